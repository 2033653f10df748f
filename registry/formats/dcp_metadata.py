"""Parse DCP `.metadata` without trusting it.

`.metadata` is a pickle, and torch's own `FileSystemReader.read_metadata` is a plain
`pickle.load`: a crafted file runs code. `load_metadata` uses an unpickler that resolves only the
globals a real DCP `.metadata` references and refuses anything else, so nothing outside that
allowlist is ever imported or called. `light=True` maps the allowed classes to plain stand-ins,
so a push takes its inventory without importing torch (~2 s).
"""

from __future__ import annotations

import io
import pickle
from pathlib import PurePosixPath
from typing import Any

from registry.errors import InvalidCheckpoint, UnsafeMetadata

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
