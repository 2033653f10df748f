"""What `torch.load` may be handed: a torch.save pickle read first without torch, charged the
work torch's unpickler would spend on it.

Whatever is handed to torch.load (a chunk held whole, a byte item, a sidecar) first passes
`check_archive` or `check_pickle`: nothing in it may make torch's unpickler, which is pure Python
and builds plain dicts, do more than linear work. `read_structure` and `read_tensors` read a
pickle's containers (and the storage records its tensors lie in) through the same bounded
reader, running nothing from the file.

Apart from torch_archive.py (a DCP chunk's one-tensor archive read as it streams): every reader
of a torch.save pickle needs these bounds (sidecars, DeepSpeed's files, chunks held whole), and
none of them needs the streaming. The storage names come from there (`LEGACY_STORAGES`).
"""

from __future__ import annotations

import _compat_pickle
import io
import math
import pickle
import zipfile
from dataclasses import dataclass, field
from typing import Any

from registry.formats.dcp_metadata import MEMO_SLACK, CheckedUnpickler
from registry.formats.torch_archive import LEGACY_STORAGES

# torch.load(weights_only=True) unpickles with torch's own pure-Python unpickler into plain
# dicts, so a pickle of 1 MB can cost it minutes: dict keys that share one hash (ints that are
# multiples of 2^61-1, floats equal to them, tuples of them) or one probe path (distinct small
# ints chosen for it), memo indices chosen the same way, and containers reached again through
# the memo and handed to call after call. `check_pickle` reads the stream first, building
# only the containers whose keys torch would hash, and refuses those.

MAX_OTHER_KEYS = 2048  # per pickle: keys that are neither names nor whole numbers in sequence
MAX_KEY_DEPTH = 32  # a key's tuples inside tuples


class Unbounded(pickle.UnpicklingError):
    """A pickle torch.load would take more than linear time over (one line)."""


def check_archive(data: bytes) -> None:
    """Every data.pkl of the torch.save archive `data` passes `check_pickle` (Unbounded or
    whatever a malformed zip or pickle raises, otherwise)."""
    if bytes(data[:4]) != b"PK\x03\x04":  # torch.load reads anything else as a bare pickle
        raise Unbounded("not a torch.save zip archive")
    archive = zipfile.ZipFile(io.BytesIO(data))
    for record in archive.infolist():
        if record.filename.rsplit("/", 1)[-1] == "data.pkl":
            check_pickle(archive.read(record))


def check_pickle(pickled: bytes) -> None:
    """Refuse (Unbounded) a pickle on which torch.load(weights_only=True) would do more than
    linear work; anything torch would refuse anyway may raise something else."""
    _TorchLoadBounds(pickled).load()


def read_structure(pickled: bytes) -> Any:
    """The containers of a torch.save pickle, read without torch and without running anything:
    dicts, lists and plain values as they are, every object an opaque stand-in (a run's
    argparse.Namespace, an enum, a tensor). Unbounded as `check_pickle`."""
    return _TorchLoadBounds(pickled).load()


@dataclass(frozen=True, slots=True)
class StoredTensor:
    """A tensor a torch.save pickle names (`read_tensors`): its storage record
    (`ROOT/data/<key>`, `storage_numel` elements of `dtype`) and where in it the tensor lies."""

    key: str
    dtype: str
    storage_numel: int
    offset: int  # elements into the storage
    shape: tuple[int, ...]
    stride: tuple[int, ...]


def read_tensors(pickled: bytes) -> Any:
    """`read_structure`, with each tensor torch's `_rebuild_tensor_v2` would build from a
    storage of a known dtype a `StoredTensor` and each `torch.Size` a tuple of its dimensions
    (anything else still an opaque stand-in). Nothing is read from the storages here."""
    unpickler = _TorchLoadBounds(pickled)
    unpickler.tensors = True
    return unpickler.load()


@dataclass(frozen=True, slots=True)
class _StorageRef:
    key: str
    dtype: str
    numel: int


def _storage_ref(pid: Any, seen: dict[Any, Any]) -> Any:
    """('storage', torch.FloatStorage, key, location, numel), as torch.save writes a typed
    storage; anything else opaque. torch.load makes a record's storage at its first mention and
    hands that one to every later one: a record named twice, in two ways, is refused (one read
    as another dtype than torch reads it)."""
    if type(pid) is not tuple or len(pid) != 5 or pid[0] != "storage":
        return _Made(1)
    _, kind, key, _, numel = pid
    module, _, name = kind.name.rpartition(".") if isinstance(kind, _Global) else ("", "", "")
    dtype = LEGACY_STORAGES.get(name) if module == "torch" else None
    described = (dtype, numel) if dtype is not None and type(numel) is int and numel >= 0 else None
    # (torch reads the record data/{key}: 0 and "0" name one)
    named = str(key) if type(key) is str or type(key) is int else None
    if named is not None and seen.setdefault(named, described) != described:
        raise pickle.UnpicklingError("a storage record named twice, in two ways")
    if described is None or type(key) is not str:
        return _Made(1)
    return _StorageRef(key, *described)


