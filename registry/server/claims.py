"""Checkpoints written by many writers under one claim, through `reg server` (issue 15).

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
import json
import math
import queue
from typing import Any

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from registry.errors import Conflict, ObjectExists, UsageError
from registry.refs import CheckpointRef
from registry.server.auth import context_for
from registry.server.requests import authed_body, idle_limited, opt_text, text

router = APIRouter()
MAX_FILE = 1 << 50
MAX_COSTS_BYTES = 4 << 20  # a 4,096-rank save's per-rank costs are ~0.5 MiB
_END, _ABORT = object(), object()


def _number(doc: dict[str, Any], key: str, default: float) -> float:
    value = doc.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise UsageError(f"{key} must be a number")
    return float(value)


@router.post("/claims")
async def claim(request: Request) -> dict[str, Any]:
    from registry.lifecycle.checkpoints import claimed

    ctx, doc = await authed_body(request)
    step = doc.get("step")
    if isinstance(step, bool) or not isinstance(step, int):
        raise UsageError("step must be a whole number")
    ref = CheckpointRef(text(doc, "project", "default"), text(doc, "run"), step)
    lease = _number(doc, "lease_seconds", claimed.DEFAULT_LEASE_S)
    return await run_in_threadpool(claimed.claim, ctx, ref, lease)


@router.post("/claims/renew")
async def renew(request: Request) -> dict[str, Any]:
    from registry.lifecycle.checkpoints import shared

    ctx, doc = await authed_body(request)
    seconds = _number(doc, "seconds", 120.0)
    if not 0 <= seconds <= 7 * 86400:
        raise UsageError("seconds must be between 0 and 7 days")

    def work() -> dict[str, Any]:
        held = shared.find(ctx, text(doc, "claim"))
        if seconds == 0:
            shared.give_up(ctx, held)
        else:
            shared.renew(ctx, held, seconds)
        return held.to_json()

    return await run_in_threadpool(work)


@router.put("/claims/{token}/files/{path:path}")
async def put_file(token: str, path: str, request: Request) -> dict[str, Any]:
    """One file of the claimed step, streamed into the store as it arrives."""
    from registry.formats.dcp_scan import check_path, is_reserved
    from registry.lifecycle.checkpoints import shared
    from registry.transfer import Stored

    ctx = await run_in_threadpool(context_for, request)
    held = await run_in_threadpool(shared.find, ctx, token)
    check_path(str(held.ref), path)
    if is_reserved(path):
        raise UsageError(f"{path} is a name the registry reserves", "rename the file")
    key = held.prefix + path
    chunks: queue.Queue[Any] = queue.Queue(maxsize=8)

    def produce(write: Any) -> None:
        while (chunk := chunks.get()) is not _END:
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

    loop = asyncio.get_running_loop()
    putting = loop.run_in_executor(None, store)
    received = 0
    try:
        async for chunk in idle_limited(request.stream()):
            received += len(chunk)
            if received > MAX_FILE:
                raise UsageError(f"{path} is over {MAX_FILE} bytes")
            if not await _offer(chunks, chunk, putting):
                break  # the store gave up: its error is raised below
        await _offer(chunks, _END, putting)
    except BaseException:
        await _offer(chunks, _ABORT, putting)
        await asyncio.gather(putting, return_exceptions=True)
        raise
    put = await putting
    stored = Stored(key, put.size, put.sha256, False, put.version)
    await run_in_threadpool(shared.record_part, ctx, held, [stored])
    return {"path": path, "size": put.size, "sha256": put.sha256, "version": put.version}


async def _offer(chunks: queue.Queue[Any], item: Any, putting: asyncio.Future[Any]) -> bool:
    """Queue `item` for the store's writer thread without blocking the event loop; False once
    that thread has ended (it failed, or never read: the key existed)."""
    while True:
        try:
            chunks.put_nowait(item)
            return True
        except queue.Full:
            if putting.done():
                return False
            await asyncio.sleep(0.002)


@router.post("/claims/{token}/commit")
async def commit(token: str, request: Request) -> dict[str, Any]:
    from registry.lifecycle.checkpoints import claimed

    ctx, doc = await authed_body(request, MAX_COSTS_BYTES + (1 << 20))
    world = doc.get("world_size")
    if world is not None and (isinstance(world, bool) or not isinstance(world, int)):
        raise UsageError("world_size must be a whole number")
    metrics = doc.get("metrics") or {}
    if not isinstance(metrics, dict):
        raise UsageError("metrics must be an object of numbers")
    costs = doc.get("save_costs")
    if costs is not None and (
        not isinstance(costs, dict) or len(json.dumps(costs)) > MAX_COSTS_BYTES
    ):
        raise UsageError(f"save_costs must be an object of at most {MAX_COSTS_BYTES} bytes")

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
