"""A DCP chunk (one `torch.save` zip archive of a tensor) understood without `torch.load`.

`data.pkl` describes the tensor; `data/<key>` holds its raw storage, uncompressed. The layout
unpickler here knows exactly one rebuild function and the storage names, so reading the layout
never runs code from the file.

`ArchiveStream` reads a chunk as it streams past (validation's one pass over a shard): it keeps
the few header bytes before the tensor's storage, hands the storage bytes on in whole-element
pieces, keeps the short tail, and at the end asks the archive's own central directory (read from
the kept head and tail) whether the bytes it handed on were the storage `torch.load` would read.
Memory: about 1 MiB at most, whatever the chunk's size. A chunk it cannot stream (a view with an
offset or strides, a compressed record) raises `NotStreamable` before any storage byte is handed
on; the caller then holds it whole (`head` has every byte so far) and loads it with torch.
"""

from __future__ import annotations

import io
import math
import pickle
import struct
from dataclasses import dataclass
from typing import Any

from registry.errors import IntegrityError
from registry.formats.dcp_metadata import DTYPE_SIZES

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
_LOCAL = 0x04034B50


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


class LayoutUnpickler(pickle.Unpickler):
    """Unpickles `data.pkl` of a one-tensor archive into inert values: never a callable."""

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
            return dict
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
        source = io.BytesIO(head[start:])
        try:
            obj = LayoutUnpickler(source).load()
        except Exception as exc:  # truncated so far, or not a layout (whatever a pickle raises)
            if len(head) < min(self.length, HEAD_MAX):
                return False  # try again with more bytes
            raise NotStreamable(f"{self.where}: data.pkl: {type(exc).__name__}") from None
        layout = plain_layout(obj, self.dtype, self.sizes)
        if layout is None:
            raise NotStreamable(f"{self.where}: not a plain contiguous tensor")
        self._pickle = bytes(head[start : start + source.tell()])
        at = start + source.tell()
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
    if sig != _LOCAL:
        raise NotStreamable("not a zip local header")
    if method != 0:
        raise NotStreamable("a compressed record")
    start = at + 30 + name_len + extra_len
    if len(buf) < start:
        return None
    return bytes(buf[at + 30 : at + 30 + name_len]).decode("utf-8", "replace"), start


class NotCanonical(Exception):
    pass


class Region:
    """An archive's bytes with its storage left out: `head`, then `gap` bytes never read, then
    `tail`. Every structure is read from head or tail; a read that reaches into the gap means
    the archive is not what torch.save writes."""

    def __init__(self, head: Any, gap: int, tail: Any) -> None:
        self.head, self.gap, self.tail = memoryview(head), gap, memoryview(tail)
        self.size = len(self.head) + gap + len(self.tail)

    def read(self, at: int, n: int) -> bytes:
        end = at + n
        if at < 0 or n < 0 or end > self.size:
            raise NotCanonical(f"a record points outside the archive ({at}+{n})")
        if end <= len(self.head):
            return bytes(self.head[at:end])
        start = len(self.head) + self.gap
        if at >= start:
            return bytes(self.tail[at - start : end - start])
        raise NotCanonical("a record points into the tensor's storage")


@dataclass(frozen=True, slots=True)
class Canonical:
    root: str
    pickle: bytes  # data.pkl
    key: str  # the storage record's name under data/
    data_at: int  # where the storage bytes start
    data_len: int
    byteorder: bytes | None


_SMALL = {".format_version", ".storage_alignment", "byteorder", "version", ".data/version"}
_SMALL |= {".data/serialization_id", "data.pkl"}
_MAX_ENTRIES = 64


def canonical(region: Region) -> Canonical:
    """The one reading of a one-tensor archive as torch.save writes it, or NotCanonical:
    the end record is the last 22 bytes (no comment), after torch's zip64 end record and
    locator where present; the central directory ends exactly where they begin; its entries
    name `ROOT/data.pkl` first and otherwise only torch's own records under ROOT (unique, also
    ignoring case), one storage record, stored uncompressed; the local records lie back to back
    from byte 0 in directory order, each followed only by its data descriptor. Any other zip
    reader (Python's, torch's) then reads the same bytes for every name."""
    size = region.size
    end = region.read(size - 22, 22)
    sig, disk, cd_disk, count, total, cd_size, cd_at, comment = struct.unpack("<IHHHHIIH", end)
    if sig != 0x06054B50 or comment or disk or cd_disk or count != total:
        raise NotCanonical("the end record is not the archive's last 22 bytes")
    cd_end = size - 22
    if size >= 22 + 20 + 56 and region.read(size - 42, 4) == b"PK\x06\x07":
        _, loc_disk, z64_at, disks = struct.unpack("<IIQI", region.read(size - 42, 20))
        if loc_disk or disks != 1 or z64_at != size - 42 - 56:
            raise NotCanonical("a zip64 locator that does not point just before it")
        z = struct.unpack("<IQHHIIQQQQ", region.read(z64_at, 56))
        if z[0] != 0x06064B50 or z[1] != 44 or z[4] or z[5] or z[6] != z[7]:
            raise NotCanonical("a malformed zip64 end record")
        count, cd_size, cd_at, cd_end = z[7], z[8], z[9], z64_at
    if count < 3 or count > _MAX_ENTRIES or cd_at + cd_size != cd_end:
        raise NotCanonical("the central directory does not end where the end record begins")
    entries = _directory(region, cd_at, cd_size, count)
    first = entries[0][0]
    root, _, rest = first.partition("/")
    if rest != "data.pkl" or not root:
        raise NotCanonical("the first record is not ROOT/data.pkl")
    seen: set[str] = set()
    storage = []
    for name, *_ in entries:
        low = name.lower()
        sub = name[len(root) + 1 :]
        if not name.startswith(root + "/") or low in seen:
            raise NotCanonical(f"a record {name!r} outside {root}/ or named twice")
        seen.add(low)
        if sub.startswith("data/") and "/" not in sub[5:] and sub[5:]:
            storage.append(name)
        elif sub not in _SMALL:
            raise NotCanonical(f"a record {name!r} torch.save does not write")
    if len(storage) != 1 or not {f"{root}/version", f"{root}/.data/version"} & seen:
        raise NotCanonical("not exactly one storage record and a version")
    bodies = _local_records(region, entries, cd_at)
    data_at, data_len = bodies[storage[0]]
    pickled = region.read(*bodies[first])
    order = bodies.get(f"{root}/byteorder")
    return Canonical(
        root,
        pickled,
        storage[0][len(root) + 6 :],
        data_at,
        data_len,
        None if order is None else region.read(*order),
    )


