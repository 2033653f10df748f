"""Webhooks against a real HTTP receiver on 127.0.0.1: every event arrives once per
id, signed, even across a receiver outage; where the server may send; the secret file's rules;
the admin commands. The server's side (a hanging receiver) is in
tests/lifecycle/test_release_workflow_server.py."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from policies.loader import parse_policy
from registry import Registry
from registry.core.config import Settings
from registry.errors import PolicyError, UsageError
from registry.integrations.webhooks import net
from registry.trust.webhook_signatures import read_secret, signature, verify
from tests.webhook_receiver import Receiver

CPU = '[promotion]\nrequire_device = "any"\n'
EVERY_EVENT = [
    "checkpoint.committed",
    "checkpoint.committed",
    "validation.recorded",
    "release.promoted",
    "alias.requested",
    "alias.approved",
    "alias.moved",
    "validation.recorded",
    "release.promoted",
    "alias.requested",
    "alias.rejected",
    "release.deprecated",
    "release.yanked",
    "checkpoint.deleted",
]


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    path = tmp_path / "webhook.secret"
    path.write_text(os.urandom(24).hex() + "\n")
    path.chmod(0o600)
    return path


@pytest.fixture
def receiver():  # type: ignore[no-untyped-def]
    r = Receiver().start()
    yield r
    r.stop()


def hook_policy(url: str, secret: Path, events: str = '["*"]', extra: str = "") -> str:
    return (
        CPU
        + '[retention]\nkeep_last = 1\nttl = "0s"\n'
        + '[[protected_aliases]]\nalias = "prod"\napprovers = ["role:releaser"]\n'
        + f'[[webhooks]]\nname = "deploy"\nurl = "{url}"\nevents = {events}\n'
        + f'secret_file = "{secret}"\nallow_private = true\n'
        + extra
    )


def use_policy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    path = tmp_path / "policy.toml"
    path.write_text(text)
    monkeypatch.setenv("REG_POLICY", str(path))


def as_user(name: str) -> Registry:
    return Registry(Settings.from_env(), user=name)


def deliver_until(count: int, receiver: Receiver, timeout: float = 60.0) -> None:
    """Run deliveries (as `reg webhook deliver` does) until `count` distinct ids arrived."""
    deadline = time.monotonic() + timeout
    while len({r.doc["id"] for r in receiver.received}) < count:
        assert time.monotonic() < deadline, receiver.events()
        with as_user("ops") as ops:
            ops.deliver_webhooks(2.0)
        time.sleep(0.2)


def test_every_event_arrives_once_signed_across_an_outage(
    ckpts, receiver: Receiver, secret: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    use_policy(tmp_path, monkeypatch, hook_policy(receiver.url, secret))
    with as_user("alice") as alice:
        alice.push_checkpoint(ckpts.ws2.step_dir(2), run="r", step=2)
        alice.push_checkpoint(ckpts.ws2.step_dir(4), run="r", step=4)
        first = alice.promote("r@step4", model="tiny", alias="prod").alias_request
        assert first is not None
    with as_user("bob") as bob:
        assert bob.approve(first["request"]).moved
    deliver_until(7, receiver)
    port = receiver.port
    receiver.stop()  # down for the rest of the run
    with as_user("alice") as alice:
        alice.promote("r@step2", model="tiny")
        second = alice.set_alias("tiny", "prod", "v2")
    with as_user("carol") as carol:
        carol.reject(second.request, "not yet")
        carol.deprecate("tiny:v1", "superseded")
        carol.yank("tiny:v2", "bad data")
        assert [d["ref"] for d in carol.gc()["decisions"] if d["action"] == "delete"] == ["r@step2"]
        carol.deliver_webhooks(1.0)
        failing = carol.webhook_deliveries(status="pending")
        assert failing and all(d.last_error for d in failing if d.attempts)
        assert not any("secret reply body" in (d.last_error or "") for d in failing)
    back = Receiver(port=port).start()  # the receiver returns: it catches up
    try:
        deliver_until(len(EVERY_EVENT) - 7, back)
        received = receiver.received + back.received
    finally:
        back.stop()
    ids = [r.doc["id"] for r in received]
    assert len(ids) == len(set(ids)) == len(EVERY_EVENT)  # once per id
    assert sorted(r.doc["event"] for r in received) == sorted(EVERY_EVENT)
    key = secret.read_bytes().strip()
    for r in received:
        assert r.headers["Content-Type"] == "application/json"
        assert r.headers["X-Reg-Delivery"] == r.doc["id"]
        assert r.doc["schema"] == "reg.webhook/1" and r.path == "/hook"
        assert verify(key, r.headers["X-Reg-Signature"], r.body, now=time.time())
    moved = next(r for r in received if r.doc["event"] == "alias.moved")
    assert moved.doc["data"] == {
        "model": "tiny",
        "alias": "prod",
        "version": 1,
        "previous": None,
        "request": first["request"],
        "requested_by": "alice",
        "approved_by": ["bob"],
    }
    # What a receiver can tell: a replay (an old timestamp), a body changed or re-signed.
    header = moved.headers["X-Reg-Signature"]
    assert not verify(key, header, moved.body, now=time.time() + 3600)
    assert not verify(key, header, moved.body.replace('"prod"', '"canary"'), now=time.time())
    forged = signature(b"not-the-secret-but-long-enough", int(time.time()), moved.body)
    assert not verify(key, forged, moved.body, now=time.time())
    with as_user("ops") as ops:
        listed = ops.webhook_deliveries(limit=100)
        assert {d.status for d in listed} == {"delivered"} and len(listed) == len(EVERY_EVENT)
        assert max(d.attempts for d in listed) > 1  # the outage's were retried


def test_a_new_subscriber_gets_only_what_happens_after_it_and_only_its_events(
    ckpts, receiver: Receiver, secret: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    use_policy(tmp_path, monkeypatch, CPU)
    with as_user("alice") as alice:
        alice.push_checkpoint(ckpts.ws2.step_dir(2), run="r", step=2)
    text = hook_policy(receiver.url, secret, events='["release.promoted"]')
    use_policy(tmp_path, monkeypatch, text)
    with as_user("ops") as ops:
        assert ops.deliver_webhooks(1.0).delivered == 0  # the subscriber starts here
    with as_user("alice") as alice:
        alice.push_checkpoint(ckpts.ws2.step_dir(4), run="r", step=4)
        alice.promote("r@step4", model="tiny")
    deliver_until(1, receiver)
    time.sleep(0.5)
    assert receiver.events() == ["release.promoted"]
    assert receiver.received[0].doc["data"]["release"] == "tiny:v1"


def test_where_the_server_may_send(receiver: Receiver):
    body, headers = b"{}", {"Content-Type": "application/json"}
    for url, private, why in (
        ("https://169.254.169.254/latest/meta-data", True, "link-local or a cloud metadata"),
        ("http://[fd00:ec2::254]/", True, "cloud metadata"),
        ("https://100.100.100.200/", True, "cloud metadata"),
        ("https://[2002:a9fe:a9fe::]/", True, "carries 169.254.169.254"),  # 6to4
        ("https://[::ffff:169.254.169.254]/", True, "cloud metadata"),
        ("https://[fec0::1]/", False, "site-local"),
        (receiver.url, False, "must be https"),
        ("https://127.0.0.1/x", False, "allowed only with allow_private"),
        ("https://localhost:9/x", False, "resolves to 127.0.0.1 is a loopback"),
        ("https://user:pw@example.com/", True, "carries credentials"),
        ("ftp://example.com/", True, "must be https"),
    ):
        with pytest.raises(net.SendError, match=why):
            net.post(url, body, headers, allow_private=private)
    assert not receiver.received
    elsewhere = Receiver().start()
    try:
        receiver.status, receiver.location = 302, elsewhere.url
        with pytest.raises(net.SendError, match="HTTP 302: redirects are not followed"):
            net.post(receiver.url, body, headers, allow_private=True)
        assert len(receiver.received) == 1 and not elsewhere.received
    finally:
        elsewhere.stop()
    receiver.status, receiver.location, receiver.hang_s = 204, None, 5.0
    started = time.monotonic()
    with pytest.raises(net.SendError, match="no reply within 1 s"):
        net.post(receiver.url, body, headers, allow_private=True, deadline_s=1.0)
    assert time.monotonic() - started < 3.0


def test_the_secret_file_is_the_servers_alone(tmp_path: Path):
    path = tmp_path / "s"
    path.write_text("x" * 40)
    path.chmod(0o644)
    with pytest.raises(UsageError, match="readable by others"):
        read_secret(str(path))
    path.chmod(0o600)
    assert read_secret(str(path)) == b"x" * 40
    path.write_text("short\n")
    with pytest.raises(UsageError, match="holds 5 bytes"):
        read_secret(str(path))
    link = tmp_path / "link"
    link.symlink_to(path)
    with pytest.raises(UsageError, match="secret file"):
        read_secret(str(link))
    with pytest.raises(UsageError, match="No such file"):
        read_secret(str(tmp_path / "missing"))
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    started = time.monotonic()
    with pytest.raises(UsageError, match="not a regular file"):
        read_secret(str(fifo))  # never blocks on a FIFO planted there
    assert time.monotonic() - started < 1.0


def test_bad_webhook_entries_are_refused(tmp_path: Path):
    base = '[[webhooks]]\nname = "d"\nevents = ["*"]\nsecret_file = "/etc/reg/s"\n'
    for extra, why in (
        ('url = "http://deploy.internal/"\n', "must be https"),
        ('url = "https://169.254.169.254/"\nallow_private = true\n', "never allowed"),
        ('url = "https://a:b@x.internal/"\n', "carries credentials"),
        ('url = "https://x.internal/"\nevents2 = 1\n', "Extra inputs"),
    ):
        with pytest.raises(PolicyError, match=why):
            parse_policy(base + extra)
    with pytest.raises(PolicyError, match="unknown event 'release.moved'"):
        parse_policy(base.replace('["*"]', '["release.moved"]') + 'url = "https://x/"\n')
    with pytest.raises(PolicyError, match="absolute path"):
        parse_policy(base.replace("/etc/reg/s", "s") + 'url = "https://x/"\n')
    twice = base + 'url = "https://x/"\n'
    with pytest.raises(PolicyError, match="two webhooks are named 'd'"):
        parse_policy(twice + twice)


def test_the_webhook_commands(
    cli, receiver: Receiver, secret: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    use_policy(tmp_path, monkeypatch, hook_policy(receiver.url, secret))
    res = cli("webhook", "test", "deploy", "--json")
    assert res.returncode == 0, res.stderr
    tested = json.loads(res.stdout)
    assert tested["ok"] and tested["status"] == 204
    ping = receiver.received[0]
    assert ping.doc["event"] == "ping" and ping.doc["id"] == tested["event_id"]
    assert verify(
        secret.read_bytes().strip(), ping.headers["X-Reg-Signature"], ping.body, now=time.time()
    )
    receiver.status = 500
    res = cli("webhook", "test", "deploy")
    assert res.returncode == 1 and "HTTP 500" in res.stdout
    assert "secret reply body" not in res.stdout + res.stderr
    res = cli("webhook", "test", "nope")
    assert res.returncode == 3 and "no webhook named 'nope'" in res.stderr
    listed = json.loads(cli("webhook", "ls", "--json").stdout)
    assert [(w["name"], w["secret_ok"], w["url"]) for w in listed] == [
        ("deploy", True, receiver.url)
    ]
    secret.chmod(0o640)
    res = cli("webhook", "ls")
    assert res.returncode == 0 and "readable by others" in res.stdout
    res = cli("webhook", "deliveries", "--status", "lost")
    assert res.returncode == 2 and "unknown status" in res.stderr
    audit = [e["action"] for e in Registry().audit_log()]
    assert audit.count("webhook-test") == 2  # an unknown name is refused before it


def test_the_documented_receiver_example_checks_what_reg_signs():
    page = Path(__file__).resolve().parents[2] / "docs" / "how-to" / "release-workflow.md"
    after = page.read_text().split("A receiver checks it so:", 1)[1]
    code = after.split("```python\n", 1)[1].split("```", 1)[0]
    space: dict[str, object] = {}
    exec(code, space)
    verified = space["verified"]
    secret, body = b"s" * 32, '{"id":"evt_1","event":"ping"}'
    header = signature(secret, int(time.time()), body)
    seen: set[str] = set()
    assert verified(secret, header, body.encode(), seen)  # type: ignore[operator]
    assert not verified(secret, header, body.encode(), seen)  # type: ignore[operator]  # repeat
    other: set[str] = set()
    assert not verified(b"t" * 32, header, body.encode(), other)  # type: ignore[operator]
    old = signature(secret, int(time.time()) - 3600, body)
    assert not verified(secret, old, body.encode(), other)  # type: ignore[operator]


def test_applying_a_policy_names_a_subscriber_whose_secret_is_unusable(tmp_path: Path):
    policy = tmp_path / "p.toml"
    policy.write_text(hook_policy("https://deploy.example/hook", tmp_path / "absent"))
    with Registry() as reg:
        applied = reg.apply_policy(policy)
    assert any("webhook deploy: secret file" in w for w in applied["warnings"]), applied
