"""What retention decides for committed checkpoints now (DESIGN §6), read by `reg show`, pins,
policy changes and `reg gc` alike: the records and protections it plans over, one checkpoint's
decision explained, the `checkpoint.protection` events that keep MLflow's expiry tags true, and
the GC lease that keeps any two collectors (or a repair and a collector) apart. The deleting is
`operations/gc.py`'s.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from sqlalchemy import select as sa_select
from sqlmodel import Session, col, select

from policies.retention import CheckpointRecord, Decision, Protections, plan
from registry.catalog import leases
from registry.catalog.models import COMMITTED, YANKED, Checkpoint, Model, Project, Release, Run
from registry.core.refs import CheckpointRef
from registry.core.timeutil import iso, now
from registry.errors import Conflict
from registry.journal import outbox as events
from registry.trust.logged_protections import signed_targets

if TYPE_CHECKING:
    from registry.lifecycle.context import Context

GC_LEASE = "gc"
GC_LEASE_SECONDS = 600.0


def retention_records(
    session: Session,
    *,
    project: str | None = None,
    run: str | None = None,
    key: bytes | None = None,
) -> tuple[list[CheckpointRecord], Protections]:
    """Committed checkpoints (all, one project's, or one run's) and what protects them, read in
    one transaction."""
    c = Checkpoint.__table__.c  # type: ignore[attr-defined]
    # Columns, not ORM objects: planning 100,000 checkpoints must not build 100,000 objects.
    stmt = (
        sa_select(
            c.id,
            c.step,
            c.committed_at,
            c.created_at,
            c.bytes,
            c.pinned,
            c.metrics,
            col(Run.name),
            col(Project.name),
        )
        .join(Run, col(Run.id) == c.run_id)
        .join(Project, col(Project.id) == Run.project_id)
        .where(c.state == COMMITTED)
    )
    if project is not None:
        stmt = stmt.where(col(Project.name) == project)
    if run is not None:
        stmt = stmt.where(col(Run.name) == run)
    rows = session.execute(stmt).all()
    records = [
        CheckpointRecord(
            cid, p, r, step, committed or created, nbytes, bool(pinned), dict(metrics or {})
        )
        for cid, step, committed, created, nbytes, pinned, metrics, r, p in rows
    ]
    return records, current_protections(session, key)


def current_protections(session: Session, key: bytes | None = None) -> Protections:
    """What keeps checkpoints from retention. With `key` (behind the server) a yanked
    release still protects its source unless a signed yank event says it was yanked: the
    runtime role can set the status by hand (never back)."""
    rows = session.exec(
        select(Release.source_checkpoint_id, Model.name, Release.version, Release.status).join(
            Model, col(Model.id) == Release.model_id
        )
    ).all()
    yanked = {f"{m}:v{v}" for _, m, v, status in rows if status == YANKED}
    if key is not None and yanked:
        yanked = signed_targets(session, key, ("yank",), sorted(yanked))
    sources = [(c, m, v) for c, m, v, _ in rows if f"{m}:v{v}" not in yanked]
    resumed = session.exec(
        select(Project.name, Run.name, Run.resumed_from_step)
        .join(Project, col(Project.id) == Run.project_id)
        .where(col(Run.resumed_from_step).is_not(None))
    ).all()
    release_sources: dict[int, str] = {}
    for cid, model, version in sorted(sources, key=lambda x: x[2]):
        release_sources.setdefault(cid, f"{model}:v{version}")
    return Protections(
        release_sources=release_sources,
        held=frozenset(leases.held_checkpoint_ids(session)),
        resumed_from={(p, r): step for p, r, step in resumed if step is not None},
    )


def explain(
    ctx: Context, project: str, run: Run, ckpt: Checkpoint, session: Session | None = None
) -> dict[str, Any]:
    """What retention would do with `ckpt` now, and why. Only its run is planned, unless the
    project has a quota (then every run of the project counts). In `session` when given (a
    change not yet committed, e.g. a pin, counts)."""
    if ckpt.state != COMMITTED:
        return {"action": ckpt.state, "reason": ckpt.delete_reason, "protected": False}
    rules = ctx.policy.retention.for_project(project)
    scope = None if rules.max_bytes is not None else run.name
    if session is not None:
        records, protections = retention_records(session, project=project, run=scope)
    else:
        with ctx.catalog.session() as s:
            records, protections = retention_records(s, project=project, run=scope)
    decision = next(
        d for d in plan(records, ctx.policy.retention, now(), protections) if d.id == ckpt.id
    )
    reason = decision.reason
    if ckpt.pinned:
        reason += f" by {ckpt.pinned_by}" + (f" ({ckpt.pin_reason})" if ckpt.pin_reason else "")
    return {
        "action": decision.action,
        "reason": reason,
        "protected": decision.protected,
        "expires_at": iso(decision.expires_at),
    }


def emit_expiry_changes(ctx: Context, session: Session, old: Any, new: Any) -> int:
    """A retention policy change: a `checkpoint.protection` event for every committed
    checkpoint whose expiry, protection or reason it changes (MLflow's tags follow). Returns
    how many checkpoints."""
    if old == new:
        return 0
    records, protections = retention_records(session)
    at = now()
    before = {d.id: d for d in plan(records, old, at, protections)}
    by_id = {r.id: r for r in records}
    count = 0
    for d in plan(records, new, at, protections):
        b = before.get(d.id)
        if b is not None and _retention_of(b) == _retention_of(d):
            continue
        r = by_id[d.id]
        emit_protection_event(
            ctx,
            session,
            CheckpointRef(r.project, r.run, r.step),
            r.pinned,
            iso(d.expires_at),
            d.reason,
        )
        count += 1
    return count


def _retention_of(d: Decision) -> tuple[float | None, str, bool]:
    return d.expires_at, d.reason, d.protected


def emit_protection_event(
    ctx: Context,
    session: Session,
    ref: CheckpointRef,
    pinned: bool,
    expires_at: str | None,
    reason: str,
    **pin: str | None,
) -> None:
    """Tell the MLflow mirror a checkpoint's protection and expiry (ISO time; `pin`:
    pinned_by and pin_reason, when a pin or unpin is what changed)."""
    ctx.events.emit(
        session,
        events.CHECKPOINT_PROTECTION,
        project=ref.project,
        run=ref.run,
        step=ref.step,
        ref=str(ref),
        pinned=pinned,
        expires_at=expires_at,
        retention=reason,
        **pin,
    )


def acquire(ctx: Context) -> str:
    """The GC lease, or a Conflict naming the GC that holds it."""
    token, holder = leases.try_acquire(ctx.catalog, GC_LEASE, ctx.actor, GC_LEASE_SECONDS)
    if token is None:
        assert holder is not None
        raise Conflict(
            f"another GC is running: {holder.holder} on {holder.host} "
            f"(pid {holder.pid}) since {iso(holder.acquired_at)}",
            f"wait for it; a crashed GC's lease expires after {GC_LEASE_SECONDS:.0f}s",
        )
    return token


def gc_lease(ctx: Context) -> AbstractContextManager[None]:
    """Hold the GC lease (renewed) for a `with` block: a GC, or a repair that deletes."""
    return leases.renewed(ctx.catalog, GC_LEASE, acquire(ctx), GC_LEASE_SECONDS)
