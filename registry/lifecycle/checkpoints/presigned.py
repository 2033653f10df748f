"""A push through `reg server` on an S3 store: the client uploads straight to S3 with presigned
URLs, the server decides everything else (DESIGN §3, §9).

    begin     authorize, check the declared files, claim the step, write the upload's plan
              beside the files, create the multipart uploads; URLs for the first items
    urls      more URLs (each lives TTL_S); renews the claim
    assemble  one multipart file, once its parts are up (while the others upload)
    complete  assemble each multipart upload not assembled yet, from exactly the declared parts
              (If-None-Match: *), check every object's size and S3's checksum, inventory
              `.metadata` from the store, write MANIFEST.json and commit under the claim
    abort     the client gave up: multipart uploads aborted, the claim marked abandoned

The server keeps no state between the requests: the claim is a catalog row, the plan an object
only the server writes (`<step prefix>/.reg-upload.json`, a reserved name), so any replica
answers any request. URLs exist only for the plan's keys, and only while the claim is held.

Whose word is each digest: S3 verifies each signed sha256 as the bytes arrive, and the server
hashes `.metadata` itself; the digest of a multipart file as a whole is what the client
declared. The checkpoint is recorded with `digests: client` until the server re-hashes it
(`reg verify`, or the read of a promotion's restore check).
"""

from __future__ import annotations

import contextlib
import hashlib
import re
import socket
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlmodel import select

from policies.access import Action
from policies.layouts import check_layout
from registry.catalog import claims, queries
from registry.catalog.leases import Heartbeat
from registry.catalog.models import PENDING, Checkpoint
from registry.core import faults
from registry.core.layout import checkpoint_prefix, manifest_key
from registry.core.refs import CheckpointRef
from registry.core.timeutil import iso, now
from registry.errors import (
    CompletedOver,
    Conflict,
    IntegrityError,
    InvalidCheckpoint,
    NotFound,
    ObjectExists,
    PermissionDenied,
    RegistryError,
    UsageError,
)
from registry.formats import file_roots
from registry.formats.dcp_roots import metadata_paths
from registry.formats.dcp_scan import UPLOAD_PLAN, ScannedDir, scan_contents
from registry.formats.documents import FileRecord
from registry.formats.recorded import recorded, resolve_step, resolve_world_size
from registry.lifecycle.checkpoints.commit import PushResult
from registry.lifecycle.checkpoints.push import (
    build_manifest,
    check_metrics,
    check_request,
    world_size_of,
)
from registry.lifecycle.checkpoints.resume_facts import facts_of, fields, proven_ends, resume_json
from registry.lifecycle.checkpoints.upload_plan import LEASE_S, DeclaredFile, Plan, part_sizes
from registry.lifecycle.transfer import OnMismatch, Stored, put_reconciled
from registry.lifecycle.views import CheckpointView
from registry.storage.s3_presign import Presigner, b64_sha256, composite_sha256
from registry.storage.verified_stream import verified_root

if TYPE_CHECKING:
    from sqlmodel import Session

    from registry.catalog.claims import Claim
    from registry.catalog.models import Checkpoint
    from registry.lifecycle.checkpoints.commit import PushResult
    from registry.lifecycle.context import Context
    from registry.storage.s3 import S3Store

MAX_URLS = 1000  # per answer
BEGIN_URLS = 64  # with `begin`; the client asks for the rest as it goes
# Upload URLs die before the claim they were signed under can run out (every request that
# signs renews the lease first), so a URL of an attempt whose claim was taken over is dead and
# cannot write into the next attempt's keys. Half the lease: whoever takes over judges the
# lease by its own clock and S3 the URL by its own, and they may disagree by up to a minute.
URL_TTL_S = int(LEASE_S) // 2
MAX_MULTIPART_FILES = 16_384  # one CreateMultipartUpload each at `begin`
ABANDONED = " (abandoned)"


def _s3(ctx: Context) -> S3Store:
    from registry.storage.s3 import S3Store

    if not isinstance(ctx.store, S3Store):
        raise UsageError(
            "this server's store is not S3: pushes stream through the server",
            "update reg on this client",
        )
    return ctx.store


