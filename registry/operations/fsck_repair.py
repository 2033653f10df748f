"""`reg fsck --repair`: only what is safe, only to what the findings name, under the GC lease
(taken before the snapshot), audited with every key and place it touched.

    damaged or missing files   restored from the object version their record names, once that
                               version is proven to hold the recorded bytes (versioned buckets)
    unfinished-deletion        finished, as the next GC would
    stale-claim                swept as GC sweeps: a dead upload once its lease ran out and it
                               is older than orphan_grace (its row is marked `sweeping` under
                               its old claim first), an unfinished sweep at once
    tombstone-objects          deleted, when no MANIFEST.json remains (a collected step is
                               never pushed again)
    unlisted-object            under a committed checkpoint: deleted; under a place no row names:
                               swept under a `sweeping` row, so a push of that step is refused
                               while it goes (as GC sweeps a dead claim)

Left for a person, and said so: anything under `release/` (release objects are never deleted),
keys reg refuses, uncataloged documents (`reg catalog rebuild`), damage with no good recorded
version, tombstones over a MANIFEST.json, and unfinished promotions (`reg promote` again).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sqlalchemy import delete
from sqlalchemy.exc import IntegrityError as DBIntegrityError
from sqlmodel import col, select

from registry.catalog import claims, queries
from registry.catalog.models import PENDING, SWEEPING, Checkpoint
from registry.core.layout import parse_checkpoint_key
from registry.core.refs import CheckpointRef
from registry.core.timeutil import now
from registry.errors import RegistryError
from registry.formats.documents import FileRecord
from registry.lifecycle.transfer import Problem, repair_stored
from registry.operations import gc
from registry.operations.fsck_findings import (
    DAMAGE,
    INVALID_KEY,
    STALE_CLAIM,
    TOMBSTONE_OBJECTS,
    UNFINISHED_DELETION,
    UNLISTED,
    Artifact,
    Finding,
    Snapshot,
)

if TYPE_CHECKING:
    from registry.lifecycle.context import Context


def repair(
    ctx: Context, snap: Snapshot, findings: list[Finding]
) -> tuple[list[str], list[Finding]]:
    """Returns (what was done, one line each; the findings left). The caller holds the GC
    lease."""
    done: list[str] = []
    left: list[Finding] = []
    errors: list[str] = []
    try:
        places = _orphan_places(snap, findings)
        for f in findings:
            artifact = snap.by_target(f.target)
            if f.kind in DAMAGE or f.target in places:
                continue  # below: per artifact, per place
            if f.kind == UNFINISHED_DELETION and artifact is not None:
                before = len(errors)
                gc.delete_checkpoint(ctx, _ref(artifact), errors)
                ok = len(errors) == before
                _outcome(f, ok, f"finished the deletion of {f.target}", done, left)
            elif f.kind == STALE_CLAIM and artifact is not None:
                _sweep_claim(ctx, artifact, f, done, left, errors)
            elif f.kind == TOMBSTONE_OBJECTS and f.sweepable and artifact is not None:
                _, ok = gc.delete_prefix(ctx, artifact.prefix, f.target, errors)
                _outcome(f, ok, f"deleted what was left of collected {f.target}", done, left)
            elif f.kind == UNLISTED and f.sweepable and artifact is not None and f.key:
                try:  # a stray object inside a committed checkpoint: nothing refers to it
                    ctx.store.delete(f.key)
                    done.append(f"deleted {f.key} (in no manifest)")
                except RegistryError as exc:
                    left.append(Finding(f.kind, f.target, f.key, f"could not delete: {exc}", False))
            else:
                left.append(f)
        for place, found in places.items():
            if _sweep_place(ctx, place, errors):
                done.append(f"swept {place} (no catalog row named it)")
            else:
                left.extend(found)
        left.extend(_restore_damaged(ctx, snap, [f for f in findings if f.kind in DAMAGE], done))
    finally:
        left.extend(Finding("repair-failed", "", None, e, False) for e in errors)
        with ctx.catalog.session(write=True) as s:
            ctx.audit(s, "fsck-repair", "registry", done=done[:500], left=len(left))
    return done, left


def _outcome(f: Finding, ok: bool, line: str, done: list[str], left: list[Finding]) -> None:
    if ok:
        done.append(line)
    else:
        left.append(f)


def _sweep_claim(
    ctx: Context,
    artifact: Artifact,
    f: Finding,
    done: list[str],
    left: list[Finding],
    errors: list[str],
) -> None:
    """As GC sweeps: only a row whose lease ran out and that is older than orphan_grace (a dead
    upload), or one a GC already marked `sweeping`."""
    row = artifact.row
    assert isinstance(row, Checkpoint)
    if row.state == PENDING:
        grace = ctx.policy.retention.orphan_grace
        if claims.is_live(row) or (row.lease_until or 0) >= now():
            left.append(f)
            return
        if row.created_at >= now() - grace:
            left.append(f)
            return
    elif row.state != SWEEPING:
        left.append(f)
        return
    out: dict[str, Any] = {"orphans": [], "errors": errors}
    gc.sweep_one(ctx, row, artifact.prefix, out)
    _outcome(f, artifact.prefix in out["orphans"], f"swept {artifact.prefix}", done, left)


def _restore_damaged(
    ctx: Context, snap: Snapshot, damaged: list[Finding], done: list[str]
) -> list[Finding]:
    left: list[Finding] = []
    by_target: dict[str, list[Finding]] = {}
    for f in damaged:
        by_target.setdefault(f.target, []).append(f)
    for target, found in by_target.items():
        artifact = snap.by_target(target)
        if artifact is None:
            left.extend(found)
            continue
        prefix = artifact.prefix
        files = [_sized(ctx, prefix, r) for r in artifact.files]
        problems = [Problem((f.key or "").removeprefix(prefix), f.detail) for f in found]
        try:
            repaired, unrepaired = repair_stored(
                ctx.store, prefix, files, problems, immutable=artifact.release
            )
        except RegistryError as exc:
            left.extend(Finding(f.kind, target, f.key, f"{f.detail}; {exc}", False) for f in found)
            continue
        done.extend(f"restored {prefix}{path} from its recorded version" for path in repaired)
        left.extend(
            Finding(found[0].kind, target, prefix + p.path, p.problem, False) for p in unrepaired
        )
    return left


def _sized(ctx: Context, prefix: str, record: FileRecord) -> FileRecord:
    """A MANIFEST.json record carries no size: its recorded version's is the one to restore."""
    if record.size >= 0 or record.version is None:
        return record
    info = ctx.store.head(prefix + record.path, version=record.version)
    size = info.size if info is not None else 0
    return FileRecord(record.path, size, record.sha256, record.rank, record.version)


