"""What a DCP checkpoint's metadata says, checked: the inventory.

The metadata is parsed by `registry.formats.dcp_metadata` (an allowlisting unpickler). From it
the registry learns, without loading tensors: every tensor's FQN, dtype, global shape and chunks,
and the byte range of each chunk in each `__R_I.distcp` file; its key paths (the FQNs) are what
resume state is decided from (policies/resume.py). Every number is bounded and every tensor's
chunks must tile it exactly. Reading a directory of files is `dcp_scan.py`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Any

from registry.errors import InvalidCheckpoint

METADATA = ".metadata"
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
# Bytes per element of each dtype a checkpoint may name (torch's names and aliases).
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

# -- inventory --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ChunkRange:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    offset: int
    length: int
    raw: bool = False  # the tensor's own bytes (a safetensors file), not a torch.save archive


@dataclass(frozen=True, slots=True)
class RawStorage:
    """Where a tensor's raw bytes are in a safetensors file (`safetensors_root.py`): built from
    a checked header only, never from a `.metadata` (DCP's unpickler cannot make one)."""

    relative_path: str
    offset: int
    length: int
    transform_descriptors: Any = None


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
    files: set[str]
    transforms: set[str] = field(default_factory=set)  # DCP storage transforms, e.g. ZStandard/1

    @property
    def tensor_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def summary(self) -> dict[str, Any]:
        return {
            "tensors": len(self.tensors),
            "tensor_bytes": self.tensor_bytes,
            "objects": len(self.byte_items),
        }


def dtype_name(dtype: Any) -> str:
    """A stand-in's name, or a torch dtype's; anything else is "unknown" (never str() of an
    object from the file, which could be a structure built to make that slow)."""
    name = getattr(dtype, "name", None)
    if isinstance(name, str):
        return name
    if type(dtype).__module__ == "torch" and type(dtype).__name__ == "dtype":
        return str(dtype).removeprefix("torch.")
    return "unknown"


# Every number in .metadata is a whole number below 2^63 (what torch itself can hold), a shape
# has at most 64 dimensions and at most 2^63 elements: checked before any arithmetic, so a
# crafted 10^5000 cannot make a check slow or fail with something other than one line.
MAX_INT = 2**63 - 1
MAX_DIMS = 64


def checked_int(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_INT:
        raise InvalidCheckpoint(
            f".metadata: {where} is not a whole number in 0..2^63", "the file is corrupt or crafted"
        )
    return value


def checked_dims(value: Any, where: str) -> tuple[int, ...]:
    if not isinstance(value, tuple | list) or len(value) > MAX_DIMS:
        raise InvalidCheckpoint(
            f".metadata: {where} is not a shape", "the file is corrupt or crafted"
        )
    dims = tuple(checked_int(v, where) for v in value)
    count = 1
    for d in dims:
        count *= d
        if count > MAX_INT:
            raise InvalidCheckpoint(
                f".metadata: {where} is too large", "the file is corrupt or crafted"
            )
    return dims


def packed(numbers: tuple[int, ...] | int) -> bytes:
    """Checked numbers (0..2^63) as a dict key. An int hashes to itself (a tuple of ints, to a
    function of theirs that anyone can compute), so a file can pick numbers that share one
    probe path of a dict, and each insertion then walks past all the others; bytes hash with
    the process's secret key."""
    if isinstance(numbers, int):
        return numbers.to_bytes(8, "little")
    return b"".join(n.to_bytes(8, "little") for n in numbers)


MAX_SAME_HASH = 16


class HashCount:
    """The keys of one dict, counted by hash: more than MAX_SAME_HASH sharing one is refused.
    DCP keys storage_data by MetadataIndex, which hashes its fqn (text: salted, so no file can
    aim where its keys land) with its offsets (numbers: not salted). Keys of one fqn can still
    be made to hash alike (an offset with a 0 lets the other dimensions take any values equal
    modulo 2^61-1), and n of them cost n^2 comparisons."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.counts: dict[bytes, int] = {}

    def check(self, key: Any) -> Any:
        found = hash(key).to_bytes(8, "little", signed=True)
        count = self.counts[found] = self.counts.get(found, 0) + 1
        if count > MAX_SAME_HASH:
            raise InvalidCheckpoint(
                f".metadata: over {MAX_SAME_HASH} {self.where} keys share one hash",
                "the file is corrupt or crafted",
            )
        return key


def checked_path(value: Any) -> str:
    """A storage location: text, or the path object an older torch pickled."""
    return checked_text(str(value) if isinstance(value, PurePath) else value, "a relative path")


def checked_text(value: Any, where: str) -> str:
    if not isinstance(value, str) or len(value) > 4096:
        raise InvalidCheckpoint(
            f".metadata: {where} is not a name", "the file is corrupt or crafted"
        )
    return value


def inventory(metadata: Any) -> Inventory:
    """Works on DCP's own Metadata and on the light stand-ins alike (attributes only). A
    metadata of the wrong structure (a field of the wrong type anywhere) is InvalidCheckpoint."""
    try:
        return _inventory(metadata)
    except STRUCTURE_ERRORS as exc:
        raise InvalidCheckpoint(
            f".metadata does not have DCP's structure ({type(exc).__name__}: {exc})",
            "the file is corrupt or crafted",
        ) from None


def _inventory(metadata: Any) -> Inventory:
    ranges: dict[str, dict[bytes, ChunkRange]] = {}  # fqn -> packed chunk offsets -> range
    with_offsets: set[str] = set()  # fqns stored with offsets: tensors (torch finds bytes by fqn)
    files: set[str] = set()
    transforms: set[str] = set()
    for index, info in (getattr(metadata, "storage_data", None) or {}).items():
        path = checked_path(info.relative_path)
        fqn = checked_text(index.fqn, "an fqn")
        offset = checked_int(info.offset, f"the storage offset of {fqn}")
        length = checked_int(info.length, f"the storage length of {fqn}")
        files.add(path)
        for descriptor in getattr(info, "transform_descriptors", None) or ():
            transforms.add(checked_text(descriptor, "a transform"))
        # Torch finds a chunk's bytes by its fqn and offsets (MetadataIndex compares only
        # those; `index` is a hint, and Megatron leaves it None on every chunk): so does reg.
        # A bytes item has no offsets: one per fqn.
        offsets = checked_dims(index.offset or (), f"the chunk offsets of {fqn}")
        if index.offset is not None:
            with_offsets.add(fqn)
        if index.index is not None:
            checked_int(index.index, f"the chunk index of {fqn}")
        where = ranges.setdefault(fqn, {})
        key = packed(offsets)
        if key in where:
            raise InvalidCheckpoint(
                f".metadata gives {fqn} two storage locations at offsets {offsets}",
                "the file is corrupt or crafted",
            )
        where[key] = ChunkRange(offsets, (), path, offset, length, type(info) is RawStorage)

    tensors: dict[str, TensorInfo] = {}
    byte_items: dict[str, list[ChunkRange]] = {}
    for fqn, meta in metadata.state_dict_metadata.items():
        checked_text(fqn, "an fqn")
        stored = ranges.get(fqn, {})  # packed offsets -> where the bytes are
        if hasattr(meta, "chunks"):
            dtype = dtype_name(meta.properties.dtype)
            itemsize = DTYPE_SIZES.get(dtype)  # from the table, never from the file
            if itemsize is None:
                raise InvalidCheckpoint(f".metadata: {fqn} has an unknown dtype", "not DCP")
            shape = checked_dims(meta.size, f"the shape of {fqn}")
            if not isinstance(meta.chunks, list):
                raise InvalidCheckpoint(f".metadata: the chunks of {fqn} are not a list", "not DCP")
            chunks = []
            for i, chunk in enumerate(meta.chunks):
                offsets = checked_dims(chunk.offsets, f"a chunk offset of {fqn}")
                sizes = checked_dims(chunk.sizes, f"a chunk size of {fqn}")
                found = stored.get(packed(offsets))
                if found is None:
                    raise InvalidCheckpoint(
                        f".metadata lists chunk {i} of {fqn} with no storage location",
                        "the checkpoint is incomplete",
                    )
                chunks.append(
                    ChunkRange(offsets, sizes, found.file, found.offset, found.length, found.raw)
                )
            problem = cover_problem(fqn, shape, chunks)
            if problem is not None:
                raise InvalidCheckpoint(
                    f".metadata: {problem}",
                    "every element must come from exactly one chunk: the metadata is corrupt "
                    "or crafted",
                )
            tensors[fqn] = TensorInfo(fqn, dtype, shape, math.prod(shape) * itemsize, chunks)
        else:
            if fqn in with_offsets:  # torch looks a bytes item up without offsets: not found
                raise InvalidCheckpoint(
                    f".metadata stores the bytes item {fqn} at chunk offsets",
                    "the file is corrupt or crafted",
                )
            byte_items[fqn] = list(stored.values())
    return Inventory(tensors, byte_items, files, transforms)


def cover_problem(fqn: str, shape: tuple[int, ...], chunks: list[ChunkRange]) -> str | None:
    """None if `chunks` tile `shape` exactly: each inside it, none overlapping another, their
    elements adding up to the tensor's (disjoint + the full count = every element exactly
    once, so no byte of a loaded tensor is left uninitialised). The overlap test is a sweep:
    about linear for row or column shards, and the grid's width for 2-D grids."""
    total = 0
    for chunk in chunks:
        if len(chunk.offsets) != len(shape) or len(chunk.sizes) != len(shape):
            return f"a chunk of {fqn} has {len(chunk.offsets)} dimensions, not {len(shape)}"
        for o, s, dim in zip(chunk.offsets, chunk.sizes, shape, strict=True):
            if o < 0 or s < 0 or o + s > dim:
                return f"a chunk of {fqn} lies outside its shape {shape}"
        total += math.prod(chunk.sizes)
    if total != math.prod(shape):
        return f"the chunks of {fqn} hold {total} elements, the tensor {math.prod(shape)}"
    if not shape:
        return None  # one element, counted once
    boxes = [c for c in chunks if math.prod(c.sizes)]
    # Sweep the dimension the chunks are split along most (rows for FSDP, columns for a
    # column-parallel shard), comparing only chunks whose extents there meet.
    d = max(range(len(shape)), key=lambda i: len({packed(c.offsets[i]) for c in boxes}))
    boxes.sort(key=lambda c: (c.offsets[d], c.sizes[d]))
    active: list[ChunkRange] = []
    budget = 64 * len(boxes) + 4096  # pair tests: DCP's layouts need about one per chunk
    for box in boxes:
        start = box.offsets[d]
        active = [a for a in active if a.offsets[d] + a.sizes[d] > start]
        budget -= len(active)
        if budget < 0:
            return f"the chunks of {fqn} are laid out too irregularly to check; refused"
        for other in active:
            if all(
                o1 < o2 + s2 and o2 < o1 + s1
                for o1, s1, o2, s2 in zip(
                    box.offsets, box.sizes, other.offsets, other.sizes, strict=True
                )
            ):
                return f"two chunks of {fqn} overlap at offsets {box.offsets} and {other.offsets}"
        active.append(box)
    return None


# -- directories ------------------------------------------------------------------------------


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
