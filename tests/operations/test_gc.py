"""`reg gc` against a real catalog and store: deletes, tombstones, protections, leases, crashes,
orphans, and GC racing pushes and a promotion in other processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from registry import Registry
from registry.errors import Collected, Conflict, PolicyError
from tests.conftest import ROOT
from tests.zygote import run_reg

AGGRESSIVE = (
    '[retention]\nkeep_last = 1\nttl = "0s"\norphan_grace = "0s"\n'
    '[promotion]\nrequire_device = "any"\n'
)


@pytest.fixture
def aggressive(tmp_path, monkeypatch):
    path = tmp_path / "policy.toml"
    path.write_text(AGGRESSIVE)
    monkeypatch.setenv("REG_POLICY", str(path))
    return path


def _push_steps(reg, ckpts, run="r", steps=(2, 4)):
    for step in steps:
        reg.push_checkpoint(ckpts.ws2.step_dir(step), run=run, step=step)


def _store_dir(reg, ref) -> Path:
    return Path(reg.show(ref)["uri"].removeprefix("file://"))


def test_gc_deletes_explains_and_leaves_tombstones(aggressive, reg, ckpts, tmp_path):
    _push_steps(reg, ckpts)
    old_dir = _store_dir(reg, "r@step2")
    dry = reg.gc(dry_run=True)
    assert not dry["applied"] and old_dir.exists()
    assert {d["ref"]: d["action"] for d in dry["decisions"]} == {
        "r@step2": "delete",
        "r@step4": "keep",
    }
    out = reg.gc()
    pushed_bytes = sum(f.stat().st_size for f in ckpts.ws2.step_dir(2).iterdir())
    assert out["applied"] and out["freed_bytes"] > pushed_bytes  # + its MANIFEST.json
    assert not old_dir.exists()
    assert [c["step"] for c in reg.list_checkpoints()] == [4]
    tomb = reg.show("r@step2")
    assert tomb["state"] == "deleted" and tomb["delete_reason"] == "deleted: older than ttl 0s"
    assert tomb["deleted_by"] == "tester"
    with pytest.raises(Collected, match="collected by retention at .* reason: deleted: older"):
        reg.pull("r@step2", tmp_path / "x")
    assert not (tmp_path / "x").exists()
    assert reg.gc()["freed_bytes"] == 0  # applying again changes nothing
    assert reg.verify("r@step4")["ok"]
    assert [e["action"] for e in reg.audit_log()].count("gc") == 1


def test_protections_hold_in_practice(aggressive, reg, ckpts, tmp_path):
    reg = reg
    _push_steps(reg, ckpts, steps=(2, 4))
    _push_steps(reg, ckpts, run="s", steps=(2, 4))
    reg.pin("r@step2")
    reg.pull("s@step2", tmp_path / "resume")  # s resumes from step 2
    out = reg.gc()
    reasons = {d["ref"]: d["reason"] for d in out["decisions"]}
    assert reasons["r@step2"] == "kept: pinned"
    assert reasons["s@step2"] == "kept: s last resumed from it"
    # A newer commit of s lifts the resume protection.
    reg.push_checkpoint(ckpts.ws3.step_dir(3), run="s", step=6)
    out = reg.gc()
    assert {d["ref"]: d["action"] for d in out["decisions"]}["s@step2"] == "delete"


def test_release_sources_are_kept(aggressive, reg, ckpts):
    _push_steps(reg, ckpts)
    reg.promote("r@step2", model="tiny")
    out = reg.gc()
    assert {d["ref"]: d["reason"] for d in out["decisions"]}[
        "r@step2"
    ] == "kept: source of release tiny:v1"


def test_one_gc_at_a_time(aggressive, reg, ckpts):
    from registry.catalog import leases
    from registry.lifecycle.retention import GC_LEASE, acquire

    token = acquire(reg.context)
    try:
        with pytest.raises(Conflict, match=r"another GC is running: tester on .* since"):
            reg.gc()
    finally:
        leases.release(reg.catalog, GC_LEASE, token)
    reg.gc()


def test_gc_killed_after_marking_is_finished_by_the_next_run(aggressive, catalog_url, big_ckpt):
    with Registry() as reg:
        for step in range(1, 5):
            reg.push_checkpoint(big_ckpt.step_dir(1), run="big", step=step)
    proc = run_reg("gc", fault="gc-marked")
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    store = Path(os.environ["REG_HOME"]) / "store" / "ckpt" / "default" / "big"
    with Registry() as reg:
        states = {c["step"]: c["state"] for c in reg.list_checkpoints(include_deleted=True)}
        assert states == {1: "deleting", 2: "deleting", 3: "deleting", 4: "committed"}
        assert sorted(p.name for p in store.iterdir()) == [f"step-{s}" for s in range(1, 5)]
        assert [c["step"] for c in reg.list_checkpoints()] == [4]  # marked: no longer visible
        reg.gc()
        remaining = reg.list_checkpoints(include_deleted=True)
        assert {c["step"]: c["state"] for c in remaining} == {
            1: "deleted",
            2: "deleted",
            3: "deleted",
            4: "committed",
        }
        assert sorted(p.name for p in store.iterdir()) == ["step-4"]
        assert reg.verify("big@step4")["ok"]


def test_orphans_are_swept(aggressive, reg, ckpts):
    from registry.catalog import claims
    from registry.core.refs import CheckpointRef
    from registry.lifecycle.checkpoints.commit import claim_step as _claim

    claim, _ = _claim(reg.context, CheckpointRef("default", "dead", 1))
    reg.store.put_bytes("ckpt/default/dead/step-1/__0_0.distcp", b"half an upload")
    claims.expire(reg.catalog, claim)
    out = reg.gc()
    assert out["orphans"] == ["ckpt/default/dead/step-1/"]
    assert reg.store.head("ckpt/default/dead/step-1/__0_0.distcp") is None


def test_malformed_policy_is_a_one_line_error(tmp_path, monkeypatch, cli):
    bad = tmp_path / "bad.toml"
    bad.write_text('[retention]\nkeep_last = 3\nttl = "seven days"\n')
    monkeypatch.setenv("REG_POLICY", str(bad))
    res = cli("gc", "--dry-run")
    assert res.returncode == 2
    assert res.stderr.strip() == (
        f"reg: error: {bad}:3: retention.ttl: expected a duration like "
        "'7d', '24h', '0s' or 'never', got 'seven days' "
        "(see policies/default.toml)"
    )
    bad.write_text("[retention]\nkeep_lats = 3\n")
    with (
        pytest.raises(PolicyError, match=r"bad.toml:2: retention.keep_lats: Extra inputs"),
        Registry() as reg,
    ):
        reg.gc(dry_run=True)


def test_gc_every_emits_json_lines_and_stops_on_sigterm(aggressive, reg, ckpts):
    _push_steps(reg, ckpts)
    proc = subprocess.Popen(
        [sys.executable, "-m", "cli", "gc", "--every", "1s"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    first = json.loads(proc.stdout.readline())
    second = json.loads(proc.stdout.readline())
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    assert first["ok"] and first["deleted"] == 1 and second["deleted"] == 0


def test_gc_racing_pushes_and_a_promotion(aggressive, catalog_url, ckpts):
    """GC in a loop while other processes push new steps and promote: a committed checkpoint
    is never deleted before a newer one exists, and a release source is never deleted."""
    with Registry() as reg:
        reg.push_checkpoint(ckpts.ws2.step_dir(2), run="race", step=0)
    pusher = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys\nfrom registry import Registry\n"
            "with Registry() as reg:\n"
            "    for step in range(1, 9):\n"
            f"        reg.push_checkpoint({str(ckpts.ws2.step_dir(2))!r}, run='race', step=step)\n"
            "        if step == 4:\n"
            "            reg.promote('race@step4', model='racer')\n",
        ],
        cwd=ROOT,
        stderr=subprocess.PIPE,
        text=True,
    )
    gcs = []
    while pusher.poll() is None:
        done = run_reg("gc")
        gcs.append((done.returncode, done.stderr))
    assert pusher.returncode == 0, pusher.stderr.read()
    with Registry() as reg:
        reg.gc()
        states = {c["step"]: c["state"] for c in reg.list_checkpoints(include_deleted=True)}
        assert states[8] == "committed" and states[4] == "committed"
        assert reg.verify("race@step8")["ok"] and reg.verify("racer:v1")["ok"]
        assert all(s in ("committed", "deleted") for s in states.values())
        for step, state in states.items():
            path = reg.settings.home / "store" / "ckpt" / "default" / "race" / f"step-{step}"
            assert path.exists() == (state == "committed"), (step, state)
    assert gcs and all(rc == 0 or (rc == 5 and b"another GC" in err) for rc, err in gcs), gcs


def test_an_orphan_that_cannot_be_deleted_keeps_its_step_until_a_later_gc(
    aggressive, reg, ckpts, monkeypatch
):
    from registry.catalog import claims
    from registry.core.refs import CheckpointRef
    from registry.lifecycle.checkpoints.commit import claim_step
    from registry.storage import local

    claim, _ = claim_step(reg.context, CheckpointRef("default", "dead", 1))
    for name in ("MANIFEST.json", "__0_0.distcp", "__1_0.distcp"):
        reg.store.put_bytes(f"ckpt/default/dead/step-1/{name}", b"left by a dead push")
    claims.expire(reg.catalog, claim)
    delete = local.LocalStore._delete

    def stuck(self, key):  # type: ignore[no-untyped-def]
        if key.endswith("__1_0.distcp"):
            raise PermissionError(13, "Operation not permitted", key)
        return delete(self, key)

    monkeypatch.setattr(local.LocalStore, "_delete", stuck)
    out = reg.gc()
    assert out["orphans"] == [] and "could not delete" in out["errors"][0]
    assert reg.store.head("ckpt/default/dead/step-1/MANIFEST.json") is None  # manifest first
    with pytest.raises(Conflict, match="abandoned upload of dead@step1 is being swept"):
        reg.push_checkpoint(ckpts.ws2.step_dir(2), run="dead", step=1)
    monkeypatch.undo()
    assert reg.gc()["orphans"] == ["ckpt/default/dead/step-1/"]
    assert list(reg.store.list("ckpt/default/dead/")) == []
    assert reg.push_checkpoint(ckpts.ws2.step_dir(2), run="dead", step=1)["state"] == "committed"


def test_a_pull_racing_a_collection_says_collected(aggressive, reg, ckpts, tmp_path, monkeypatch):
    _push_steps(reg, ckpts)
    import threading

    from registry.storage import local

    get_file, collected, once = local.LocalStore._get_file, [], threading.Lock()

    def racing(self, key, dest, progress, version):  # type: ignore[no-untyped-def]
        with once:  # the first file to start downloading runs one GC
            if not collected:
                collected.append(reg.gc())  # retention deletes r@step2 while it is being pulled
        return get_file(self, key, dest, progress, version)

    monkeypatch.setattr(local.LocalStore, "_get_file", racing)
    with pytest.raises(Collected, match=r"r@step2 was collected by retention") as info:
        reg.pull("r@step2", tmp_path / "out")
    assert info.value.exit_code == 3
    assert {d["ref"]: d["action"] for d in collected[0]["decisions"]}["r@step2"] == "delete"
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.reg-pull-*"))


def test_a_committed_file_named_like_a_temp_file_survives_the_sweep(
    aggressive, reg, ckpts, tmp_path
):
    import shutil

    src = tmp_path / "ckpt"
    shutil.copytree(ckpts.ws2.step_dir(4), src)
    (src / ".__0_0.distcp.tmp-0123456789ab").write_bytes(b"a file the trainer wrote")
    reg.push_checkpoint(src, run="t", step=4)
    out = reg.gc()
    assert out["orphans"] == [] and out["errors"] == []
    assert reg.verify("t@step4")["ok"]
    assert ".__0_0.distcp.tmp-0123456789ab" in {f["path"] for f in reg.show("t@step4")["files"]}
