"""The shared protocols the lifecycles stand on: put-if-absent with reconciliation, the claim on
a pending row, named leases, and where the policy in force comes from."""

from __future__ import annotations

import threading
import uuid

import pytest

from registry import Registry
from registry.catalog import claims, leases
from registry.core.refs import CheckpointRef
from registry.errors import Conflict, PolicyError
from registry.lifecycle.checkpoints.commit import claim_step
from registry.lifecycle.transfer import OnMismatch, put_reconciled
from registry.storage import open_store


@pytest.fixture(params=["memory", "local"])
def store(request, tmp_path):  # type: ignore[no-untyped-def]
    if request.param == "memory":
        return open_store(f"memory://{uuid.uuid4().hex}")
    return open_store((tmp_path / "store").as_uri())


def test_put_reconciled_reuses_equal_bytes_and_writes_nothing(store, tmp_path):
    first = put_reconciled(store, "ckpt/k", data=b"same", on_mismatch=OnMismatch.CONFLICT)
    assert not first.reused
    src = tmp_path / "f"
    src.write_bytes(b"same")
    again = put_reconciled(store, "ckpt/k", path=src, on_mismatch=OnMismatch.CONFLICT)
    assert again.reused and again.sha256 == first.sha256
    assert store.get_bytes("ckpt/k") == b"same"


def test_put_reconciled_conflict_leaves_the_stored_bytes(store):
    store.put_bytes("ckpt/k", b"theirs")
    with pytest.raises(Conflict, match="ckpt/k exists with other content"):
        put_reconciled(store, "ckpt/k", data=b"mine", on_mismatch=OnMismatch.CONFLICT)
    with pytest.raises(Conflict):
        put_reconciled(
            store, "ckpt/k", produce=lambda write: write(b"mine"), on_mismatch=OnMismatch.CONFLICT
        )
    assert store.get_bytes("ckpt/k") == b"theirs"


def test_put_reconciled_replaces_only_after_its_guard(store, tmp_path):
    store.put_bytes("ckpt/k", b"leftover")
    asked: list[str] = []

    def refuse() -> None:
        asked.append("refuse")
        raise Conflict("lost the claim")

    with pytest.raises(Conflict, match="lost the claim"):
        put_reconciled(
            store, "ckpt/k", data=b"new", on_mismatch=OnMismatch.REPLACE, before_replace=refuse
        )
    assert asked == ["refuse"] and store.get_bytes("ckpt/k") == b"leftover"
    src = tmp_path / "f"
    src.write_bytes(b"new")
    done = put_reconciled(
        store,
        "ckpt/k",
        path=src,
        on_mismatch=OnMismatch.REPLACE,
        before_replace=lambda: asked.append("allow"),
    )
    assert asked == ["refuse", "allow"] and not done.reused
    assert store.get_bytes("ckpt/k") == b"new"
    with pytest.raises(TypeError):
        put_reconciled(store, "ckpt/x", data=b"a", path=src, on_mismatch=OnMismatch.CONFLICT)


