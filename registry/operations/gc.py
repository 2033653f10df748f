"""Garbage collection: apply the retention plan, sweep orphans (DESIGN §3, §6).

Decide, then delete. One GC at a time (the `gc` lease in the catalog, renewed while it runs).
Each deletion is three steps: mark the row `deleting` (re-checking protections in the same
transaction, holds included, so a pin, a hold or a release made after planning wins), delete
the objects (manifest first, so the prefix stops looking committed), then leave a tombstone
(`deleted`, who, when, why). A crash between steps is finished by the next run; a failed object
delete is logged and retried next run, and never stops the others.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from sqlalchemy import and_, delete, or_, update
from sqlmodel import Session, col, select

from policies.access import Action
from policies.retention import DELETE, Decision, plan
from registry.catalog import claims
from registry.catalog.models import (
    COMMITTED,
    DELETED,
    DELETING,
    LOCAL,
    PENDING,
    SWEEPING,
    Checkpoint,
    Project,
    Run,
)
from registry.catalog.models import LOST as LOST_STATE
from registry.core import faults
from registry.core.layout import CHECKPOINTS, MANIFEST, checkpoint_prefix, parse_checkpoint_key
from registry.core.refs import CheckpointRef
from registry.core.timeutil import now
from registry.errors import RegistryError
from registry.journal import outbox as events
from registry.lifecycle.checkpoints.lost import (
    LOST_REASON,
    held_copies,
    hold_lost,
    lose_if_gone,
    release_lost,
)
from registry.lifecycle.checkpoints.tiers import TIER0_ONLY
from registry.lifecycle.retention import current_protections, gc_lease, retention_records
from registry.trust import signed_facts

if TYPE_CHECKING:
    from registry.lifecycle.context import Context

BATCH = 200


# -- the run ------------------------------------------------------------------------------------


def _log_key(ctx: Context) -> bytes | None:
    """The key the signed audit log is checked with: behind the server only (an embedded
    registry's catalog is its owner's own)."""
    return ctx.audit_key if ctx.server else None


def run_gc(ctx: Context, *, dry_run: bool = False) -> dict[str, Any]:
    ctx.authorize(Action.GC, target="retention")
    with ctx.catalog.session() as s:
        records, protections = retention_records(s, key=_log_key(ctx))
    decisions = plan(records, ctx.policy.retention, now(), protections)
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
        collect_lost(ctx, out, dry_run=True)
        out["freed_bytes"] = sum(
            d["bytes"] for d in out["decisions"] if d["action"] in (DELETE, LOST)
        )
        return out
    where = {r.id: r for r in records}
    with gc_lease(ctx):
        freed = finish_interrupted(ctx, out["errors"])
        doomed = [d for d in decisions if d.action == DELETE]
        for start in range(0, len(doomed), BATCH):
            batch = doomed[start : start + BATCH]
            marked = _mark_deleting(ctx, batch, out["errors"])
            faults.point("gc-marked")
            for d in batch:
                if d.id not in marked:
                    _note_skip(out, d.ref)
                    continue
                r = where[d.id]
                freed += delete_checkpoint(
                    ctx, CheckpointRef(r.project, r.run, r.step), out["errors"]
                )
        freed += sweep_orphans(ctx, out)
        freed += collect_lost(ctx, out)
        out["freed_bytes"] = freed
    return out


def _note_skip(out: dict[str, Any], ref: str) -> None:
    for d in out["decisions"]:
        if d["ref"] == ref:
            d["action"], d["reason"] = "keep", "kept: protected since the plan was made"


def _mark_deleting(ctx: Context, batch: list[Decision], errors: list[str]) -> set[int]:
    """Mark a batch `deleting`, skipping any that became protected since planning, and, behind
    the server, any the signed audit log protects whatever its row says (an error names it)."""
    key = _log_key(ctx)
    with ctx.catalog.session(write=True) as s:
        protections = current_protections(s, key)
        logged: dict[str, str] = {}
        if key is not None:
            from registry.trust.logged_protections import protected_by_log

            logged = protected_by_log(s, key, [d.ref for d in batch])
            for d in batch:
                if d.ref in logged:
                    errors.append(
                        f"{d.ref}: kept: {logged[d.ref]}, though the catalog's row says not "
                        "(changed outside reg: reg audit verify, then tell an admin)"
                    )
        ids = [
            d.id
            for d in batch
            if d.id not in protections.held
            and d.id not in protections.release_sources
            and d.ref not in logged
        ]
        reasons = {d.id: d.reason for d in batch}
        marked = set()
        rows = s.exec(
            select(Checkpoint, Run)
            .join(Run, col(Run.id) == Checkpoint.run_id)
            .where(
                col(Checkpoint.id).in_(ids),
                Checkpoint.state == COMMITTED,
                col(Checkpoint.pinned).is_(False),
            )
        ).all()
        for row, run in rows:
            if run.resumed_from_step == row.step:
                continue
            _mark(ctx, s, row, reasons[row.id or 0])
            marked.add(row.id or 0)
    return marked


def _mark(ctx: Context, s: Session, row: Checkpoint, reason: str) -> None:
    """`deleting`, with why, by whom and when; behind the server, signed."""
    row.state, row.delete_reason = DELETING, reason
    row.deleted_by, row.deleted_at = ctx.actor, now()
    s.add(row)
    if ctx.audit_key is not None:  # the server finishes only the marks it signed
        s.flush()
        content = signed_facts.deletion_content(row, signed_facts.subject_of(s, row.id or 0))
        signed_facts.sign(
            s, ctx.audit_key, signed_facts.DELETION, row.id or 0, content, signed_by=ctx.actor
        )


LOST = "lost"  # the decision on a tier-0 step no node holds (`lifecycle.checkpoints.lost`)


def collect_lost(ctx: Context, out: dict[str, Any], *, dry_run: bool = False) -> int:
    """Tier-0 steps nobody is copying to the store, older than orphan_grace, whose every node
    copy is gone: nothing can restore or copy them, so they are marked lost (not collected: the
    step may be saved again). Whatever a lost step's copy had put in the store is deleted.
    `dry_run`: only listed."""
    grace = ctx.policy.retention.orphan_grace
    found: list[tuple[CheckpointRef, bool]] = []  # (ref, marked lost by this run)
    with ctx.catalog.session(write=not dry_run) as s:
        rows = s.exec(
            select(Checkpoint, Run.name, Project.name)
            .join(Run, col(Run.id) == Checkpoint.run_id)
            .join(Project, col(Project.id) == Run.project_id)
            .where(
                or_(
                    and_(
                        col(Checkpoint.state) == LOCAL,
                        col(Checkpoint.created_at) < now() - grace,
                        col(Checkpoint.pinned).is_(False),
                    ),
                    col(Checkpoint.state) == LOST_STATE,
                )
            )
        ).all()
        for row, run, project in rows:
            ref = CheckpointRef(project, run, row.step)
            if row.state == LOST_STATE:
                # a step never to be copied (`replicate_every`) left nothing in the store
                if not (isinstance(row.save_costs, dict) and row.save_costs.get(TIER0_ONLY)):
                    found.append((ref, False))
            elif (
                not held_copies(s, row.id or 0)
                and not claims.is_live(row)
                and (dry_run or lose_if_gone(ctx, s, row, ref))
            ):
                found.append((ref, True))
    freed = 0
    for ref, marked in found:
        got = 0
        prefix = checkpoint_prefix(ref.project, ref.run, ref.step or 0)
        if dry_run:
            got = sum(o.size for o in ctx.store.list(prefix))
        else:
            got = _clear_lost(ctx, ref, prefix, out["errors"])
        freed += got
        if marked or got:
            out["decisions"].append(
                {"ref": str(ref), "action": LOST, "reason": LOST_REASON, "bytes": got}
            )
    return freed


def _clear_lost(ctx: Context, ref: CheckpointRef, prefix: str, errors: list[str]) -> int:
    """Delete what lost step `ref`'s copy left under `prefix`, holding the row meanwhile so
    that a new attempt at the step (which writes there) waits; 0 if one already took it."""
    with ctx.catalog.session(write=True) as s:
        row = _row_of(s, ref)
        token = None if row is None else hold_lost(s, row.id or 0)
    if row is None or token is None:
        return 0
    try:
        return delete_prefix(ctx, prefix, str(ref), errors)[0]
    finally:
        with ctx.catalog.session(write=True) as s:
            release_lost(s, row.id or 0, token)


def delete_prefix(ctx: Context, prefix: str, label: str, errors: list[str]) -> tuple[int, bool]:
    """Delete every object under `prefix`, MANIFEST.json first so the prefix stops looking
    committed: (bytes freed, all gone). A failed delete is logged, never raised: the next run
    retries it, and it never stops the others."""
    keys = [o.key for o in ctx.store.list(prefix)]
    manifest = [k for k in keys if k == prefix + MANIFEST]
    failed: dict[str, str] = {}
    freed = 0
    for batch in (manifest, [k for k in keys if k not in manifest]):
        if batch and not failed:
            try:
                got, failed = ctx.store.delete_many(batch)
                freed += got
            except RegistryError as exc:
                failed = {batch[0]: str(exc)}
    for key, why in failed.items():
        errors.append(f"{label}: could not delete {key}: {why}")
    return freed, not failed


def delete_checkpoint(ctx: Context, ref: CheckpointRef, errors: list[str]) -> int:
    """Delete a checkpoint's objects, then leave the tombstone (a row marked `deleting`).
    Behind the server only a mark GC signed is carried out: one written into the catalog
    around it is reported and left (`registry.trust.signed_facts`)."""
    if ctx.server and not _mark_is_signed(ctx, ref):
        errors.append(
            f"{ref}: its deletion mark is unsigned or forged (not made by this server's GC): "
            "left as it is (reg fsck names it)"
        )
        return 0
    prefix = checkpoint_prefix(ref.project, ref.run, ref.step or 0)
    freed, done = delete_prefix(ctx, prefix, str(ref), errors)
    if not done:
        return freed
    with ctx.catalog.session(write=True) as s:
        row = _row_of(s, ref)
        if row is not None and row.state == DELETING:
            row.state = DELETED
            s.add(row)
            ctx.audit(s, "gc", str(ref), reason=row.delete_reason, freed_bytes=freed)
            ctx.events.emit(
                s,
                events.CHECKPOINT_COLLECTED,
                project=ref.project,
                run=ref.run,
                step=ref.step,
                ref=str(ref),
                reason=row.delete_reason,
            )
    return freed


def _row_of(s: Session, ref: CheckpointRef) -> Checkpoint | None:
    return s.exec(
        select(Checkpoint)
        .join(Run, col(Run.id) == Checkpoint.run_id)
        .join(Project, col(Project.id) == Run.project_id)
        .where(Project.name == ref.project, Run.name == ref.run, Checkpoint.step == ref.step)
    ).first()


def _mark_is_signed(ctx: Context, ref: CheckpointRef) -> bool:
    with ctx.catalog.session() as s:
        row = _row_of(s, ref)
        return (
            row is not None
            and ctx.audit_key is not None
            and signed_facts.deletion_is_signed(s, ctx.audit_key, row)
        )


def finish_interrupted(ctx: Context, errors: list[str]) -> int:
    """Checkpoints a crashed GC left `deleting`: finish them."""
    with ctx.catalog.session() as s:
        rows = s.exec(
            select(Checkpoint.step, Run.name, Project.name)
            .join(Run, col(Run.id) == Checkpoint.run_id)
            .join(Project, col(Project.id) == Run.project_id)
            .where(Checkpoint.state == DELETING)
        ).all()
    return sum(delete_checkpoint(ctx, CheckpointRef(p, r, step), errors) for step, r, p in rows)


def sweep_orphans(ctx: Context, out: dict[str, Any]) -> int:
    """Uploads that never committed: dead claims older than orphan_grace, and sweeps an earlier
    GC did not finish. Each row is first marked `sweeping` under its old claim (a push of the
    step is refused meanwhile, so it cannot publish into a prefix being emptied), its objects
    are deleted, and only then the row goes, freeing the step. Then what crashed writers left in
    the store's own temp space (never a key a live push holds)."""
    grace = ctx.policy.retention.orphan_grace
    with ctx.catalog.session() as s:
        rows = s.exec(
            select(Checkpoint, Run.name, Project.name)
            .join(Run, col(Run.id) == Checkpoint.run_id)
            .join(Project, col(Project.id) == Run.project_id)
            .where(
                or_(
                    col(Checkpoint.state) == SWEEPING,
                    and_(
                        col(Checkpoint.state) == PENDING,
                        col(Checkpoint.created_at) < now() - grace,
                        col(Checkpoint.lease_until) < now(),
                    ),
                )
            )
        ).all()
    freed = 0
    for row, run, project in rows:
        freed += sweep_one(ctx, row, checkpoint_prefix(project, run, row.step), out)
    for swept in ctx.store.sweep_incomplete(CHECKPOINTS, grace, skip=_live_claim_keys(ctx)):
        freed += swept.size
        out["orphans"].append(swept.what)
    return freed


