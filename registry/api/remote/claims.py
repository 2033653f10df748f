"""A checkpoint's files pushed under a shared claim through `reg server`: one node's
part of a step (`reg push-ckpt DIR --claim TOKEN`), each file a streamed PUT that the server
hashes as it lands; the answer's digest must equal the one computed here while sending."""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from registry.catalog.leases import Heartbeat
from registry.core.progress import Counter, Progress
from registry.core.refs import CheckpointRef
from registry.errors import IntegrityError, UsageError
from registry.formats.dcp_scan import open_checked, scan_part
from registry.lifecycle.checkpoints.claimed import DEFAULT_LEASE_S, RENEW_EVERY_S
from registry.lifecycle.checkpoints.shared import check_token

if TYPE_CHECKING:
    from registry.core.config import Settings

CHUNK = 4 << 20


class ClaimServer(Protocol):
    """What a part's push asks of the server (`RemoteRegistry`, which calls `push_part`)."""

    settings: Settings

    def renew_claim(self, claim: str, seconds: float) -> dict[str, Any]: ...
    def put_claimed(self, claim: str, path: str, chunks: Iterable[bytes]) -> dict[str, Any]: ...


def push_part(
    registry: ClaimServer,
    root: Path,
    token: str,
    ref: CheckpointRef,
    progress: Progress | None = None,
) -> dict[str, Any]:
    held = registry.renew_claim(check_token(token), DEFAULT_LEASE_S)
    if held.get("ref") != str(ref):
        raise UsageError(
            f"the claim is for {held.get('ref')}, not {ref}",
            "pass the --run and --step it was made for",
        )
    files, identity = scan_part(root)
    counter = Counter(progress)
    if progress:
        progress.start(f"push {ref} (part)", sum(files.values()))
    started = time.monotonic()

    def put(path: str) -> dict[str, Any]:
        digest = hashlib.sha256()
        fd = open_checked(root, path, identity[path], files[path])

        def chunks() -> Iterator[bytes]:
            with os.fdopen(fd, "rb") as f:
                while chunk := f.read(CHUNK):
                    digest.update(chunk)
                    counter(len(chunk))
                    yield chunk

        got = registry.put_claimed(token, path, chunks())
        if (got.get("size"), got.get("sha256")) != (files[path], digest.hexdigest()):
            raise IntegrityError(
                f"{root / path}: the server stored other bytes than were sent",
                "the file changed while being pushed, or was damaged in transit; push again",
            )
        return {"path": path, "size": files[path], "sha256": digest.hexdigest()}

    try:
        with (
            Heartbeat(lambda: registry.renew_claim(token, DEFAULT_LEASE_S), RENEW_EVERY_S),
            ThreadPoolExecutor(max_workers=registry.settings.workers) as pool,
        ):
            done = list(pool.map(put, sorted(files, key=lambda p: -files[p])))
    finally:
        if progress:
            progress.finish()
    return {
        "ref": str(ref),
        "files": sorted(done, key=lambda f: f["path"]),
        "bytes": sum(files.values()),
        "reused_files": 0,
        "upload_seconds": round(time.monotonic() - started, 3),
    }
