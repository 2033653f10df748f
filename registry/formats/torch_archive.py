"""A DCP chunk (one `torch.save` zip archive of a tensor) understood without `torch.load`.

`data.pkl` describes the tensor; `data/<key>` holds its raw storage, uncompressed. The layout
unpickler here knows exactly one rebuild function and the storage names, so reading the layout
never runs code from the file.

`ArchiveStream` reads a chunk as it streams past (validation's one pass over a shard): it keeps
the few header bytes before the tensor's storage, hands the storage bytes on in whole-element
pieces, keeps the short tail, and at the end asks `torch_zip.canonical` (reading the kept head
and tail) whether the archive is one torch.save writes and the bytes it handed on were its one
storage, the bytes `torch.load` would read.
Memory: about 1 MiB at most, whatever the chunk's size. A chunk it cannot stream (a view with an
offset or strides, a compressed record) raises `NotStreamable` before any storage byte is handed
on; the caller then holds it whole (`head` has every byte so far) and loads it with torch.

A chunk held whole is checked before torch.load reads it (`torch_pickle_bounds.check_archive`:
nothing in its pickle may make torch's unpickler do more than linear work).
"""

from __future__ import annotations

import math
import pickle
import struct
from dataclasses import dataclass
from typing import Any

from registry.errors import IntegrityError
from registry.formats.dcp import DTYPE_SIZES
from registry.formats.dcp_metadata import CheckedUnpickler
from registry.formats.torch_zip import LOCAL_HEADER, NotCanonical, Region, canonical

_ALIASES = {"double", "float", "half", "long", "int", "short"}

LEGACY_STORAGES = {
    "FloatStorage": "float32",
    "DoubleStorage": "float64",
    "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16",
    "LongStorage": "int64",
    "IntStorage": "int32",
    "ShortStorage": "int16",
    "CharStorage": "int8",
    "ByteStorage": "uint8",
    "BoolStorage": "bool",
    "ComplexFloatStorage": "complex64",
    "ComplexDoubleStorage": "complex128",
}
# The canonical dtype names a tensor can have, and their sizes.
ITEMSIZE = {name: size for name, size in DTYPE_SIZES.items() if name not in _ALIASES}
HEAD_MAX = 1 << 20  # the bytes before a tensor's storage: data.pkl and three tiny records
TAIL_MAX = 1 << 20  # after it: two tiny records and the central directory
LAYOUT_MAX = 1 << 16  # a plain tensor's data.pkl: about 160 bytes


class _Rebuild:
    """torch's _rebuild_tensor_v2 (a typed storage) or, with `v3`, _rebuild_tensor_v3 (an
    untyped storage of bytes and the dtype as an argument: float8, uint16 and newer)."""

    v3 = False

    def __init__(self, *args: Any) -> None:
        self.args = args


class _Rebuild3(_Rebuild):
    v3 = True


class _Dtype(str):
    """A dtype named in data.pkl (only ever a name)."""


class LayoutUnpickler(CheckedUnpickler):
    """Unpickles `data.pkl` of a one-tensor archive into inert values: never a callable, and no
    key but a name (a plain tensor's pickle has none)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _Rebuild
        if (module, name) == ("torch._utils", "_rebuild_tensor_v3"):
            return _Rebuild3
        if (module, name) == ("torch.storage", "UntypedStorage"):
            return "untyped"
        if module == "torch" and name in LEGACY_STORAGES:
            return LEGACY_STORAGES[name]
        if module == "torch" and name in ITEMSIZE:
            return _Dtype(name)
        if (module, name) == ("collections", "OrderedDict"):
            return _empty_dict
        raise pickle.UnpicklingError(f"{module}.{name}")

    references = 0

    def persistent_load(self, pid: Any) -> Any:
        self.references += 1
        return pid

    def load(self) -> Any:
        """The layout; a pickle that names a storage more than once is refused (torch keeps
        the first reference's dtype for a key: a decoy would change what torch reads)."""
        obj = super().load()
        if self.references != 1:
            raise pickle.UnpicklingError(f"{self.references} storage references, not one")
        return obj


def _empty_dict(*args: Any) -> dict[Any, Any]:
    """OrderedDict() as a plain tensor's pickle calls it (its backward hooks: none)."""
    if args:
        raise pickle.UnpicklingError("an OrderedDict built from arguments")
    return {}


def read_layout(pickled: bytes) -> tuple[Any, int]:
    """What the first LAYOUT_MAX bytes of `pickled` unpickle to, and the pickle's length."""
    unpickler = LayoutUnpickler(pickled[:LAYOUT_MAX])
    return unpickler.load(), unpickler.source.tell()


@dataclass(frozen=True, slots=True)
class Layout:
    """A contiguous tensor over the whole of storage `key`."""

    key: str
    dtype: str
    sizes: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.sizes) * ITEMSIZE[self.dtype]


