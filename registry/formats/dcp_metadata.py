"""Parse DCP `.metadata` without trusting it.

`.metadata` is a pickle, and torch's own `FileSystemReader.read_metadata` is a plain
`pickle.load`: a crafted file runs code. `load_metadata` uses an unpickler that resolves only the
globals a real DCP `.metadata` references and refuses anything else, so nothing outside that
allowlist is ever imported or called.

The stream never reaches a real class either. Every allowed global resolves to a stand-in made
for this one load (a fresh subclass of a plain attribute holder, or a fresh function), so a
stream that tries to change a class (pickle's BUILD on a class object sets its attributes)
changes only that throwaway stand-in, never torch's classes, pathlib or another load's. With
`light=False` the stand-ins are then converted, field by field and type-checked, into torch's
own metadata classes by explicit construction; with `light=True` (push) torch is never imported
(~2 s saved).
"""

from __future__ import annotations

import io
import pickle
from pathlib import PurePosixPath
from typing import Any

from registry.errors import InvalidCheckpoint, UnsafeMetadata

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
# What reading a stand-in of the wrong structure raises (a field of the wrong type, missing, too
# deep): callers turn it into one InvalidCheckpoint line.
STRUCTURE_ERRORS = (
    AttributeError,
    TypeError,
    ValueError,
    KeyError,
    IndexError,
    OverflowError,
    RecursionError,
)
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


