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
import zipfile
from dataclasses import dataclass
from typing import Any

from registry.errors import IntegrityError

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
}
ITEMSIZE = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}
HEAD_MAX = 1 << 20  # the bytes before a tensor's storage: data.pkl and three tiny records
TAIL_MAX = 1 << 20  # after it: two tiny records and the central directory
_LOCAL = 0x04034B50


class _Rebuild:
    def __init__(self, *args: Any) -> None:
        self.args = args


class LayoutUnpickler(pickle.Unpickler):
    """Unpickles `data.pkl` of a one-tensor archive into inert values: never a callable."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _Rebuild
        if module == "torch" and name in LEGACY_STORAGES:
            return LEGACY_STORAGES[name]
        if (module, name) == ("collections", "OrderedDict"):
            return dict
        raise pickle.UnpicklingError(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        return pid


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
        if not isinstance(obj, _Rebuild):
            return None
        (kind, storage_dtype, key, _location, numel), offset, size, stride = obj.args[:4]
        expected = tuple(math.prod(sizes[i + 1 :]) for i in range(len(sizes)))
        if (
            kind != "storage"
            or storage_dtype != dtype
            or dtype not in ITEMSIZE
            or tuple(size) != sizes
            or tuple(stride) != expected
            or offset != 0
            or numel != math.prod(sizes)
            or not isinstance(key, str)
        ):
            return None
    except (TypeError, ValueError):
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
        """After the chunk's last byte: the archive's central directory must agree."""
        if self.layout is None:
            raise NotStreamable(f"{self.where}: no tensor storage found")
        if self._got != self.layout.nbytes or self._seen != self.length:
            raise IntegrityError(
                f"{self.where}: the chunk ends before the tensor's {self.layout.nbytes} bytes",
                "the shard is corrupt; run `reg verify`",
            )
        sparse = _Sparse(bytes(self.head), self.layout.nbytes, bytes(self.tail))
        try:
            archive = zipfile.ZipFile(sparse)
            names = archive.namelist()
            root = names[0][: -len("data.pkl")] if names and names[0].endswith("data.pkl") else ""
            pickled = archive.getinfo(f"{root}data.pkl")
            data = archive.getinfo(f"{root}data/{self.layout.key}")
            byteorder = f"{root}byteorder"
            ok = (
                len(set(names)) == len(names)
                and pickled.header_offset == 0
                and pickled.compress_type == zipfile.ZIP_STORED
                and archive.read(pickled) == self._pickle
                and data.header_offset == self._data_header
                and data.compress_type == zipfile.ZIP_STORED
                and data.file_size == self.layout.nbytes
                and (byteorder not in names or archive.read(byteorder) == b"little")
            )
        except (zipfile.BadZipFile, KeyError, ValueError, OSError, EOFError) as exc:
            raise IntegrityError(
                f"{self.where}: not a well-formed tensor archive ({exc})",
                "the shard is corrupt or crafted; run `reg verify`",
            ) from None
        if not ok:
            raise IntegrityError(
                f"{self.where}: the archive's directory disagrees with its bytes",
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


class _Sparse(io.RawIOBase):
    """The archive with the storage's bytes left out (read as zeros): enough for zipfile to
    read the central directory and the small records."""

    def __init__(self, head: bytes, gap: int, tail: bytes) -> None:
        self.head, self.gap, self.tail = head, gap, tail
        self.size = len(head) + gap + len(tail)
        self.pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self.pos, 2: self.size}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        n = max(0, min(len(view), self.size - self.pos))
        done = 0
        gap_end = len(self.head) + self.gap
        while done < n:
            at = self.pos + done
            if at < len(self.head):
                piece = self.head[at : at + n - done]
            elif at < gap_end:
                piece = bytes(min(n - done, gap_end - at))
            else:
                piece = self.tail[at - gap_end : at - gap_end + n - done]
            view[done : done + len(piece)] = piece
            done += len(piece)
        self.pos += n
        return n
