"""The review of `reg advise`, one test per finding: a clean run's MTBF (the prior,
not the rate's bound), heartbeats off the training loop, C_eff without eval or RPC time,
collected checkpoints still counted, the resampled Monte Carlo's censored tail and capped
trials, preemptions and crash loops, heartbeat lockout and input abuse, the heartbeat floor,
the `reg recovery --json` keys, a known injected interference measured back, and `optimal`
for tiny C/M."""

from __future__ import annotations

import importlib
import json
import math
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from registry import Registry
from registry.core.refs import CheckpointRef
from registry.economics import model, simulate
from registry.economics.advise import summary
from registry.economics.facts import RunFacts
from registry.errors import UsageError
from registry.training import CheckpointManager
from registry.training import manager as manager_mod
from registry.training import saves as saves_mod
from tests.economics.test_advise import _attempt

advise_mod = importlib.import_module("registry.economics.advise")

# -- 1. a clean run: the prior MTBF, the bound as a range; MLflow agrees -------------------------


def saved_every_100(stall_s: float, c_eff_s: float) -> list[SimpleNamespace]:
    """Checkpoints at steps 100..1000, each with these save costs."""
    return [
        SimpleNamespace(
            step=s,
            state="committed",
            world_size=1,
            bytes=1000,
            upload_seconds=None,
            committed_at=float(s),
            created_at=float(s),
            save_costs={"async": True, "stall_seconds": stall_s, "c_eff_seconds": c_eff_s},
        )
        for s in range(100, 1100, 100)
    ]


def failure(
    restored: int, reached: int, at: float, step_s: float | None = 1.0
) -> tuple[int, SimpleNamespace]:
    """A failure restore from step `restored`, after the run reached `reached`, at `at`
    (seconds and GPU-seconds); 5 s to fetch."""
    return restored, SimpleNamespace(
        kind="failure",
        reached_step=reached,
        created_at=at,
        gpu_seconds=at,
        step_seconds=step_s,
        phases={"fetch_seconds": 5.0},
    )


def _facts(name: str, *, gpu_s: float, failures: list[tuple[int, int, float]] = ()) -> RunFacts:
    """A run saved every 100 steps of 1 s, C_eff 10 s; failures: (restored, reached, gpu_s)."""
    run = SimpleNamespace(step_seconds=1.0, last_step=1000, gpu_seconds=gpu_s, name=name)
    ckpts = saved_every_100(2.0, 10.0)
    restores = [failure(*f) for f in failures]
    facts = RunFacts("default", run)  # type: ignore[arg-type]
    facts.checkpoints, facts.restores = ckpts, restores  # type: ignore[assignment]
    return facts


def test_a_clean_run_is_advised_with_the_prior_and_mlflow_agrees() -> None:
    facts = _facts("clean", gpu_s=3 * 3600.0)  # 3 GPU-hours, no failure
    out = advise_mod._compose(
        "clean", facts, [facts], gpus=None, mtbf_s=None, fleet=False, trials=200
    )
    fail = out["failures"]
    assert fail["mtbf_s"] == advise_mod.ASSUMED_MTBF_S and "prior" in fail["mtbf_source"]
    assert fail["mtbf_low_s"] > 0 and fail["mtbf_high_s"] is None  # the bound: a range
    assert out["interval"]["advised_s"] == pytest.approx(model.optimal(10.0, 86400.0), abs=0.01)
    assert summary(facts)["advised_interval_s"] == pytest.approx(
        out["interval"]["advised_s"], abs=0.01
    )
    # --fleet with failures elsewhere: those, pooled
    other = _facts("other", gpu_s=7200.0, failures=[(100, 150, 3600.0), (200, 230, 7000.0)])
    pooled = advise_mod._compose(
        "clean", facts, [facts, other], gpus=None, mtbf_s=None, fleet=True, trials=200
    )
    assert pooled["failures"]["mtbf_source"] == "measured: the project's runs pooled"
    assert pooled["failures"]["mtbf_s"] == pytest.approx(5 * 3600 / 2, rel=1e-3)


# -- 2, 3, 7, 9, 11: the manager's heartbeats and step timings (a fake clock and backend) ------


class _Backend:
    def __init__(self, *, block: threading.Event | None = None, fail: bool = False) -> None:
        self.block, self.fail = block, fail
        self.beats: list[dict[str, Any]] = []
        self.restores: list[Any] = []

    def heartbeat(self, ref: Any, **figures: Any) -> dict[str, Any]:
        if self.block is not None:
            self.block.wait(5)
        if self.fail:
            raise ValueError("not a RegistryError")
        self.beats.append(figures)
        return {"recorded": True}

    def restored(self, ref: Any, world_size: int, phases: dict[str, float]) -> None:
        if self.fail:
            raise KeyError("boom")
        self.restores.append(ref)

    def plan_restart(self, ref: Any) -> None:
        pass


class _Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _manager(backend: _Backend, heartbeat_s: float = 30.0) -> CheckpointManager:
    m = CheckpointManager("fake", heartbeat_s=heartbeat_s)
    m._backend = backend  # type: ignore[assignment]
    m._saved_any = True
    return m


