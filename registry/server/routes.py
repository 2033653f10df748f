"""One endpoint per `Registry` method (DESIGN §7 names; the JSON is the `--json` output).

Each builds the request's Context from its token (`auth.context_for`) and calls the same
lifecycle function as the embedded mode; access checks and audit happen there. Bodies are
bounded (`MAX_JSON_BYTES`); a push streams (`upload.py`) and is capped at its declared sizes.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import os
import struct
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from registry.context import Context
from registry.errors import NotFound, RegistryError, UsageError
from registry.formats.documents import FileRecord
from registry.refs import CheckpointRef, ReleaseRef, parse_checkpoint_ref, parse_ref
from registry.server.app import MAX_JSON_BYTES, MAX_PROMOTE_BYTES
from registry.server.auth import context_for
from registry.server.upload import (
    MAGIC,
    MAX_HEADER,
    Receiver,
    Writer,
    parse_header,
    private_dir,
    release_dir,
)

router = APIRouter()
CTX = Depends(context_for)
# A request body that stops arriving for this long is abandoned (REG_SERVER_IDLE_TIMEOUT).
IDLE_S = float(os.environ.get("REG_SERVER_IDLE_TIMEOUT", "60"))
MAX_RANGE = 64 << 20  # one ranged read; a client asks for larger reads in pieces
WRITE_BATCH = 4 << 20


async def _authed_body(
    request: Request, limit: int = MAX_JSON_BYTES
) -> tuple[Context, dict[str, Any]]:
    """The request's Context (its token checked first: an anonymous caller gets nothing
    read), then its JSON body."""
    ctx = await run_in_threadpool(context_for, request)
    return ctx, await _body(request, limit)


async def _body(request: Request, limit: int = MAX_JSON_BYTES) -> dict[str, Any]:
    """The request's JSON object, refused past `limit` bytes before it is all read, or when
    the client stops sending for IDLE_S; parsed off the event loop."""
    size = request.headers.get("content-length")
    if size is not None and (not size.isdigit() or int(size) > limit):
        raise UsageError(f"request body over {limit} bytes", "send less")
    data = bytearray()
    async for chunk in idle_limited(request.stream()):
        data += chunk
        if len(data) > limit:
            raise UsageError(f"request body over {limit} bytes", "send less")
    return await run_in_threadpool(_parse_json, bytes(data))


def _parse_json(data: bytes) -> dict[str, Any]:
    try:
        doc = json.loads(data or b"{}")
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UsageError(f"request body is not JSON: {exc}") from None
    except RecursionError:
        raise UsageError("request body is nested too deeply") from None
    if not isinstance(doc, dict):
        raise UsageError("request body is not a JSON object")
    return doc


async def idle_limited(stream: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """`stream`, cut off (exit 1) when no byte arrives for IDLE_S: a client that stops sending
    holds no connection, memory or upload for long."""
    iterator = stream.__aiter__()
    while True:
        try:
            chunk = await asyncio.wait_for(iterator.__anext__(), IDLE_S)
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise RegistryError(
                f"the client sent nothing for {IDLE_S:.0f}s; request abandoned", "send again"
            ) from None
        yield chunk


def _str(doc: dict[str, Any], key: str, default: str | None = None) -> str:
    value = doc.get(key, default)
    if not isinstance(value, str):
        raise UsageError(f"{key} must be a string")
    return value


def _opt_str(doc: dict[str, Any], key: str) -> str | None:
    value = doc.get(key)
    if value is not None and not isinstance(value, str):
        raise UsageError(f"{key} must be a string")
    return value


def _bool(doc: dict[str, Any], key: str) -> bool:
    value = doc.get(key, False)
    if not isinstance(value, bool):
        raise UsageError(f"{key} must be true or false")
    return value


# -- who am I --------------------------------------------------------------------------------------


@router.get("/whoami")
def whoami(ctx: Context = CTX) -> dict[str, Any]:
    return {
        "principal": ctx.actor,
        "token": ctx.principal.credential,
        "grants": [g.model_dump(mode="json") for g in ctx.principal.grants],
        "single_user": ctx.principal.single_user,
    }


# -- checkpoints -----------------------------------------------------------------------------------


@router.post("/checkpoints/push")
async def push_checkpoint(request: Request) -> dict[str, Any]:
    """A push: the framed stream of `upload.py`, received into a private directory, then pushed
    with the embedded code (the server scans and inventories what it received)."""
    from registry.lifecycle.checkpoints.push import push
    from registry.server import metrics

    ctx = await run_in_threadpool(context_for, request)
    stream = idle_limited(request.stream()).__aiter__()
    buffer = bytearray()

    async def fill(n: int) -> None:
        async for chunk in stream:
            buffer.extend(chunk)
            if len(buffer) >= n:
                return
        if len(buffer) < n:
            raise UsageError("the push ended inside its header", "push again")

    start = len(MAGIC) + 8
    await fill(start)
    if bytes(buffer[: len(MAGIC)]) != MAGIC:
        raise UsageError("not a push stream", "use reg push-ckpt")
    (length,) = struct.unpack(">Q", bytes(buffer[len(MAGIC) : start]))
    if length > MAX_HEADER:
        raise UsageError(f"push header over {MAX_HEADER} bytes")
    if len(buffer) < start + length:
        await fill(start + length)
    req = await run_in_threadpool(parse_header, bytes(buffer[start : start + length]))
    rest = bytes(buffer[start + length :])
    # Refused before a byte is stored: who may push here, and a well-formed name.
    await run_in_threadpool(
        ctx.authorize,
        "push",
        project=req.project,
        target=f"{req.project}/{req.run}@step{req.step}",
    )
    state = request.app.state.reg
    receiver = await run_in_threadpool(Receiver.create, state.settings.home / "uploads", req.files)
    started = time.perf_counter()
    writer = Writer(receiver)
    try:
        batch, batched, received = [rest], len(rest), len(rest)
        async for chunk in stream:
            batch.append(chunk)
            batched += len(chunk)
            received += len(chunk)
            if received > req.total:
                raise UsageError("the push sent more bytes than its header declared")
            if batched >= WRITE_BATCH:
                if not writer.offer(batch):
                    await run_in_threadpool(writer.put, batch)
                batch, batched = [], 0
        await run_in_threadpool(writer.put, batch)
        await run_in_threadpool(writer.close)
        metrics.BYTES_IN.inc(received)
        request.state.phases = {"receive_seconds": round(time.perf_counter() - started, 3)}
        notes: list[str] = []
        try:
            result = await run_in_threadpool(
                lambda: push(
                    ctx,
                    receiver.root,
                    run=req.run,
                    step=req.step,
                    project=req.project,
                    world_size=req.world_size,
                    metrics=req.metrics,
                    notes=notes,
                    received=receiver.received,
                ).to_json()
            )
        except RegistryError as exc:  # name the client's files, not the server's directory
            exc.message = exc.message.replace(str(receiver.root), "(the pushed directory)")
            raise
        result["notes"] = notes
        request.state.phases["push_seconds"] = round(
            time.perf_counter() - started - request.state.phases["receive_seconds"], 3
        )
        return result
    finally:
        await run_in_threadpool(writer.abandon)
        await run_in_threadpool(receiver.discard)


@router.get("/checkpoints")
def list_checkpoints(
    run: str | None = None,
    project: str | None = None,
    include_deleted: bool = False,
    ctx: Context = CTX,
) -> list[dict[str, Any]]:
    from registry.lifecycle.checkpoints.listing import list_checkpoints

    return list_checkpoints(ctx, run, project, include_deleted=include_deleted)


@router.get("/show")
def show(ref: str, ctx: Context = CTX) -> dict[str, Any]:
    parsed = parse_ref(ref)
    if isinstance(parsed, ReleaseRef):
        from registry.lifecycle import releases

        return releases.show(ctx, parsed)
    from registry.lifecycle.checkpoints import read

    return read.show(ctx, parsed)


@router.get("/read")
def read_file(request: Request, ref: str, path: str, ctx: Context = CTX) -> Response:
    """Bytes of one file of a committed checkpoint or a readable release, as the catalog
    records it (its recorded version on a versioned bucket); `Range: bytes=A-B` for a part."""
    from registry.server import metrics

    key, version, size = _readable(ctx, parse_ref(ref), path)
    wanted = request.headers.get("range")
    if wanted is None:
        metrics.BYTES_OUT.inc(size)
        pieces: Iterator[bytes] = ctx.store.stream(key, version=version)
        # Chunked, not the catalog's size as Content-Length: a damaged object reaches the
        # client as what it is, and the client's sha256 check names it.
        return StreamingResponse(pieces, media_type="application/octet-stream")
    offset, length = _range(wanted, size)
    data = ctx.store.read_range(key, offset, length, version=version)
    metrics.BYTES_OUT.inc(len(data))
    return Response(
        bytes(data),
        status_code=206,
        media_type="application/octet-stream",
        headers={"content-range": f"bytes {offset}-{offset + len(data) - 1}/{size}"},
    )


def _pullable(
    ctx: Context, ref: CheckpointRef | ReleaseRef
) -> tuple[str, str, list[FileRecord], dict[str, Any]]:
    """(full ref, store prefix, files, view JSON) of what a pull of `ref` downloads, if the
    caller may read it: committed checkpoints, and releases that are not yanked."""
    from registry.layout import checkpoint_prefix, release_prefix

    if isinstance(ref, ReleaseRef):
        from registry.lifecycle.releases import pullable, stored_files

        view = pullable(ctx, ref)
        prefix = release_prefix(view.model.name, view.row.version)
        return view.name, prefix, stored_files(view), view.to_json()
    from registry.lifecycle.checkpoints.read import resolve
    from registry.lifecycle.views import CheckpointView

    ctx.authorize_read(project=ref.project)
    _, ckpt, files = resolve(ctx, ref)
    full = CheckpointRef(ref.project, ref.run, ckpt.step)
    prefix = checkpoint_prefix(ref.project, ref.run, ckpt.step)
    return str(full), prefix, files, CheckpointView.of(ref.project, ref.run, ckpt, files).to_json()


@router.get("/files")
def files(ref: str, ctx: Context = CTX) -> dict[str, Any]:
    """What a pull of `ref` downloads: the resolved ref and every file (path, size, sha256,
    version), the release's release.json included."""
    full, _, listed, view = _pullable(ctx, parse_ref(ref))
    return {"ref": full, "files": [f.document_json() for f in listed], "view": view}