def begin(
    ctx: Context,
    project: str,
    run: str,
    step: int,
    *,
    world_size: int | None,
    metrics: dict[str, float],
    files: list[DeclaredFile],
    layout: str | None = None,
) -> dict[str, Any]:
    from registry.lifecycle.checkpoints import commit

    ref = check_request(project, run, step)
    check_layout(layout)
    checked_metrics = check_metrics(metrics)
    ctx.authorize(Action.PUSH, project=project, target=str(ref))
    store = _s3(ctx)
    if sum(1 for f in files if f.parts) > MAX_MULTIPART_FILES:
        raise UsageError(f"at most {MAX_MULTIPART_FILES} files over 8 MiB in one push")
    claim, existing = _reclaim_own_abandoned(ctx, ref), None
    if claim is None:
        claim, existing = commit.claim_step(ctx, ref)
    if existing is not None:
        return {"unchanged": _compare_existing(ctx, ref, files, existing).to_json()}
    with _held(ctx, claim):
        presigner = Presigner(store, URL_TTL_S)
        prefix = checkpoint_prefix(ref.project, ref.run, ref.step or 0)
        reused = _clear_leftovers(store, presigner, prefix, files)
        store.sweep_incomplete(prefix, 0.0)  # an earlier attempt's multipart uploads

        def started(f: DeclaredFile) -> DeclaredFile:
            if not f.parts or f.path in reused:
                return f
            upload_id = presigner.create_multipart(prefix + f.path)
            return DeclaredFile(f.path, f.size, f.sha256, f.parts, upload_id)

        with ThreadPoolExecutor(max_workers=16) as pool:
            declared = list(pool.map(started, files))
        plan = Plan(
            claim.token,
            ref,
            ctx.actor,
            world_size,
            checked_metrics,
            declared,
            reused,
            now(),
            layout,
        )
        store.put_bytes(prefix + UPLOAD_PLAN, plan.to_bytes())
        _hold(ctx, claim)  # renewed before URLs are signed: the lease outlives them
        first = _urls(presigner, plan, 0, BEGIN_URLS)
    return {
        "upload": claim.token,
        "ref": str(ref),
        "items": len(plan.items),
        "reused": reused,
        "ttl_s": presigner.ttl_s,
        "urls": first,
    }


def urls(ctx: Context, ref: CheckpointRef, token: str, start: int, count: int) -> dict[str, Any]:
    """URLs for items [start, start+count) of the plan; renews the claim (from 0, count 0:
    the client's heartbeat, and all it does; the plan is not read)."""
    if start == 0 and count == 0:
        _hold(ctx, _claim_of(ctx, ref, token))
        return {"urls": [], "ttl_s": URL_TTL_S}
    claim, plan = _resume(ctx, ref, token)
    _hold(ctx, claim)
    presigner = Presigner(_s3(ctx), URL_TTL_S)
    return {"urls": _urls(presigner, plan, start, count), "ttl_s": presigner.ttl_s}


def _urls(presigner: Presigner, plan: Plan, start: int, count: int) -> list[dict[str, Any]]:
    items = plan.items
    if isinstance(start, bool) or not 0 <= start <= len(items):
        raise UsageError(f"start {start} is outside the plan's {len(items)} items")
    prefix = checkpoint_prefix(plan.ref.project, plan.ref.run, plan.ref.step or 0)
    out = []
    for i, number in items[start : start + max(0, min(count, MAX_URLS))]:
        f = plan.files[i]
        if number == 0:
            signed = presigner.put_url(prefix + f.path, f.size, f.sha256)
            size, offset = f.size, 0
        else:
            sizes = part_sizes(f.size) or []
            size, offset = sizes[number - 1], sum(sizes[: number - 1])
            assert f.upload_id is not None and f.parts is not None
            signed = presigner.part_url(
                prefix + f.path, f.upload_id, number, size, f.parts[number - 1]
            )
        out.append(
            {"path": f.path, "part": number, "offset": offset, "size": size, **signed.to_json()}
        )
    return out


