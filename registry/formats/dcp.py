"""Read PyTorch Distributed Checkpoint (DCP) directories without trusting them.

`.metadata` is a pickle, and torch's own `FileSystemReader.read_metadata` is a plain
`pickle.load`: a crafted file runs code. `load_metadata` uses an unpickler that resolves only the
globals a real DCP `.metadata` references and refuses anything else, so nothing outside that
allowlist is ever imported or called.

From the metadata the registry learns, without loading tensors: every tensor's FQN, dtype, global
shape and chunks, the byte range of each chunk in each `__R_I.distcp` file, and the top-level key
each item came from (for the resume-state inventory).
"""

from __future__ import annotations

import io
import math
import os
import pickle
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from registry.errors import InvalidCheckpoint, UnsafeMetadata

METADATA = ".metadata"
MANIFEST = "MANIFEST.json"
RANK_FILE = re.compile(r"__(\d+)_(\d+)\.distcp")
_NAME_SEGMENT = re.compile(r"[A-Za-z0-9._=-][A-Za-z0-9._=+-]*")
MAX_METADATA_BYTES = 512 * 1024 * 1024

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_ALLOWED_CLASSES = {
    (_DCP_METADATA, "Metadata"),
    (_DCP_METADATA, "TensorStorageMetadata"),
    (_DCP_METADATA, "BytesStorageMetadata"),
    (_DCP_METADATA, "ChunkStorageMetadata"),
    (_DCP_METADATA, "TensorProperties"),
    (_DCP_METADATA, "MetadataIndex"),
    (_DCP_METADATA, "StorageMeta"),
    (_DCP_METADATA, "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
}


class _SafeUnpickler(pickle.Unpickler):
    """Resolves allowlisted globals only; `light` maps them to plain stand-ins (no torch)."""

    def __init__(self, data: bytes, light: bool) -> None:
        super().__init__(io.BytesIO(data))
        self.light = light

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and name in _DTYPE_SIZES:
            return _LightDtype(name) if self.light else getattr(_torch(), name)
        if (module, name) not in _ALLOWED_CLASSES:
            raise UnsafeMetadata(
                f".metadata references {module}.{name}, which a DCP checkpoint never does; refused "
                "without running it",
                "the file is corrupt or crafted: do not load it with torch either",
            )
        if self.light:
            return _LIGHT[(module, name)]
        import importlib

        return getattr(importlib.import_module(module), name)

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeMetadata(".metadata uses persistent ids; refused", "not a DCP metadata file")


def _torch() -> Any:
    import torch

    return torch


def load_metadata(data: bytes, *, light: bool = False) -> Any:
    """Parse `.metadata` bytes through the allowlisting unpickler.

    `light=False` gives DCP's own `Metadata` (for handing to DCP's load planner); `light=True`
    gives plain stand-in objects with the same attributes, without importing torch (~2 s), which
    is all `push` needs to take an inventory.
    """
    try:
        metadata = _SafeUnpickler(data, light).load()
    except UnsafeMetadata:
        raise
    except Exception as exc:
        raise InvalidCheckpoint(
            f".metadata is corrupt: {type(exc).__name__}: {exc}",
            "rewrite the checkpoint; the file does not parse as DCP metadata",
        ) from exc
    expected = _LightObject if light else _torch_metadata_class()
    if not isinstance(metadata, expected) or not hasattr(metadata, "state_dict_metadata"):
        raise InvalidCheckpoint(
            f".metadata holds a {type(metadata).__name__}, not DCP Metadata", "not a DCP checkpoint"
        )
    return metadata


def _torch_metadata_class() -> type:
    from torch.distributed.checkpoint.metadata import Metadata

    return Metadata


# Stand-ins for light parsing: enough structure for the inventory, nothing that runs code.
_DTYPE_SIZES = {
    "float64": 8,
    "double": 8,
    "float32": 4,
    "float": 4,
    "float16": 2,
    "half": 2,
    "bfloat16": 2,
    "int64": 8,
    "long": 8,
    "int32": 4,
    "int": 4,
    "int16": 2,
    "short": 2,
    "int8": 1,
    "uint8": 1,
    "uint16": 2,
    "uint32": 4,
    "uint64": 8,
    "bool": 1,
    "complex64": 8,
    "complex128": 16,
    "complex32": 4,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
}


class _LightDtype:
    __slots__ = ("itemsize", "name")

    def __init__(self, name: str) -> None:
        self.name, self.itemsize = name, _DTYPE_SIZES[name]

    def __str__(self) -> str:
        return f"torch.{self.name}"


class _LightObject:
    """A dataclass instance rebuilt from its pickled state, attributes only."""

    _fields: tuple[str, ...] = ()

    def __init__(self, *args: Any) -> None:
        for field_name, value in zip(self._fields, args, strict=False):
            setattr(self, field_name, value)

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):
            state = {**(state[0] or {}), **state[1]}
        if isinstance(state, dict):
            self.__dict__.update(state)
        elif isinstance(state, tuple):
            for field_name, value in zip(self._fields, state, strict=False):
                setattr(self, field_name, value)