class _SafeUnpickler(pickle._Unpickler):
    """Resolves allowlisted globals only, each to a stand-in made for this load.

    Python's own unpickler, not the C one: its memo is a dict, so a crafted `LONG_BINPUT` with
    an index near 2^32 costs one entry, where the C unpickler grows an array to that index
    (gigabytes, seconds) - parsing stays linear in the file's size. It is about 6x slower
    (9 ms instead of 1.4 ms for a 31 KB metadata). BUILD is allowed on the stand-in instances
    only: never on a stand-in function or a container."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))
        self._made: dict[tuple[str, str], Any] = {}

    def _load_build(self) -> None:
        target = self.stack[-2]  # type: ignore[attr-defined]
        if not isinstance(target, _LightObject):
            raise UnsafeMetadata(
                f".metadata sets the state of a {type(target).__name__}, which a DCP "
                "checkpoint never does; refused",
                "the file is corrupt or crafted: do not load it with torch either",
            )
        pickle._Unpickler.load_build(self)  # type: ignore[attr-defined]

    dispatch[pickle.BUILD[0]] = _load_build  # type: ignore[assignment]

    # Dict keys and set members are checked before they are hashed (see `_key`).
    def _load_dict(self) -> None:
        items = self.pop_mark()  # type: ignore[attr-defined]
        self.append({_key(items[i]): items[i + 1] for i in range(0, len(items), 2)})  # type: ignore[attr-defined]

    def _load_setitem(self) -> None:
        stack = self.stack  # type: ignore[attr-defined]
        value, key = stack.pop(), stack.pop()
        stack[-1][_key(key)] = value

    def _load_setitems(self) -> None:
        items = self.pop_mark()  # type: ignore[attr-defined]
        target = self.stack[-1]  # type: ignore[attr-defined]
        for i in range(0, len(items), 2):
            target[_key(items[i])] = items[i + 1]

    def _load_additems(self) -> None:
        items = self.pop_mark()  # type: ignore[attr-defined]
        self.stack[-1].update(_key(v) for v in items)  # type: ignore[attr-defined]

    def _load_frozenset(self) -> None:
        items = self.pop_mark()  # type: ignore[attr-defined]
        self.append(frozenset(_key(v) for v in items))  # type: ignore[attr-defined]

    dispatch[pickle.DICT[0]] = _load_dict  # type: ignore[assignment]
    dispatch[pickle.SETITEM[0]] = _load_setitem  # type: ignore[assignment]
    dispatch[pickle.SETITEMS[0]] = _load_setitems  # type: ignore[assignment]
    dispatch[pickle.ADDITEMS[0]] = _load_additems  # type: ignore[assignment]
    dispatch[pickle.FROZENSET[0]] = _load_frozenset  # type: ignore[assignment]

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and name in DTYPE_SIZES:
            return _LightDtype(name)
        if (module, name) not in _ALLOWED_CLASSES:
            raise UnsafeMetadata(
                f".metadata references {module}.{name}, which a DCP checkpoint never does; refused "
                "without running it",
                "the file is corrupt or crafted: do not load it with torch either",
            )
        key = (module, name)
        if key not in self._made:
            self._made[key] = _stand_in(key)
        return self._made[key]

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeMetadata(".metadata uses persistent ids; refused", "not a DCP metadata file")


def load_metadata(data: bytes, *, light: bool = False) -> Any:
    """Parse `.metadata` bytes through the allowlisting unpickler.

    `light=False` gives DCP's own `Metadata` (for handing to DCP's load planner); `light=True`
    gives plain stand-in objects with the same attributes, without importing torch (~2 s), which
    is all `push` needs to take an inventory.
    """
    try:
        metadata = _SafeUnpickler(data).load()
    except UnsafeMetadata:
        raise
    except Exception as exc:
        raise InvalidCheckpoint(
            f".metadata is corrupt: {type(exc).__name__}: {exc}",
            "rewrite the checkpoint; the file does not parse as DCP metadata",
        ) from exc
    if not (isinstance(metadata, _LightObject) and type(metadata).__name__ == "Metadata"):
        raise InvalidCheckpoint(
            f".metadata holds a {type(metadata).__name__}, not DCP Metadata", "not a DCP checkpoint"
        )
    if light:
        return metadata
    from registry.formats.dcp_torch import to_torch

    return to_torch(metadata)


# Stand-ins for light parsing: enough structure for the inventory, nothing that runs code.
DTYPE_SIZES = {
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
    """A dtype by name; its size comes from the table, and nothing in the stream can set it."""

    __slots__ = ("itemsize", "name")
    name: str
    itemsize: int

    def __init__(self, name: str) -> None:
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "itemsize", DTYPE_SIZES[name])

    def __setattr__(self, key: str, value: Any) -> None:
        raise TypeError("a dtype is immutable")

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


_FIELDS: dict[tuple[str, str], tuple[str, ...]] = {
    (_DCP_METADATA, "Metadata"): ("state_dict_metadata",),
    (_DCP_METADATA, "TensorStorageMetadata"): ("properties", "size", "chunks"),
    (_DCP_METADATA, "BytesStorageMetadata"): (),
    (_DCP_METADATA, "ChunkStorageMetadata"): ("offsets", "sizes"),
    (_DCP_METADATA, "TensorProperties"): (
        "dtype",
        "layout",
        "requires_grad",
        "memory_format",
        "pin_memory",
    ),
    (_DCP_METADATA, "MetadataIndex"): ("fqn", "offset", "index"),
    (_DCP_METADATA, "StorageMeta"): (),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): (
        "relative_path",
        "offset",
        "length",
    ),
}
_CONTAINERS: dict[tuple[str, str], Any] = {
    ("collections", "OrderedDict"): dict,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
}


def _key(value: Any) -> Any:
    """What may be hashed as a dict key or set member: names, numbers, stand-in instances (hashed
    by identity). A tuple key is refused: hashing one built from shared references costs time
    exponential in its depth, and a deep one crashes the interpreter."""
    if value is None or isinstance(value, str | int | _LightObject | _LightDtype):
        return value
    raise pickle.UnpicklingError(f"a {type(value).__name__} as a key or set member")


def _stand_in(key: tuple[str, str]) -> Any:
    """What an allowed global resolves to, made fresh for one load."""
    if key in _FIELDS:
        return _light_class(key[1], _FIELDS[key])
    if key in _CONTAINERS:
        container = _CONTAINERS[key]

        def build(*args: Any) -> Any:  # set(iterable), OrderedDict(pairs): keys checked first
            items = list(args[0]) if args else []
            if container is dict:
                return {_key(k): v for k, v in items}
            return container(_key(v) for v in items)

        return build
    if key == ("torch", "Size"):

        def size(*args: Any) -> tuple[int, ...]:
            return tuple(args[0]) if args else ()

        return size
    if key in (("pathlib", "PosixPath"), ("pathlib", "PurePosixPath")):

        def path(*parts: Any) -> PurePosixPath:
            return PurePosixPath(*parts)

        return path

    def value(argument: Any) -> Any:  # _MEM_FORMAT_ENCODING(n), _get_layout(name)
        return argument

    return value
