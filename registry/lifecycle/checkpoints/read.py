"""Reading checkpoints: resolve a ref, show, pull, verify; pin and unpin (DESIGN §3, §7).
A pulled folder keeps the checkpoint's MANIFEST.json (checked offline: `pulled.py`).

Only committed rows are visible; a collected one answers with its tombstone (when, why).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import update

from policies.access import Action
from registry.catalog import queries
from registry.catalog.models import LOST, Checkpoint, Run
from registry.core.layout import MANIFEST, checkpoint_prefix
from registry.core.refs import CheckpointRef, check_reason
from registry.core.timeutil import now
from registry.errors import IntegrityError
from registry.formats.documents import FileRecord
from registry.lifecycle.checkpoints.costs import costs_json
from registry.lifecycle.checkpoints.lost import LOST_REASON
from registry.lifecycle.checkpoints.resume_facts import resume_json
from registry.lifecycle.checkpoints.tiers import tiers_json
from registry.lifecycle.retention import emit_protection_event, explain
from registry.lifecycle.transfer import download
from registry.lifecycle.verify import verify_files
from registry.lifecycle.views import CheckpointView

if TYPE_CHECKING:
    from registry.core.progress import Progress
    from registry.lifecycle.context import Context


def resolve(
    ctx: Context, ref: CheckpointRef, *, tombstones: bool = False, local: bool = False
) -> tuple[Run, Checkpoint, list[FileRecord]]:
    """The committed checkpoint `ref` names (`@latest`: the newest), with its files."""
    with ctx.catalog.session() as s:
        run, ckpt = queries.resolve_checkpoint(s, ref, tombstones=tombstones, local=local)
        return run, ckpt, queries.files_of(s, ckpt.id or 0)


def show(ctx: Context, ref: CheckpointRef) -> dict[str, Any]:
    ctx.authorize_read(project=ref.project)
    run, ckpt, files = resolve(ctx, ref, tombstones=True, local=True)
    full = CheckpointRef(ref.project, run.name, ckpt.step)
    view = CheckpointView.of(ref.project, run.name, ckpt, files)
    out = view.detail_json(ctx.store.describe(checkpoint_prefix(ref.project, run.name, ckpt.step)))
    out.update(resume_json(ctx, full, ckpt, files))  # decided now, under the policy in force
    out["protection"] = explain(ctx, ref.project, run, ckpt)
    if ckpt.state == LOST:  # no copy left: the content rows say what was saved, not what is
        out.update(resumable=False, lost=LOST_REASON)
    with ctx.catalog.session() as s:
        out.update(costs_json(s, ckpt.id or 0, ckpt.save_costs))
        out["tiers"] = tiers_json(s, ckpt)
    return out


def pull(
    ctx: Context, ref: CheckpointRef, dest: Path, *, progress: Progress | None = None
) -> dict[str, Any]:
    """Copy a committed checkpoint to `dest`, verifying every byte, with its MANIFEST.json (the
    record `reg verify --dir` checks the folder against); all or nothing. A trainer's
    pull records the run as resuming from it, so retention keeps it until the run commits a
    newer step (a viewer's pull changes nothing)."""
    ctx.authorize_read(project=ref.project)
    _, ckpt, files = resolve(ctx, ref)
    full = CheckpointRef(ref.project, ref.run, ckpt.step)
    latest: list[Checkpoint] = []

    def still_committed(_: Path | None = None) -> None:
        # A collection that raced the download wins: never hand out a half-deleted checkpoint.
        latest.append(resolve(ctx, full)[1])

    prefix = checkpoint_prefix(ref.project, ref.run, ckpt.step)
    kept = kept_manifest(ctx, prefix, ckpt)
    try:
        where = download(
            ctx.store,
            prefix,
            files if kept is None else [*files, kept],
            dest,
            label=str(full),
            workers=ctx.workers,
            progress=progress,
            before_publish=still_committed,
        )
    except IntegrityError:
        still_committed()  # a file gone because GC collected it meanwhile: exit 3, says so
        raise
    if ctx.principal.authorize(Action.PUSH, project=ref.project).allowed:
        record_resume(ctx, full)

    out = CheckpointView.of(ref.project, ref.run, latest[0], files).to_json()
    out.update(resume_json(ctx, full, latest[0], files, full=False))  # its bytes are verified
    out["dest"] = str(where)
    out["manifest_sha256"] = latest[0].manifest_sha256
    out["kept"] = MANIFEST if kept is not None else None  # `reg verify --dir` checks against it
    return out


def kept_manifest(ctx: Context, prefix: str, ckpt: Checkpoint) -> FileRecord | None:
    """The checkpoint's MANIFEST.json as a file the pull copies too, verified like the others
    against the digest the catalog recorded: the pulled folder can then be checked offline
    (`reg verify --dir`) and pushed again. None for a row that records no manifest digest."""
    if not ckpt.manifest_sha256:
        return None
    info = ctx.store.head(prefix + MANIFEST, version=ckpt.manifest_version)
    size = info.size if info is not None else 0  # missing: the download says so (exit 1)
    return FileRecord(MANIFEST, size, ckpt.manifest_sha256, version=ckpt.manifest_version)


def record_resume(ctx: Context, ref: CheckpointRef) -> None:
    """The run resumes from `ref`: retention keeps it until the run commits a newer step.
    Audited: it changes what retention may delete."""
    with ctx.catalog.session(write=True) as s:
        run = queries.find_run(s, ref.project, ref.run)
        if run is not None:
            before = run.resumed_from_step
            run.resumed_from_step, run.resumed_at = ref.step, now()
            s.add(run)
            ctx.audit(s, "resume", str(ref))
            s.flush()
            from sqlmodel import col, select

            from registry.catalog.models import COMMITTED

            steps = {before, ref.step} - {None}  # the one protected now, and the one before
            for ckpt in s.exec(
                select(Checkpoint).where(
                    Checkpoint.run_id == run.id,
                    col(Checkpoint.step).in_(steps),
                    Checkpoint.state == COMMITTED,
                )
            ).all():
                full = CheckpointRef(ref.project, ref.run, ckpt.step)
                emit_protection(ctx, s, full, run, ckpt)


def verify(
    ctx: Context, ref: CheckpointRef, *, repair: bool = False, progress: Progress | None = None
) -> dict[str, Any]:
    """Re-hash the stored copy. Returns a report; `ok` is false when any file is damaged.
    `repair` restores damaged files from their recorded versions (versioned buckets)."""
    ctx.authorize_read(project=ref.project)
    _, ckpt, files = resolve(ctx, ref)
    full = CheckpointRef(ref.project, ref.run, ckpt.step)
    prefix = checkpoint_prefix(ref.project, ref.run, ckpt.step)
    manifest = kept_manifest(ctx, prefix, ckpt)  # its MANIFEST.json too: every stored byte
    report = verify_files(
        ctx,
        prefix,
        files + ([manifest] if manifest is not None else []),
        name=str(full),
        scope={"project": ref.project},
        repair=repair,
        immutable=False,
        progress=progress,
    )
    if report["ok"] and ckpt.digests_reported_by is not None:
        rehashed(ctx, ckpt.id or 0, str(full))
    return {"ref": str(full), **report}


def rehashed(ctx: Context, checkpoint_id: int, ref: str) -> None:
    """Every byte matched the client-reported digests: they are the registry's own now."""

    with ctx.catalog.session(write=True) as s:
        s.exec(
            update(Checkpoint)
            .where(Checkpoint.id == checkpoint_id)  # type: ignore[arg-type]
            .values(digests_reported_by=None)
        )
        ctx.audit(s, "rehash", ref, note="the client-reported digests matched every byte")


def set_pin(
    ctx: Context, ref: CheckpointRef, pinned: bool, reason: str | None = None
) -> dict[str, Any]:
    from registry.journal.write import record as journal_record

    reason = check_reason(reason, "pin reason")
    action = Action.PIN if pinned else Action.UNPIN
    ctx.authorize(action, project=ref.project, target=str(ref))
    with ctx.catalog.session(write=True) as s:
        run, ckpt = queries.resolve_checkpoint(s, ref)
        ckpt.pinned = pinned
        ckpt.pin_reason = reason if pinned else None
        ckpt.pinned_by = ctx.actor if pinned else None
        s.add(ckpt)
        full = CheckpointRef(ref.project, ref.run, ckpt.step)
        ctx.audit(s, action, str(full), reason=reason)
        s.flush()
        emit_protection(ctx, s, full, run, ckpt)
        files = queries.files_of(s, ckpt.id or 0)
        out = CheckpointView.of(ref.project, run.name, ckpt, files).to_json()
        journal_record(  # last: the commit follows it (registry.journal.write)
            ctx,
            s,
            action,
            {"project": ref.project, "run": run.name, "step": ckpt.step},
            {"reason": reason} if pinned else {},
        )
    return out | resume_json(ctx, full, ckpt, files, full=False)


def emit_protection(ctx: Context, session: Any, ref: CheckpointRef, run: Any, ckpt: Any) -> None:
    """Tell the MLflow mirror the checkpoint's protection and expiry as they are now."""
    retention = explain(ctx, ref.project, run, ckpt, session)
    emit_protection_event(
        ctx,
        session,
        ref,
        ckpt.pinned,
        retention.get("expires_at"),
        retention.get("reason") or "",
        pinned_by=ckpt.pinned_by,
        pin_reason=ckpt.pin_reason,
    )
