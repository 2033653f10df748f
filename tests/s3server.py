"""A real S3-compatible server for the tests (moto, over HTTP on 127.0.0.1), and a fault-injecting
HTTP proxy that sits between boto3 and it."""

from __future__ import annotations

import http.client
import random
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class MotoServer:
    """moto's threaded server, with S3's one guarantee that moto lacks: conditional writes are
    atomic. moto checks `If-None-Match: *` and then stores, unlocked, so two concurrent PutObject
    (or CompleteMultipartUpload) of one key could both succeed (seen in CI: 2 winners of 8).
    AWS S3 lets exactly one win and answers the rest 412; requests carrying `If-None-Match`
    are serialised here so that the emulator does the same. (Issue 34 moves the S3 tests to
    SeaweedFS, and asks that reg stay correct on a store where two completes can both win.)"""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        self.port = free_port()
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self._server._server_entry = self._serve  # type: ignore[method-assign]

    def _serve(self) -> None:
        from moto.moto_server.werkzeug_app import (
            DomainDispatcherApplication,
            MotoRequestHandler,
            create_backend_app,
        )
        from werkzeug.serving import make_server

        app = DomainDispatcherApplication(create_backend_app)
        conditional = threading.Lock()

        def atomic_conditional_writes(environ, start_response):  # type: ignore[no-untyped-def]
            if "HTTP_IF_NONE_MATCH" not in environ:
                return app(environ, start_response)
            with conditional:
                return list(app(environ, start_response))

        moto = self._server
        moto._server = make_server(
            "127.0.0.1",
            self.port,
            atomic_conditional_writes,
            True,
            request_handler=MotoRequestHandler,
        )
        moto._server_ready_event.set()
        moto._server.serve_forever()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> MotoServer:
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop()


class FaultyProxy:
    """Forwards requests to `upstream`; a share of them fail instead, as one of `kinds`:
    "500", "503" (SlowDown), "drop" (the connection closes before the request is forwarded),
    "lost" (the request is carried out upstream, then the connection closes before the reply:
    the client cannot tell that it succeeded), "slow" (carried out, answered after `slow_s`
    seconds) or "truncate" (carried out, the reply's headers promise the whole body but only
    the first half of it is sent before the connection closes). `by_kind` counts the faults
    injected. Bounded: it only serves the test that started it, on 127.0.0.1."""

    def __init__(
        self,
        upstream_port: int,
        fault_rate: float,
        seed: int = 0,
        kinds: tuple[str, ...] = ("500", "503", "drop", "lost"),
        slow_s: float = 0.5,
    ) -> None:
        self.upstream_port = upstream_port
        self.fault_rate = fault_rate
        self.random = random.Random(seed)
        self.slow_s = slow_s
        self.faults = 0
        self.requests = 0
        self.by_kind: dict[str, int] = {}
        self.lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _any(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                with proxy.lock:
                    proxy.requests += 1
                    roll = proxy.random.random()
                    fault = roll < proxy.fault_rate
                    kind = proxy.random.choice(kinds) if fault else ""
                    proxy.faults += fault
                    if fault:
                        proxy.by_kind[kind] = proxy.by_kind.get(kind, 0) + 1
                if kind == "drop":
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if kind in ("500", "503"):
                    code = "SlowDown" if kind == "503" else "InternalError"
                    payload = (
                        f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{code}</Code>"
                        f"<Message>injected</Message></Error>"
                    ).encode()
                    self.send_response(int(kind))
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                    return
                if kind == "slow":
                    time.sleep(proxy.slow_s)
                conn = http.client.HTTPConnection("127.0.0.1", proxy.upstream_port, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() != "host"}
                headers["Host"] = f"127.0.0.1:{proxy.upstream_port}"
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                if kind == "truncate" and (self.command == "HEAD" or not data):
                    kind = "lost"  # no body to cut short: the reply is lost instead
                if kind == "lost":  # done upstream; the client never hears of it
                    conn.close()
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                # A HEAD's reply has no body: its Content-Length is the object's size.
                length = resp.getheader("Content-Length") if self.command == "HEAD" else None
                self.send_header("Content-Length", length or str(len(data)))
                self.end_headers()
                if kind == "truncate":  # the promised length, half the bytes, then gone
                    self.wfile.write(data[: len(data) // 2])
                    self.wfile.flush()
                    conn.close()
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def start(self) -> FaultyProxy:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
