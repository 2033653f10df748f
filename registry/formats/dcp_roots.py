"""Where a checkpoint's DCP roots are, and one metadata for all of them.

Most checkpoints are one DCP root: `.metadata` at the top. accelerate's sharded FSDP
`save_state` writes several, one level down (`pytorch_model_fsdp_0/.metadata`,
`optimizer_0/.metadata`), beside its own files (`scheduler.bin`, `random_states_0.pkl`). The
registry treats such a directory as one checkpoint: each root's key paths are prefixed with the
root's name (`pytorch_model_fsdp_0.model.embed.weight`), and its chunks' files with the root's
directory, so one merged metadata describes every tensor, and inventory, validation and
consolidation read it as they read any checkpoint. Root names hold no dot, so the prefix is
unambiguous; two roots can never claim the same key path.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from registry.errors import InvalidCheckpoint, RegistryError
from registry.formats import file_roots
from registry.formats.dcp import (
    METADATA,
    STRUCTURE_ERRORS,
    HashCount,
    checked_dims,
    checked_int,
    checked_path,
    checked_text,
)
from registry.formats.dcp_metadata import load_metadata

ROOT_NAME = re.compile(r"[A-Za-z0-9_-]{1,128}")
MAX_ROOTS = 64


def roots_of(paths: Iterable[str]) -> tuple[str, ...]:
    """("",) when `.metadata` is at the top; else every directory one level down that holds
    one, sorted (accelerate); () when there is none. Names are not checked here
    (`check_roots`)."""
    paths = list(paths)
    if METADATA in paths:
        return ("",)
    return tuple(sorted(p[: -len(METADATA) - 1] for p in paths if _nested_metadata(p)))


def _nested_metadata(path: str) -> bool:
    return path.endswith("/" + METADATA) and path.count("/") == 1


def metadata_path(root: str) -> str:
    return f"{root}/{METADATA}" if root else METADATA


def metadata_paths(paths: Iterable[str]) -> tuple[str, ...]:
    """The files a checkpoint's metadata is read from: its roots' `.metadata` (see `roots_of`),
    or, with none, the files whose own bytes describe their tensors (`file_roots.roots`: the
    Trainer's safetensors model files, DeepSpeed's states files)."""
    paths = list(paths)
    return tuple(metadata_path(r) for r in roots_of(paths)) or file_roots.roots(paths)


def check_roots(label: str, paths: Iterable[str]) -> tuple[str, ...]:
    """The roots of a checkpoint's file list, or InvalidCheckpoint saying why there are none
    reg can take."""
    paths = list(paths)
    roots = roots_of(paths)
    if not roots and (models := file_roots.roots(paths)):
        return models
    if roots != ("",):
        _refuse_unfinished_roots(label, paths, roots)
    if not roots:
        raise InvalidCheckpoint(
            f"{label} has no .metadata: not a complete DCP checkpoint",
            "DCP writes .metadata last; the save may not have finished",
        )
    if len(roots) > MAX_ROOTS:
        raise InvalidCheckpoint(
            f"{label} has {len(roots)} DCP roots (directories with a .metadata); refused",
            f"a checkpoint has at most {MAX_ROOTS}",
        )
    for root in roots:
        if root and not ROOT_NAME.fullmatch(root):
            raise InvalidCheckpoint(
                f"{label}: the DCP root {root!r} has a name reg cannot prefix key paths with",
                "name DCP root directories with letters, digits, _ and - only",
            )
    return roots


def _refuse_unfinished_roots(label: str, paths: list[str], roots: tuple[str, ...]) -> None:
    """A directory one level down with DCP shards and no `.metadata` is a root whose save did
    not finish (accelerate writes the model's, then the optimizer's): not a smaller
    checkpoint."""
    for path in paths:
        parent, _, name = path.rpartition("/")
        if parent and "/" not in parent and parent not in roots and name.endswith(".distcp"):
            raise InvalidCheckpoint(
                f"{label}: {parent}/ holds DCP shards ({name}) but no .metadata",
                "DCP writes .metadata last; the save may not have finished",
            )


def merged_metadata(
    parts: Mapping[str, bytes], *, light: bool = False, sizes: Mapping[str, int] | None = None
) -> Any:
    """One metadata for the roots whose `.metadata` bytes are `parts` (path -> bytes): the
    root's own when there is one at the top, else the roots merged with prefixed key paths and
    files. `light` as in `load_metadata` (stand-ins, no torch). Safetensors roots (their
    first bytes, at least the header) give one metadata of their headers' tensors (`sizes`:
    the files', where known)."""
    if file_roots.is_file_roots(parts):
        return file_roots.metadata(parts, light=light, sizes=sizes)
    loaded = {}
    for path, data in sorted(parts.items()):
        root = path[: -len(METADATA)].rstrip("/")
        try:
            loaded[root] = load_metadata(data, light=light)
        except RegistryError as exc:
            if root:
                exc.message = f"{root}/{exc.message}"
            raise
    if list(loaded) == [""]:
        return loaded[""]
    if "" in loaded:
        raise InvalidCheckpoint("a checkpoint's roots are either the top or one level down")
    return _merge(loaded, light)


