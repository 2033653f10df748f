"""The catalog side of a push: claim the step, commit it under the claim, or compare with what
is already committed (DESIGN §3). `push.py` imports this module only once the copy is running,
so the import of SQLAlchemy and the catalog models overlaps the data path."""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sqlalchemy import insert
from sqlalchemy.exc import IntegrityError as DBIntegrityError
from sqlmodel import select

from registry.catalog import claims, queries
from registry.catalog.claims import Claim
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
    CheckpointTier,
)
from registry.core.layout import checkpoint_prefix
from registry.core.timeutil import iso, now
from registry.errors import Conflict
from registry.journal import outbox as events
from registry.lifecycle.checkpoints import lost
from registry.lifecycle.checkpoints.resume_facts import KeyFacts, resume_json, save
from registry.lifecycle.views import CheckpointView
from registry.storage.base import hash_stream

if TYPE_CHECKING:
    from registry.core.refs import CheckpointRef
    from registry.formats.dcp_scan import ScannedDir
    from registry.formats.documents import Manifest
    from registry.lifecycle.context import Context

held = claims.held


@dataclass(frozen=True, slots=True)
class PushResult:
    view: CheckpointView
    unchanged: bool  # identical content was already committed; nothing copied
    reused_files: int = 0  # files a killed earlier attempt had uploaded
    resume: dict[str, Any] | None = None  # the resume verdict (resume_facts.fields)

    def to_json(self) -> dict[str, Any]:
        out = self.view.to_json() | (self.resume or {})
        out["unchanged"] = self.unchanged
        if not self.unchanged:
            out["reused_files"] = self.reused_files
        return out


def claim_step(ctx: Context, ref: CheckpointRef) -> tuple[Claim, Checkpoint | None]:
    """Take the step: a new pending row, a stale claim, or a new attempt at a lost tier-0 step
    (`lost.py`). Returns the committed row instead if the step is already committed."""
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
                return Claim(Checkpoint, row.id, token, fresh=True), None
            if row.state == COMMITTED:
                return Claim(Checkpoint, row.id or 0, ""), row
            if lost.lose_if_gone(ctx, s, row, ref) or row.state == LOST:
                retry = lost.new_attempt(s, row, pushed_by=ctx.actor)
                if retry is None:
                    continue  # another attempt took it first: look again
                again = retry
                break
            if row.state == LOCAL:
                nodes = ", ".join(sorted(lost.held_copies(s, row.id or 0)))
                copy = (
                    f"being copied to the store {claims.holder(row)}"
                    if claims.is_live(row)
                    else "waiting for a job on those nodes to copy it to the store"
                )
                raise Conflict(
                    f"{ref} is saved at tier 0 since {iso(row.committed_at)}, held by node(s) "
                    f"{nodes}, and {copy}",
                    "save under a new step; a node that no longer holds its copy is recorded "
                    "by that node's next restore, and the step can then be saved again",
                )
            if row.state == SWEEPING:
                raise Conflict(
                    f"an abandoned upload of {ref} is being swept by reg gc",
                    "push again once that GC is done",
                )
            if row.state in (DELETING, DELETED):
                raise Conflict(
                    f"{ref} was collected by retention at {iso(row.deleted_at)} "
                    f"({row.delete_reason}); a collected step is not pushed again",
                    "push under a new step",
                )
            if claims.is_live(row):
                if row.claim_pid is None:  # a launcher's claim (reg claim-ckpt): a lease only
                    raise Conflict(
                        f"{ref} is being pushed by {row.pushed_by} under a claim made on "
                        f"{row.claim_host} at {iso(row.created_at)}",
                        f"commit it with `reg commit-ckpt`, or wait until its lease runs out "
                        f"({iso(row.lease_until)})",
                    )
                raise Conflict(
                    f"{ref} is being pushed by {row.pushed_by} on {row.claim_host} "
                    f"(pid {row.claim_pid}) since {iso(row.created_at)}",
                    "wait for that push to finish or fail; a dead push's claim expires within "
                    f"{claims.LEASE_SECONDS:.0f}s",
                )
            taken = claims.take_over(s, row, pushed_by=ctx.actor, created_at=now())
            if taken is not None:
                return taken, None
    else:
        raise Conflict(f"could not claim {ref}: it kept changing under concurrent pushes", "retry")
    # What the lost attempt's copy put in the store is cleared by the shared claim, or reused
    # by a push where its digests match (`push.py`), as a dead push's files are.
    return again, None


def ensure_held(ctx: Context, claim: Claim, ref: CheckpointRef) -> None:
    """Raise Conflict unless the claim is still ours (before anything is replaced under it)."""
    if not claims.still_held(ctx.catalog, claim):
        raise Conflict(
            f"lost the claim on {ref} while pushing (another push took it over)",
            "check `reg show` and push again if needed",
        )


