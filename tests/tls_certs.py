"""Real X.509 certificates for the TLS tests, made with `cryptography`: a CA, certificates it signs (a server's for
127.0.0.1, an expired one, a client's), and a second CA that signed none of them."""
from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from ipaddress import ip_address
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from kvfabric.net.tls import TLSFiles


@dataclass(frozen=True)
class Certs:
    ca: Path
    other_ca: Path
    server: TLSFiles  # cert, key, ca (to check clients)
    expired: TLSFiles
    client: TLSFiles  # a client certificate the CA signed, and the CA to check the server


def _key(path: Path) -> ec.EllipticCurvePrivateKey:
    key = ec.generate_private_key(ec.SECP256R1())
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    path.chmod(0o600)
    return key


def _cert(path: Path, name: str, key, issuer_key, issuer_name: x509.Name | None, *, is_ca: bool = False,
          days: tuple[int, int] = (-1, 30)) -> x509.Name:
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = dt.datetime.now(dt.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer_name or subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now + dt.timedelta(days=days[0])).not_valid_after(now + dt.timedelta(days=days[1]))
               .add_extension(x509.BasicConstraints(ca=is_ca, path_length=None), critical=True))
    if is_ca:
        builder = builder.add_extension(x509.KeyUsage(True, False, False, False, False, True, True, False, False),
                                        critical=True)
    else:
        builder = builder.add_extension(x509.SubjectAlternativeName([x509.IPAddress(ip_address("127.0.0.1")),
                                                                     x509.DNSName("localhost")]), critical=False)
    path.write_bytes(builder.sign(issuer_key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM))
    return subject


def make_certs(folder: Path) -> Certs:
    folder.mkdir(parents=True, exist_ok=True)
    ca_key = _key(folder / "ca.key")
    ca_name = _cert(folder / "ca.pem", "kvfabric test CA", ca_key, ca_key, None, is_ca=True)
    other_key = _key(folder / "other-ca.key")
    _cert(folder / "other-ca.pem", "another CA", other_key, other_key, None, is_ca=True)
    made = {}
    for name, days in (("server", (-1, 30)), ("expired", (-30, -1)), ("client", (-1, 30))):
        key = _key(folder / f"{name}.key")
        _cert(folder / f"{name}.pem", f"kvfabric {name}", key, ca_key, ca_name, days=days)
        made[name] = TLSFiles(str(folder / f"{name}.pem"), str(folder / f"{name}.key"), str(folder / "ca.pem"))
    return Certs(folder / "ca.pem", folder / "other-ca.pem", made["server"], made["expired"], made["client"])