def complete(
    ctx: Context, ref: CheckpointRef, token: str, notes: list[str] | None = None
) -> PushResult:
    from registry.lifecycle.checkpoints import commit

    claim, plan = _resume(ctx, ref, token)
    store = _s3(ctx)
    presigner = Presigner(store)
    prefix = checkpoint_prefix(ref.project, ref.run, ref.step or 0)
    with _held(ctx, claim):
        stored = _assemble(ctx, presigner, prefix, plan)
        faults.point("presigned-assembled")
        scanned = _scan_stored(ctx, prefix, plan)
        # what the trainer's own files record, read from the objects as declared (proven)
        read = _proven_reader(ctx, prefix, plan)
        found = recorded("", scanned.files, read)
        resolve_step(plan.ref.step, found)
        source = "--world-size" if plan.world_size is not None else found.world_source
        world_size = resolve_world_size(plan.world_size, found)
        world = world_size_of(scanned, world_size, notes, source)
        declared = [FileRecord(f.path, f.size, f.sha256) for f in plan.files]
        facts = facts_of(
            scanned.inventory,
            scanned.files,
            read,
            plan.layout,
            proven_ends(store, prefix, declared),
        )
        manifest = build_manifest(
            ctx, ref, scanned, stored, world, facts.record(ctx.policy.resume), plan.metrics
        )
        data = manifest.to_bytes()
        put = put_reconciled(
            store,
            manifest_key(ref.project, ref.run, ref.step or 0),
            data=data,
            on_mismatch=OnMismatch.REPLACE,
            before_replace=lambda: commit.ensure_held(ctx, claim, ref),
        )
        result = commit.commit(
            ctx,
            claim,
            manifest,
            data,
            put.version,
            time.time() - plan.started,
            sum(s.reused for s in stored),
            digests_reported_by=ctx.actor,
        )
    store.delete(prefix + UPLOAD_PLAN)
    return replace(result, resume=fields(facts, ctx.policy.resume))


def assemble(ctx: Context, ref: CheckpointRef, token: str, path: str) -> dict[str, Any]:
    """Assemble one multipart file as soon as its parts are up (the client asks while the rest
    upload, so the store's assembly overlaps them); `complete` checks it like every file."""
    claim, plan = _resume(ctx, ref, token)
    _hold(ctx, claim)
    f = next((f for f in plan.files if f.path == path and f.upload_id), None)
    if f is None or f.path in plan.reused:
        raise UsageError(f"{str(path)[:80]!r} is not a multipart file of this upload")
    prefix = checkpoint_prefix(ref.project, ref.run, ref.step or 0)
    _complete_multipart(Presigner(_s3(ctx)), prefix + f.path, f)
    return {"path": f.path, "assembled": True}


def abort(ctx: Context, ref: CheckpointRef, token: str) -> dict[str, Any]:
    """The client gave up: its multipart uploads are aborted and the claim is marked abandoned
    (its pusher may take the step back at once; anyone else once its URLs are dead). What was
    uploaded is reused by the next push of the step, or swept by GC."""
    claim, plan = _resume(ctx, ref, token)
    presigner = Presigner(_s3(ctx))
    prefix = checkpoint_prefix(plan.ref.project, plan.ref.run, plan.ref.step or 0)
    for f in plan.files:
        if f.upload_id:
            presigner.abort(prefix + f.path, f.upload_id)
    # Not expired at once: the claim lives until every URL signed under it is dead, so nobody
    # else's next attempt can receive this one's bytes. The same pusher takes it back at once.
    _hold(ctx, claim, abandoned=True)
    with ctx.catalog.session(write=True) as s:
        ctx.audit(s, "push", str(ref), "failed", reason="the client abandoned the upload")
    return {"ref": str(plan.ref), "aborted": True}


# -- steps ---------------------------------------------------------------------------------------


def _hold(ctx: Context, claim: Claim, *, abandoned: bool = False) -> None:
    """Lease the claim for LEASE_S, held by no process (the client's requests renew it)."""
    host = f"{socket.gethostname()} (presigned)" + (ABANDONED if abandoned else "")
    with ctx.catalog.session(write=True) as s:
        if not claims.guarded_update(
            s, claim, lease_until=now() + LEASE_S, claim_host=host[:255], claim_pid=0
        ):
            raise Conflict(
                "lost the claim on this upload (another push took it over)", "push again"
            )


@contextlib.contextmanager
def _held(ctx: Context, claim: Claim) -> Iterator[None]:
    """The claim renewed while a request works; if the request fails, marked abandoned rather
    than expired: URLs signed under it may still be alive, so only their owner may take the
    step back before the lease runs out."""
    _hold(ctx, claim)
    try:
        with Heartbeat(lambda: _hold(ctx, claim), LEASE_S / 4):
            yield
    except BaseException:
        with contextlib.suppress(RegistryError):
            _hold(ctx, claim, abandoned=True)
        raise