def _readable(
    ctx: Context, ref: CheckpointRef | ReleaseRef, path: str
) -> tuple[str, str | None, int]:
    """(key, version, size) of `path` in `ref`: only files the catalog lists."""
    _, prefix, listed, _ = _pullable(ctx, ref)
    for f in listed:
        if f.path == path:
            return prefix + f.path, f.version, f.size
    raise NotFound(f"{ref} has no file {path[:200]!r}", f"reg show {ref} lists its files")


def _range(header: str, size: int) -> tuple[int, int]:
    unit, _, spec = header.partition("=")
    first, sep, last = spec.partition("-")
    try:
        if unit.strip() != "bytes" or not sep or "," in spec:
            raise ValueError
        start, end = int(first), int(last)
    except ValueError:
        raise UsageError(f"bad Range {header[:60]!r}", "send bytes=START-END") from None
    if not 0 <= start <= end < size or end - start + 1 > MAX_RANGE:
        raise UsageError(f"Range {start}-{end} is outside 0-{size - 1} or over {MAX_RANGE} bytes")
    return start, end - start + 1


@router.post("/checkpoints/pulled")
async def pulled(request: Request) -> dict[str, Any]:
    """After a client downloaded and verified a checkpoint: a trainer's pull records the run
    as resuming from it (retention keeps it), as in the embedded mode."""
    from registry.lifecycle.checkpoints.read import record_resume, resolve
    from registry.lifecycle.views import CheckpointView

    ctx, doc = await _authed_body(request)
    ref = parse_checkpoint_ref(_str(doc, "ref"))

    def work() -> dict[str, Any]:
        ctx.authorize_read(project=ref.project)
        _, ckpt, files = resolve(ctx, ref)
        full = CheckpointRef(ref.project, ref.run, ckpt.step)
        if ctx.principal.authorize("push", project=ref.project).allowed:
            record_resume(ctx, full)
        return CheckpointView.of(ref.project, ref.run, ckpt, files).to_json()

    return await run_in_threadpool(work)


