"""A real HTTP receiver on 127.0.0.1 for the webhook tests: it records every POST (headers and
body) and answers as told: 204, an error status, a redirect, or not at all (it hangs)."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: str
    at: float
    hung: bool = False  # held past the sender's deadline: the sender saw no reply

    @property
    def doc(self) -> dict[str, Any]:
        return json.loads(self.body)  # type: ignore[no-any-return]


@dataclass
class Receiver:
    port: int = 0
    status: int = 204
    hang_s: float = 0.0
    location: str | None = None
    received: list[Received] = field(default_factory=list)
    _server: ThreadingHTTPServer | None = None

    def start(self) -> Receiver:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                size = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(size).decode()
                self.close_connection = True
                hung = receiver.hang_s
                if hung:
                    time.sleep(hung)
                receiver.received.append(
                    Received(self.path, dict(self.headers.items()), body, time.time(), bool(hung))
                )
                try:
                    self.send_response(receiver.status)
                    if receiver.location:
                        self.send_header("Location", receiver.location)
                    self.send_header("Content-Length", "17")
                    self.end_headers()
                    self.wfile.write(b"secret reply body")
                except OSError:
                    pass  # the sender gave up on a hung reply

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    def events(self) -> list[str]:
        return [r.doc["event"] for r in self.received]

    def wait_for(self, count: int, timeout: float = 60.0) -> list[Received]:
        """Until `count` distinct event ids arrived (or the timeout)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if len({r.doc["id"] for r in self.received}) >= count:
                return self.received
            time.sleep(0.1)
        raise AssertionError(f"{len(self.received)} deliveries, not {count}: {self.events()}")
