"""The checkpoint lifecycle: push, list, show, pull, verify, pin (DESIGN §3, §4, §7).

Push protocol: claim the step in the catalog (a `pending` row with a lease), upload every file
put-if-absent while hashing it, write MANIFEST.json last, then commit the row. Only the claim
holder writes objects; readers trust only committed rows, so a crash at any point leaves nothing
visible, and the next push of the step takes over the stale claim and reuses what was uploaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import update
from sqlalchemy.exc import IntegrityError as DBIntegrityError
from sqlmodel import col, select

from registry import audit, outbox
from registry.catalog import queries
from registry.catalog.models import (
    COMMITTED,
    DELETED,
    DELETING,
    PENDING,
    Checkpoint,
    CheckpointFile,
    Run,
)
from registry.errors import (
    Conflict,
    IntegrityError,
    NotFound,
    ObjectExists,
    RegistryError,
    UsageError,
)
from registry.formats.dcp import MANIFEST, ScannedDir, scan_directory
from registry.leases import Heartbeat, is_stale
from registry.progress import Counter, Progress
from registry.refs import CheckpointRef, check_name
from registry.storage.base import hash_stream
from registry.timeutil import iso, now

if TYPE_CHECKING:
    from registry.api import Registry

MANIFEST_FORMAT = "reg.manifest/1"
LEASE_SECONDS = 60.0


def checkpoint_prefix(project: str, run: str, step: int) -> str:
    return f"ckpt/{project}/{run}/step-{step}/"


# -- views ------------------------------------------------------------------------------------


def view(project: str, run: str, ckpt: Checkpoint, files: list[CheckpointFile]) -> dict[str, Any]:
    """The JSON shape of a checkpoint (DESIGN §7)."""
    ref = CheckpointRef(project, run, ckpt.step)
    return {
        "ref": str(ref),
        "project": project,
        "run": run,
        "step": ckpt.step,
        "world_size": ckpt.world_size,
        "state": ckpt.state,
        "bytes": ckpt.bytes,
        "files": [{"path": f.path, "size": f.size, "sha256": f.sha256} for f in files],
        "resumable": ckpt.resumable,
        "missing_state": list(ckpt.missing_state),
        "pinned": ckpt.pinned,
        "created_at": iso(ckpt.committed_at or ckpt.created_at),
        "upload_seconds": ckpt.upload_seconds,
    }


def detailed_view(
    reg: Registry, project: str, run: str, ckpt: Checkpoint, files: list[CheckpointFile]
) -> dict[str, Any]:
    out = view(project, run, ckpt, files)
    for f, row in zip(out["files"], files, strict=True):
        f["rank"] = row.rank
    out.update(
        world_size_inferred=ckpt.world_size_inferred,
        tensor_count=ckpt.tensor_count,
        tensor_bytes=ckpt.tensor_bytes,
        resume_state=ckpt.resume_classes,
        metrics=ckpt.metrics,
        pushed_by=ckpt.pushed_by,
        pin_reason=ckpt.pin_reason,
        manifest_sha256=ckpt.manifest_sha256,
        uri=reg.store.describe(checkpoint_prefix(project, run, ckpt.step)),
    )
    if ckpt.state in (DELETING, DELETED):
        out.update(
            deleted_at=iso(ckpt.deleted_at),
            deleted_by=ckpt.deleted_by,
            delete_reason=ckpt.delete_reason,
        )
    return out


# -- push -------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Claim:
    checkpoint_id: int
    token: str


def push(
    reg: Registry,
    src: Path,
    *,
    run: str,
    step: int,
    project: str,
    world_size: int | None = None,
    metrics: dict[str, float] | None = None,
    progress: Progress | None = None,
    notes: list[str] | None = None,
) -> dict[str, Any]:
    """Register the DCP checkpoint in `src` as project/run@step. Returns its view, with
    `"unchanged": true` when identical content was already committed."""
    check_name(project, "project name")
    check_name(run, "run name")
    if step < 0:
        raise UsageError(f"step must be >= 0, got {step}")
    ref = CheckpointRef(project, run, step)
    reg.authorize("push", project=project, target=str(ref))
    scanned = scan_directory(Path(src))
    world_size, inferred = _world_size(scanned, world_size, notes)
    resume = reg.classify_resume(scanned.inventory.top_level_keys())

    claim, existing = _claim(reg, ref)
    if existing is not None:
        return _compare_existing(reg, ref, scanned, existing, reg.settings.workers)

    started = time.monotonic()
    try:
        with Heartbeat(lambda: _renew_claim(reg, claim), LEASE_SECONDS / 4):
            uploaded = _upload(reg, ref, scanned, claim, progress)
            upload_seconds = time.monotonic() - started
            manifest = _manifest(
                reg, ref, scanned, uploaded, (world_size, inferred), resume, metrics or {}
            )
            manifest_bytes = json.dumps(manifest, indent=1, sort_keys=True).encode()
            _put_replacing_leftover(
                reg, checkpoint_prefix(project, run, step) + MANIFEST, manifest_bytes
            )
            return _commit(
                reg, ref, claim, scanned, uploaded, manifest, manifest_bytes, upload_seconds
            )
    except BaseException:
        _expire_claim(reg, claim)
        raise


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


def _claim(reg: Registry, ref: CheckpointRef) -> tuple[_Claim, Checkpoint | None]:
    """Take the step: a new pending row, or a stale claim. Returns the committed row instead if
    the step is already committed."""
    token = uuid.uuid4().hex
    host, pid = socket.gethostname(), os.getpid()
    for _ in range(5):
        with reg.catalog.session(write=True) as s:
            _, run = queries.get_or_create_run(s, ref.project, ref.run)
            row = s.exec(
                select(Checkpoint).where(Checkpoint.run_id == run.id, Checkpoint.step == ref.step)
            ).first()
            if row is None:
                row = Checkpoint(
                    run_id=run.id or 0,
                    step=ref.step or 0,
                    state=PENDING,
                    created_at=now(),
                    pushed_by=reg.user,
                    claim_token=token,
                    claim_host=host,
                    claim_pid=pid,
                    lease_until=now() + LEASE_SECONDS,
                )
                try:
                    with s.begin_nested():
                        s.add(row)
                except DBIntegrityError:
                    continue  # a concurrent push inserted it first: look again
                s.flush()
                assert row.id is not None
                return _Claim(row.id, token), None
            if row.state == COMMITTED:
                return _Claim(row.id or 0, ""), row
            if row.state in (DELETING, DELETED):
                raise Conflict(
                    f"{ref} was collected by retention at {iso(row.deleted_at)} "
                    f"({row.delete_reason}); a collected step is not pushed again",
                    "push under a new step",
                )
            if not is_stale(row.lease_until, row.claim_host, row.claim_pid):
                raise Conflict(
                    f"{ref} is being pushed by {row.pushed_by} on {row.claim_host} "
                    f"(pid {row.claim_pid}) since {iso(row.created_at)}",
                    "wait for that push to finish or fail; a dead push's claim expires within "
                    f"{LEASE_SECONDS:.0f}s",
                )
            taken = s.exec(
                update(Checkpoint)
                .where(
                    col(Checkpoint.id) == row.id,
                    col(Checkpoint.claim_token) == row.claim_token,
                    col(Checkpoint.state) == PENDING,
                )
                .values(
                    claim_token=token,
                    claim_host=host,
                    claim_pid=pid,
                    pushed_by=reg.user,
                    lease_until=now() + LEASE_SECONDS,
                    created_at=now(),
                )
            )
            if taken.rowcount == 1:
                return _Claim(row.id or 0, token), None
    raise Conflict(f"could not claim {ref}: it kept changing under concurrent pushes", "retry")


def _renew_claim(reg: Registry, claim: _Claim) -> None:
    with reg.catalog.session(write=True) as s:
        s.exec(
            update(Checkpoint)
            .where(
                col(Checkpoint.id) == claim.checkpoint_id,
                col(Checkpoint.claim_token) == claim.token,
            )
            .values(lease_until=now() + LEASE_SECONDS)
        )


def _expire_claim(reg: Registry, claim: _Claim) -> None:
    """A failed push lets the next one take over at once (its leftovers get reused)."""
    try:
        with reg.catalog.session(write=True) as s:
            s.exec(
                update(Checkpoint)
                .where(
                    col(Checkpoint.id) == claim.checkpoint_id,
                    col(Checkpoint.claim_token) == claim.token,
                    col(Checkpoint.state) == PENDING,
                )
                .values(lease_until=0.0)
            )
    except RegistryError:
        pass  # the lease runs out by itself


@dataclass(frozen=True, slots=True)
class _Uploaded:
    path: str
    size: int
    sha256: str
    reused: bool


def _upload(
    reg: Registry,
    ref: CheckpointRef,
    scanned: ScannedDir,
    claim: _Claim,
    progress: Progress | None,
) -> list[_Uploaded]:
    prefix = checkpoint_prefix(ref.project, ref.run, ref.step or 0)
    total = sum(scanned.files.values())
    if progress:
        progress.start(f"push {ref}", total)
    counter = Counter(progress)

    def one(path: str) -> _Uploaded:
        key, src = prefix + path, scanned.root / path
        try:
            put = reg.store.put_file(key, src, progress=counter)
            return _Uploaded(path, put.size, put.sha256, False)
        except ObjectExists:
            pass
        # A leftover of an earlier attempt at this step: reuse it if it is the same bytes.
        size, digest = _hash_file(src)
        head = reg.store.head(key)
        if head is not None and head.size == size and reg.store.sha256(key) == digest:
            counter(size)
            return _Uploaded(path, size, digest, True)
        reg.store.delete(key)  # we hold the claim: the leftover is ours to replace
        put = reg.store.put_file(key, src, progress=counter)
        return _Uploaded(path, put.size, put.sha256, False)

    # Largest first keeps the workers busy to the end.
    order = sorted(scanned.files, key=lambda p: -scanned.files[p])
    try:
        with ThreadPoolExecutor(max_workers=reg.settings.workers) as pool:
            results = list(pool.map(one, order))
    finally:
        if progress:
            progress.finish()
    for r in results:
        if r.size != scanned.files[r.path]:
            raise IntegrityError(
                f"{scanned.root / r.path} changed size while being pushed",
                "push a checkpoint that is no longer being written",
            )
    return sorted(results, key=lambda r: r.path)


def _put_replacing_leftover(reg: Registry, key: str, data: bytes) -> None:
    try:
        reg.store.put_bytes(key, data)
    except ObjectExists:
        if reg.store.get_bytes(key) == data:
            return
        reg.store.delete(key)
        reg.store.put_bytes(key, data)


def _manifest(
    reg: Registry,
    ref: CheckpointRef,
    scanned: ScannedDir,
    uploaded: list[_Uploaded],
    world_size: tuple[int, bool],
    resume: Any,
    metrics: dict[str, float],
) -> dict[str, Any]:
    return {
        "format": MANIFEST_FORMAT,
        "project": ref.project,
        "run": ref.run,
        "step": ref.step,
        "world_size": world_size[0],
        "world_size_inferred": world_size[1],
        "files": [
            {"path": u.path, "size": u.size, "sha256": u.sha256, "rank": scanned.rank_of(u.path)}
            for u in uploaded
        ],
        "bytes": sum(u.size for u in uploaded),
        "tensors": scanned.inventory.summary(),
        "resume": {
            "classes": resume.classes,
            "missing": resume.missing,
            "resumable": resume.resumable,
            "unclassified": resume.unclassified,
        },
        "metrics": metrics,
        "pushed_by": reg.user,
        "created_at": iso(now()),
    }


def _commit(
    reg: Registry,
    ref: CheckpointRef,
    claim: _Claim,
    scanned: ScannedDir,
    uploaded: list[_Uploaded],
    manifest: dict[str, Any],
    manifest_bytes: bytes,
    upload_seconds: float,
) -> dict[str, Any]:
    with reg.catalog.session(write=True) as s:
        result = s.exec(
            update(Checkpoint)
            .where(
                col(Checkpoint.id) == claim.checkpoint_id,
                col(Checkpoint.claim_token) == claim.token,
                col(Checkpoint.state) == PENDING,
            )
            .values(
                state=COMMITTED,
                world_size=manifest["world_size"],
                world_size_inferred=manifest["world_size_inferred"],
                bytes=manifest["bytes"],
                file_count=len(uploaded),
                tensor_count=len(scanned.inventory.tensors),
                tensor_bytes=scanned.inventory.tensor_bytes,
                manifest_sha256=hashlib.sha256(manifest_bytes).hexdigest(),
                resumable=manifest["resume"]["resumable"],
                missing_state=manifest["resume"]["missing"],
                resume_classes=manifest["resume"]["classes"],
                metrics=manifest["metrics"],
                committed_at=now(),
                upload_seconds=round(upload_seconds, 3),
                claim_token=None,
                lease_until=None,
            )
        )
        if result.rowcount != 1:
            raise Conflict(
                f"lost the claim on {ref} while pushing (another push took it over)",
                "check `reg show` and push again if needed",
            )
        for u in uploaded:
            s.add(
                CheckpointFile(
                    checkpoint_id=claim.checkpoint_id,
                    path=u.path,
                    size=u.size,
                    sha256=u.sha256,
                    rank=scanned.rank_of(u.path),
                )
            )
        run = queries.find_run(s, ref.project, ref.run)
        if (
            run is not None
            and run.resumed_from_step is not None
            and ref.step is not None
            and ref.step > run.resumed_from_step
        ):
            run.resumed_from_step = None  # a newer step lifts the resume protection
            s.add(run)
        audit.record(
            s,
            reg.user,
            "push",
            str(ref),
            bytes=manifest["bytes"],
            files=len(uploaded),
            reused=sum(u.reused for u in uploaded),
        )
        ttl = reg.policy.retention.for_project(ref.project).ttl
        outbox.emit(
            s,
            outbox.CHECKPOINT_COMMITTED,
            project=ref.project,
            run=ref.run,
            step=ref.step,
            ref=str(ref),
            world_size=manifest["world_size"],
            bytes=manifest["bytes"],
            resumable=manifest["resume"]["resumable"],
            missing_state=manifest["resume"]["missing"],
            metrics=manifest["metrics"],
            uri=reg.store.describe(checkpoint_prefix(ref.project, ref.run, ref.step or 0)),
            manifest_sha256=hashlib.sha256(manifest_bytes).hexdigest(),
            committed_at=now(),
            expires_at=None if ttl == float("inf") else now() + ttl,
        )
        s.flush()
        ckpt = s.get(Checkpoint, claim.checkpoint_id)
        assert ckpt is not None
        files = queries.files_of(s, claim.checkpoint_id)
        out = view(ref.project, ref.run, ckpt, files)
    out["unchanged"] = False
    out["reused_files"] = sum(u.reused for u in uploaded)
    reg.after_commit()
    return out


def _compare_existing(
    reg: Registry, ref: CheckpointRef, scanned: ScannedDir, existing: Checkpoint, workers: int
) -> dict[str, Any]:
    with reg.catalog.session() as s:
        files = queries.files_of(s, existing.id or 0)
    stored = {f.path: (f.size, f.sha256) for f in files}
    differs = f"{ref} is already committed with different content"
    hint = f"pushed by {existing.pushed_by} at {iso(existing.committed_at)}; push under a new step"
    if set(stored) != set(scanned.files) or any(
        stored[p][0] != size for p, size in scanned.files.items()
    ):
        raise Conflict(differs, hint)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        digests = dict(
            zip(
                scanned.files,
                pool.map(lambda p: _hash_file(scanned.root / p)[1], scanned.files),
                strict=True,
            )
        )
    if any(stored[p][1] != d for p, d in digests.items()):
        raise Conflict(differs, hint)
    out = view(ref.project, ref.run, existing, files)
    out["unchanged"] = True
    return out


def _hash_file(path: Path) -> tuple[int, str]:
    with open(path, "rb") as f:
        return hash_stream(f)


# -- reads ------------------------------------------------------------------------------------


def resolve(
    reg: Registry, ref: CheckpointRef, *, tombstones: bool = False
) -> tuple[Run, Checkpoint, list[CheckpointFile]]:
    with reg.catalog.session() as s:
        run, ckpt = queries.resolve_checkpoint(s, ref, tombstones=tombstones)
        return run, ckpt, queries.files_of(s, ckpt.id or 0)


def show(reg: Registry, ref: CheckpointRef) -> dict[str, Any]:
    reg.authorize_read(project=ref.project)
    run, ckpt, files = resolve(reg, ref, tombstones=True)
    out = detailed_view(reg, ref.project, run.name, ckpt, files)
    out["protection"] = reg.protection_of(ref.project, run, ckpt)
    return out


def pull(
    reg: Registry, ref: CheckpointRef, dest: Path, *, progress: Progress | None = None
) -> dict[str, Any]:
    """Copy a committed checkpoint to `dest`, verifying every byte; all or nothing."""
    reg.authorize_read(project=ref.project)
    _, ckpt, files = resolve(reg, ref)
    full = CheckpointRef(ref.project, ref.run, ckpt.step)
    dest = Path(dest).absolute()
    _check_dest(dest)
    temp = dest.parent / f".{dest.name}.reg-pull-{uuid.uuid4().hex[:8]}"
    temp.mkdir(parents=True)
    try:
        _download(
            reg, checkpoint_prefix(ref.project, ref.run, ckpt.step), files, temp, full, progress
        )
        # A collection that raced the download wins: never hand out a half-deleted checkpoint.
        _, ckpt_now, _ = resolve(reg, full)
        _check_dest(dest)
        if dest.exists():
            dest.rmdir()
        os.rename(temp, dest)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    record_resume(reg, full)
    out = view(ref.project, ref.run, ckpt_now, files)
    out["dest"] = str(dest)
    return out


def record_resume(reg: Registry, ref: CheckpointRef) -> None:
    """The run resumes from `ref`: retention keeps it until the run commits a newer step."""
    with reg.catalog.session(write=True) as s:
        run = queries.find_run(s, ref.project, ref.run)
        if run is not None:
            run.resumed_from_step, run.resumed_at = ref.step, now()
            s.add(run)


def _check_dest(dest: Path) -> None:
    if dest.is_symlink() or (dest.exists() and (not dest.is_dir() or any(dest.iterdir()))):
        raise UsageError(
            f"{dest} exists and is not an empty directory", "pull into a new or empty directory"
        )


def _download(
    reg: Registry,
    prefix: str,
    files: list[CheckpointFile],
    dest: Path,
    what: object,
    progress: Progress | None,
) -> None:
    if progress:
        progress.start(f"pull {what}", sum(f.size for f in files))
    counter = Counter(progress)

    def one(f: CheckpointFile) -> None:
        target = dest / f.path
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            got = reg.store.get_file(prefix + f.path, target, progress=counter)
        except NotFound:
            raise IntegrityError(
                f"{what}: stored file {f.path} is missing",
                f"reg verify {what} lists every damaged file",
            ) from None
        if got.size != f.size or got.sha256 != f.sha256:
            raise IntegrityError(
                f"{what}: stored file {f.path} is corrupt (sha256 {got.sha256[:12]}..., "
                f"expected {f.sha256[:12]}...); nothing was written to the destination",
                f"reg verify {what} lists every damaged file",
            )

    try:
        with ThreadPoolExecutor(max_workers=reg.settings.workers) as pool:
            list(pool.map(one, files))
    finally:
        if progress:
            progress.finish()


def verify(
    reg: Registry, ref: CheckpointRef, *, progress: Progress | None = None
) -> dict[str, Any]:
    """Re-hash the stored copy. Returns a report; `ok` is false when any file is damaged."""
    reg.authorize_read(project=ref.project)
    _, ckpt, files = resolve(reg, ref)
    full = CheckpointRef(ref.project, ref.run, ckpt.step)
    prefix = checkpoint_prefix(ref.project, ref.run, ckpt.step)
    problems = check_stored_files(
        reg, prefix, [(f.path, f.size, f.sha256) for f in files], progress, f"verify {full}"
    )
    return {
        "ref": str(full),
        "ok": not problems,
        "files": len(files),
        "bytes": sum(f.size for f in files),
        "problems": problems,
    }


def check_stored_files(
    reg: Registry,
    prefix: str,
    files: list[tuple[str, int, str]],
    progress: Progress | None,
    label: str,
) -> list[dict[str, str]]:
    """Sizes and sha256 of stored files against the record; one problem per damaged file."""
    if progress:
        progress.start(label, sum(size for _, size, _ in files))
    counter = Counter(progress)

    def one(item: tuple[str, int, str]) -> dict[str, str] | None:
        path, size, digest = item
        head = reg.store.head(prefix + path)
        if head is None:
            return {"path": path, "problem": "missing"}
        if head.size != size:
            return {"path": path, "problem": f"size {head.size}, expected {size}"}
        got = reg.store.sha256(prefix + path, progress=counter)
        if got != digest:
            return {"path": path, "problem": f"sha256 {got}, expected {digest}"}
        return None

    try:
        with ThreadPoolExecutor(max_workers=reg.settings.workers) as pool:
            return [p for p in pool.map(one, files) if p]
    finally:
        if progress:
            progress.finish()


def set_pin(
    reg: Registry, ref: CheckpointRef, pinned: bool, reason: str | None = None
) -> dict[str, Any]:
    reg.authorize("pin" if pinned else "unpin", project=ref.project, target=str(ref))
    with reg.catalog.session(write=True) as s:
        run, ckpt = queries.resolve_checkpoint(s, ref)
        ckpt.pinned = pinned
        ckpt.pin_reason = reason if pinned else None
        ckpt.pinned_by = reg.user if pinned else None
        s.add(ckpt)
        full = str(CheckpointRef(ref.project, ref.run, ckpt.step))
        audit.record(s, reg.user, "pin" if pinned else "unpin", full, reason=reason)
        out = view(ref.project, run.name, ckpt, queries.files_of(s, ckpt.id or 0))
    return out
