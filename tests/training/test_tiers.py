"""Tier 0: a training job's saves are committed on its nodes' local disks first and
copied to the store behind it. In-process tests check the catalog's side on SQLite and
PostgreSQL (the states, the guards, the copy's commit refusing what tier 0 did not record);
torchrun jobs on simulated nodes check the restores: from tier 0 after a SIGKILL, from the
store for a node that lost its copies, at another world size; and the same through `reg
server`, where the job holds no credentials and forged commits and copies are refused."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from sqlalchemy import text

from registry import Registry
from registry.errors import (
    Conflict,
    IntegrityError,
    NotFound,
    RegistryError,
    Unfinished,
    UsageError,
)
from registry.training import CheckpointManager
from tests.helpers import ROOT, torchrun


def _state(step: int) -> dict[str, Any]:
    torch.manual_seed(step)
    return {"model": {"w": torch.randn(64, 64)}, "train_state": {"step": step}}


def _manager(reg: Registry, local: Path, **kw: Any) -> CheckpointManager:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return CheckpointManager("tiered", registry=reg, local_dir=local, node_id="n0", **kw)


def _saved(mgr: CheckpointManager, step: int) -> dict[str, Any]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP: "torch.distributed is disabled"
        assert mgr.save(_state(step), step) is None  # returns once the bytes are durable
        view = mgr.wait()
    assert view is not None
    return view


def _sql(reg: Registry, statement: str) -> None:
    with reg.catalog.engine.begin() as c:  # type: ignore[attr-defined]
        c.execute(text(statement))


def _row_id(reg: Registry, step: int) -> int:
    with reg.catalog.engine.connect() as c:  # type: ignore[attr-defined]
        return int(c.execute(text(f"SELECT id FROM checkpoint WHERE step = {step}")).scalar_one())


def test_a_tier0_step_is_local_until_copied_and_the_catalog_guards_it(reg, tmp_path):
    local = tmp_path / "node"
    mgr = _manager(reg, local, replicate=False)
    view = _saved(mgr, 1)
    assert view["state"] == "local" and view["tier"] == 0 and view["world_size"] == 1
    shown = reg.show("tiered@step1")
    assert shown["state"] == "local"
    assert [(t["tier"], t["node"], t["held"], t["files"]) for t in shown["tiers"]] == [
        (0, "n0", True, 2)
    ]
    assert shown["save_costs"]["tier"] == 0 and shown["save_costs"]["ranks"][0]["node"] == "n0"
    assert [c["state"] for c in reg.list_checkpoints("tiered")] == ["local"]
    step_dir = local / "default" / "tiered" / "step-1"
    assert sorted(p.name for p in step_dir.iterdir()) == [
        ".metadata",
        "MANIFEST.json",
        "__0_0.distcp",
    ]
    # Nothing that reads the store takes it, and `@latest` is a step in the store.
    with pytest.raises(NotFound, match="is saved at tier 0 only .* not yet in the store"):
        reg.pull("tiered@step1", tmp_path / "pulled")
    with pytest.raises(NotFound, match="no committed checkpoints"):
        reg.show("tiered@latest")
    with (
        pytest.raises(Conflict, match=r"tiered@step1 is saved at tier 0 .* held by node\(s\) n0"),
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("ignore")
        CheckpointManager("tiered", registry=reg).save(_state(1), 1)  # a store save
    # The database refuses what the code never does to a tier-0 row.
    row = _row_id(reg, 1)
    for statement, message in (
        (f"UPDATE checkpoint SET state = 'pending' WHERE id = {row}", "moves only"),
        (f"UPDATE checkpoint SET bytes = 1 WHERE id = {row}", "immutable"),
        (f"UPDATE checkpoint SET manifest_version = 'v9' WHERE id = {row}", "immutable"),
        (f"UPDATE checkpoint SET manifest_sha256 = NULL WHERE id = {row}", "immutable"),
        (f"DELETE FROM checkpoint WHERE id = {row}", "never deleted"),
        (f"DELETE FROM checkpoint_tier WHERE checkpoint_id = {row}", "only while it is pending"),
        (f"DELETE FROM checkpoint_file WHERE checkpoint_id = {row}", "only while it is pending"),
    ):
        with pytest.raises(Exception, match=message):
            _sql(reg, statement)
    mgr.close()


def test_the_copy_to_the_store_commits_only_what_tier0_recorded(reg, tmp_path):
    """A node's copy changed after the save is not copied (the step stays at tier 0); a part
    record that names other bytes is refused by the commit; the real copy commits at tier 1
    and the store then holds exactly the recorded bytes."""
    from registry.core.refs import CheckpointRef
    from registry.lifecycle.checkpoints.shared import record_part
    from registry.lifecycle.checkpoints.tiers import claim_replication, commit_replicated
    from registry.lifecycle.transfer import Stored
    from registry.training.replicator import Job, Replicator
    from registry.training.tier_catalog import EmbeddedTiers

    local = tmp_path / "node"
    mgr = _manager(reg, local, replicate=False)
    _saved(mgr, 1)
    mgr.close()
    ref = CheckpointRef("default", "tiered", 1)
    step_dir = local / "default" / "tiered" / "step-1"
    shard = step_dir / "__0_0.distcp"
    files = [f for f in reg.show("tiered@step1")["files"]]
    records = _records(files)
    original = shard.read_bytes()
    shard.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))  # one bit flipped
    claim = claim_replication(reg.context, ref)
    copier = Replicator(EmbeddedTiers(reg), bytes_per_s=None, on_error="raise")
    job = Job(claim, step_dir, records, manifest=True, commit=True)
    with pytest.raises(RegistryError, match="not the file the save recorded"):
        copier.copy(job, commit=True)
    assert reg.show("tiered@step1")["state"] == "local"
    shard.write_bytes(original)
    # A writer's record naming other bytes than tier 0 recorded, or naming the recorded
    # bytes without putting them (a writer that "exits 0 without copying"): refused.
    for digest, message in (
        ("0" * 64, "is not the file tier 0 recorded"),
        (None, "not in the store"),
    ):
        claim = _retaken(reg, ref, claim)
        said = [Stored(claim.prefix + r.path, r.size, digest or r.sha256, False) for r in records]
        record_part(reg.context, claim, said)
        with pytest.raises(IntegrityError, match=message):
            commit_replicated(reg.context, claim, 1.0)
        assert reg.show("tiered@step1")["state"] == "local"
    claim = _retaken(reg, ref, claim)
    # The real copy, from scratch.
    Replicator(EmbeddedTiers(reg), bytes_per_s=None, on_error="raise").copy(
        Job(claim, step_dir, records, manifest=True, commit=True), commit=True
    )
    shown = reg.show("tiered@step1")
    assert shown["state"] == "committed"
    assert [(t["tier"], t["held"]) for t in shown["tiers"]] == [(0, True), (1, True)]
    out = reg.pull("tiered@step1", tmp_path / "pulled")
    assert (tmp_path / "pulled" / "__0_0.distcp").read_bytes() == original
    assert out["manifest_sha256"] == shown["manifest_sha256"]


def _records(files: list[dict[str, Any]]) -> list[Any]:
    from registry.formats.documents import FileRecord

    return [FileRecord(f["path"], f["size"], f["sha256"], f.get("rank")) for f in files]


def _retaken(reg: Registry, ref: Any, claim: Any) -> Any:
    """The claim given up, as a dead replicator's runs out; then taken over afresh."""
    from registry.catalog import claims
    from registry.lifecycle.checkpoints.tiers import claim_replication

    claims.expire(reg.catalog, claim.catalog_claim())
    with reg.catalog.engine.begin() as c:  # type: ignore[attr-defined]
        c.execute(text(f"UPDATE checkpoint SET claim_pid = NULL WHERE id = {claim.row_id}"))
    return claim_replication(reg.context, ref)