def stored_metadata(
    read: Callable[[str], bytes], paths: Iterable[str], *, light: bool = False
) -> Any:
    """The merged metadata of a stored checkpoint whose files are `paths`, each root's
    `.metadata` read through `read(path)` (which proves or pins the bytes it returns)."""
    return merged_metadata({p: read(p) for p in metadata_paths(paths)}, light=light)


@dataclass(frozen=True, slots=True)
class _Index:  # DCP's MetadataIndex, for light (stand-in) metadata; compared as DCP's is
    fqn: str
    offset: tuple[int, ...] | None = None
    index: int | None = field(default=None, compare=False)


@dataclass(frozen=True, slots=True)
class _Info:  # DCP's _StorageInfo
    relative_path: str
    offset: int
    length: int
    transform_descriptors: Any = None


@dataclass(slots=True)
class _Metadata:  # DCP's Metadata
    state_dict_metadata: dict[str, Any] = field(default_factory=dict)
    storage_data: dict[Any, Any] = field(default_factory=dict)
    planner_data: Any = None


def _merge(loaded: Mapping[str, Any], light: bool) -> Any:
    """Every field is checked before it is used, and before anything from the file is hashed
    as a dict key: a crafted offset (a deep or self-sharing tuple) hashes for ever."""
    out = _Metadata()
    hashes = HashCount("storage_data")  # an index hashes its offsets
    index_type: Any = _Index
    info_type: Any = _Info
    if not light:
        from torch.distributed.checkpoint.filesystem import _StorageInfo
        from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

        index_type, info_type = MetadataIndex, _StorageInfo
    for root, metadata in loaded.items():
        where = f"{root}/{METADATA}"
        try:
            for fqn, meta in metadata.state_dict_metadata.items():
                out.state_dict_metadata[f"{root}.{checked_text(fqn, 'an fqn')}"] = meta
            for index, info in (getattr(metadata, "storage_data", None) or {}).items():
                fqn = f"{root}.{checked_text(index.fqn, 'an fqn')}"
                offset, position = index.offset, index.index
                if light:  # torch's objects were built from checked fields (dcp_torch.py)
                    if offset is not None:
                        offset = checked_dims(offset, f"a chunk offset of {fqn}")
                    if position is not None:
                        position = checked_int(position, f"the chunk index of {fqn}")
                key = hashes.check(index_type(fqn, offset, position))
                if key in out.storage_data:
                    raise InvalidCheckpoint(
                        f"{where} gives {fqn} two storage locations at offsets {offset}",
                        "the file is corrupt or crafted",
                    )
                out.storage_data[key] = info_type(
                    f"{root}/{checked_path(info.relative_path)}",
                    checked_int(info.offset, f"the storage offset of {fqn}"),
                    checked_int(info.length, f"the storage length of {fqn}"),
                    getattr(info, "transform_descriptors", None),
                )
        except STRUCTURE_ERRORS as exc:
            raise InvalidCheckpoint(
                f"{where} does not have DCP's structure ({type(exc).__name__})",
                "the file is corrupt or crafted",
            ) from None
        except RegistryError as exc:
            exc.message = f"{root}/{exc.message}"
            raise
    if light:
        return out
    return Metadata(state_dict_metadata=out.state_dict_metadata, storage_data=out.storage_data)