def _light_class(name: str, fields: tuple[str, ...] = ()) -> type:
    # Pickled dataclasses leave out fields still at their default: those default to None here.
    return type(name, (_LightObject,), {"_fields": fields, **dict.fromkeys(fields)})


def _light_size(*args: Any) -> tuple[int, ...]:
    return tuple(args[0]) if args else ()


_LIGHT: dict[tuple[str, str], Any] = {
    (_DCP_METADATA, "Metadata"): _light_class("Metadata", ("state_dict_metadata",)),
    (_DCP_METADATA, "TensorStorageMetadata"): _light_class(
        "TensorStorageMetadata", ("properties", "size", "chunks")
    ),
    (_DCP_METADATA, "BytesStorageMetadata"): _light_class("BytesStorageMetadata"),
    (_DCP_METADATA, "ChunkStorageMetadata"): _light_class(
        "ChunkStorageMetadata", ("offsets", "sizes")
    ),
    (_DCP_METADATA, "TensorProperties"): _light_class(
        "TensorProperties", ("dtype", "layout", "requires_grad", "memory_format", "pin_memory")
    ),
    (_DCP_METADATA, "MetadataIndex"): _light_class("MetadataIndex", ("fqn", "offset", "index")),
    (_DCP_METADATA, "StorageMeta"): _light_class("StorageMeta"),
    (_DCP_METADATA, "_MEM_FORMAT_ENCODING"): lambda value: value,
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _light_class(
        "_StorageInfo", ("relative_path", "offset", "length")
    ),
    ("torch.serialization", "_get_layout"): lambda name: name,
    ("torch", "Size"): _light_size,
    ("pathlib", "PosixPath"): PurePosixPath,
    ("pathlib", "PurePosixPath"): PurePosixPath,
    ("collections", "OrderedDict"): dict,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
}


# -- inventory --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ChunkRange:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    offset: int
    length: int


@dataclass(slots=True)
class TensorInfo:
    fqn: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    chunks: list[ChunkRange] = field(default_factory=list)


@dataclass(slots=True)
class Inventory:
    tensors: dict[str, TensorInfo]
    byte_items: dict[str, list[ChunkRange]]
    top_level: dict[str, str]  # fqn -> top-level key
    files: set[str]

    @property
    def tensor_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def top_level_keys(self) -> set[str]:
        return set(self.top_level.values())

    def model_names(self, model_keys: list[str], model_key: str) -> dict[str, str]:
        """Model state_dict name -> checkpoint FQN for the tensors under the top-level keys the
        resume classification calls the model (`model_key.` stripped; with `model_key = ""`
        the names are kept as they are)."""
        prefix = f"{model_key}." if model_key else ""
        out = {}
        for fqn in self.tensors:
            if self.top_level[fqn] in model_keys:
                out[fqn.removeprefix(prefix) if prefix and fqn.startswith(prefix) else fqn] = fqn
        return out

    def summary(self) -> dict[str, Any]:
        return {
            "tensors": len(self.tensors),
            "tensor_bytes": self.tensor_bytes,
            "objects": len(self.byte_items),
        }


def dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def inventory(metadata: Any) -> Inventory:
    """Works on DCP's own Metadata and on the light stand-ins alike (attributes only)."""
    planner_data = getattr(metadata, "planner_data", None)
    planner = planner_data if isinstance(planner_data, dict) else {}
    ranges: dict[str, dict[int, ChunkRange]] = {}
    files: set[str] = set()
    for index, info in (getattr(metadata, "storage_data", None) or {}).items():
        path = str(info.relative_path)
        files.add(path)
        ranges.setdefault(index.fqn, {})[index.index or 0] = ChunkRange(
            tuple(index.offset or ()), (), path, int(info.offset), int(info.length)
        )

    tensors: dict[str, TensorInfo] = {}
    byte_items: dict[str, list[ChunkRange]] = {}
    top_level: dict[str, str] = {}
    for fqn, meta in metadata.state_dict_metadata.items():
        key_path = planner.get(fqn)
        top_level[fqn] = str(key_path[0]) if key_path else fqn.split(".", 1)[0]
        stored = ranges.get(fqn, {})
        if hasattr(meta, "chunks"):
            itemsize = meta.properties.dtype.itemsize
            shape = tuple(int(s) for s in meta.size)
            chunks = []
            for i, chunk in enumerate(meta.chunks):
                found = _by_offsets(stored, tuple(chunk.offsets)) or stored.get(i)
                if found is None:
                    raise InvalidCheckpoint(
                        f".metadata lists chunk {i} of {fqn} with no storage location",
                        "the checkpoint is incomplete",
                    )
                chunks.append(
                    ChunkRange(
                        tuple(chunk.offsets),
                        tuple(chunk.sizes),
                        found.file,
                        found.offset,
                        found.length,
                    )
                )
            tensors[fqn] = TensorInfo(
                fqn, dtype_name(meta.properties.dtype), shape, math.prod(shape) * itemsize, chunks
            )
        else:
            byte_items[fqn] = list(stored.values())
    return Inventory(tensors, byte_items, top_level, files)


