"""Read a DCP checkpoint directory without trusting it: what push copies.

`scan_directory` walks the directory (no symlinks, no hard links, no odd or overlong names, no
document names of the registry's), parses each root's `.metadata` (one at the top, or several
one level down: `dcp_roots.py`) from a descriptor it checked, takes the inventory and refuses
what torch writes but reg cannot read back. `open_checked` gives the copy the very files the
scan checked.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from registry.core.layout import MANIFEST, RELEASE_DOCUMENT
from registry.errors import InvalidCheckpoint
from registry.formats import file_roots
from registry.formats.dcp import METADATA, Inventory, check_ranges, inventory
from registry.formats.dcp_roots import check_roots, merged_metadata, metadata_paths
from registry.formats.foreign import refuse_foreign

RANK_FILE = re.compile(r"__(\d+)_(\d+)\.distcp")
_NAME_SEGMENT = re.compile(r"[A-Za-z0-9._=-][A-Za-z0-9._=+-]*")
MAX_METADATA_BYTES = 512 * 1024 * 1024
MAX_PATH = 1024  # the catalog's column for a file path
UPLOAD_PLAN = ".reg-upload.json"  # a presigned push's plan, beside its files (reg server)
# One writer's record of the files it put under a shared claim (`reg push-ckpt --claim`).
CLAIM_RECORD_PREFIX = ".reg-claim-"
RESERVED_NAMES = (MANIFEST, RELEASE_DOCUMENT, UPLOAD_PLAN)


def is_reserved(path: str) -> bool:
    """A path with a name the registry writes itself, as a file or a directory."""
    return any(n in RESERVED_NAMES or n.startswith(CLAIM_RECORD_PREFIX) for n in path.split("/"))


ReadHead = Callable[[str, int], bytes]  # (path, offset) -> the 9 bytes there


@dataclass(slots=True)
class ScannedDir:
    root: Path
    files: dict[str, int]  # relative path -> size
    metadata: Any
    inventory: Inventory
    ranks: set[int]
    identity: dict[str, tuple[int, int, int]] = field(default_factory=dict)  # dev, inode, ctime
    metadata_digests: dict[str, str] = field(default_factory=dict)  # each .metadata parsed
    headers: dict[str, bytes] = field(default_factory=dict)  # each file root's bytes, parsed
    spans: dict[str, list[tuple[int, bytes]]] = field(default_factory=dict)  # what they hold

    @property
    def inferred_world_size(self) -> int:
        """A lower bound: replicated items are written by one rank only (DCP dedup)."""
        return max(self.ranks) + 1 if self.ranks else 1

    def open(self, path: str) -> int:
        """A descriptor of the file the scan checked (see `open_checked`)."""
        return open_checked(self.root, path, self.identity.get(path), self.files[path])

    def read(self, path: str) -> bytes:
        """The bytes of a file the scan checked (a sidecar reg reads); of a file root, the
        root bytes the scan read (file_roots.py)."""
        if path in self.headers:
            return self.headers[path]
        if file_roots.is_root_name(path):  # by its ranges, as every reader of a stored copy
            fd = self.open(path)
            try:
                root, _ = file_roots.read_root(
                    path, lambda at, n: os.pread(fd, n, at), self.files[path], str(self.root / path)
                )
            finally:
                os.close(fd)
            return root
        with os.fdopen(self.open(path), "rb") as f:
            return f.read(self.files[path] + 1)

    def read_ends(self, path: str, head: int, tail: int) -> tuple[bytes, bytes]:
        """The first `head` and last `tail` bytes of a file the scan checked (a large sidecar,
        read for its structure)."""
        size = self.files[path]
        head = min(head, size)
        tail = min(tail, size - head)
        fd = self.open(path)
        try:
            return os.pread(fd, head, 0), os.pread(fd, tail, size - tail)
        finally:
            os.close(fd)

    def rank_of(self, path: str) -> int | None:
        match = RANK_FILE.fullmatch(Path(path).name)
        return int(match.group(1)) if match else None


def open_checked(root: Path, path: str, identity: Any, size: int) -> int:
    """A descriptor of `root/path` if it is still the file the scan checked, else
    InvalidCheckpoint. Each component is opened relative to its parent with O_NOFOLLOW (a file
    or directory swapped for a symlink since the scan is refused), and the opened file must be
    the scanned one: same inode and change time (a rewrite in place changes it), a regular
    file with one link, the same size."""
    parts = path.split("/")
    fd = -1
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        for part in parts[:-1]:
            parent = fd
            fd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=parent)
            os.close(parent)
        parent = fd
        fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=parent)
        os.close(parent)
    except OSError as exc:
        if fd >= 0:
            os.close(fd)
        raise InvalidCheckpoint(
            f"{root}: {path} cannot be opened safely ({exc.strerror})",
            "it changed since it was checked (a symlink?); push again when the directory "
            "is settled",
        ) from None
    st = os.fstat(fd)
    if (
        not stat.S_ISREG(st.st_mode)
        or (st.st_dev, st.st_ino, st.st_ctime_ns) != identity
        or st.st_nlink != 1
        or st.st_size != size
    ):
        os.close(fd)
        raise InvalidCheckpoint(
            f"{root}: {path} is not the file that was checked a moment ago",
            "something changed it during the push; push again when the directory is settled",
        )
    return fd


def check_kind(root: Path) -> None:
    """A directory holding DCP metadata (at the top, or one level down), or the transformers
    Trainer's plain save (its model in safetensors), not another stack's save:
    InvalidCheckpoint, one line naming what it is, otherwise. Cheap: nothing is walked,
    so `reg push-ckpt ~` answers at once."""
    try:
        st = os.lstat(root)
    except FileNotFoundError:
        raise InvalidCheckpoint(f"{root} does not exist", "give the checkpoint directory") from None
    if stat.S_ISLNK(st.st_mode):
        raise InvalidCheckpoint(f"{root} is a symlink", "give the real checkpoint directory")
    if not stat.S_ISDIR(st.st_mode):
        raise InvalidCheckpoint(f"{root} is not a directory", "give the checkpoint directory")
    has_metadata = _has_metadata(root)
    if not refuse_foreign(root, has_metadata=has_metadata) and not has_metadata:
        raise InvalidCheckpoint(
            f"{root} has no .metadata: not a complete DCP checkpoint",
            "DCP writes .metadata last; the save may not have finished",
        )


def scan_directory(root: Path, *, skip: frozenset[str] = frozenset()) -> ScannedDir:
    """Check that `root` is a complete DCP checkpoint that is safe to copy; describe it.
    `skip`: top-level files that are not the checkpoint's (the MANIFEST.json a pulled folder
    keeps, already read and checked by the caller)."""
    root = Path(root)
    check_kind(root)
    files, identity = _walk(root)
    for name in skip:
        files.pop(name, None)
        identity.pop(name, None)
    check_file_set(str(root), files)
    # Parsed from the descriptors the identity check gave, hashed: the push later refuses a
    # stored .metadata with another digest, so what was checked is what gets committed.
    metadata_bytes, spans = {}, {}
    for path in metadata_paths(files):
        with os.fdopen(open_checked(root, path, identity[path], files[path]), "rb") as f:
            if file_roots.is_root_name(path):  # the ranges that describe its tensors

                def pread(at: int, n: int, fd: int = f.fileno()) -> bytes:
                    return os.pread(fd, n, at)

                label = f"{root}/{path}"
                metadata_bytes[path], spans[path] = file_roots.read_root(
                    path, pread, files[path], label
                )
            else:
                metadata_bytes[path] = f.read()

    def read_head(path: str, offset: int) -> bytes:
        with open(root / path, "rb") as f:
            f.seek(offset)
            return f.read(9)

    scanned = scan_contents(root, files, metadata_bytes, read_head)
    scanned.identity = identity
    scanned.spans = spans
    return scanned


def scan_part(root: Path) -> tuple[dict[str, int], dict[str, tuple[int, int, int]]]:
    """The files of one writer's part of a checkpoint (`reg push-ckpt DIR --claim`): regular
    files with plain names, none reserved; `.metadata` only where the coordinator ran."""
    root = Path(root)
    try:
        st = os.lstat(root)
    except FileNotFoundError:
        raise InvalidCheckpoint(f"{root} does not exist", "give the directory") from None
    if not stat.S_ISDIR(st.st_mode):
        raise InvalidCheckpoint(f"{root} is not a directory", "give the directory")
    files, identity = _walk(root)
    if not files:
        raise InvalidCheckpoint(f"{root} holds no files", "give the directory this node wrote")
    _check_names_and_sizes(str(root), files)
    return files, identity


def check_file_set(label: str, files: dict[str, int]) -> None:
    """The file list of a checkpoint: its roots' .metadata there and of a sane size, no name
    the registry reserves. (The walk checked each name; a list from elsewhere goes through
    `check_path`.)"""
    check_roots(label, files)
    _check_names_and_sizes(label, files)


def _check_names_and_sizes(label: str, files: dict[str, int]) -> None:
    """No name the registry reserves; every `.metadata` of a sane size."""
    reserved = sorted(p for p in files if is_reserved(p))
    if reserved:
        raise InvalidCheckpoint(
            f"{label} contains {reserved[0]}, a name the registry reserves", "remove or rename it"
        )
    for path in metadata_paths(files):
        if path.endswith(METADATA) and files[path] > MAX_METADATA_BYTES:
            raise InvalidCheckpoint(
                f"{label}/{path} is {files[path]} bytes; refused", "not a DCP metadata file"
            )


def check_path(label: str, rel: str) -> None:
    """A relative file path of a checkpoint as the walk accepts it: plain name segments."""
    parts = rel.split("/")
    if len(rel) > MAX_PATH or any(
        not _NAME_SEGMENT.fullmatch(p) or p in {".", ".."} for p in parts
    ):
        raise InvalidCheckpoint(
            f"{label}: unsafe file path {rel[:80]!r}",
            f"names are letters, digits and . _ = + -, paths at most {MAX_PATH} characters",
        )


def scan_contents(
    root: Path,
    files: dict[str, int],
    metadata_bytes: dict[str, bytes],
    read_head: ReadHead | None,
) -> ScannedDir:
    """Inventory a checkpoint from its roots' `.metadata` bytes (path -> bytes) and file sizes,
    reading only the first bytes of each file's first chunk through `read_head(path, offset)`:
    the same checks wherever the files are (a local directory, or objects a client uploaded).
    `read_head=None`: reg's own StoreWriter wrote the shards (torch.save, no transforms), so
    their serialization is known and no shard is read."""
    merged = merged_metadata(metadata_bytes, light=True, sizes=files)
    return scan_merged(root, files, merged, metadata_bytes, read_head)


def scan_merged(
    root: Path,
    files: dict[str, int],
    metadata: Any,
    metadata_bytes: dict[str, bytes],
    read_head: ReadHead | None,
) -> ScannedDir:
    """`scan_contents` for a caller that merged the roots' `.metadata` already."""
    inv = inventory(metadata)
    check_ranges(inv, files, str(root))
    _check_serialization(root, inv, read_head)
    ranks = {int(m.group(1)) for p in files if (m := RANK_FILE.fullmatch(Path(p).name))}
    digests = {  # a file root's bytes here are ranges of it: not a digest of the file
        p: hashlib.sha256(data).hexdigest()
        for p, data in metadata_bytes.items()
        if not file_roots.is_root_name(p)
    }
    headers = {p: data for p, data in metadata_bytes.items() if file_roots.is_root_name(p)}
    return ScannedDir(root, files, metadata, inv, ranks, {}, digests, headers)


