"""A push's bytes, received: the stream of `registry.api.remote.push_stream`. The server
writes the files into a private directory, hashing each as it lands and stopping at its declared
size, then pushes that directory with the same code as the embedded mode: it scans and
inventories `.metadata` itself, so nothing the client says about the checkpoint's content is
taken on trust. A file whose bytes do not match the client's digest was damaged in transit or
changed while being sent: refused, named.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import queue
import shutil
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from policies.layouts import check_layout
from registry.api.remote.push_stream import DIGEST
from registry.errors import IntegrityError, RegistryError, UsageError

MAX_HEADER = 16 << 20
MAX_FILES = 100_000
MAX_FILE_SIZE = 1 << 50
MAX_PATH = 1024
MAX_DEPTH = 32  # path segments; a DCP checkpoint is flat, HF-style ones a level or two
MAX_SEGMENT = 255  # bytes of one path segment: NAME_MAX of every common filesystem
MAX_DIRECTORIES = 10_000
WRITEBACK_EVERY = 64 << 20


@dataclass(frozen=True, slots=True)
class Declared:
    path: str
    size: int


@dataclass
class PushRequest:
    project: str
    run: str
    step: int
    world_size: int | None
    metrics: dict[str, float]
    files: list[Declared]
    layout: str | None = None

    @property
    def total(self) -> int:
        """Bytes that follow the header: every file and its digest."""
        return sum(f.size + DIGEST for f in self.files)


def parse_header(data: bytes) -> PushRequest:
    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UsageError(f"push header is not JSON: {exc}", "use reg push-ckpt") from None
    except RecursionError:
        raise UsageError("push header is nested too deeply", "use reg push-ckpt") from None
    if not isinstance(doc, dict):
        raise UsageError("push header is not a JSON object", "use reg push-ckpt")
    files = doc.get("files")
    if not isinstance(files, list) or not files or len(files) > MAX_FILES:
        raise UsageError(f"push header: files must be a list of 1 to {MAX_FILES} entries")
    declared = [_declared(f) for f in files]
    _check_tree([d.path for d in declared])
    step, world = doc.get("step"), doc.get("world_size")
    metrics = doc.get("metrics") or {}
    if not isinstance(metrics, dict):
        raise UsageError("push header: metrics must be an object of numbers")
    return PushRequest(
        project=_text(doc.get("project"), "project"),
        run=_text(doc.get("run"), "run"),
        step=step if isinstance(step, int) and not isinstance(step, bool) else -1,
        world_size=world if world is None or isinstance(world, int) else -1,
        metrics=metrics,
        files=declared,
        layout=_layout(doc.get("layout")),
    )


def _layout(value: object) -> str | None:
    """Refused before a byte is stored, like the names."""
    if value is not None and not isinstance(value, str):
        raise UsageError("push header: layout must be a string")
    return check_layout(value)


def _text(value: object, what: str) -> str:
    if not isinstance(value, str):
        raise UsageError(f"push header: {what} must be a string")
    return value


def _declared(entry: object) -> Declared:
    if not isinstance(entry, dict):
        raise UsageError("push header: each file is an object with path and size")
    path, size = entry.get("path"), entry.get("size")
    if not isinstance(path, str):
        raise UsageError("push header: a file path is not a string")
    if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= MAX_FILE_SIZE:
        raise UsageError(f"push header: {path[:80]!r} has a bad size {size!r}")
    return Declared(_checked_path(path), size)


def _checked_path(path: str) -> str:
    """A relative path of plain names: nothing that could leave the upload directory."""
    why = path_problem(path)
    if why is not None:
        raise UsageError(f"push header: {path[:80]!r} is not a plain relative file path ({why})")
    return path


def path_problem(path: str) -> str | None:
    """Why `path` is not a relative path of plain names the server may create a file at (in
    its upload directory or a local store), checked before the filesystem is touched; None when
    it is one. A push's files and a claim's uploads are held to the same rules."""
    parts = path.split("/")
    if not path:
        return "empty"
    if len(path) > MAX_PATH:
        return f"{len(path)} characters, over {MAX_PATH}"
    if len(parts) > MAX_DEPTH:
        return f"{len(parts)} segments, over {MAX_DEPTH}"
    if not path.isprintable():
        return "a control character"
    for p in parts:
        if p in ("", ".", ".."):
            return "an empty, . or .. segment"
        if len(p.encode()) > MAX_SEGMENT:
            return f"a segment of {len(p.encode())} bytes, over {MAX_SEGMENT}"
    return None


def _check_tree(paths: list[str]) -> None:
    """No path twice, none inside another file, a bounded number of directories; in time
    proportional to the paths' total length."""
    files = set(paths)
    if len(files) != len(paths):
        raise UsageError("push header: a file path appears twice")
    directories: set[str] = set()
    for p in paths:
        end = p.find("/")
        while end != -1:
            parent = p[:end]
            if parent in files:
                raise UsageError(f"push header: {p!r} is inside the file {parent!r}")
            directories.add(parent)
            end = p.find("/", end + 1)
        if len(directories) > MAX_DIRECTORIES:
            raise UsageError(f"push header: more than {MAX_DIRECTORIES} directories")


