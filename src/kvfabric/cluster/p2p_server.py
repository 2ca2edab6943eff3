"""Peer-to-peer chunk transfer, server side: a threaded TCP server that serves chunks from local tiers.

`PeerServer`:
- Binds 127.0.0.1 unless told otherwise; binding elsewhere needs a token, and TLS (`tls`, an ssl server context
  from kvfabric.net.tls) unless `insecure` (then a logged warning). With TLS every connection's handshake runs on its
  own thread within `io_timeout_s`; a refused one (a client with the wrong CA or an expired certificate, a
  plain-text client) is one logged line and counted (`tls_refused`), and the server keeps serving. A chunk kept
  as a file goes out through TLS as read blocks, not sendfile. At most `max_connections`
  connections are served at once (one thread each; extra ones get ERROR 503 and are closed).
- A connection waits at most `idle_timeout_s` for the next request and `io_timeout_s` for the rest of a frame;
  any protocol violation (bad magic, oversize or truncated body, bad token) gets an ERROR frame and the
  connection is closed. Nothing a client sends can raise out of the server or stop it.
- GET: each key is read from the served tiers (or the one named); blobs go out as they are stored, with
  scatter-gather writes (no copy in user space); chunks kept as files (`Tier.file_of`) go out with sendfile. A key
  no tier holds (or a tier that raises) gives Status.MISSING and `on_missing(key)` is called (the worker then
  corrects what the controller believes).
- CONTROL: the JSON message goes to the `control` callback; its dict (or {"ok": false, "error": ...}) is the
  REPLY.
Threads rather than asyncio: tier reads block (files), and a blocking `sendmsg` of the stored blob sends it
without first copying it into a transport buffer.

The client side is `p2p_client`.
"""
from __future__ import annotations

import hmac
import logging
import os
import socket
import ssl
import threading
import time
from collections.abc import Callable, Sequence

from kvfabric.cluster import protocol as p
from kvfabric.codec.format import fill_checksums
from kvfabric.net.framing import no_delay, recv_into, send_all
from kvfabric.net.tls import check_exposure, handshake_error, is_loopback
from kvfabric.observe.counters import Counters
from kvfabric.tiers.base import Blob, Tier

log = logging.getLogger(__name__)
FILE_BLOCK = 4 << 20  # a chunk file read and sent in blocks of this size through TLS (sendfile cannot encrypt)


