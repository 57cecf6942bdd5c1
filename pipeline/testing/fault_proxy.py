"""A threaded HTTP proxy for tests and benchmarks: fault injection and added latency.

``FaultyProxy`` forwards every request to an upstream on 127.0.0.1 (e.g. the GCS
emulator) and can

- fail a seeded fraction of requests with 503, 429 or a dropped connection, to test
  retries (``failure_rate``, ``seed``);
- hold every request for ``latency_s`` before answering it, to stand in for a real
  network round trip. The wait happens in the request's own handler thread, so
  concurrent requests wait at the same time, as they do on a network;
- forward at most ``max_upstream`` requests at a time (default: no limit). The GCS
  emulator answers one request at a time and listens with a backlog of 5, so more
  than about 5 connections opened to it at once get dropped and retried by the kernel
  a second later; queueing them here instead keeps that out of a benchmark.

Point a client at it through its ``port``; use it as a context manager::

    with FaultyProxy(upstream_port, failure_rate=0.1, seed=3) as proxy:
        os.environ["STORAGE_EMULATOR_HOST"] = f"http://127.0.0.1:{proxy.port}"
        ...
    proxy.counts  # {"forwarded": n, "503": n, "429": n, "dropped": n}
    proxy.requests  # (method, path, bytes answered) of every forwarded request

With ``failure_rate=0`` it only watches: ``requests`` shows what a client read. The
emulator's object metadata carries links to itself (``mediaLink``), which some clients
(Beam's GCS reader) download from; with ``own_links`` the proxy points those links at
itself, so no download goes around it.
"""
from __future__ import annotations

import contextlib
import http.client
import http.server
import random
import socketserver
import threading
import time

FAULTS = ("503", "429", "dropped")


class FaultyProxy:
    """Proxy to ``127.0.0.1:upstream_port``. ``counts`` says what happened to each request
    (``forwarded`` or the fault injected), ``upstream_errors`` how many forwarded ones the
    upstream failed (dropped for the client), ``connections`` how many client connections
    were opened to the proxy, ``requests`` the method, path and answered body size of
    each request the upstream answered."""

    def __init__(self, upstream_port: int, failure_rate: float = 0.1, seed: int = 0, latency_s: float = 0.0,
                 max_upstream: int | None = None, own_links: bool = False):
        self.upstream_port, self.failure_rate, self.latency_s = upstream_port, failure_rate, latency_s
        self.upstream_slots = threading.BoundedSemaphore(max_upstream) if max_upstream else contextlib.nullcontext()
        self.random = random.Random(seed)
        self.lock = threading.Lock()
        self.counts = {"forwarded": 0, **{fault: 0 for fault in FAULTS}}
        self.connections = self.upstream_errors = 0
        self.requests: list[tuple[str, str, int]] = []
        self.own_links = own_links
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # else Nagle and delayed ACKs add ~40 ms to small replies

            def log_message(self, *args):
                pass

            def setup(self):
                super().setup()
                with proxy.lock:
                    proxy.connections += 1

            def _handle(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                fault = proxy._pick_fault()
                if proxy.latency_s > 0:
                    time.sleep(proxy.latency_s)
                if fault == "dropped":
                    self.close_connection = True
                    self.connection.close()
                    return
                if fault is not None:
                    self._reply(int(fault), [("Content-Type", "application/json")],
                                b'{"error": {"code": %s, "message": "injected"}}' % fault.encode())
                    return
                try:
                    with proxy.upstream_slots:
                        response, data = self._forward(body)
                except (OSError, http.client.HTTPException):  # the client sees a dropped connection
                    with proxy.lock:
                        proxy.upstream_errors += 1
                    self.close_connection = True
                    return
                with proxy.lock:
                    proxy.requests.append((self.command, self.path, len(data)))
                headers = [(k, v) for k, v in response.getheaders()
                           if k.lower() not in ("transfer-encoding", "connection", "content-length")]
                if proxy.own_links:
                    upstream, here = (f"127.0.0.1:{port}".encode() for port in (proxy.upstream_port, proxy.port))
                    headers = [(k, v.replace(upstream.decode(), here.decode())) for k, v in headers]
                    if "json" in response.getheader("Content-Type", ""):
                        data = data.replace(upstream, here)
                self._reply(response.status, headers, data)

            def _forward(self, body: bytes):
                upstream = http.client.HTTPConnection("127.0.0.1", proxy.upstream_port, timeout=60)
                try:
                    headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
                    upstream.request(self.command, self.path, body=body or None, headers=headers)
                    response = upstream.getresponse()
                    data = response.read()
                finally:
                    upstream.close()
                return response, data

            def _reply(self, status: int, headers: list[tuple[str, str]], data: bytes):
                self.send_response(status)
                for key, value in headers:
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _handle

        class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
            daemon_threads = True
            request_queue_size = 128  # the default 5 drops connects when many clients open at once

        self.server = Server(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def _pick_fault(self) -> str | None:
        with self.lock:
            if self.random.random() >= self.failure_rate:
                self.counts["forwarded"] += 1
                return None
            fault = self.random.choice(FAULTS)
            self.counts[fault] += 1
            return fault

    def __enter__(self) -> "FaultyProxy":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
