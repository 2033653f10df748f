"""The data path of `reg server` on a local store: a push streams in (`upload.py`), and a
pull or a validator reads one listed file of one readable artifact at a time."""

from __future__ import annotations

import struct
import time
from collections.abc import Iterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from policies.access import Action
from registry.api.remote.push_stream import MAGIC
from registry.core.layout import MANIFEST, checkpoint_prefix, release_prefix
from registry.core.refs import CheckpointRef, ReleaseRef, parse_checkpoint_ref, parse_ref
from registry.errors import NotFound, RegistryError, UsageError
from registry.formats.documents import FileRecord
from registry.lifecycle.checkpoints.costs import record_restore
from registry.lifecycle.checkpoints.push import push
from registry.lifecycle.checkpoints.read import kept_manifest, record_resume, resolve
from registry.lifecycle.checkpoints.resume_facts import resume_json
from registry.lifecycle.context import Context
from registry.lifecycle.views import CheckpointView
from registry.server.auth import CTX, context_for
from registry.server.presigned import read_urls
from registry.server.requests import authed_body, idle_limited, text
from registry.server.upload import MAX_HEADER, Receiver, Writer, parse_header

router = APIRouter()
MAX_RANGE = 64 << 20  # one ranged read; a client asks for larger reads in pieces
WRITE_BATCH = 4 << 20


@router.post("/checkpoints/push")
async def push_checkpoint(request: Request) -> dict[str, Any]:
    """A push: the framed stream of `upload.py`, received into a private directory, then pushed
    with the embedded code (the server scans and inventories what it received)."""
    from registry.server import metrics

    ctx = await run_in_threadpool(context_for, request)
    stream = idle_limited(request).__aiter__()
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
        Action.PUSH,
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
                    layout=req.layout,
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
    ctx: Context, ref: CheckpointRef | ReleaseRef, *, with_view: bool = True
) -> tuple[str, str, list[FileRecord], dict[str, Any]]:
    """(full ref, store prefix, files, view JSON) of what a pull of `ref` downloads, if the
    caller may read it: committed checkpoints, and releases that are not yanked. Without
    `with_view` (each ranged read) the view is empty: nothing is decided or rendered."""
    if isinstance(ref, ReleaseRef):
        from registry.lifecycle.releases import pullable, stored_files

        view = pullable(ctx, ref)
        prefix = release_prefix(view.model.name, view.row.version)
        return view.name, prefix, stored_files(view), view.to_json()

    ctx.authorize_read(project=ref.project)
    _, ckpt, files = resolve(ctx, ref)
    full = CheckpointRef(ref.project, ref.run, ckpt.step)
    prefix = checkpoint_prefix(ref.project, ref.run, ckpt.step)
    if not with_view:
        return str(full), prefix, files, {}
    shown = CheckpointView.of(ref.project, ref.run, ckpt, files).to_json()
    return str(full), prefix, files, shown | resume_json(ctx, full, ckpt, files, full=False)


@router.get("/files")
def files(ref: str, ctx: Context = CTX) -> dict[str, Any]:
    """What a pull of `ref` downloads: the resolved ref and every file (path, size, sha256,
    version), the release's release.json included; on an S3 store, a presigned GET each."""
    full, prefix, listed, view = _pullable(ctx, parse_ref(ref))
    kept = _kept_manifest(ctx, full)
    urls = read_urls(ctx, prefix, listed if kept is None else [*listed, kept])
    out = {
        "ref": full,
        "files": [f.document_json() | ({"url": urls[f.path]} if urls else {}) for f in listed],
        "view": view,
    }
    if kept is not None:  # a pull keeps it beside the files (`reg verify --dir`)
        out["manifest"] = kept.document_json() | ({"url": urls[kept.path]} if urls else {})
    return out


def _kept_manifest(ctx: Context, full: str) -> FileRecord | None:
    """A checkpoint's MANIFEST.json as a pull copies it (None for a release: its release.json
    is one of its files already)."""
    ref = parse_ref(full)
    if not isinstance(ref, CheckpointRef):
        return None
    _, ckpt, _ = resolve(ctx, ref)
    return kept_manifest(ctx, checkpoint_prefix(ref.project, ref.run, ckpt.step), ckpt)


def _readable(
    ctx: Context, ref: CheckpointRef | ReleaseRef, path: str
) -> tuple[str, str | None, int]:
    """(key, version, size) of `path` in `ref`: only files the catalog lists."""
    full, prefix, listed, _ = _pullable(ctx, ref, with_view=False)
    if path == MANIFEST and (kept := _kept_manifest(ctx, full)) is not None:
        listed = [*listed, kept]
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
    ctx, doc = await authed_body(request)
    ref = parse_checkpoint_ref(text(doc, "ref"))

    restore = _restore_phases(doc.get("restore"))

    def work() -> dict[str, Any]:
        ctx.authorize_read(project=ref.project)
        # A training loop restores a step at tier 0 too, named by its step.
        _, ckpt, files = resolve(ctx, ref, local=ref.step is not None)
        full = CheckpointRef(ref.project, ref.run, ckpt.step)
        if ctx.principal.authorize(Action.PUSH, project=ref.project).allowed:
            if restore is None:
                record_resume(ctx, full)
            else:  # a training loop's restore (resumed already), with its phases
                record_restore(ctx, full, *restore)
        view = CheckpointView.of(ref.project, ref.run, ckpt, files).to_json()
        return view | resume_json(ctx, full, ckpt, files, full=False)

    return await run_in_threadpool(work)


def _restore_phases(doc: object) -> tuple[int, dict[str, float]] | None:
    """{world_size, phases: {name: seconds}} of a training loop's restore, checked."""
    if doc is None:
        return None
    if not isinstance(doc, dict):
        raise UsageError("restore must be an object")
    world, phases = doc.get("world_size"), doc.get("phases")
    if isinstance(world, bool) or not isinstance(world, int) or not 1 <= world < 2**31:
        raise UsageError("restore.world_size must be a whole number >= 1")
    if not isinstance(phases, dict) or len(phases) > 32:
        raise UsageError("restore.phases must be an object of at most 32 numbers")
    out = {}
    for name, value in phases.items():
        if (
            not isinstance(name, str)
            or len(name) > 64
            or isinstance(value, bool)
            or not isinstance(value, int | float)
            or not 0 <= value < 1e15
        ):
            raise UsageError(f"restore.phases: {str(name)[:64]!r} is not a phase in seconds")
        out[name] = float(value)
    return world, out
