"""`reg advise` on what a job really paid: heartbeats, failures and their lost work, planned
restarts, C_eff from step times, the CLI (table, JSON, plot, the `recovery` alias, `run
restart --planned`), the failure rate pooled over a project, MLflow metrics, and the same
through `reg server` with a viewer's read."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from registry import Registry
from registry.errors import NotFound, UsageError
from registry.training import CheckpointManager


def _state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(128, 1024, generator=g)}, "train_state": {"step": step}}


def _work() -> None:
    x = torch.ones(200, 200)
    for _ in range(5):
        x = x @ x / 200


def _attempt(
    run: str,
    until: int,
    *,
    every: int = 4,
    planned: bool = False,
    close: bool = False,
    project: str = "default",
) -> tuple[int | None, CheckpointManager]:
    """One attempt of a job: restore, train to `until` saving async every `every` steps, then
    crash (nothing closed: the manager is left as a SIGKILL would leave it) or close."""
    manager = CheckpointManager(run, project=project, heartbeat_s=0)
    state = _state(0)
    start = manager.restore(state, planned=planned)
    for step in range((start or 0) + 1, until + 1):
        _work()
        manager.step_done(step)
        if step % every == 0:
            manager.save(_state(step), step, async_=True)
    manager.wait()  # the last save committed: what a crash finds is deterministic
    if close:
        manager.close()
    else:
        manager.flush()  # the last heartbeat reached the registry before the crash
    return start, manager


def test_a_crash_is_a_failure_with_its_lost_work_and_a_planned_restart_is_not(clean_env: Path):
    _attempt("r", 11)  # saves 4 and 8, reaches 11, crashes
    start, _ = _attempt("r", 14)  # restores 8 (lost 9..11), reaches 14, crashes
    assert start == 8
    start, _ = _attempt("r", 17)  # restores 12 (lost 13, 14), reaches 17
    assert start == 12
    with Registry() as reg:
        reg.plan_restart("r")  # ... and is stopped on purpose
    start, _ = _attempt("r", 21, close=True)  # restores 16: planned; closes at 21
    assert start == 16
    start, _ = _attempt("r", 22, close=True)  # restores 20 after a close: a resume
    assert start == 20
    with Registry() as reg:
        kinds = [r["kind"] for s in (8, 12, 16, 20) for r in reg.show(f"r@step{s}")["restores"]]
        assert kinds == ["failure", "failure", "planned", "resume"]
        out = reg.advise("r")
        costs = reg.show("r@step4")["save_costs"]
    # Saved async with step times reported: C_eff = stall + interference (+ any wait).
    assert costs["c_eff_seconds"] >= costs["stall_seconds"]
    assert costs["steps_during"] >= 1 and "baseline_step_seconds" in costs
    fail = out["failures"]
    assert fail["count"] == 2 and fail["planned_restarts"] == 1
    assert [(e["reached_step"], e["restored_step"], e["lost_steps"]) for e in fail["events"]] == [
        (11, 8, 3),
        (14, 12, 2),
    ]
    # A planned restart and a resume lose work too (not failures): 17 -> 16 and 21 -> 20.
    assert [(e["kind"], e["lost_steps"]) for e in fail["other_losses"]] == [
        ("planned", 1),
        ("resume", 1),
    ]
    assert fail["lost_steps"] == 7 and all(e["lost_s"] > 0 for e in fail["events"])
    assert fail["exposure_gpu_hours"] > 0 and fail["rate_low"] < fail["rate_per_gpu_hour"]
    assert fail["rate_per_gpu_hour"] < fail["rate_high"]
    assert fail["mtbf_source"] == "measured: the run's failures"
    assert out["c_eff"]["source"] == "step times around saves"
    assert out["c_eff"]["median_s"] >= out["c_eff"]["stall_median_s"]
    assert out["rto"]["restores"] == 4 and out["rto"]["fetch_s"] > 0
    assert out["interval"]["current_steps"] == 4
    assert out["interval"]["advised_s"] == pytest.approx(out["interval"]["availability_s"])
    sim = out["simulation"]
    assert sim["exponential"]["difference_pct"] < 5
    assert sim["measured_gaps"]["gaps"] == 2 and sim["measured_gaps"]["censored_gaps"] == 1
    assert sim["measured_gaps"]["advised_capped_share"] == 0
    assert out["advice"].startswith(("Checkpoint", "Keep"))


def test_heartbeats_are_checked_and_wait_for_the_run(clean_env: Path):
    with Registry() as reg:
        assert reg.heartbeat("nope", step=1, seconds=1.0, world_size=1) == {"recorded": False}
        for bad in (
            {"step": -1, "seconds": 1.0, "world_size": 1},
            {"step": 1, "seconds": float("nan"), "world_size": 1},
            {"step": 1, "seconds": 1.0, "world_size": 0},
            {"step": 1, "seconds": 1.0, "world_size": 1, "saves": {"4": {"evil": 1.0}}},
        ):
            with pytest.raises(UsageError):
                reg.heartbeat("nope", **bad)
        with pytest.raises(NotFound):
            reg.plan_restart("nope")
        with pytest.raises(NotFound):
            reg.advise("nope")


def test_mtbf_override_fleet_and_the_cli(clean_env: Path, cli, tmp_path: Path):
    for run in ("a", "b"):
        _attempt(run, 9)
        _attempt(run, 10, close=True)
    with Registry() as reg:
        one = reg.advise("a")
        pooled = reg.advise("a", fleet=True)
        given = reg.advise("a", mtbf_s=7200.0, gpus=64)
    assert one["failures"]["count"] == 1 and one["failures"]["pooled_runs"] == 1
    assert pooled["failures"]["pooled_runs"] == 2
    assert pooled["failures"]["exposure_gpu_hours"] > one["failures"]["exposure_gpu_hours"]
    assert pooled["failures"]["mtbf_source"] == "measured: the project's runs pooled"
    assert given["failures"]["mtbf_source"] == "--mtbf" and given["gpus"] == 64
    assert given["interval"]["daly_s"] < given["interval"]["young_s"]

    plot = tmp_path / "waste.svg"
    res = cli("advise", "a", "--gpus", "8", "--plot", str(plot))
    assert res.returncode == 0, res.stderr
    for figure in (
        "C_eff",
        "RTO",
        "failures",
        "Young",
        "Daly",
        "availability optimum",
        "regret",
        "Monte Carlo, exponential",
        "Monte Carlo, measured gaps",
    ):
        assert figure in res.stdout
    assert plot.read_text().startswith("<svg") and res.stderr == ""
    res = cli("advise", "a", "--json")
    doc = json.loads(res.stdout)
    assert doc["run"] == "a" and doc["failures"]["count"] == 1 and res.stderr == ""
    res = cli("recovery", "a", "--mtbf", "2h", "--json")
    assert json.loads(res.stdout)["failures"]["mtbf_s"] == 7200
    assert res.stderr.strip().splitlines() == [
        "reg: `reg recovery` is deprecated and goes in the next release: use `reg advise`"
    ]
    for args, code in (
        (("advise", "a", "--mtbf", "0s"), 2),
        (("advise", "a", "--gpus", "0"), 2),
        (("advise", "a", "--plot", str(tmp_path / "x.png")), 2),
        (("advise", "nope"), 3),
        (("run", "restart", "a"), 2),
    ):
        res = cli(*args)
        assert res.returncode == code, (args, res.stderr)
        assert len(res.stderr.strip().splitlines()) == 1
    res = cli("run", "restart", "a", "--planned")
    assert res.returncode == 0 and "planned" in res.stdout


@pytest.mark.process
def test_economics_are_mirrored_to_mlflow(clean_env: Path):
    from mlflow import MlflowClient

    from registry.integrations.mirror.drain import drain

    _attempt("m", 9)
    _attempt("m", 10, close=True)
    with Registry() as reg:
        assert drain(reg.catalog, reg.settings, 120)["error"] is None
    import os

    client = MlflowClient(tracking_uri=os.environ["MLFLOW_TRACKING_URI"])
    exp = client.get_experiment_by_name("default")
    run_id = client.search_runs([exp.experiment_id])[0].info.run_id
    metrics = client.get_run(run_id).data.metrics
    assert {"reg.c_eff_s", "reg.rto_s", "reg.advised_interval_s"} <= set(metrics)
    assert metrics["reg.c_eff_s"] > 0 and metrics["reg.advised_interval_s"] > 0


@pytest.mark.timeout(300)
def test_through_reg_server_a_viewer_reads_and_a_trainer_reports(reg_server, cli):
    """The manager through `reg server` (heartbeats, a planned restore); `reg advise` as a
    viewer; a viewer's heartbeat or planned restart is refused."""
    _attempt("srv", 9)
    _attempt("srv", 10, planned=True, close=True)
    viewer = reg_server.client_env("vera")
    res = cli("advise", "srv", "--json", env=viewer)
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["failures"]["count"] == 0 and doc["failures"]["planned_restarts"] == 1
    assert doc["c_eff"]["source"] == "step times around saves"
    assert cli("run", "restart", "srv", "--planned", env=viewer).returncode == 4
    started = time.monotonic()
    res = cli("recovery", "srv", env=viewer)
    assert res.returncode == 0 and "deprecated" in res.stderr
    assert time.monotonic() - started < 60
