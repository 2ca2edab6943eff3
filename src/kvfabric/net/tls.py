"""TLS for kvfabric's own TCP servers and their clients (the P2P chunk transfer; the controller through uvicorn).

Contract:
- `TLSFiles(cert, key, ca, require_client_cert)`: PEM paths from config (`cluster.tls`). Empty `cert`: no TLS.
- `server_context(files)`: TLS 1.2+ with the certificate and key; with `require_client_cert`, clients must show a
  certificate that `ca` signed (mTLS). `client_context(files)`: verifies the server against `ca` (the system's
  roots when empty) with hostname checks (an IP address is checked against the certificate's IP SANs); presents
  `cert` / `key` as its own certificate when given (for a server that requires one). A file that is missing or not
  PEM is `TLSConfigError`, one line naming it.
- `handshake_error(exc)`: the one line a refused handshake is reported with (the reason OpenSSL gives: "certificate
  verify failed: certificate has expired", "wrong version number" for a plain-text peer ...).
- `check_exposure(host, tls, insecure, what)`: a server bound beyond loopback without TLS refuses to start
  (`TLSConfigError`) unless `insecure`, and then logs one warning: tokens and chunks cross the network in clear.
- `self_signed(folder)`: a throw-away certificate for 127.0.0.1 and its key (for benchmarks: `bench p2p --tls`);
  needs `cryptography` (the `security` extra).
"""
from __future__ import annotations

import ipaddress
import logging
import ssl
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)


class TLSConfigError(ValueError):
    """TLS cannot be set up as configured (a missing or unreadable file, plain text beyond loopback)."""


@dataclass(frozen=True, slots=True)
class TLSFiles:
    cert: str = ""
    key: str = ""
    ca: str = ""
    require_client_cert: bool = False

    @property
    def is_enabled(self) -> bool:
        return bool(self.cert)

    @classmethod
    def of(cls, section) -> TLSFiles:
        """From a config section with the same four fields (config.TLSConfig: `cluster.tls`)."""
        return cls(section.cert, section.key, section.ca, section.require_client_cert)


def _load(ctx: ssl.SSLContext, files: TLSFiles, *, own_cert: bool) -> ssl.SSLContext:
    try:
        if own_cert and files.cert:
            ctx.load_cert_chain(files.cert, files.key or None)
        if files.ca:
            ctx.load_verify_locations(cafile=files.ca)
    except (OSError, ssl.SSLError) as exc:
        what = getattr(exc, "filename", None) or f"{files.cert} / {files.key} / {files.ca}"
        raise TLSConfigError(f"TLS: cannot load {what}: {getattr(exc, 'strerror', None) or exc}") from None
    return ctx


def server_context(files: TLSFiles) -> ssl.SSLContext | None:
    if not files.is_enabled:
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if files.require_client_cert:
        if not files.ca:
            raise TLSConfigError("TLS: require_client_cert needs a ca to check client certificates against")
        ctx.verify_mode = ssl.CERT_REQUIRED
    return _load(ctx, files, own_cert=True)


def client_context(files: TLSFiles) -> ssl.SSLContext | None:
    if not files.is_enabled and not files.ca:
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # verifies the server and its name by default
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if not files.ca:
        ctx.load_default_certs()
    return _load(ctx, files, own_cert=True)


def self_signed(folder: Path, days: int = 1) -> TLSFiles:
    """A self-signed certificate for 127.0.0.1 / localhost (its own CA) and its key, written 0600 into folder."""
    import datetime as dt

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvfabric self-signed")])
    now = dt.datetime.now(dt.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                                                        x509.DNSName("localhost")]), critical=False)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = folder / "self-signed.pem", folder / "self-signed.key"
    for path, data in ((cert_path, cert.public_bytes(serialization.Encoding.PEM)),
                       (key_path, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                    serialization.NoEncryption()))):
        path.write_bytes(data)
        path.chmod(0o600)
    return TLSFiles(str(cert_path), str(key_path), str(cert_path))


def handshake_error(exc: BaseException) -> str:
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"certificate verify failed: {exc.verify_message}"
    if isinstance(exc, ssl.SSLError):
        return (exc.reason or str(exc)).lower().replace("_", " ")
    return str(exc) or type(exc).__name__


def is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_exposure(host: str, tls: bool, insecure: bool, what: str) -> None:
    if tls or is_loopback(host):
        return
    if not insecure:
        raise TLSConfigError(f"{what} binds {host}, beyond loopback, without TLS: set cluster.tls.cert and "
                             f"cluster.tls.key (or insecure: true to accept plain text on this network)")
    log.warning("kvfabric: %s binds %s without TLS (insecure: true): its token and chunks cross the network in "
                "clear", what, host)