def _directory(region: Region, at: int, size: int, count: int) -> list[tuple[str, int, int]]:
    """(name, local header offset, size) of each central directory entry."""
    out = []
    end = at + size
    for _ in range(count):
        fixed = struct.unpack("<IHHHHHHIIIHHHHHII", region.read(at, 46))
        (sig, _, _, flags, method, _, _, _, csize, usize, nlen, elen, clen) = fixed[:13]
        offset = fixed[16]
        name = region.read(at + 46, nlen)
        extra = region.read(at + 46 + nlen, elen)
        if sig != 0x02014B50 or method or clen or flags & 0x41:  # no encryption, no comment
            raise NotCanonical("a central directory entry that is not a stored record")
        csize, usize, offset = _zip64_sizes(extra, csize, usize, offset)
        if csize != usize:
            raise NotCanonical("a record whose stored and real sizes differ")
        try:
            text = name.decode("utf-8")
        except UnicodeDecodeError:
            raise NotCanonical("a record name that is not UTF-8") from None
        out.append((text, offset, csize))
        at += 46 + nlen + elen
    if at != end:
        raise NotCanonical("the central directory's size disagrees with its entries")
    return out


def _zip64_sizes(extra: bytes, csize: int, usize: int, offset: int) -> tuple[int, int, int]:
    """The sizes and offset an entry's zip64 extra field (0x0001) holds for its 0xFFFFFFFF
    fields, in the order the format fixes."""
    wanted = [v == 0xFFFFFFFF for v in (usize, csize, offset)]
    values = [usize, csize, offset]
    at = 0
    while at + 4 <= len(extra):
        tag, length = struct.unpack_from("<HH", extra, at)
        if tag == 0x0001:
            body, i = extra[at + 4 : at + 4 + length], 0
            for k, need in enumerate(wanted):
                if need:
                    if i + 8 > len(body):
                        raise NotCanonical("a short zip64 extra field")
                    values[k] = struct.unpack_from("<Q", body, i)[0]
                    i += 8
            wanted = [False, False, False]
        at += 4 + length
    if any(wanted):
        raise NotCanonical("a zip64 size without its extra field")
    return values[1], values[0], values[2]


def _local_records(
    region: Region, entries: list[tuple[str, int, int]], cd_at: int
) -> dict[str, tuple[int, int]]:
    """name -> (where its bytes start, length), each local record checked against its entry,
    back to back from byte 0."""
    out = {}
    expected = 0
    for i, (name, offset, size) in enumerate(entries):
        if offset != expected:
            raise NotCanonical(f"{name!r} does not start where the previous record ends")
        sig, _, flags, method, _, _, _, csize, usize, nlen, elen = struct.unpack(
            "<IHHHHHIIIHH", region.read(offset, 30)
        )
        local_name = region.read(offset + 30, nlen)
        if sig != _LOCAL or method or local_name != name.encode("utf-8"):
            raise NotCanonical(f"the local record of {name!r} disagrees with the directory")
        if not flags & 0x08 and (csize, usize) not in ((size, size), (0xFFFFFFFF, 0xFFFFFFFF)):
            raise NotCanonical(f"the local sizes of {name!r} disagree with the directory")
        start = offset + 30 + nlen + elen
        out[name] = (start, size)
        following = entries[i + 1][1] if i + 1 < len(entries) else cd_at
        expected = start + size + _descriptor(region, start + size, following, flags, size, name)
    if expected != cd_at:
        raise NotCanonical("bytes between the last record and the central directory")
    return out


def _descriptor(region: Region, at: int, following: int, flags: int, size: int, name: str) -> int:
    """The length of the data descriptor at `at` (0 without one)."""
    if not flags & 0x08:
        return 0
    length = following - at
    if length == 16:
        sig, _, csize, usize = struct.unpack("<IIII", region.read(at, 16))
    elif length == 24:
        sig, _, csize, usize = struct.unpack("<IIQQ", region.read(at, 24))
    else:
        raise NotCanonical(f"no data descriptor after {name!r}")
    if sig != 0x08074B50 or csize != size or usize != size:
        raise NotCanonical(f"the data descriptor of {name!r} disagrees with the directory")
    return length
