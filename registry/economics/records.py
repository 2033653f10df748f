"""What a training job reports to the catalog for its economics, and how a restore
is classified when it is recorded.

- A heartbeat (`CheckpointManager.step_done`, flushed every `heartbeat_s`, at each save and at
  close): the last step reached, the time at risk since the previous heartbeat (added to the
  run's `train_seconds`, and x the run's world size to `gpu_seconds`), the median step time,
  and for each background save that finished, the slowdown of the steps it overlapped (merged
  into that checkpoint's `save_costs`: `interference_seconds`, `c_eff_seconds`, ...).
- Exposure cannot grow faster than wall time: a heartbeat adds at most the time the
  registry's clock moved since the run's previous report (its previous recorded heartbeat or
  restore; its creation before either), and that report time only moves forward, so a run's
  `train_seconds` never exceeds the wall time since it was created, however many heartbeats
  arrive (a burst adds the burst's duration). Reports are serialized per run (the row is
  locked), so two at once do not both count the same stretch.
- The world size is the registry's, never the heartbeat's: the newest saved checkpoint's
  (committed, or collected since; at most MAX_WORLD_SIZE). A heartbeat's `world_size` is still
  accepted and bounds-checked (older clients send it) and otherwise ignored. Until the run
  has a saved checkpoint no world size is known: the heartbeat is not recorded
  (`recorded: false`) and the job keeps its time for the next one, which the clock then bounds
  by the time since the run's creation. (A pending claim records no world size.)
- `plan_restart`: the next restore of the run is planned, not a failure.
- `classify`: a restore is a `start` (the run never reported a step), `planned`, a `resume` (the
  previous attempt closed: finished, or killed by SIGTERM/Ctrl-C), a `failure` (the job died
  after it advanced past the step its previous restore loaded), or a `retry` (it died again
  before advancing: a crash loop is one failure, not one per restore). Every kind keeps the
  step the run had reached, with the run's exposure then: lost work is counted wherever the
  reached step is past the restored one (a preemption loses work too).
- Inputs are bounded (steps < 2^63, ASCII digits; world size <= 1e6): a bad input is a 400,
  never a 500.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any

from sqlmodel import col, select

from policies.access import Action
from registry.catalog import queries
from registry.catalog.models import (
    COMMITTED,
    DELETED,
    DELETING,
    LOCAL,
    LOST,
    Checkpoint,
    CheckpointRestore,
    Project,
    Run,
)
from registry.core.refs import CheckpointRef, check_name
from registry.core.timeutil import iso, now
from registry.economics.advise import summary
from registry.economics.facts import gather
from registry.errors import NotFound, UsageError
from registry.journal import outbox as events

if TYPE_CHECKING:
    from sqlmodel import Session

    from registry.catalog.models import CheckpointRestore, Run
    from registry.lifecycle.context import Context

MAX_HEARTBEAT_SECONDS = 7 * 86400.0  # one heartbeat's time at risk (a week without one: a bug)
MAX_SAVES = 64  # finished background saves one heartbeat reports
MAX_STEP = 2**63 - 1
MAX_WORLD_SIZE = 1_000_000
ECONOMICS_EVERY_S = 300.0  # MLflow's economics from heartbeats: at most this often per run
_emitted: dict[tuple[str, str], float] = {}  # (project, run) -> when its economics last went out
SAVE_FIELDS = (
    "interference_seconds",
    "blocked_seconds",
    "baseline_step_seconds",
    "steps_during",
    "copy_interference_seconds",  # a tier-0 step's copy to the store
    "copy_steps_during",
)


def record_heartbeat(
    ctx: Context,
    project: str,
    run: str,
    *,
    step: int | None,
    seconds: float,
    world_size: int | None = None,
    step_seconds: float | None = None,
    saves: dict[str, dict[str, float]] | None = None,
    ended: bool = False,
) -> dict[str, Any]:
    """Add one heartbeat to `project/run` (trainer). `recorded: false` when the run has no
    saved checkpoint yet (it does not exist, or its first save is not committed): the job keeps
    its figures for the next heartbeat. `world_size` is checked and ignored (the module's
    docstring says why); the answer says the one used."""
    check_name(project, "project name")
    check_name(run, "run name")
    _check(step, seconds, world_size, step_seconds, saves)
    ctx.authorize(Action.PUSH, project=project, target=f"{project}/{run}")
    with ctx.catalog.session(write=True) as s:
        row = _locked_run(s, project, run)
        if row is None:
            return {"recorded": False}
        world = known_world_size(s, row)
        if world is None:
            return {"recorded": False}
        at = now()  # after the lock: a report that waited for it sees the one before it
        since = row.last_step_at if row.last_step_at is not None else row.created_at
        seconds = min(seconds, max(0.0, at - since))
        if step is not None:
            row.last_step = int(step)
        row.last_step_at = max(since, at)  # never back: a clock behind another adds nothing
        row.train_seconds = (row.train_seconds or 0.0) + seconds
        row.gpu_seconds = (row.gpu_seconds or 0.0) + seconds * world
        if step_seconds is not None:
            row.step_seconds = step_seconds
        row.attempt_ended_at = at if ended else None
        s.add(row)
        merged = _merge_saves(s, row, saves or {})
        if ended:
            ctx.audit(s, "heartbeat-ended", f"{project}/{run}", step=step)
        if ended or (merged and _due(project, run)):
            emit_economics(ctx, s, project, run, row)
    return {"recorded": True, "saves": merged, "seconds": round(seconds, 4), "world_size": world}


def _locked_run(s: Session, project: str, run: str) -> Run | None:
    """The run's row, locked until the session ends (PostgreSQL; SQLite's write transactions
    already take turns): heartbeats of one run are added one after the other."""

    return s.exec(
        select(Run)
        .join(Project)
        .where(Project.name == project, Run.name == run)
        .with_for_update(of=Run)
    ).first()


def known_world_size(s: Session, run: Run) -> int | None:
    """The world size the registry knows `run` at: its newest saved checkpoint's (committed,
    or collected since), at most MAX_WORLD_SIZE; None before its first commit."""

    world = s.exec(
        select(Checkpoint.world_size)
        .where(
            Checkpoint.run_id == run.id,
            col(Checkpoint.state).in_((COMMITTED, LOCAL, LOST, DELETING, DELETED)),
            col(Checkpoint.world_size) > 0,
        )
        .order_by(col(Checkpoint.step).desc())
        .limit(1)
    ).first()
    return None if world is None else min(int(world), MAX_WORLD_SIZE)


def _due(project: str, run: str) -> bool:
    """Whether the run's economics (a full gather) may go out again from a heartbeat."""
    key, clock = (project, run), time.monotonic()
    if clock - _emitted.get(key, -math.inf) < ECONOMICS_EVERY_S:
        return False
    if len(_emitted) > 10_000:
        _emitted.clear()
    _emitted[key] = clock
    return True


