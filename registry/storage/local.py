"""The local filesystem store: the embedded default.

A write goes to a file with no name yet (`O_TMPFILE` on the store's filesystem), is fsynced, then
`link()`ed to its final name: link fails if the name exists, so an object is never replaced
(put-if-absent), a reader never sees a partial object, and a writer that dies leaves nothing
behind (the kernel frees an unnamed file). The directory is fsynced after the link so the name
is durable.

Where the filesystem has no `O_TMPFILE`, the temp file is named under `<root>/.tmp/`, a
namespace no key can enter (keys never start with `.`), and held with `flock` while it is
written; `sweep_incomplete` removes the ones whose writer is gone.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import fcntl
import hashlib
import io
import mmap
import os
import stat
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from registry.core import faults
from registry.errors import IntegrityError, NotFound, ObjectExists
from registry.storage.base import (
    CHUNK,
    DISK_FULL,
    BaseStore,
    HashingSink,
    ObjectInfo,
    ObjectWriter,
    Producer,
    Progress,
    PutResult,
    Staged,
    Swept,
    check_key,
    disk_full,
    write_all,
)

TEMP_DIR = ".tmp"
# Modes of what the store writes: readable by the owner and the store root's group, never by
# others, and never looser than a source file (a 0600 checkpoint file stays 0600).
CHECKPOINT_MODE, RELEASE_MODE, DIR_MODE = 0o640, 0o440, 0o750


def _is_release(root: Path, directory: str) -> bool:
    return os.path.relpath(directory, root).split(os.sep, 1)[0] == "release"


def _file_mode(immutable: bool, source_mode: int | None) -> int:
    mode = RELEASE_MODE if immutable else CHECKPOINT_MODE
    if source_mode is not None:
        mode &= stat.S_IMODE(source_mode) | stat.S_IRUSR | stat.S_IWUSR
    return mode


_TEMP_SEPARATOR = "~"  # never in a key segment, so a temp name gives its key back


class LocalStore(BaseStore):
    def __init__(self, root: Path) -> None:
        self.root = Path(root).absolute()
        self.url = self.root.as_uri()
        # O_TMPFILE (named through /proc) until the filesystem says otherwise.
        self._tmpfile = os.path.isdir("/proc/self/fd")

    def _path(self, key: str) -> Path:
        return self.root / key

    def _describe(self, key: str) -> str:
        if key.endswith("/"):
            return self._path(key.rstrip("/")).as_uri() + "/"
        return self._path(key).as_uri() if key else self.url + "/"

    # -- writes --------------------------------------------------------------------------------
    def _stage_file(self, key: str, src: Path, immutable: bool, progress: Progress) -> _LocalStaged:
        source_mode = os.stat(src).st_mode
        return self._stage(
            key,
            lambda fd: _copy_path_hashing(src, fd, progress, direct=True),
            immutable,
            source_mode,
        )

    def adopt_file(
        self, key: str, src: Path, *, size: int, sha256: str, immutable: bool = False
    ) -> Staged:
        """On the store's filesystem the file itself becomes the object: made durable, given
        the store's mode, then linked to its key at publish (put-if-absent, as any staged
        write) and its old name removed. Elsewhere: copied like any file."""
        check_key(key)
        fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            self.root.mkdir(parents=True, exist_ok=True)
            if st.st_dev != os.stat(self.root).st_dev or st.st_nlink != 1:
                os.close(fd)
                return super().adopt_file(key, src, size=size, sha256=sha256, immutable=immutable)
            if st.st_size != size:
                raise IntegrityError(f"{src} changed before it was stored", "push again")
            os.fsync(fd)
            self._set_owner(fd, _file_mode(immutable, st.st_mode))
        except BaseException:
            with contextlib.suppress(OSError):
                os.close(fd)
            raise
        return _LocalStaged(self, key, fd, str(src), size, sha256)

    def _put_file(
        self, key: str, src: Path, immutable: bool, progress: Progress
    ) -> tuple[int, str]:
        return self._put(
            key, lambda fd: _copy_path_hashing(src, fd, progress, direct=True), immutable
        )

    def _put_bytes(self, key: str, data: bytes, immutable: bool) -> tuple[int, str]:
        return self._put(key, lambda fd: _copy_stream_hashing(io.BytesIO(data), fd), immutable)

    def _put_stream(self, key: str, produce: Producer, immutable: bool) -> tuple[int, str]:
        return self._put(key, lambda fd: _write_produced(fd, produce), immutable)

    def _put(
        self, key: str, write: Callable[[int], tuple[int, str]], immutable: bool
    ) -> tuple[int, str]:
        if os.path.lexists(self._path(key)):
            raise ObjectExists(key)
        with self._stage(key, write, immutable) as staged:
            done = staged.publish()
        return done.size, done.sha256

    def _stage(
        self,
        key: str,
        write: Callable[[int], tuple[int, str]],
        immutable: bool,
        source_mode: int | None = None,
    ) -> _LocalStaged:
        """Write into a file no reader can see yet, fsynced, hashed, with the store's modes."""
        fd, temp = self._open_temp(key)
        try:
            size, digest = write(fd)
            faults.point("store-write", key)
            os.fsync(fd)  # a full disk often shows only here (delayed allocation)
            self._set_owner(fd, _file_mode(immutable, source_mode))
        except BaseException as exc:
            _close_temp(fd, temp)
            if isinstance(exc, OSError) and exc.errno in DISK_FULL:
                raise disk_full(self._path(key), exc) from exc
            raise
        return _LocalStaged(self, key, fd, temp, size, digest)

    def _set_owner(self, fd: int, mode: int) -> None:
        """The object's mode, and the store root's group where the writer may give it."""
        os.fchmod(fd, mode)
        with contextlib.suppress(OSError):
            os.fchown(fd, -1, os.stat(self.root).st_gid)

    def _make_dirs(self, directory: Path) -> None:
        """Create `directory` and its missing parents under the root: 0750, the root's group."""
        missing = []
        while not directory.is_dir():
            missing.append(directory)
            directory = directory.parent
        for d in reversed(missing):
            with contextlib.suppress(FileExistsError):
                os.mkdir(d, DIR_MODE)
                fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
                try:
                    self._set_owner(fd, DIR_MODE)
                finally:
                    os.close(fd)

    def _open_temp(self, key: str) -> tuple[int, str | None]:
        """An unnamed file on the store's filesystem (None for its name), or, where the
        filesystem has no O_TMPFILE, a named one under .tmp/, locked while its writer lives."""
        if self._tmpfile:
            self.root.mkdir(parents=True, exist_ok=True)
            try:
                return os.open(self.root, os.O_TMPFILE | os.O_WRONLY, 0o600), None
            except OSError as exc:
                if exc.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
                    raise
                self._tmpfile = False
        temp = self.root / TEMP_DIR / f"{key}{_TEMP_SEPARATOR}{uuid.uuid4().hex[:12]}"
        temp.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        return fd, str(temp)

    def open_writer(self, key: str) -> _LocalWriter:
        if os.path.lexists(self._path(check_key(key))):
            raise ObjectExists(key)
        fd, temp = self._open_temp(key)
        return _LocalWriter(self, key, fd, temp)

    def sweep_incomplete(
        self, prefix: str, older_than: float, *, skip: Callable[[str], bool] | None = None
    ) -> builtins.list[Swept]:
        start = self.root / TEMP_DIR
        cutoff = time.time() - older_than
        swept: builtins.list[Swept] = []
        for dirpath, _, filenames in os.walk(start):
            for name in filenames:
                path = os.path.join(dirpath, name)
                key = os.path.relpath(path, start).rpartition(_TEMP_SEPARATOR)[0]
                if not key.startswith(prefix) or (skip is not None and skip(key)):
                    continue
                removed = _remove_if_abandoned(path, cutoff)
                if removed is not None:
                    swept.append(Swept(f"temp file {path}", key, removed))
        return swept

    # -- reads ---------------------------------------------------------------------------------
    def _open(self, key: str) -> int:
        try:
            return os.open(self._path(key), os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            raise NotFound(f"object {key} is missing from the store") from None

    def _stream(self, key: str, version: str | None) -> Iterator[bytes]:
        fd = self._open(key)

        def pieces() -> Iterator[bytes]:
            try:
                while piece := os.read(fd, CHUNK):
                    yield piece
            finally:
                os.close(fd)

        return pieces()

    def _get_file(
        self, key: str, dest: Path, progress: Progress, version: str | None
    ) -> tuple[int, str]:
        fd_in = self._open(key)
        os.close(fd_in)  # NotFound before the destination is created
        fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            size, digest = _copy_path_hashing(self._path(key), fd, progress)
            faults.point("pull-write", dest)
        finally:
            os.close(fd)
        return size, digest

    def _read_range(self, key: str, offset: int, length: int, version: str | None) -> bytes:
        # Into a writable buffer, read once: tensors are made straight from it (no copy).
        data = bytearray(length)
        fd = self._open(key)
        try:
            got = os.preadv(fd, [data], offset)
        finally:
            os.close(fd)
        return data if got == length else data[:got]  # type: ignore[return-value]

    def _head(self, key: str, version: str | None) -> ObjectInfo | None:
        try:
            st = os.stat(self._path(key), follow_symlinks=False)
        except FileNotFoundError:
            return None
        return ObjectInfo(key, st.st_size) if stat.S_ISREG(st.st_mode) else None

    def _list(self, prefix: str) -> Iterator[ObjectInfo]:
        # The prefix may end mid-segment ("ckpt/p/run4" matches run4 and run42).
        base, _, _ = prefix.rpartition("/")
        start = self.root / base if base else self.root
        if not start.is_dir():
            return
        found: list[ObjectInfo] = []
        for dirpath, dirnames, filenames in os.walk(start):
            if dirpath == str(self.root):
                dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            rel_dir = os.path.relpath(dirpath, self.root)
            for name in filenames:
                key = name if rel_dir == "." else f"{rel_dir}/{name}"
                if key.startswith(prefix) and not key.startswith("."):
                    found.append(ObjectInfo(key, os.stat(os.path.join(dirpath, name)).st_size))
        yield from sorted(found, key=lambda o: o.key)

    # -- deletes -------------------------------------------------------------------------------
    def _delete(self, key: str) -> int:
        path = self._path(key)
        try:
            size = path.stat().st_size
            path.unlink()
        except FileNotFoundError:
            return 0
        _prune_empty_dirs(path.parent, self.root)
        return size

    # -- store --------------------------------------------------------------------------------
    def init(self) -> dict[str, object]:
        """Create the root; bring objects an older reg wrote (0644 files, 0755 directories) to
        the store's modes, never loosening one."""
        self.root.mkdir(parents=True, exist_ok=True)
        tightened = 0
        for dirpath, dirnames, filenames in os.walk(self.root):
            dirnames[:] = [d for d in dirnames if not (dirpath == str(self.root) and d == TEMP_DIR)]
            for name, limit in [(d, DIR_MODE) for d in dirnames] + [
                (f, RELEASE_MODE if _is_release(self.root, dirpath) else CHECKPOINT_MODE)
                for f in filenames
            ]:
                path = os.path.join(dirpath, name)
                st = os.lstat(path)
                if stat.S_ISLNK(st.st_mode):
                    continue
                mode = stat.S_IMODE(st.st_mode)
                if mode & ~limit:
                    os.chmod(path, mode & limit)
                    tightened += 1
        return {
            "store": self.url,
            "kind": "local filesystem",
            "note": "objects are put-if-absent via link()",
            "modes_tightened": tightened,
        }


class _LocalStaged(Staged):
    """A written, fsynced file with no name yet (or a locked temp name); `publish` links it to
    its key: link() fails if the name exists, so an object is never replaced."""

    def __init__(
        self, store: LocalStore, key: str, fd: int, temp: str | None, size: int, digest: str
    ) -> None:
        super().__init__(key)
        self._store, self._fd, self._temp = store, fd, temp
        self._digest = (size, digest)
        self._open = True

    def digest(self) -> tuple[int, str]:
        return self._digest

    def publish(self) -> PutResult:
        final = self._store._path(self.key)
        faults.point("store-publish", final)
        self._store._make_dirs(final.parent)
        dir_fd = os.open(final.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            # An unnamed file gets its name through /proc (linkat with AT_SYMLINK_FOLLOW, which
            # os.link passes only when a dir_fd is given).
            source = self._temp or f"/proc/self/fd/{self._fd}"
            try:
                os.link(source, final.name, dst_dir_fd=dir_fd, follow_symlinks=self._temp is None)
            except FileExistsError:
                raise ObjectExists(self.key) from None
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        return PutResult(self.key, *self._digest)

    def discard(self) -> None:
        if self._open:
            self._open = False
            _close_temp(self._fd, self._temp)


OVERLAP = 4 << 20  # writes from this size are hashed while they are written
_HASHER = ThreadPoolExecutor(max_workers=2, thread_name_prefix="reg-hash")


class _LocalWriter(ObjectWriter):
    """Written and hashed in the caller's thread into an unnamed file, as DCP's own file
    writer writes (no copy, no hand-off); `publish` fsyncs and links it like a staged file."""

    def __init__(self, store: LocalStore, key: str, fd: int, temp: str | None) -> None:
        self.key = key
        self._store, self._fd, self._temp = store, fd, temp
        self._hash = hashlib.sha256()
        self._size = 0
        self._open = True

    def write(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        # A large write is hashed on a second thread while this one writes it (both release
        # the GIL); the call returns only once both are done with the caller's memory.
        hashing = _HASHER.submit(self._hash.update, view) if len(view) >= OVERLAP else None
        if hashing is None:
            self._hash.update(view)
        try:
            write_all(self._fd, view)
            faults.point("store-write", self.key)
        except OSError as exc:
            if exc.errno in DISK_FULL:
                raise disk_full(self._store._path(self.key), exc) from exc
            raise
        finally:
            if hashing is not None:
                hashing.result()
        self._size += len(view)

    def publish(self) -> PutResult:
        try:
            os.fsync(self._fd)
        except OSError as exc:
            if exc.errno in DISK_FULL:
                raise disk_full(self._store._path(self.key), exc) from exc
            raise
        self._store._set_owner(self._fd, _file_mode(False, None))
        self._open = False
        staged = _LocalStaged(
            self._store, self.key, self._fd, self._temp, self._size, self._hash.hexdigest()
        )
        try:
            return staged.publish()
        finally:
            staged.discard()

    def discard(self) -> None:
        if self._open:
            self._open = False
            _close_temp(self._fd, self._temp)


def _close_temp(fd: int, temp: str | None) -> None:
    if temp is not None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
    os.close(fd)


def _remove_if_abandoned(path: str, cutoff: float) -> int | None:
    """Remove a temp file older than `cutoff` unless its writer still holds its lock."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    try:
        st = os.fstat(fd)
        if st.st_mtime >= cutoff:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return None  # a live writer
        os.unlink(path)
        return st.st_size
    finally:
        os.close(fd)


def _write_produced(fd: int, produce: Producer) -> tuple[int, str]:
    sink = HashingSink(lambda view: write_all(fd, view))
    try:
        produce(sink.write)
    finally:
        size, digest = sink.close()
    return size, digest


def _copy_path_hashing(
    src: Path, fd_out: int, progress: Progress, *, direct: bool = False
) -> tuple[int, str]:
    """Copy file to file while a second thread hashes the source through mmap, then fsync: no
    byte passes through Python buffers, and a source that changes meanwhile is refused, so the
    digest is that of the copy.

    `direct` (the store's own writes) writes the mapped source with O_DIRECT: the disk reads
    the source's page-cache pages itself, so the cores are left to the hash, nothing waits for
    writeback at fsync, and the store's copy does not push a training job's pages out of the
    cache. Otherwise (a pull, whose copy is read next) the kernel copies (copy_file_range)."""
    fd_in = os.open(src, os.O_RDONLY)
    try:
        before = os.fstat(fd_in)
        size = before.st_size
        digest = hashlib.sha256()
        if size == 0:
            os.fsync(fd_out)
            return 0, digest.hexdigest()
        failure: list[BaseException] = []
        with mmap.mmap(fd_in, size, prot=mmap.PROT_READ) as mapped:
            mapped.madvise(mmap.MADV_SEQUENTIAL)
            view = memoryview(mapped)

            def hash_source() -> None:
                try:
                    for offset in range(0, size, CHUNK):
                        with view[offset : offset + CHUNK] as chunk:
                            digest.update(chunk)  # releases the GIL
                            n = len(chunk)
                        if progress:
                            progress(n)
                except BaseException as exc:  # re-raised in the caller
                    failure.append(exc)

            hasher = threading.Thread(target=hash_source, name="reg-hash")
            hasher.start()
            try:
                if direct:
                    _direct_copy(view, fd_out, size)
                else:
                    _kernel_copy(fd_in, fd_out, size)
                os.fsync(fd_out)  # while the hash thread finishes: the two overlap
            finally:
                hasher.join()
                view.release()
        if failure:
            raise failure[0]
        after = os.fstat(fd_in)
        if (after.st_size, after.st_mtime_ns) != (size, before.st_mtime_ns):
            raise IntegrityError(
                f"{src} changed while being copied",
                "copy a checkpoint that is no longer being written",
            )
        return size, digest.hexdigest()
    finally:
        os.close(fd_in)


DIRECT_ALIGN = 4096  # O_DIRECT offsets and lengths: a multiple of the disk's logical block


def _direct_copy(view: memoryview, fd_out: int, size: int) -> None:
    """Write the mapped source with O_DIRECT, CHUNK at a time, and the unaligned tail (or all
    of it, where the filesystem refuses O_DIRECT: tmpfs on older kernels) through the cache."""
    flags = fcntl.fcntl(fd_out, fcntl.F_GETFL)
    aligned = size - size % DIRECT_ALIGN
    offset = 0
    try:
        fcntl.fcntl(fd_out, fcntl.F_SETFL, flags | os.O_DIRECT)
    except OSError:
        aligned = 0
    try:
        while offset < aligned:
            with view[offset : min(offset + CHUNK, aligned)] as piece:
                try:
                    n = os.pwrite(fd_out, piece, offset)
                except OSError as exc:
                    if exc.errno != errno.EINVAL:
                        raise _source_gone(exc) from exc
                    break  # another alignment wanted: the cache from here
            offset += n
            if n % DIRECT_ALIGN:
                break
    finally:
        fcntl.fcntl(fd_out, fcntl.F_SETFL, flags)
    while offset < size:
        with view[offset:size] as rest:
            try:
                offset += os.pwrite(fd_out, rest, offset)
            except OSError as exc:
                raise _source_gone(exc) from exc


def _source_gone(exc: OSError) -> Exception:
    """EFAULT from a write out of the mapped source: the file shrank under the copy."""
    if exc.errno != errno.EFAULT:
        return exc
    return IntegrityError(
        "source file shrank while being copied",
        "copy a checkpoint that is no longer being written",
    )


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


def _copy_stream_hashing(source: io.BytesIO, fd: int) -> tuple[int, str]:
    digest = hashlib.sha256()
    size = 0
    while piece := source.read(CHUNK):
        digest.update(piece)
        write_all(fd, memoryview(piece))
        size += len(piece)
    return size, digest.hexdigest()


def _prune_empty_dirs(path: Path, root: Path) -> None:
    while path != root and root in path.parents:
        try:
            path.rmdir()
        except OSError:
            return
        path = path.parent