@dataclass
class Receiver:
    """Writes the declared files, in order, from the bytes that follow the header."""

    root: Path
    files: list[Declared]
    index: int = 0
    written: int = 0
    fd: int | None = None
    trailer: bytearray = field(default_factory=bytearray)
    hasher: Any = field(default_factory=hashlib.sha256)
    received: dict[str, tuple[int, str]] = field(default_factory=dict)  # path -> size, sha256
    flushed: int = 0  # bytes of the current file handed to writeback

    lock: int | None = None

    @classmethod
    def create(cls, parent: Path, files: list[Declared]) -> Receiver:
        needed = sum(f.size for f in files)
        check_space(parent, needed)
        root, lock = private_dir(parent, "push")
        return cls(root, files, lock=lock)

    def _open(self) -> int:
        if self.index >= len(self.files):
            raise UsageError("the push sent more bytes than its header declared")
        target = self.root / self.files[self.index].path
        target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        self.fd = os.open(target, flags, 0o600)
        self.hasher, self.written, self.flushed = hashlib.sha256(), 0, 0
        self.trailer.clear()
        return self.fd

    def _check_trailer(self) -> None:
        f = self.files[self.index]
        assert self.fd is not None
        os.close(self.fd)  # made durable by the store when it takes the file (adopt_file)
        self.fd = None
        got, sent = self.hasher.hexdigest(), bytes(self.trailer).hex()
        if got != sent:
            raise IntegrityError(
                f"{f.path} arrived with sha256 {got[:16]}..., not the {sent[:16]}... the "
                "client read",
                "the file changed while being pushed, or was damaged in transit: push again",
            )
        self.received[f.path] = (f.size, got)
        self.index += 1

    def feed(self, data: bytes) -> None:
        """Write `data`, the bytes that follow the previous ones."""
        view = memoryview(data)
        while view:
            fd = self.fd if self.fd is not None else self._open()
            f = self.files[self.index]
            if self.written < f.size:
                piece = view[: f.size - self.written]
                self.hasher.update(piece)
                rest = piece
                while rest:
                    rest = rest[os.write(fd, rest) :]
                self.written += len(piece)
                if self.written - self.flushed >= WRITEBACK_EVERY:
                    # Start writing back what landed, so the store's fsync finds little left.
                    os.posix_fadvise(fd, self.flushed, 0, os.POSIX_FADV_DONTNEED)
                    self.flushed = self.written
            else:
                piece = view[: DIGEST - len(self.trailer)]
                self.trailer += piece
                if len(self.trailer) == DIGEST:
                    self._check_trailer()
            view = view[len(piece) :]

    def feed_all(self, pieces: list[bytes]) -> None:
        for piece in pieces:
            self.feed(piece)

    def finish(self) -> None:
        if self.index < len(self.files):
            f = self.files[self.index]
            raise IntegrityError(
                f"the push ended inside {f.path} ({self.written} of {f.size} bytes)",
                "the connection dropped or the client stopped: push again",
            )

    def discard(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        release_dir(self.root, self.lock)
        self.lock = None


SPACE_MARGIN = 1 << 30  # left free on the server's disk after an upload


def check_space(parent: Path, needed: int) -> None:
    """Refuse an upload the server's disk cannot hold, before a byte is written."""
    parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = os.statvfs(parent)
    free = st.f_bavail * st.f_frsize
    if needed + SPACE_MARGIN > free:
        raise RegistryError(
            f"the server has {free >> 20} MiB free for uploads and this push needs "
            f"{needed >> 20} MiB (plus {SPACE_MARGIN >> 20} MiB kept free)",
            "ask the operator to free space on the server, or push later",
        )


def private_dir(parent: Path, kind: str) -> tuple[Path, int]:
    """A new directory only this process uses (0700), and the lock that says it is in use:
    `sweep` removes the directories whose lock nobody holds (a crashed or killed server)."""
    parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    name = f"{kind}-{uuid.uuid4().hex}"
    lock = os.open(parent / f"{name}.lock", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    fcntl.flock(lock, fcntl.LOCK_EX)
    root = parent / name
    root.mkdir(mode=0o700)
    return root, lock


def release_dir(root: Path, lock: int | None) -> None:
    shutil.rmtree(root, ignore_errors=True)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(f"{root}.lock")
    if lock is not None:
        os.close(lock)


def sweep(parent: Path) -> list[str]:
    """Remove what dead requests left under `parent`: directories whose lock no live process
    holds. Returns their names."""
    removed: list[str] = []
    if not parent.is_dir():
        return removed
    for lock_path in parent.glob("*.lock"):
        try:
            fd = os.open(lock_path, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue  # a live request
        root = lock_path.with_suffix("")
        shutil.rmtree(root, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(lock_path)
        os.close(fd)
        removed.append(root.name)
    return removed


class Writer:
    """Feeds a Receiver on its own thread, so receiving the next bytes overlaps hashing and
    writing the last ones. A bounded queue keeps the memory in use at `depth` batches."""

    def __init__(self, receiver: Receiver, depth: int = 8) -> None:
        self.receiver = receiver
        self.queue: queue.Queue[list[bytes] | None] = queue.Queue(depth)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="reg-receive", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (batch := self.queue.get()) is not None:
            if self.error is None:  # after a failure, drain without writing
                try:
                    self.receiver.feed_all(batch)
                except BaseException as exc:
                    self.error = exc

    def offer(self, batch: list[bytes]) -> bool:
        """Queue `batch` if there is room now (no waiting); False if the queue is full."""
        self._raise()
        try:
            self.queue.put_nowait(batch)
        except queue.Full:
            return False
        return True

    def put(self, batch: list[bytes]) -> None:
        """Queue `batch`, waiting for room (call from a worker thread)."""
        self._raise()
        self.queue.put(batch)

    def close(self) -> None:
        """Wait until everything queued is written; raise what writing raised."""
        self.queue.put(None)
        self.thread.join()
        self._raise()
        self.receiver.finish()

    def abandon(self) -> None:
        self.error = self.error or RuntimeError("abandoned")
        with contextlib.suppress(queue.Full):
            while True:
                self.queue.put_nowait(None)
        self.thread.join(timeout=30)

    def _raise(self) -> None:
        if self.error is not None:
            raise self.error
