"""A push killed midway, two pushes racing, a locked catalog: nothing committed is lost or
half-visible."""

from __future__ import annotations

import os
import re
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from registry import Registry
from registry.errors import NotFound
from tests.zygote import Running


def _reg_process(*args: str, fault: str | None = None) -> Running:
    return Running(args, fault=fault)


@pytest.mark.parametrize("fault", ["push-published", "push-manifest"])
def test_push_killed_before_commit_leaves_nothing_visible_and_push_again_completes(
    catalog_url, big_ckpt, tmp_path, fault
):
    src = big_ckpt.step_dir(1)
    step_dir = Path(os.environ["REG_HOME"]) / "store" / "ckpt" / "default" / "big" / "step-1"
    proc = _reg_process("push-ckpt", str(src), "--run", "big", "--step", "1", fault=fault)
    assert proc.wait(timeout=300) == -signal.SIGKILL, proc.err()
    # The files are in the store, under a claim nobody holds; no reader sees them.
    assert sorted(p.name for p in step_dir.iterdir()) == sorted(
        [f.name for f in src.iterdir()] + (["MANIFEST.json"] if fault == "push-manifest" else [])
    )
    with Registry() as reg:
        assert reg.list_checkpoints() == []
        with pytest.raises(NotFound):
            reg.show("big@step1")
        # The dead push's claim is taken over at once (same host, pid gone); leftovers reused.
        out = reg.push_checkpoint(src, run="big", step=1)
        assert out["state"] == "committed" and out["reused_files"] == len(out["files"])
        assert reg.verify("big@step1")["ok"]
        reg.pull("big@step1", tmp_path / "back")
    for f in src.iterdir():
        assert (tmp_path / "back" / f.name).read_bytes() == f.read_bytes()


def test_racing_pushes_of_different_content_have_one_winner(catalog_url, ckpts, tmp_path):
    sources = {"a": ckpts.ws2.step_dir(2), "b": ckpts.ws2.step_dir(4)}
    procs = {
        name: _reg_process("push-ckpt", str(src), "--run", "race", "--step", "7")
        for name, src in sources.items()
    }
    results = {name: (p.wait(timeout=300), p.err()) for name, p in procs.items()}
    codes = sorted(rc for rc, _ in results.values())
    assert codes == [0, 5], results
    loser = next(name for name, (rc, _) in results.items() if rc == 5)
    winner = "b" if loser == "a" else "a"
    stderr = results[loser][1].strip().splitlines()
    assert len(stderr) == 1 and stderr[0].startswith("reg: error: race@step7")
    with Registry() as reg:
        assert reg.verify("race@step7")["ok"]
        reg.pull("race@step7", tmp_path / "won")
    for f in sources[winner].iterdir():
        assert (tmp_path / "won" / f.name).read_bytes() == f.read_bytes()