def _join(m: CheckpointManager) -> None:
    if m._beat_thread is not None:
        m._beat_thread.join(5)


def test_heartbeats_never_block_or_break_the_training_loop() -> None:
    gate = threading.Event()
    m = _manager(_Backend(block=gate), heartbeat_s=1.0)
    m._flushed_at -= 10  # a heartbeat is due
    started = time.monotonic()
    for step in range(1, 50):
        m.step_done(step)  # the first starts a beat that hangs; the rest drop theirs
    assert time.monotonic() - started < 0.5
    assert m._beat_in_flight()
    gate.set()
    _join(m)
    assert len(m._backend.beats) == 1  # type: ignore[union-attr]

    broken = _manager(_Backend(fail=True), heartbeat_s=1.0)
    broken._restore = saves_mod.RestoreRecord(
        CheckpointRef("default", "fake", 4),
        {"total_seconds": 1.0},
        False,
    )
    broken._flushed_at -= 10
    with pytest.warns(UserWarning, match="heartbeat of fake failed"):
        broken.step_done(5)  # the restore's record and the beat raise on the thread: warned
        _join(broken)
    broken.close(status=None)  # nothing reaches the caller either


def test_heartbeat_floor_and_a_long_outage_are_clamped() -> None:
    from registry.economics.records import MAX_HEARTBEAT_SECONDS, MAX_SAVES

    assert CheckpointManager("x", heartbeat_s=0).heartbeat_s == 1.0
    backend = _Backend()
    m = _manager(backend)
    m._flushed_at -= 30 * 86400  # a month without a recorded heartbeat
    m._finished = {str(s): {"steps_during": 1.0} for s in range(100)}
    m.step_done(1)
    _join(m)
    beat = backend.beats[-1]
    assert beat["seconds"] == MAX_HEARTBEAT_SECONDS and len(beat["saves"]) == MAX_SAVES
    m.flush()
    assert len(backend.beats[-1]["saves"]) == 100 - MAX_SAVES and not m._finished


def test_a_known_interference_is_measured_back_without_eval_or_the_save(monkeypatch) -> None:
    """Steps of 1 s; eval of 2 s between step_done and save; a save that stalls 0.5 s; the 5
    steps it overlaps are each 0.2 s slower: the interference is 1.0 s (within 25%)."""
    clock = _Clock()
    monkeypatch.setattr(manager_mod, "_now", clock)
    m = _manager(_Backend())
    done = threading.Event()
    future = SimpleNamespace(done=done.is_set)

    def fake_save(state, step, metrics, async_, per_rank, entered):  # type: ignore[no-untyped-def]
        clock.t += 0.5  # the stall
        save = SimpleNamespace(future=future)
        m._tracking.append(saves_mod.Track(save, step))  # type: ignore[arg-type]

    monkeypatch.setattr(m, "_save", fake_save)
    for step in range(1, 11):
        clock.t += 1.0
        m.step_done(step)
    clock.t += 2.0  # eval and logging after step_done(10), before save
    m.save({}, 10, async_=True)
    for step in range(11, 16):
        clock.t += 1.2  # the injected slowdown: 0.2 s a step while the save persists
        m.step_done(step)
    done.set()
    clock.t += 1.0
    m.step_done(16)  # finds the save finished
    _join(m)
    figures = m._finished.get("10") or m._backend.beats[-1]["saves"]["10"]  # type: ignore[union-attr]
    assert figures["interference_seconds"] == pytest.approx(1.0, rel=0.25)
    assert figures["baseline_step_seconds"] == pytest.approx(1.0)


# -- 4, 6, 10: through the catalog ---------------------------------------------------------------


def test_collected_checkpoints_still_count_and_recovery_keeps_its_json(clean_env: Path, cli):
    from sqlmodel import select

    from registry.catalog.models import DELETED, DELETING, Checkpoint

    _attempt("gc", 13)  # saves 4, 8, 12
    with Registry() as reg:
        before = reg.advise("gc")
        with reg.context.catalog.session(write=True) as s:
            row = s.exec(select(Checkpoint).where(Checkpoint.step == 8)).one()
            row.state = DELETING  # retention collected it
            s.add(row)
            s.flush()
            row.state = DELETED
            s.add(row)
        after = reg.advise("gc")
    assert before["interval"]["current_steps"] == after["interval"]["current_steps"] == 4
    assert after["c_eff"]["saves"] == before["c_eff"]["saves"] == 3
    res = cli("recovery", "gc", "--json")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    for key in ("save_cost_seconds", "transfer_rate_bytes_per_second", "rto_seconds"):
        assert key in doc
    assert doc["mtbf_seconds"] == advise_mod.ASSUMED_MTBF_S
    assert doc["save_cost_seconds"] == after["c_eff"]["median_s"]
    assert isinstance(doc["advice"], list) and doc["advice"] == [after["advice"]]


