"""The object-store contract, shaped by what the two lifecycles need (DESIGN §3).

`BaseStore` is the one class every backend extends. Its public methods check each key once
(relative, no odd segments, never inside the store's own `.`-namespace) and that deletes never
touch `release/`, then call small backend hooks (`_put_stream`, `_read_range`, `_head`, ...).
Conveniences (`put_bytes`, `get_bytes`, `sha256`, `get_file`) are built on the hooks here; a
backend overrides one only where it has a faster way.

Every write is put-if-absent: an existing object is never replaced (`ObjectExists`). A caller
that finds an object already there compares digests (`registry.lifecycle.transfer.put_reconciled`).
Keys are `/`-separated relative paths.

A writer that may not publish yet (a push waiting for its claim) stages: `stage_file` writes and
hashes the bytes where no reader can see them, `Staged.publish()` makes them the object later
(put-if-absent), `discard()` drops them. Backends without invisible staging defer the write to
`publish()`.

Optional capabilities are explicit methods with safe defaults: `init()` (`reg storage init`) and
`sweep_incomplete(prefix, older_than)` (temp files or multipart uploads that crashed writers
left behind).
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import hashlib
import os
import queue
import re
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from registry.core import faults
from registry.errors import Conflict, IntegrityError, RegistryError, UsageError

Progress = Callable[[int], None] | None
Write = Callable[[Any], None]
Producer = Callable[[Write], None]
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
    version: str | None = None  # the version the put created, on a versioned bucket


@dataclass(frozen=True, slots=True)
class Swept:
    """Something a crashed writer left behind, removed by `sweep_incomplete`."""

    what: str  # a temp file or a multipart upload, as a person would name it
    key: str  # the key it was meant to become
    size: int


class Staged:
    """Bytes on their way to `key`, not visible to any reader until `publish()`."""

    def __init__(self, key: str) -> None:
        self.key = key

    def publish(self) -> PutResult:
        """Make the staged bytes the object at `key`; ObjectExists if the key is taken (the
        staged bytes stay, for a retry after the taker's leftover is removed)."""
        raise NotImplementedError

    def digest(self) -> tuple[int, str]:
        """(size, sha256) of the staged bytes."""
        raise NotImplementedError

    def discard(self) -> None:
        """Drop what is staged (published objects stay)."""

    def __enter__(self) -> Staged:
        return self

    def __exit__(self, *exc: object) -> None:
        self.discard()


class ObjectWriter:
    """Bytes pushed in by the caller (`write`), hashed as they come; `publish()` makes them the
    object (put-if-absent: ObjectExists if the key appeared meanwhile), `discard()` drops
    them. Nothing is visible before `publish()`."""

    key: str

    def write(self, data: Any) -> None:
        raise NotImplementedError

    def publish(self) -> PutResult:
        raise NotImplementedError

    def discard(self) -> None:
        raise NotImplementedError


class _DeferredFile(Staged):
    """Staging for backends that cannot hide a written object: the write happens at publish."""

    def __init__(
        self, store: BaseStore, key: str, src: Path, immutable: bool, progress: Progress
    ) -> None:
        super().__init__(key)
        self._store, self._src, self._immutable, self._progress = store, src, immutable, progress
        self._digest: tuple[int, str] | None = None

    def publish(self) -> PutResult:
        size, digest = self._store._put_file(self.key, self._src, self._immutable, self._progress)
        self._digest = (size, digest)
        return PutResult(self.key, size, digest, self._store._written_version(self.key))

    def digest(self) -> tuple[int, str]:
        if self._digest is None:
            self._digest = hash_file(self._src)
        return self._digest


def check_key(key: str) -> str:
    """Refuse keys that could escape the store root, alias another key, or enter the store's
    own namespace (top-level names starting with `.`, where temp files live)."""
    parts = key.split("/")
    if not key or key.startswith("/") or any(not _SEGMENT.fullmatch(p) for p in parts):
        raise UsageError(
            f"invalid object key {key!r}", "keys are relative, no empty or odd segments"
        )
    if any(p in {".", ".."} or p.startswith("..") for p in parts):
        raise UsageError(f"invalid object key {key!r}", "keys never contain '.' or '..' segments")
    if parts[0].startswith("."):
        raise UsageError(
            f"invalid object key {key!r}", "top-level names starting with '.' are the store's own"
        )
    return key


def check_prefix(prefix: str) -> str:
    """A listing prefix: empty, or a key (possibly ending in `/` or mid-segment)."""
    if prefix:
        check_key(prefix.removesuffix("/"))
    return prefix


def check_deletable(key: str) -> None:
    if key.startswith("release/"):
        raise Conflict(
            f"refusing to delete {key}", "release objects are immutable and never deleted"
        )
    if key.startswith("audit/"):
        raise Conflict(f"refusing to delete {key}", "audit anchors are never deleted")
    if key.startswith("journal/"):
        raise Conflict(
            f"refusing to delete {key}", "the decision journal is append-only: never deleted"
        )


class BaseStore(ABC):
    url: str

    # -- writes (put-if-absent) -----------------------------------------------------------------
    def put_file(
        self, key: str, src: Path, *, immutable: bool = False, progress: Progress = None
    ) -> PutResult:
        """Stream `src` to `key`, hashing in the same pass. Raise ObjectExists if `key` exists."""
        size, digest = self._put_file(check_key(key), Path(src), immutable, progress)
        return PutResult(key, size, digest, self._written_version(key))

    def stage_file(
        self, key: str, src: Path, *, immutable: bool = False, progress: Progress = None
    ) -> Staged:
        """Start writing `src` toward `key` without making it visible (see `Staged`)."""
        return self._stage_file(check_key(key), Path(src), immutable, progress)

    def adopt_file(
        self, key: str, src: Path, *, size: int, sha256: str, immutable: bool = False
    ) -> Staged:
        """Stage a file this process wrote itself and already hashed (`reg server`'s received
        uploads), giving it up: a store on the same filesystem takes the file as it is (no
        copy); any other copies it, and a copy whose digest differs is refused."""
        check_key(key)
        staged = self.stage_file(key, Path(src), immutable=immutable)
        if staged.digest() != (size, sha256):
            staged.discard()
            raise IntegrityError(f"{src} changed before it was stored", "push again")
        return staged

    def put_bytes(self, key: str, data: bytes, *, immutable: bool = False) -> PutResult:
        size, digest = self._put_bytes(check_key(key), bytes(data), immutable)
        return PutResult(key, size, digest, self._written_version(key))

    def put_stream(self, key: str, produce: Producer, *, immutable: bool = False) -> PutResult:
        """Write what `produce(write)` writes, hashing it; put-if-absent like `put_file`."""
        size, digest = self._put_stream(check_key(key), produce, immutable)
        return PutResult(key, size, digest, self._written_version(key))

    # -- reads ----------------------------------------------------------------------------------
    # Reads take the `version` a manifest recorded: on a versioned bucket they read that
    # version, not whatever was put under the key since; stores without versions ignore it.
    def head(self, key: str, *, version: str | None = None) -> ObjectInfo | None:
        return self._head(check_key(key), version)

    def read_range(
        self, key: str, offset: int, length: int, *, version: str | None = None
    ) -> bytes:
        """Exactly `length` bytes from `offset` (a writable buffer, so tensors can be made from
        it without a copy); a short object is an IntegrityError."""
        if offset < 0 or length < 0:
            raise UsageError(f"bad range of {key}: offset {offset}, length {length}")
        if length == 0:
            return b""
        data = self._read_range(check_key(key), offset, length, version)
        if len(data) != length:
            raise IntegrityError(
                f"object {key} is truncated: wanted bytes {offset}..{offset + length}, "
                f"it has {offset + len(data)}",
                "run `reg verify` on the checkpoint",
            )
        return data

    def stream(self, key: str, *, version: str | None = None) -> Iterator[bytes]:
        """The object's bytes in order, in pieces of at most CHUNK (NotFound if missing)."""
        return self._stream(check_key(key), version)

    def get_bytes(self, key: str, *, version: str | None = None) -> bytes:
        return b"".join(self.stream(key, version=version))

    def get_file(
        self, key: str, dest: Path, *, progress: Progress = None, version: str | None = None
    ) -> PutResult:
        """Write the object to the new file `dest` (fsynced), returning its size and sha256.
        On failure `dest` is removed again; a full disk is a one-line error naming `dest`."""
        dest = Path(dest)
        existed = os.path.lexists(dest)
        try:
            size, digest = self._get_file(check_key(key), dest, progress, version)
        except BaseException as exc:
            if not existed:
                with contextlib.suppress(OSError):
                    os.unlink(dest)
            if isinstance(exc, OSError) and exc.errno in DISK_FULL:
                raise disk_full(dest.absolute(), exc) from exc
            raise
        return PutResult(key, size, digest, version)

    def sha256(self, key: str, *, progress: Progress = None, version: str | None = None) -> str:
        """Re-hash the stored bytes (a scrub reads every byte)."""
        digest = hashlib.sha256()
        for piece in self.stream(key, version=version):
            digest.update(piece)
            if progress:
                progress(len(piece))
        return digest.hexdigest()

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        """Objects whose key starts with `prefix`, in key order."""
        return self._list(check_prefix(prefix))

    def describe(self, key: str) -> str:
        """A URI a person or another tool can use for `key` (or a prefix ending in `/`)."""
        return self._describe(check_prefix(key))

    # -- deletes --------------------------------------------------------------------------------
    def delete(self, key: str) -> int:
        """Delete the object (every version where versioned). Return the bytes freed."""
        check_deletable(check_key(key))
        return self._delete(key)

    def delete_many(self, keys: Sequence[str]) -> tuple[int, dict[str, str]]:
        """Delete objects in batches (every version where versioned): (bytes freed, errors by
        key). All keys are checked before any is deleted; a failed key never stops the others."""
        for key in keys:
            check_deletable(check_key(key))
        return self._delete_many(list(keys))

    # -- optional capabilities ------------------------------------------------------------------
    def init(self) -> dict[str, Any]:
        """Check the store and set what it needs (`reg storage init`)."""
        return {"store": self.url, "note": "nothing to configure"}

    def lock_compliance(self, key: str, version: str | None) -> str | None:
        """Put a COMPLIANCE retention on `key` (that `version` of it, on a versioned bucket)
        where the backend has Object Lock: what the lock is, or None where it has none."""
        return None

    def open_writer(self, key: str) -> ObjectWriter | None:
        """A writer the caller pushes bytes into from its own thread (hashed as written,
        invisible until `publish()`), where the backend has one; None: use `put_stream`."""
        return None

    def sweep_incomplete(
        self, prefix: str, older_than: float, *, skip: Callable[[str], bool] | None = None
    ) -> builtins.list[Swept]:
        """Remove what writers that crashed left under `prefix` (temp files, multipart uploads)
        more than `older_than` seconds ago, except where `skip(key)` says a writer still holds
        the key. Committed objects are never touched."""
        return []

    # -- backend hooks --------------------------------------------------------------------------
    @abstractmethod
    def _put_stream(self, key: str, produce: Producer, immutable: bool) -> tuple[int, str]: ...

    def _put_file(
        self, key: str, src: Path, immutable: bool, progress: Progress
    ) -> tuple[int, str]:
        def produce(write: Write) -> None:
            with open(src, "rb") as f:
                while piece := f.read(CHUNK):
                    write(piece)
                    if progress:
                        progress(len(piece))

        return self._put_stream(key, produce, immutable)

    def _put_bytes(self, key: str, data: bytes, immutable: bool) -> tuple[int, str]:
        return self._put_stream(key, lambda write: write(data), immutable)

    def _stage_file(self, key: str, src: Path, immutable: bool, progress: Progress) -> Staged:
        return _DeferredFile(self, key, src, immutable, progress)

    def restore_version(self, key: str, version: str, *, immutable: bool = False) -> None:
        """Make `version` of `key` its current content again (a copy of the old version on top
        of whatever is there, a delete marker included). Versioned buckets only."""
        raise UsageError(
            f"{self.url} keeps no object versions, so {key} cannot be restored from one",
            "restore the file from a backup; on S3, enable versioning (and Object Lock)",
        )

    def _written_version(self, key: str) -> str | None:
        """The version this process's last put of `key` created (versioned buckets only)."""
        return None

    @abstractmethod
    def _head(self, key: str, version: str | None) -> ObjectInfo | None: ...

    @abstractmethod
    def _read_range(self, key: str, offset: int, length: int, version: str | None) -> bytes: ...

    @abstractmethod
    def _stream(self, key: str, version: str | None) -> Iterator[bytes]: ...

    def _get_file(
        self, key: str, dest: Path, progress: Progress, version: str | None
    ) -> tuple[int, str]:
        digest, size = hashlib.sha256(), 0
        fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            for piece in self._stream(key, version):
                digest.update(piece)
                write_all(fd, memoryview(piece))
                faults.point("pull-write", dest)
                size += len(piece)
                if progress:
                    progress(len(piece))
            os.fsync(fd)
        finally:
            os.close(fd)
        return size, digest.hexdigest()

    @abstractmethod
    def _list(self, prefix: str) -> Iterator[ObjectInfo]: ...

    @abstractmethod
    def _describe(self, key: str) -> str: ...

    @abstractmethod
    def _delete(self, key: str) -> int: ...

    def _delete_many(self, keys: builtins.list[str]) -> tuple[int, dict[str, str]]:
        freed, errors = 0, {}
        for key in keys:
            try:
                freed += self._delete(key)
            except (OSError, RegistryError) as exc:
                errors[key] = str(exc)
        return freed, errors


DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def disk_full(path: Path, exc: OSError) -> RegistryError:
    """A full disk (or quota) while writing `path`, as one line (exit 1)."""
    what = "disk quota exceeded" if exc.errno == errno.EDQUOT else "disk full"
    return RegistryError(
        f"{what}: no space left on the device writing {path}",
        "free space there and retry; nothing partial was kept",
    )


def write_all(fd: int, view: memoryview) -> None:
    written = 0
    while written < len(view):
        written += os.write(fd, view[written:])


def hash_file(path: Path) -> tuple[int, str]:
    """(size, sha256) of a local file."""
    with open(path, "rb") as f:
        return hash_stream(f)


def hash_stream(stream: Any, progress: Progress = None) -> tuple[int, str]:
    """(size, sha256) of a readable binary stream, read in CHUNK pieces."""
    digest = hashlib.sha256()
    size = 0
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    while n := stream.readinto(view):
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