def plan_restart(ctx: Context, project: str, run: str) -> dict[str, Any]:
    """Announce that the next restore of `project/run` is a planned restart (trainer)."""
    check_name(project, "project name")
    check_name(run, "run name")
    target = f"{project}/{run}"
    ctx.authorize(Action.PUSH, project=project, target=target)
    with ctx.catalog.session(write=True) as s:
        row = queries.find_run(s, project, run)
        if row is None:
            raise NotFound(
                f"run {CheckpointRef(project, run, None).run_label} not found",
                "reg ls lists the runs",
            )
        row.restart_planned_at = now()
        s.add(row)
        ctx.audit(s, "plan-restart", target)
    return {"project": project, "run": run, "planned_at": iso(row.restart_planned_at)}


def classify(session: Session, run: Run, restored_step: int, restore: CheckpointRestore) -> None:
    """Fill in how `restore` (of `run`, to `restored_step`) came about, and start the new
    attempt: the run is at the restored step now."""
    at = now()
    if run.last_step is None:
        restore.kind = "start"
    else:
        restore.reached_step = run.last_step  # every kind: a preemption loses work too
        if run.restart_planned_at is not None:
            restore.kind = "planned"
        elif run.attempt_ended_at is not None:
            restore.kind = "resume"
        elif run.last_step > _previous_restored_step(session, run):
            restore.kind = "failure"
        else:
            restore.kind = "retry"  # died again before advancing: the same failure
    restore.train_seconds = run.train_seconds
    restore.gpu_seconds = run.gpu_seconds
    restore.step_seconds = run.step_seconds
    run.last_step = restored_step
    run.last_step_at = at if run.last_step_at is None else max(run.last_step_at, at)
    run.restart_planned_at = run.attempt_ended_at = None
    session.add(run)