def _whole(values: Any) -> bool:
    return type(values) is tuple and all(type(v) is int and v >= 0 for v in values)


def _tensor(args: tuple[Any, ...]) -> Any:
    """torch._utils._rebuild_tensor_v2(storage, offset, size, stride, ...) as a StoredTensor,
    when every argument is what torch.save writes; else opaque."""
    if len(args) < 4 or not isinstance(args[0], _StorageRef):
        return _Made(1)
    storage, offset, shape, stride = args[:4]
    if type(offset) is not int or offset < 0 or not _whole(shape) or not _whole(stride):
        return _Made(1)
    if len(shape) != len(stride):
        return _Made(1)
    return StoredTensor(storage.key, storage.dtype, storage.numel, offset, shape, stride)


class _TorchLoadBounds(CheckedUnpickler):
    """Reads a pickle as torch's weights_only unpickler would, with every global an inert
    stand-in (`_Global`), and charges it what torch's unpickler will spend:
      - dict keys and set members (`checked_key`): a name is free (hashed with the process's
        secret key); a whole number k is free while k < (the numbers before it in that dict,
        less its other keys) + MEMO_SLACK, as an optimizer's state numbers its parameters 0,
        1, 2, ...: a dict's table has over 1.5 slots per key, so such numbers stay below its
        size and each lands in a slot of its own (an int hashes to itself). Any other key (any
        other number, a float, a tuple, a tensor, None) counts towards MAX_OTHER_KEYS per pickle,
        which bounds their collisions to a constant, and costs the work of hashing it (a tuple
        is hashed whole every time, and one of shared references holds exponentially many);
      - memo indices and the size of what calls are handed, as for every CheckedUnpickler;
      - the containers torch builds from an argument (OrderedDict, Counter, set) are built
        here too, key by key, and so is what `_rebuild_from_type_v2` calls and BUILD's dict
        state (into the object's own dict)."""

    dispatch = dict(CheckedUnpickler.dispatch)

    def __init__(self, data: bytes) -> None:
        super().__init__(data)
        self.encoding = "utf-8"  # torch.load's: SHORT_BINSTRING is text
        self.tensors = False  # `read_tensors`: tensors and torch.Size as values
        self._storages: dict[Any, Any] = {}  # key -> (dtype, numel) as first named
        self._others = 0
        self._bounds: dict[int, tuple[Any, _Bounds]] = {}  # id(container) -> it, its bounds
        self._attrs: dict[int, tuple[Any, dict[Any, Any]]] = {}  # id(object) -> it, its dict

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _compat_pickle.NAME_MAPPING:  # as torch maps Python 2's names
            module, name = _compat_pickle.NAME_MAPPING[(module, name)]
        elif module in _compat_pickle.IMPORT_MAPPING:
            module = _compat_pickle.IMPORT_MAPPING[module]
        return _Global(self, module, name)

    def persistent_load(self, pid: Any) -> Any:
        return _storage_ref(pid, self._storages) if self.tensors else _Made(1)

    def checked_key(self, value: Any, target: Any) -> Any:
        kind = type(value)
        if kind is str:
            return value
        held = self._bounds.get(id(target))
        if held is None:
            held = self._bounds[id(target)] = (target, _Bounds())
        bounds = held[1]
        if kind is int or kind is bool or (kind is float and value.is_integer()):
            number = int(value)  # a float equal to a whole number hashes and compares as it
            if 0 <= number < bounds.numbers - bounds.others + MEMO_SLACK:
                seen = bounds.seen
                if number >= len(seen):
                    seen.extend(bytes(number + 1 - len(seen)))
                if not seen[number]:
                    seen[number] = 1
                    bounds.numbers += 1
                return value
        bounds.others += 1
        self._others += 1
        if self._others > MAX_OTHER_KEYS:
            raise Unbounded(
                f"over {MAX_OTHER_KEYS} keys that are neither names nor whole numbers in sequence"
            )
        self.charge(_hash_work(value, self._work + 1))
        return value

    def charge(self, work: int) -> None:
        self._work -= work
        if self._work < 0:
            raise Unbounded("the stream asks for more work than its length allows")

    def spend(self, value: Any) -> None:
        try:
            super().spend(value)
        except pickle.UnpicklingError as exc:
            raise Unbounded(str(exc)) from None

    def memo_index(self, index: int) -> int:
        try:
            return super().memo_index(index)
        except pickle.UnpicklingError as exc:
            raise Unbounded(str(exc)) from None

    def fill(self, target: Any, source: Any, pairs: bool) -> Any:
        """`target` (a dict or set) filled as torch fills one from `source`, key by key."""
        if not isinstance(source, dict | str | list | tuple):
            raise pickle.UnpicklingError(f"a container built from a {type(source).__name__}")
        keys: Any = source
        if pairs and isinstance(source, list | tuple):  # OrderedDict([(key, value), ...])
            if not all(type(p) in (tuple, list) and len(p) == 2 for p in source):
                raise pickle.UnpicklingError("an OrderedDict built from other than pairs")
            keys = (p[0] for p in source)
        add = target.add if isinstance(target, set) else target.setdefault
        for key in keys:
            add(key if type(key) is str else self.checked_key(key, target))
        return target

    def set_state(self, target: Any, state: Any) -> None:
        """BUILD's dict state (or a (state, slotstate) pair) into `target`'s own dict; a numpy
        dtype's or array's state is checked to be plain numbers (`_numpy_state`)."""
        if isinstance(target, _NumpyDtype | _NumpyArray):
            _numpy_state(target, state)
            return
        held = self._attrs.get(id(target))
        if held is None:
            held = self._attrs[id(target)] = (target, {})
        attrs = held[1]
        for part in state if type(state) is tuple and len(state) == 2 else (state,):
            if isinstance(part, dict):
                for key in part:
                    attrs[self.checked_key(key, attrs)] = None

    def _load_build(self) -> None:
        self.spend(self.stack[-1])  # type: ignore[attr-defined]
        state = self.stack.pop()  # type: ignore[attr-defined]
        self.set_state(self.stack[-1], state)  # type: ignore[attr-defined]

    def _load_newobj(self) -> None:
        self.spend(self.stack[-1])  # type: ignore[attr-defined]
        self.stack.pop()  # type: ignore[attr-defined]
        self.append(self.stack.pop().new())  # type: ignore[attr-defined]

    def _load_newobj_ex(self) -> None:
        self.spend(self.stack[-2])  # type: ignore[attr-defined]
        self.spend(self.stack[-1])  # type: ignore[attr-defined]
        del self.stack[-2:]  # type: ignore[attr-defined]
        self.append(self.stack.pop().new())  # type: ignore[attr-defined]

    dispatch[pickle.BUILD[0]] = _load_build  # type: ignore[assignment]
    dispatch[pickle.NEWOBJ[0]] = _load_newobj  # type: ignore[assignment]
    dispatch[pickle.NEWOBJ_EX[0]] = _load_newobj_ex  # type: ignore[assignment]


