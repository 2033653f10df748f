"""A public-facing `reg server` holds under abuse: connections that send their
headers one line at a time are cut off, the number of connections stays below the descriptor
limit, and a normal client and the audit sealer keep working meanwhile."""

from __future__ import annotations

import contextlib
import json
import socket
import time

import httpx
import pytest

from tests.serverproc import RegServer, server_env

SLOW = 380  # slowloris connections, as in the report: the server's limit is 400 descriptors
NOFILE = 400


def _slow_connection(port: int) -> socket.socket | None:
    s = socket.socket()
    s.settimeout(2)
    try:
        s.connect(("127.0.0.1", port))
        s.sendall(b"GET /v1/checkpoints HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    except OSError:
        s.close()
        return None
    return s


def _open(s: socket.socket) -> bool:
    """Still held open by the server: one more header line goes through and nothing came back
    (the server answers a slow request nothing; it closes it)."""
    try:
        s.setblocking(False)
        try:
            if s.recv(1024) == b"":
                return False  # closed by the server
            return False  # answered (a 503 at the limit): not held either
        except BlockingIOError:
            pass
        s.sendall(b"X-Slow: 1\r\n")
        return True
    except OSError:
        return False


@pytest.mark.process  # reg server
def test_slow_connections_are_cut_while_a_normal_client_and_the_sealer_keep_working(tmp_path):
    home = tmp_path / "server-home"
    env = server_env(home, f"sqlite:///{home / 'catalog.db'}")
    env.update(REG_SERVER_HEADER_TIMEOUT="4", REG_AUDIT_SEAL_EVERY="1s")
    server = RegServer(env, home).init().start(nofile=NOFILE)
    slow: list[socket.socket] = []
    try:
        admin = server.token("admin")
        token = server.token("vera")
        slow = [s for s in (_slow_connection(server.port) for _ in range(SLOW)) if s]
        assert len(slow) > 300  # the connects themselves succeed (the kernel's backlog)
        served = 0
        with httpx.Client(base_url=server.url, timeout=10) as client:
            for _ in range(12):  # 6 s: past the header deadline
                headers = {"authorization": f"Bearer {token}", "connection": "close"}
                r = client.get("/v1/checkpoints", headers=headers)
                assert r.status_code == 200, r.text
                r = client.post("/v1/gc", json={"dry_run": True}, headers=headers)
                assert r.status_code == 403, r.text  # a denial: an audit event to seal
                served += 2
                for s in slow:  # one header line a round, as slowloris does
                    _open(s)
                time.sleep(0.5)
        assert served == 24
        # Every slow connection is gone: cut at its deadline, or evicted for a real client.
        held = sum(_open(s) for s in slow)
        assert held == 0, f"{held} slow connections still held after the header deadline"
        log = server.log_text()
        assert "Too many open files" not in log and "sealing failed" not in log, log[-3000:]
        assert '"connections": "closed"' in log
        sealed_after = [
            json.loads(line)
            for line in log.splitlines()
            if '"audit": "sealed"' in line and json.loads(line).get("seals")
        ]
        assert sealed_after, "the sealer sealed nothing during the flood"
        for _ in range(40):  # the flood's last events are sealed within a second or two
            verified = httpx.post(
                f"{server.url}/v1/audit/verify",
                params={"max_unsealed_age": 30},
                headers={"authorization": f"Bearer {admin}"},
                timeout=30,
            ).json()
            if verified["unsealed"] == 0:
                break
            time.sleep(0.5)
        assert verified["ok"] and verified["unsealed"] == 0, verified
    finally:
        for s in slow:
            with contextlib.suppress(OSError):
                s.close()
        server.stop()


@pytest.mark.parametrize(
    ("name", "value"),
    [("REG_SERVER_HEADER_TIMEOUT", "soon"), ("REG_SERVER_HEADER_TIMEOUT", "0"),
     ("REG_SERVER_MAX_CONNECTIONS", "-1")],
)  # fmt: skip
def test_a_bad_connection_setting_stops_the_start_in_one_line(cli, tmp_path, name, value):
    home = tmp_path / "server-home"
    server = RegServer(server_env(home, f"sqlite:///{home / 'catalog.db'}"), home).init()
    res = cli("server", "--port", str(server.port), env={**server.env, name: value}, timeout=60)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and name in lines[0], res.stderr
