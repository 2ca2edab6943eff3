"""P2P over TLS with real certificates (tests/tls_certs.py): chunks arrive intact, from memory and from chunk files;
a client with the wrong CA, a plain-text client, an expired server certificate and a missing client certificate
(mTLS) are each refused with a clear error while the server keeps serving; a server beyond loopback without TLS
refuses to start unless `insecure`."""
from __future__ import annotations

import logging
import socket

import pytest

from kvfabric.cluster import protocol as p
from kvfabric.cluster.p2p_client import PeerClient, PeerError
from kvfabric.cluster.p2p_server import PeerServer
from kvfabric.net.tls import TLSConfigError, TLSFiles, check_exposure, client_context, server_context
from kvfabric.tiers.cpu import CpuTier
from kvfabric.tiers.disk import DiskTier
from tests.cluster_scripts.helpers import key, make_blob, wait_for
from tests.tls_certs import make_certs

TOKEN = "t0ken"


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture
def tiers(tmp_path):
    cpu, disk = CpuTier(1 << 24), DiskTier(tmp_path / "disk", 1 << 24)
    cpu.put(key(0), make_blob(key(0), seed=0))
    disk.put(key(1), make_blob(key(1), seed=1, num_tokens=512))  # served from its file: blocks through TLS
    return cpu, disk


def serve(tiers, files: TLSFiles) -> PeerServer:
    return PeerServer(list(tiers), token=TOKEN, io_timeout_s=2.0, tls=server_context(files)).start()


def fetch(srv: PeerServer, files: TLSFiles | None, keys=(key(0), key(1))) -> dict:
    client = PeerClient(srv.host, srv.port, TOKEN, connect_timeout_s=2.0,
                        tls=client_context(files) if files is not None else None)
    try:
        return client.fetch_all(list(keys))
    finally:
        client.close()


def intact(got: dict) -> bool:
    return got == {key(0): make_blob(key(0), seed=0), key(1): make_blob(key(1), seed=1, num_tokens=512)}


def test_chunks_cross_tls_intact_from_memory_and_from_files(certs, tiers):
    srv = serve(tiers, certs.server)
    try:
        assert intact(fetch(srv, TLSFiles(ca=str(certs.ca))))
        assert srv.counters["chunks_sent"] == 2 and srv.counters["tls_refused"] == 0
    finally:
        srv.close()


@pytest.mark.parametrize("case", ["wrong CA", "plain text", "expired certificate"])
def test_refused_with_a_clear_error_and_the_server_keeps_serving(certs, tiers, case, caplog):
    files = certs.expired if case == "expired certificate" else certs.server
    srv = serve(tiers, files)
    try:
        with pytest.raises(PeerError) as refused:
            fetch(srv, {"wrong CA": TLSFiles(ca=str(certs.other_ca)), "plain text": None,
                        "expired certificate": TLSFiles(ca=str(certs.ca))}[case])
        message = str(refused.value)
        if case == "wrong CA":
            assert "refused: certificate verify failed" in message
        elif case == "expired certificate":
            assert "certificate verify failed: certificate has expired" in message
        else:
            assert f"{srv.host}:{srv.port}" in message
        assert wait_for(lambda: srv.counters["tls_refused"] == 1, 5.0)  # logged and counted on the server side
        assert any("TLS handshake refused" in r.getMessage() for r in caplog.records)
        if case != "expired certificate":
            assert intact(fetch(srv, TLSFiles(ca=str(certs.ca))))  # still serving
    finally:
        srv.close()


def test_mutual_tls_requires_a_client_certificate_from_the_ca(certs, tiers):
    required = TLSFiles(certs.server.cert, certs.server.key, str(certs.ca), require_client_cert=True)
    srv = serve(tiers, required)
    try:
        with pytest.raises(PeerError, match="TLS handshake|failed"):
            fetch(srv, TLSFiles(ca=str(certs.ca)))  # no certificate of its own
        assert intact(fetch(srv, certs.client))
    finally:
        srv.close()


def test_a_plain_text_frame_gets_no_answer_from_a_tls_server(certs, tiers):
    srv = serve(tiers, certs.server)
    try:
        with socket.create_connection((srv.host, srv.port), timeout=2.0) as raw:
            request = p.encode_get(TOKEN, [key(0)], "")
            raw.sendall(p.pack_header(p.FrameType.GET, len(request)) + request)
            try:
                reply = raw.recv(65536)
            except ConnectionResetError:
                reply = b""
            assert not reply.startswith(p.MAGIC)  # a TLS alert, a close or a reset, never a frame
        assert wait_for(lambda: srv.counters["tls_refused"] == 1, 5.0) and srv.counters["requests"] == 0
    finally:
        srv.close()