@router.post("/verify")
async def verify(request: Request) -> dict[str, Any]:
    ctx, doc = await _authed_body(request)
    parsed = parse_ref(_str(doc, "ref"))
    repair = _bool(doc, "repair")

    def work() -> dict[str, Any]:
        if isinstance(parsed, ReleaseRef):
            from registry.lifecycle import releases

            return releases.verify(ctx, parsed, repair=repair)
        from registry.lifecycle.checkpoints import read

        return read.verify(ctx, parsed, repair=repair)

    return await run_in_threadpool(work)


@router.post("/pin")
async def pin(request: Request) -> dict[str, Any]:
    from registry.lifecycle.checkpoints.read import set_pin

    ctx, doc = await _authed_body(request)
    ref = parse_checkpoint_ref(_str(doc, "ref"))
    on = doc.get("pinned", True)
    if not isinstance(on, bool):
        raise UsageError("pinned must be true or false")
    return await run_in_threadpool(set_pin, ctx, ref, on, _opt_str(doc, "reason"))


# -- validation: a validator's report --------------------------------------------------------------


@router.post("/validations/begin")
async def validation_begin(request: Request) -> dict[str, Any]:
    """A validator is about to validate `ref` on its own device: refused now (and audited)
    unless it may attest; answers what it needs (the checkpoint's files and the policy)."""
    from registry.lifecycle.checkpoints.read import resolve

    ctx, doc = await _authed_body(request)
    ref = parse_checkpoint_ref(_str(doc, "ref"))

    def work() -> dict[str, Any]:
        ctx.authorize("attest", project=ref.project, target=str(ref))
        _, ckpt, files = resolve(ctx, ref)
        return {
            "ref": str(CheckpointRef(ref.project, ref.run, ckpt.step)),
            "metrics": dict(ckpt.metrics),
            "files": [f.to_json() | {"rank": f.rank} for f in files],
            "policy": ctx.policy.text,
        }

    return await run_in_threadpool(work)


