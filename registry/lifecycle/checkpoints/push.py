"""Push: register a DCP checkpoint directory as project/run@step (DESIGN §3, §4).

Claim the step in the catalog (a pending row with a claim), upload every file put-if-absent
while hashing it, write MANIFEST.json last, then commit the row under the claim. Readers trust
only committed rows, so a crash at any point leaves nothing visible, and the next push of the
step takes over the stale claim and reuses what was uploaded.
"""

from __future__ import annotations

import hashlib
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy.exc import IntegrityError as DBIntegrityError
from sqlmodel import select

from policies.resume import ResumeInventory, classify
from registry import audit, events
from registry.catalog import claims, queries
from registry.catalog.claims import Claim
from registry.catalog.models import (
    COMMITTED,
    DELETED,
    DELETING,
    PENDING,
    Checkpoint,
    CheckpointFile,
)
from registry.errors import Conflict, IntegrityError, UsageError
from registry.formats.dcp import ScannedDir, scan_directory
from registry.formats.documents import FileRecord, Manifest, ResumeRecord, TensorSummary
from registry.layout import checkpoint_prefix, manifest_key
from registry.lifecycle.views import CheckpointView
from registry.progress import Counter, Progress
from registry.refs import CheckpointRef, check_name
from registry.storage.base import hash_stream
from registry.timeutil import iso, now
from registry.transfer import OnMismatch, Stored, put_reconciled

if TYPE_CHECKING:
    from registry.context import Context


@dataclass(frozen=True, slots=True)
class PushResult:
    view: CheckpointView
    unchanged: bool  # identical content was already committed; nothing copied
    reused_files: int = 0  # files a killed earlier attempt had uploaded

    def to_json(self) -> dict[str, Any]:
        out = self.view.to_json()
        out["unchanged"] = self.unchanged
        if not self.unchanged:
            out["reused_files"] = self.reused_files
        return out


def push(
    ctx: Context,
    src: Path,
    *,
    run: str,
    step: int,
    project: str,
    world_size: int | None = None,
    metrics: dict[str, float] | None = None,
    progress: Progress | None = None,
    notes: list[str] | None = None,
) -> PushResult:
    """Register the DCP checkpoint in `src` as project/run@step."""
    ref = _check_request(project, run, step)
    metrics = _check_metrics(metrics or {})
    ctx.authorize("push", project=project, target=str(ref))
    scanned = scan_directory(Path(src))
    world = _world_size(scanned, world_size, notes)
    resume = classify(scanned.inventory.top_level_keys(), ctx.policy.resume)

    claim, existing = _claim(ctx, ref)
    if existing is not None:
        return _compare_existing(ctx, ref, scanned, existing)
    started = time.monotonic()
    with claims.held(ctx.catalog, claim):
        uploaded = _upload(ctx, ref, scanned, progress)
        upload_seconds = time.monotonic() - started
        manifest = _manifest(ctx, ref, scanned, uploaded, world, resume, metrics)
        data = manifest.to_bytes()
        put_reconciled(
            ctx.store,
            manifest_key(project, run, step),
            data=data,
            on_mismatch=OnMismatch.REPLACE,  # a leftover of our own earlier attempt
        )
        return _commit(ctx, claim, scanned, manifest, data, upload_seconds, uploaded)


def _check_request(project: str, run: str, step: int) -> CheckpointRef:
    check_name(project, "project name")
    check_name(run, "run name")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise UsageError(f"step must be a whole number >= 0, got {step!r}")
    if step >= 10**18:
        raise UsageError(f"step {step} is too large", "steps are below 10^18")
    return CheckpointRef(project, run, step)


def _check_metrics(metrics: dict[str, float]) -> dict[str, float]:
    out = {}
    for name, value in metrics.items():
        check_name(name, "metric name")
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise UsageError(f"metric {name} is {value!r}, not a number")
        if not math.isfinite(value):
            raise UsageError(f"metric {name} is {value}", "metrics are finite numbers")
        out[name] = float(value)
    return out


