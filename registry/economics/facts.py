"""What the catalog knows about a run's checkpoint economics, gathered in one session, and the
figures derived from it (C_eff, RTO by phase, the current interval, failures and exposure).

Checkpoints that retention collected since (deleting, deleted) still count for the interval and
the save costs: they were paid for, as do those still (or only ever) at tier 0 (`local`).
`checkpoints` is every saved one; `committed` the live ones in the store.

A run that saves at tier 0 has two levels: `tiers()` gives each its figures (the
tier-0 saves' C_eff, the copies' cost to the loop and their lag, the restores from each tier,
and the failures each tier recovered from), for `levels`' model.
"""

from __future__ import annotations

import itertools
import math
import statistics
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sqlmodel import col, select

from registry.catalog.models import (
    COMMITTED,
    DELETED,
    DELETING,
    LOCAL,
    LOST,
    Checkpoint,
    CheckpointRestore,
    CheckpointTier,
    Run,
    Validation,
)

if TYPE_CHECKING:
    from sqlmodel import Session


@dataclass
class Failure:
    at: float
    restored_step: int
    reached_step: int
    gpu_seconds: float | None  # the run's exposure when it failed
    step_seconds: float | None
    kind: str = "failure"  # or a restore that lost work without failing: resume, planned, retry

    @property
    def lost_steps(self) -> int:
        return max(0, self.reached_step - self.restored_step)

    @property
    def lost_seconds(self) -> float | None:
        return None if self.step_seconds is None else self.lost_steps * self.step_seconds


@dataclass
class RunFacts:
    project: str
    run: Run
    checkpoints: list[Checkpoint] = field(default_factory=list)  # saved, collected or not
    restores: list[tuple[int, CheckpointRestore]] = field(default_factory=list)  # (step, row)
    validation_seconds: list[float] = field(default_factory=list)
    copy_seconds: list[float] = field(default_factory=list)  # tier-0 commit -> in the store

    # -- C_eff ------------------------------------------------------------------------------
    def costs(self) -> tuple[list[float], list[float], list[float], str]:
        """Per checkpoint: C_eff, the bare stall, the interference; and where C_eff came from."""
        c_eff, stalls, extra = [], [], []
        measured = unmeasured = pushed = 0
        for row in self.checkpoints:
            costs = row.save_costs if isinstance(row.save_costs, dict) else None
            stall = _num(costs.get("stall_seconds")) if costs else None
            if stall is None:
                if row.upload_seconds:
                    pushed += 1
                    c_eff.append(float(row.upload_seconds))
                continue
            stalls.append(stall)
            total = _num(costs.get("c_eff_seconds"))  # type: ignore[union-attr]
            if total is not None:
                measured += 1
                c_eff.append(total)
                extra.append(total - stall)
            elif costs.get("async"):  # type: ignore[union-attr]
                unmeasured += 1  # a background save no step times were reported around
                c_eff.append(stall)
            else:
                c_eff.append(stall)  # a synchronous save: the stall is all it cost
                extra.append(0.0)
        source = (
            "step times around saves"
            if measured
            else "stall only (no step_done reported)"
            if unmeasured
            else "registry upload time (pushed, not saved from the loop)"
            if pushed
            else "saves from the loop (synchronous)"
        )
        return c_eff, stalls, extra, source

    # -- RTO ------------------------------------------------------------------------------------
    def rto(self) -> dict[str, Any] | None:
        totals, fetch, load, first = [], [], [], []
        for _, r in self.restores:
            f, lr, fs = restore_phases(r)
            fetch.append(f)
            load.append(lr)
            first.append(fs)
            totals.append(f + lr + fs)
        if totals:
            return {
                "median_s": statistics.median(totals),
                "fetch_s": statistics.median(fetch),
                "load_reshard_s": statistics.median(load),
                "first_step_s": statistics.median(first),
                "restores": len(totals),
                "source": "the run's restores",
            }
        if self.validation_seconds:
            return {
                "median_s": statistics.median(self.validation_seconds),
                "fetch_s": None,
                "load_reshard_s": None,
                "first_step_s": None,
                "restores": 0,
                "source": "restore validations (no restore by the training loop yet)",
            }
        return None

    # -- two levels -------------------------------------------------------------------
    def tiers(self) -> dict[str, Any] | None:
        """Per level: the tier-0 saves' C_eff, the copies' interference and lag, the restores
        from each tier, the failures each recovered from, and how many tier-0 saves there are
        per copy now. None when the run never saved at tier 0."""
        tier0 = [c for c in self.checkpoints if _costs(c).get("tier") == 0]
        if not tier0:
            return None
        recent = tier0[-50:]
        copied = [c for c in recent if not _costs(c).get("tier0_only")]
        k_now = max(1, round(len(recent) / len(copied))) if copied else None
        c0 = [
            v
            for c in tier0
            if (v := _num(_costs(c).get("c_eff_seconds", _costs(c).get("stall_seconds"))))
            is not None
        ]
        c1 = [
            v for c in tier0 if (v := _num(_costs(c).get("copy_interference_seconds"))) is not None
        ]
        r0: list[float] = []
        r1: list[float] = []
        for _, r in self.restores:
            (r0 if restore_tier(r) == 0 else r1).append(sum(restore_phases(r)))
        by_tier = {0: 0, 1: 0}  # the failures each tier recovered from
        for _, r in self.restores:
            if r.kind == "failure":
                by_tier[restore_tier(r)] += 1
        return {
            "saves": len(tier0),
            "copied": len(tier0) - sum(1 for c in tier0 if _costs(c).get("tier0_only")),
            "k_now": k_now,
            "c0": c0,
            "c1": c1,
            "lag": list(self.copy_seconds),
            "r0": r0,
            "r1": r1,
            "failures_tier0": by_tier[0],
            "failures_store": by_tier[1],
        }

    # -- the current interval ----------------------------------------------------------------------
    def interval(self) -> tuple[float | None, int | None, str]:
        """Training time between saves: the median step gap x the median step time, else the
        median time between commits."""
        steps = [c.step for c in self.checkpoints]
        gaps = [b - a for a, b in itertools.pairwise(steps) if b > a]
        step_s = self.run.step_seconds
        if gaps and step_s:
            every = int(statistics.median(gaps))
            return every * step_s, every, "steps between saves x step time"
        times = [c.committed_at or c.created_at for c in self.checkpoints]
        walls = [b - a for a, b in itertools.pairwise(times) if b > a]
        if walls:
            return (
                statistics.median(walls),
                (int(statistics.median(gaps)) if gaps else None),
                ("time between commits"),
            )
        return None, None, "unknown (fewer than two checkpoints)"

    # -- failures -------------------------------------------------------------------------------
    @property
    def committed(self) -> list[Checkpoint]:
        return [c for c in self.checkpoints if c.state == COMMITTED]

    def failures(self) -> list[Failure]:
        return [f for f in self.losses() if f.kind == "failure"]

    def losses(self) -> list[Failure]:
        """Every restore that was a failure or lost work (reached past the restored step)."""
        out = []
        for step, r in self.restores:
            reached = int(r.reached_step if r.reached_step is not None else step)
            if r.kind == "failure" or (r.kind != "start" and reached > step):
                out.append(
                    Failure(
                        r.created_at,
                        step,
                        reached,
                        r.gpu_seconds,
                        r.step_seconds or self.run.step_seconds,
                        str(r.kind),
                    )
                )
        return out

    def planned(self) -> int:
        return sum(1 for _, r in self.restores if r.kind == "planned")

    def gpu_seconds(self) -> float:
        return float(self.run.gpu_seconds or 0.0)

    def gaps_gpu_seconds(self) -> list[float]:
        """GPU-seconds of exposure between consecutive failures (the first from the start)."""
        out, before = [], 0.0
        for f in self.failures():
            if f.gpu_seconds is None:
                continue
            if f.gpu_seconds > before:
                out.append(f.gpu_seconds - before)
            before = f.gpu_seconds
        return out

    def censored_gpu_seconds(self) -> float:
        """The failure-free tail: exposure since the last failure (or since the start)."""
        last = max((f.gpu_seconds or 0.0 for f in self.failures()), default=0.0)
        return max(0.0, self.gpu_seconds() - last)


