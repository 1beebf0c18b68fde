"""A loopback HTTP server for the demo source: real downloads without the internet.

Routes: /img/NAME serves www/img/NAME; /robots.txt serves www/robots.txt when there is one (else
404: everything allowed); /status/404/NAME and /status/500/NAME answer with that status; /slow/NAME
waits `slow_seconds` before answering (longer than ingest's timeout). HEAD answers as GET does,
without the body. It binds
127.0.0.1 on a free port, runs in a daemon thread, and is a context manager so it always stops.
"""
from __future__ import annotations

import mimetypes
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


class _Handler(BaseHTTPRequestHandler):
    root: Path
    slow_seconds: float
    stop_event: threading.Event

    def log_message(self, *args):  # the demo makes thousands of requests; keep the terminal readable
        pass

    head = False

    def do_HEAD(self):
        self.head = True
        self.do_GET()

    def do_GET(self):
        parts = self.path.lstrip("/").split("/")
        if parts == ["robots.txt"] and (self.root / "robots.txt").is_file():
            self._send(200, (self.root / "robots.txt").read_bytes(), "text/plain")
            return
        if parts[0] == "status" and len(parts) == 3:
            self._send(int(parts[1]), b"error", "text/plain")
            return
        if parts[0] == "slow" and len(parts) == 2:
            self.stop_event.wait(self.slow_seconds)
            parts = ["img", parts[1]]
        if parts[0] == "img" and len(parts) == 2 and "/" not in parts[1] and not parts[1].startswith("."):
            path = self.root / "img" / parts[1]
            if path.is_file():
                data = path.read_bytes()
                ctype = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
                if data[:6] == b"<html>":
                    ctype = "text/html"
                self._send(200, data, ctype)
                return
        self._send(404, b"not found", "text/plain")

    def _send(self, status: int, body: bytes, ctype: str):
        try:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if not self.head:
                self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up (a timeout): expected for /slow


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256   # listen() backlog: 16 download threads per shard task, several tasks at once


class DemoServer:
    def __init__(self, root: Path, slow_seconds: float = 6.0, port: int = 0, log=None):
        self.port, self.log = port, log
        self.root = Path(root)
        self.slow_seconds = slow_seconds
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    @property
    def base_url(self) -> str:
        assert self._server is not None, "server not started"
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    @property
    def netloc(self) -> str:
        return self.base_url.split("://", 1)[1]

    def __enter__(self) -> "DemoServer":
        handler = type("Handler", (_Handler,), {
            "root": self.root, "slow_seconds": self.slow_seconds, "stop_event": self._stop})
        try:   # a fixed port keeps the fetched URLs (in the ledger and the shards' json) the same every run
            self._server = _Server(("127.0.0.1", self.port), handler)
        except OSError as err:
            if not self.port:
                raise
            self._server = _Server(("127.0.0.1", 0), handler)
            if self.log:
                self.log(f"ingest: port {self.port} is busy ({err.strerror}); serving on "
                         f"{self._server.server_address[1]}, so this run's URLs (and shard json) name that port")
        self._thread = threading.Thread(target=self._server.serve_forever, name="capline-demo-server",
                                        daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()  # release /slow handlers at once
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
