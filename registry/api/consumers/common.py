"""What both release caches share.

- `resolve`: the release a ref names now, as the registry's `show` describes it (an alias is
  resolved once, here; everything after names the version), refused when yanked.
- `pull_verified`: `pull_release` of that version into a new temporary folder, then checked to
  be the release its digest names: release.json hashes to the digest and names the release, the
  files it lists were pulled with those digests, and the folder holds exactly the files pulled.
- `scan`, `swap_in`, `locked`, `temp_name`, `sweep_dead`: a folder's files as found (never
  through a link), an atomic replacement of a folder, a lock file, and the temporary names a
  killed fetch leaves (removed once the process that made them is gone).

Every path built here comes from a checked name (the model, the alias), a checked digest, or
a file path checked to be relative with safe segments: an answer from the registry, or a
record on disk, cannot point a write outside the cache.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import re
import shutil
import socket
import stat
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from registry.api.results import ReleaseDetails
from registry.core.layout import RELEASE_DOCUMENT
from registry.core.refs import (
    ReleaseRef,
    as_release_ref,
    check_alias,
    check_name,
)
from registry.errors import Conflict, IntegrityError, MalformedRef, UsageError
from registry.formats.documents import FileRecord, ReleaseDocument
from registry.lifecycle.checkpoints.pulled import hash_all
from registry.trust.release_signing.bundle import check_pulled

if TYPE_CHECKING:
    from registry.api.contract import Registry
    from registry.core.progress import Progress

SHA256 = re.compile(r"[0-9a-f]{64}")
_SEGMENT = re.compile(r"[A-Za-z0-9._=-][A-Za-z0-9._=+-]*")  # a store key's (storage.base)
_MAX_PATH = 1024
_YANKED = "yanked"  # registry.catalog.models.YANKED, without importing the catalog
HOST = re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname())
_LEFT = re.compile(rf"\..*\.reg-(?:fetch|old)-{re.escape(HOST)}-(\d+)-[0-9a-f]{{8}}(?:\..*)?")


@dataclass(frozen=True, slots=True)
class Target:
    """The release a ref names now: its version, its release.json digest (what the caches are
    keyed by) and every other file of its folder (path -> size, sha256), as `show` listed them."""

    details: ReleaseDetails
    model: str
    version: int
    alias: str | None
    digest: str
    files: Mapping[str, tuple[int, str]]

    @property
    def name(self) -> str:
        return f"{self.model}:v{self.version}"

    def digests(self) -> list[tuple[str, str]]:
        """Every file of the folder and its sha256, release.json included."""
        return [(p, d) for p, (_, d) in self.files.items()] + [(RELEASE_DOCUMENT, self.digest)]


def resolve(registry: Registry, ref: str | ReleaseRef) -> Target:
    asked = as_release_ref(ref)
    if not isinstance(asked, ReleaseRef) or (asked.version is None) == (asked.alias is None):
        raise MalformedRef(f"malformed release ref {ref!r}", "expected MODEL:vK or MODEL@ALIAS")
    check_name(asked.model, "model name")  # a ReleaseRef made in Python was never parsed
    if asked.alias is not None:
        check_alias(asked.alias)
    details = registry.show(str(asked))
    if not isinstance(details, ReleaseDetails):
        raise IntegrityError(f"the registry answered {asked} with a checkpoint")
    version = details.version
    if (
        details.model != asked.model
        or not isinstance(version, int)
        or isinstance(version, bool)
        or version < 1
        or (asked.version is not None and version != asked.version)
    ):
        raise IntegrityError(
            f"the registry answered {asked} with {details.release!r}",
            "do not use what it serves; report it to the registry's operator",
        )
    name = f"{asked.model}:v{version}"
    if details.status == _YANKED:
        raise Conflict(
            f"{name} was yanked: {details.status_reason}",
            f"fetch another version of {asked.model} (reg releases {asked.model})",
        )
    digest = details.sha256
    if not isinstance(digest, str) or not SHA256.fullmatch(digest):
        raise IntegrityError(
            f"{name} has no release.json digest to be cached by",
            f"reg pull-release {name} DIR copies it out",
        )
    return Target(details, asked.model, version, asked.alias, digest, listing(details.files, name))


def listing(files: Any, name: str) -> dict[str, tuple[int, str]]:
    """A file list as the registry answered it (path, size, sha256 each), every value checked:
    release.json, which the lists leave out, may not be one of them."""
    if not isinstance(files, list):
        raise IntegrityError(f"{name}: the registry's file list is not a list")
    out: dict[str, tuple[int, str]] = {}
    for f in files:
        if not isinstance(f, dict):
            raise IntegrityError(f"{name}: the registry's file list holds {f!r:.60}")
        path, size, digest = safe_path(f.get("path"), name), f.get("size"), f.get("sha256")
        if (
            path in out
            or path == RELEASE_DOCUMENT
            or not isinstance(size, int)
            or isinstance(size, bool)
            or size < 0
            or not isinstance(digest, str)
            or not SHA256.fullmatch(digest)
        ):
            raise IntegrityError(f"{name}: the registry lists {path} with {size!r}, {digest!r}")
        out[path] = (size, digest)
    return out


def safe_path(value: Any, where: str) -> str:
    """`value` if it is a relative path of safe segments (no `.` or `..`, no empty one)."""
    if isinstance(value, str) and 0 < len(value) <= _MAX_PATH:
        parts = value.split("/")
        if all(_SEGMENT.fullmatch(p) and p != "." and not p.startswith("..") for p in parts):
            return value
    raise IntegrityError(
        f"{where}: {value!r:.80} is not a safe relative path",
        "the registry's answer is damaged; do not use it",
    )


def pull_verified(
    registry: Registry,
    target: Target,
    dest: Path,
    public_key: str | None,
    progress: Progress | None,
) -> None:
    """Pull `target`'s version into `dest` (new) and check it is the release its digest names;
    removed again on any failure. With `public_key` the pull itself refuses a folder that key
    did not sign (nothing is written then)."""
    pulled = registry.pull_release(target.name, dest, public_key=public_key, progress=progress)
    try:
        got = listing(pulled.files, target.name)
        if got != dict(target.files):
            raise IntegrityError(
                f"{target.name}: the pull listed other files than show did",
                "the release changed meanwhile (a signature added): run it again",
            )
        data = (dest / RELEASE_DOCUMENT).read_bytes()
        if hashlib.sha256(data).hexdigest() != target.digest:
            raise IntegrityError(
                f"{target.name}: the pulled {RELEASE_DOCUMENT} is not the one show named",
                "do not use what the registry serves; report it to its operator",
            )
        document = ReleaseDocument.from_bytes(data, f"{target.name} {RELEASE_DOCUMENT}")
        if document.release != target.name:
            raise IntegrityError(f"{target.name}: its {RELEASE_DOCUMENT} names {document.release}")
        for f in document.files:
            if got.get(f.path) != (f.size, f.sha256):
                raise IntegrityError(
                    f"{target.name}: {f.path} is not the file its {RELEASE_DOCUMENT} lists"
                )
        found = scan(dest)
        if found is None or set(found) != {*got, RELEASE_DOCUMENT}:
            raise IntegrityError(f"{target.name}: the pulled folder holds other files")
    except BaseException:
        shutil.rmtree(dest, ignore_errors=True)
        raise


def check_signed(folder: Path, target: Target, public_key: str) -> None:
    """model.sig in `folder` signs, under `public_key`, exactly the files `target` lists (the
    digests recorded when they were pulled; no file is read again but release.json)."""
    check_pulled(folder, target.digests(), public_key, target.model, target.version)


def rehashed(folder: Path, target: Target) -> bool:
    """Does every file of `folder` (followed through a snapshot's links) hash to what `target`
    lists? What a reuse under a pinned key reads: the cheap check trusts the cache's own
    record, which whoever can write the cache directory can rewrite too."""
    files = [FileRecord(path, -1, digest) for path, digest in target.digests()]
    try:
        return hash_all(folder, files) == [f.sha256 for f in files]
    except OSError:  # a file gone meanwhile
        return False


def scan(folder: Path) -> dict[str, os.stat_result] | None:
    """Every regular file below `folder` (relative path -> its lstat), or None when `folder` is
    not a directory or holds anything else (a link, a FIFO) or an empty directory."""
    found = _entries(folder)
    if found is None or any(not stat.S_ISREG(st.st_mode) for st in found.values()):
        return None
    return found


def links(folder: Path) -> dict[str, str] | None:
    """Every symlink below `folder` (relative path -> what it points at), or None when `folder`
    is not a directory or holds anything else or an empty directory."""
    found = _entries(folder)
    if found is None or any(not stat.S_ISLNK(st.st_mode) for st in found.values()):
        return None
    try:
        return {path: os.readlink(folder / path) for path in found}
    except OSError:
        return None


def _entries(folder: Path) -> dict[str, os.stat_result] | None:
    """Everything below `folder` but its directories (relative path -> lstat, links never
    followed), or None when `folder` is not a directory, holds an empty directory, or cannot
    be read."""
    out: dict[str, os.stat_result] = {}
    try:
        if not stat.S_ISDIR(os.lstat(folder).st_mode):
            return None
        stack = [(folder, "")]
        while stack:
            here, prefix = stack.pop()
            entries = list(os.scandir(here))
            if not entries and prefix:
                return None
            for entry in entries:
                st = entry.stat(follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    stack.append((Path(entry.path), f"{prefix}{entry.name}/"))
                else:
                    out[prefix + entry.name] = st
    except OSError:
        return None
    return out


def sha256_of(path: Path) -> str | None:
    try:
        with open(path, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()
    except OSError:
        return None


def usable_dir(path: Path, what: str, hint: str) -> Path:
    """`path`, created if missing; one line if it cannot be (a file in the way, no permission)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        if not os.access(path, os.R_OK | os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
    except OSError as exc:
        raise UsageError(f"the {what} {path} is not usable: {exc.strerror or exc}", hint) from None
    return path


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """An exclusive lock on `path` (created if missing), released on leaving."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def temp_name(stem: str, kind: str = "fetch") -> str:
    """A hidden name beside `stem` that says which host and process made it (`sweep_dead`)."""
    return f".{stem}.reg-{kind}-{HOST}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def sweep_dead(directory: Path) -> None:
    """Remove what a fetch killed on this host left in `directory` (its names carry the host
    and pid): only once that process is gone. Another host's, or a live one's, stays."""
    with contextlib.suppress(OSError):
        for entry in os.scandir(directory):
            match = _LEFT.fullmatch(entry.name)
            if match is None:
                continue
            try:
                os.kill(int(match.group(1)), 0)
                continue  # alive (or not ours to signal)
            except ProcessLookupError:
                remove(Path(entry.path))
            except (PermissionError, OverflowError):
                continue


def remove(path: Path) -> None:
    """A file, a link or a folder (never followed), gone; a missing one is no error."""
    try:
        if stat.S_ISDIR(os.lstat(path).st_mode):
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink()
    except FileNotFoundError:
        pass


def swap_in(new: Path, final: Path) -> None:
    """`final` becomes `new` (siblings; under the caller's lock): renamed in where nothing is
    there, else the old one is renamed aside first and removed after. A reader sees the old
    folder or the new one, never a half-written one."""
    old = None
    if os.path.lexists(final):
        old = final.with_name(temp_name(final.name, "old"))
        os.rename(final, old)
    os.rename(new, final)
    sync_dir(final.parent)
    if old is not None:
        remove(old)


def write_atomic(path: Path, data: bytes) -> None:
    """`path` holds `data` or what it held before, never part of it."""
    temp = path.with_name(temp_name(path.name))
    try:
        with open(temp, "xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            temp.unlink()
        raise
    sync_dir(path.parent)


def sync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
