"""The object-store contract, shaped by what the two lifecycles need (DESIGN §3).

Every write is put-if-absent: an existing object is never replaced. A caller that finds an object
already there compares digests (equal: skip; different: conflict, or for the holder of a stale
claim, delete and retry). Keys are `/`-separated relative paths; `release/` keys are never deleted.
"""

from __future__ import annotations

import hashlib
import queue
import re
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Protocol, runtime_checkable

from registry.errors import Conflict, UsageError

Progress = Callable[[int], None] | None
Producer = Callable[[Callable[[Any], None]], None]
CHUNK = 8 * 1024 * 1024
_SEGMENT = re.compile(r"[A-Za-z0-9._=-][A-Za-z0-9._=+-]*")


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    key: str
    size: int
    version_id: str | None = None


@dataclass(frozen=True, slots=True)
class PutResult:
    key: str
    size: int
    sha256: str


@runtime_checkable
class ObjectStore(Protocol):
    url: str

    def put_file(
        self, key: str, src: Path, *, immutable: bool = False, progress: Progress = None
    ) -> PutResult:
        """Stream `src` to `key`, hashing in the same pass. Raise ObjectExists if `key` exists."""
        ...

    def put_bytes(self, key: str, data: bytes, *, immutable: bool = False) -> PutResult: ...

    def put_stream(self, key: str, produce: Producer, *, immutable: bool = False) -> PutResult:
        """Write what `produce(write)` writes, hashing it; put-if-absent like `put_file`."""
        ...

    def get_file(self, key: str, dest: Path, *, progress: Progress = None) -> PutResult:
        """Write the object to `dest` (created, fsynced), returning its size and sha256."""
        ...

    def get_bytes(self, key: str) -> bytes: ...

    def read_range(self, key: str, offset: int, length: int) -> bytes: ...

    def open_read(self, key: str) -> BinaryIO:
        """A readable, seekable binary stream over the object."""
        ...

    def head(self, key: str) -> ObjectInfo | None: ...

    def sha256(self, key: str, *, progress: Progress = None) -> str:
        """Re-hash the stored bytes (a scrub reads every byte)."""
        ...

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        """Objects whose key starts with `prefix`, in key order."""
        ...

    def delete(self, key: str) -> int:
        """Delete the object (every version where versioned). Return the bytes freed."""
        ...

    def delete_many(self, keys: Sequence[str]) -> tuple[int, dict[str, str]]:
        """Delete objects in batches (every version where versioned): (bytes freed, errors by
        key). A failed key never stops the others."""
        ...

    def describe(self, key: str) -> str:
        """A URI a person or another tool can use for `key`."""
        ...


def check_key(key: str) -> str:
    """Refuse keys that could escape the store root or alias another key."""
    parts = key.split("/")
    if not key or key.startswith("/") or any(not _SEGMENT.fullmatch(p) for p in parts):
        raise UsageError(
            f"invalid object key {key!r}", "keys are relative, no empty or odd segments"
        )
    if any(p in {".", ".."} or p.startswith("..") for p in parts):
        raise UsageError(f"invalid object key {key!r}", "keys never contain '.' or '..' segments")
    return key


def check_deletable(key: str) -> None:
    if key.startswith("release/"):
        raise Conflict(
            f"refusing to delete {key}", "release objects are immutable and never deleted"
        )


def hash_stream(stream: BinaryIO, progress: Progress = None) -> tuple[int, str]:
    digest = hashlib.sha256()
    size = 0
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    while n := stream.readinto(view):  # type: ignore[attr-defined]
        digest.update(view[:n])
        size += n
        if progress:
            progress(n)
    return size, digest.hexdigest()


class HashingSink:
    """Hashes and writes buffers on a background thread while the producer prepares the next
    one (two in flight at most, so memory stays bounded). `close()` returns (size, sha256)."""

    def __init__(self, write: Callable[[memoryview], None]) -> None:
        self._write = write
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=2)
        self._digest = hashlib.sha256()
        self._size = 0
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="reg-sink", daemon=True)
        self._thread.start()

    def write(self, data: Any) -> None:
        if self._error is not None:
            raise self._error
        self._queue.put(data)

    def _run(self) -> None:
        while (data := self._queue.get()) is not None:
            if self._error is not None:
                continue  # drain after a failure
            try:
                view = memoryview(data).cast("B")
                self._digest.update(view)
                self._write(view)
                self._size += len(view)
            except BaseException as exc:
                self._error = exc

    def close(self) -> tuple[int, str]:
        self._queue.put(None)
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._size, self._digest.hexdigest()