@router.post("/validations")
async def validation_record(request: Request) -> dict[str, Any]:
    """Record a validator's validation: attested, the only kind the server's GPU gate takes."""
    from registry.lifecycle.checkpoints.read import resolve
    from registry.lifecycle.validation import Attempt, record

    ctx, doc = await _authed_body(request)
    ref = parse_checkpoint_ref(_str(doc, "ref"))
    attempt = Attempt.from_json(doc.get("attempt"))

    def work() -> dict[str, Any]:
        ctx.authorize("attest", project=ref.project, target=str(ref))
        _, ckpt, _ = resolve(ctx, ref)
        full = CheckpointRef(ref.project, ref.run, ckpt.step)
        return record(ctx, full, ckpt, attempt, attested=True)

    return await run_in_threadpool(work)


# -- releases --------------------------------------------------------------------------------------


@router.post("/promote")
async def promote(request: Request) -> dict[str, Any]:
    """A promotion, run here: the client only asks, so no client publishes bytes of its own
    choosing. Extras (config.json, ...) come in the body, base64, within MAX_PROMOTE_BYTES."""
    from registry.lifecycle.promotion import promote as run_promotion

    ctx = await run_in_threadpool(context_for, request)
    if not ctx.principal.may_anywhere("promote"):  # refused before 64 MiB are read
        await run_in_threadpool(lambda: ctx.authorize("promote", target="a promotion"))
    doc = await _body(request, MAX_PROMOTE_BYTES)
    ref = parse_checkpoint_ref(_str(doc, "ref"))
    extras = doc.get("extras") or []
    if not isinstance(extras, list):
        raise UsageError("extras must be a list of {name, data}")
    if doc.get("model_factory") is not None:
        raise UsageError(
            "a model factory runs where the validation runs, not in the server",
            "reg validate REF --model-factory MOD:FN with a validator token, then promote",
        )
    state = request.app.state.reg
    model = _str(doc, "model")
    await run_in_threadpool(
        lambda: ctx.authorize("promote", project=ref.project, model=model, target=str(ref))
    )
    workdir, lock = private_dir(state.settings.home / "uploads", "promote")
    try:
        paths = [_write_extra(workdir, e) for e in extras]
        return await run_in_threadpool(
            lambda: run_promotion(
                ctx,
                ref,
                model=model,
                alias=_opt_str(doc, "alias"),
                dtype=_opt_str(doc, "dtype"),
                max_shard_size=_str(doc, "max_shard_size", "5GB"),
                extras=paths,
            )
        )
    finally:
        release_dir(workdir, lock)


def _write_extra(workdir: Path, entry: object) -> Path:
    from registry.refs import check_name

    if not isinstance(entry, dict):
        raise UsageError("an extra is an object {name, data}")
    name = check_name(_str(entry, "name"), "extra file name")
    try:
        data = base64.b64decode(_str(entry, "data"), validate=True)
    except binascii.Error:
        raise UsageError(f"extra {name}: data is not base64") from None
    target = workdir / name
    if target.exists():
        raise UsageError(f"--extra {name}: the name appears twice")
    target.write_bytes(data)
    return target


@router.get("/releases")
def releases(model: str | None = None, ctx: Context = CTX) -> list[dict[str, Any]]:
    from registry.lifecycle.releases import list_releases

    return list_releases(ctx, model)


@router.post("/alias")
async def alias(request: Request) -> dict[str, Any]:
    from registry.lifecycle.releases import set_alias

    ctx, doc = await _authed_body(request)
    version = doc.get("version")
    if not isinstance(version, str | int) or isinstance(version, bool):
        raise UsageError("version must be vK or a number")
    return await run_in_threadpool(set_alias, ctx, _str(doc, "model"), _str(doc, "alias"), version)