def _reclaim_own_abandoned(ctx: Context, ref: CheckpointRef) -> Claim | None:
    """A presigned push of `ref` this principal abandoned is taken back at once for its retry,
    in one guarded write (its live URLs are this principal's own); anyone else waits for the
    claim to run out."""
    with ctx.catalog.session(write=True) as s:
        row = _pending_row(s, ref)
        if (
            row is None
            or not row.claim_token
            or row.pushed_by != ctx.actor
            or not (row.claim_host or "").endswith(ABANDONED)
        ):
            return None
        return claims.take_over(s, row, pushed_by=ctx.actor, created_at=now())


def _pending_row(session: Session, ref: CheckpointRef) -> Checkpoint | None:
    """The pending row of step `ref`, if there is one."""

    run = queries.find_run(session, ref.project, ref.run)
    if run is None:
        return None
    return session.exec(
        select(Checkpoint).where(
            Checkpoint.run_id == run.id, Checkpoint.step == ref.step, Checkpoint.state == PENDING
        )
    ).first()


def _resume(ctx: Context, ref: CheckpointRef, token: str) -> tuple[Claim, Plan]:
    """The claim and plan of upload `token` of `ref`, if the caller started it and it is still
    pending under that claim."""
    claim = _claim_of(ctx, ref, token)
    prefix = checkpoint_prefix(ref.project, ref.run, ref.step or 0)
    try:
        plan = Plan.from_bytes(bytes(ctx.store.get_bytes(prefix + UPLOAD_PLAN)))
    except NotFound:
        raise NotFound(f"the upload plan of {ref} is gone", "push again") from None
    if plan.token != token or plan.ref != ref:
        raise Conflict(f"the upload of {ref} was started again by another push", "push again")
    return claim, plan


def _claim_of(ctx: Context, ref: CheckpointRef, token: str) -> Claim:
    """The claim of upload `token` of `ref`, if the caller started it and it is still pending
    under that claim (a renewal needs no more; the others read the plan too)."""
    ctx.authorize(Action.PUSH, project=ref.project, target=str(ref))
    if not isinstance(token, str) or not re.fullmatch(r"[0-9a-f]{32}", token):
        raise UsageError("not an upload id", "start the push again")
    with ctx.catalog.session() as s:
        row = _pending_row(s, ref)
    if row is None or row.claim_token != token:
        raise NotFound(
            f"no upload of {ref} in progress with this id (committed, abandoned or taken over)",
            "push again",
        )
    if row.pushed_by != ctx.actor:
        raise PermissionDenied(f"the upload of {ref} is {row.pushed_by}'s, not {ctx.actor}'s")
    return claims.Claim(Checkpoint, row.id or 0, token)


def _clear_leftovers(
    store: S3Store, presigner: Presigner, prefix: str, files: list[DeclaredFile]
) -> list[str]:
    """Objects an earlier attempt at this step left (we hold the claim now): a single-PUT file
    whose size and S3 checksum match what is declared is kept; everything else goes."""
    declared = {f.path: f for f in files}
    reused = []
    for info in list(store.list(prefix)):
        path = info.key.removeprefix(prefix)
        f = declared.get(path)
        if f is not None and f.parts is None and info.size == f.size:
            found = presigner.head(info.key)
            if found is not None and found[2] == b64_sha256(f.sha256):
                reused.append(path)
                continue
        store.delete(info.key)
    return sorted(reused)


def _assemble(ctx: Context, presigner: Presigner, prefix: str, plan: Plan) -> list[Stored]:
    """Every file as S3 holds it: multipart uploads completed from exactly their declared
    parts, then each object's size and checksum compared with the plan."""
    store = presigner.store

    def one(f: DeclaredFile) -> Stored:
        key = prefix + f.path
        created = None
        if f.upload_id and f.path not in plan.reused:
            created = _complete_multipart(presigner, key, f)
            if created is None:  # assembled by an earlier request (or the bucket keeps no versions)
                _one_version(store, key, f.path)
        # The version this request created, if it did: on a store where a second complete of
        # the key can also succeed, the current version may be someone else's.
        found = presigner.head(key, created)
        if found is None:
            raise IntegrityError(f"{f.path} was not uploaded", "push again")
        size, version, checksum = found
        expected = b64_sha256(f.sha256) if f.parts is None else composite_sha256(f.parts)
        if size != f.size or (checksum is not None and checksum.split("-")[0] != expected):
            raise IntegrityError(
                f"{f.path} holds other bytes than the push declared ({size} bytes)",
                "the file changed while being pushed; push again",
            )
        return Stored(key, size, f.sha256, f.path in plan.reused, version)

    with ThreadPoolExecutor(max_workers=max(1, ctx.workers * 2)) as pool:
        return sorted(pool.map(one, plan.files), key=lambda s: s.key)


