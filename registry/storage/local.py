"""The local filesystem store: the embedded default.

A write goes to a temp name in the target directory, is fsynced, then `link()`ed to its final
name: link fails if the name exists, so an object is never replaced (put-if-absent), and a reader
never sees a partial object. The directory is fsynced after the link so the name is durable.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import mmap
import os
import stat
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import BinaryIO

from registry.errors import IntegrityError, NotFound, ObjectExists, RegistryError
from registry.storage.base import (
    CHUNK,
    HashingSink,
    ObjectInfo,
    Producer,
    Progress,
    PutResult,
    check_deletable,
    check_key,
    hash_stream,
)

TEMP_MARK = ".tmp-"


class LocalStore:
    def __init__(self, root: Path) -> None:
        self.root = Path(root).absolute()
        self.url = self.root.as_uri()

    # -- paths -------------------------------------------------------------------------------
    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def describe(self, key: str) -> str:
        if key.endswith("/"):
            return self._path(key.rstrip("/")).as_uri() + "/"
        return self._path(key).as_uri()

    # -- writes ------------------------------------------------------------------------------
    def put_file(
        self, key: str, src: Path, *, immutable: bool = False, progress: Progress = None
    ) -> PutResult:
        return self._put(key, lambda temp: _copy_path_hashing(Path(src), temp, progress), immutable)

    def put_bytes(self, key: str, data: bytes, *, immutable: bool = False) -> PutResult:
        import io

        return self._put(key, lambda temp: _copy_hashing(io.BytesIO(data), temp, None), immutable)

    def put_stream(self, key: str, produce: Producer, *, immutable: bool = False) -> PutResult:
        return self._put(key, lambda temp: _write_produced(temp, produce), immutable)

    def _put(
        self, key: str, write: Callable[[Path], tuple[int, str]], immutable: bool
    ) -> PutResult:
        final = self._path(key)
        if final.exists():
            raise ObjectExists(key)
        final.parent.mkdir(parents=True, exist_ok=True)
        temp = final.with_name(f".{final.name}{TEMP_MARK}{uuid.uuid4().hex[:12]}")
        try:
            size, digest = write(temp)
            if immutable:
                os.chmod(temp, stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH)
            try:
                os.link(temp, final)
            except FileExistsError:
                raise ObjectExists(key) from None
            _fsync_dir(final.parent)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp)
        return PutResult(key, size, digest)

    # -- reads -------------------------------------------------------------------------------
    def open_read(self, key: str) -> BinaryIO:
        try:
            return open(self._path(key), "rb")
        except FileNotFoundError:
            raise NotFound(f"object {key} is missing from the store") from None

    def get_file(self, key: str, dest: Path, *, progress: Progress = None) -> PutResult:
        try:
            size, digest = _copy_path_hashing(self._path(key), dest, progress)
        except FileNotFoundError:
            raise NotFound(f"object {key} is missing from the store") from None
        return PutResult(key, size, digest)

    def get_bytes(self, key: str) -> bytes:
        with self.open_read(key) as f:
            return f.read()

    def read_range(self, key: str, offset: int, length: int) -> bytes:
        # Into a writable buffer, read once: tensors are made straight from it (no copy).
        data = bytearray(length)
        with self.open_read(key) as f:
            got = os.preadv(f.fileno(), [data], offset) if length else 0
        if got != length:
            raise IntegrityError(
                f"object {key} is truncated: wanted bytes {offset}..{offset + length}, "
                f"it has {offset + got}",
                "run `reg verify` on the checkpoint",
            )
        return data  # type: ignore[return-value]  # a bytearray: bytes-like and writable

    def head(self, key: str) -> ObjectInfo | None:
        try:
            st = os.stat(self._path(key))
        except FileNotFoundError:
            return None
        return ObjectInfo(key, st.st_size)

    def sha256(self, key: str, *, progress: Progress = None) -> str:
        with self.open_read(key) as f:
            return hash_stream(f, progress)[1]

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        # The prefix may end mid-segment ("ckpt/p/run4" matches run4 and run42).
        base, _, _ = prefix.rpartition("/")
        start = self.root / base if base else self.root
        if not start.is_dir():
            return
        found: list[ObjectInfo] = []
        for dirpath, dirnames, filenames in os.walk(start):
            dirnames.sort()
            rel_dir = os.path.relpath(dirpath, self.root)
            for name in filenames:
                if TEMP_MARK in name:
                    continue
                key = name if rel_dir == "." else f"{rel_dir}/{name}"
                if key.startswith(prefix):
                    found.append(ObjectInfo(key, os.stat(os.path.join(dirpath, name)).st_size))
        yield from sorted(found, key=lambda o: o.key)

    def list_temp(self, prefix: str) -> Iterator[tuple[Path, float]]:
        """Leftover temp files of crashed writes (for the orphan sweep)."""
        start = self.root / prefix
        if start.is_dir():
            for dirpath, _, filenames in os.walk(start):
                for name in filenames:
                    if TEMP_MARK in name:
                        p = Path(dirpath) / name
                        with contextlib.suppress(FileNotFoundError):
                            yield p, p.stat().st_mtime

    # -- deletes -----------------------------------------------------------------------------
    def delete_many(self, keys: Sequence[str]) -> tuple[int, dict[str, str]]:
        for key in keys:  # all refused before any is deleted, as on S3
            check_deletable(key)
        freed, errors = 0, {}
        for key in keys:
            try:
                freed += self.delete(key)
            except (OSError, RegistryError) as exc:
                errors[key] = str(exc)
        return freed, errors

    def delete(self, key: str) -> int:
        check_deletable(key)
        path = self._path(key)
        try:
            size = path.stat().st_size
            path.unlink()
        except FileNotFoundError:
            return 0
        _prune_empty_dirs(path.parent, self.root)
        return size


def _write_produced(dest: Path, produce: Producer) -> tuple[int, str]:
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:

        def write_all(view: memoryview) -> None:
            written = 0
            while written < len(view):
                written += os.write(fd, view[written:])

        sink = HashingSink(write_all)
        try:
            produce(sink.write)
        finally:
            size, digest = sink.close()
        os.fsync(fd)
    finally:
        os.close(fd)
    return size, digest


def _copy_path_hashing(src: Path, dest: Path, progress: Progress) -> tuple[int, str]:
    """Copy file to file in the kernel (copy_file_range) while a second thread hashes the source
    through mmap: no byte passes through Python buffers. Both read the same page-cache pages,
    and a source that changes meanwhile is refused, so the digest is that of the copy."""
    fd_in = os.open(src, os.O_RDONLY)
    try:
        before = os.fstat(fd_in)
        size = before.st_size
        digest = hashlib.sha256()
        failure: list[BaseException] = []

        def hash_source() -> None:
            try:
                with mmap.mmap(fd_in, size, prot=mmap.PROT_READ) as mapped:
                    mapped.madvise(mmap.MADV_SEQUENTIAL)
                    view = memoryview(mapped)
                    try:
                        for offset in range(0, size, CHUNK):
                            with view[offset : offset + CHUNK] as chunk:
                                digest.update(chunk)  # releases the GIL
                                n = len(chunk)
                            if progress:
                                progress(n)
                    finally:
                        view.release()
            except BaseException as exc:  # re-raised in the caller
                failure.append(exc)

        hasher = threading.Thread(target=hash_source, name="reg-hash") if size else None
        if hasher:
            hasher.start()
        try:
            fd_out = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                _kernel_copy(fd_in, fd_out, size)
                os.fsync(fd_out)
            finally:
                os.close(fd_out)
        finally:
            if hasher:
                hasher.join()
        if failure:
            raise failure[0]
        after = os.fstat(fd_in)
        if (after.st_size, after.st_mtime_ns) != (size, before.st_mtime_ns):
            raise IntegrityError(
                f"{src} changed while being copied",
                "copy a checkpoint that is no longer being written",
            )
        return size, digest.hexdigest()
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise RegistryError(f"no space left writing {dest}", "free space and retry") from exc
        raise
    finally:
        os.close(fd_in)


def _kernel_copy(fd_in: int, fd_out: int, size: int) -> None:
    offset = 0
    while offset < size:
        try:
            n = os.copy_file_range(fd_in, fd_out, min(size - offset, 1 << 30), offset, offset)
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
                raise
            n = os.sendfile(fd_out, fd_in, offset, min(size - offset, 1 << 30))
        if n == 0:
            raise IntegrityError(
                "source file shrank while being copied",
                "copy a checkpoint that is no longer being written",
            )
        offset += n


def _copy_hashing(source: BinaryIO, dest: Path, progress: Progress) -> tuple[int, str]:
    """Copy `source` into a new file `dest` while hashing; fsync before returning."""
    digest = hashlib.sha256()
    size = 0
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        while n := source.readinto(view):  # type: ignore[attr-defined]
            chunk = view[:n]
            digest.update(chunk)  # releases the GIL: other files copy meanwhile
            written = 0
            while written < n:
                written += os.write(fd, chunk[written:])
            size += n
            if progress:
                progress(n)
        os.fsync(fd)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise RegistryError(f"no space left writing {dest}", "free space and retry") from exc
        raise
    finally:
        os.close(fd)
    return size, digest.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _prune_empty_dirs(path: Path, root: Path) -> None:
    while path != root and root in path.parents:
        try:
            path.rmdir()
        except OSError:
            return
        path = path.parent