def gather(s: Session, project: str, run: Run) -> RunFacts:
    facts = RunFacts(project, run)
    facts.checkpoints = list(
        s.exec(
            select(Checkpoint)
            .where(
                Checkpoint.run_id == run.id,
                col(Checkpoint.state).in_((COMMITTED, LOCAL, LOST, DELETING, DELETED)),
            )
            .order_by(col(Checkpoint.step))
        ).all()
    )
    facts.restores = [
        (int(step), r)
        for r, step in s.exec(
            select(CheckpointRestore, Checkpoint.step)
            .join(Checkpoint, col(Checkpoint.id) == col(CheckpointRestore.checkpoint_id))
            .where(Checkpoint.run_id == run.id)
            .order_by(col(CheckpointRestore.id))
        ).all()
    ]
    ids = [c.id for c in facts.checkpoints]
    facts.copy_seconds = [
        float(t.seconds)
        for t in s.exec(
            select(CheckpointTier).where(
                col(CheckpointTier.checkpoint_id).in_(ids), CheckpointTier.tier == 1
            )
        ).all()
        if t.seconds is not None and t.seconds >= 0
    ]
    facts.validation_seconds = [
        v.seconds
        for v in s.exec(
            select(Validation).where(col(Validation.checkpoint_id).in_(ids), Validation.passed)
        ).all()
        if v.seconds
    ]
    return facts


def restore_tier(restore: CheckpointRestore) -> int:
    """0: every rank read its own node's copy; 1: some rank read the store (a restore from
    before tiers, or a node whose copy was gone)."""
    phases = restore.phases or {}
    local = _num(phases.get("local_bytes")) or 0.0
    store = _num(phases.get("store_bytes"))
    return 0 if local > 0 and store == 0 else 1


def restore_phases(restore: CheckpointRestore) -> tuple[float, float, float]:
    """A restore's RTO in its three parts: fetch (catalog, verifying the node's copies,
    metadata, bytes), load/reshard, first step."""
    p = restore.phases or {}
    fetch = sum(
        float(p.get(k) or 0)
        for k in ("catalog_seconds", "verify_seconds", "metadata_seconds", "fetch_seconds")
    )
    return fetch, float(p.get("load_reshard_seconds") or 0), float(p.get("first_step_seconds") or 0)


def _costs(row: Checkpoint) -> dict[str, Any]:
    return row.save_costs if isinstance(row.save_costs, dict) else {}


def _num(value: object) -> float | None:
    """A recorded figure as a float; None unless a finite number >= 0 (an integer too large
    for a float, which a reported save_costs may hold, included)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None
