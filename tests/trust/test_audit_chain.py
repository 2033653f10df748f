"""The provable audit log: every attack the database owner can make on it is detected.

Each attack is done with raw SQL as the owner, who can drop (SQLite) or disable (PostgreSQL) the
append-only triggers, or TRUNCATE; `reg audit verify` must exit 1 naming it. Real keys, real
catalogs (SQLite and PostgreSQL), a real `reg server` and a real S3 server with Object Lock.
"""

from __future__ import annotations

import json
import logging
import os
import random
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from registry import Registry
from registry.catalog.engine import Catalog
from registry.core.config import Settings
from registry.trust.audit_chain import keys

GUARDS_SQLITE = ("audit_event_no_update", "audit_event_no_delete")
GUARDS_SQLITE += ("audit_seal_no_update", "audit_seal_no_delete")


def _key_path() -> Path:
    return Settings.from_env().audit_key_path


def _activity(reg: Registry, n: int = 3) -> None:
    """Real mutating actions, each audited: tokens minted for a few principals."""
    for i in range(n):
        reg.create_token(f"user{i}")


@pytest.fixture
def sealed(catalog_url: str):  # type: ignore[no-untyped-def]
    """An embedded registry on the server's host (it reads the key): three rounds of activity,
    each sealed and anchored by `reg audit seal` (4 events per seal)."""
    assert keys.create(_key_path())
    with Registry() as reg:
        for _ in range(3):
            _activity(reg)
            out = reg.audit_seal()
            assert out["anchor"]["existing"] is False
        yield reg


def as_owner(catalog_url: str, *statements: str) -> None:
    """Run SQL as the database owner, the guards out of the way first."""
    cat = Catalog(catalog_url)
    try:
        with cat.engine.begin() as conn:
            if cat.is_sqlite:
                for trigger in GUARDS_SQLITE:
                    conn.exec_driver_sql(f"DROP TRIGGER IF EXISTS {trigger}")
            else:
                for table in ("audit_event", "audit_seal"):
                    conn.exec_driver_sql(f"ALTER TABLE {table} DISABLE TRIGGER {table}_append_only")
            for statement in statements:
                conn.exec_driver_sql(statement)
    finally:
        cat.dispose()


def _seals(reg: Registry) -> list[tuple[int, int, int]]:
    with reg.catalog.engine.connect() as conn:
        rows = conn.exec_driver_sql("SELECT seq, low, high FROM audit_seal ORDER BY seq")
        return [tuple(r) for r in rows]  # type: ignore[misc]


def verify(
    cli: Any, *flags: str, env: dict[str, str] | None = None
) -> tuple[int, dict[str, Any], str]:
    res = cli("audit", "verify", "--json", *flags, env=env)
    return res.returncode, json.loads(res.stdout) if res.stdout else {}, res.stderr


