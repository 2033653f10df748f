"""`reg server` in a subprocess for tests: real uvicorn on 127.0.0.1, a free port, its own
REG_HOME; bootstrapped with `reg server init --admin admin` and the test's policy."""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.zygote import Child, zygote

ROOT = Path(__file__).resolve().parent.parent
CPU_POLICY = ROOT / "examples" / "cpu-policy.toml"

# Who is who in the server tests (grants of TEAM_POLICY).
TEAM_GRANTS = """
[[access.grants]]
principals = ["admin"]
role = "admin"

[[access.grants]]
principals = ["alice"]
role = "trainer"
projects = ["team-a"]

[[access.grants]]
principals = ["bob"]
role = "trainer"
projects = ["team-b"]

[[access.grants]]
principals = ["rel"]
role = "releaser"
projects = ["team-a"]
models = ["tiny-*"]

[[access.grants]]
principals = ["vera"]
role = "viewer"

[[access.grants]]
principals = ["val"]
role = "validator"
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_env(home: Path, catalog_url: str, store_url: str | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("REG_", "AWS_"))}
    env.update(
        REG_HOME=str(home),
        REG_CATALOG_URL=catalog_url,
        REG_MLFLOW="off",
        REG_POLICY=str(CPU_POLICY),
        REG_USER="operator",
    )
    if store_url:
        env["REG_STORE_URL"] = store_url
    return env


@dataclass
class RegServer:
    env: dict[str, str]
    home: Path
    port: int = field(default_factory=free_port)
    admin_token: str = ""
    proc: Child | None = None
    log: Path | None = None
    tokens: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def init(self) -> RegServer:
        out = zygote().run(
            ["server", "init", "--admin", "admin", "--json"], env=self.env, cwd=ROOT, timeout=120
        )
        assert out.returncode == 0, out.stderr
        self.admin_token = json.loads(out.stdout)["token"]
        self.tokens["admin"] = self.admin_token
        return self

    def start(self, *extra: str, nofile: int | None = None) -> RegServer:
        """Start it; `nofile`: its descriptor limit (set before its first connection, as a
        systemd unit's LimitNOFILE would). A port another process took between `free_port`
        and the server's bind (seen in CI: "address already in use") is traded for a fresh one,
        twice at most."""
        for _ in range(2):
            try:
                return self._start(*extra, nofile=nofile)
            except AssertionError as exc:
                if "address already in use" not in str(exc):
                    raise
                self.port = free_port()
        return self._start(*extra, nofile=nofile)

    def _start(self, *extra: str, nofile: int | None = None) -> RegServer:
        self.home.mkdir(parents=True, exist_ok=True)
        self.log = self.home / f"server-{self.port}.log"
        self.log.touch()
        self.proc = zygote().spawn(
            ["server", "--port", str(self.port), *extra],
            env=self.env,
            cwd=ROOT,
            stdout=self.log,
            stderr=self.log,
        )
        if nofile is not None:
            import resource

            resource.prlimit(self.proc.pid, resource.RLIMIT_NOFILE, (nofile, nofile))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"reg server exited: {self.log.read_text()[-2000:]}")
            try:
                if httpx.get(f"{self.url}/readyz", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"reg server did not become ready: {self.log.read_text()[-2000:]}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        code = self.proc.wait(timeout=timeout)
        self.proc = None
        return code

    def client_env(self, who: str = "admin") -> dict[str, str]:
        """The environment of a client acting as `who` (a token of theirs)."""
        return {"REG_URL": self.url, "REG_TOKEN": self.token(who)}

    def token(self, who: str) -> str:
        if who not in self.tokens:
            self.tokens[who] = self.call("admin", "POST", "/v1/tokens", json={"principal": who})[
                "token"
            ]
        return self.tokens[who]

    def call(self, who: str, method: str, path: str, **kw: Any) -> Any:
        r = httpx.request(
            method,
            self.url + path,
            headers={"authorization": f"Bearer {self.token(who)}"},
            timeout=60,
            **kw,
        )
        assert r.status_code < 400, r.text
        return r.json()

    def apply_policy(self, text: str, who: str = "admin") -> Any:
        return self.call(who, "POST", "/v1/policy", json={"text": text, "name": "test policy"})

    def log_text(self) -> str:
        return self.log.read_text() if self.log else ""


def team_policy(extra: str = "") -> str:
    return CPU_POLICY.read_text() + TEAM_GRANTS + extra


@dataclass
class Deployment:
    """How a test's commands reach the registry: embedded (server None) or through a server."""

    server: RegServer | None

    @property
    def remote(self) -> bool:
        return self.server is not None

    def direct(self) -> Any:
        """An embedded Registry over the registry's own catalog and store."""
        from registry import Registry
        from registry.core.config import Settings

        if self.server is None:
            return Registry()
        return Registry(Settings.from_env(self.server.env))
