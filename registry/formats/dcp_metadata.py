"""Parse DCP `.metadata` without trusting it.

`.metadata` is a pickle, and torch's own `FileSystemReader.read_metadata` is a plain
`pickle.load`: a crafted file runs code. `load_metadata` uses an unpickler that resolves only the
globals a real DCP `.metadata` references and refuses anything else, so nothing outside that
allowlist is ever imported or called. Parsing costs time linear in the file's length whatever
it holds (`CheckedUnpickler`): no memo index, dict key or reference to a big container can make
it quadratic.

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
import struct
from pathlib import PurePosixPath
from typing import Any

from registry.errors import InvalidCheckpoint, UnsafeMetadata
from registry.formats.dcp import DTYPE_SIZES

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_DCP_PLANNER = "torch.distributed.checkpoint.planner"
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
    # Megatron's planner keeps every rank's save plan in `.metadata` (`all_local_plans`):
    # torch's own planner dataclasses, read as inert data and never used.
    (_DCP_PLANNER, "SavePlan"),
    (_DCP_PLANNER, "WriteItem"),
    (_DCP_PLANNER, "WriteItemType"),
    (_DCP_PLANNER, "TensorWriteData"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
}


# The work a stream may ask of an unpickler, per byte of it (see `CheckedUnpickler.spend`).
WORK_PER_BYTE = 2
WORK_FLOOR = 1 << 16
# How far past the memo's size a memo index may point (see `CheckedUnpickler`).
MEMO_SLACK = 64
_SIZED = {str, bytes, bytearray, tuple, list, dict, set, frozenset}


class CheckedUnpickler(pickle._Unpickler):
    """Python's own unpickler, with the work any stream can ask of it bounded by its length.

    Python's, not the C one: a crafted `LONG_BINPUT` with an index near 2^32 makes the C
    unpickler grow its memo array to that index (gigabytes, seconds). It is 3 to 6 times slower
    (40 us instead of 12 for a chunk's layout). Against streams that are short but cost the
    square of their length or more:
      - a memo index must be at most MEMO_SLACK past the memo's size (picklers number their
        memo 0, 1, 2, ...): an int hashes to itself, so indices chosen to share one probe path
        of the memo dict (distinct small ones will do) would make each insertion walk past all
        the others; indices below the dict's table size each land in a slot of their own;
      - every dict key and set member goes through `checked_key` before it is hashed, for the
        same reason (subclasses say which values may be keys);
      - a call or BUILD is charged the size of what it is handed (`spend`): a container reached
        again through the memo costs its whole size each time, so a 1 MB stream could hand one
        list of 100,000 items to 100,000 calls. More than WORK_PER_BYTE per byte is refused
        (DCP's own `.metadata` needs about 0.3).
    """

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, data: bytes) -> None:
        self.source = io.BytesIO(data)
        super().__init__(self.source)
        self._work = WORK_PER_BYTE * len(data) + WORK_FLOOR

    def checked_key(self, value: Any, target: Any) -> Any:
        """`value`, if it may be a key or member of `target` (the dict or set it goes into)."""
        if type(value) is str:  # hashed with the process's secret key: no stream can aim it
            return value
        raise pickle.UnpicklingError(f"{type(value).__name__} as a key or set member")

    def spend(self, value: Any) -> None:
        """Charge 1 plus `value`'s length and, for a tuple or list, its items' lengths (paid
        for before they are walked)."""
        work = self._work - 1
        if type(value) in _SIZED:
            work -= len(value)
            if work >= 0 and type(value) in (tuple, list):
                for item in value:
                    if type(item) in _SIZED:
                        work -= len(item)
        self._work = work
        if work < 0:
            raise pickle.UnpicklingError(
                f"the stream asks for more than {WORK_PER_BYTE} steps of work per byte"
            )

    def memo_index(self, index: int) -> int:
        held = len(self.memo)  # type: ignore[attr-defined]
        if not 0 <= index < held + MEMO_SLACK:
            raise pickle.UnpicklingError(
                f"memo index {index} out of sequence (the memo holds {held})"
            )
        return index

    def _load_put(self) -> None:
        index = self.memo_index(int(self.readline()[:-1]))  # type: ignore[attr-defined]
        self.memo[index] = self.stack[-1]  # type: ignore[attr-defined]

    def _load_long_binput(self) -> None:
        (index,) = struct.unpack("<I", self.read(4))  # type: ignore[attr-defined]
        self.memo[self.memo_index(index)] = self.stack[-1]  # type: ignore[attr-defined]

    def _load_reduce(self) -> None:
        self.spend(self.stack[-1])  # type: ignore[attr-defined]
        pickle._Unpickler.load_reduce(self)  # type: ignore[attr-defined]

    def _load_newobj(self) -> None:
        self.spend(self.stack[-1])  # type: ignore[attr-defined]
        pickle._Unpickler.load_newobj(self)  # type: ignore[attr-defined]

    def _load_newobj_ex(self) -> None:
        self.spend(self.stack[-2])  # type: ignore[attr-defined]
        self.spend(self.stack[-1])  # type: ignore[attr-defined]
        pickle._Unpickler.load_newobj_ex(self)  # type: ignore[attr-defined]

    def _instantiate(self, klass: Any, args: Any) -> None:  # INST and OBJ
        self.spend(args)
        pickle._Unpickler._instantiate(self, klass, args)  # type: ignore[attr-defined]

    def _load_build(self) -> None:
        self.spend(self.stack[-1])  # type: ignore[attr-defined]
        pickle._Unpickler.load_build(self)  # type: ignore[attr-defined]

    def _load_dict(self) -> None:
        items = self.pop_mark()  # type: ignore[attr-defined]
        target: dict[Any, Any] = {}
        for i in range(0, len(items), 2):
            target[self.checked_key(items[i], target)] = items[i + 1]
        self.append(target)  # type: ignore[attr-defined]

    def _load_setitem(self) -> None:
        stack = self.stack  # type: ignore[attr-defined]
        value, key = stack.pop(), stack.pop()
        target = stack[-1]
        target[self.checked_key(key, target)] = value

    def _load_setitems(self) -> None:
        items = self.pop_mark()  # type: ignore[attr-defined]
        target = self.stack[-1]  # type: ignore[attr-defined]
        for i in range(0, len(items), 2):
            target[self.checked_key(items[i], target)] = items[i + 1]

    def _load_additems(self) -> None:
        items = self.pop_mark()  # type: ignore[attr-defined]
        target = self.stack[-1]  # type: ignore[attr-defined]
        for item in items:
            target.add(self.checked_key(item, target))

    def _load_frozenset(self) -> None:
        items = self.pop_mark()  # type: ignore[attr-defined]
        members: set[Any] = set()
        for item in items:
            members.add(self.checked_key(item, members))
        self.append(frozenset(members))  # type: ignore[attr-defined]

    dispatch[pickle.PUT[0]] = _load_put  # type: ignore[assignment]
    dispatch[pickle.LONG_BINPUT[0]] = _load_long_binput  # type: ignore[assignment]
    dispatch[pickle.REDUCE[0]] = _load_reduce  # type: ignore[assignment]
    dispatch[pickle.NEWOBJ[0]] = _load_newobj  # type: ignore[assignment]
    dispatch[pickle.NEWOBJ_EX[0]] = _load_newobj_ex  # type: ignore[assignment]
    dispatch[pickle.BUILD[0]] = _load_build  # type: ignore[assignment]
    dispatch[pickle.DICT[0]] = _load_dict  # type: ignore[assignment]
    dispatch[pickle.SETITEM[0]] = _load_setitem  # type: ignore[assignment]
    dispatch[pickle.SETITEMS[0]] = _load_setitems  # type: ignore[assignment]
    dispatch[pickle.ADDITEMS[0]] = _load_additems  # type: ignore[assignment]
    dispatch[pickle.FROZENSET[0]] = _load_frozenset  # type: ignore[assignment]


class _SafeUnpickler(CheckedUnpickler):
    """Resolves allowlisted globals only, each to a stand-in made for this load. BUILD is
    allowed on the stand-in instances only: never on a stand-in function or a container. Keys
    are names and stand-ins (see `_key`)."""

    dispatch = dict(CheckedUnpickler.dispatch)

    def __init__(self, data: bytes) -> None:
        super().__init__(data)
        self._made: dict[tuple[str, str], Any] = {}

    def _load_build(self) -> None:
        target = self.stack[-2]  # type: ignore[attr-defined]
        if not isinstance(target, _LightObject):
            raise UnsafeMetadata(
                f".metadata sets the state of a {type(target).__name__}, which a DCP "
                "checkpoint never does; refused",
                "the file is corrupt or crafted: do not load it with torch either",
            )
        CheckedUnpickler._load_build(self)

    dispatch[pickle.BUILD[0]] = _load_build  # type: ignore[assignment]

    def checked_key(self, value: Any, target: Any) -> Any:
        if value is None or isinstance(value, str | _LightObject | _LightDtype):
            return value
        return _key(value)  # refused

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
    (_DCP_PLANNER, "SavePlan"): ("items", "storage_data", "planner_data", "usable"),
    (_DCP_PLANNER, "WriteItem"): ("index", "type", "tensor_data"),
    (_DCP_PLANNER, "TensorWriteData"): ("chunk", "properties", "size"),
}
_CONTAINERS: dict[tuple[str, str], Any] = {
    ("collections", "OrderedDict"): dict,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
}


def _key(value: Any) -> Any:
    """What may be hashed as a dict key or set member: names (hashed with the process's secret
    key) and stand-in instances (hashed by identity), which is all DCP keys its dicts by. A
    number is refused: its hash is its value, so a file can give thousands of keys one hash
    (multiples of 2^61-1) or one probe path, and each insertion then walks past all the
    others. A tuple is refused too: hashing one built from shared references costs time
    exponential in its depth, and a deep one crashes the interpreter."""
    if value is None or isinstance(value, str | _LightObject | _LightDtype):
        return value
    raise pickle.UnpicklingError(f"{type(value).__name__} as a key or set member")


def _stand_in(key: tuple[str, str]) -> Any:
    """What an allowed global resolves to, made fresh for one load."""
    if key in _FIELDS:
        return _light_class(key[1], _FIELDS[key])
    if key in _CONTAINERS:
        container = _CONTAINERS[key]

        def build(*args: Any) -> Any:  # set(iterable), OrderedDict(pairs): keys checked first
            items = args[0] if args else ()
            if container is dict:
                return {k if type(k) is str else _key(k): v for k, v in items}
            return container(v if type(v) is str else _key(v) for v in items)

        return build
    if key == ("torch", "Size"):

        def size(*args: Any) -> tuple[int, ...]:
            return tuple(args[0]) if args else ()

        return size
    if key in (("pathlib", "PosixPath"), ("pathlib", "PurePosixPath")):

        def path(*parts: Any) -> PurePosixPath:
            return PurePosixPath(*parts)

        return path

    def value(argument: Any) -> Any:  # _MEM_FORMAT_ENCODING(n), _get_layout(name), WriteItemType(n)
        return argument

    return value