def test_locked_sqlite_catalog_is_a_one_line_conflict(ckpts, cli):
    home = Path(os.environ["REG_HOME"])
    with Registry() as reg:
        reg.push_checkpoint(ckpts.ws2.step_dir(2), run="r", step=2)
    holder = sqlite3.connect(home / "catalog.db", isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        res = cli(
            "push-ckpt",
            ckpts.ws2.step_dir(4),
            "--run",
            "r",
            "--step",
            "4",
            env={"REG_BUSY_TIMEOUT": "1"},
        )
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert res.returncode == 5, res.stderr
    assert res.stderr.count("\n") == 1 and "locked by another process" in res.stderr
    with Registry() as reg:
        assert [c["step"] for c in reg.list_checkpoints()] == [2]
        reg.push_checkpoint(ckpts.ws2.step_dir(4), run="r", step=4)
        assert [c["step"] for c in reg.list_checkpoints()] == [2, 4]


def test_live_claim_is_a_conflict_naming_the_holder(reg, ckpts):
    """A pending claim whose holder is alive blocks a second push (exit 5, names the holder)."""
    from sqlmodel import select

    from registry.catalog.models import Checkpoint
    from registry.core.refs import CheckpointRef
    from registry.errors import Conflict
    from registry.lifecycle.checkpoints.commit import claim_step as _claim

    claim, existing = _claim(reg.context, CheckpointRef("default", "held", 1))
    assert existing is None
    with pytest.raises(Conflict, match=r"is being pushed by tester on .* \(pid \d+\)"):
        reg.push_checkpoint(ckpts.ws2.step_dir(2), run="held", step=1)
    with reg.catalog.session() as s:
        row = s.exec(select(Checkpoint).where(Checkpoint.id == claim.row_id)).one()
    assert row.state == "pending" and row.claim_token == claim.token


def test_a_failed_push_writes_nothing_after_it_gives_its_claim_back(reg, ckpts, monkeypatch):
    """One file fails while another is still being published: the push raises only once every
    write of its own has ended, so a later push that takes the step over is never overwritten."""
    import threading

    from registry.errors import IntegrityError
    from registry.storage import local

    running: list[str] = []
    failed = threading.Event()
    publish, stage = local._LocalStaged.publish, local.LocalStore._stage_file

    def held_publish(self):  # type: ignore[no-untyped-def]
        running.append(self.key)
        try:
            if self.key.endswith(".metadata"):  # still publishing when the other file fails
                assert failed.wait(30)
            return publish(self)
        finally:
            running.remove(self.key)

    def failing_stage(self, key, src, immutable, progress):  # type: ignore[no-untyped-def]
        if key.endswith("__1_0.distcp"):
            failed.set()
            raise IntegrityError(f"{src} changed while being copied")
        return stage(self, key, src, immutable, progress)

    monkeypatch.setattr(local._LocalStaged, "publish", held_publish)
    monkeypatch.setattr(local.LocalStore, "_stage_file", failing_stage)
    with pytest.raises(IntegrityError, match=r"__1_0.distcp changed while being pushed"):
        reg.push_checkpoint(ckpts.ws2.step_dir(2), run="r", step=7)
    assert running == []
    monkeypatch.undo()
    out = reg.push_checkpoint(ckpts.ws2.step_dir(4), run="r", step=7)  # takes over at once
    assert out["state"] == "committed" and reg.verify("r@step7")["ok"]


def test_many_files_do_not_exhaust_file_descriptors(ckpts, tmp_path, cli):
    """Staging holds a descriptor per file until it is published: only a bounded number of
    files are staged ahead of the claim."""
    import resource
    import shutil

    src = tmp_path / "many"
    shutil.copytree(ckpts.ws2.step_dir(2), src)
    for i in range(600):
        (src / f"extra-{i:04d}.bin").write_bytes(b"x" * 10)
    limits = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, limits[1]))
    try:
        res = cli("push-ckpt", src, "--run", "many", "--step", "1", "--json")
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, limits)
    assert res.returncode == 0, res.stderr
    with Registry() as reg:
        assert len(reg.show("many@step1")["files"]) == 603 and reg.verify("many@step1")["ok"]


def test_a_pull_sweeps_what_a_killed_pull_left_beside_its_destination(reg, ckpts, tmp_path):
    """A pull killed mid-download leaves its temp folder (named for host and pid); the next
    pull into that place removes it once that process is gone, and leaves a live one's."""
    import socket

    reg.push_checkpoint(ckpts.ws2.step_dir(2), run="r", step=2)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname())
    left = tmp_path / f".restore.reg-pull-{host}-{dead.pid}-0123abcd"
    live = tmp_path / f".restore.reg-pull-{host}-{os.getpid()}-4567cdef"
    other = tmp_path / f".restore.reg-pull-elsewhere-{dead.pid}-89abcdef"
    for folder in (left, live, other):
        folder.mkdir()
        (folder / "__0_0.distcp").write_bytes(b"partial")
    reg.pull("r@step2", tmp_path / "restore")
    assert not left.exists() and live.exists() and other.exists()
    assert reg.verify("r@step2")["ok"] and (tmp_path / "restore" / ".metadata").exists()
