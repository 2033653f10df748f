"""Garbage collection: apply the retention plan, sweep orphans (DESIGN §3, §6).

Decide, then delete. One GC at a time (a lease in the catalog). Each deletion is three steps:
mark the row `deleting` (re-checking protections in the same transaction, so a pin, a hold or a
release made after planning wins), delete the objects (manifest first, so the prefix stops
looking committed), then leave a tombstone (`deleted`, who, when, why). A crash between steps is
finished by the next run; a failed object delete is logged and retried next run, and never stops
the others.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from sqlalchemy import delete
from sqlalchemy import select as sa_select
from sqlmodel import col, select

from policies.retention import DELETE, CheckpointRecord, Protections, plan
from registry import audit, leases, outbox
from registry.catalog.models import (
    COMMITTED,
    DELETED,
    DELETING,
    PENDING,
    YANKED,
    Checkpoint,
    Model,
    Project,
    Release,
    Run,
)
from registry.checkpoints import checkpoint_prefix
from registry.errors import Conflict, RegistryError
from registry.formats.dcp import MANIFEST
from registry.holds import held_checkpoint_ids
from registry.timeutil import iso, now

if TYPE_CHECKING:
    from registry.api import Registry

GC_LEASE = "gc"
GC_LEASE_SECONDS = 600.0
BATCH = 200


def _records(
    reg: Registry, project: str | None = None
) -> tuple[list[CheckpointRecord], Protections, dict[int, tuple[str, str, int]]]:
    c = Checkpoint.__table__.c  # type: ignore[attr-defined]
    with reg.catalog.session() as s:
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
        rows = s.execute(stmt).all()
        sources = s.exec(
            select(Release.source_checkpoint_id, Model.name, Release.version)
            .join(Model, col(Model.id) == Release.model_id)
            .where(col(Release.status).notin_([YANKED]))
        ).all()
        resumed = s.exec(
            select(Project.name, Run.name, Run.resumed_from_step)
            .join(Project, col(Project.id) == Run.project_id)
            .where(col(Run.resumed_from_step).is_not(None))
        ).all()
    records = [
        CheckpointRecord(
            cid, p, r, step, committed or created, nbytes, bool(pinned), dict(metrics or {})
        )
        for cid, step, committed, created, nbytes, pinned, metrics, r, p in rows
    ]
    release_sources: dict[int, str] = {}
    for cid, model, version in sorted(sources, key=lambda x: x[2]):
        release_sources.setdefault(cid, f"{model}:v{version}")
    protections = Protections(
        release_sources=release_sources,
        held=frozenset(held_checkpoint_ids(reg)),
        resumed_from={(p, r): step for p, r, step in resumed if step is not None},
    )
    where = {rec.id: (rec.project, rec.run, rec.step) for rec in records}
    return records, protections, where


def explain(reg: Registry, project: str, run: Run, ckpt: Checkpoint) -> dict[str, Any]:
    """What retention would do with `ckpt` now, and why."""
    if ckpt.state != COMMITTED:
        return {"action": ckpt.state, "reason": ckpt.delete_reason, "protected": False}
    records, protections, _ = _records(reg, project)
    mine = [r for r in records if r.run == run.name]
    decision = next(
        d for d in plan(mine, reg.policy.retention, now(), protections) if d.id == ckpt.id
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


# -- the lease ----------------------------------------------------------------------------------


def _acquire(reg: Registry) -> str:
    token, holder = leases.try_acquire(reg, GC_LEASE, GC_LEASE_SECONDS)
    if token is None:
        assert holder is not None
        raise Conflict(
            f"another GC is running: {holder.holder} on {holder.host} "
            f"(pid {holder.pid}) since {iso(holder.acquired_at)}",
            f"wait for it; a crashed GC's lease expires after {GC_LEASE_SECONDS:.0f}s",
        )
    return token


def _renew(reg: Registry, token: str) -> None:
    leases.renew(reg, GC_LEASE, token, GC_LEASE_SECONDS)


def _release(reg: Registry, token: str) -> None:
    leases.release(reg, GC_LEASE, token)


# -- the run ------------------------------------------------------------------------------------


def run_gc(reg: Registry, *, dry_run: bool = False) -> dict[str, Any]:
    reg.authorize("gc", target="retention")
    records, protections, where = _records(reg)
    decisions = plan(records, reg.policy.retention, now(), protections)
    out: dict[str, Any] = {
        "applied": not dry_run,
        "decisions": [
            {"ref": d.ref, "action": d.action, "reason": d.reason, "bytes": d.bytes}
            for d in decisions
        ],
        "freed_bytes": 0,
        "errors": [],
        "orphans": [],
    }
    if dry_run:
        out["freed_bytes"] = sum(d.bytes for d in decisions if d.action == DELETE)
        return out
    token = _acquire(reg)
    try:
        freed = _finish_interrupted(reg, out["errors"])
        doomed = [d for d in decisions if d.action == DELETE]
        for start in range(0, len(doomed), BATCH):
            batch = doomed[start : start + BATCH]
            marked = _mark_deleting(reg, batch)
            for d in batch:
                if d.id not in marked:
                    _note_skip(out, d.ref)
                    continue
                project, run, step = where[d.id]
                freed += _delete_objects(
                    reg, checkpoint_prefix(project, run, step), d.ref, out["errors"], d.reason
                )
            _renew(reg, token)
        freed += _sweep_orphans(reg, out)
        out["freed_bytes"] = freed
    finally:
        _release(reg, token)
    return out


def _note_skip(out: dict[str, Any], ref: str) -> None:
    for d in out["decisions"]:
        if d["ref"] == ref:
            d["action"], d["reason"] = "keep", "kept: protected since the plan was made"


def _mark_deleting(reg: Registry, batch: list[Any]) -> set[int]:
    """Mark a batch `deleting`, skipping any that became protected since planning."""
    with reg.catalog.session(write=True) as s:
        held = held_checkpoint_ids(reg)
        sources = set(
            s.exec(
                select(Release.source_checkpoint_id).where(col(Release.status).notin_([YANKED]))
            ).all()
        )
        ids = [d.id for d in batch if d.id not in held and d.id not in sources]
        reasons = {d.id: d.reason for d in batch}
        marked = set()
        rows = s.exec(
            select(Checkpoint).where(
                col(Checkpoint.id).in_(ids),
                Checkpoint.state == COMMITTED,
                col(Checkpoint.pinned).is_(False),
            )
        ).all()
        for row in rows:
            run = s.get(Run, row.run_id)
            if run is not None and run.resumed_from_step == row.step:
                continue
            row.state, row.delete_reason = DELETING, reasons[row.id or 0]
            row.deleted_by, row.deleted_at = reg.user, now()
            s.add(row)
            marked.add(row.id or 0)
    return marked


def _delete_objects(
    reg: Registry, prefix: str, ref: str, errors: list[str], reason: str | None
) -> int:
    """Delete a checkpoint's objects (manifest first), then leave the tombstone."""
    keys = [o.key for o in reg.store.list(prefix)]
    manifest = [k for k in keys if k.endswith(MANIFEST)]
    failed: dict[str, str] = {}
    freed = 0
    # The manifest first, so the prefix stops looking committed; then the rest in batches.
    for batch in (manifest, [k for k in keys if k not in manifest]):
        if batch and not failed:
            try:
                got, failed = reg.store.delete_many(batch)
                freed += got
            except RegistryError as exc:  # logged, retried next run; never stops the others
                failed = {batch[0]: str(exc)}
    for key, why in failed.items():
        errors.append(f"{ref}: could not delete {key}: {why}")
    if not failed:
        with reg.catalog.session(write=True) as s:
            project, run_and_step = prefix.removeprefix("ckpt/").split("/", 1)
            run_name, step_part = run_and_step.rstrip("/").split("/")
            step = int(step_part.removeprefix("step-"))
            row = s.exec(
                select(Checkpoint)
                .join(Run, col(Run.id) == Checkpoint.run_id)
                .join(Project, col(Project.id) == Run.project_id)
                .where(Project.name == project, Run.name == run_name, Checkpoint.step == step)
            ).first()
            if row is not None:
                row.state = DELETED
                s.add(row)
                audit.record(
                    s, reg.user, "gc", ref, reason=row.delete_reason or reason, freed_bytes=freed
                )
                outbox.emit(
                    s,
                    outbox.CHECKPOINT_COLLECTED,
                    project=project,
                    run=run_name,
                    step=step,
                    ref=ref,
                    reason=row.delete_reason or reason,
                )
                reg.after_commit()
    return freed