def _complete_multipart(presigner: Presigner, key: str, f: DeclaredFile) -> str | None:
    """Assemble `f` from exactly its declared parts: the version created (versioned buckets).
    Done already is fine (the caller checks the object S3 then holds). Another writer's
    complete landed over ours is not: the caller holds the claim, so the key is cleared (a
    later `complete` then finds the file not uploaded) and the push fails."""
    assert f.upload_id is not None and f.parts is not None
    sizes = part_sizes(f.size) or []
    try:
        return presigner.complete(key, f.upload_id, list(zip(sizes, f.parts, strict=True)))
    except CompletedOver:
        presigner.store.delete(key)
        raise IntegrityError(
            f"{f.path}: another write landed on it as it was assembled", "push again"
        ) from None
    except (ObjectExists, NotFound):  # completed by an earlier request
        return None


def _one_version(store: S3Store, key: str, path: str) -> None:
    """On a versioned bucket, a file assembled by an earlier request must be the key's only
    version (`begin` cleared the key): a second one is another writer's, and the current one
    may be it."""
    if store.versioned() and len(store.admin.versions(key)) > 1:
        raise IntegrityError(
            f"{path}: another write landed on it after it was assembled", "push again"
        )


def _proven_reader(ctx: Context, prefix: str, plan: Plan) -> Callable[[str], bytes]:
    """Reads an uploaded file whole, refused unless it holds the bytes the push declared; of
    a safetensors model file, its header."""
    declared = {f.path: f.sha256 for f in plan.files}
    sizes = {f.path: f.size for f in plan.files}

    def read(path: str) -> bytes:
        if file_roots.is_root_name(path):
            return verified_root(
                ctx.store,
                prefix,
                path,
                size=sizes[path],
                sha256=declared[path],
                version=None,
                label=f"{plan.ref}: {path}",
            )
        data = bytes(ctx.store.get_bytes(prefix + path))
        if hashlib.sha256(data).hexdigest() != declared[path]:
            raise IntegrityError(
                f"{plan.ref}: {path} holds other bytes than declared", "push again"
            )
        return data

    return read


def _scan_stored(ctx: Context, prefix: str, plan: Plan) -> ScannedDir:
    """The inventory of the uploaded checkpoint, from `.metadata` as S3 holds it (hashed here:
    its digest is the server's) and the first bytes of each shard's chunks."""
    sizes = {f.path: f.size for f in plan.files}
    label = f"{plan.ref}"
    read = _proven_reader(ctx, prefix, plan)
    metadata = {path: read(path) for path in metadata_paths(sizes)}

    def read_head(path: str, offset: int) -> bytes:
        if offset >= sizes[path]:
            return b""
        return bytes(ctx.store.read_range(prefix + path, offset, min(9, sizes[path] - offset)))

    try:
        return scan_contents(Path(label), sizes, metadata, read_head)
    except InvalidCheckpoint as exc:
        exc.message = exc.message.replace(label + "/", "")
        raise


def _compare_existing(
    ctx: Context, ref: CheckpointRef, files: list[DeclaredFile], existing: Checkpoint
) -> PushResult:
    """The step is committed: the same files and digests are a no-op, anything else a conflict."""
    with ctx.catalog.session() as s:
        stored = queries.files_of(s, existing.id or 0)
    if {(f.path, f.size, f.sha256) for f in stored} != {(f.path, f.size, f.sha256) for f in files}:
        raise Conflict(
            f"{ref} is already committed with different content",
            f"pushed by {existing.pushed_by} at {iso(existing.committed_at)}; "
            "push under a new step",
        )
    view = CheckpointView.of(ref.project, ref.run, existing, stored)
    resume = resume_json(ctx, view.ref, existing, stored, full=False)  # as recorded
    return PushResult(view, unchanged=True, resume=resume)
