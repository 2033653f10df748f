"""Journal what the catalog decided before it had a journal (a registry upgraded to it).

Every decision the catalog holds and no journal event covers is written as an event carrying
the row's own time and author, so that a later rebuild recognizes the row and orders the event
where it was decided: applied policies, validations, the alias history, yanks and deprecations,
and the pins in force (a checkpoint's pin has no time of its own: its event carries now, which
is where it stands among later pins and unpins). Idempotent: run twice, it writes nothing the
second time. Admin, like `reg catalog rebuild`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from sqlmodel import Session, col, select

from policies.access import Action
from registry.catalog.models import (
    COMMITTED,
    DEPRECATED,
    YANKED,
    Alias,
    AliasEvent,
    Checkpoint,
    Model,
    PolicyDocument,
    Project,
    Release,
    Run,
    Validation,
)
from registry.journal import replay, write
from registry.journal.event import (
    ALIAS,
    DEPRECATE,
    PIN,
    POLICY,
    UNPIN,
    VALIDATION,
    YANK,
    Event,
)
from registry.trust import signed_facts

if TYPE_CHECKING:
    from registry.lifecycle.context import Context

# kind, target, fact, ts (None: now), actor, and what identifies the fact among events
Fact = tuple[str, dict[str, Any], dict[str, Any], float | None, str, tuple[Any, ...]]


def backfill(ctx: Context, *, dry_run: bool = False) -> dict[str, Any]:
    ctx.authorize(Action.CATALOG, target="journal backfill")
    journal = replay.read(ctx, dry_run=True)
    covered = {_identity(e) for e in journal.events} | _pins(journal.events)
    with ctx.catalog.session() as s:
        facts = list(_facts(s))
    written: Counter[str] = Counter()
    for kind, target, fact, ts, actor, identity in facts:
        if identity in covered:
            continue
        if not dry_run:
            write.put(ctx, kind, target, fact, ts, actor)
        written[kind] += 1
    if written and not dry_run:
        with ctx.catalog.session(write=True) as s:
            ctx.audit(s, "journal-backfill", "journal", events=sum(written.values()))
    return {
        "applied": not dry_run,
        "events_written": dict(sorted(written.items())),
        "already_journaled": len(facts) - sum(written.values()),
        "events_skipped": journal.skipped,
    }


def _identity(e: Event) -> tuple[Any, ...]:
    t = e.target
    if e.kind == POLICY:
        return (POLICY, t["version"], e.fact["sha256"])
    if e.kind == VALIDATION:
        return (VALIDATION, t["project"], t["run"], t["step"], round(e.ts, 6))
    if e.kind == ALIAS:
        return (ALIAS, t["model"], t["version"], e.fact["alias"], round(e.ts, 6))
    if e.kind in (YANK, DEPRECATE):
        return (e.kind, t["model"], t["version"])
    return (e.kind, e.id)  # pins: see _pins


def _pins(events: list[Event]) -> set[tuple[Any, ...]]:
    """Checkpoints whose last pin or unpin event is a pin: their pin is journaled."""
    last: dict[tuple[Any, ...], str] = {}
    for e in events:
        if e.kind in (PIN, UNPIN):
            last[(e.target["project"], e.target["run"], e.target["step"])] = e.kind
    return {(PIN, *where) for where, kind in last.items() if kind == PIN}


def _facts(s: Session) -> Iterator[Fact]:
    for p in s.exec(select(PolicyDocument).order_by(col(PolicyDocument.version))).all():
        yield (
            POLICY,
            {"version": p.version},
            {"text": p.text, "sha256": p.sha256},
            p.applied_at,
            p.applied_by,
            (POLICY, p.version, p.sha256),
        )
    places = select(Checkpoint, Run, Project).where(
        Checkpoint.run_id == Run.id, Run.project_id == Project.id
    )
    for v, ckpt, run, project in s.exec(
        select(Validation, Checkpoint, Run, Project).where(
            Validation.checkpoint_id == Checkpoint.id,
            Checkpoint.run_id == Run.id,
            Run.project_id == Project.id,
        )
    ).all():
        where = {"project": project.name, "run": run.name, "step": ckpt.step}
        yield (
            VALIDATION,
            where,
            signed_facts.validation_fact(v),
            v.created_at,
            v.created_by,
            (VALIDATION, project.name, run.name, ckpt.step, round(v.created_at, 6)),
        )
    yield from _aliases(s)
    for release, model in s.exec(
        select(Release, Model).where(
            Release.model_id == Model.id, col(Release.status).in_((YANKED, DEPRECATED))
        )
    ).all():
        kind = YANK if release.status == YANKED else DEPRECATE
        yield (
            kind,
            {"model": model.name, "version": release.version},
            {"reason": release.status_reason or ("" if kind == DEPRECATE else "yanked")},
            release.status_changed_at,
            release.status_changed_by or release.created_by,
            (kind, model.name, release.version),
        )
    for ckpt, run, project in s.exec(
        places.where(col(Checkpoint.pinned).is_(True), Checkpoint.state == COMMITTED)
    ).all():
        yield (
            PIN,
            {"project": project.name, "run": run.name, "step": ckpt.step},
            {"reason": ckpt.pin_reason},
            None,
            ckpt.pinned_by or "unknown",
            (PIN, project.name, run.name, ckpt.step),
        )


def _aliases(s: Session) -> Iterator[Fact]:
    """The alias history; a pointer no history row explains gets one event of its own."""
    explained: set[tuple[int, str, int]] = set()
    for h, model in s.exec(
        select(AliasEvent, Model)
        .where(AliasEvent.model_id == Model.id)
        .order_by(col(AliasEvent.id))
    ).all():
        explained.add((model.id or 0, h.name, h.to_version))
        yield (
            ALIAS,
            {"model": model.name, "version": h.to_version},
            {"alias": h.name, "from": h.from_version},
            h.ts,
            h.actor,
            (ALIAS, model.name, h.to_version, h.name, round(h.ts, 6)),
        )
    for alias, release, model in s.exec(
        select(Alias, Release, Model).where(
            Alias.release_id == Release.id, Alias.model_id == Model.id
        )
    ).all():
        if (model.id or 0, alias.name, release.version) in explained:
            continue
        yield (
            ALIAS,
            {"model": model.name, "version": release.version},
            {"alias": alias.name, "from": None},
            alias.updated_at,
            alias.updated_by,
            (ALIAS, model.name, release.version, alias.name, round(alias.updated_at, 6)),
        )