@dataclass(slots=True)
class _Bounds:
    """One dict's or set's keys so far: which whole numbers, how many, how many others."""

    seen: bytearray = field(default_factory=bytearray)
    numbers: int = 0
    others: int = 0


class _Made:
    """What torch builds by calling a global: opaque here; `work` is what hashing it may cost
    (torch.Size hashes every dimension)."""

    __slots__ = ("work",)

    def __init__(self, work: int) -> None:
        self.work = work


# numpy arrays: numpy's own __setstate__ trusts its state (an object dtype, or data shorter
# than the shape, makes it read pointers out of the heap: a crash, or worse). Wherever numpy's
# globals are allowed (RNG states), every array in a pickle must be plain numbers whose bytes
# are exactly its shape's, its dtype one of these (numpy's pickled codes -> item size).
NUMERIC_DTYPES = {
    "b1": 1, "i1": 1, "u1": 1, "i2": 2, "u2": 2, "f2": 2, "i4": 4, "u4": 4, "f4": 4,
    "i8": 8, "u8": 8, "f8": 8, "c8": 8, "c16": 16,
}  # fmt: skip
NUMPY_RECONSTRUCT = ("numpy._core.multiarray._reconstruct", "numpy.core.multiarray._reconstruct")


class _NumpyDtype(_Made):
    __slots__ = ("itemsize",)

    def __init__(self, itemsize: int) -> None:
        super().__init__(1)
        self.itemsize = itemsize


class _NumpyArray(_Made):
    __slots__ = ("built",)

    def __init__(self) -> None:
        super().__init__(1)
        self.built = False


class NotPlain(Unbounded):
    """A numpy array in a pickle that is not plain numbers of exactly its bytes."""


def _not_plain(what: str) -> NotPlain:
    return NotPlain(f"a numpy array that is not plain numbers ({what})")