def test_beyond_loopback_needs_tls_or_insecure(certs, tiers, caplog):
    with pytest.raises(TLSConfigError, match="without TLS"):
        PeerServer(list(tiers), token=TOKEN, host="0.0.0.0")
    with caplog.at_level(logging.WARNING, logger="kvfabric.net.tls"):
        PeerServer(list(tiers), token=TOKEN, host="0.0.0.0", insecure=True).close()
    assert any("in clear" in r.getMessage() for r in caplog.records)
    PeerServer(list(tiers), token=TOKEN, host="0.0.0.0", tls=server_context(certs.server)).close()
    check_exposure("127.0.0.1", False, False, "a loopback server")  # loopback: plain text is fine


def test_a_missing_certificate_file_is_one_line(tmp_path):
    with pytest.raises(TLSConfigError, match="cannot load") as missing:
        server_context(TLSFiles(str(tmp_path / "nope.pem"), str(tmp_path / "nope.key")))
    assert "\n" not in str(missing.value)


def test_a_fleet_fetches_chunks_over_mutual_tls(certs, tmp_path):
    """Two engines with tier "peer" and cluster.tls (mTLS on): B's retrieve of A's prompt crosses TLS, bit-exact."""
    import torch

    from kvfabric.cache.builder import build_engine
    from kvfabric.cluster.controller_app import create_app
    from kvfabric.cluster.index_memory import MemoryIndex
    from kvfabric.config import ClusterConfig, Config, CpuTierConfig, TLSConfig
    from tests.cluster_scripts.helpers import LAYOUT, ControllerThread

    controller = ControllerThread(create_app(MemoryIndex(), token=TOKEN, sweep_interval_s=0.2)).start()
    tls = TLSConfig(certs.server.cert, certs.server.key, str(certs.ca), require_client_cert=True)
    engines = []
    try:
        for name in ("a", "b"):
            config = Config(chunk_size=16, tiers=("cpu", "peer"), cpu=CpuTierConfig(capacity=1 << 24),
                            cluster=ClusterConfig(controller_url=controller.url, token=TOKEN, instance_id=name,
                                                  report_interval_s=0.05, lookup_ttl_s=0.0, tls=tls))
            engines.append(build_engine(config, LAYOUT, "test-model"))
        a, b = engines
        tokens = list(range(64))
        data = torch.randn(LAYOUT.shape(64), generator=torch.Generator().manual_seed(3))
        assert a.store(tokens, data) == 4
        a.flush()
        assert a.node.flush_reports() and b.node.flush_reports()
        assert torch.equal(b.retrieve(tokens), data)
        assert b.stats().counters["hit.peer"] == 4 and a.node.server.counters["tls_refused"] == 0
        # the server counts a chunk once its bytes are out, and the client may use the last chunk before that
        wait_for(lambda: a.node.server.counters["chunks_sent"] == 4, timeout_s=10)
        assert a.node.server.tls is not None and a.node.server.counters["chunks_sent"] == 4
    finally:
        for engine in engines:
            engine.close()
        controller.stop()


@pytest.mark.slow
def test_the_controller_serves_https_and_refuses_plain_text_beyond_loopback(certs, tmp_path):
    import subprocess
    import sys

    from kvfabric.cluster.client import ControllerClient, ControllerError
    from tests.cluster_scripts.helpers import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kvfabric.cluster.controller", "--port", str(port),
                             "--tls-cert", certs.server.cert, "--tls-key", certs.server.key])
    good = ControllerClient(f"https://127.0.0.1:{port}", tls=client_context(TLSFiles(ca=str(certs.ca))))
    bad = ControllerClient(f"https://127.0.0.1:{port}", tls=client_context(TLSFiles(ca=str(certs.other_ca))))
    try:
        def healthy():
            try:
                return good.health()
            except ControllerError:
                return None
        assert wait_for(healthy, 30.0)
        with pytest.raises(ControllerError, match="CERTIFICATE_VERIFY_FAILED|certificate verify failed"):
            bad.health()
        assert good.health()  # still serving
    finally:
        good.close()
        bad.close()
        proc.terminate()
        proc.wait(10)
    token = tmp_path / "token"
    token.write_text("t")
    done = subprocess.run([sys.executable, "-m", "kvfabric.cluster.controller", "--host", "0.0.0.0", "--port",
                           str(free_port()), "--token-file", str(token)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "without TLS" in done.stderr and len(done.stderr.strip().splitlines()) == 1