def test_a_node_keeps_its_newest_copies_and_every_copy_not_yet_in_the_store(reg, tmp_path):
    local = tmp_path / "node"
    run_dir = local / "default" / "tiered"
    mgr = _manager(reg, local, replicate=False, keep_local=1)
    for step in (1, 2, 3):
        _saved(mgr, step)
    assert sorted(p.name for p in run_dir.iterdir()) == ["step-1", "step-2", "step-3"]
    mgr.close()
    mgr = _manager(reg, local, keep_local=1)  # replicates: the older steps go once copied
    assert mgr.restore(_state(0)) == 3
    _saved(mgr, 4)
    mgr.wait(replicated=True)
    _saved(mgr, 5)  # its tier-0 commit evicts what is in the store, but the newest
    assert sorted(p.name for p in run_dir.iterdir()) == ["step-5"]
    mgr.close()
    shown = reg.show("tiered@step2")
    assert shown["state"] == "committed"
    assert [(t["tier"], t["held"]) for t in shown["tiers"]] == [(0, False), (1, True)]
    assert shown["tiers"][0]["evicted_at"] is not None


def test_a_save_of_a_step_at_tier0_never_writes_over_its_copy(reg, tmp_path):
    """A second save of step 1 (a restarted job that resumed from an older step) is written
    beside the recorded copy, refused when the step is claimed, and removed: the node's copy
    is the bytes the catalog recorded."""
    import hashlib

    local = tmp_path / "node"
    first = _manager(reg, local, replicate=False)
    _saved(first, 1)
    first.close()
    step_dir = local / "default" / "tiered" / "step-1"
    recorded = {f["path"]: f["sha256"] for f in reg.show("tiered@step1")["files"]}
    again = _manager(reg, local, replicate=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        again.save(_state(2), 1)  # other bytes, the same step
    with pytest.warns(UserWarning, match="tiered@step1 was not saved: .*is saved at tier 0"):
        assert again.wait() is None  # on_error="warn": said once, the loop goes on
    assert [f["step"] for f in again.failures] == [1]
    held = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in step_dir.iterdir()}
    assert {p: held[p] for p in recorded} == recorded
    assert sorted(p.name for p in step_dir.parent.iterdir()) == ["step-1"]  # no .partial left
    again.close()


