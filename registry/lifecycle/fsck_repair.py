"""`reg fsck --repair`: only what is safe, under the GC lease, audited.

    damaged or missing files   restored from the object version their record names, once that
                               version is proven to hold the recorded bytes (versioned buckets)
    unfinished-deletion        finished, as the next GC would
    stale-claim                swept (a dead upload's objects, then its row), as GC would, but
                               without waiting out orphan_grace: its holder is gone
    tombstone-objects          deleted (a collected step is never pushed again)
    unlisted-object            under a committed checkpoint: deleted; under a place no row names:
                               swept under a `sweeping` row, so a push of that step is refused
                               while it goes (exactly as GC sweeps a dead claim)

Left for a person, and said so: anything under `release/` (release objects are never deleted),
uncataloged documents (`reg catalog rebuild`), damage with no good recorded version, and
unfinished promotions (`reg promote` again finishes them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sqlalchemy import delete
from sqlalchemy.exc import IntegrityError as DBIntegrityError
from sqlmodel import col, select

from registry.catalog import leases, queries
from registry.catalog.models import SWEEPING, Checkpoint
from registry.errors import RegistryError
from registry.layout import parse_checkpoint_key
from registry.lifecycle import gc
from registry.lifecycle.fsck import (
    DAMAGE,
    STALE_CLAIM,
    TOMBSTONE_OBJECTS,
    UNFINISHED_DELETION,
    UNLISTED,
    Finding,
    Snapshot,
)
from registry.timeutil import now
from registry.transfer import Problem, repair_stored

if TYPE_CHECKING:
    from registry.context import Context


def repair(
    ctx: Context, snap: Snapshot, findings: list[Finding]
) -> tuple[list[str], list[Finding]]:
    """Returns (what was done, one line each; the findings left)."""
    ctx.authorize("repair", target="fsck --repair")
    done: list[str] = []
    left: list[Finding] = []
    errors: list[str] = []
    kinds = {f.kind for f in findings}
    with leases.renewed(ctx.catalog, gc.GC_LEASE, gc.acquire(ctx), gc.GC_LEASE_SECONDS):
        left.extend(_restore_damaged(ctx, snap, [f for f in findings if f.kind in DAMAGE], done))
        if UNFINISHED_DELETION in kinds:
            gc.finish_interrupted(ctx, errors)
            done.extend(
                f"finished the deletion of {f.target}"
                for f in findings
                if f.kind == UNFINISHED_DELETION
            )
        if STALE_CLAIM in kinds:
            out: dict[str, Any] = {"orphans": [], "errors": errors}
            gc.sweep_orphans(ctx, out, grace=0.0)
            done.extend(f"swept {prefix}" for prefix in out["orphans"])
        for f in findings:
            if f.kind == TOMBSTONE_OBJECTS:
                _, ok = gc.delete_prefix(ctx, snap_prefix(snap, f), f.target, errors)
                if ok:
                    done.append(f"deleted what was left of collected {f.target}")
        left.extend(_sweep_unlisted(ctx, snap, [f for f in findings if f.kind == UNLISTED], done))
        handled = {*DAMAGE, UNFINISHED_DELETION, STALE_CLAIM, TOMBSTONE_OBJECTS, UNLISTED}
        left.extend(f for f in findings if f.kind not in handled)
    left.extend(Finding("repair-failed", "", None, e, False) for e in errors)
    with ctx.catalog.session(write=True) as s:
        ctx.audit(s, "fsck-repair", "registry", repaired=len(done), left=len(left))
    return done, left


def snap_prefix(snap: Snapshot, f: Finding) -> str:
    return next(p for p, a in snap.artifacts.items() if a.target == f.target)


def _restore_damaged(
    ctx: Context, snap: Snapshot, damaged: list[Finding], done: list[str]
) -> list[Finding]:
    left: list[Finding] = []
    by_target: dict[str, list[Finding]] = {}
    for f in damaged:
        by_target.setdefault(f.target, []).append(f)
    for target, found in by_target.items():
        prefix = snap_prefix(snap, found[0])
        artifact = snap.artifacts[prefix]
        problems = [Problem((f.key or "").removeprefix(prefix), f.detail) for f in found]
        repaired, unrepaired = repair_stored(
            ctx.store, prefix, artifact.files, problems, immutable=artifact.release
        )
        done.extend(f"restored {prefix}{path} from its recorded version" for path in repaired)
        left.extend(
            Finding(found[0].kind, target, prefix + p.path, p.problem, False) for p in unrepaired
        )
    return left


def _sweep_unlisted(
    ctx: Context, snap: Snapshot, unlisted: list[Finding], done: list[str]
) -> list[Finding]:
    left: list[Finding] = []
    orphan_places: dict[str, list[Finding]] = {}
    for f in unlisted:
        if not f.sweepable or f.key is None:
            left.append(f)
        elif f.target in {a.target for a in snap.artifacts.values()}:
            try:  # a stray object inside a committed checkpoint: nothing refers to it
                ctx.store.delete(f.key)
                done.append(f"deleted {f.key} (in no manifest)")
            except RegistryError as exc:
                left.append(Finding(f.kind, f.target, f.key, f"could not delete: {exc}", False))
        else:
            orphan_places.setdefault(f.target, []).append(f)
    for prefix, found in orphan_places.items():
        if _sweep_place(ctx, prefix):
            done.append(f"swept {prefix} (no catalog row named it)")
        else:
            left.extend(found)
    return left


def _sweep_place(ctx: Context, prefix: str) -> bool:
    """Objects under a step no row names: a `sweeping` row refuses pushes of that step while
    they are deleted, then goes. False when a push claimed the step meanwhile."""
    parsed = parse_checkpoint_key(prefix + "x")
    if parsed is None:
        return False
    project, run_name, step, _ = parsed
    with ctx.catalog.session(write=True) as s:
        _, run = queries.get_or_create_run(s, project, run_name)
        taken = select(Checkpoint).where(Checkpoint.run_id == run.id, Checkpoint.step == step)
        if s.exec(taken).first() is not None:
            return False  # a push claimed the step since the listing: its objects are its own
        row = Checkpoint(
            run_id=run.id or 0,
            step=step,
            state=SWEEPING,
            created_at=now(),
            pushed_by=ctx.actor,
            deleted_by=ctx.actor,
            deleted_at=now(),
        )
        try:
            with s.begin_nested():
                s.add(row)
        except DBIntegrityError:
            return False
        s.flush()
        row_id = row.id
    errors: list[str] = []
    _, ok = gc.delete_prefix(ctx, prefix, f"orphan {prefix}", errors)
    if ok:
        with ctx.catalog.session(write=True) as s:
            s.exec(delete(Checkpoint).where(col(Checkpoint.id) == row_id))
    return ok