def test_a_crash_loop_is_one_failure_and_a_preemption_loses_work(clean_env: Path):
    _attempt("loop", 11)  # saves 4, 8; reaches 11; crashes
    _attempt("loop", 8)  # restores 8 (a failure: 11 > none before); dies before a step
    _attempt("loop", 8)  # restores 8 again, never advanced: a retry, not a second failure
    start, m = _attempt("loop", 14)  # restores 8; saves 12; reaches 14
    assert start == 8
    m.close("killed")  # SIGTERM: the attempt ended, but steps 13-14 are lost
    start, _ = _attempt("loop", 16, close=True)
    assert start == 12
    with Registry() as reg:
        out = reg.advise("loop")
    fail = out["failures"]
    assert fail["count"] == 1 and fail["events"][0]["lost_steps"] == 3
    assert [(e["kind"], e["reached_step"], e["lost_steps"]) for e in fail["other_losses"]] == [
        ("resume", 14, 2)
    ]
    assert fail["lost_steps"] == 5


# -- 8: heartbeat inputs -------------------------------------------------------------------------


def test_heartbeat_inputs_are_bounded_and_seconds_clamped(clean_env: Path):
    started = time.time()
    _attempt("hb", 5)
    ok = {"step": 5, "seconds": 1.0, "world_size": 1}
    with Registry() as reg:
        for bad in (
            {"step": 2**63},
            {"world_size": 10**6 + 1},
            {"saves": {"²": {"steps_during": 1.0}}},  # a unicode digit: int() fails
            {"saves": {"٣": {"steps_during": 1.0}}},
            {"saves": {str(2**63): {"steps_during": 1.0}}},
        ):
            with pytest.raises(UsageError):
                reg.heartbeat("hb", **(ok | bad))
        got = reg.heartbeat("hb", **(ok | {"seconds": 6 * 86400.0}))
        # the registry's clock since the run's previous report, no slack
        assert got["recorded"] and got["seconds"] <= time.time() - started
        reg.heartbeat("hb", **ok, ended=True)
        assert any(e["action"] == "heartbeat-ended" for e in reg.audit_log())


def test_economics_go_out_at_most_every_few_minutes(monkeypatch) -> None:
    from registry.economics import records

    monkeypatch.setattr(records, "_emitted", {})
    assert records._due("p", "r") and not records._due("p", "r") and records._due("p", "s")


# -- 5: the resampled Monte Carlo ----------------------------------------------------------------


def test_resampling_counts_the_censored_tail() -> None:
    plain = simulate.resampled([100.0, 200.0], 0)(4000)
    tailed = simulate.resampled([100.0, 200.0], 0, censored_s=[10_000.0])(4000)
    assert tailed.mean() > 10 * plain.mean()


def test_a_trial_that_never_gets_through_is_counted_not_the_whole_figure() -> None:
    calls = [0]

    def draw(n: int) -> Any:  # trial 0 fails for ever; the others never fail
        calls[0] += 1
        if calls[0] == 1:
            return np.r_[1.0, np.full(n - 1, 1e15)]
        return np.full(n, 1.0)

    got = simulate.run(100.0, 10.0, 5.0, draw, trials=50, segments=5)
    assert got.capped_share == pytest.approx(1 / 50)
    assert got.fraction == pytest.approx(10.0 / 110.0, rel=1e-6)


def test_too_few_failures_are_not_resampled() -> None:
    facts = _facts("one", gpu_s=7200.0, failures=[(100, 150, 3600.0)])
    out = advise_mod._compose(
        "one", facts, [facts], gpus=None, mtbf_s=None, fleet=False, trials=100
    )
    assert "too few failures" in out["simulation"]["measured_gaps"]["skipped"]
    two = _facts("two", gpu_s=7200.0, failures=[(100, 150, 3000.0), (200, 210, 6000.0)])
    out = advise_mod._compose("two", two, [two], gpus=None, mtbf_s=None, fleet=False, trials=100)
    measured = out["simulation"]["measured_gaps"]
    assert measured["gaps"] == 2 and measured["censored_s"] == pytest.approx(1200.0)


# -- 12: tiny C/M, --mtbf bounds -----------------------------------------------------------------


@pytest.mark.parametrize("x", [1e-9, 1e-12, 1e-14, 1e-20])
def test_optimal_for_tiny_cost_over_mtbf(x: float) -> None:
    assert model.optimal(x * 3600.0, 3600.0) == pytest.approx(math.sqrt(2 * x) * 3600.0, rel=1e-4)


def test_mtbf_is_capped_and_its_error_suggests_only_what_it_takes(clean_env: Path, cli):
    _attempt("cap", 5)
    for text in ("0s", "never", "40000d", "abc"):
        res = cli("advise", "cap", "--mtbf", text)
        assert res.returncode == 2, res.stderr
        shown = res.stderr.replace(f"got {text!r}", "")
        assert "'0s'" not in shown and "never" not in shown and len(shown.splitlines()) == 1
    with Registry() as reg, pytest.raises(UsageError):
        reg.advise("cap", mtbf_s=1e12)