def plain_layout(obj: Any, dtype: str, sizes: tuple[int, ...]) -> Layout | None:
    """The layout when `obj` (an unpickled data.pkl) is a contiguous `dtype` tensor of `sizes`
    over the whole of its storage; None for anything else."""
    try:
        if not isinstance(obj, _Rebuild) or dtype not in ITEMSIZE:
            return None
        (kind, storage, key, _location, numel), offset, size, stride = obj.args[:4]
        requires_grad, hooks = obj.args[4:6]
        count = math.prod(sizes)
        # Nothing after the fixed arguments: a `metadata` argument (neg or conj bits) changes
        # the values torch builds from the same bytes.
        if len(obj.args) != (7 if obj.v3 else 6) or not isinstance(requires_grad, bool):
            return None
        if not isinstance(hooks, dict) or hooks:
            return None
        if obj.v3:  # an untyped storage counts bytes; the dtype is the 7th argument
            ok = storage == "untyped" and isinstance(obj.args[6], _Dtype)
            ok = ok and obj.args[6] == dtype and numel == count * ITEMSIZE[dtype]
        else:
            ok = storage == dtype and numel == count
        expected = tuple(math.prod(sizes[i + 1 :]) for i in range(len(sizes)))
        if (
            not ok
            or kind != "storage"
            or tuple(size) != sizes
            or (count and tuple(stride) != expected)  # an empty tensor's strides say nothing
            or offset != 0
            or not isinstance(key, str)
            or type(numel) is not int
        ):
            return None
    except (TypeError, ValueError, IndexError):
        return None
    return Layout(key, dtype, sizes)


class NotStreamable(Exception):
    """This archive has to be held whole and loaded with torch."""