def test_a_damaged_node_copy_is_neither_restored_nor_copied_and_the_step_is_lost(reg, tmp_path):
    """A bit flipped in the node's only copy of a step not yet in the store: the restore
    re-hashes it and says why it is skipped; no copy of the step is left, so it is lost
    (`ls`, `show`, `pull` agree), and saving the step again is a new attempt that commits."""
    local = tmp_path / "node"
    first = _manager(reg, local, replicate=False)
    _saved(first, 1)
    first.close()
    recorded = reg.show("tiered@step1")["files"]
    shard = local / "default" / "tiered" / "step-1" / "__0_0.distcp"
    data = shard.read_bytes()
    shard.write_bytes(data[:100] + bytes([data[100] ^ 1]) + data[101:])
    second = _manager(reg, local, replicate=False)
    assert second.restore(_state(0)) is None
    assert second.resume_notes == [
        "step 1 is not yet in the store, and node n0's copy is gone or damaged "
        "(__0_0.distcp: its sha256 is not the one recorded)"
    ]
    shown = reg.show("tiered@step1")
    assert (
        shown["state"] == "lost" and shown["resumable"] is False and "every node" in shown["lost"]
    )
    assert [(t["node"], t["held"]) for t in shown["tiers"]] == [("n0", False)]
    assert [(c["step"], c["state"], c["resumable"]) for c in reg.list_checkpoints("tiered")] == [
        (1, "lost", False)
    ]
    with pytest.raises(NotFound, match="tiered@step1 was lost: .*save the step again"):
        reg.pull("tiered@step1", tmp_path / "pulled")
    view = _saved(second, 1)  # the same step, a new attempt
    assert view["state"] == "local"
    again = reg.show("tiered@step1")
    assert [(t["node"], t["held"]) for t in again["tiers"]] == [("n0", True)]
    assert {f["path"]: f["sha256"] for f in again["files"]} != {
        f["path"]: f["sha256"] for f in recorded
    }
    with reg.catalog.engine.connect() as c:  # type: ignore[attr-defined]
        said = c.execute(text("SELECT action, target FROM audit_event")).all()
    assert ("lost", "tiered@step1") in [tuple(r) for r in said]
    second.close()


def test_an_async_save_over_the_staging_budget_is_saved_synchronously(reg, tmp_path):
    mgr = _manager(reg, tmp_path / "node", replicate=False, staging_budget_bytes=1024)
    with pytest.warns(UserWarning, match="exceed staging_budget_bytes=1024: saving synchronously"):
        mgr.save(_state(1), 1, async_=True)
    mgr.wait()
    assert reg.show("tiered@step1")["save_costs"]["async"] is False
    mgr.close()


def test_waits_for_copies_to_the_store_end_at_their_bound_and_name_what_runs(tmp_path):
    """A copy far slower than the bound (2 kB/s): `wait(replicated=True, timeout=...)` raises
    after it, naming the step and what it is doing, and `close()` gives up after
    `close_timeout_s` with one warning; the step stays at tier 0, as it was."""
    with Registry() as reg:
        mgr = _manager(reg, tmp_path / "node", replicate_bytes_per_s=2000, close_timeout_s=0.5)
        _saved(mgr, 1)
        started = time.monotonic()
        with pytest.raises(Unfinished, match=r"after 0.2 s \(step 1: copying this rank's files\)"):
            mgr.wait(replicated=True, timeout=0.2)
        with pytest.warns(UserWarning, match="close gave up waiting: copies to the store") as got:
            mgr.close()
        assert time.monotonic() - started < 5
        assert len([w for w in got if "gave up" in str(w.message)]) == 1
        assert reg.show("tiered@step1")["state"] == "local"


def test_with_on_error_raise_close_raises_what_it_gave_up_on_once_closed(tmp_path):
    with Registry() as reg:
        mgr = _manager(
            reg, tmp_path / "node", replicate_bytes_per_s=2000, close_timeout_s=0.2,
            on_error="raise",
        )  # fmt: skip
        _saved(mgr, 1)
        with pytest.raises(Unfinished, match="step 1: copying this rank's files"):
            mgr.close()
        with reg.catalog.engine.connect() as c:  # type: ignore[attr-defined]
            ended = c.execute(text("SELECT attempt_ended_at FROM run")).scalar_one()
        assert ended is not None  # the rest of close ran: the attempt's end was reported
    with pytest.raises(UsageError, match="close_timeout_s"):
        CheckpointManager("r", local_dir=tmp_path, close_timeout_s=0)


@pytest.mark.process
def test_ranks_of_one_node_with_different_local_dirs_are_refused_at_the_first_save(tmp_path):
    """`local_dir=f"/nvme/rank{rank}"` on one node: every rank stops at its first save with
    one line naming the slip, before a byte is written or a step claimed (it used to leave
    close() waiting an hour for the other rank's part)."""
    with pytest.raises(RuntimeError) as failed:
        torchrun(
            "examples.train_with_manager", 2,
            ["--run-name", "slip", "--steps", "2", "--local-dir", str(tmp_path / "nvme"),
             "--local-dir-per-rank"],
            attempts=1, env_extra={"PYTHONWARNINGS": "ignore"},
        )  # fmt: skip
    said = str(failed.value)
    assert "UsageError: ranks 0 and 1 of node" in said and "save to different local_dirs" in said
    assert "exitcode  : 1" in said  # every rank stopped, none hung
    assert not list((tmp_path / "nvme").rglob("*.distcp"))
    with Registry() as reg:
        assert reg.list_checkpoints("slip") == []


@pytest.fixture
def no_grace(tmp_path, monkeypatch):
    path = tmp_path / "policy.toml"
    path.write_text('[retention]\norphan_grace = "0s"\n')
    monkeypatch.setenv("REG_POLICY", str(path))
    return path


