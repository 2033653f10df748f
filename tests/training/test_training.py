"""The CheckpointManager in real torchrun jobs: every rank writes its files straight into the
store under one claim, rank 0 commits, and a later job (at the same or another world size)
resumes exactly."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from registry import Registry
from tests.helpers import torchrun


def _job(nproc: int, *args: str, killed: bool = False) -> None:
    """A job on nproc ranks. A retried attempt (gloo aborts now and then, even in teardown after
    the work is committed) starts from REG_HOME as it was, never from the failed attempt's saves."""
    torchrun(
        "examples.train_with_manager",
        nproc,
        list(args),
        keep=Path(os.environ["REG_HOME"]),
        env_extra={"PYTHONWARNINGS": "ignore"},
        killed=killed,
    )


def _steps(run: str) -> list[int]:
    with Registry() as reg:
        return [c["step"] for c in reg.list_checkpoints(run)]


def _assert_same(a: Any, b: Any, where: str = "") -> None:
    """Equal state dicts: the same keys, tensors equal bit for bit, other values equal."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), where
        for k in a:
            _assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


@pytest.mark.process
def test_save_and_resume_across_world_sizes(tmp_path: Path) -> None:
    _job(2, "--run-name", "mgr", "--steps", "2", "--report", str(tmp_path / "first.json"))
    first = json.loads((tmp_path / "first.json").read_text())
    assert first == {"resumed": None, "start": 0, "last": 2, "notes": []}
    with Registry() as reg:
        listed = reg.list_checkpoints("mgr")
        assert [c["step"] for c in listed] == [1, 2]
        assert all(c["world_size"] == 2 for c in listed)  # recorded, not inferred
        shown = reg.show("mgr@step2")
        assert shown["world_size_inferred"] is False
        assert shown["resumable"] is True  # model, optimizer, train_state, rng, dataloader
        costs = shown["save_costs"]
        assert costs["async"] is False and costs["world_size"] == 2
        assert [r["rank"] for r in costs["ranks"]] == [0, 1]
        assert all(r["bytes"] > 0 and r["files"] == 1 for r in costs["ranks"])
        assert costs["stall_seconds"] == costs["persist_seconds"] > 0
        assert costs["bytes"] == shown["bytes"]
    # A second job on 3 ranks resumes from step 2 (resharded) and continues.
    _job(3, "--run-name", "mgr", "--steps", "2", "--report", str(tmp_path / "second.json"))
    second = json.loads((tmp_path / "second.json").read_text())
    assert second["resumed"] == 2 and (second["start"], second["last"]) == (2, 4)
    # Rank 2 has no saved RNG or loader position: rank 0, where loops log, says so too.
    for cls in ("rng", "dataloader"):
        assert (
            f"rank 2: {cls}: saved for ranks 0-1, not for rank 2; it keeps its own"
            in (second["notes"])
        )
    assert _steps("mgr") == [1, 2, 3, 4]
    with Registry() as reg:
        assert reg.show("mgr@step4")["world_size"] == 3
        restores = reg.show("mgr@step2")["restores"]
    assert len(restores) == 1 and restores[0]["world_size"] == 3
    phases = restores[0]["phases"]
    assert {"metadata_seconds", "fetch_seconds", "load_reshard_seconds", "total_seconds"} <= set(
        phases
    )
    assert phases["first_step_seconds"] > 0 and phases["bytes"] > 0


def test_four_ranks_write_to_s3_without_local_files_and_three_restore_exactly(
    s3_env: str, tmp_path: Path, clean_env: Path
) -> None:
    """No shared disk: the store is S3 over HTTP, each rank's temp directory is its own, and
    nothing lands in any of them. A job at world size 3 restores the exact model and optimizer
    state the 4-rank job saved; the per-rank state of rank 3 is reported as not carried."""
    private = tmp_path / "private"
    four, three = tmp_path / "four.pt", tmp_path / "three.pt"
    _job(
        4, "--run-name", "wide", "--steps", "2", "--dump", str(four), "--private-tmp", str(private)
    )
    assert sorted(p.name for p in private.iterdir()) == ["rank0", "rank1", "rank2", "rank3"]
    staged = [p for p in private.rglob("*") if p.is_file()]
    assert staged == []  # nothing staged (torch makes an empty inductor cache directory)
    assert not (clean_env / "store").exists()  # the bytes went to S3 only
    with Registry() as reg:
        shown = reg.show("wide@step2")
    assert shown["uri"].startswith(s3_env) and shown["world_size"] == 4
    assert sorted(f["rank"] for f in shown["files"] if f["rank"] is not None) == [0, 1, 2, 3]
    assert [r["rank"] for r in shown["save_costs"]["ranks"]] == [0, 1, 2, 3]

    report = tmp_path / "report.json"
    _job(3, "--run-name", "wide", "--steps", "0", "--dump", str(three), "--report", str(report))
    saved = torch.load(four, weights_only=True)
    restored = torch.load(three, weights_only=True)
    _assert_same(saved["model"], restored["model"], "model")
    _assert_same(saved["optimizer"], restored["optimizer"], "optimizer")
    notes = json.loads(report.read_text())["notes"]
    assert "rng: the state of rank(s) 3 is not loaded (world size 3 now)" in notes
    assert "dataloader: the state of rank(s) 3 is not loaded (world size 3 now)" in notes


@pytest.mark.process
def test_exact_resume_after_every_rank_is_killed(tmp_path: Path) -> None:
    """Train 5 steps straight; train again to step 3 with async saves and SIGKILL every rank;
    restore and continue to 5: the same losses bit for bit (per-rank data generators and
    positions included)."""
    straight, cut = tmp_path / "straight.json", tmp_path / "cut.json"
    _job(2, "--run-name", "straight", "--until", "5", "--losses", str(straight))
    _job(
        2,
        "--run-name",
        "cut",
        "--until",
        "5",
        "--async",
        "--kill-after",
        "3",
        "--losses",
        str(cut),
        killed=True,
    )
    assert _steps("cut") == [1, 2, 3]
    assert sorted(json.loads(cut.read_text())) == ["1", "2", "3"]
    _job(2, "--run-name", "cut", "--until", "5", "--async", "--losses", str(cut))
    assert json.loads(cut.read_text()) == json.loads(straight.read_text())
    assert _steps("cut") == [1, 2, 3, 4, 5]
    with Registry() as reg:
        costs = reg.show("cut@step4")["save_costs"]
    assert costs["async"] is True
    assert 0 < costs["stall_seconds"] <= costs["persist_seconds"]
