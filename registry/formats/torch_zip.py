"""The layout of a one-tensor `torch.save` archive, read strictly: `canonical` accepts exactly
what torch.save writes, so that every zip reader (Python's, torch's miniz) reads the same bytes
for every name. Used by the streamed reading of a chunk (torch_archive.py) and by promotion's
fast path (dcp_load.stored_tensor_view); the tensor's storage itself is never read here.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, Protocol

LOCAL_HEADER = 0x04034B50


class NotCanonical(Exception):
    pass


class Readable(Protocol):
    """An archive's bytes, where read: a Region, a DeepSpeed file's ranges."""

    size: int

    def read(self, at: int, n: int) -> bytes: ...


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
    count, cd_size, cd_at = end_record(region, _MAX_ENTRIES)
    entries = directory(region, cd_at, cd_size, count)
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


def end_record(region: Readable, most: int) -> tuple[int, int, int]:
    """(entries, central directory size, where it starts) from the end record, the last 22
    bytes (no comment), after torch's zip64 end record and locator where present; the
    directory must end exactly where they begin and hold 3 to `most` entries."""
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
    if count < 3 or count > most or cd_at + cd_size != cd_end:
        raise NotCanonical("the central directory does not end where the end record begins")
    return count, cd_size, cd_at


def archive_pickle(region: Region, most: int, max_pickle: int) -> bytes:
    """The data.pkl of a torch.save archive of many records (an optimizer's state_dict), read
    from its head and tail alone: the central directory (in the tail, at most `most` entries,
    every one stored and under one ROOT/, no name twice) names ROOT/data.pkl first, at byte 0,
    and its local record there agrees; its bytes must lie in the head. What torch.load reads
    as data.pkl is then these bytes."""
    count, cd_size, cd_at = end_record(region, most)
    if region.gap and cd_at < region.size - len(region.tail):
        raise NotCanonical(f"its central directory is over the {len(region.tail)} bytes read")
    entries = directory(region, cd_at, cd_size, count)
    first, offset, size = entries[0]
    root, _, rest = first.partition("/")
    if rest != "data.pkl" or not root or offset != 0:
        raise NotCanonical("the first record is not ROOT/data.pkl at byte 0")
    if size > max_pickle or (region.gap and 30 + len(first) + size > len(region.head)):
        raise NotCanonical(f"its pickle is over the {len(region.head)} bytes read")
    seen: set[str] = set()
    for name, *_ in entries:
        if not name.startswith(root + "/") or name.lower() in seen:
            raise NotCanonical(f"a record {name[:80]!r} outside {root}/ or named twice")
        seen.add(name.lower())
    sig, _, flags, method, _, _, _, csize, usize, nlen, elen = struct.unpack(
        "<IHHHHHIIIHH", region.read(0, 30)
    )
    if sig != LOCAL_HEADER or method or region.read(30, nlen) != first.encode("utf-8"):
        raise NotCanonical("the local record of data.pkl disagrees with the directory")
    if not flags & 0x08 and (csize, usize) not in ((size, size), (0xFFFFFFFF, 0xFFFFFFFF)):
        raise NotCanonical("the local sizes of data.pkl disagree with the directory")
    return region.read(30 + nlen + elen, size)


def directory(region: Readable, at: int, size: int, count: int) -> list[tuple[str, int, int]]:
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
        if sig != LOCAL_HEADER or method or local_name != name.encode("utf-8"):
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