@router.post("/status")
async def release_status(request: Request) -> dict[str, Any]:
    """deprecate or yank (status `deprecated` or `yanked`, with a reason for a yank)."""
    from registry.catalog.models import DEPRECATED, YANKED
    from registry.lifecycle.releases import set_status
    from registry.refs import parse_release_ref

    ctx, doc = await _authed_body(request)
    ref = parse_release_ref(_str(doc, "ref"))
    status = _str(doc, "status")
    if status not in (DEPRECATED, YANKED):
        raise UsageError(f"status must be {DEPRECATED} or {YANKED}")
    return await run_in_threadpool(set_status, ctx, ref, status, _opt_str(doc, "reason"))


# -- administration --------------------------------------------------------------------------------


@router.post("/gc")
async def gc(request: Request) -> dict[str, Any]:
    from registry.lifecycle.gc import run_gc

    ctx, doc = await _authed_body(request)
    return await run_in_threadpool(lambda: run_gc(ctx, dry_run=_bool(doc, "dry_run")))


@router.post("/catalog/rebuild")
async def rebuild(request: Request) -> dict[str, Any]:
    from registry.lifecycle.rebuild import rebuild as run_rebuild

    ctx, doc = await _authed_body(request)
    return await run_in_threadpool(lambda: run_rebuild(ctx, dry_run=_bool(doc, "dry_run")))


@router.post("/storage/init")
def storage_init(ctx: Context = CTX) -> dict[str, Any]:
    from registry.lifecycle.admin import storage_init as run_init

    return run_init(ctx)


@router.get("/audit")
def audit_log(
    since: float | None = None,
    actor: str | None = None,
    action: str | None = None,
    ctx: Context = CTX,
) -> list[dict[str, Any]]:
    from registry.lifecycle.admin import audit_log as query

    return query(ctx, since=since, actor=actor, action=action)


@router.get("/policy")
def policy_show(ctx: Context = CTX) -> dict[str, Any]:
    from registry.lifecycle.policy_admin import show as run_show

    return run_show(ctx)


@router.post("/policy")
async def policy_apply(request: Request) -> dict[str, Any]:
    from registry.lifecycle.policy_admin import apply_text

    ctx, doc = await _authed_body(request)
    return await run_in_threadpool(
        apply_text, ctx, _str(doc, "text"), _str(doc, "name", "policy")[:200]
    )


@router.get("/policy/export")
def policy_export(bucket: str | None = None, ctx: Context = CTX) -> dict[str, Any]:
    from registry.lifecycle.policy_admin import export

    document, missing = export(ctx, bucket)
    return {"document": document, "missing": missing}


@router.post("/mlflow/sync")
async def mlflow_sync(request: Request) -> dict[str, Any]:
    from registry.mlflow_mirror import drain

    ctx, doc = await _authed_body(request)
    budget = doc.get("budget_s", 300.0)
    if isinstance(budget, bool) or not isinstance(budget, int | float) or not 0 < budget <= 3600:
        raise UsageError("budget_s must be a number of seconds in (0, 3600]")
    settings = request.app.state.reg.settings

    def work() -> dict[str, Any]:
        ctx.authorize("mlflow-sync", target="the MLflow mirror")
        return drain(ctx.catalog, settings, float(budget), wait=True, holder=ctx.actor)

    return await run_in_threadpool(work)


@router.get("/recovery")
def recovery(
    run: str, project: str = "default", mtbf_s: float = Query(86400.0), ctx: Context = CTX
) -> dict[str, Any]:
    from registry.lifecycle.recovery import economics

    if not 0 < mtbf_s < float("inf"):
        raise UsageError(f"--mtbf must be a positive, finite duration, got {mtbf_s}s")
    return economics(ctx, run, project=project, mtbf_s=mtbf_s)


# -- tokens ----------------------------------------------------------------------------------------


@router.post("/tokens")
async def token_create(request: Request) -> dict[str, Any]:
    from registry.lifecycle import token_admin

    ctx, doc = await _authed_body(request)
    expires = doc.get("expires_s")
    if expires is not None and (isinstance(expires, bool) or not isinstance(expires, int | float)):
        raise UsageError("expires_s must be a number of seconds")
    return await run_in_threadpool(
        lambda: token_admin.create(ctx, _str(doc, "principal"), expires_s=expires)
    )


@router.get("/tokens")
def token_list(ctx: Context = CTX) -> list[dict[str, Any]]:
    from registry.lifecycle import token_admin

    return token_admin.listing(ctx)


@router.delete("/tokens/{token_id}")
def token_revoke(token_id: str, ctx: Context = CTX) -> dict[str, Any]:
    from registry.lifecycle import token_admin

    return token_admin.revoke(ctx, token_id)