def _orphan_places(snap: Snapshot, findings: list[Finding]) -> dict[str, list[Finding]]:
    """Places no row names whose objects are all sweepable (none with a key reg refuses)."""
    places: dict[str, list[Finding]] = {}
    for f in findings:
        if f.kind == UNLISTED and f.sweepable and snap.by_target(f.target) is None:
            places.setdefault(f.target, []).append(f)
    refused = {f.target for f in findings if f.kind == INVALID_KEY}
    return {p: found for p, found in places.items() if p not in refused}


def _ref(artifact: Artifact) -> CheckpointRef:
    parsed = parse_checkpoint_key(artifact.prefix + "x")
    assert parsed is not None
    return CheckpointRef(parsed[0], parsed[1], parsed[2])


def _sweep_place(ctx: Context, prefix: str, errors: list[str]) -> bool:
    """Objects under a step no row names: a `sweeping` row refuses pushes of that step while
    they are deleted, then goes. False (the row gone again) when a push claimed the step since
    the listing, or a delete failed."""
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
    _, ok = gc.delete_prefix(ctx, prefix, f"orphan {prefix}", errors)
    with ctx.catalog.session(write=True) as s:  # gone either way: a retry starts afresh
        s.exec(
            delete(Checkpoint).where(
                col(Checkpoint.id) == row_id, col(Checkpoint.state) == SWEEPING
            )
        )
    return ok