class PeerServer:
    def __init__(self, tiers: Sequence[Tier], *, token: str | None = None, host: str = "127.0.0.1", port: int = 0,
                 control: Callable[[dict], dict] | None = None, on_missing: Callable[[bytes], None] | None = None,
                 max_connections: int = 64, io_timeout_s: float = 10.0, idle_timeout_s: float = 60.0,
                 max_keys: int = p.MAX_KEYS, max_request_bytes: int = p.MAX_REQUEST_BYTES,
                 tls: ssl.SSLContext | None = None, insecure: bool = False) -> None:
        if not token and not is_loopback(host):
            raise ValueError(f"the peer server binds {host!r}, beyond loopback: a token is required")
        check_exposure(host, tls is not None, insecure, "the peer server")
        self.tls = tls
        self.tiers = list(tiers)
        self._token = token.encode() if token else None
        self.control = control
        self.on_missing = on_missing
        self.max_keys = min(max_keys, p.MAX_KEYS)
        self.max_request_bytes = max_request_bytes
        self.io_timeout_s = io_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self._slots = threading.BoundedSemaphore(max_connections)
        self._closing = threading.Event()
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self.counters = Counters({"requests": 0, "chunks_sent": 0, "bytes_sent": 0, "missing": 0,
                                         "errors": 0, "rejected": 0, "sendfile": 0, "tls_refused": 0})
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self._sock.listen(128)
        self._sock.settimeout(0.2)  # the accept loop checks for close() this often
        self.host, self.port = self._sock.getsockname()[:2]
        self._thread = threading.Thread(target=self._accept_loop, name="kvfabric-p2p-accept", daemon=True)

    def start(self) -> PeerServer:
        self._thread.start()
        return self

    # ---- connections ---------------------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while not self._closing.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._closing.is_set():
                    return
                time.sleep(0.05)  # e.g. out of file descriptors: back off, keep serving
                continue
            no_delay(conn)
            if not self._slots.acquire(blocking=False):
                self.counters.add("rejected")
                self._reject(conn, 503, "too many connections")
                continue
            with self._lock:
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="kvfabric-p2p-conn", daemon=True).start()

    def _reject(self, conn: socket.socket, code: int, message: str) -> None:
        try:
            conn.settimeout(1.0)
            conn.sendall(p.encode_error(code, message))
        except OSError:
            pass
        finally:
            conn.close()

    def _handshake(self, conn: socket.socket) -> socket.socket | None:
        """The connection wrapped in TLS, or None after a refused handshake (logged and counted)."""
        assert self.tls is not None
        try:
            conn.settimeout(self.io_timeout_s)
            wrapped = self.tls.wrap_socket(conn, server_side=True)
        except (ssl.SSLError, OSError) as exc:
            self.counters.add("tls_refused")
            log.warning("peer server: TLS handshake refused: %s", handshake_error(exc))
            return None
        with self._lock:
            self._conns.discard(conn)
            self._conns.add(wrapped)
        return wrapped

    def _serve(self, conn: socket.socket) -> None:
        try:
            if self.tls is not None:
                wrapped = self._handshake(conn)
                if wrapped is None:
                    return
                conn = wrapped
            while not self._closing.is_set():
                try:
                    kind, _, length = p.recv_header(conn, self.idle_timeout_s)
                except OSError:  # closed between requests (framing.PeerClosed is one), or idle too long
                    return
                except p.ProtocolError as exc:
                    self.counters.add("errors")
                    conn.settimeout(1.0)
                    conn.sendall(p.encode_error(400, str(exc)))
                    return
                if kind not in (p.FrameType.GET, p.FrameType.CONTROL):
                    self.counters.add("errors")
                    conn.sendall(p.encode_error(400, f"unexpected frame {kind.name}"))
                    return
                if length > self.max_request_bytes:
                    self.counters.add("errors")
                    conn.sendall(p.encode_error(413, f"request of {length} bytes is over {self.max_request_bytes}"))
                    return
                body = bytearray(length)
                recv_into(conn, memoryview(body), self.io_timeout_s,
                             time.monotonic() + self.io_timeout_s)
                self.counters.add("requests")
                try:
                    if kind == p.FrameType.GET:
                        ok = self._get(conn, body)
                    else:
                        ok = self._control(conn, body)
                except p.ProtocolError as exc:
                    self.counters.add("errors")
                    conn.sendall(p.encode_error(400, str(exc)))
                    return
                if not ok:
                    return
        except OSError:
            pass  # the client went away or stalled: drop the connection
        except Exception:  # never let a handler bug take the server down
            log.exception("peer connection failed")
            self.counters.add("errors")
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()
            self._slots.release()

    def _authorized(self, token: bytes) -> bool:
        return self._token is None or hmac.compare_digest(token, self._token)

    # ---- requests ------------------------------------------------------------------------------------------
    def _get(self, conn: socket.socket, body: bytearray) -> bool:
        token, tier_name, keys = p.decode_get(body)
        if not self._authorized(token):
            self.counters.add("errors")
            conn.sendall(p.encode_error(401, "bad token"))
            return False
        if len(keys) > self.max_keys:
            conn.sendall(p.encode_error(413, f"at most {self.max_keys} keys per request"))
            return False
        tiers = [t for t in self.tiers if not tier_name or t.name == tier_name]
        conn.settimeout(self.io_timeout_s)
        for key in keys:
            if self._send_file(conn, tiers, key):
                continue
            blob = self._read(tiers, key)
            if blob is None:
                self.counters.add("missing")
                conn.sendall(p.pack_header(p.FrameType.CHUNK, p.KEY_BYTES, p.Status.MISSING) + key)
                if self.on_missing is not None:
                    try:
                        self.on_missing(key)
                    except Exception:
                        log.exception("on_missing callback failed")
                continue
            send_all(conn, [p.pack_header(p.FrameType.CHUNK, p.KEY_BYTES + len(blob), p.Status.OK), key, blob])
            with self._lock:
                self.counters.add("chunks_sent")
                self.counters.add("bytes_sent", len(blob))
        conn.sendall(p.pack_header(p.FrameType.END, 4) + len(keys).to_bytes(4, "little"))
        return True

    def _send_file(self, conn: socket.socket, tiers: Sequence[Tier], key: bytes) -> bool:
        """Serve a chunk kept as a file (`file_of`) with sendfile: no copy through this process, no buffer to
        allocate. Only when no faster tier before it holds the key. True if sent."""
        for tier in tiers:
            path = tier.file_of(key)
            if path is None:
                if tier.contains_many([key])[0]:
                    return False  # a tier without files has it: the normal path
                continue
            try:
                f = open(path, "rb")
            except OSError:
                continue
            with f:
                size = os.fstat(f.fileno()).st_size
                if size == 0:
                    continue
                conn.sendall(p.pack_header(p.FrameType.CHUNK, p.KEY_BYTES + size, p.Status.OK) + key)
                # socket.sendfile: os.sendfile, waiting within the socket's timeout when its buffer is full.
                # The file is immutable once renamed into place (the disk tier's contract).
                if self.tls is not None:
                    self._send_blocks(conn, f, size)
                elif conn.sendfile(f, 0, size) != size:
                    raise ConnectionError("file shrank while being sent")  # the client sees a failure
            with self._lock:
                self.counters.add("chunks_sent")
                self.counters.add("bytes_sent", size)
                self.counters.add("sendfile")
            return True
        return False

    @staticmethod
    def _send_blocks(conn: socket.socket, f, size: int) -> None:
        """A file through TLS: read into one reused block, encrypted and sent from there (socket.sendfile on a
        TLS socket would fall back to 8 KiB sends)."""
        block = memoryview(bytearray(min(size, FILE_BLOCK)))
        left = size
        while left:
            n = f.readinto(block[:min(left, len(block))])
            if not n:
                raise ConnectionError("file shrank while being sent")
            conn.sendall(block[:n])
            left -= n

    @staticmethod
    def _read(tiers: Sequence[Tier], key: bytes) -> Blob | None:
        for tier in tiers:
            try:
                blob = tier.get(key)
            except Exception:
                log.exception("tier %s failed to read a chunk", tier.name)
                continue
            if blob is not None:
                if tier.is_trusted:
                    fill_checksums(blob)  # process memory may hold unsealed blobs (codec.format)
                return blob
        return None

    def _control(self, conn: socket.socket, body: bytearray) -> bool:
        token, message = p.decode_control(body)
        if not self._authorized(token):
            self.counters.add("errors")
            conn.sendall(p.encode_error(401, "bad token"))
            return False
        if self.control is None:
            reply = {"ok": False, "error": "no control handler"}
        else:
            try:
                reply = self.control(message)
            except Exception as exc:
                log.exception("control message failed")
                reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        data = p.encode_json(reply)
        conn.settimeout(self.io_timeout_s)
        conn.sendall(p.pack_header(p.FrameType.REPLY, len(data)) + data)
        return True

    def close(self) -> None:
        if self._closing.is_set():
            return
        self._closing.set()
        if self._thread.is_alive():
            self._thread.join()
        self._sock.close()
        with self._lock:
            conns = list(self._conns)
        for conn in conns:  # wake handlers blocked in recv
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