def commit(
    ctx: Context,
    claim: Claim,
    manifest: Manifest,
    manifest_bytes: bytes,
    manifest_version: str | None,
    upload_seconds: float,
    reused: int,
    *,
    digests_reported_by: str | None = None,
    save_costs: dict[str, Any] | None = None,
    local: tuple[str, bool, list[CheckpointTier]] | None = None,
) -> PushResult:
    """Make the step visible: committed in one transaction with its files, the audit record and
    the MLflow event, only while the claim is still ours.

    `local` (a replication token, whether this process holds it, the tier-0 copies): committed
    at tier 0 only: the row becomes `local`, claimed by the replicator that will copy
    it to the store, and the MLflow event waits for that copy (`tiers.commit_replicated`)."""
    ref = manifest.ref
    manifest_sha256 = hashlib.sha256(manifest_bytes).hexdigest()
    facts = Checkpoint.facts_of(manifest, manifest_sha256, manifest_version)
    held_by: dict[str, Any] = {"claim_token": None, "lease_until": None}
    if local is not None:
        facts["state"] = LOCAL
        held_by = claims.claim_columns(local[0])
        if not local[1]:
            held_by.update(claim_pid=None, lease_until=0.0)
        elif ctx.server:  # held by the job through the server: its lease alone says so
            held_by.update(claim_pid=None)
    with ctx.catalog.session(write=True) as s:
        committed = claims.guarded_update(
            s,
            claim,
            **facts,
            committed_at=now(),
            upload_seconds=round(upload_seconds, 3),
            digests_reported_by=digests_reported_by,
            save_costs=save_costs,
            **held_by,
        )
        if not committed:
            raise Conflict(
                f"lost the claim on {ref} while pushing (another push took it over)",
                "check `reg show` and push again if needed",
            )
        # One batched INSERT (executemany), not a statement per file: a 4,096-rank checkpoint
        # commits in a few statements.
        s.execute(
            insert(CheckpointFile),
            [CheckpointFile.of(claim.row_id, f).model_dump(exclude={"id"}) for f in manifest.files],
        )
        save_key_facts(s, claim.row_id, manifest)
        if local is None:
            lift_resume_protection(s, ref)
            emit_committed(ctx, s, manifest, manifest_sha256)
        else:
            s.add_all(local[2])
        ctx.audit(
            s,
            "push",
            str(ref),
            bytes=manifest.bytes,
            files=len(manifest.files),
            reused=reused,
            digests_reported_by=digests_reported_by,
            **({} if local is None else {"tier": 0}),
        )
        s.flush()
        row = s.get(Checkpoint, claim.row_id)
        assert row is not None
        view = CheckpointView.of(ref.project, ref.run, row, queries.files_of(s, claim.row_id))
    return PushResult(view, unchanged=False, reused_files=reused)


def lift_resume_protection(session: Any, ref: CheckpointRef) -> None:
    """A newer step in the store lifts the protection of the step the run resumed from."""
    run = queries.find_run(session, ref.project, ref.run)
    resumed = run.resumed_from_step if run is not None else None
    if run is not None and resumed is not None and (ref.step or 0) > resumed:
        run.resumed_from_step = None
        session.add(run)


def save_key_facts(session: Any, checkpoint_id: int, manifest: Manifest) -> None:
    """The manifest's key paths into the catalog (format /3 on; older ones get them on first
    use, from their `.metadata`)."""
    r = manifest.resume
    if r.layout is not None and r.keys is not None:
        save(session, checkpoint_id, KeyFacts(r.keys, r.sidecars or (), r.layout))


def emit_committed(ctx: Context, session: Any, manifest: Manifest, manifest_sha256: str) -> None:
    ref = manifest.ref
    ttl = ctx.policy.retention.for_project(ref.project).ttl
    ctx.events.emit(
        session,
        events.CHECKPOINT_COMMITTED,
        project=ref.project,
        run=ref.run,
        step=ref.step,
        ref=str(ref),
        world_size=manifest.world_size,
        bytes=manifest.bytes,
        resumable=manifest.resume.resumable,
        missing_state=manifest.resume.missing,
        layout=manifest.resume.layout,
        metrics=manifest.metrics,
        uri=ctx.store.describe(checkpoint_prefix(ref.project, ref.run, manifest.step)),
        manifest_sha256=manifest_sha256,
        pushed_by=manifest.pushed_by,
        committed_at=now(),
        expires_at=None if ttl == float("inf") else now() + ttl,
    )


def compare_existing(
    ctx: Context, ref: CheckpointRef, scanned: ScannedDir, existing: Checkpoint
) -> PushResult:
    """The step is committed: identical content is a no-op (exit 0), anything else a conflict."""
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
        fd = scanned.open(path)  # the file the scan checked, not whatever the path is now
        with os.fdopen(fd, "rb") as f:
            return hash_stream(f)[1]

    with ThreadPoolExecutor(max_workers=ctx.workers) as pool:
        digests = dict(zip(scanned.files, pool.map(digest, scanned.files), strict=True))
    if any(stored[p][1] != d for p, d in digests.items()):
        raise Conflict(differs, hint)

    view = CheckpointView.of(ref.project, ref.run, existing, files)
    resume = resume_json(ctx, view.ref, existing, files, full=False)  # as recorded, not asked
    return PushResult(view, unchanged=True, resume=resume)