def sweep_one(ctx: Context, row: Checkpoint, prefix: str, out: dict[str, Any]) -> int:
    """One dead upload (a `pending` row whose lease ran out, marked `sweeping` under its old
    claim first) or an unfinished sweep: its objects, then its row. Bytes freed."""
    if row.state == PENDING and not _mark_sweeping(ctx, row):
        return 0  # someone took the claim over meanwhile
    got, done = delete_prefix(ctx, prefix, f"orphan {prefix}", out["errors"])
    if done:
        with ctx.catalog.session(write=True) as s:
            s.exec(
                delete(Checkpoint).where(
                    col(Checkpoint.id) == row.id, col(Checkpoint.state) == SWEEPING
                )
            )
        out["orphans"].append(prefix)
    return got


def _mark_sweeping(ctx: Context, row: Checkpoint) -> bool:
    with ctx.catalog.session(write=True) as s:
        marked = s.exec(
            update(Checkpoint)
            .where(
                col(Checkpoint.id) == row.id,
                col(Checkpoint.state) == PENDING,
                col(Checkpoint.claim_token) == row.claim_token,
                col(Checkpoint.lease_until) < now(),
            )
            .values(state=SWEEPING, deleted_by=ctx.actor, deleted_at=now())
        )
        return marked.rowcount == 1


def _live_claim_keys(ctx: Context) -> Callable[[str], bool]:
    """Keys under a step some push (or a replicator) still holds: its writes in flight are not
    orphans."""
    with ctx.catalog.session() as s:
        pending = s.exec(
            select(Checkpoint, Run.name, Project.name)
            .join(Run, col(Run.id) == Checkpoint.run_id)
            .join(Project, col(Project.id) == Run.project_id)
            .where(col(Checkpoint.state).in_((PENDING, LOCAL)))  # LOCAL: a copy to tier 1
        ).all()
    live = {(p, r, c.step) for c, r, p in pending if claims.is_live(c)}

    def held(key: str) -> bool:
        parsed = parse_checkpoint_key(key)
        return parsed is not None and parsed[:3] in live

    return held
