"""Checkpoints written by many writers under one claim, through `reg server`.

    POST /v1/claims                        {project, run, step, lease_seconds}: the claim token
    POST /v1/claims/renew                  {claim, seconds}: keep it alive (a writer renews)
    PUT  /v1/claims/{token}/files/{path}   one file's bytes, streamed into the store
    POST /v1/claims/{token}/commit         {world_size, metrics, layout, save_costs}

Each writer's file streams through the server into the store (put-if-absent), hashed here as it
lands: the digest recorded for it is the server's, and the server writes the record of what it
received (`shared.record_part`), so the commit takes no file list from a client. The commit
reads `.metadata` and the head of every shard from the store itself.
"""

from __future__ import annotations

import asyncio
import errno
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from registry.core.layout import MANIFEST
from registry.errors import Conflict, IntegrityError, ObjectExists, RegistryError, UsageError
from registry.formats.dcp_scan import check_path, is_reserved
from registry.lifecycle.checkpoints import claimed, shared, tiers
from registry.lifecycle.checkpoints.costs import check_save_costs
from registry.lifecycle.transfer import Stored
from registry.server.auth import context_for
from registry.server.requests import (
    authed_body,
    idle_limited,
    idle_s,
    json_body,
    number,
    opt_text,
    text,
)
from registry.server.upload import MAX_DEPTH, MAX_PATH, MAX_SEGMENT, path_problem

router = APIRouter()
MAX_FILE = 1 << 44  # 16 TiB: far above any shard
MIN_RATE = 64 * 1024  # bytes/s a body must keep up after its first minute


UPLOAD_WAIT_S = 120.0


