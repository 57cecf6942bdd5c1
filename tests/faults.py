"""A fault-injecting HTTP proxy for tests: forwards to an upstream on 127.0.0.1 and
fails a seeded fraction of requests with 503, 429 or a dropped connection."""
import http.client
import http.server
import random
import socketserver
import threading


class FaultyProxy:
    def __init__(self, upstream_port: int, failure_rate: float = 0.1, seed: int = 0):
        self.upstream_port, self.failure_rate = upstream_port, failure_rate
        self.random = random.Random(seed)
        self.lock = threading.Lock()
        self.counts = {"forwarded": 0, "503": 0, "429": 0, "dropped": 0}
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _handle(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                fault = proxy._pick_fault()
                if fault == "dropped":
                    self.close_connection = True
                    self.connection.close()
                    return
                if fault in ("503", "429"):
                    payload = b'{"error": {"code": %s, "message": "injected"}}' % fault.encode()
                    self.send_response(int(fault))
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                    return
                upstream = http.client.HTTPConnection("127.0.0.1", proxy.upstream_port, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
                upstream.request(self.command, self.path, body=body or None, headers=headers)
                response = upstream.getresponse()
                data = response.read()
                self.send_response(response.status)
                for key, value in response.getheaders():
                    if key.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(key, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                upstream.close()

            do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _handle

        class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
            daemon_threads = True

        self.server = Server(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def _pick_fault(self):
        with self.lock:
            if self.random.random() >= self.failure_rate:
                self.counts["forwarded"] += 1
                return None
            fault = self.random.choice(["503", "429", "dropped"])
            self.counts[fault] += 1
            return fault

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()
