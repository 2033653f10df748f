"""`REG_CACHE_DIR/releases/MODEL/SHA256/`: one verified folder per release.json digest.

    releases/MODEL/
        SHA256/          exactly the release's files (model_signing verify key passes on it)
        SHA256.json      the completion record: each file's path, size, sha256, mtime, ctime
        .lock            held while a folder is swapped in and its record written

The first fetch of a digest pulls into a hidden sibling (`common.pull_verified`), then, under
the lock, renames it in and writes the record; a concurrent fetch of the same digest that comes
second finds the winner's folder valid and uses it. A later fetch reuses the folder after a
check that reads no weights: the record is the release `show` lists now (a signature added to
a release later makes it stale), the folder holds exactly the recorded files, each with its
size, mtime and ctime (a write, even one that restores the size and the mtime, moves the
ctime), and release.json still hashes to the digest. A folder that fails the check is pulled
again and swapped in for it. With a public key, reuse also needs model.sig to sign exactly the
recorded digests under that key, and every file is re-hashed first (the record is the cache's
own: whoever can write the cache can rewrite it; a file that differs means a new pull). A folder
whose bytes are right but whose signature is not by that key is refused without pulling: the
registry's copy is the same bytes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from registry.api.consumers.common import (
    Target,
    check_signed,
    locked,
    pull_verified,
    rehashed,
    remove,
    safe_path,
    scan,
    sha256_of,
    swap_in,
    sweep_dead,
    temp_name,
    usable_dir,
    write_atomic,
)
from registry.core.layout import RELEASE_DOCUMENT
from registry.errors import IntegrityError

if TYPE_CHECKING:
    from registry.api.contract import Registry
    from registry.core.progress import Progress

FORMAT = "reg.fetched/1"


def fetch(
    registry: Registry,
    target: Target,
    cache_dir: Path,
    public_key: str | None,
    progress: Progress | None,
) -> tuple[Path, bool]:
    """The verified folder of `target` under `cache_dir`, and whether it was there already."""
    root = usable_dir(
        cache_dir / "releases" / target.model,
        "cache directory",
        "set REG_CACHE_DIR (or --cache-dir) to a directory you can write",
    )
    folder, record = root / target.digest, root / f"{target.digest}.json"
    sweep_dead(root)
    valid = _valid(folder, record, target)
    altered = valid and public_key is not None and not rehashed(folder, target)
    if valid and not altered:
        if public_key is not None:
            check_signed(folder, target, public_key)
        return folder, True
    temp = root / temp_name(target.digest)
    pull_verified(registry, target, temp, public_key, progress)
    try:
        with locked(root / ".lock"):
            # else a concurrent fetch won: use its folder (unless this one found it altered)
            if altered or not _valid(folder, record, target):
                record.unlink(missing_ok=True)
                swap_in(temp, folder)
                write_atomic(record, _record(folder, target))
    finally:
        remove(temp)
    return folder, False


def _record(folder: Path, target: Target) -> bytes:
    found = scan(folder) or {}
    digests = dict(target.digests())
    files = [
        {
            "path": path,
            "size": st.st_size,
            "sha256": digests[path],
            "mtime_ns": st.st_mtime_ns,
            "ctime_ns": st.st_ctime_ns,
        }
        for path, st in sorted(found.items())
    ]
    doc = {"format": FORMAT, "release": target.name, "sha256": target.digest, "files": files}
    return json.dumps(doc, indent=1).encode()


def _valid(folder: Path, record: Path, target: Target) -> bool:
    """`folder` is complete and unchanged since its record was written, and the record is the
    release `target` names (no weight is read)."""
    recorded = _read(record, target)
    if recorded is None:
        return False
    listed = {p: v[:2] for p, v in recorded.items() if p != RELEASE_DOCUMENT}
    if listed != dict(target.files) or recorded[RELEASE_DOCUMENT][1] != target.digest:
        return False
    found = scan(folder)
    if found is None or set(found) != set(recorded):
        return False
    for path, st in found.items():
        size, _, mtime_ns, ctime_ns = recorded[path]
        if (st.st_size, st.st_mtime_ns, st.st_ctime_ns) != (size, mtime_ns, ctime_ns):
            return False
    return sha256_of(folder / RELEASE_DOCUMENT) == target.digest


def _read(record: Path, target: Target) -> dict[str, tuple[int, str, int, int]] | None:
    """The record's files (path -> size, sha256, mtime_ns, ctime_ns); None when it is missing,
    damaged or another release's: the folder is then pulled again."""
    try:
        doc: Any = json.loads(record.read_bytes())
        if (doc["format"], doc["release"], doc["sha256"]) != (FORMAT, target.name, target.digest):
            return None
        out = {}
        for f in doc["files"]:
            size, digest, mtime_ns, ctime_ns = f["size"], f["sha256"], f["mtime_ns"], f["ctime_ns"]
            if not all(type(v) is int for v in (size, mtime_ns, ctime_ns)):
                return None
            out[safe_path(f["path"], str(record))] = (size, str(digest), mtime_ns, ctime_ns)
    except (OSError, ValueError, KeyError, TypeError, IntegrityError):
        return None
    return out if RELEASE_DOCUMENT in out else None