def test_a_stale_claim_changes_hands_once_and_the_old_holder_can_no_longer_commit(reg):
    ref = CheckpointRef("default", "r", 1)
    old, _ = claim_step(reg.context, ref)
    with pytest.raises(Conflict, match=r"r@step1 is being pushed by tester"):
        claim_step(reg.context, ref)  # alive: our own pid holds it
    claims.expire(reg.catalog, old)
    results: list[object] = []

    def take() -> None:
        try:
            results.append(claim_step(reg.context, ref)[0])
        except Conflict as exc:
            results.append(exc)

    threads = [threading.Thread(target=take) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    won = [r for r in results if isinstance(r, claims.Claim)]
    assert len(won) == 1 and len(results) == 4, results
    assert not claims.still_held(reg.catalog, old) and claims.still_held(reg.catalog, won[0])
    with reg.catalog.session(write=True) as s:
        assert not claims.guarded_update(s, old, state="committed")
        assert claims.guarded_update(s, won[0], lease_until=0.0)


def test_a_claim_is_renewed_while_held_and_expired_when_the_work_fails(reg, monkeypatch):
    from registry.catalog.models import Checkpoint

    monkeypatch.setattr(claims, "LEASE_SECONDS", 0.4)  # renewed every 0.1 s
    claim, _ = claim_step(reg.context, CheckpointRef("default", "r", 2))

    def lease() -> float:
        with reg.catalog.session() as s:
            row = s.get(Checkpoint, claim.row_id)
            assert row is not None
            return float(row.lease_until or 0.0)

    with pytest.raises(RuntimeError), claims.held(reg.catalog, claim):
        before = lease()
        threading.Event().wait(0.5)
        assert lease() > before  # renewed by the heartbeat
        raise RuntimeError("the upload failed")
    assert lease() == 0.0  # the next attempt takes over at once


def test_one_holder_of_a_named_lease_at_a_time(reg):
    tokens: list[str | None] = []

    def take() -> None:
        tokens.append(leases.try_acquire(reg.catalog, "gc", "tester", 60)[0])

    threads = [threading.Thread(target=take) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    held = [t for t in tokens if t]
    assert len(held) == 1 and len(tokens) == 6
    token, holder = leases.try_acquire(reg.catalog, "gc", "other", 60)
    assert token is None and holder is not None and holder.holder == "tester"
    with leases.renewed(reg.catalog, "gc", held[0], 60):
        pass
    assert leases.try_acquire(reg.catalog, "gc", "other", 60)[0] is not None  # given back


def test_a_hold_protects_a_checkpoint_from_retention(reg, ckpts, tmp_path, monkeypatch):
    policy = tmp_path / "p.toml"
    policy.write_text('[retention]\nkeep_last = 1\nttl = "0s"\n')
    monkeypatch.setenv("REG_POLICY", str(policy))
    with Registry() as fresh:
        for step in (2, 4):
            fresh.push_checkpoint(ckpts.ws2.step_dir(step), run="r", step=step)
        show = fresh.show("r@step2")
        with leases.hold(fresh.catalog, "tester", _checkpoint_id(fresh, 2), "validate r@step2"):
            decisions = {d["ref"]: d["reason"] for d in fresh.gc()["decisions"]}
            assert decisions["r@step2"] == "kept: in validation or promotion"
        assert show["state"] == "committed"
        assert {d["ref"]: d["action"] for d in fresh.gc()["decisions"]}["r@step2"] == "delete"


def _checkpoint_id(reg, step: int) -> int:  # type: ignore[no-untyped-def]
    from registry.catalog import queries

    with reg.catalog.session() as s:
        _, row = queries.resolve_checkpoint(s, CheckpointRef("default", "r", step))
        return int(row.id)


def test_where_the_policy_comes_from(tmp_path, monkeypatch):
    home = tmp_path / "reg-home"
    home.mkdir(parents=True, exist_ok=True)
    with Registry() as reg:
        assert reg.policy.source.endswith("policies/default.toml")
    (home / "policy.toml").write_text("[retention]\nkeep_last = 4\n")
    with Registry() as reg:
        assert reg.policy.source == str(home / "policy.toml")
        assert reg.policy.retention.keep_last == 4
    own = tmp_path / "own.toml"
    own.write_text("[retention]\nkeep_last = 5\n")
    monkeypatch.setenv("REG_POLICY", str(own))
    with Registry() as reg:
        assert reg.policy.retention.keep_last == 5  # REG_POLICY wins over REG_HOME/policy.toml
        assert reg.context.principal.single_user
    own.write_text("[access]\ngrants = []\n")
    with Registry() as reg:
        assert reg.context.principal.single_user  # an empty list grants nothing
    monkeypatch.setenv("REG_POLICY", str(tmp_path / "missing.toml"))
    with pytest.raises(PolicyError, match="cannot read policy .*missing.toml"), Registry() as reg:
        reg.list_checkpoints()
    own.write_text("[access\nbroken")
    monkeypatch.setenv("REG_POLICY", str(own))
    with pytest.raises(PolicyError, match="not valid TOML"), Registry() as reg:
        reg.list_checkpoints()  # validated, not read as single-user mode