def test_a_tier0_step_evicted_before_the_store_had_it_is_lost_and_gc_clears_its_leftovers(
    no_grace, reg, tmp_path
):
    """Evicted before it reached the store (`evict_unreplicated`), nobody copying it: the
    eviction marks it lost at once; a lost step's partial copy in the store is GC's to delete
    (listed as `lost`), and the step with a copy stays."""
    from registry.core.layout import checkpoint_prefix

    mgr = _manager(reg, tmp_path / "node", replicate=False, keep_local=1, evict_unreplicated=True)
    _saved(mgr, 1)
    _saved(mgr, 2)
    mgr.close()
    assert reg.show("tiered@step1")["state"] == "lost"
    assert [t["held"] for t in reg.show("tiered@step1")["tiers"]] == [False]
    leftover = checkpoint_prefix("default", "tiered", 1) + "__0_0.distcp"
    reg.store.put_bytes(leftover, b"x" * 10)  # type: ignore[attr-defined]
    planned = reg.gc(dry_run=True)
    assert [(d["ref"], d["action"], d["bytes"]) for d in planned["decisions"]] == [
        ("tiered@step1", "lost", 10)
    ]
    out = reg.gc()
    assert [(d["ref"], d["action"]) for d in out["decisions"]] == [("tiered@step1", "lost")]
    assert "every node's copy was gone" in out["decisions"][0]["reason"]
    assert reg.store.head(leftover) is None  # type: ignore[attr-defined]
    assert reg.gc()["decisions"] == []  # nothing left to clear
    assert reg.show("tiered@step1")["state"] == "lost"
    assert reg.show("tiered@step2")["state"] == "local"


def test_bad_tier_settings_are_one_line(reg, tmp_path):
    with pytest.raises(RegistryError, match="on_error='ignore'"):
        _manager(reg, tmp_path, on_error="ignore")
    with pytest.raises(RegistryError, match="keep_local=0"):
        _manager(reg, tmp_path, keep_local=0)
    with pytest.raises(RegistryError, match="node_id"):
        CheckpointManager("r", registry=reg, local_dir=tmp_path, node_id="../up")
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(RegistryError, match="local_dir .*file"):
        CheckpointManager("r", registry=reg, local_dir=blocker / "sub")


# -- torchrun jobs on simulated nodes ------------------------------------------------------------


def _local() -> Path:
    return Path(os.environ["REG_HOME"]) / "nodes"  # kept with REG_HOME across a retried attempt


def _job(nproc: int, *args: str, killed: bool = False) -> None:
    torchrun(
        "examples.train_with_manager",
        nproc,
        ["--local-dir", str(_local()), *args],
        keep=Path(os.environ["REG_HOME"]),
        env_extra={"PYTHONWARNINGS": "ignore"},
        killed=killed,
    )


_UNINTERRUPTED: list[Any] = []  # the example's losses over 5 steps without a fault, per worker


def _uninterrupted(tmp_path: Path) -> Any:
    """The losses of the example's 2-rank job trained 5 steps with no fault: seeded, the same
    for every test, so a worker trains it once."""
    if not _UNINTERRUPTED:
        path = tmp_path / "straight.json"
        _job(2, "--run-name", "straight", "--until", "5", "--losses", str(path))
        _UNINTERRUPTED.append(json.loads(path.read_text()))
    return _UNINTERRUPTED[0]


def _states(run: str) -> dict[int, str]:
    with Registry() as reg:
        return {c["step"]: c["state"] for c in reg.list_checkpoints(run)}


@pytest.mark.process
def test_a_job_killed_before_its_copy_resumes_exactly_from_tier0(tmp_path, cli):
    """Async saves while the loop all-reduces every step; SIGKILL once step 3 is at tier 0
    with its copy crawling at 20 kB/s: the restart restores step 3 from the node's own copy
    (every byte read locally), copies the left steps to the store, and trains on with the
    same losses as a job never interrupted."""
    straight, cut = tmp_path / "straight.json", tmp_path / "cut.json"
    _job(2, "--run-name", "straight", "--until", "5", "--losses", str(straight))
    assert set(_states("straight").values()) == {"committed"}  # close() waits for the copy
    _UNINTERRUPTED[:] = [json.loads(straight.read_text())]
    slow = ["--replicate-rate", "20000"]
    _job(2, "--run-name", "cut", "--until", "5", "--async", *slow, "--kill-after-tier0", "3",
         "--losses", str(cut), killed=True)  # fmt: skip
    assert _states("cut") == {1: "local", 2: "local", 3: "local"}
    res = cli("pull", "cut@step3", tmp_path / "pulled")
    assert res.returncode != 0 and "Traceback" not in res.stderr
    assert "cut@step3 is saved at tier 0 only" in res.stderr.strip().splitlines()[-1]
    report = tmp_path / "report.json"
    _job(2, "--run-name", "cut", "--until", "5", "--async", "--losses", str(cut),
         "--report", str(report))  # fmt: skip
    assert json.loads(report.read_text())["resumed"] == 3
    assert json.loads(cut.read_text()) == json.loads(straight.read_text())
    assert _states("cut") == {s: "committed" for s in (1, 2, 3, 4, 5)}
    with Registry() as reg:
        (restore,) = reg.show("cut@step3")["restores"]
        costs = reg.show("cut@step4")["save_costs"]
    assert restore["phases"]["local_bytes"] == restore["phases"]["bytes"] > 0
    # the node's copy was re-hashed before it was read: a phase of its own, not the catalog's
    assert restore["phases"]["verify_seconds"] > 0
    # What the background hashing and commit cost the steps beside them reached the record.
    assert costs["tier"] == 0 and costs["async"] is True and "steps_during" in costs


