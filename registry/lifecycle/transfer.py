"""Verified bytes between the store and local files, shared by every lifecycle.

- `download`: copy an artifact's files out of the store into a new or empty directory, in
  parallel, each file's size and sha256 checked against the catalog's record; all or nothing
  (a temp directory renamed into place), one error type (`IntegrityError`) for a missing or
  damaged stored file.
- `verify_stored`: re-hash stored files against their records; one problem per damaged file.
- `put_reconciled`: put-if-absent with an explicit choice for an object already there: equal
  bytes are reused; other bytes are replaced (a claim holder's own leftover) or a conflict.
"""

from __future__ import annotations

import contextlib
import enum
import hashlib
import os
import re
import shutil
import socket
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from registry.core.progress import Counter, Progress
from registry.errors import Conflict, IntegrityError, NotFound, ObjectExists, UsageError
from registry.formats.documents import FileRecord
from registry.storage.base import BaseStore, Producer, Staged, check_key


class OnMismatch(enum.Enum):
    REPLACE = "replace"  # the object is our own leftover (we hold the claim): replace it
    CONFLICT = "conflict"  # someone else's bytes: refuse


@dataclass(frozen=True, slots=True)
class Stored:
    key: str
    size: int
    sha256: str
    reused: bool  # the object was already there with these bytes
    version: str | None = None  # the object's version, on a versioned bucket


@dataclass(frozen=True, slots=True)
class Problem:
    path: str
    problem: str

    def to_json(self) -> dict[str, str]:
        return {"path": self.path, "problem": self.problem}


# -- writes -------------------------------------------------------------------------------------


def put_reconciled(
    store: BaseStore,
    key: str,
    *,
    data: bytes | None = None,
    path: Path | None = None,
    produce: Producer | None = None,
    staged: Staged | None = None,
    immutable: bool = False,
    on_mismatch: OnMismatch,
    before_replace: Callable[[], None] | None = None,
    progress: Callable[[int], None] | None = None,
) -> Stored:
    """Put one of `data`, `path`, `produce` or what `staged` holds at `key`; if the key exists,
    compare digests: equal is a reuse, other bytes follow `on_mismatch` (`before_replace` runs
    first and may refuse, e.g. when the claim that made the leftover ours was lost)."""
    if sum(x is not None for x in (data, path, produce, staged)) != 1:
        raise TypeError("give exactly one of data, path, produce, staged")
    if path is not None:
        staged = store.stage_file(key, path, immutable=immutable, progress=progress)
    if staged is not None:
        with staged:
            return _publish_reconciled(store, staged, on_mismatch, before_replace)
    try:
        if data is not None:
            done = store.put_bytes(key, data, immutable=immutable)
        else:
            assert produce is not None
            done = store.put_stream(key, produce, immutable=immutable)
        return Stored(key, done.size, done.sha256, False, done.version)
    except ObjectExists:
        pass
    size, digest = _digest_of(data, produce)
    held = _holds(store, key, size, digest)
    if held is not None:
        return Stored(key, size, digest, True, held or None)
    _refuse_or_remove(store, key, on_mismatch, before_replace)
    return put_reconciled(
        store, key, data=data, produce=produce, immutable=immutable, on_mismatch=OnMismatch.CONFLICT
    )


def _publish_reconciled(
    store: BaseStore,
    staged: Staged,
    on_mismatch: OnMismatch,
    before_replace: Callable[[], None] | None,
) -> Stored:
    try:
        done = staged.publish()
        return Stored(done.key, done.size, done.sha256, False, done.version)
    except ObjectExists:
        pass
    size, digest = staged.digest()
    held = _holds(store, staged.key, size, digest)
    if held is not None:
        return Stored(staged.key, size, digest, True, held or None)
    _refuse_or_remove(store, staged.key, on_mismatch, before_replace)
    done = staged.publish()
    return Stored(done.key, done.size, done.sha256, False, done.version)


def _holds(store: BaseStore, key: str, size: int, digest: str) -> str | None:
    """The version of the object at `key` if it holds exactly these bytes ("" where the store
    has no versions), else None. The bytes hashed are those of the version the HEAD saw."""
    head = store.head(key)
    if head is None or head.size != size:
        return None
    if store.sha256(key, version=head.version_id) != digest:
        return None
    return head.version_id or ""


def _refuse_or_remove(
    store: BaseStore,
    key: str,
    on_mismatch: OnMismatch,
    before_replace: Callable[[], None] | None,
) -> None:
    if on_mismatch is OnMismatch.CONFLICT:
        raise Conflict(
            f"{key} exists with other content",
            "the prefix holds files from another attempt; nothing was overwritten",
        )
    if before_replace is not None:
        before_replace()
    store.delete(key)  # our own leftover: the claim we hold makes it ours to replace


def _digest_of(data: bytes | None, produce: Producer | None) -> tuple[int, str]:
    if data is not None:
        return len(data), hashlib.sha256(data).hexdigest()
    assert produce is not None
    digest, size = hashlib.sha256(), 0

    def write(piece: Any) -> None:
        nonlocal size
        view = memoryview(piece).cast("B")
        digest.update(view)
        size += len(view)

    produce(write)  # the same bytes again, hashed, not stored
    return size, digest.hexdigest()


# -- reads --------------------------------------------------------------------------------------


