"""A release in the Hugging Face hub cache, as `huggingface_hub` lays out a download, so
`from_pretrained(MODEL, local_files_only=True)` (and `revision=ALIAS`) loads it offline:

    HUB/models--MODEL/blobs/SHA256                    the bytes of each file, named by sha256
    HUB/models--MODEL/snapshots/REVISION/PATH         a relative link: ../../blobs/SHA256
    HUB/models--MODEL/refs/main, refs/vK, refs/ALIAS  REVISION (40 hex, no newline)
    HUB/.locks/models--MODEL/reg.lock                 held while blobs, snapshot and refs move

REVISION is the first 40 hex digits of the release.json sha256: huggingface_hub takes a
revision of 40 hex digits for a commit (`REGEX_COMMIT_HASH`) and opens `snapshots/REVISION/`
without asking anyone; a branch name (`main`, an alias) it reads from `refs/` (the whole file,
no newline stripped: none is written). Blobs are the bytes a verified pull wrote (sha256 checked
as they were written), renamed into place; the snapshot is built beside its final name and
swapped in, so a reader sees the whole snapshot or the one before.

A snapshot already there is reused when every link points at the blob of the file's recorded
digest and each blob has its size (release.json's is hashed): the cheap check huggingface_hub
makes none of. `model_signing verify` checks a snapshot only with `--allow_symlinks`.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path
from typing import TYPE_CHECKING

from registry.api.consumers.common import (
    Target,
    check_signed,
    links,
    locked,
    pull_verified,
    rehashed,
    remove,
    sha256_of,
    swap_in,
    sweep_dead,
    temp_name,
    usable_dir,
    write_atomic,
)
from registry.core.layout import RELEASE_DOCUMENT
from registry.errors import UsageError

if TYPE_CHECKING:
    from collections.abc import Mapping

    from registry.api.contract import Registry
    from registry.core.progress import Progress

# huggingface_hub's validate_repo_id, for a name without a namespace: 1-96 characters, starting
# and ending with a letter, digit or `_`, no `--` (its folder separator) and no `..`
_REPO_NAME = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9_])?")


def default_hub_cache(env: Mapping[str, str] | None = None) -> Path:
    """Where huggingface_hub looks: HF_HUB_CACHE, else HF_HOME/hub, else the XDG cache's (by
    default ~/.cache/huggingface/hub)."""
    env = os.environ if env is None else env
    given = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE")
    if given:
        return Path(os.path.expandvars(given)).expanduser()
    home = env.get("HF_HOME")
    if home:
        return Path(os.path.expandvars(home)).expanduser() / "hub"
    xdg = env.get("XDG_CACHE_HOME") or str(Path("~/.cache").expanduser())
    return Path(os.path.expandvars(xdg)).expanduser() / "huggingface" / "hub"


def check_repo_id(model: str) -> str:
    if not _REPO_NAME.fullmatch(model) or "--" in model or ".." in model or model.endswith(".git"):
        raise UsageError(
            f"model name {model!r} is not a Hugging Face repo id",
            "a repo id is 1-96 of A-Z a-z 0-9 . _ -, ends in a letter, digit or _, holds no "
            "'--' and does not end in .git; fetch it without --hf and load the folder",
        )
    return model


def revision_of(target: Target) -> str:
    return target.digest[:40]


def fetch(
    registry: Registry,
    target: Target,
    hub: Path,
    public_key: str | None,
    progress: Progress | None,
) -> tuple[Path, bool, str]:
    """`target` in the hub cache `hub`: its snapshot folder, whether it was there already, and
    its revision. refs/main (and refs/vK, refs/ALIAS when fetched by alias) name it after."""
    check_repo_id(target.model)
    hint = "give --hf-cache a directory you can write (or set HF_HUB_CACHE)"
    usable_dir(hub, "Hugging Face cache", hint)
    repo = hub / f"models--{target.model}"
    blobs, snapshots, refs = repo / "blobs", repo / "snapshots", repo / "refs"
    for folder in (blobs, snapshots, refs):
        usable_dir(folder, "Hugging Face cache", hint)
    lock = usable_dir(hub / ".locks" / repo.name, "Hugging Face cache", hint) / "reg.lock"
    revision = revision_of(target)
    snapshot = snapshots / revision
    sweep_dead(repo)
    sweep_dead(snapshots)
    cached = _complete(repo, snapshot, target)
    altered = cached and public_key is not None and not rehashed(snapshot, target)
    cached = cached and not altered  # written around reg: pulled again (a pinned key reads all)
    if cached:
        if public_key is not None:
            check_signed(snapshot, target, public_key)
    else:
        temp = repo / temp_name("pull")
        pull_verified(registry, target, temp, public_key, progress)
        built = snapshots / temp_name(revision)
        try:
            with locked(lock):
                # else a concurrent fetch made it (unless this one found it altered)
                if altered or not _complete(repo, snapshot, target):
                    for path, digest in target.digests():
                        os.replace(temp / path, blobs / digest)  # verified bytes, same volume
                    built.mkdir()
                    for path, digest in target.digests():
                        link = built / path
                        link.parent.mkdir(parents=True, exist_ok=True)
                        os.symlink(_pointer(path, digest), link)
                    swap_in(built, snapshot)
                    remove(repo / ".no_exist" / revision)  # a miss cached for this revision
        finally:
            remove(built)
            remove(temp)
    # an alias named like a version or main would move that ref: `revision="v1"` loading v2
    alias = target.alias if target.alias and not VERSION_REF.fullmatch(target.alias) else None
    names = ["main", f"v{target.version}", *([alias] if alias else [])]
    with locked(lock):
        for name in names:  # checked names (refs.check_alias): one segment each
            ref = refs / name
            try:
                same = ref.read_bytes() == revision.encode()
            except OSError:
                same = False
            if not same:
                write_atomic(ref, revision.encode())
    return snapshot, cached, revision


VERSION_REF = re.compile(r"main|v[0-9]+")


def _pointer(path: str, digest: str) -> str:
    """The link at snapshots/REVISION/PATH to blobs/DIGEST, relative as huggingface_hub writes
    it (one `../` more per directory in PATH)."""
    return "../" * (2 + path.count("/")) + f"blobs/{digest}"


def _complete(repo: Path, snapshot: Path, target: Target) -> bool:
    """Every file of `target` is in `snapshot` as the link to its blob, nothing else is, and
    each blob is a regular file of its size (release.json's hashed: it is small)."""
    found = links(snapshot)
    digests = dict(target.digests())
    if found is None or set(found) != set(digests):
        return False
    for path, digest in digests.items():
        if found[path] != _pointer(path, digest):
            return False
        blob = repo / "blobs" / digest
        try:
            st = os.lstat(blob)
        except OSError:
            return False
        if not stat.S_ISREG(st.st_mode):
            return False
        if path == RELEASE_DOCUMENT:
            if sha256_of(blob) != digest:
                return False
        elif st.st_size != target.files[path][0]:
            return False
    return True