@pytest.mark.process
def test_a_lost_node_loses_its_unreplicated_steps_and_the_job_saves_them_again(tmp_path, cli):
    """Steps 3 and 4 committed at tier 0, their copies crawling, every rank killed and the
    node's disk replaced: the restart resumes from step 2 (in the store), records both steps
    lost, saves them again as new attempts, and trains on exactly as a job never interrupted.
    (It crash-looped: each restart's save of step 3 was refused as "being copied".)"""
    straight, losses = _uninterrupted(tmp_path), tmp_path / "losses.json"
    _job(2, "--run-name", "gone", "--until", "2", "--losses", str(losses))
    _job(2, "--run-name", "gone", "--until", "5", "--async", "--replicate-rate", "20000",
         "--kill-after-tier0", "4", "--losses", str(losses), killed=True)  # fmt: skip
    assert _states("gone") == {1: "committed", 2: "committed", 3: "local", 4: "local"}
    shutil.rmtree(_local())  # the node's disk, replaced
    report = tmp_path / "report.json"
    _job(2, "--run-name", "gone", "--until", "5", "--async", "--losses", str(losses),
         "--report", str(report))  # fmt: skip
    assert json.loads(report.read_text())["resumed"] == 2
    assert json.loads(losses.read_text()) == straight
    assert _states("gone") == {s: "committed" for s in (1, 2, 3, 4, 5)}
    res = cli("audit", "--action", "lost", "--json")
    lost = [e["target"] for e in json.loads(res.stdout)]
    assert sorted(lost) == ["gone@step3", "gone@step4"]


@pytest.mark.process
def test_a_job_trains_through_a_store_outage_and_the_next_resumes_exactly(
    tmp_path, s3_env, s3_server, monkeypatch
):
    """S3 (SeaweedFS behind a proxy that drops every request) down for a whole 2-rank job: it
    saves steps 1-4 at tier 0, gives up waiting for their copies after its close bound and
    exits 0. The store back, the next job resumes from step 4 on the node, copies 1-4 to the
    store, and trains on exactly as a job never interrupted."""
    from tests.s3server import FaultyProxy

    proxy = FaultyProxy(s3_server.port, 0.0, kinds=("drop",)).start()
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")
    try:
        straight, losses = _uninterrupted(tmp_path), tmp_path / "losses.json"
        proxy.fault_rate = 1.0  # the store is gone
        started = time.monotonic()
        _job(2, "--run-name", "out", "--until", "4", "--async", "--close-timeout", "3",
             "--losses", str(losses))  # fmt: skip
        outage_job = time.monotonic() - started
        assert _states("out") == {1: "local", 2: "local", 3: "local", 4: "local"}
        proxy.fault_rate = 0.0  # back
        report = tmp_path / "report.json"
        _job(2, "--run-name", "out", "--until", "5", "--losses", str(losses),
             "--report", str(report))  # fmt: skip
    finally:
        proxy.stop()
    assert json.loads(report.read_text())["resumed"] == 4
    assert json.loads(losses.read_text()) == straight
    assert _states("out") == {s: "committed" for s in (1, 2, 3, 4, 5)}
    assert outage_job < 40, outage_job  # bounded: the close gave up after 3 s


@pytest.mark.process
def test_a_node_without_its_copies_reads_the_store_and_so_does_another_world_size(tmp_path):
    """Two simulated nodes: node1 loses its local directory; the restart restores step 3,
    node0's ranks from their own copies, node1's from the store, exactly. A job at world size
    3 then restores the same state from the store alone."""
    straight, losses = _uninterrupted(tmp_path), tmp_path / "losses.json"
    _job(2, "--run-name", "two", "--until", "3", "--nodes", "2", "--losses", str(losses))
    with Registry() as reg:
        tiers = reg.show("two@step3")["tiers"]
    assert [(t["tier"], t["node"], t["ranks"]) for t in tiers] == [
        (0, "node0", [0]),
        (0, "node1", [1]),
        (1, None, [0, 1]),
    ]
    shutil.rmtree(_local() / "node1")
    report, five = tmp_path / "report.json", tmp_path / "five.pt"
    _job(2, "--run-name", "two", "--until", "5", "--nodes", "2", "--losses", str(losses),
         "--report", str(report), "--dump", str(five))  # fmt: skip
    assert json.loads(report.read_text())["resumed"] == 3
    assert json.loads(losses.read_text()) == straight
    with Registry() as reg:
        (restore,) = reg.show("two@step3")["restores"]
    assert 0 < restore["phases"]["local_bytes"] < restore["phases"]["bytes"]
    three = tmp_path / "three.pt"
    _job(3, "--run-name", "two", "--steps", "0", "--nodes", "3", "--dump", str(three),
         "--report", str(report))  # fmt: skip
    assert json.loads(report.read_text())["resumed"] == 5
    saved, restored = torch.load(five, weights_only=True), torch.load(three, weights_only=True)
    for part in ("model", "optimizer"):
        assert _flat(saved[part]) == _flat(restored[part]), part
    with Registry() as reg:
        at_three = [r for r in reg.show("two@step5")["restores"] if r["world_size"] == 3]
    assert at_three and at_three[0]["phases"]["local_bytes"] == 0