def _previous_restored_step(session: Session, run: Run) -> int:
    """The step the run's previous restore loaded (-1: none)."""

    step = session.exec(
        select(Checkpoint.step)
        .join(CheckpointRestore, col(Checkpoint.id) == col(CheckpointRestore.checkpoint_id))
        .where(Checkpoint.run_id == run.id, col(CheckpointRestore.kind).is_not(None))
        .order_by(col(CheckpointRestore.id).desc())
    ).first()
    return -1 if step is None else int(step)


def _merge_saves(s: Session, run: Run, saves: dict[str, dict[str, float]]) -> list[int]:
    """Each finished background save's slowdown, merged into its checkpoint's save_costs."""

    merged = []
    for key, figures in sorted(saves.items()):
        ckpt = s.exec(
            select(Checkpoint).where(
                Checkpoint.run_id == run.id,
                Checkpoint.step == int(key),
                col(Checkpoint.state).in_((COMMITTED, LOCAL, LOST, DELETING, DELETED)),
            )
        ).first()
        if ckpt is None or not isinstance(ckpt.save_costs, dict):
            continue
        costs = dict(ckpt.save_costs)
        costs.update({k: figures[k] for k in SAVE_FIELDS if k in figures})
        if "interference_seconds" in figures:  # else unmeasured (no clean steps to compare)
            stall = float(costs.get("stall_seconds") or 0.0)
            extra = figures["interference_seconds"] + figures.get("blocked_seconds", 0.0)
            costs["c_eff_seconds"] = round(stall + extra, 4)
        ckpt.save_costs = costs
        s.add(ckpt)
        merged.append(ckpt.step)
    return merged


def emit_economics(ctx: Context, s: Session, project: str, run: str, row: Run) -> None:
    """The run's economics for MLflow (reg.c_eff_s, reg.rto_s, reg.advised_interval_s)."""
    s.flush()
    figures = summary(gather(s, project, row))
    if figures:
        ctx.events.emit(
            s, events.RUN_ECONOMICS, project=project, run=run, step=row.last_step or 0, **figures
        )


def _check(
    step: int | None,
    seconds: float,
    world_size: int | None,
    step_seconds: float | None,
    saves: dict[str, dict[str, float]] | None,
) -> None:
    def number(value: object, what: str, high: float) -> None:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise UsageError(f"{what} must be a number")
        if not (math.isfinite(value) and 0 <= value <= high):
            raise UsageError(f"{what} must be between 0 and {high:g}")

    if step is not None and (
        isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP
    ):
        raise UsageError(f"step must be an integer from 0 to {MAX_STEP}")
    number(seconds, "seconds", MAX_HEARTBEAT_SECONDS)
    if world_size is not None and (
        isinstance(world_size, bool)
        or not isinstance(world_size, int)
        or not 1 <= world_size <= MAX_WORLD_SIZE
    ):
        raise UsageError(f"world_size must be an integer from 1 to {MAX_WORLD_SIZE}")
    if step_seconds is not None:
        number(step_seconds, "step_seconds", MAX_HEARTBEAT_SECONDS)
    if saves is None:
        return
    if not isinstance(saves, dict) or len(saves) > MAX_SAVES:
        raise UsageError(f"saves must be an object of at most {MAX_SAVES} steps")
    for key, figures in saves.items():
        if (
            not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 19)
            or int(key) > MAX_STEP
            or not isinstance(figures, dict)
        ):
            raise UsageError(f"saves maps a step (ASCII digits, at most {MAX_STEP}) to its figures")
        for name, value in figures.items():
            if name not in SAVE_FIELDS:
                raise UsageError(
                    f"unknown save figure {name!r}", "known: " + ", ".join(SAVE_FIELDS)
                )
            number(value, name, MAX_HEARTBEAT_SECONDS * 1000)
