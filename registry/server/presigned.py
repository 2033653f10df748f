"""The presigned data path of `reg server` on an S3 store: the server authorizes, claims and
signs; the client's bytes go straight to S3 (`registry.lifecycle.checkpoints.presigned`).

    GET  /v1/data-path                  which path this server's store takes (stream | presigned)
    POST /v1/checkpoints/push/begin     {project, run, step, world_size, metrics, files}
    POST /v1/checkpoints/push/urls      {ref, upload, start, count}
    POST /v1/checkpoints/push/assemble  {ref, upload, path}  (one file, once its parts are up)
    POST /v1/checkpoints/push/complete  {ref, upload}
    POST /v1/checkpoints/push/abort     {ref, upload}
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from registry.core.refs import CheckpointRef, parse_checkpoint_ref
from registry.errors import UsageError
from registry.formats.documents import FileRecord
from registry.lifecycle.checkpoints.presigned import abort as abort_push
from registry.lifecycle.checkpoints.presigned import assemble as assemble_file
from registry.lifecycle.checkpoints.presigned import begin as begin_push
from registry.lifecycle.checkpoints.presigned import complete as complete_push
from registry.lifecycle.checkpoints.presigned import urls as more_urls
from registry.lifecycle.checkpoints.upload_plan import declared_files
from registry.lifecycle.context import Context
from registry.server.auth import CTX
from registry.server.requests import authed_body, opt_text, text
from registry.server.upload import MAX_HEADER
from registry.storage.s3_presign import Presigner

router = APIRouter()


@router.get("/data-path")
def data_path(ctx: Context = CTX) -> dict[str, Any]:
    from registry.storage.s3 import S3Store

    presigned = isinstance(ctx.store, S3Store)
    return {
        "push": "presigned" if presigned else "stream",
        "read": "presigned" if presigned else "server",
    }


@router.post("/checkpoints/push/begin")
async def begin(request: Request) -> dict[str, Any]:
    ctx, doc = await authed_body(request, MAX_HEADER)
    step, world, metrics = doc.get("step"), doc.get("world_size"), doc.get("metrics") or {}
    if not isinstance(metrics, dict):
        raise UsageError("metrics must be an object of numbers")

    def work() -> dict[str, Any]:
        files = declared_files(doc.get("files"))
        return begin_push(
            ctx,
            text(doc, "project"),
            text(doc, "run"),
            step if isinstance(step, int) and not isinstance(step, bool) else -1,
            world_size=world if world is None or isinstance(world, int) else -1,
            metrics=metrics,
            files=files,
            layout=opt_text(doc, "layout"),
        )

    return await run_in_threadpool(work)


def _upload(doc: dict[str, Any]) -> tuple[CheckpointRef, str]:
    ref = parse_checkpoint_ref(text(doc, "ref"))
    if ref.step is None:
        raise UsageError("ref must name a step", "project/run@stepN")
    return ref, text(doc, "upload")


@router.post("/checkpoints/push/urls")
async def urls(request: Request) -> dict[str, Any]:
    ctx, doc = await authed_body(request)
    ref, upload = _upload(doc)
    start, count = doc.get("start", 0), doc.get("count", 0)
    if not all(isinstance(n, int) and not isinstance(n, bool) for n in (start, count)):
        raise UsageError("start and count are whole numbers")
    return await run_in_threadpool(more_urls, ctx, ref, upload, start, count)


@router.post("/checkpoints/push/complete")
async def complete(request: Request) -> dict[str, Any]:
    ctx, doc = await authed_body(request)
    ref, upload = _upload(doc)

    def work() -> dict[str, Any]:
        notes: list[str] = []
        out = complete_push(ctx, ref, upload, notes).to_json()
        out["notes"] = notes
        return out

    return await run_in_threadpool(work)


@router.post("/checkpoints/push/assemble")
async def assemble(request: Request) -> dict[str, Any]:
    ctx, doc = await authed_body(request)
    ref, upload = _upload(doc)
    return await run_in_threadpool(assemble_file, ctx, ref, upload, text(doc, "path"))


@router.post("/checkpoints/push/abort")
async def abort(request: Request) -> dict[str, Any]:
    ctx, doc = await authed_body(request)
    ref, upload = _upload(doc)
    return await run_in_threadpool(abort_push, ctx, ref, upload)


def read_urls(ctx: Context, prefix: str, files: list[FileRecord]) -> dict[str, str]:
    """Presigned GETs of each listed file (the version the catalog recorded), for a caller the
    endpoint already authorized; none when the store is not S3 (the server serves reads)."""
    from registry.storage.s3 import S3Store

    if not isinstance(ctx.store, S3Store):
        return {}
    presigner = Presigner(ctx.store)
    return {f.path: presigner.get_url(prefix + f.path, f.version) for f in files}
