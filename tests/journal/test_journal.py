"""Losing the catalog loses no decisions: the journal under `journal/` and its replay
by `reg catalog rebuild`."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest

from registry import Registry
from registry.core.layout import JOURNAL, journal_key
from registry.journal.event import MAX_BYTES, parse, sign
from registry.trust.audit_chain import keys
from tests.helpers import PG_URL

POLICY = """
[promotion]
require_device = "any"

[retention]
keep_last = 1
ttl = "0s"

[[access.grants]]
principals = ["tester"]
role = "admin"

[[access.grants]]
principals = ["alice"]
role = "trainer"
projects = ["team-a"]
"""


def lose_catalog(url: str) -> None:
    """The catalog is gone: the SQLite file, or the test's own PostgreSQL schema (dropped and
    made again empty; no other schema or database is touched)."""
    if url.startswith("sqlite"):
        path = Path(url.removeprefix("sqlite:///"))
        for suffix in ("", "-wal", "-shm"):
            Path(f"{path}{suffix}").unlink(missing_ok=True)
        return
    import psycopg

    options = unquote(urlparse(url).query).removeprefix("options=-csearch_path=")
    assert options.startswith("t_") and options.isidentifier(), options
    with psycopg.connect(PG_URL.replace("+psycopg", ""), autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA {options} CASCADE")
        conn.execute(f"CREATE SCHEMA {options}")


def journal_keys(reg: Registry) -> list[str]:
    return [o.key for o in reg.store.list(JOURNAL)]


def tree(path: Path) -> dict[str, str]:
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


def rebuild(cli) -> dict:  # type: ignore[no-untyped-def,type-arg]
    res = cli("catalog", "rebuild", "--json")
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)  # type: ignore[no-any-return]


def test_drill_every_decision_survives_the_catalog(
    catalog_url, cpu_policy, ckpts, tmp_path, cli, monkeypatch
):
    policy = tmp_path / "team.toml"
    policy.write_text(POLICY)
    with Registry() as reg:
        for step in (2, 4):
            reg.push_checkpoint(ckpts.ws2.step_dir(step), run="r", step=step, project="team-a")
        checked = reg.validate("team-a/r@step4", device="cpu")
        assert checked["passed"]
        reg.promote("team-a/r@step2", model="tiny")
        v2 = reg.promote("team-a/r@step4", model="tiny")
        assert v2["validation"]["id"] == checked["validation_id"]
        reg.set_alias("tiny", "prod", 2)
        reg.set_alias("tiny", "canary", 1)
        reg.set_alias("tiny", "canary", 2)
        reg.yank("tiny:v1", reason="bad eval")
        reg.pin("team-a/r@step2", reason="the paper's numbers")
        reg.pin("team-a/r@step4", reason="for a while")
        reg.unpin("team-a/r@step4")
        reg.deprecate("tiny:v2")
        reg.pull_release("tiny:v2", tmp_path / "before")
        history = reg.show("tiny:v2")["alias_history"]
    assert cli("policy", "apply", str(policy)).returncode == 0
    monkeypatch.delenv("REG_POLICY")
    yanked = cli("pull-release", "tiny:v1", str(tmp_path / "y0"))
    assert yanked.returncode == 5, yanked.stderr
    assert cli("policy", "show", env={"REG_USER": "mallory"}).returncode == 4
    with Registry() as reg:
        written = journal_keys(reg)
        kinds = sorted(parse(reg.store.get_bytes(k), k).kind for k in written)
    assert kinds == sorted(
        ["validation"] * 2 + ["alias"] * 3 + ["yank", "pin", "pin", "unpin", "deprecate", "policy"]
    ), kinds  # promote ran step2's validation itself

    lose_catalog(catalog_url)
    single_user = cli("policy", "show", env={"REG_USER": "mallory"})
    assert single_user.returncode == 0  # no policy applied: everyone is admin, for now
    out = rebuild(cli)
    assert out["releases_added"] == ["tiny:v1", "tiny:v2"]
    assert out["events_replayed"] == {
        "alias": 3,
        "deprecate": 1,
        "pin": 1,
        "policy": 1,
        "validation": 2,
        "yank": 1,
    }
    # step4: pinned, then unpinned: the unpin is applied (it was unpinned anyway), the pin
    # superseded by it
    assert out["events_current"] == {"unpin": 1}
    assert out["events_superseded"] == {"pin": 1}
    assert out["events_unsigned"] == 9  # no audit key: every replayed event is trusted
    assert out["events_skipped"] == [] and out["events_aborted"] == 0
    assert out["not_recoverable"] == "the audit log lives only in the catalog"

    # grants hold: a principal without one is denied, one with one is not
    denied = cli("policy", "show", env={"REG_USER": "mallory"})
    assert denied.returncode == 4, denied.stderr
    assert cli("ls", env={"REG_USER": "alice"}).returncode == 0
    # the yanked release stays unpullable, the active one pulls bit-exact, aliases resolve
    again = cli("pull-release", "tiny:v1", str(tmp_path / "y1"))
    assert again.returncode == 5 and "yanked: bad eval" in again.stderr
    assert cli("pull-release", "tiny@prod", str(tmp_path / "after")).returncode == 0
    assert tree(tmp_path / "after") == tree(tmp_path / "before")
    with Registry() as reg:
        assert journal_keys(reg) == written  # replaying wrote no new events
        shown = reg.show("tiny@canary")
        assert shown["version"] == 2 and set(shown["aliases"]) == {"canary", "prod"}
        assert shown["alias_history"] == history
        # the validation is back: linked to v2, and the promotion gate takes it (no new one)
        assert shown["validation"]["passed"] and shown["validation"]["device"] == "cpu"
        step4 = reg.show("team-a/r@step4")
        pinned = reg.show("team-a/r@step2")
        assert pinned["pinned"] and pinned["pin_reason"] == "the paper's numbers"
        assert not step4["pinned"] and shown["status"] == "deprecated"
        other = reg.promote("team-a/r@step4", model="tiny-copy")
        assert other["validation"]["id"] == shown["validation"]["id"]
        assert len(journal_keys(reg)) == len(written)  # no validation ran, none recorded
        # the pin holds: GC under the replayed policy (keep_last 1, ttl 0s) keeps step2
        plan = {d["ref"]: d for d in reg.gc()["decisions"]}
        assert plan["team-a/r@step2"]["action"] == "keep", plan
        assert "pinned" in plan["team-a/r@step2"]["reason"]
        assert reg.show("team-a/r@step2")["state"] == "committed"
    assert step4["step"] == 4

    # a second rebuild changes nothing
    twice = rebuild(cli)
    assert twice["checkpoints_added"] == [] and twice["releases_added"] == []
    assert twice["events_replayed"] == {}
    assert twice["events_current"] == {
        "alias": 3,
        "deprecate": 1,
        "pin": 2,
        "policy": 1,
        "unpin": 1,
        "validation": 2,
        "yank": 1,
    }
    # and the store and the rebuilt catalog agree, byte for byte
    fsck = cli("fsck", "--full", "--json")
    assert fsck.returncode == 0, fsck.stdout + fsck.stderr
    assert json.loads(fsck.stdout)["problems"] == []
    human = cli("catalog", "rebuild")
    assert "replayed 0 decision(s); 11 already in the catalog; 0 superseded; 0 aborted" in (
        human.stdout
    )


def test_unsigned_and_forged_events_are_refused_with_a_key(ckpts, cli, clean_env):
    key_path = clean_env / "audit.key"
    assert keys.create(key_path)
    key = keys.read(key_path)
    with Registry() as reg:
        reg.push_checkpoint(ckpts.ws2.step_dir(2), run="r", step=2)
        reg.push_checkpoint(ckpts.ws2.step_dir(4), run="r", step=4)
        reg.pin("r@step2", reason="keep")
        (genuine,) = journal_keys(reg)
        event = parse(reg.store.get_bytes(genuine), genuine)
        assert event.key_id == keys.key_id(key) and event.mac is not None
        body = dict(event.body())
        # an unpin nobody signed, a pin whose content was changed after signing, and one
        # signed under another key
        unsigned = dict(body, id=f"{2 * 10**18:020d}-{'a' * 32}", kind="unpin", fact={})
        unsigned.update(key_id=None)
        altered = dict(
            body, id=f"{2 * 10**18 + 1:020d}-{'b' * 32}", target=dict(body["target"], step=4)
        )
        other = b"\x01" * 32
        alien = dict(body, id=f"{2 * 10**18 + 2:020d}-{'c' * 32}", key_id=keys.key_id(other))
        for doc, mac in (
            (unsigned, None),
            (altered, event.mac),
            (alien, sign(alien, other)),
        ):
            ns, uid = doc["id"].split("-")
            raw = json.dumps(doc | {"mac": mac}).encode()
            reg.store.put_bytes(journal_key(int(ns), uid), raw)
        home = reg.settings.home
    lose_catalog(f"sqlite:///{home / 'catalog.db'}")
    out = rebuild(cli)
    assert out["events_replayed"] == {"pin": 1}
    reasons = sorted(s["reason"] for s in out["events_skipped"])
    assert len(reasons) == 3
    assert "unsigned, and this registry has an audit key" in reasons
    assert "its signature does not match its content (forged or altered)" in reasons
    assert any(r.startswith("signed with another key") for r in reasons)
    with Registry() as reg:
        assert reg.show("r@step2")["pinned"]  # the forged unpin was not taken
        assert not reg.show("r@step4")["pinned"]  # nor the altered pin


def test_malformed_events_are_skipped_and_reported(cli, tmp_path, clean_env):
    policy = tmp_path / "p.toml"
    policy.write_text(POLICY)
    assert cli("policy", "apply", str(policy)).returncode == 0
    with Registry() as reg:
        (genuine,) = journal_keys(reg)
        good = json.loads(reg.store.get_bytes(genuine))
        ids = [f"{10**18 + n:020d}-{n:032x}" for n in range(6)]
        bad = [
            b"{nope",
            b'{"format": "reg.event/1", "format": "reg.event/1"}',
            json.dumps(dict(good, id=ids[2], ts=float("nan"))).encode(),
            b" " * (MAX_BYTES + 1),
            json.dumps(dict(good, id=ids[4], kind="grant-everyone")).encode(),
            b"[]",
        ]
        for ident, data in zip(ids, bad, strict=True):
            ns, uid = ident.split("-")
            reg.store.put_bytes(journal_key(int(ns), uid), data)
        reg.store.put_bytes("journal/elsewhere.json", json.dumps(good).encode())
        reg.store.put_bytes(  # a genuine event copied under another name (moved in time)
            journal_key(10**18 + 99, "f" * 32), json.dumps(good).encode()
        )
    lose_catalog(f"sqlite:///{clean_env / 'catalog.db'}")
    out = rebuild(cli)
    assert out["events_replayed"] == {"policy": 1}
    reasons = " | ".join(s["reason"] for s in out["events_skipped"])
    assert len(out["events_skipped"]) == len(bad) + 2, reasons
    for text in (
        "not JSON",
        "appears twice",
        "NaN is not a finite number",
        f"over {MAX_BYTES}: not read",
        "kind is 'grant-everyone'",
        "is not a JSON object",
        "not where a journal event is kept",
        "not the name it is stored under",
    ):
        assert text in reasons, text
    human = cli("catalog", "rebuild")
    assert human.returncode == 0 and "Traceback" not in human.stderr
    assert "not where a journal event is kept" in human.stderr
    assert cli("policy", "show", env={"REG_USER": "mallory"}).returncode == 4


def test_a_failed_catalog_commit_is_not_resurrected(cli, tmp_path, clean_env, monkeypatch):
    from sqlmodel import Session

    from registry.errors import RegistryError

    first, second = tmp_path / "a.toml", tmp_path / "b.toml"
    first.write_text(POLICY)
    second.write_text(POLICY.replace('"alice"', '"alice", "mallory"'))
    with Registry() as reg:
        reg.apply_policy(first)
    from registry.operations import policy_admin

    real_commit, real_record = Session.commit, policy_admin.journal_record
    armed = []

    def record(*args, **kwargs):  # type: ignore[no-untyped-def]
        written = real_record(*args, **kwargs)
        armed.append(written)  # the event is in the store; now the commit fails
        return written

    def commit(self):  # type: ignore[no-untyped-def]
        if armed:
            armed.clear()
            raise RegistryError("the catalog went away", "retry")
        return real_commit(self)

    monkeypatch.setattr(policy_admin, "journal_record", record)
    monkeypatch.setattr(Session, "commit", commit)
    with Registry() as reg, pytest.raises(RegistryError, match="went away"):
        reg.apply_policy(second)
    monkeypatch.setattr(Session, "commit", real_commit)
    monkeypatch.setattr(policy_admin, "journal_record", real_record)
    with Registry() as reg:
        kinds = [parse(reg.store.get_bytes(k), k).kind for k in journal_keys(reg)]
        assert kinds == ["policy", "policy", "aborted"]
    lose_catalog(f"sqlite:///{clean_env / 'catalog.db'}")
    out = rebuild(cli)
    assert out["events_replayed"] == {"policy": 1} and out["events_aborted"] == 1
    assert (
        cli("policy", "show", env={"REG_USER": "mallory"}).returncode == 4
    )  # b.toml never took effect
    with Registry() as reg:
        assert reg.policy.text == POLICY


def test_the_server_signs_what_it_journals_and_refuses_what_it_did_not(reg_server, cli):
    """Behind `reg server` the server writes the journal, signed with its audit key; an event
    put into the store by anyone else (store credentials, no key) is not replayed."""
    from registry.core.config import Settings
    from registry.journal.event import signature_problem

    with Registry(Settings.from_env(reg_server.env)) as direct:
        # `reg server init`'s policy (its admin grant), then the fixture's team policy
        key = keys.read(direct.settings.audit_key_path)
        events = [parse(direct.store.get_bytes(k), k) for k in journal_keys(direct)]
        assert [(e.kind, e.target, e.actor) for e in events] == [
            ("policy", {"version": 1}, "admin"),
            ("policy", {"version": 2}, "admin"),
        ]
        assert all(signature_problem(e, key) is None for e in events)
        event = events[-1]
        forged = dict(
            event.body(),
            id=f"{event.id[:-32]}{'e' * 32}",
            target={"version": 3},
            fact={"text": POLICY, "sha256": hashlib.sha256(POLICY.encode()).hexdigest()},
            key_id=None,
        )
        ns, uid = forged["id"].split("-")
        direct.store.put_bytes(
            journal_key(int(ns), uid), json.dumps(forged | {"mac": None}).encode()
        )
    out = rebuild(cli)
    assert out["events_current"] == {"policy": 2} and out["events_replayed"] == {}
    (skipped,) = out["events_skipped"]
    assert skipped["reason"] == "unsigned, and this registry has an audit key"
    shown = json.loads(cli("policy", "show", "--json").stdout)
    assert shown["source"].startswith("catalog policy v2")


def test_an_event_reads_back_as_signed():
    """The MAC is checked over the event as stored: whole numbers where floats are read still
    verify; a reason may be empty; an aborted event must name an event id."""
    from dataclasses import replace

    from registry.errors import InvalidDocument
    from registry.journal.event import Event, signature_problem

    key = b"\x07" * 32
    fact = {
        "validation_id": 3,
        "passed": True,
        "device": "cpu",
        "device_name": "",
        "torch_version": "2.13.0",
        "world_size": 1,
        "seconds": 2,
        "phases": {"load": 1},
        "checks": [{"name": "finite", "passed": True, "detail": {"n": [1, 2]}}],
        "attested": False,
        "model_path": "",
        "mode": "streamed",
        "driver": None,
    }
    target = {"project": "default", "run": "r", "step": 0}
    made = Event(f"{10**18:020d}-{'0' * 32}", "validation", 1, "a", target, fact, keys.key_id(key))
    made = replace(made, mac=sign(made.body(), key))
    back = parse(made.to_bytes(), made.key)
    assert signature_problem(back, key) is None
    assert back.fact["phases"] == {"load": 1.0} and back.fact["seconds"] == 2.0
    pin = Event(f"{10**18 + 1:020d}-{'1' * 32}", "pin", 1.5, "a", target, {"reason": ""})
    assert parse(pin.to_bytes(), pin.key).fact == {"reason": ""}
    aborted = Event(
        f"{10**18 + 2:020d}-{'2' * 32}", "aborted", 2.0, "a", {"event": "9" * 40}, {"error": ""}
    )
    with pytest.raises(InvalidDocument, match="target.event is '9999"):
        parse(aborted.to_bytes(), aborted.key)


def test_the_journal_on_s3(s3_env, cli, tmp_path, clean_env):
    policy = tmp_path / "p.toml"
    policy.write_text(POLICY)
    assert cli("policy", "apply", str(policy)).returncode == 0
    with Registry() as reg:
        (written,) = journal_keys(reg)
        assert reg.store.describe(written).startswith(s3_env)
    lose_catalog(f"sqlite:///{clean_env / 'catalog.db'}")
    assert rebuild(cli)["events_replayed"] == {"policy": 1}
    assert cli("policy", "show", env={"REG_USER": "mallory"}).returncode == 4


def test_backfill_journals_what_an_older_registry_decided(
    cpu_policy, ckpts, tmp_path, cli, clean_env, monkeypatch
):
    """A registry from before the journal: its decisions are only in the catalog until
    `backfill` writes them (with their rows' times and authors); then a lost catalog loses
    none of them, and a second backfill writes nothing."""
    import shutil

    from registry.journal.backfill import backfill

    policy = tmp_path / "team.toml"
    policy.write_text(POLICY)
    with Registry() as reg:
        for step in (2, 4):
            reg.push_checkpoint(ckpts.ws2.step_dir(step), run="r", step=step)
        reg.validate("r@step4", device="cpu")
        reg.promote("r@step4", model="tiny", alias="prod")
        reg.promote("r@step2", model="tiny")
        reg.deprecate("tiny:v2")
        reg.pin("r@step2", reason="keep")
        reg.apply_policy(policy)
    monkeypatch.delenv("REG_POLICY")
    shutil.rmtree(clean_env / "store" / "journal")  # as if written before the journal
    with Registry() as reg:
        dry = backfill(reg.context, dry_run=True)
        assert not journal_keys(reg)
    res = cli("catalog", "backfill-journal", "--json")  # the command an upgrade runs
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    with Registry() as reg:
        assert out == dict(dry, applied=True)
        assert out["events_written"] == {
            "alias": 1,
            "deprecate": 1,
            "pin": 1,
            "policy": 1,
            "validation": 2,
        }
        assert backfill(reg.context)["events_written"] == {}
        before = reg.show("tiny@prod")
    lose_catalog(f"sqlite:///{clean_env / 'catalog.db'}")
    rebuilt = rebuild(cli)
    assert rebuilt["events_replayed"] == out["events_written"], rebuilt
    assert cli("policy", "show", env={"REG_USER": "mallory"}).returncode == 4
    with Registry() as reg:
        after = reg.show("tiny@prod")
        assert after["validation"]["passed"] and after["alias_history"] == before["alias_history"]
        assert reg.show("tiny:v2")["status"] == "deprecated"
        assert reg.show("r@step2")["pinned"]


def test_no_one_deletes_from_the_journal_through_reg(clean_env):
    from registry.errors import Conflict

    with Registry() as reg:
        key = journal_key(1_700_000_000 * 10**9, "0" * 32)
        reg.store.put_bytes(key, b"{}")
        with pytest.raises(Conflict, match="append-only"):
            reg.store.delete(key)
        assert reg.store.head(key) is not None


def test_a_rebuild_restores_only_what_was_lost(catalog_url, cpu_policy, ckpts, cli, tmp_path):
    """On a catalog that still holds its rows, the journal changes nothing: an older alias move,
    an unpin and a yank that never committed (their processes died after the journal write) are
    `current`; only what the rebuild re-created takes its decisions from the journal."""
    import time

    from registry.journal import write
    from registry.journal.event import ALIAS, UNPIN, YANK

    with Registry() as reg:
        for step in (2, 4):
            reg.push_checkpoint(ckpts.ws2.step_dir(step), run="r", step=step)
        reg.promote("r@step2", model="tiny")
        reg.promote("r@step4", model="tiny")
        reg.set_alias("tiny", "prod", 1)
        time.sleep(0.05)
        between = time.time()
        time.sleep(0.05)
        reg.set_alias("tiny", "prod", 2)
        reg.pin("r@step2", reason="paper")
        # decisions whose commit never happened: a move back to v1 (dated between the two
        # real moves), an unpin, a yank
        ctx = reg.context
        write.put(
            ctx, ALIAS, {"model": "tiny", "version": 1}, {"alias": "prod", "from": 2}, between
        )
        write.put(ctx, UNPIN, {"project": "default", "run": "r", "step": 2}, {}, None)
        write.put(ctx, YANK, {"model": "tiny", "version": 2}, {"reason": "never"}, None)
        before = reg.show("tiny@prod")
    out = rebuild(cli)
    assert out["checkpoints_added"] == [] and out["releases_added"] == []
    assert out["events_replayed"] == {} and out["events_skipped"] == []
    assert out["events_current"]["alias"] == 3 and out["events_current"]["yank"] == 1
    with Registry() as reg:
        after = reg.show("tiny@prod")
        assert after["version"] == 2 and after["alias_history"] == before["alias_history"]
        assert reg.show("r@step2")["pinned"]
        assert reg.show("tiny:v2")["status"] == "active"


def test_a_signed_journal_is_not_replayed_without_its_key(ckpts, cli, clean_env):
    """The key is lost with the catalog: the rebuild refuses (exit 2, naming the key id and
    REG_AUDIT_KEY_FILE) rather than replay unchecked, and so it does under a new key; with the
    key's backup it replays, and an unsigned `aborted` does not undo a signed yank."""
    import shutil
    import time

    from registry.trust.audit_chain.macs import canonical

    key_path = clean_env / "audit.key"
    assert keys.create(key_path)
    ident = keys.key_id(keys.read(key_path))
    shutil.copy(key_path, clean_env.parent / "audit.key.backup")
    with Registry() as reg:
        reg.push_checkpoint(ckpts.ws2.step_dir(2), run="r", step=2)
        reg.pin("r@step2", reason="keep")
        (pin,) = journal_keys(reg)
        ns = time.time_ns()
        forged = {
            "format": "reg.event/1",
            "id": f"{ns:020d}-{'d' * 32}",
            "kind": "aborted",
            "ts": ns / 1e9,
            "actor": "tester",
            "target": {"event": parse(reg.store.get_bytes(pin), pin).id},
            "fact": {"error": "x"},
            "key_id": None,
            "mac": None,
        }
        reg.store.put_bytes(journal_key(ns, "d" * 32), canonical(forged))
    lose_catalog(f"sqlite:///{clean_env / 'catalog.db'}")
    key_path.unlink()
    refused = cli("catalog", "rebuild", "--json")
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert ident in refused.stderr and "REG_AUDIT_KEY_FILE" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1
    assert json.loads(refused.stdout)["error"]["exit_code"] == 2
    with Registry() as reg:
        assert reg.list_checkpoints() == []  # refused before anything was added
    assert keys.create(key_path)  # an operator makes a new key
    again = cli("catalog", "rebuild")
    assert again.returncode == 2 and "no event in the journal is signed" in again.stderr
    key_path.unlink()
    shutil.copy(clean_env.parent / "audit.key.backup", key_path)
    out = rebuild(cli)
    assert out["events_replayed"] == {"pin": 1} and out["events_aborted"] == 0
    assert out["events_unsigned"] == 0
    assert [s["reason"] for s in out["events_skipped"]] == [
        "unsigned, and this registry has an audit key"
    ]
    with Registry() as reg:
        assert reg.show("r@step2")["pinned"]


def test_a_put_that_landed_but_failed_is_aborted(cli, tmp_path, clean_env, monkeypatch):
    """The journal put lands and its reply is lost: a retry answered 'exists' with our own
    bytes is success; any other failure refuses the decision and marks the event aborted, so a
    rebuild does not replay what the catalog never committed."""
    from registry.errors import ObjectExists, RegistryError
    from registry.storage.local import LocalStore

    first, second, third = (tmp_path / n for n in ("a.toml", "b.toml", "c.toml"))
    first.write_text(POLICY)
    second.write_text(POLICY.replace('"alice"', '"alice", "mallory"'))
    third.write_text(POLICY + "\n# v3\n")
    with Registry() as reg:
        reg.apply_policy(first)
    real = LocalStore.put_bytes
    failure: list[Exception] = []

    def landed(self, key, data, **kwargs):  # type: ignore[no-untyped-def]
        real(self, key, data, **kwargs)
        if key.startswith("journal/") and failure:
            raise failure.pop()

    monkeypatch.setattr(LocalStore, "put_bytes", landed)
    failure.append(RegistryError("connection reset", "retry"))
    with Registry() as reg, pytest.raises(RegistryError, match="connection reset"):
        reg.apply_policy(second)
    failure.append(ObjectExists("journal/...: already exists"))  # the retry that landed
    with Registry() as reg:
        reg.apply_policy(third)
        assert reg.policy.text == third.read_text()
        kinds = [parse(reg.store.get_bytes(k), k).kind for k in journal_keys(reg)]
    assert kinds == ["policy", "policy", "aborted", "policy"], kinds
    lose_catalog(f"sqlite:///{clean_env / 'catalog.db'}")
    out = rebuild(cli)
    assert out["events_replayed"] == {"policy": 2} and out["events_aborted"] == 1
    assert cli("policy", "show", env={"REG_USER": "mallory"}).returncode == 4
    with Registry() as reg:
        assert reg.policy.text == third.read_text()


def test_replay_refuses_what_the_live_commands_refuse(cpu_policy, ckpts, cli, clean_env):
    """A journal writer's events are checked as the commands check them: alias names, reasons,
    the actor's name, a plausible time that is the id's; no alias onto a yanked release."""
    import time

    from registry.trust.audit_chain.macs import canonical

    with Registry() as reg:
        reg.push_checkpoint(ckpts.ws2.step_dir(2), run="r", step=2)
        reg.promote("r@step2", model="tiny")
        reg.yank("tiny:v1", reason="bad eval")
        base = time.time_ns()
        alias = {"model": "tiny", "version": 1}
        pin = {"project": "default", "run": "r", "step": 2}
        cases = [  # kind, target, fact, ts (None: the id's), actor
            ("alias", alias, {"alias": "latest", "from": None}, None, "tester"),
            ("alias", alias, {"alias": "prod", "from": None}, None, "tester"),  # after the yank
            ("pin", pin, {"reason": "a\x1b[2Jb"}, None, "tester"),
            ("pin", pin, {"reason": "x"}, 1e300, "tester"),
            ("pin", pin, {"reason": "x"}, base / 1e9 - 5, "tester"),
            ("pin", pin, {"reason": "x"}, None, " admin"),
            ("deprecate", alias, {"reason": "r" * 501}, None, "tester"),
        ]
        for n, (kind, target, fact, ts, actor) in enumerate(cases):
            ns, uid = base + n * 1000, f"{n:032x}"
            reg.store.put_bytes(
                journal_key(ns, uid),
                canonical(
                    {
                        "format": "reg.event/1",
                        "id": f"{ns:020d}-{uid}",
                        "kind": kind,
                        "ts": ns / 1e9 if ts is None else ts,
                        "actor": actor,
                        "target": target,
                        "fact": fact,
                        "key_id": None,
                        "mac": None,
                    }
                ),
            )
    lose_catalog(f"sqlite:///{clean_env / 'catalog.db'}")
    out = rebuild(cli)
    assert out["events_replayed"] == {"validation": 1, "yank": 1}, out
    reasons = " | ".join(s["reason"] for s in out["events_skipped"])
    assert len(out["events_skipped"]) == len(cases), reasons
    for text in (
        "invalid alias 'latest'",
        "the release was yanked before it",
        "holds control characters",
        "is before 2000 or more than a day ahead",
        "is not the time its id names",
        "its actor is not a usable user name",
        "501 characters",
    ):
        assert text in reasons, text
    with Registry() as reg:
        assert not reg.show("r@step2")["pinned"] and reg.show("tiny:v1")["aliases"] == []


def test_pins_are_journaled_by_set_pin_not_by_the_audit_log(ckpts, clean_env):
    """The pin writes its own event; an audit record named 'pin' (as any caller may write) is
    no decision and journals nothing."""
    with Registry() as reg:
        reg.push_checkpoint(ckpts.ws2.step_dir(2), run="r", step=2)
        with reg.context.catalog.session(write=True) as s:
            reg.context.audit(s, "pin", "r@step2", reason="only a record")
        assert journal_keys(reg) == []
        reg.pin("r@step2", reason="keep")
        reg.unpin("r@step2")
        events = [parse(reg.store.get_bytes(k), k) for k in journal_keys(reg)]
    assert [(e.kind, e.target["step"], e.fact) for e in events] == [
        ("pin", 2, {"reason": "keep"}),
        ("unpin", 2, {}),
    ]