def _flat(value: Any, where: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(_flat(v, f"{where}.{k}"))
        return out
    if isinstance(value, torch.Tensor):
        return {where: (value.dtype, value.shape, value.flatten().tolist())}
    return {where: value}


def _served(local: Path, **kw: Any) -> CheckpointManager:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return CheckpointManager("served", project="team-a", local_dir=local, node_id="n0", **kw)


@pytest.mark.process
def test_through_reg_server_tier0_and_its_copy_to_the_store(reg_server, tmp_path):
    """The job holds no catalog or store credentials: the server commits each save at tier 0
    from the job's records (each `.metadata` checked against its record), the copy goes
    through the server's push path (hashed there), and the tier-1 commit takes only what the
    server received. A restore reads the node's copy, or the store through the server; a step
    a dead job left at tier 0 is adopted and copied; what a token does not grant, it does not."""
    local = tmp_path / "node"
    mgr = _served(local)
    for step in (1, 2):
        _saved(mgr, step)
    mgr.wait(replicated=True)
    mgr.close()
    with Registry() as reg:  # a client of the server, as every call here
        shown = reg.show("team-a/served@step2")
        assert shown["state"] == "committed"
        assert [(t["tier"], t["node"]) for t in shown["tiers"]] == [(0, "n0"), (1, None)]
        reg.verify("team-a/served@step2")  # the server's own check of every stored byte
    # A save whose copy is off stays at tier 0; a restore reads it from the node alone.
    lazy = _served(local, replicate=False)
    _saved(lazy, 3)
    lazy.close()
    reader = _served(local, replicate=False)
    state = _state(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert reader.restore(state) == 3
    assert torch.equal(state["model"]["w"], _state(3)["model"]["w"])
    reader.close()
    # Bob (a trainer of team-b) may neither adopt the copy nor say a node dropped it; a viewer
    # may not commit at tier 0 with a claim token she holds no push right for.
    auth = {"authorization": f"Bearer {reg_server.token('bob')}"}
    for route, body in (
        ("/v1/tiers/adopt", {"ref": "team-a/served@step3"}),
        ("/v1/tiers/evicted", {"ref": "team-a/served@step3", "node": "n0"}),
        ("/v1/tiers/candidates", {"project": "team-a", "run": "served"}),
    ):
        got = httpx.post(f"{reg_server.url}{route}", json=body, headers=auth)
        assert got.status_code == 403, (route, got.text)
    # The next job (copies on) takes the stranded step over and copies it through the server.
    adopter = _served(local)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert adopter.restore(_state(0)) == 3
    adopter.wait(replicated=True)
    adopter.close()
    with Registry() as reg:
        assert reg.show("team-a/served@step3")["state"] == "committed"
    # The node lost its disk: the restore reads the store, through the server.
    shutil.rmtree(local)
    lost = _served(local)
    state = _state(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert lost.restore(state) == 3
    assert torch.equal(state["model"]["w"], _state(3)["model"]["w"])
    lost.close()


@pytest.mark.process
def test_through_reg_server_a_forged_tier0_commit_or_copy_is_refused(reg_server, tmp_path):
    """A `.metadata` other than the one recorded, a manifest other than the one tier 0
    recorded, and a copy's file with other bytes: each refused by the server in one line."""
    from registry.core.refs import CheckpointRef
    from registry.lifecycle.checkpoints.shared import SharedClaim
    from registry.training.tier_catalog import ServerTiers

    local = tmp_path / "node"
    mgr = _served(local, replicate=False)
    _saved(mgr, 1)
    mgr.close()
    step_dir = local / "team-a" / "served" / "step-1"
    with Registry() as reg:
        tiers = ServerTiers(reg)  # type: ignore[arg-type]
        files = _records(reg.show("team-a/served@step1")["files"])
        # A new claim on step 2, committed with step 1's records and another .metadata.
        claim = tiers.claim(CheckpointRef("team-a", "served", 2))
        forged = tmp_path / "forged"
        shutil.copytree(step_dir, forged)
        (forged / ".metadata").write_bytes((forged / ".metadata").read_bytes() + b"x")

        def commit(records: list[Any], directory: Path) -> Any:
            return tiers.commit_local(
                claim,
                records,
                directory=directory,
                nodes={"n0": ([0], [f.path for f in records])},
                world_size=1,
                metrics=None,
                costs={"tier": 0},
                upload_seconds=0.1,
                held=True,
            )

        with pytest.raises(IntegrityError, match="holds other bytes than its writer recorded"):
            commit(files, forged)
        # A path that would lead a restore out of the node's directory: refused.
        tricked = [*files[:-1], replace(files[-1], path="../../escape.distcp")]
        with pytest.raises(RegistryError, match="unsafe file path"):
            commit(tricked, step_dir)
        # The copy of step 1: a manifest or a shard other than tier 0's is refused.
        copy = tiers.adopt(CheckpointRef("team-a", "served", 1))
        assert isinstance(copy, SharedClaim)
        (forged / "MANIFEST.json").write_bytes(b"{}")
        with pytest.raises(IntegrityError, match="not the manifest tier 0 recorded"):
            tiers.put(copy, "MANIFEST.json", forged / "MANIFEST.json", None, lambda n: None)
        shard = next(f for f in files if f.path.endswith(".distcp"))
        with pytest.raises(IntegrityError, match="not the file __0_0.distcp tier 0 recorded"):
            tiers.put(copy, shard.path, forged / ".metadata", shard, lambda n: None)
        with pytest.raises(UsageError, match="is not a file its tier-0 save recorded"):
            tiers.put(copy, "extra.bin", forged / ".metadata", None, lambda n: None)
        with pytest.raises(IntegrityError, match="were not copied to the store"):
            tiers.commit_replicated(copy, 0.0)
        assert reg.show("team-a/served@step1")["state"] == "local"


@pytest.mark.process
def test_async_saves_beside_the_loops_collectives_need_their_own_group(tmp_path):
    """The same loop all-reduces on the default group every step while async saves persist:
    reg's saves (their collectives on a gloo group of their own) finish; a bare
    `dcp.async_save` on the default group deadlocks against the loop's all_reduce (each rank's
    watchdog ends it), which is why the manager never saves on the default group."""

    def job(mode: str) -> list[dict[str, Any]]:
        out = tmp_path / mode
        for _ in range(3):  # gloo on 2 cores now and then aborts a rank at start-up: again
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir()
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc-per-node=2", "-m", "tests.training.async_group_job", mode,
                   str(out)]  # fmt: skip
            env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
            env["PYTHONWARNINGS"] = "ignore"
            subprocess.run(cmd, env=env, capture_output=True, timeout=120, check=False)
            marks = sorted(out.glob("rank-*.json"))
            if len(marks) == 2:
                return [json.loads(m.read_text()) for m in marks]
        raise AssertionError(f"{mode}: the job never got both ranks into the loop")

    assert job("reg") == [{"done": True}, {"done": True}]
    hung = job("bare")
    assert all("hung_at" in m for m in hung), hung  # torch fixed it? then say so in the docs
    assert all(10 <= m["hung_at"] < 40 for m in hung)  # after the first save, before the end


# -- room at tier 0 -----------------------------------------------------------------------------


def _big(step: int) -> dict[str, Any]:
    torch.manual_seed(step)  # 1 MiB of tensors: the room check's margin is small beside it
    return {"model": {"w": torch.randn(512, 512)}, "train_state": {"step": step}}


def _saved_big(mgr: CheckpointManager, step: int) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mgr.save(_big(step), step)
        mgr.wait(replicated=True)


def test_a_save_that_does_not_fit_evicts_copies_the_store_holds_first(reg, tmp_path):
    """`keep_local=2` in room for two checkpoints: the third save evicts the oldest copy the
    store already holds before it writes (it used to need room for three)."""
    local = tmp_path / "node"
    mgr = _manager(reg, local, keep_local=2, local_budget_bytes=int(2.6 * (1 << 20)))
    for step in (1, 2, 3):
        _saved_big(mgr, step)
    assert sorted(local_steps(local)) == [2, 3]
    assert [(t["tier"], t["held"]) for t in reg.show("tiered@step1")["tiers"]] == [
        (0, False),
        (1, True),
    ]
    assert reg.show("tiered@step3")["save_costs"]["tier"] == 0
    assert mgr.failures == []
    mgr.close()


def test_a_save_with_no_room_at_tier0_goes_straight_to_the_store(reg, tmp_path):
    """Nothing at tier 0 may go (no step is in the store yet): the save that does not fit is
    written to the store, with one warning for the job; nothing is dropped, and saves that fit
    again go to tier 0."""
    local = tmp_path / "node"
    mgr = _manager(reg, local, replicate=False, local_budget_bytes=int(2.6 * (1 << 20)))
    for step in (1, 2):
        _saved_big(mgr, step)
    with pytest.warns(UserWarning, match=r"tiered@step3 cannot be saved at tier 0 .*no room"):
        view = mgr.save(_big(3), 3)  # a synchronous save to the store returns its view
    assert view is not None and view["state"] == "committed"
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        mgr.save(_big(4), 4, async_=True)
        assert mgr.wait()["state"] == "committed"  # type: ignore[index]
    assert not [w for w in said if "reg:" in str(w.message)]  # said once, for the job
    assert _states_of(reg) == {1: "local", 2: "local", 3: "committed", 4: "committed"}
    assert sorted(local_steps(local)) == [1, 2]
    restored = _big(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert mgr.restore(restored) == 4
    assert torch.equal(restored["model"]["w"], _big(4)["model"]["w"])
    mgr.close()


def test_a_full_tier0_filesystem_sends_saves_to_the_store_and_training_goes_on(reg, tmp_path):
    """A real 3 MiB tmpfs as the node's disk, room for two checkpoints, `keep_local=2`, no
    copies to the store: every save is committed somewhere, none raises, none says ENOSPC."""
    with _tmpfs(tmp_path / "tmpfs", "3m") as mount:
        mgr = _manager(reg, mount, replicate=False, keep_local=2)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            for step in range(1, 6):
                mgr.save(_big(step), step)
                mgr.wait()
        mgr.close()
        states = _states_of(reg)
        assert states == {1: "local", 2: "local", 3: "committed", 4: "committed", 5: "committed"}
        texts = [str(w.message) for w in said if "reg:" in str(w.message)]
        assert len([t for t in texts if "cannot be saved at tier 0" in t]) == 1
        assert not [t for t in texts if "not saved" in t or "No space" in t]


def test_a_tier0_disk_remounted_read_only_sends_saves_to_the_store_until_it_is_writable(
    reg, tmp_path
):
    """The node's disk remounted read-only mid-job (as a filesystem does after I/O errors):
    the save goes to the store with one warning naming why, and once the disk is writable
    again saves go to tier 0 again; nothing raises into the loop."""
    with _tmpfs(tmp_path / "tmpfs", "8m") as mount:
        mgr = _manager(reg, mount, replicate=False)
        _saved(mgr, 1)
        subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True)
        with pytest.warns(UserWarning, match=r"step2 cannot be saved at tier 0 .*Read-only"):
            view = mgr.save(_state(2), 2)
        assert view is not None and view["state"] == "committed"
        subprocess.run(["mount", "-o", "remount,rw", str(mount)], check=True)
        assert _saved(mgr, 3)["state"] == "local"
        mgr.close()
        assert _states_of(reg) == {1: "local", 2: "committed", 3: "local"}
        assert mgr.failures == []


@contextlib.contextmanager
def _tmpfs(mount: Path, size: str) -> Iterator[Path]:
    """A real tmpfs of `size` at `mount` (a node's small disk), unmounted after; the test
    skips, saying why, on a machine that cannot mount one (this one can, as root)."""
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)],
                          capture_output=True, text=True)  # fmt: skip
    if done.returncode != 0:
        pytest.skip(f"this machine cannot mount a tmpfs: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def _states_of(reg: Registry) -> dict[int, str]:
    return {c["step"]: c["state"] for c in reg.list_checkpoints("tiered")}


def local_steps(local: Path) -> list[int]:
    return [int(p.name[5:]) for p in (local / "default" / "tiered").glob("step-*")]


# -- the store down ------------------------------------------------------------------------------


def test_tier0_saves_go_on_while_the_store_is_down_and_are_copied_when_it_returns(
    s3_env, s3_server, monkeypatch, tmp_path
):
    """S3 (SeaweedFS behind a proxy that drops every request) goes down after the first save:
    the next saves still commit at tier 0 without touching the store, each in about the time
    of a bare save; one warning says the copies wait; when the store is back, every step left
    at tier 0 is copied by the same job, and a restore reads the newest."""
    from registry.training import replicator
    from tests.s3server import FaultyProxy

    monkeypatch.setattr(replicator, "RETRY_LATER_S", 0.5)
    monkeypatch.setattr(replicator, "BACKOFF_S", 0.05)
    proxy = FaultyProxy(s3_server.port, 0.0, kinds=("drop",)).start()
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")
    try:
        with Registry() as reg:
            mgr = _manager(reg, tmp_path / "node")
            _saved(mgr, 1)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                mgr.wait(replicated=True, timeout=60)
            proxy.fault_rate = 1.0  # the store is gone
            blocked = []
            with warnings.catch_warnings(record=True) as said:
                warnings.simplefilter("always")
                for step in (2, 3, 4):
                    started = time.monotonic()
                    mgr.save(_state(step), step)
                    view = mgr.wait()
                    blocked.append(time.monotonic() - started)
                    assert view is not None and view["state"] == "local"
                time.sleep(1.0)  # the copies fail, and wait to be retried
            assert max(blocked) < 5.0, blocked  # no store round trip in a save
            copies = [str(w.message) for w in said if "copying" in str(w.message)]
            assert len(copies) == 1 and "retried every" in copies[0], copies
            assert mgr.failures == []
            assert _states_of(reg) == {1: "committed", 2: "local", 3: "local", 4: "local"}
            proxy.fault_rate = 0.0  # back
            mgr.wait(replicated=True, timeout=60)
            assert _states_of(reg) == {s: "committed" for s in (1, 2, 3, 4)}
            mgr.close()
            shutil.rmtree(tmp_path / "node")  # read from the store alone
            again = _manager(reg, tmp_path / "node")
            restored = _state(0)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                assert again.restore(restored) == 4
            assert torch.equal(restored["model"]["w"], _state(4)["model"]["w"])
            again.close()
    finally:
        proxy.stop()


def test_a_new_attempt_at_a_lost_step_waits_while_gc_clears_its_leftovers(reg, tmp_path):
    """GC holds a lost step while it deletes what the step's copy left in the store: a save
    of the step meanwhile is refused (warned, recorded) rather than writing where GC deletes;
    once GC lets go, the step is saved again."""
    from registry.lifecycle.checkpoints.lost import hold_lost, release_lost

    mgr = _manager(reg, tmp_path / "node", replicate=False, keep_local=1, evict_unreplicated=True)
    _saved(mgr, 1)
    _saved(mgr, 2)  # evicts 1: lost
    assert reg.show("tiered@step1")["state"] == "lost"
    row = _row_id(reg, 1)
    with reg.catalog.session(write=True) as s:  # type: ignore[attr-defined]
        token = hold_lost(s, row)
    assert token is not None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mgr.save(_state(1), 1)
        assert mgr.wait() is None
    assert [f["step"] for f in mgr.failures] == [1]
    assert reg.show("tiered@step1")["state"] == "lost"
    with reg.catalog.session(write=True) as s:  # type: ignore[attr-defined]
        release_lost(s, row, token)
    assert _saved(mgr, 1)["state"] == "local"
    mgr.close()