def _world_size(
    scanned: ScannedDir, given: int | None, notes: list[str] | None
) -> tuple[int, bool]:
    inferred = scanned.inferred_world_size
    if given is None:
        if notes is not None:
            notes.append(
                f"world size {inferred} inferred from rank file names "
                "(a lower bound; pass --world-size to record the real one)"
            )
        return inferred, True
    if given < 1:
        raise UsageError(f"--world-size must be >= 1, got {given}")
    if given < inferred:
        raise UsageError(
            f"--world-size {given} is smaller than the {inferred} ranks the shard files show",
            "pass the world size the checkpoint was saved at",
        )
    return given, False


def _claim(ctx: Context, ref: CheckpointRef) -> tuple[Claim, Checkpoint | None]:
    """Take the step: a new pending row, or a stale claim. Returns the committed row instead if
    the step is already committed."""
    for _ in range(5):
        with ctx.catalog.session(write=True) as s:
            _, run = queries.get_or_create_run(s, ref.project, ref.run)
            row = s.exec(
                select(Checkpoint).where(Checkpoint.run_id == run.id, Checkpoint.step == ref.step)
            ).first()
            if row is None:
                token = claims.new_token()
                row = Checkpoint(
                    run_id=run.id or 0,
                    step=ref.step or 0,
                    state=PENDING,
                    created_at=now(),
                    pushed_by=ctx.actor,
                    **claims.claim_columns(token),
                )
                try:
                    with s.begin_nested():
                        s.add(row)
                except DBIntegrityError:
                    continue  # a concurrent push inserted it first: look again
                s.flush()
                assert row.id is not None
                return Claim(Checkpoint, row.id, token), None
            if row.state == COMMITTED:
                return Claim(Checkpoint, row.id or 0, ""), row
            if row.state in (DELETING, DELETED):
                raise Conflict(
                    f"{ref} was collected by retention at {iso(row.deleted_at)} "
                    f"({row.delete_reason}); a collected step is not pushed again",
                    "push under a new step",
                )
            if claims.is_live(row):
                raise Conflict(
                    f"{ref} is being pushed by {row.pushed_by} on {row.claim_host} "
                    f"(pid {row.claim_pid}) since {iso(row.created_at)}",
                    "wait for that push to finish or fail; a dead push's claim expires within "
                    f"{claims.LEASE_SECONDS:.0f}s",
                )
            taken = claims.take_over(s, row, pushed_by=ctx.actor, created_at=now())
            if taken is not None:
                return taken, None
    raise Conflict(f"could not claim {ref}: it kept changing under concurrent pushes", "retry")


def _upload(
    ctx: Context, ref: CheckpointRef, scanned: ScannedDir, progress: Progress | None
) -> list[Stored]:
    prefix = checkpoint_prefix(ref.project, ref.run, ref.step or 0)
    if progress:
        progress.start(f"push {ref}", sum(scanned.files.values()))
    counter = Counter(progress)

    def one(path: str) -> Stored:
        # A file already there is a leftover of an earlier attempt at this step (we hold the
        # claim): reused if it is the same bytes, replaced otherwise.
        return put_reconciled(
            ctx.store,
            prefix + path,
            path=scanned.root / path,
            on_mismatch=OnMismatch.REPLACE,
            progress=counter,
        )

    # Largest first keeps the workers busy to the end.
    order = sorted(scanned.files, key=lambda p: -scanned.files[p])
    try:
        with ThreadPoolExecutor(max_workers=ctx.workers) as pool:
            results = list(pool.map(one, order))
    finally:
        if progress:
            progress.finish()
    for r in results:
        path = r.key.removeprefix(prefix)
        if r.size != scanned.files[path]:
            raise IntegrityError(
                f"{scanned.root / path} changed size while being pushed",
                "push a checkpoint that is no longer being written",
            )
    return sorted(results, key=lambda r: r.key)


def _manifest(
    ctx: Context,
    ref: CheckpointRef,
    scanned: ScannedDir,
    uploaded: list[Stored],
    world: tuple[int, bool],
    resume: ResumeInventory,
    metrics: dict[str, float],
) -> Manifest:
    prefix = checkpoint_prefix(ref.project, ref.run, ref.step or 0)
    files = []
    for u in uploaded:
        path = u.key.removeprefix(prefix)
        files.append(FileRecord(path, u.size, u.sha256, scanned.rank_of(path)))
    summary = scanned.inventory.summary()
    return Manifest(
        project=ref.project,
        run=ref.run,
        step=ref.step or 0,
        world_size=world[0],
        world_size_inferred=world[1],
        files=tuple(files),
        tensors=TensorSummary(summary["tensors"], summary["tensor_bytes"], summary["objects"]),
        resume=ResumeRecord(resume.classes, resume.missing, resume.resumable, resume.unclassified),
        metrics=metrics,
        pushed_by=ctx.actor,
        created_at=iso(now()) or "",
    )


