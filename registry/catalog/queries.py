"""Lookups shared by the lifecycles; each takes an open session."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, col, select

from registry.catalog import claims
from registry.catalog.models import (
    COMMITTED,
    DELETED,
    DELETING,
    LOCAL,
    LOST,
    PENDING,
    SWEEPING,
    Checkpoint,
    CheckpointFile,
    Project,
    Run,
)
from registry.core.refs import CheckpointRef
from registry.core.timeutil import iso, now
from registry.errors import Collected, NotFound
from registry.formats.documents import FileRecord


def get_or_create_run(session: Session, project: str, run: str) -> tuple[Project, Run]:
    proj = session.exec(select(Project).where(Project.name == project)).first()
    if proj is None:
        proj = _insert_or_get(
            session,
            Project(name=project, created_at=now()),
            select(Project).where(Project.name == project),
        )
    assert proj.id is not None
    row = session.exec(select(Run).where(Run.project_id == proj.id, Run.name == run)).first()
    if row is None:
        row = _insert_or_get(
            session,
            Run(project_id=proj.id, name=run, created_at=now()),
            select(Run).where(Run.project_id == proj.id, Run.name == run),
        )
    return proj, row


def _insert_or_get(session: Session, obj: Any, stmt: Any) -> Any:
    try:
        with session.begin_nested():
            session.add(obj)
    except IntegrityError:
        return session.exec(stmt).one()
    return obj


def find_run(session: Session, project: str, run: str) -> Run | None:
    return session.exec(
        select(Run).join(Project).where(Project.name == project, Run.name == run)
    ).first()


def resolve_checkpoint(
    session: Session, ref: CheckpointRef, *, tombstones: bool = False, local: bool = False
) -> tuple[Run, Checkpoint]:
    """The committed row `ref` names (or with `tombstones`, a collected one too; with `local`,
    one committed at tier 0 only); NotFound says what exists, Collected when and why. Pending
    rows are never visible; a tier-0 step is not in the store yet, so whatever reads its files
    from the store is told so."""
    run = find_run(session, ref.project, ref.run)
    if run is None:
        runs = session.exec(
            select(Run.name).join(Project).where(Project.name == ref.project).order_by(Run.name)
        ).all()
        hint = (
            f"runs in project {ref.project}: {_few(runs)}" if runs else "reg ls lists what exists"
        )
        raise NotFound(f"run {ref.run_label} not found", hint)
    stmt = select(Checkpoint).where(Checkpoint.run_id == run.id)
    if ref.step is None:
        stmt = stmt.where(Checkpoint.state == COMMITTED).order_by(col(Checkpoint.step).desc())
    else:
        stmt = stmt.where(Checkpoint.step == ref.step)
    row = session.exec(stmt).first()
    if row is not None and row.state in (DELETING, DELETED) and not tombstones:
        raise Collected(
            f"{ref} was collected by retention at {iso(row.deleted_at)}, reason: "
            f"{row.delete_reason or 'unknown'}",
            f"reg ls {ref.run_label} lists what remains",
        )
    if row is not None and row.state == LOST and not tombstones:
        raise NotFound(
            f"{ref} was lost: saved at tier 0 only, every node's copy was gone before it "
            "reached the store",
            f"save the step again (a new attempt); reg ls {ref.run_label} lists what remains",
        )
    if row is not None and row.state == LOCAL and not local:
        copying = "being copied" if claims.is_live(row) else "waiting for a job on its nodes"
        raise NotFound(
            f"{ref} is saved at tier 0 only (on its nodes' local disks) and not yet in the "
            f"store ({copying})",
            "`reg show` says which nodes hold it; a job restoring on them copies it",
        )
    if row is None or row.state in (PENDING, SWEEPING):
        steps = committed_steps(session, run.id or 0)
        if steps:
            raise NotFound(
                f"{ref} not found: {ref.run_label} has steps {_few(steps)}",
                f"reg ls {ref.run_label}",
            )
        raise NotFound(
            f"{ref} not found: {ref.run_label} has no committed checkpoints",
            "reg push-ckpt registers one",
        )
    return run, row


def committed_steps(session: Session, run_id: int) -> list[int]:
    return list(
        session.exec(
            select(Checkpoint.step)
            .where(Checkpoint.run_id == run_id, Checkpoint.state == COMMITTED)
            .order_by(col(Checkpoint.step))
        ).all()
    )


def files_of(session: Session, checkpoint_id: int) -> list[FileRecord]:
    rows = session.exec(
        select(CheckpointFile)
        .where(CheckpointFile.checkpoint_id == checkpoint_id)
        .order_by(col(CheckpointFile.path))
    ).all()
    return [f.record() for f in rows]


def _few(items: Sequence[Any], limit: int = 8) -> str:
    shown = [str(i) for i in items[-limit:]]
    more = len(items) - len(shown)
    return (f"... ({more} more), " if more else "") + ", ".join(shown)
