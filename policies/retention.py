"""Retention: which committed checkpoints to keep, and why (DESIGN §6).

Pure: plain records in, one decision per checkpoint out, each with a reason. No I/O.

Always protected (no rule or quota deletes them): pinned checkpoints, the newest committed
checkpoint of every run, sources of releases that are not yanked, checkpoints held by a running
validation or promotion, and the checkpoint a run last pulled to resume from.

Then the rules, per project (with per-project overrides): `keep_last` newest steps of a run,
milestones (`step % keep_every_steps == 0`, until `milestone_ttl`), `keep_best` by a metric
recorded at push, and `ttl`: anything no rule keeps is deleted once older than `ttl`. Finally
`max_bytes`: while a project's kept bytes exceed its quota, the oldest checkpoints that are not
always-protected are deleted.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

from policies.loader import RetentionPolicy, RetentionRules

KEEP, DELETE = "keep", "delete"


@dataclass(frozen=True, slots=True)
class CheckpointRecord:
    id: int
    project: str
    run: str
    step: int
    committed_at: float
    bytes: int
    pinned: bool = False
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def ref(self) -> str:
        prefix = "" if self.project == "default" else f"{self.project}/"
        return f"{prefix}{self.run}@step{self.step}"


@dataclass(frozen=True, slots=True)
class Protections:
    release_sources: dict[int, str] = field(default_factory=dict)  # checkpoint id -> release
    held: frozenset[int] = frozenset()  # in validation or promotion
    resumed_from: dict[tuple[str, str], int] = field(default_factory=dict)  # run -> step


@dataclass(frozen=True, slots=True)
class Decision:
    id: int
    ref: str
    action: str  # keep | delete
    reason: str
    bytes: int
    protected: bool = False
    expires_at: float | None = None  # when the ttl would delete it, if nothing else keeps it


def _duration(seconds: float) -> str:
    if math.isinf(seconds):
        return "never"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"


def _size(n: int) -> str:
    for unit, size in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6)):
        if n >= size:
            return f"{n / size:g}{unit}"
    return f"{n}B"


def plan(
    records: Iterable[CheckpointRecord],
    policy: RetentionPolicy,
    now: float,
    protections: Protections | None = None,
) -> list[Decision]:
    """One decision per record, in (project, run, step) order."""
    prot = protections or Protections()
    by_run: dict[tuple[str, str], list[CheckpointRecord]] = defaultdict(list)
    for r in records:
        by_run[(r.project, r.run)].append(r)
    decisions: dict[int, Decision] = {}
    for (project, run), rows in by_run.items():
        rules = policy.for_project(project)
        rows.sort(key=lambda r: r.step)
        for d in _plan_run(project, run, rows, rules, now, prot):
            decisions[d.id] = d
    _apply_quotas(decisions, by_run, policy)
    order = sorted(
        (r for rows in by_run.values() for r in rows), key=lambda r: (r.project, r.run, r.step)
    )
    return [decisions[r.id] for r in order]


def _plan_run(
    project: str,
    run: str,
    rows: list[CheckpointRecord],
    rules: RetentionRules,
    now: float,
    prot: Protections,
) -> list[Decision]:
    newest = rows[-1].step
    last_n = {r.step for r in rows[-rules.keep_last :]}
    best: dict[int, str] = {}
    if rules.keep_best is not None:
        metric, sign = rules.keep_best.metric, 1 if rules.keep_best.mode == "min" else -1
        scored = sorted(
            (r for r in rows if metric in r.metrics),
            key=lambda r: (sign * r.metrics[metric], -r.step),
        )
        for rank, r in enumerate(scored[: rules.keep_best.n], start=1):
            best[r.id] = (
                f"kept: best {rules.keep_best.n} by {metric} "
                f"({rules.keep_best.mode}, #{rank}: {r.metrics[metric]:g})"
            )
    resumed = prot.resumed_from.get((project, run))
    out = []
    for r in rows:
        age = now - r.committed_at
        expires = r.committed_at + rules.ttl if not math.isinf(rules.ttl) else None

        def keep(
            reason: str,
            protected: bool = False,
            r: CheckpointRecord = r,
            expires: float | None = expires,
        ) -> Decision:
            return Decision(
                r.id, r.ref, KEEP, reason, r.bytes, protected, None if protected else expires
            )

        if r.pinned:
            out.append(keep("kept: pinned", True))
        elif r.step == newest:
            out.append(keep(f"kept: newest checkpoint of {run}", True))
        elif r.id in prot.release_sources:
            out.append(keep(f"kept: source of release {prot.release_sources[r.id]}", True))
        elif r.id in prot.held:
            out.append(keep("kept: in validation or promotion", True))
        elif resumed == r.step:
            out.append(keep(f"kept: {run} last resumed from it", True))
        elif r.step in last_n:
            out.append(keep(f"kept: newest {rules.keep_last} of {run}"))
        elif (
            rules.keep_every_steps
            and r.step % rules.keep_every_steps == 0
            and (age < rules.milestone_ttl)
        ):
            until = (
                ""
                if math.isinf(rules.milestone_ttl)
                else f" until {_duration(rules.milestone_ttl)} old"
            )
            out.append(keep(f"kept: milestone (step % {rules.keep_every_steps} == 0){until}"))
        elif r.id in best:
            out.append(keep(best[r.id]))
        elif age < rules.ttl:
            out.append(keep(f"kept: younger than ttl {_duration(rules.ttl)}"))
        else:
            out.append(
                Decision(
                    r.id, r.ref, DELETE, f"deleted: older than ttl {_duration(rules.ttl)}", r.bytes
                )
            )
    return out


def _apply_quotas(
    decisions: dict[int, Decision],
    by_run: dict[tuple[str, str], list[CheckpointRecord]],
    policy: RetentionPolicy,
) -> None:
    by_project: dict[str, list[CheckpointRecord]] = defaultdict(list)
    for (project, _), rows in by_run.items():
        by_project[project].extend(rows)
    for project, rows in by_project.items():
        quota = policy.for_project(project).max_bytes
        if quota is None:
            continue
        kept = [r for r in rows if decisions[r.id].action == KEEP]
        total = sum(r.bytes for r in kept)
        for r in sorted(kept, key=lambda r: (r.committed_at, r.step)):
            if total <= quota:
                break
            if decisions[r.id].protected:
                continue
            decisions[r.id] = Decision(
                r.id,
                r.ref,
                DELETE,
                f"deleted: project {project} over quota {_size(quota)} (oldest unprotected first)",
                r.bytes,
            )
            total -= r.bytes
