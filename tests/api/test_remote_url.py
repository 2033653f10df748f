"""A plain http:// REG_URL to a host that is not loopback would send the bearer token in
cleartext: refused before any connection (exit 2, one line) unless REG_ALLOW_HTTP=1 or
`allow_http = true` in config.toml says it is meant, as an http JWKS URL is refused by
`reg server`. Loopback (localhost, 127.0.0.0/8, ::1) stays allowed."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest

from registry.core.config import Settings, loopback_url
from registry.errors import UsageError

REMOTE = ("http://10.1.2.3:8080", "http://reg.example.com", "http://[fd00::1]:8080")


def _one_line(res: Any) -> str:
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("reg: "), res.stderr
    assert "Traceback" not in res.stderr
    return str(lines[0])


def test_which_hosts_are_loopback() -> None:
    for url in (
        "http://localhost:8080",
        "http://LOCALHOST",
        "http://127.0.0.1:1",
        "http://127.8.9.10/x",
        "http://[::1]:8080",
        "http://[::ffff:127.0.0.1]:8080",
    ):
        assert loopback_url(url), url
    # Judged by the text, never resolved: a name is not loopback whatever it resolves to.
    for url in (*REMOTE, "http://localhost.example.com", "http://127.0.0.1.nip.io", "http://[::"):
        assert not loopback_url(url), url


def test_http_to_another_host_is_refused_before_any_connection(
    cli: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for url in REMOTE:
        res = cli("ls", env={"REG_URL": url, "REG_TOKEN": "reg_a_b"})
        assert res.returncode == 2, (url, res.stderr)
        line = _one_line(res)
        assert "plain http would send the bearer token in cleartext" in line
        assert "use https://" in line and "REG_ALLOW_HTTP=1" in line
    login = cli("login", "http://10.1.2.3:8080", "--token-stdin", "--json")
    assert login.returncode == 2 and "cleartext" in _one_line(login)
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "config.toml").write_text('url = "http://10.1.2.3:8080"\n')
    res = cli("ls", env={"REG_HOME": str(tmp_path / "home"), "REG_TOKEN": "reg_a_b"})
    assert res.returncode == 2 and "cleartext" in _one_line(res)

    # In this process: the refusal comes before a name is resolved or a socket connects.
    calls: list[Any] = []

    def no_network(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        raise AssertionError("a network call was attempted")

    from registry import Registry

    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    for url in REMOTE:
        env = {"REG_HOME": str(tmp_path / "h"), "REG_URL": url, "REG_TOKEN": "reg_a_b"}
        with pytest.raises(UsageError, match="plain http") as raised:
            Registry(Settings.from_env(env))
        assert raised.value.exit_code == 2
    assert calls == []


def _loopback_by_another_name() -> str:
    """A host name that resolves to this machine's loopback but is not loopback by its text
    (the machine's own name in /etc/hosts, usually)."""
    for name in (socket.gethostname(), "localhost.localdomain"):
        try:
            address = socket.gethostbyname(name)
        except OSError:
            continue
        if address.startswith("127.") and not loopback_url(f"http://{name}"):
            return name
    pytest.skip("no host name of this machine resolves to 127.0.0.0/8")


def test_the_setting_lets_http_through(cli: Any, reg_server: Any, tmp_path: Path) -> None:
    url = f"http://{_loopback_by_another_name()}:{reg_server.port}"
    token = reg_server.token("vera")
    refused = cli("whoami", env={"REG_URL": url, "REG_TOKEN": token})
    assert refused.returncode == 2 and "cleartext" in _one_line(refused)
    allowed = cli("whoami", env={"REG_URL": url, "REG_TOKEN": token, "REG_ALLOW_HTTP": "1"})
    assert allowed.returncode == 0 and allowed.stdout.strip() == "vera", allowed.stderr
    # The same in config.toml; the environment wins over the file, either way.
    home = tmp_path / "home"
    home.mkdir()
    (home / "config.toml").write_text(f'url = "{url}"\nallow_http = true\n')
    env = {"REG_HOME": str(home), "REG_URL": "", "REG_TOKEN": token}
    assert cli("whoami", env=env).stdout.strip() == "vera"
    res = cli("whoami", env={**env, "REG_ALLOW_HTTP": "0"})
    assert res.returncode == 2 and "cleartext" in _one_line(res)
    res = cli("whoami", env={**env, "REG_ALLOW_HTTP": "maybe"})
    assert res.returncode == 2 and "REG_ALLOW_HTTP is 'maybe'" in _one_line(res)
    # Loopback by its text needs no setting (the tests' own servers are on 127.0.0.1).
    assert cli("whoami", env={"REG_TOKEN": token}).returncode == 0
