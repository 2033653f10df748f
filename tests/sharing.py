"""What the suite builds once and shares: across pytest-xdist workers, and safely.

`build_once(factory, name, build)` runs `build(path)` once per test session however many
workers ask (the first takes a file lock and builds, the others wait and read its result), so a
torchrun-written checkpoint or a framework's training run costs its 20-60 s once. The directory
a build leaves is shared read-only: its files lose their write bits, and `SharedTrees` keeps a
snapshot of every file (size, mtime, inode) that the autouse fixture in conftest compares after
each test; a test that wrote to, added to or removed from a shared tree fails, naming the file,
instead of silently changing what the tests after it see. (Root ignores write bits: the
snapshot is the check that holds for everyone.)

`ExclusiveLock` keeps the tests marked `exclusive` (their assertions depend on timing or memory
measurements) apart from every other test of the session, on any worker: the others hold the
machine shared, an exclusive test waits until no other test runs and keeps new ones out.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pickle
import shutil
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest

T = TypeVar("T")


def session_root(factory: pytest.TempPathFactory) -> Path:
    """The directory every worker of this session sees: pytest's base temp under plain pytest,
    its parent (the session's) under xdist, whose workers each get `popen-gwN` below it."""
    base = factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@contextlib.contextmanager
def _flock(path: Path, mode: int) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, mode)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def build_once(factory: pytest.TempPathFactory, name: str, build: Callable[[Path], T]) -> T:
    """`build(path)`'s result, built by whichever worker asks first and read by the rest. A
    build that raised is tried again by the next worker that asks (each sees its own error)."""
    root = session_root(factory) / "shared"
    root.mkdir(exist_ok=True)
    path, result = root / name, root / f"{name}.result.pickle"
    started = time.monotonic()
    with _flock(root / f"{name}.lock", fcntl.LOCK_EX):
        waited = time.monotonic() - started
        if result.exists():
            value: T = pickle.loads(result.read_bytes())
            SETUP_TIMES.append((name, "shared", waited))
        else:
            if path.exists():  # a build that failed half-way
                _make_writable(path)
                shutil.rmtree(path)
            path.mkdir()
            value = build(path)
            _make_read_only(path)
            result.write_bytes(pickle.dumps(value))
            SETUP_TIMES.append((name, "built", time.monotonic() - started))
    SHARED.watch(name, path)
    return value


# (fixture, "built" or "shared", seconds): printed in the terminal summary (conftest).
SETUP_TIMES: list[tuple[str, str, float]] = []


@contextlib.contextmanager
def timed(name: str) -> Iterator[None]:
    """Record how long a per-worker set-up (a server, the zygote) took, for the summary."""
    started = time.monotonic()
    try:
        yield
    finally:
        SETUP_TIMES.append((name, "built", time.monotonic() - started))


def _walk(path: Path) -> Iterator[Path]:
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames.sort()
        for entry in (*dirnames, *sorted(filenames)):
            yield Path(dirpath) / entry


def _make_read_only(path: Path) -> None:
    for entry in _walk(path):
        if entry.is_file() and not entry.is_symlink():
            entry.chmod(entry.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))


def _make_writable(path: Path) -> None:
    for entry in _walk(path):
        if entry.is_file() and not entry.is_symlink():
            entry.chmod(entry.stat().st_mode | stat.S_IWUSR)


Snapshot = dict[str, tuple[int, int, int, int]]


def snapshot(path: Path) -> Snapshot:
    """Every entry under `path`: (kind and mode, size, mtime_ns, inode)."""
    out: Snapshot = {}
    for entry in _walk(path):
        st = entry.lstat()
        size = st.st_size if stat.S_ISREG(st.st_mode) else 0
        out[str(entry.relative_to(path))] = (st.st_mode, size, st.st_mtime_ns, st.st_ino)
    return out


class SharedTrees:
    """The shared trees of this worker and what they held when built."""

    def __init__(self) -> None:
        self._trees: dict[str, tuple[Path, Snapshot]] = {}

    def watch(self, name: str, path: Path) -> None:
        if name not in self._trees:
            self._trees[name] = (path, snapshot(path))

    def changes(self) -> list[str]:
        """What changed in any shared tree since it was built (or last reported); each
        reported change is taken as the new state, so one bad test is named once."""
        found = []
        for name, (path, before) in list(self._trees.items()):
            now = snapshot(path)
            if now == before:
                continue
            added = sorted(now.keys() - before.keys())
            removed = sorted(before.keys() - now.keys())
            changed = sorted(k for k in now.keys() & before.keys() if now[k] != before[k])
            parts = [
                f"{label} {', '.join(items[:3])}{' ...' if len(items) > 3 else ''}"
                for label, items in (("added", added), ("removed", removed), ("changed", changed))
                if items
            ]
            found.append(f"{name} ({path}): {'; '.join(parts)}")
            self._trees[name] = (path, now)
        return found


SHARED = SharedTrees()


class ExclusiveLock:
    """A readers-writer lock over the whole machine, with writer priority, from two flock(2)
    files in the session's shared directory: `gate` (taken briefly by every test, held by an
    exclusive one for its whole run, so no new test starts meanwhile) and `machine` (shared by
    ordinary tests, exclusive for an exclusive one, so it waits for the running ones). A run of
    exclusive tests back to back keeps both for the whole run: no other test slips in between
    (and makes the next one wait for it)."""

    def __init__(self, root: Path) -> None:
        self.gate = root / "exclusive.gate"
        self.machine = root / "exclusive.machine"
        self._held: tuple[int, int] | None = None  # (gate fd, machine fd) of an exclusive run

    def _open(self, path: Path) -> int:
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o644)

    @contextlib.contextmanager
    def hold(self, exclusive: bool, next_exclusive: bool) -> Iterator[None]:
        if exclusive:
            if self._held is None:
                gate, machine = self._open(self.gate), self._open(self.machine)
                fcntl.flock(gate, fcntl.LOCK_EX)
                fcntl.flock(machine, fcntl.LOCK_EX)
                self._held = (gate, machine)
            try:
                yield
            finally:
                if not next_exclusive:
                    self.release()
            return
        self.release()
        machine = self._open(self.machine)
        try:
            with _flock(self.gate, fcntl.LOCK_EX):
                fcntl.flock(machine, fcntl.LOCK_SH)
            yield
        finally:
            os.close(machine)

    def release(self) -> None:
        if self._held is not None:
            for fd in self._held:
                os.close(fd)
            self._held = None


def unchanged_shared_trees() -> str | None:
    """For conftest: the failure message when a test changed a shared tree, else None."""
    changes = SHARED.changes()
    if not changes:
        return None
    return (
        "this test changed a fixture that the whole session shares read-only; copy it first "
        "(Trained.copy_step, shutil.copytree) and change the copy:\n  " + "\n  ".join(changes)
    )