def download(
    store: BaseStore,
    prefix: str,
    files: Sequence[FileRecord],
    dest: Path,
    *,
    label: str,
    workers: int,
    progress: Progress | None = None,
    before_publish: Callable[[Path], None] | None = None,
) -> Path:
    """Copy `files` (under `prefix`) into `dest`, a new or empty directory, all or nothing.
    `before_publish(folder)` runs after every byte is verified and before `dest` appears, on
    the folder that becomes it (a last check that the artifact is still there, or that the
    folder is signed). Returns the absolute destination."""
    for f in files:
        check_key(prefix + f.path)
    dest = Path(dest).absolute()
    _check_dest(dest)
    _sweep_dead_pulls(dest)
    temp = dest.parent / f".{dest.name}.{_PULL_TEMP}-{_HOST}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    temp.mkdir(parents=True)
    if progress:
        progress.start(f"pull {label}", sum(f.size for f in files))
    counter = Counter(progress)

    def one(f: FileRecord) -> None:
        target = temp / f.path
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            got = store.get_file(prefix + f.path, target, progress=counter, version=f.version)
        except NotFound:
            raise IntegrityError(
                f"{label}: stored file {f.path} is missing; nothing was written to the destination",
                f"reg verify {label} lists every damaged file",
            ) from None
        if got.size != f.size or got.sha256 != f.sha256:
            raise IntegrityError(
                f"{label}: stored file {f.path} is corrupt (sha256 {got.sha256[:12]}..., "
                f"expected {f.sha256[:12]}...); nothing was written to the destination",
                f"reg verify {label} lists every damaged file",
            )

    try:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            list(pool.map(one, files))
        if before_publish is not None:
            before_publish(temp)
        _check_dest(dest)
        if dest.exists():
            dest.rmdir()
        os.rename(temp, dest)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    finally:
        if progress:
            progress.finish()
    return dest


_PULL_TEMP = "reg-pull"
_HOST = re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname())


def _sweep_dead_pulls(dest: Path) -> None:
    """What a pull into `dest` killed on this host left beside it (its temp folder names the
    host and the pid): removed when that process is gone. Another host's, or a live one's,
    is left alone."""
    pattern = re.compile(
        rf"\.{re.escape(dest.name)}\.{_PULL_TEMP}-{re.escape(_HOST)}-(\d+)-[0-9a-f]{{8}}"
    )
    with contextlib.suppress(OSError):
        for entry in dest.parent.iterdir():
            match = pattern.fullmatch(entry.name)
            if match is None or entry.is_symlink() or not entry.is_dir():
                continue
            pid = int(match.group(1))
            try:
                os.kill(pid, 0)
                continue  # alive (or not ours to signal): leave it
            except ProcessLookupError:
                shutil.rmtree(entry, ignore_errors=True)
            except PermissionError:
                continue


def _check_dest(dest: Path) -> None:
    if dest.is_symlink() or (dest.exists() and (not dest.is_dir() or any(dest.iterdir()))):
        raise UsageError(
            f"{dest} exists and is not an empty directory", "pull into a new or empty directory"
        )


def repair_stored(
    store: BaseStore,
    prefix: str,
    files: Sequence[FileRecord],
    problems: Sequence[Problem],
    *,
    immutable: bool,
) -> tuple[list[str], list[Problem]]:
    """Restore each damaged file from the version its record names, after proving that version
    still holds the recorded bytes. Returns (repaired paths, problems left)."""
    records = {f.path: f for f in files}
    repaired, left = [], []
    for problem in problems:
        record = records[problem.path]
        key = prefix + record.path
        if record.version is None:
            left.append(Problem(record.path, f"{problem.problem}; no version was recorded"))
            continue
        head = store.head(key, version=record.version)
        where = f"{problem.problem}; its recorded version {record.version}"
        if head is None:
            left.append(Problem(record.path, f"{where} is gone"))
            continue
        if head.size != record.size or store.sha256(key, version=record.version) != record.sha256:
            left.append(Problem(record.path, f"{where} is damaged too"))
            continue
        store.restore_version(key, record.version, immutable=immutable)
        repaired.append(record.path)
    return repaired, left


def verify_stored(
    store: BaseStore,
    prefix: str,
    files: Sequence[FileRecord],
    *,
    label: str,
    workers: int,
    progress: Progress | None = None,
    recorded_versions: bool = False,
) -> list[Problem]:
    """Sizes and sha256 of stored files against their records; one problem per damaged file.
    By default the current objects are checked (what every reader of the bucket gets); with
    `recorded_versions` the versions the records name (what reg itself reads)."""
    if progress:
        progress.start(label, sum(f.size for f in files))
    counter = Counter(progress)

    def one(f: FileRecord) -> Problem | None:
        version = f.version if recorded_versions else None
        head = store.head(prefix + f.path, version=version)
        if head is None:
            return Problem(f.path, "missing")
        if head.size != f.size:
            return Problem(f.path, f"size {head.size}, expected {f.size}")
        got = store.sha256(prefix + f.path, progress=counter, version=head.version_id)
        if got != f.sha256:
            return Problem(f.path, f"sha256 {got}, expected {f.sha256}")
        return None

    try:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            return [p for p in pool.map(one, files) if p]
    finally:
        if progress:
            progress.finish()