def _by_offsets(stored: dict[int, ChunkRange], offsets: tuple[int, ...]) -> ChunkRange | None:
    return next((r for r in stored.values() if r.offsets == offsets), None)


# -- directories ------------------------------------------------------------------------------


@dataclass(slots=True)
class ScannedDir:
    root: Path
    files: dict[str, int]  # relative path -> size
    metadata: Any
    inventory: Inventory
    ranks: set[int]

    @property
    def inferred_world_size(self) -> int:
        """A lower bound: replicated items are written by one rank only (DCP dedup)."""
        return max(self.ranks) + 1 if self.ranks else 1

    def rank_of(self, path: str) -> int | None:
        match = RANK_FILE.fullmatch(Path(path).name)
        return int(match.group(1)) if match else None


def scan_directory(root: Path) -> ScannedDir:
    """Check that `root` is a complete DCP checkpoint that is safe to copy; describe it."""
    root = Path(root)
    try:
        st = os.lstat(root)
    except FileNotFoundError:
        raise InvalidCheckpoint(f"{root} does not exist", "give the checkpoint directory") from None
    if stat.S_ISLNK(st.st_mode):
        raise InvalidCheckpoint(f"{root} is a symlink", "give the real checkpoint directory")
    if not stat.S_ISDIR(st.st_mode):
        raise InvalidCheckpoint(f"{root} is not a directory", "give the checkpoint directory")
    if not (root / METADATA).is_file():  # before walking: `reg push-ckpt ~` stays cheap
        raise InvalidCheckpoint(
            f"{root} has no .metadata: not a complete DCP checkpoint",
            "DCP writes .metadata last; the save may not have finished",
        )
    files = _walk(root)
    if METADATA not in files:
        raise InvalidCheckpoint(f"{root}/.metadata is not a regular file", "not a DCP checkpoint")
    if MANIFEST in files:
        raise InvalidCheckpoint(
            f"{root} contains {MANIFEST}, a name the registry reserves", "remove or rename it"
        )
    if files[METADATA] > MAX_METADATA_BYTES:
        raise InvalidCheckpoint(
            f"{root}/.metadata is {files[METADATA]} bytes; refused", "not a DCP metadata file"
        )
    metadata = load_metadata((root / METADATA).read_bytes(), light=True)
    inv = inventory(metadata)
    check_ranges(inv, files, str(root))
    ranks = {int(m.group(1)) for p in files if (m := RANK_FILE.fullmatch(Path(p).name))}
    return ScannedDir(root, files, metadata, inv, ranks)


def check_ranges(inv: Inventory, sizes: dict[str, int], where: str) -> None:
    """Every chunk named in metadata must lie inside an existing file."""
    needed: dict[str, int] = {}
    for chunk in _all_chunks(inv):
        needed[chunk.file] = max(needed.get(chunk.file, 0), chunk.offset + chunk.length)
    for path, end in sorted(needed.items()):
        if path not in sizes:
            raise InvalidCheckpoint(
                f"{where}: shard {path} named in .metadata is missing",
                "copy every rank's files before pushing",
            )
        if sizes[path] < end:
            raise InvalidCheckpoint(
                f"{where}: shard {path} is truncated: .metadata needs {end} bytes, it has "
                f"{sizes[path]}",
                "the save did not finish or the copy was cut short",
            )


def _all_chunks(inv: Inventory) -> list[ChunkRange]:
    out = [c for t in inv.tensors.values() for c in t.chunks]
    out += [c for chunks in inv.byte_items.values() for c in chunks]
    return out


def _walk(root: Path) -> dict[str, int]:
    files: dict[str, int] = {}
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
            if stat.S_ISREG(st.st_mode):
                files[rel.replace(os.sep, "/")] = st.st_size
            elif not stat.S_ISDIR(st.st_mode):
                raise InvalidCheckpoint(f"{root}: {rel} is not a regular file", "remove it")
    return files