def _has_metadata(root: Path) -> bool:
    """A `.metadata` at the top or one level down (a few thousand entries looked at at most)."""
    if (root / METADATA).is_file():
        return True
    with os.scandir(root) as entries:
        for i, entry in enumerate(entries):
            if i >= 4096:
                return True  # let the walk decide
            if entry.is_dir(follow_symlinks=False) and (Path(entry.path) / METADATA).is_file():
                return True
    return False


def _check_serialization(root: Path, inv: Inventory, read_head: ReadHead | None) -> None:
    """Refuse what torch writes but reg cannot read back: storage transforms (compression via
    `_extensions`), and shards saved with `serialization_format=SAFETENSORS`, which torch 2.13
    cannot load either. Each chunk reg reads is a `torch.save` archive (a zip file)."""
    if inv.transforms:
        raise InvalidCheckpoint(
            f"{root} was saved with DCP storage transforms ({', '.join(sorted(inv.transforms))}"
            "), which reg does not read",
            "save without _extensions (compress the bucket or filesystem instead)",
        )
    if read_head is None:
        return
    firsts: dict[str, int] = {}
    for info in inv.tensors.values():
        for chunk in info.chunks:
            if chunk.raw:  # a safetensors tensor: its header was checked, its bytes are data
                continue
            firsts[chunk.file] = min(firsts.get(chunk.file, chunk.offset), chunk.offset)
    for path, offset in sorted(firsts.items()):
        head = read_head(path, offset)
        if head[:4] == b"PK\x03\x04":
            continue
        if len(head) == 9 and head[8:9] == b"{":
            raise InvalidCheckpoint(
                f"{root}: {path} is a safetensors file: the checkpoint was saved with "
                "serialization_format=SAFETENSORS, which torch cannot load back",
                "save with the default serialization_format (TORCH_SAVE)",
            )
        raise InvalidCheckpoint(
            f"{root}: the tensor data in {path} at byte {offset} is not a torch.save archive",
            "the shard is corrupt or was not written by torch.distributed.checkpoint",
        )


