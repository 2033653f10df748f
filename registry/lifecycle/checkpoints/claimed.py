"""A checkpoint pushed by a launcher outside Python, node by node, under one claim.

    reg claim-ckpt --run R --step N              prints a claim token (lease: --lease, 1h)
    reg push-ckpt DIR --claim TOKEN --run R --step N    on each node, for the files it has
    reg commit-ckpt --claim TOKEN                commits once every file .metadata names is up

Each `push-ckpt --claim` copies its directory's files into the step's prefix (put-if-absent,
hashed while copied; a file another node already put with the same bytes is reused, other
bytes are a conflict) and records which files it put (`shared.record_part`). The commit reads
the records back, checks them against the store and `.metadata` (`shared.commit_written`),
and deletes them.
"""

from __future__ import annotations

import contextlib
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from policies.layouts import check_layout
from registry.catalog.leases import Heartbeat
from registry.core.progress import Counter, Progress
from registry.core.refs import CheckpointRef
from registry.errors import IntegrityError, RegistryError, UsageError
from registry.formats.dcp_scan import open_checked, scan_part
from registry.lifecycle.checkpoints import shared
from registry.lifecycle.transfer import OnMismatch, Stored, put_reconciled

if TYPE_CHECKING:
    from registry.lifecycle.context import Context

DEFAULT_LEASE_S = 3600.0
RENEW_EVERY_S = 60.0


def claim(ctx: Context, ref: CheckpointRef, lease_s: float = DEFAULT_LEASE_S) -> dict[str, Any]:
    taken = shared.claim(ctx, ref, lease_s=lease_s)
    return {**taken.to_json(), "lease_seconds": lease_s}


def push_part(
    ctx: Context,
    src: Path,
    token: str,
    ref: CheckpointRef,
    *,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Copy one node's files of the claimed step; `ref` must be the step the claim holds."""
    held = shared.find(ctx, token)
    if held.ref != ref:
        raise UsageError(
            f"the claim is for {held.ref}, not {ref}", "pass the --run and --step it was made for"
        )
    root = Path(src)
    files, identity = scan_part(root)
    shared.renew(ctx, held, DEFAULT_LEASE_S)
    counter = Counter(progress)
    if progress:
        progress.start(f"push {ref} (part)", sum(files.values()))
    started = time.monotonic()

    def put(path: str) -> Stored:
        fd = open_checked(root, path, identity[path], files[path])
        try:
            source = Path(f"/proc/self/fd/{fd}") if os.path.isdir("/proc/self/fd") else root / path
            return put_reconciled(
                ctx.store,
                held.prefix + path,
                path=source,
                on_mismatch=OnMismatch.CONFLICT,  # another node's bytes: never replaced
                progress=counter,
            )
        finally:
            os.close(fd)

    try:
        # The claim lives as long as the copy does, however long that is.
        with (
            Heartbeat(lambda: shared.renew(ctx, held, DEFAULT_LEASE_S), RENEW_EVERY_S),
            ThreadPoolExecutor(max_workers=ctx.workers) as pool,
        ):
            stored = list(pool.map(put, sorted(files, key=lambda p: -files[p])))
    finally:
        if progress:
            progress.finish()
    for s in stored:
        path = s.key.removeprefix(held.prefix)
        if s.size != files[path]:
            raise IntegrityError(f"{root / path} changed while being pushed", "push it again")
    try:
        shared.record_part(ctx, held, stored)
    except RegistryError:
        # The claim changed while the files went up: what this push wrote must not stay in
        # the next attempt's way (a file another writer had put already is theirs).
        for s in stored:
            if not s.reused:
                with contextlib.suppress(RegistryError):
                    ctx.store.delete(s.key)
        raise
    shared.renew(ctx, held, DEFAULT_LEASE_S)
    seconds = time.monotonic() - started
    return {
        "ref": str(ref),
        "files": [
            {"path": s.key.removeprefix(held.prefix), "size": s.size, "sha256": s.sha256}
            for s in sorted(stored, key=lambda s: s.key)
        ],
        "bytes": sum(s.size for s in stored),
        "reused_files": sum(s.reused for s in stored),
        "upload_seconds": round(seconds, 3),
    }


def commit(
    ctx: Context,
    token: str,
    *,
    world_size: int | None = None,
    metrics: dict[str, float] | None = None,
    layout: str | None = None,
    save_costs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Commit the claimed step from every part pushed under `token` (`save_costs`: what the
    training loop measured, recorded as it says)."""
    check_layout(layout)
    held = shared.find(ctx, token)
    files, records = shared.recorded_parts(ctx, held)
    if not files:
        raise IntegrityError(
            f"{held.ref}: nothing was pushed under this claim",
            "run `reg push-ckpt DIR --claim TOKEN` on each node first",
        )
    result = shared.commit_written(
        ctx,
        held,
        files,
        world_size=world_size,
        metrics=metrics,
        layout=layout,
        save_costs=save_costs,
    )
    for key in records:  # the parts' records are not part of the checkpoint
        with contextlib.suppress(RegistryError):
            ctx.store.delete(key)
    return result.to_json()