class UploadSlots:
    """The file uploads the server receives at once (REG_SERVER_UPLOADS): they run on a pool
    of their own, never the request threadpool every request needs; a PUT waits at most
    UPLOAD_WAIT_S for a slot, then the client is told to retry."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.pool = ThreadPoolExecutor(max_workers=count, thread_name_prefix="reg-upload")
        self._slots: dict[int, asyncio.Semaphore] = {}  # one per event loop (it binds to one)

    def slots(self) -> asyncio.Semaphore:
        loop = id(asyncio.get_running_loop())
        return self._slots.setdefault(loop, asyncio.Semaphore(self.count))


def _uploads(request: Request) -> UploadSlots:
    state = request.app.state.reg
    if state.uploads is None:
        state.uploads = UploadSlots(state.settings.server.uploads)
    return state.uploads  # type: ignore[no-any-return]


MAX_COSTS_BYTES = 4 << 20  # a 4,096-rank save's per-rank costs are ~0.5 MiB
_END, _ABORT = object(), object()


@router.post("/claims/renew")
async def renew(request: Request) -> dict[str, Any]:
    ctx, doc = await authed_body(request)
    seconds = number(doc, "seconds", 120.0)
    if not 0 <= seconds <= 7 * 86400:
        raise UsageError("seconds must be between 0 and 7 days")

    def work() -> dict[str, Any]:
        held = shared.find(ctx, text(doc, "claim"), local=True)  # a save's or a copy's
        if seconds == 0:
            shared.give_up(ctx, held)
        else:
            shared.renew(ctx, held, seconds)
        return held.to_json()

    return await run_in_threadpool(work)


@router.put("/claims/{token}/files/{path:path}")
async def put_file(token: str, path: str, request: Request) -> dict[str, Any]:
    """One file of the claimed step, streamed into the store as it arrives."""
    ctx = await run_in_threadpool(context_for, request)
    held = await run_in_threadpool(lambda: shared.find(ctx, token, local=True))
    # A tier-0 step's copy to the store: only the files tier 0 recorded, each with
    # the bytes it recorded, and the manifest it recorded.
    copy = await run_in_threadpool(tiers.copying, ctx, held)
    check_path(str(held.ref), path)
    if (why := path_problem(path)) is not None:  # before a directory or file is made
        raise UsageError(
            f"{held.ref}: {path[:80]!r} is not a plain relative file path ({why})",
            f"names of at most {MAX_SEGMENT} bytes, paths of at most {MAX_PATH} characters "
            f"and {MAX_DEPTH} segments",
        )
    if is_reserved(path) and not (copy and path == MANIFEST):
        raise UsageError(f"{path} is a name the registry reserves", "rename the file")
    expected: Any = None
    if copy:
        expected = await run_in_threadpool(tiers.expected, ctx, held, path)
        if expected is None:
            raise UsageError(
                f"{held.ref}: {path[:80]!r} is not a file its tier-0 save recorded",
                "copy only the step's own files",
            )
    uploads = _uploads(request)
    slots = uploads.slots()
    try:
        await asyncio.wait_for(slots.acquire(), UPLOAD_WAIT_S)
    except TimeoutError:
        raise RegistryError(
            f"the server is busy: {uploads.count} uploads in flight", "retry in a moment"
        ) from None
    try:
        return await _receive(ctx, held, path, request, uploads.pool, expected=expected)
    finally:
        slots.release()


async def _receive(
    ctx: Any,
    held: Any,
    path: str,
    request: Request,
    pool: ThreadPoolExecutor,
    *,
    expected: tuple[int, str] | None = None,
) -> dict[str, Any]:
    """The request's body into the store (on the upload pool's thread), without polling: the
    store's thread takes each chunk from an asyncio queue through the event loop. A body that
    arrives slower than MIN_RATE after its first minute is cut off. `expected`: a tier-0 step's
    copy to the store, whose file must be the (size, sha256) tier 0 recorded: no more bytes
    are taken, and other bytes are deleted, never recorded."""
    limit = MAX_FILE if expected is None else expected[0]
    loop = asyncio.get_running_loop()
    idle = idle_s(request)
    chunks: asyncio.Queue[Any] = asyncio.Queue(maxsize=8)
    key = held.prefix + path

    def produce(write: Any) -> None:
        while True:
            chunk = asyncio.run_coroutine_threadsafe(chunks.get(), loop).result(idle * 2)
            if chunk is _END:
                return
            if chunk is _ABORT:
                raise UsageError(f"the upload of {path} was cut off", "send it again")
            write(chunk)

    def store() -> Any:
        try:
            return ctx.store.put_stream(key, produce)
        except ObjectExists:
            raise Conflict(
                f"{held.ref}: {path} was already written under this claim",
                "each file has one writer; claim the step again to rewrite it",
            ) from None
        except (NotADirectoryError, IsADirectoryError, FileExistsError):
            raise Conflict(
                f"{held.ref}: {path} collides with a file or directory already written",
                "give each file its own path",
            ) from None
        except OSError as exc:
            if exc.errno != errno.ENAMETOOLONG:
                raise
            raise UsageError(  # a name the store's filesystem cannot hold: the client's to fix
                f"{held.ref}: {path[:80]!r} is too long a name for the store",
                "use shorter file names",
            ) from None

    putting = loop.run_in_executor(pool, store)

    async def offer(item: Any) -> bool:
        """Queue `item` for the store's thread; False once that thread has ended."""
        queued = asyncio.ensure_future(chunks.put(item))
        done, _ = await asyncio.wait({queued, putting}, return_when=asyncio.FIRST_COMPLETED)
        if queued in done:
            return True
        queued.cancel()
        return False

    received, started = 0, time.monotonic()
    try:
        async for chunk in idle_limited(request):
            received += len(chunk)
            if received > limit:
                raise UsageError(f"{path} is over {limit} bytes")
            elapsed = time.monotonic() - started
            if elapsed > 60 and received < MIN_RATE * elapsed:
                raise UsageError(f"the upload of {path} is too slow", "send it again")
            if not await offer(chunk):
                break  # the store gave up: its error is raised below
        await offer(_END)
    except BaseException:
        await offer(_ABORT)
        await asyncio.gather(putting, return_exceptions=True)
        raise
    put = await putting
    if expected is not None and expected[1] != put.sha256:
        await run_in_threadpool(ctx.store.delete, key)  # this request's own object
        what = "the manifest" if path == MANIFEST else f"the file {path}"
        raise IntegrityError(
            f"{held.ref}: that is not {what} tier 0 recorded", "copy the node's own copy"
        )
    stored = Stored(key, put.size, put.sha256, False, put.version)
    if expected is not None and path == MANIFEST:  # not a file of the checkpoint's own
        return {"path": path, "size": put.size, "sha256": put.sha256, "version": put.version}
    try:
        await run_in_threadpool(shared.record_part, ctx, held, [stored])
    except RegistryError:
        # The claim changed while the bytes came in (given up, taken over): they are this
        # request's own object, and must not stay in the next attempt's way.
        await run_in_threadpool(ctx.store.delete, key)
        raise
    return {"path": path, "size": put.size, "sha256": put.sha256, "version": put.version}


@router.post("/claims/{token}/commit")
async def commit(token: str, request: Request) -> dict[str, Any]:
    ctx = await run_in_threadpool(context_for, request)
    await run_in_threadpool(shared.find, ctx, token)  # authorized before the body is read
    doc = await json_body(request, MAX_COSTS_BYTES + (1 << 20))
    world = doc.get("world_size")
    if world is not None and (isinstance(world, bool) or not isinstance(world, int)):
        raise UsageError("world_size must be a whole number")
    metrics = doc.get("metrics") or {}
    if not isinstance(metrics, dict):
        raise UsageError("metrics must be an object of numbers")
    costs = check_save_costs(doc.get("save_costs"))

    def work() -> dict[str, Any]:
        return claimed.commit(
            ctx,
            token,
            world_size=world,
            metrics=metrics,
            layout=opt_text(doc, "layout"),
            save_costs=costs,
        )

    return await run_in_threadpool(work)