def _walk(root: Path) -> tuple[dict[str, int], dict[str, tuple[int, int, int]]]:
    files: dict[str, int] = {}
    identity: dict[str, tuple[int, int, int]] = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in list(dirnames) + filenames:
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, root)
            st = os.lstat(full)
            if stat.S_ISLNK(st.st_mode):
                raise InvalidCheckpoint(
                    f"{root}: {rel} is a symlink; refused", "copy the real files into the directory"
                )
            if not _NAME_SEGMENT.fullmatch(name) or name in {".", ".."}:
                raise InvalidCheckpoint(
                    f"{root}: unsafe file name {rel!r}", "names are letters, digits and . _ = + -"
                )
            if len(rel) > MAX_PATH:
                raise InvalidCheckpoint(
                    f"{root}: the path {rel[:60]}... is {len(rel)} characters; refused",
                    f"the registry keeps paths of at most {MAX_PATH} characters",
                )
            if stat.S_ISREG(st.st_mode):
                if st.st_nlink > 1:
                    raise InvalidCheckpoint(
                        f"{root}: {rel} has {st.st_nlink} hard links; refused",
                        "DCP never writes hard links: copy the file into the directory",
                    )
                files[rel.replace(os.sep, "/")] = st.st_size
                identity[rel.replace(os.sep, "/")] = (st.st_dev, st.st_ino, st.st_ctime_ns)
            elif not stat.S_ISDIR(st.st_mode):
                raise InvalidCheckpoint(f"{root}: {rel} is not a regular file", "remove it")
    return files, identity