def _finish_interrupted(reg: Registry, errors: list[str]) -> int:
    """Checkpoints a crashed GC left `deleting`: finish them."""
    with reg.catalog.session() as s:
        rows = s.exec(
            select(Checkpoint, Run.name, Project.name)
            .join(Run, col(Run.id) == Checkpoint.run_id)
            .join(Project, col(Project.id) == Run.project_id)
            .where(Checkpoint.state == DELETING)
        ).all()
    freed = 0
    for c, run, project in rows:
        ref = f"{'' if project == 'default' else project + '/'}{run}@step{c.step}"
        freed += _delete_objects(
            reg, checkpoint_prefix(project, run, c.step), ref, errors, c.delete_reason
        )
    return freed


def _sweep_orphans(reg: Registry, out: dict[str, Any]) -> int:
    """Uploads that never committed (dead claims older than orphan_grace): objects and row."""
    grace = reg.policy.retention.orphan_grace
    cutoff = now() - grace
    with reg.catalog.session() as s:
        rows = s.exec(
            select(Checkpoint, Run.name, Project.name)
            .join(Run, col(Run.id) == Checkpoint.run_id)
            .join(Project, col(Project.id) == Run.project_id)
            .where(
                Checkpoint.state == PENDING,
                Checkpoint.created_at < cutoff,
                col(Checkpoint.lease_until) < now(),
            )
        ).all()
    freed = 0
    for c, run, project in rows:
        prefix = checkpoint_prefix(project, run, c.step)
        with reg.catalog.session(write=True) as s:
            gone = s.exec(
                delete(Checkpoint).where(
                    col(Checkpoint.id) == c.id,
                    col(Checkpoint.state) == PENDING,
                    col(Checkpoint.claim_token) == c.claim_token,
                    col(Checkpoint.lease_until) < now(),
                )
            )
            if gone.rowcount != 1:
                continue  # someone took the claim over meanwhile
        for obj in list(reg.store.list(prefix)):
            try:
                freed += reg.store.delete(obj.key)
            except Exception as exc:
                out["errors"].append(f"orphan {prefix}: could not delete {obj.key}: {exc}")
        out["orphans"].append(prefix)
    list_temp = getattr(reg.store, "list_temp", None)
    if list_temp is not None:
        for path, mtime in list(list_temp("ckpt/")):
            if mtime < cutoff:
                try:
                    size = path.stat().st_size
                    path.unlink()
                    freed += size
                    out["orphans"].append(str(path))
                except OSError:
                    continue
    return freed


def every(reg_factory: Any, interval: float, emit: Any, stop: Any) -> None:
    """Run GC every `interval` seconds until `stop` is set; one result per cycle to `emit`."""
    while not stop.is_set():
        started = time.monotonic()
        try:
            reg = reg_factory()
            with reg:
                result = run_gc(reg)
            emit(
                {
                    "ts": iso(now()),
                    "ok": True,
                    "freed_bytes": result["freed_bytes"],
                    "deleted": sum(d["action"] == "delete" for d in result["decisions"]),
                    "kept": sum(d["action"] == "keep" for d in result["decisions"]),
                    "errors": result["errors"],
                }
            )
        except RegistryError as exc:
            emit({"ts": iso(now()), "ok": False, "error": str(exc)})
        stop.wait(max(0.0, interval - (time.monotonic() - started)))