class ArchiveStream:
    """One chunk's bytes, fed in order (see the module docstring)."""

    def __init__(self, length: int, dtype: str, sizes: tuple[int, ...], where: str) -> None:
        self.length, self.dtype, self.sizes, self.where = length, dtype, sizes, where
        self.head = bytearray()  # every byte before the storage (all bytes, until it is found)
        self.tail = bytearray()
        self.layout: Layout | None = None
        self._pickle = b""
        self._data_header = 0  # where the storage record's local header starts
        self._start = 0  # where the storage bytes start
        self._got = 0  # storage bytes handed on
        self._carry = b""
        self._seen = 0

    @property
    def streaming(self) -> bool:
        return self.layout is not None

    def feed(self, view: memoryview) -> list[memoryview | bytes]:
        """The storage bytes in `view`, in pieces of whole elements."""
        self._seen += len(view)
        if self.layout is None:
            kept = max(0, HEAD_MAX - len(self.head))
            self.head += view[:kept]
            try:
                if not self._find_storage():
                    if len(self.head) >= HEAD_MAX:
                        raise NotStreamable(f"{self.where}: no tensor storage in the first 1 MiB")
                    return []
            except NotStreamable:
                self.head += view[kept:]  # the caller holds the chunk whole from here
                raise
            first = memoryview(bytes(self.head[self._start :]))  # at most 1 MiB
            del self.head[self._start :]
            return self._storage(first) + self._storage(view[kept:])
        return self._storage(view)

    def _storage(self, view: memoryview) -> list[memoryview | bytes]:
        assert self.layout is not None
        want = self.layout.nbytes - self._got
        body, after = view[:want], view[want:]
        self._got += len(body)
        if len(after):
            self.tail += after
            if len(self.tail) > TAIL_MAX:
                raise IntegrityError(
                    f"{self.where}: more than 1 MiB after the tensor's storage",
                    "the shard is corrupt or crafted; run `reg verify`",
                )
        out: list[memoryview | bytes] = []
        item = ITEMSIZE[self.layout.dtype]
        if self._carry:
            need = item - len(self._carry)
            self._carry += bytes(body[:need])
            body = body[need:]
            if len(self._carry) == item:
                out.append(self._carry)
                self._carry = b""
        whole = len(body) - len(body) % item
        if whole:
            out.append(body[:whole])
        if whole < len(body):
            self._carry += bytes(body[whole:])
        return out

    def _find_storage(self) -> bool:
        head = self.head
        if len(head) < 30:
            return False
        header = _local_header(head, 0)
        if header is None:
            return False
        name, start = header
        if not name.endswith("data.pkl"):
            raise NotStreamable(f"{self.where}: the archive does not start with data.pkl")
        root = name[: -len("data.pkl")]
        try:
            obj, length = read_layout(bytes(head[start : start + LAYOUT_MAX]))
        except Exception as exc:  # truncated so far, or not a layout (whatever a pickle raises)
            if len(head) < min(self.length, HEAD_MAX, start + LAYOUT_MAX):
                return False  # try again with more bytes
            raise NotStreamable(f"{self.where}: data.pkl: {type(exc).__name__}") from None
        layout = plain_layout(obj, self.dtype, self.sizes)
        if layout is None:
            raise NotStreamable(f"{self.where}: not a plain contiguous tensor")
        self._pickle = bytes(head[start : start + length])
        at = start + length
        target = f"{root}data/{layout.key}"
        while (at := head.find(b"PK\x03\x04", at)) >= 0:
            header = _local_header(head, at)
            if header is None:
                return False  # the header is not all here yet
            if header[0] == target:
                self.layout, self._data_header, self._start = layout, at, header[1]
                return True
            at += 4
        return False

    def finish(self) -> None:
        """After the chunk's last byte: the archive must be canonical (`canonical`), with the
        bytes handed on as its one storage record."""
        if self.layout is None:
            raise NotStreamable(f"{self.where}: no tensor storage found")
        if self._got != self.layout.nbytes or self._seen != self.length:
            raise IntegrityError(
                f"{self.where}: the chunk ends before the tensor's {self.layout.nbytes} bytes",
                "the shard is corrupt; run `reg verify`",
            )
        try:
            found = canonical(Region(bytes(self.head), self.layout.nbytes, bytes(self.tail)))
        except (NotCanonical, struct.error, ValueError) as exc:
            raise IntegrityError(
                f"{self.where}: not an archive torch.save writes ({exc})",
                "the shard is corrupt or crafted; run `reg verify`",
            ) from None
        if (
            found.data_at != len(self.head)
            or found.data_len != self.layout.nbytes
            or found.key != self.layout.key
            or found.pickle != self._pickle
            or found.byteorder not in (None, b"little")
        ):
            raise IntegrityError(
                f"{self.where}: the archive's directory disagrees with the bytes checked",
                "the shard is corrupt or crafted; run `reg verify`",
            )


def _local_header(buf: bytearray, at: int) -> tuple[str, int] | None:
    """(name, where its data starts) of the local file header at `at`; None when the buffer
    ends inside it."""
    if len(buf) < at + 30:
        return None
    sig, _, _, method, _, _, _, _, _, name_len, extra_len = struct.unpack_from(
        "<IHHHHHIIIHH", buf, at
    )
    if sig != LOCAL_HEADER:
        raise NotStreamable("not a zip local header")
    if method != 0:
        raise NotStreamable("a compressed record")
    start = at + 30 + name_len + extra_len
    if len(buf) < start:
        return None
    return bytes(buf[at + 30 : at + 30 + name_len]).decode("utf-8", "replace"), start