def _numpy_dtype(args: tuple[Any, ...]) -> _NumpyDtype:
    """numpy.dtype(code, align, copy): a plain numeric code only."""
    code = args[0] if args else None
    if type(code) is not str or code not in NUMERIC_DTYPES:
        raise _not_plain(f"dtype {str(code)[:20]!r}")
    return _NumpyDtype(NUMERIC_DTYPES[code])


def _numpy_state(target: _Made, state: Any) -> None:
    """BUILD of a dtype (no subarray, names or fields) or of an array (version, shape, dtype,
    fortran order, exactly its bytes)."""
    if type(state) is not tuple:
        raise _not_plain("its state is not a tuple")
    if isinstance(target, _NumpyDtype):
        if len(state) < 5 or any(part is not None for part in state[2:5]):
            raise _not_plain("a dtype with fields or a subarray")
        return
    assert isinstance(target, _NumpyArray)
    if target.built or len(state) != 5:
        raise _not_plain("an array's state is not numpy's")
    _, shape, dtype, _, data = state
    if not (type(shape) is tuple and all(type(n) is int and n >= 0 for n in shape)):
        raise _not_plain("its shape is not whole numbers")
    if not isinstance(dtype, _NumpyDtype) or type(data) is not bytes:
        raise _not_plain("its dtype or its data")
    if len(data) != math.prod(shape) * dtype.itemsize:
        raise _not_plain(f"{len(data)} bytes for shape {shape[:8]}")
    target.built = True


class _Global:
    """A global the stream names, called or instantiated as torch would, building nothing but
    the containers whose keys torch hashes."""

    def __init__(self, owner: _TorchLoadBounds, module: str, name: str) -> None:
        self.owner, self.name = owner, f"{module}.{name}"

    def new(self) -> Any:  # NEWOBJ: cls.__new__(cls, *args) leaves a container empty
        if self.name.startswith("numpy."):  # numpy pickles by REDUCE, never so
            raise _not_plain(f"{self.name[:60]} built by NEWOBJ")
        if self.name in ("collections.OrderedDict", "collections.Counter"):
            return {}
        if self.name == "builtins.set":
            return set()
        return _Made(1)

    def __call__(self, *args: Any) -> Any:
        owner, name = self.owner, self.name
        if name == "numpy.dtype":
            return _numpy_dtype(args)
        if name in NUMPY_RECONSTRUCT:
            if not (args and isinstance(args[0], _Global) and args[0].name == "numpy.ndarray"):
                raise _not_plain("_reconstruct of another class")
            return _NumpyArray()
        if name == "numpy.dtypes.UInt32DType":
            return _NumpyDtype(4)
        if name.startswith("numpy."):  # numpy pickles arrays by _reconstruct and BUILD only
            raise _not_plain(f"{name[:60]} called")
        if name == "_codecs.encode":  # protocol 2's bytes: an array's data
            if len(args) == 2 and type(args[0]) is str and args[1] == "latin1":
                owner.charge(len(args[0]))
                return args[0].encode("latin1")
            return _Made(1)
        if name in ("collections.OrderedDict", "collections.Counter", "builtins.set"):
            if not args:
                return self.new()
            return owner.fill(self.new(), args[0], pairs=name == "collections.OrderedDict")
        if name == "builtins.bytearray" and args and type(args[0]) is int:
            owner.charge(max(args[0], 0))  # bytearray(n) allocates n bytes
        if owner.tensors and name == "torch._utils._rebuild_tensor_v2":
            return _tensor(args)
        if owner.tensors and name == "torch.Size" and len(args) == 1 and _whole(args[0]):
            return args[0]
        if name == "torch._tensor._rebuild_from_type_v2" and len(args) == 4:
            func, _, func_args, state = args  # torch calls func(*func_args), sets the state
            owner.spend(func_args)
            made = func(*func_args) if isinstance(func, _Global) else _Made(1)
            owner.set_state(made, state)
            return made
        return _Made(1 + sum(len(a) for a in args if type(a) in (tuple, list, str)))


def _hash_work(value: Any, cap: int) -> int:
    """The work of hashing `value` once (tuples are hashed whole, every time: a tuple of shared
    references counts every path), at most about `cap`. A key nested deeper than MAX_KEY_DEPTH
    is refused: hashing recurses in C, and a deep one crashes the interpreter."""
    sizes: dict[int, int] = {}

    def work(node: Any, depth: int) -> int:
        if type(node) is _Made:
            return int(node.work)
        if type(node) is not tuple:
            return 1
        if depth > MAX_KEY_DEPTH:
            raise Unbounded(f"a key nested over {MAX_KEY_DEPTH} deep")
        known = sizes.get(id(node))
        if known is None:
            known = 1
            for item in node:
                known += work(item, depth + 1)
                if known > cap:
                    break
            sizes[id(node)] = known
        return known

    return work(value, 0)
