"""The push stream: how a push's bytes travel to `reg server` in one request.

    b"REGPUSH1" | u64 big-endian header length | header JSON |
        file 1 bytes | sha256 of file 1 (32 bytes) | file 2 bytes | sha256 of file 2 | ...

The header names the checkpoint (project, run, step, world size, metrics) and each file's path
and size. Each file's digest follows its bytes, so the client reads every file once. The
client writes it (`body`); the server reads it (`registry.server.upload`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import queue
import struct
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from registry.errors import IntegrityError

if TYPE_CHECKING:
    from registry.core.progress import Progress
    from registry.formats.dcp_scan import ScannedDir

MAGIC = b"REGPUSH1"
DIGEST = 32  # the sha256 after each file
PIECE = 1 << 20
DEPTH = 16  # pieces read ahead of the network


def frame_header(header: dict[str, Any]) -> bytes:
    data = json.dumps(header, separators=(",", ":")).encode()
    return MAGIC + struct.pack(">Q", len(data)) + data


def body(
    header: dict[str, Any], scanned: ScannedDir, order: list[str], progress: Progress | None
) -> Iterator[bytes]:
    """The whole stream of a push of `scanned`, files in `order`."""
    yield frame_header(header)
    yield from _prefetched(scanned, order, progress)


def _prefetched(
    scanned: ScannedDir, order: list[str], progress: Progress | None
) -> Iterator[bytes]:
    """The body after the header, read and hashed by a thread ahead of the sender, so disk
    reads overlap the network (at most DEPTH pieces in memory)."""
    pieces: queue.Queue[tuple[bytes, bool] | BaseException | None] = queue.Queue(DEPTH)
    stop = threading.Event()

    def read_all() -> None:
        try:
            for path in order:
                for item in _file_pieces(scanned, path):
                    if stop.is_set():
                        return
                    pieces.put(item)
            pieces.put(None)
        except BaseException as exc:  # handed to the sender, which raises it
            pieces.put(exc)

    reader = threading.Thread(target=read_all, name="reg-push-read", daemon=True)
    reader.start()
    try:
        while (item := pieces.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            piece, content = item
            if progress and content:
                progress.advance(len(piece))
            yield piece
    finally:
        stop.set()
        with contextlib.suppress(queue.Empty):
            while True:
                pieces.get_nowait()
        reader.join(timeout=10)


def _file_pieces(scanned: ScannedDir, path: str) -> Iterator[tuple[bytes, bool]]:
    """The bytes of one scanned file (True: content), then its sha256 (False): opened as the
    scan checked it, read once; a file that changed size since the scan is refused here."""
    fd = scanned.open(path)
    digest, sent = hashlib.sha256(), 0
    try:
        while piece := os.read(fd, PIECE):
            digest.update(piece)
            sent += len(piece)
            if sent > scanned.files[path]:
                break
            yield piece, True
    finally:
        os.close(fd)
    if sent != scanned.files[path]:
        raise IntegrityError(
            f"{scanned.root / path} changed while being pushed ({sent} bytes, the scan saw "
            f"{scanned.files[path]})",
            "push a checkpoint that is no longer being written",
        )
    yield digest.digest(), False
