"""Resume verdicts across the catalog: what a policy change changes (MLflow follows it), and the
checkpoints committed before the catalog kept key paths (`reg catalog migrate` records them).

Per checkpoint, the facts and verdicts are `resume_facts.py`'s."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from sqlalchemy import select as sa_select
from sqlmodel import Session, col, select

from registry.catalog import queries
from registry.catalog.models import COMMITTED, Checkpoint, CheckpointKeys, KeySet, Project, Run
from registry.core.refs import CheckpointRef
from registry.errors import RegistryError
from registry.journal import outbox as events
from registry.lifecycle.checkpoints.resume_facts import (
    from_stored_metadata,
    missing_of,
    record_facts,
)

if TYPE_CHECKING:
    from policies.loader import ResumePolicy
    from registry.catalog.models import Checkpoint
    from registry.core.refs import CheckpointRef
    from registry.lifecycle.context import Context


def emit_changes(ctx: Context, session: object, old: ResumePolicy, new: ResumePolicy) -> int:
    """A policy change: a `checkpoint.resume` event for every committed checkpoint whose verdict
    it changes. Each distinct (key set, layout) is decided once under each policy; the key
    paths themselves are read only for the sets that change. Returns how many checkpoints."""

    assert isinstance(session, Session)
    if old == new:
        return 0
    layouts = session.exec(
        select(CheckpointKeys.key_set_id, CheckpointKeys.layout)
        .join(Checkpoint, col(Checkpoint.id) == CheckpointKeys.checkpoint_id)
        .where(Checkpoint.state == COMMITTED)
        .distinct()
    ).all()
    ids = sorted({set_id for set_id, _ in layouts})
    summaries = {}
    for start in range(0, len(ids), 500):  # no DISTINCT over JSON: PostgreSQL cannot compare it
        found = session.execute(  # five columns: sqlmodel's select types at most four
            sa_select(
                col(KeySet.id),
                col(KeySet.sha256),
                col(KeySet.heads),
                col(KeySet.optimizer_roots),
                col(KeySet.sidecars),
            ).where(col(KeySet.id).in_(ids[start : start + 500]))
        ).all()
        summaries.update({r[0]: tuple(r[1:]) for r in found})

    def keys_of(set_id: int) -> Callable[[], list[str]]:
        return lambda: list(session.exec(select(KeySet.keys).where(KeySet.id == set_id)).one())

    changed: dict[tuple[int, str], list[str]] = {}
    for set_id, layout in layouts:
        sha, key_heads, roots, sidecars = summaries[set_id]
        summary = (list(key_heads), list(roots), list(sidecars))
        before = missing_of(sha, layout, old, summary, keys_of(set_id))
        after = missing_of(sha, layout, new, summary, keys_of(set_id))
        if before != after:
            changed[(set_id, layout)] = after
    if not changed:
        return 0
    projects = {p.id: p.name for p in session.exec(select(Project)).all()}
    rows = session.exec(
        select(Run, Checkpoint.step, CheckpointKeys.key_set_id, CheckpointKeys.layout)
        .join(Checkpoint, col(Checkpoint.run_id) == Run.id)
        .join(CheckpointKeys, col(CheckpointKeys.checkpoint_id) == Checkpoint.id)
        .where(
            Checkpoint.state == COMMITTED,
            col(CheckpointKeys.key_set_id).in_(sorted({set_id for set_id, _ in changed})),
        )
    ).all()
    count = 0
    for run_row, step, set_id, layout in rows:
        missing = changed.get((set_id, layout))
        if missing is None:
            continue
        project = projects[run_row.project_id]
        ctx.events.emit(
            session,
            events.CHECKPOINT_RESUME,
            project=project,
            ref=str(CheckpointRef(project, run_row.name, step)),
            resumable=not missing,
            missing_state=missing,
            layout=layout,
        )
        count += 1
    return count


def undecided(ctx: Context) -> list[tuple[CheckpointRef, Checkpoint]]:
    """Committed checkpoints whose key paths the catalog does not hold (committed before it
    kept them)."""

    with ctx.catalog.session() as s:
        rows = s.exec(
            select(Project.name, Run.name, Checkpoint)
            .join(Run, col(Run.project_id) == Project.id)
            .join(Checkpoint, col(Checkpoint.run_id) == Run.id)
            .outerjoin(CheckpointKeys, col(CheckpointKeys.checkpoint_id) == Checkpoint.id)
            .where(Checkpoint.state == COMMITTED, col(CheckpointKeys.checkpoint_id).is_(None))
        ).all()
    return [(CheckpointRef(p, r, c.step), c) for p, r, c in rows]


def record_all(ctx: Context) -> dict[str, Any]:
    """Record the key paths of every committed checkpoint the catalog has none for, each from
    its `.metadata` proven against the catalog's sha256 (`reg catalog migrate` runs it): the
    ones that cannot be read are named and keep their push-time verdict until first used."""
    recorded, failed = 0, []
    for ref, ckpt in undecided(ctx):
        with ctx.catalog.session() as s:
            files = queries.files_of(s, ckpt.id or 0)
        try:
            facts = from_stored_metadata(ctx, ref, ckpt, files)
        except RegistryError as exc:
            failed.append({"ref": str(ref), "error": exc.message})
            continue
        if record_facts(ctx, ckpt.id or 0, facts):
            recorded += 1
        else:
            failed.append({"ref": str(ref), "error": "the catalog refused the write"})
    return {"recorded": recorded, "failed": failed}
