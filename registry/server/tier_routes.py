"""Tier 0 through `reg server`: a training job's saves committed on its nodes' local
disks, and their copy to the store through the server's push path.

    POST /v1/claims/{token}/commit-local  {files, nodes, metadata, world_size, metrics,
                                           save_costs, upload_seconds, held}: the tier-0 commit
    GET  /v1/claims/{token}/missing       the files of a tier-0 step not yet copied to the store
    POST /v1/claims/{token}/replicated    {seconds}: its commit at tier 1
    POST /v1/tiers/evicted                {ref, node}: a node dropped its copy
    POST /v1/tiers/states                 {project, run, steps}: each step's state
    POST /v1/tiers/candidates             {project, run}: the steps a restore may read
    POST /v1/tiers/stranded               {project, run, live}: tier-0 steps nobody copies
    POST /v1/tiers/adopt                  {ref}: take over such a step's copy (its claim)

The tier-0 commit takes the files' digests on the job's word (the bytes are on its nodes, not
here), but reads each `.metadata` from the request and checks it against its record, and the
step is at tier 0 only: nothing that reads the store sees it. Each file of the copy to the
store comes through `PUT /v1/claims/{token}/files/{path}` (`claims.put_file`), hashed and
recorded here; the tier-1 commit (`tiers.commit_replicated`) takes only what this server
received with the digests tier 0 recorded, and a manifest that hashes to the recorded one.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from registry.catalog import claims
from registry.core.refs import CheckpointRef, check_name, parse_checkpoint_ref
from registry.errors import IntegrityError, UsageError
from registry.formats.dcp_scan import check_path
from registry.formats.documents import FileRecord
from registry.lifecycle.checkpoints import shared, tiers
from registry.lifecycle.checkpoints.costs import check_save_costs
from registry.server.auth import context_for
from registry.server.requests import authed_body, flag, json_body, number, text

router = APIRouter()
MAX_COMMIT_BYTES = 64 << 20  # the records and each .metadata, base64 (48 MiB of them)
MAX_STEPS = 10_000
MAX_NODES = 4096


def _int(value: object, what: str, low: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise UsageError(f"{what} must be a whole number of at least {low}")
    return value


def _seconds(doc: dict[str, Any], key: str) -> float:
    seconds = number(doc, key, 0.0)
    if seconds < 0:
        raise UsageError(f"{key} must be a number of at least 0")
    return seconds


def _files(doc: object) -> list[FileRecord]:
    if not isinstance(doc, list):
        raise UsageError("files must be a list of [path, size, sha256, rank]")
    out = []
    for item in doc:
        if not (isinstance(item, list) and len(item) == 4 and isinstance(item[0], str)):
            raise UsageError("files must be a list of [path, size, sha256, rank]")
        path, size, digest, rank = item
        if not shared.is_digest(digest):
            raise UsageError(f"{path[:80]!r}: sha256 must be 64 hex digits")
        rank = None if rank is None else _int(rank, "rank")
        out.append(FileRecord(path, _int(size, "size"), digest, rank))
    return out


def _nodes(doc: object) -> dict[str, tuple[list[int], list[str]]]:
    if not isinstance(doc, dict) or len(doc) > MAX_NODES:
        raise UsageError(f"nodes must map at most {MAX_NODES} node ids to [ranks, files]")
    out = {}
    for node, held in doc.items():
        check_name(node, "node_id")
        if not (isinstance(held, list) and len(held) == 2):
            raise UsageError(f"node {node}: [ranks, files]")
        node_ranks, node_files = held
        if not isinstance(node_ranks, list) or not isinstance(node_files, list):
            raise UsageError(f"node {node}: [ranks, files]")
        if not all(isinstance(f, str) for f in node_files):
            raise UsageError(f"node {node}: files are paths")
        out[node] = ([_int(r, "rank") for r in node_ranks], list(node_files))
    return out


def _metadata(doc: object) -> dict[str, bytes]:
    if not isinstance(doc, dict):
        raise UsageError("metadata must map each .metadata path to its bytes (base64)")
    out = {}
    for path, encoded in doc.items():
        if not isinstance(encoded, str):
            raise UsageError(f"metadata[{path[:80]!r}] must be base64")
        try:
            out[path] = base64.b64decode(encoded, validate=True)
        except (binascii.Error, ValueError):
            raise UsageError(f"metadata[{path[:80]!r}] is not base64") from None
    return out


@router.post("/claims/{token}/commit-local")
async def commit_local(token: str, request: Request) -> dict[str, Any]:
    ctx = await run_in_threadpool(context_for, request)
    held = await run_in_threadpool(shared.find, ctx, token)  # authorized before the body
    doc = await json_body(request, MAX_COMMIT_BYTES)
    files = _files(doc.get("files"))
    nodes = _nodes(doc.get("nodes"))
    sent = _metadata(doc.get("metadata"))
    label = str(held.ref)
    for path in [f.path for f in files] + [p for _, ps in nodes.values() for p in ps] + [*sent]:
        check_path(label, path)  # they become paths on other jobs' nodes (a restore's reads)
    world = _int(doc.get("world_size"), "world_size", 1)
    metrics = doc.get("metrics") or {}
    if not isinstance(metrics, dict):
        raise UsageError("metrics must be an object of numbers")
    costs = check_save_costs(doc.get("save_costs"))
    seconds = _seconds(doc, "upload_seconds")
    keep = flag(doc, "held", default=True)
    written: list[bytes] = []

    def read(path: str) -> bytes:
        if path not in sent:
            raise IntegrityError(
                f"{held.ref}: {path} is on the job's nodes, not sent with the commit",
                "a tier-0 save through the server holds DCP's files only",
            )
        return sent[path]

    def work() -> dict[str, Any]:
        token_1 = claims.new_token()
        result = shared.commit_written(
            ctx,
            held,
            files,
            world_size=world,
            metrics=metrics,
            save_costs=costs,
            upload_seconds=seconds,
            own_writer=True,
            local=shared.LocalCopy(
                read=read, nodes=nodes, write_manifest=written.append, token=token_1, held=keep
            ),
        )
        return {
            "view": result.to_json(),
            "row": held.row_id,
            "claim": token_1,
            "manifest": base64.b64encode(written[-1]).decode(),
        }

    return await run_in_threadpool(work)


@router.get("/claims/{token}/missing")
async def missing(token: str, request: Request) -> dict[str, Any]:
    ctx = await run_in_threadpool(context_for, request)

    def work() -> dict[str, Any]:
        held = _copying(ctx, token)
        return {"ref": str(held.ref), "missing": tiers.missing_parts(ctx, held)}

    return await run_in_threadpool(work)


@router.post("/claims/{token}/replicated")
async def replicated(token: str, request: Request) -> dict[str, Any]:
    ctx, doc = await authed_body(request)
    seconds = _seconds(doc, "seconds")

    def work() -> dict[str, Any]:
        return tiers.commit_replicated(ctx, _copying(ctx, token), seconds)

    return await run_in_threadpool(work)


def _copying(ctx: Any, token: str) -> shared.SharedClaim:
    held = shared.find(ctx, token, local=True)
    if not tiers.copying(ctx, held):
        raise UsageError(f"{held.ref} is being saved, not copied", "commit it at tier 0 first")
    return held


def _step_ref(doc: dict[str, Any]) -> CheckpointRef:
    ref = parse_checkpoint_ref(text(doc, "ref"))
    if ref.step is None:
        raise UsageError(f"{ref}: name a step (RUN@stepN)")
    return ref


def _run(doc: dict[str, Any]) -> tuple[str, str]:
    project, run = text(doc, "project"), text(doc, "run")
    check_name(project, "project name")
    check_name(run, "run name")
    return project, run


@router.post("/tiers/evicted")
async def evicted(request: Request) -> dict[str, Any]:
    ctx, doc = await authed_body(request)
    ref, node = _step_ref(doc), text(doc, "node")
    check_name(node, "node_id")
    await run_in_threadpool(tiers.record_eviction, ctx, ref, node)
    return {"ref": str(ref), "node": node}


@router.post("/tiers/states")
async def states(request: Request) -> dict[str, Any]:
    ctx, doc = await authed_body(request)
    project, run = _run(doc)
    steps = doc.get("steps")
    if not isinstance(steps, list) or len(steps) > MAX_STEPS:
        raise UsageError(f"steps must be a list of at most {MAX_STEPS} steps")
    wanted = [_int(s, "step") for s in steps]
    found = await run_in_threadpool(tiers.step_states, ctx, project, run, wanted)
    return {"states": {str(k): v for k, v in found.items()}}


@router.post("/tiers/candidates")
async def candidates(request: Request) -> dict[str, Any]:
    ctx, doc = await authed_body(request)
    project, run = _run(doc)
    found = await run_in_threadpool(tiers.restore_candidates, ctx, project, run)
    return {"candidates": [c | {"files": [list(f) for f in c["files"]]} for c in found]}


@router.post("/tiers/stranded")
async def stranded(request: Request) -> dict[str, Any]:
    ctx, doc = await authed_body(request)
    project, run = _run(doc)
    live = flag(doc, "live")
    found = await run_in_threadpool(lambda: tiers.stranded(ctx, project, run, live=live))
    return {
        "stranded": [
            s | {"files": [list(f) for f in s["files"]], "holder": list(s["holder"])} for s in found
        ]
    }


@router.post("/tiers/adopt")
async def adopt(request: Request) -> dict[str, Any]:
    ctx, doc = await authed_body(request)
    ref = _step_ref(doc)
    taken = await run_in_threadpool(tiers.claim_replication, ctx, ref)
    return {"ref": str(ref), "row": taken.row_id, "claim": taken.token}