def _commit(
    ctx: Context,
    claim: Claim,
    scanned: ScannedDir,
    manifest: Manifest,
    manifest_bytes: bytes,
    upload_seconds: float,
    uploaded: list[Stored],
) -> PushResult:
    ref = manifest.ref
    manifest_sha256 = hashlib.sha256(manifest_bytes).hexdigest()
    with ctx.catalog.session(write=True) as s:
        committed = claims.guarded_update(
            s,
            claim,
            state=COMMITTED,
            world_size=manifest.world_size,
            world_size_inferred=manifest.world_size_inferred,
            bytes=manifest.bytes,
            file_count=len(manifest.files),
            tensor_count=manifest.tensors.tensors,
            tensor_bytes=manifest.tensors.tensor_bytes,
            manifest_sha256=manifest_sha256,
            resumable=manifest.resume.resumable,
            missing_state=manifest.resume.missing,
            resume_classes=manifest.resume.classes,
            metrics=manifest.metrics,
            committed_at=now(),
            upload_seconds=round(upload_seconds, 3),
            claim_token=None,
            lease_until=None,
        )
        if not committed:
            raise Conflict(
                f"lost the claim on {ref} while pushing (another push took it over)",
                "check `reg show` and push again if needed",
            )
        for f in manifest.files:
            s.add(
                CheckpointFile(
                    checkpoint_id=claim.row_id,
                    path=f.path,
                    size=f.size,
                    sha256=f.sha256,
                    rank=f.rank,
                )
            )
        run = queries.find_run(s, ref.project, ref.run)
        if (
            run is not None
            and run.resumed_from_step is not None
            and manifest.step > run.resumed_from_step
        ):
            run.resumed_from_step = None  # a newer step lifts the resume protection
            s.add(run)
        reused = sum(u.reused for u in uploaded)
        audit.record(
            s,
            ctx.actor,
            "push",
            str(ref),
            bytes=manifest.bytes,
            files=len(manifest.files),
            reused=reused,
        )
        ttl = ctx.policy.retention.for_project(ref.project).ttl
        ctx.events.emit(
            s,
            events.CHECKPOINT_COMMITTED,
            project=ref.project,
            run=ref.run,
            step=ref.step,
            ref=str(ref),
            world_size=manifest.world_size,
            bytes=manifest.bytes,
            resumable=manifest.resume.resumable,
            missing_state=manifest.resume.missing,
            metrics=manifest.metrics,
            uri=ctx.store.describe(checkpoint_prefix(ref.project, ref.run, manifest.step)),
            manifest_sha256=manifest_sha256,
            committed_at=now(),
            expires_at=None if ttl == float("inf") else now() + ttl,
        )
        s.flush()
        row = s.get(Checkpoint, claim.row_id)
        assert row is not None
        view = CheckpointView.of(ref.project, ref.run, row, queries.files_of(s, claim.row_id))
    return PushResult(view, unchanged=False, reused_files=reused)


def _compare_existing(
    ctx: Context, ref: CheckpointRef, scanned: ScannedDir, existing: Checkpoint
) -> PushResult:
    with ctx.catalog.session() as s:
        files = queries.files_of(s, existing.id or 0)
    stored = {f.path: (f.size, f.sha256) for f in files}
    differs = f"{ref} is already committed with different content"
    hint = f"pushed by {existing.pushed_by} at {iso(existing.committed_at)}; push under a new step"
    if set(stored) != set(scanned.files) or any(
        stored[p][0] != size for p, size in scanned.files.items()
    ):
        raise Conflict(differs, hint)

    def digest(path: str) -> str:
        with open(scanned.root / path, "rb") as f:
            return hash_stream(f)[1]

    with ThreadPoolExecutor(max_workers=ctx.workers) as pool:
        digests = dict(zip(scanned.files, pool.map(digest, scanned.files), strict=True))
    if any(stored[p][1] != d for p, d in digests.items()):
        raise Conflict(differs, hint)
    return PushResult(CheckpointView.of(ref.project, ref.run, existing, files), unchanged=True)