def _kinds(out: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    found: dict[str, list[dict[str, Any]]] = {}
    for p in out["problems"]:
        found.setdefault(p["kind"], []).append(p)
    return found


# -- a clean log ------------------------------------------------------------------------------


def test_a_clean_log_verifies_embedded_with_the_key(sealed, cli):
    res = cli("audit", "verify")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "audit log ok: 12 events, 12 sealed in 3 seals, 0 not sealed yet; 3 anchor" in res.stdout
    code, out, _ = verify(cli)
    assert code == 0 and out["ok"] and out["problems"] == []
    assert (out["events"], out["sealed"], out["seals"], out["anchors"]) == (12, 12, 3, 3)
    assert oct(_key_path().stat().st_mode & 0o777) == "0o600"


def test_unsealed_signed_events_are_fine_and_counted(sealed, cli):
    _activity(sealed, 2)
    code, out, _ = verify(cli)
    assert code == 0 and out["unsealed"] == 2 and out["sealed"] == 12
    assert out["oldest_unsealed"].endswith("Z")  # on a server, minutes old = sealing stalled


# -- the owner's attacks --------------------------------------------------------------------------


def test_an_edited_actor_is_detected(sealed, cli, catalog_url):
    _, low, _ = _seals(sealed)[1]
    victim = low + 1
    as_owner(catalog_url, f"UPDATE audit_event SET actor = 'mallory' WHERE id = {victim}")
    code, out, err = verify(cli)
    assert code == 1 and "fails verification" in err
    assert [(p["event"], p["seal"]) for p in _kinds(out)["edited"]] == [(victim, 2)]
    assert set(_kinds(out)) == {"edited"}


def test_two_events_swapped_are_named_as_reordered(sealed, cli, catalog_url):
    """Whole rows swapped (content, uid and MAC together): each event's own MAC still
    verifies; the seal binds ids to MACs, so the swap is named, both ways."""
    _, low, _ = _seals(sealed)[1]
    a, b = low, low + 2
    cols = ("ts", "actor", "action", "target", "outcome", "details", "uid", "mac")
    copy = ", ".join(f"{c} = (SELECT {c} FROM keep WHERE keep.id = {{other}})" for c in cols)
    as_owner(
        catalog_url,
        f"CREATE TEMP TABLE keep AS SELECT * FROM audit_event WHERE id IN ({a}, {b})",
        f"UPDATE audit_event SET uid = NULL WHERE id IN ({a}, {b})",
        f"UPDATE audit_event SET {copy.format(other=b)} WHERE id = {a}",
        f"UPDATE audit_event SET {copy.format(other=a)} WHERE id = {b}",
    )
    code, out, _ = verify(cli)
    assert code == 1
    reordered = _kinds(out)["reordered"]
    assert sorted(p["event"] for p in reordered) == [a, b]
    assert f"holds what seal 2 sealed as event {b}" in reordered[0]["message"]


def test_an_event_deleted_in_the_middle_is_detected(sealed, cli, catalog_url):
    _, low, _ = _seals(sealed)[1]
    as_owner(catalog_url, f"DELETE FROM audit_event WHERE id = {low + 1}")
    code, out, _ = verify(cli)
    assert code == 1
    assert [(p["event"], p["seal"]) for p in _kinds(out)["deleted"]] == [(low + 1, 2)]


def test_the_tail_removed_back_past_the_newest_anchor_is_truncation(sealed, cli, catalog_url):
    """The owner deletes the last two seals and their events: what is left is a valid chain,
    one seal long; the anchors in the store say it was three."""
    _, _, high1 = _seals(sealed)[0]
    as_owner(
        catalog_url,
        "DELETE FROM audit_seal WHERE seq >= 2",
        f"DELETE FROM audit_event WHERE id > {high1}",
    )
    code, out, _ = verify(cli)
    assert code == 1
    truncated = _kinds(out)["truncated"]
    assert {p["seal"] for p in truncated} == {2, 3}
    assert "the chain ends at seal 1 (4 events)" in truncated[0]["message"]
    assert "the tail was removed" in truncated[0]["message"]


def test_a_rewritten_tail_does_not_match_its_anchor(sealed, cli, catalog_url):
    """Tail removed, then new activity sealed in its place: the seqs are there again, but not
    the seals the store anchored."""
    _, _, high1 = _seals(sealed)[0]
    as_owner(
        catalog_url,
        "DELETE FROM audit_seal WHERE seq >= 2",
        f"DELETE FROM audit_event WHERE id > {high1}",
    )
    for _ in range(2):
        _activity(sealed, 2)
        from registry.trust.audit_chain.sealer import seal_pending

        seal_pending(sealed.catalog, keys.read(_key_path()))
    code, out, _ = verify(cli)
    assert code == 1
    assert {p["seal"] for p in _kinds(out)["anchor-mismatch"]} == {2, 3}


def test_the_whole_log_wiped_is_detected(sealed, cli, catalog_url):
    """PostgreSQL's TRUNCATE fires no row trigger at all (the hole of the issue); on SQLite the
    owner drops the trigger and deletes every row."""
    if catalog_url.startswith("sqlite"):
        as_owner(catalog_url, "DELETE FROM audit_event")
    else:
        cat = Catalog(catalog_url)
        with cat.engine.begin() as conn:
            conn.exec_driver_sql("TRUNCATE audit_event")  # the guard triggers still enabled
        cat.dispose()
    code, out, _ = verify(cli)
    assert code == 1 and out["events"] == 0
    assert [p["seal"] for p in _kinds(out)["deleted"]] == [1, 2, 3]
    assert "events 1-4 sealed in seal 1 are gone" in _kinds(out)["deleted"][0]["message"]


def test_forged_inserts_are_detected(sealed, cli, catalog_url):
    """Without the key the owner can add a row with a made-up MAC, or none at all."""
    insert = (
        "INSERT INTO audit_event (ts, actor, action, target, outcome, details, uid, mac) "
        "VALUES ({ts}, 'admin', 'yank', 'llama:v1', 'allowed', '{{}}', '{uid}', {mac})"
    )
    as_owner(
        catalog_url,
        insert.format(ts=time.time(), uid="f" * 32, mac="'" + "ab" * 32 + "'"),
        insert.format(ts=time.time(), uid="e" * 32, mac="NULL"),
    )
    code, out, _ = verify(cli)
    assert code == 1
    kinds = _kinds(out)
    assert [p["event"] for p in kinds["forged"]] == [13]
    assert [p["event"] for p in kinds["unsigned"]] == [14]
    # The sealer refuses both: they never become part of the chain.
    out = sealed.audit_seal()
    assert [r["event"] for r in out["refused"]] == [13, 14]
    assert set(_kinds(verify(cli)[1])) == {"forged", "unsigned"}


def test_a_copied_event_is_a_duplicate(sealed, cli, catalog_url):
    """A signed event replayed as a new row (the uid's unique index dropped first)."""
    cols = "ts, actor, action, target, outcome, details, uid, mac"
    as_owner(
        catalog_url,
        "DROP INDEX ix_audit_event_uid",
        f"INSERT INTO audit_event ({cols}) SELECT {cols} FROM audit_event WHERE id = 2",
    )
    code, out, _ = verify(cli)
    assert code == 1
    assert [p["event"] for p in _kinds(out)["duplicate"]] == [13]


def test_a_deleted_seal_row_is_a_gap_in_the_chain(sealed, cli, catalog_url):
    as_owner(catalog_url, "DELETE FROM audit_seal WHERE seq = 2")
    code, out, _ = verify(cli)
    assert code == 1
    missing = _kinds(out)["seal-missing"]
    assert [p["seal"] for p in missing] == [2]
    assert "(4 sealed events with them)" in missing[0]["message"]


def test_an_edited_seal_row_is_detected(sealed, cli, catalog_url):
    as_owner(catalog_url, "UPDATE audit_seal SET sealed_at = sealed_at + 1 WHERE seq = 2")
    code, out, _ = verify(cli)
    assert code == 1
    assert [p["seal"] for p in _kinds(out)["seal-forged"]] == [2]


def test_forged_and_edited_anchors_are_detected(sealed, cli, catalog_url):
    """Someone with the store but not the key: an anchor edited, one made up."""
    root = Path(Settings.from_env().store_url.removeprefix("file://"))
    newest = root / "audit" / "anchors" / f"{3:012d}.json"
    doc = json.loads(newest.read_text())
    doc["events"] = 99
    newest.chmod(0o640)
    newest.write_text(json.dumps(doc))
    made_up = dict(doc, seq=7, anchor_mac="00" * 32)
    (newest.parent / f"{7:012d}.json").write_text(json.dumps(made_up))
    code, out, _ = verify(cli)
    assert code == 1
    forged = _kinds(out)["anchor-forged"]
    assert sorted(p["anchor"] for p in forged) == [
        "audit/anchors/000000000003.json",
        "audit/anchors/000000000007.json",
    ]
    assert "truncated" not in _kinds(out)  # a made-up anchor proves nothing


# -- keys --------------------------------------------------------------------------------------


def test_verifying_without_the_key_says_where_to_run_it(sealed, cli, tmp_path):
    res = cli("audit", "verify", env={"REG_AUDIT_KEY_FILE": str(tmp_path / "absent.key")})
    assert res.returncode == 2
    assert "needs the server's audit key" in res.stderr
    assert "through the server (REG_URL) or on the server's host" in res.stderr
    assert "Traceback" not in res.stderr


def test_a_wrong_key_is_one_clear_line(sealed, cli, tmp_path):
    other = tmp_path / "other.key"
    other.write_bytes(os.urandom(32).hex().encode() + b"\n")  # the hex form reads too
    other.chmod(0o600)
    res = cli("audit", "verify", env={"REG_AUDIT_KEY_FILE": str(other)})
    assert res.returncode == 2, res.stderr
    assert "the audit chain is sealed with key" in res.stderr
    bad = tmp_path / "bad.key"
    bad.write_bytes(b"short")
    bad.chmod(0o400)
    res = cli("audit", "verify", env={"REG_AUDIT_KEY_FILE": str(bad)})
    assert res.returncode == 2 and "is not an audit key" in res.stderr


def test_a_key_file_others_can_read_is_refused(sealed, cli):
    """Like ssh with a private key: whoever reads the key can sign, so a key open to group or
    others is one clear line, not a chain that proves nothing."""
    path = _key_path()
    for mode in (0o644, 0o640, 0o602):
        path.chmod(mode)
        res = cli("audit", "verify")
        assert res.returncode == 2, res.stderr
        assert f"the audit key {path} is open to group or others (mode {mode:04o})" in res.stderr
        assert f"chmod 600 {path}" in res.stderr and "Traceback" not in res.stderr
    path.chmod(0o400)
    assert cli("audit", "verify").returncode == 0


def test_the_key_file_is_created_once(tmp_path):
    path = tmp_path / "k" / "audit.key"
    assert keys.create(path) is True
    first = path.read_bytes()
    assert keys.create(path) is False and path.read_bytes() == first
    assert len(first) == 32 and path.stat().st_mode & 0o777 == 0o600


# -- history, concurrency -----------------------------------------------------------------------


def test_history_before_the_key_goes_into_the_genesis_seal_only(catalog_url, cli, monkeypatch):
    from registry.trust.audit_chain import sealer

    monkeypatch.setattr(sealer, "BATCH", 2)  # signed events per seal, after the history
    with Registry() as reg:  # no key yet: events are recorded unsigned
        _activity(reg, 3)
    code, _, err = verify(cli)
    assert code == 2 and "needs the server's audit key" in err
    keys.create(_key_path())
    with Registry() as reg:
        _activity(reg, 2)
        code, out, _ = verify(cli)
        assert code == 0 and (out["unsigned_history"], out["unsealed"]) == (3, 2)
        out = reg.audit_seal()
        assert out["seals"] == [1, 2] and out["sealed"] == 6 and out["refused"] == []
        assert [(seq, high - low + 1) for seq, low, high in _seals(reg)] == [(1, 5), (2, 1)]
    with Registry(Settings.from_env({**os.environ, "REG_AUDIT_KEY_FILE": "/nonexistent"})) as r:
        _activity(r, 1)  # a client without the key, after the chain began
    code, out, _ = verify(cli)
    assert code == 1 and [p["event"] for p in _kinds(out)["unsigned"]] == [7]
    assert (out["sealed"], out["unsigned_history"]) == (6, 0)


def test_concurrent_writers_end_in_a_fully_sealed_verifying_chain(catalog_url, cli):
    """Writers sign their own events while a sealer runs: nobody waits on a shared row. On
    PostgreSQL each writer holds its transaction open after its id was assigned, so commits
    land out of id order; the sealer still takes every event exactly once."""
    from registry.trust.audit_chain.sealer import seal_pending

    keys.create(_key_path())
    key = keys.read(_key_path())
    writers, per_writer = 4, 15
    done = threading.Event()
    errors: list[BaseException] = []
    seals: list[int] = []

    def write(n: int) -> None:
        rng = random.Random(n)
        try:
            with Registry() as reg:
                for i in range(per_writer):
                    with reg.catalog.session(write=True) as s:
                        reg.context.audit(s, "push", f"w{n}@step{i}")
                        s.flush()  # the id is taken now; the commit comes later
                        time.sleep(rng.uniform(0, 0.02))
        except BaseException as exc:
            errors.append(exc)

    def seal() -> None:
        catalog = Catalog(catalog_url)
        try:
            while not done.is_set():
                seals.extend(seal_pending(catalog, key).seals)
                time.sleep(0.01)
        except BaseException as exc:
            errors.append(exc)
        finally:
            catalog.dispose()

    threads = [threading.Thread(target=write, args=(n,)) for n in range(writers)]
    sealer = threading.Thread(target=seal)
    sealer.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done.set()
    sealer.join()
    assert errors == []
    catalog = Catalog(catalog_url)
    seals.extend(seal_pending(catalog, key).seals)  # a routine cycle, not a full scan
    catalog.dispose()
    assert len(seals) > 1, "the sealer ran alongside the writers"
    code, out, _ = verify(cli)
    assert code == 0, out["problems"]
    assert out["events"] == out["sealed"] == writers * per_writer and out["unsealed"] == 0


def test_a_sealer_that_lost_the_race_for_a_link_says_so_and_raises_nothing(
    catalog_url, monkeypatch
):
    """Two sealers read the same head and append the same next link (the policy's seal_now and
    the server's background sealer did, in CI): the database refuses the second (SQLite: the
    unique key; PostgreSQL: the next-link trigger's own error first), and the loser reports
    that it raced instead of failing the request that sealed."""
    from registry.trust.audit_chain import sealer

    keys.create(_key_path())
    key = keys.read(_key_path())
    with Registry() as reg:
        with reg.catalog.session(write=True) as s:
            reg.context.audit(s, "push", "a@step1")
        catalog = Catalog(catalog_url)
        try:
            assert sealer.seal_pending(catalog, key).seals == [1]
            with catalog.session() as s:
                stale = sealer.head(s)
            with reg.catalog.session(write=True) as s:
                reg.context.audit(s, "push", "a@step2")
            assert sealer.seal_pending(catalog, key).seals == [2]  # the winner
            # The loser read the head before the winner's link landed.
            monkeypatch.setattr(sealer, "head", lambda session: stale)
            with reg.catalog.session(write=True) as s:
                reg.context.audit(s, "push", "a@step3")
            run = sealer.seal_pending(catalog, key)
            assert run.raced and run.seals == []
        finally:
            catalog.dispose()


# -- through reg server ---------------------------------------------------------------------------


def test_through_a_real_server(catalog_url, tmp_path, cli):
    """The server signs every request's events, seals them on its own (one leader, the
    lease) and anchors the head; `reg audit verify` runs through REG_URL; an edit by the owner
    is named through the server too; a client on the host without the key is told where to
    go."""
    from tests.serverproc import RegServer, server_env, team_policy

    env = server_env(tmp_path / "srv", catalog_url)
    env.update(REG_AUDIT_SEAL_EVERY="1s", REG_AUDIT_ANCHOR_EVERY="1s")
    server = RegServer(env, tmp_path / "srv").init().start()
    try:
        assert (tmp_path / "srv" / "audit.key").stat().st_mode & 0o777 == 0o600
        server.apply_policy(team_policy())
        client = server.client_env("admin")
        for who in ("alice", "bob"):
            assert cli("token", "create", who, env=client).returncode == 0
        deadline = time.monotonic() + 30
        while True:
            code, out, err = verify(cli, env=client)
            assert code == 0, (out, err)
            head = out["head"] or {}
            if out["unsealed"] == 0 and out["anchors"] and head.get("events") == out["events"]:
                break
            assert time.monotonic() < deadline, out
            time.sleep(0.5)
        assert out["events"] >= 5  # init's policy and token, the policy, two tokens
        assert (out["max_unsealed_age_s"], out["max_anchor_age_s"]) == (900, 900)
        code, out, _ = verify(cli, "--max-unsealed-age", "30s", env=client)  # to the server
        assert code == 0 and out["max_unsealed_age_s"] == 30, out
        assert '"audit": "sealed"' in server.log_text()
        res = cli("audit", "seal", env=client)
        assert res.returncode == 0 and "chain head: seal" in res.stdout, res.stderr

        with Catalog(catalog_url).engine.connect() as conn:
            victim = conn.exec_driver_sql("SELECT min(id) FROM audit_event").scalar()
        as_owner(catalog_url, f"UPDATE audit_event SET target = 'nothing' WHERE id = {victim}")
        code, out, _ = verify(cli, env=client)
        assert code == 1 and [p["event"] for p in _kinds(out)["edited"]] == [victim]

        keyless = {"REG_HOME": str(tmp_path / "operator-without-key"), "REG_USER": "admin"}
        res = cli("audit", "verify", env=keyless)
        assert res.returncode == 2 and "needs the server's audit key" in res.stderr
    finally:
        server.stop()


def test_the_server_refuses_to_start_without_a_key(tmp_path, cli):
    from tests.serverproc import RegServer, server_env

    home = tmp_path / "no-key"
    server = RegServer(server_env(home, f"sqlite:///{home / 'catalog.db'}"), home)
    res = cli("server", "--port", str(server.port), env=server.env, timeout=60)
    assert res.returncode == 2, res.stderr
    assert f"no audit key at {home / 'audit.key'}" in res.stderr
    assert "reg server init" in res.stderr and "Traceback" not in res.stderr


# -- anchors on S3 --------------------------------------------------------------------------------


def test_anchors_on_s3_are_write_once_and_compliance_locked(s3_server, monkeypatch):
    for k, v in s3_server.credentials().items():
        monkeypatch.setenv(k, v)
    s3 = s3_server.client()
    bucket = f"reg-lock-{os.urandom(4).hex()}"
    s3.create_bucket(Bucket=bucket, ObjectLockEnabledForBucket=True)
    monkeypatch.setenv("REG_STORE_URL", f"s3://{bucket}/reg")
    keys.create(_key_path())
    with Registry() as reg:
        _activity(reg, 2)
        out = reg.audit_seal()
        anchor = out["anchor"]
        assert anchor["locked"].startswith("COMPLIANCE until ")
        key = f"reg/{anchor['key']}"
        head = s3.head_object(Bucket=bucket, Key=key)
        assert head["ObjectLockMode"] == "COMPLIANCE"
        with pytest.raises(Exception, match="AccessDenied"):
            s3.delete_object(Bucket=bucket, Key=key, VersionId=head["VersionId"])
        from registry.errors import Conflict

        with pytest.raises(Conflict, match="audit anchors are never deleted"):
            reg.store.delete(anchor["key"])
        again = reg.audit_seal()  # nothing new but its own event: a new seal, a new anchor
        assert again["anchor"]["seq"] == 2
        assert reg.audit_verify()["ok"]


# -- a stalled sealer -----------------------------------------------------------------------------


def _plant_lease(catalog_url: str) -> None:
    """What a stolen runtime role (or the owner) can do: hold the sealer's lease for a holder
    on another host, far into the future."""
    from registry.trust.audit_chain.schedule import LEASE

    as_owner(
        catalog_url,
        "INSERT INTO lease (name, holder, host, pid, token, acquired_at, expires_at) VALUES "
        f"('{LEASE}', 'x', 'elsewhere', 1, 'deadbeef', {time.time()}, 1e12)",
    )


def _schedule(reg: Registry, **kw: Any) -> Any:
    from registry.trust.audit_chain.schedule import SealSchedule

    kw.setdefault("anchor_every_s", 0)
    return SealSchedule(
        reg.catalog, reg.store, keys.read(_key_path()), every_s=10, holder="reg-server", **kw
    )


def test_a_held_lease_stalls_sealing_and_verify_fails_past_the_bound(sealed, cli, catalog_url):
    """The lease planted, the server's sealer never leads again; events written since stay
    unsealed and the owner deletes two. Within the bound that is fine and counted (the known
    limit); past it, verify fails naming `stalled`."""
    _plant_lease(catalog_url)
    sched = _schedule(sealed)
    assert sched.cycle() is None
    _activity(sealed, 5)
    assert sched.cycle() is None
    with sealed.catalog.engine.connect() as c:
        ids = [r[0] for r in c.exec_driver_sql("SELECT id FROM audit_event ORDER BY id DESC")]
    as_owner(catalog_url, f"DELETE FROM audit_event WHERE id IN ({ids[0]}, {ids[2]})")
    code, out, _ = verify(cli)  # default bound: max(15 min, 10 x REG_AUDIT_SEAL_EVERY)
    assert code == 0 and out["unsealed"] == 3 and out["problems"] == []
    assert (out["max_unsealed_age_s"], out["max_anchor_age_s"]) == (900, 900)
    time.sleep(1.2)
    code, out, err = verify(cli, "--max-unsealed-age", "1s")
    assert code == 1 and "fails verification" in err
    assert set(_kinds(out)) == {"stalled"}
    (stalled,) = _kinds(out)["stalled"]
    assert stalled["event"] == ids[4]  # the oldest waiting
    assert stalled["message"].startswith("3 signed event(s) have waited unsealed longer than 1s")
    assert "audit-seal lease" in stalled["message"]
    res = cli("audit", "verify", "--max-unsealed-age", "1s")
    assert res.returncode == 1 and "stalled: 3 signed event(s)" in res.stdout
    res = cli("audit", "verify", "--max-unsealed-age", "soon")
    assert res.returncode == 2 and "bad --max-unsealed-age" in res.stderr


def test_events_older_than_the_default_bound_fail_without_a_flag(sealed, cli, catalog_url):
    """An event signed 20 minutes ago (the key holder's own clock) and never sealed: the
    default bound (15 min for a 10s sealer) fails it; a larger bound given accepts it."""
    from registry.catalog.models import AuditEvent
    from registry.trust.audit_chain.macs import event_mac

    content: dict[str, Any] = {
        "uid": os.urandom(16).hex(),
        "ts": time.time() - 1200,
        "actor": "admin",
        "action": "token-create",
        "target": "late",
        "outcome": "allowed",
        "details": {},
    }
    with sealed.catalog.session(write=True) as s:
        s.add(AuditEvent(**content, mac=event_mac(keys.read(_key_path()), content)))
    code, out, _ = verify(cli)
    assert code == 1 and set(_kinds(out)) == {"stalled"}  # the newest anchor is fresh
    assert verify(cli, "--max-unsealed-age", "1h")[0] == 0


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(json.loads(record.getMessage()))


def test_reg_audit_seal_recovers_from_a_held_lease(sealed, cli, catalog_url):
    """The planted lease does not stop an explicit seal (it takes no lease); the server's
    sealer, shut out, says so in one JSON warning line (not every cycle)."""
    _plant_lease(catalog_url)
    sched = _schedule(sealed)
    sched.patience_s = 0.5
    _activity(sealed, 3)
    time.sleep(0.7)
    handler = _Lines()
    logging.getLogger("reg.server").addHandler(handler)
    try:
        assert sched.cycle() is None and sched.cycle() is None
        lines = list(handler.lines)
        assert len(lines) == 1, lines
        assert _kinds(verify(cli, "--max-unsealed-age", "0.5s")[1]).keys() == {"stalled"}
        handler.lines.clear()
        sched.warned_at = float("-inf")
        assert cli("audit", "seal").returncode == 0
        assert sched.cycle() is None  # still shut out, but nothing waits: no warning
        assert handler.lines == []
    finally:
        logging.getLogger("reg.server").removeHandler(handler)
    assert lines[0]["audit"] == "stalled" and lines[0]["waiting_s"] >= 0.5
    assert (lines[0]["lease_holder"], lines[0]["lease_host"]) == ("x", "elsewhere")
    assert lines[0]["lease_expires"] == "1000000000000.0 (not a time)"
    code, out, _ = verify(cli, "--max-unsealed-age", "0.5s", "--max-anchor-age", "0.5s")
    assert out["unsealed"] == 0 and out["unanchored"] == 0, out
    # sealed now, but the stall is not forgotten: the seal took them past the bound
    # (the head itself may be older than 0.5s by now, which a heartbeat would have prevented)
    assert code == 1 and set(_kinds(out)) - {"stalled", "anchor-stale"} == {"sealed-late"}
    (late,) = _kinds(out)["sealed-late"]
    assert late["seal"] == out["head"]["seq"] and late["delay_s"] > 0.5, late
    assert verify(cli, "--max-unsealed-age", "1h", "--max-anchor-age", "1h")[0] == 0


def test_sealed_but_unanchored_past_the_bound_is_anchor_stale(sealed, cli):
    """Seals made, none anchored (anchoring stopped): the store holds nothing of them, so the
    owner could cut them unseen; past the bound that is `anchor-stale`."""
    from registry.trust.audit_chain.sealer import seal_pending

    began = time.monotonic()  # the fixture's anchors (seal 3) are older than this
    time.sleep(1.2)  # the anchors of the fixture are older than the bound now
    code, out, _ = verify(cli, "--max-anchor-age", "1s")  # everything anchored, but long ago
    assert code == 1 and set(_kinds(out)) == {"anchor-stale"}, out["problems"]
    (stale,) = _kinds(out)["anchor-stale"]
    assert stale["message"].startswith("the newest anchor (seal 3), of ")
    assert stale["seal"] == 3 and "anchoring stopped" in stale["message"]
    assert verify(cli, "--max-anchor-age", "1h")[0] == 0
    _activity(sealed, 2)
    assert seal_pending(sealed.catalog, keys.read(_key_path())).sealed == 2
    code, out, _ = verify(cli, "--max-anchor-age", "1h")
    assert code == 0 and out["unanchored"] == 2 and out["newest_anchor"]["seq"] == 3
    time.sleep(1.2)
    code, out, _ = verify(cli, "--max-anchor-age", "1s")
    assert code == 1 and set(_kinds(out)) == {"anchor-stale"}, out["problems"]
    (stale,) = _kinds(out)["anchor-stale"]
    assert "2 signed event(s) are in no anchored seal" in stale["message"]
    assert "the newest anchor (seal 3)" in stale["message"]
    assert verify(cli)[0] == 0  # the default bound (15 min) is not reached
    # A bound that seal 3's anchor is past (it is older than `began`) but a fresh anchor is
    # within on a loaded machine: at least the 2.4 s slept above, not a fixed second.
    bound = time.monotonic() - began
    sealed.audit_seal()  # in process: a CLI's start-up alone can take a second here
    out = sealed.audit_verify(max_anchor_age_s=bound)
    assert out["ok"] and out["unanchored"] == 0, out["problems"]
    assert out["newest_anchor"]["seq"] == 5, out


def test_a_policy_apply_anchored_after_its_seal_is_in_force_once_anchored(
    sealed, tmp_path, monkeypatch
):
    """A server's sealer seals an apply event and writes the anchor a moment later. Asked in
    between, the answer is "not anchored yet"; asked once the anchor is in the store, with no
    newer seal, the policy is in force (a "not yet" remembered from before is not the answer:
    it kept an apply waiting out its whole bound, and failing, until the sealer's next seal)."""
    from registry.operations import policy_admin
    from registry.trust.audit_chain import anchors
    from registry.trust.audit_chain.sealer import anchor_head, seal_pending
    from registry.trust.proven_policy import PENDING_RECHECK_S, in_force

    key = keys.read(_key_path())
    path = tmp_path / "policy.toml"
    path.write_text("[retention]\nkeep_last = 3\n")
    monkeypatch.setattr(policy_admin, "_in_force_now", lambda ctx, version: None)  # the sealer's
    version = sealed.apply_policy(path)["version"]
    assert seal_pending(sealed.catalog, key).sealed >= 1  # sealed, not anchored
    waiting = in_force(sealed.catalog, sealed.store, key)
    assert waiting.version != version and waiting.pending
    assert any(line.endswith("not anchored yet") for line in waiting.ignored), waiting.ignored
    with sealed.catalog.session() as s:
        head = anchor_head(s)
    assert head is not None
    assert anchors.write(sealed.store, key, head)["existing"] is False
    time.sleep(PENDING_RECHECK_S)
    assert in_force(sealed.catalog, sealed.store, key).version == version


def test_a_late_event_with_an_old_ts_is_sealed_by_the_periodic_full_scan(sealed, cli):
    """A routine cycle re-looks below the head only at the last 15 minutes; an event with a
    low id and a ts older than that (a replica's clock behind, a transaction held open) is
    sealed by the next full scan, every `full_every` cycles."""
    from registry.catalog.models import AuditEvent
    from registry.trust.audit_chain.macs import event_mac

    key = keys.read(_key_path())
    high = _seals(sealed)[-1][2]

    def insert(event_id: int, ts: float) -> None:
        content: dict[str, Any] = {
            "uid": os.urandom(16).hex(),
            "ts": ts,
            "actor": "admin",
            "action": "push",
            "target": f"late{event_id}",
            "outcome": "allowed",
            "details": {},
        }
        with sealed.catalog.session(write=True) as s:
            s.add(AuditEvent(id=event_id, **content, mac=event_mac(key, content)))

    sched = _schedule(sealed, full_every=3, anchor_every_s=3600)
    assert sched.cycle()["seals"] == []  # cycle 0: full
    insert(high + 1000, time.time())
    assert sched.cycle()["sealed"] == 1  # cycle 1: routine, above the head
    insert(high + 500, time.time() - 3600)
    assert sched.cycle()["seals"] == []  # cycle 2: routine, misses it
    out = verify(cli)[1]
    assert out["unsealed"] == 1 and [p["event"] for p in _kinds(out)["stalled"]] == [high + 500]
    assert sched.cycle()["sealed"] == 1  # cycle 3: the periodic full scan takes it
    code, out, _ = verify(cli, "--max-anchor-age", "2h")
    # its ts is older than the chain (the fixture's genesis): not `sealed-late`, which
    # test_an_event_sealed_past_the_bound_is_sealed_late covers
    assert code == 0 and out["unsealed"] == 0, out["problems"]


# -- stalls that ended, stalls kept up, heartbeats -----------------------------------------------


def _ids(reg: Registry) -> list[int]:
    with reg.catalog.engine.connect() as c:
        return [r[0] for r in c.exec_driver_sql("SELECT id FROM audit_event ORDER BY id")]


def _empty_seals(reg: Registry) -> int:
    with reg.catalog.engine.connect() as c:
        found = c.exec_driver_sql("SELECT count(*) FROM audit_seal WHERE count = 0").scalar()
        return int(found or 0)


def test_a_stall_released_after_deletions_is_sealed_late(sealed, cli, catalog_url):
    """Exploit A: the lease planted, events written, the bound passes, the owner deletes two
    still unsealed and lets the lease go; the real sealer seals the rest. The deleted ones
    leave no row, but the seal that took the survivors took them late: `sealed-late`."""
    _plant_lease(catalog_url)
    sched = _schedule(sealed)
    before = set(_ids(sealed))
    _activity(sealed, 5)
    assert sched.cycle() is None
    new = sorted(set(_ids(sealed)) - before)
    time.sleep(1.5)
    as_owner(
        catalog_url,
        f"DELETE FROM audit_event WHERE id IN ({new[1]}, {new[3]})",
        "DELETE FROM lease WHERE name = 'audit-seal'",
    )
    assert sched.cycle()["sealed"] == 3  # the real sealer leads again
    # The anchor bound is not under test: an anchor's time is kept to the second, so a 1s
    # bound could name a fresh anchor stale.
    out = sealed.audit_verify(max_unsealed_age_s=1, max_anchor_age_s=60)
    assert out["unsealed"] == 0 and set(_kinds(out)) == {"sealed-late"}, out["problems"]
    (late,) = _kinds(out)["sealed-late"]
    assert (late["seal"], late["event"]) == (out["head"]["seq"], new[0]) and late["delay_s"] > 1.5
    assert late["message"].startswith(f"seal {late['seal']} (of ")
    assert f"took event {new[0]} " in late["message"] and "longer than 1s" in late["message"]
    res = cli("audit", "verify", "--max-unsealed-age", "1s", "--max-anchor-age", "1h")
    assert res.returncode == 1 and f"sealed-late: seal {late['seal']} (of " in res.stdout
    assert verify(cli)[0] == 0  # within the default bound (15 min) that was no stall


def test_a_stall_kept_up_while_aged_events_are_deleted_is_stalled(sealed, catalog_url):
    """Exploit B: the lease kept planted, every unsealed event deleted before it ages; the
    survivors are young, but no heartbeat seal or anchor came for longer than the bound."""
    _plant_lease(catalog_url)
    sched = _schedule(sealed)
    before = set(_ids(sealed))
    _activity(sealed, 3)
    old = sorted(set(_ids(sealed)) - before)
    time.sleep(1.5)
    _activity(sealed, 2)  # fresh activity, the stall still on
    assert sched.cycle() is None
    as_owner(catalog_url, f"DELETE FROM audit_event WHERE id IN ({','.join(map(str, old))})")
    out = sealed.audit_verify(max_unsealed_age_s=1, max_anchor_age_s=1)
    assert out["unsealed"] == 2 and set(_kinds(out)) == {"stalled", "anchor-stale"}, out
    (stalled,) = _kinds(out)["stalled"]
    assert stalled["seal"] == 3 and stalled["message"].startswith("the newest seal (seal 3, of ")
    assert "2 left unsealed" in stalled["message"]
    assert _kinds(out)["anchor-stale"][0]["seal"] == 3


def test_empty_seals_verify_link_and_anchor(catalog_url, cli):
    """Heartbeats on an empty log (an empty genesis), between sealed events and after them:
    each links to the one before, its MAC covers zero entries, the anchors hold them; an
    empty seal edited by the owner is named."""
    from registry.trust.audit_chain.sealer import heartbeat, seal_pending

    assert keys.create(_key_path())
    key = keys.read(_key_path())
    with Registry() as reg:
        assert _ids(reg) == []  # a log with nothing in it yet
        assert heartbeat(reg.catalog, key, every_s=0) == 1
        assert heartbeat(reg.catalog, key, every_s=3600) is None  # the head is fresh
        _activity(reg, 2)
        assert seal_pending(reg.catalog, key).seals == [2]
        assert heartbeat(reg.catalog, key, every_s=0) == 3
        assert reg.audit_seal()["head"]["seq"] == 4  # its own event, anchored
        assert heartbeat(reg.catalog, key, every_s=0) == 5
        out = reg.audit_verify()
        assert out["ok"] and out["seals"] == 5 and out["unsealed"] == 0, out["problems"]
        assert _empty_seals(reg) == 3 and out["head"]["events"] == out["events"] == 3
        rows = _seals(reg)
        assert [r for r in rows if r[0] in (1, 3, 5)] == [(1, 0, 0), (3, 0, 0), (5, 0, 0)]
        sched = _schedule(reg)
        assert sched.cycle()["heartbeat"] == 6 and sched.cycle()["anchor"]["seq"] == 7
        assert reg.audit_verify()["ok"]
        as_owner(catalog_url, "UPDATE audit_seal SET sealed_at = sealed_at + 1 WHERE seq = 3")
        assert [(p["kind"], p["seal"]) for p in reg.audit_verify()["problems"]] == [
            ("seal-forged", 3)
        ]
        as_owner(catalog_url, "UPDATE audit_seal SET event_ids = ',' WHERE seq = 5")
        assert ("seal-forged", 5) in [
            (p["kind"], p.get("seal")) for p in reg.audit_verify()["problems"]
        ]


@pytest.mark.exclusive
def test_a_quiet_registry_with_a_running_sealer_stays_clean(sealed):
    """A leader cycling with short intervals: some activity, then nothing; at any time the
    newest seal and anchor are younger than the bound (2s here), and verify is clean."""
    sched = _schedule(sealed, anchor_every_s=0.3)
    assert sched.heartbeat_s == 0.3
    beats_before = _empty_seals(sealed)
    start = time.monotonic()
    checks = 0
    while time.monotonic() - start < 4:
        if time.monotonic() - start < 1:
            _activity(sealed, 1)
        sched.cycle()
        if time.monotonic() - start > 2.5 and not checks:
            out = sealed.audit_verify(max_unsealed_age_s=2, max_anchor_age_s=2)
            assert out["ok"], out["problems"]
            checks += 1
        time.sleep(0.1)
    out = sealed.audit_verify(max_unsealed_age_s=2, max_anchor_age_s=2)
    assert out["ok"] and out["unsealed"] == 0 and out["unanchored"] == 0, out["problems"]
    assert _empty_seals(sealed) - beats_before >= 5  # ~3s quiet / 0.3s
    assert out["newest_anchor"]["seq"] >= out["head"]["seq"] - 1


@pytest.mark.exclusive
def test_a_real_server_heartbeats_and_a_stopped_one_is_named(catalog_url, tmp_path, cli):
    """`reg server` with REG_AUDIT_SEAL_EVERY=0.2s, REG_AUDIT_ANCHOR_EVERY=0.5s: init seals
    what it wrote; after the activity stops the server keeps writing empty seals and anchors,
    and verify with a 2s bound stays clean. Stopped, its head ages: verify (on the host, with
    the key) names `stalled` until a server runs again; the stop itself, with nothing written
    meanwhile, leaves no trace."""
    from tests.serverproc import RegServer, server_env, team_policy

    env = server_env(tmp_path / "srv", catalog_url)
    env.update(REG_AUDIT_SEAL_EVERY="0.2s", REG_AUDIT_ANCHOR_EVERY="0.5s")
    server = RegServer(env, tmp_path / "srv").init()
    bounds = ("--max-unsealed-age", "2s", "--max-anchor-age", "2s")
    host = {k: v for k, v in env.items() if k != "REG_USER"} | {"REG_USER": "admin"}
    # init seals what it wrote: a server started long after would otherwise seal it late
    code, out, _ = verify(cli, env=host)
    assert code == 0 and out["unsealed"] == 0 and out["head"]["seq"] >= 2, out
    server.start()
    try:
        server.apply_policy(team_policy())
        client = server.client_env("admin")
        for who in ("alice", "bob"):
            assert cli("token", "create", who, env=client).returncode == 0
        time.sleep(3)  # quiet
        code, out, _ = verify(cli, *bounds, env=client)
        assert code == 0 and out["unsealed"] == 0, out["problems"]
        with Catalog(catalog_url).engine.connect() as c:
            beats = c.exec_driver_sql("SELECT count(*) FROM audit_seal WHERE count = 0").scalar()
        assert (beats or 0) >= 3 and out["newest_anchor"]["seq"] >= out["head"]["seq"] - 2, out
        server.stop()
        time.sleep(2.5)
        code, out, _ = verify(cli, *bounds, env=host)
        assert code == 1 and set(_kinds(out)) == {"stalled", "anchor-stale"}, out["problems"]
        assert "no server running" in _kinds(out)["stalled"][0]["message"]
        server.start()
        time.sleep(1.5)
        code, out, _ = verify(cli, *bounds, env=server.client_env("admin"))
        assert code == 0, out["problems"]
    finally:
        server.stop()
