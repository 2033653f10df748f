"""A checkpoint whose model is in safetensors files: the transformers Trainer's plain save, and
a PEFT adapter as `save_pretrained` writes it.

Without FSDP's sharded state dict the Trainer writes the model as `model.safetensors` (or
`model-0000K-of-0000N.safetensors` with an index) beside `optimizer.pt`, `scheduler.pt`,
`rng_state_R.pth` and `trainer_state.json`; PEFT's save_pretrained writes
`adapter_model.safetensors` beside `adapter_config.json`. Such a file is a root of the
checkpoint, as a DCP `.metadata` is (docs/concepts/design.md §3): its header (8 bytes of
length, then JSON naming each tensor's dtype, shape and byte range) is read, checked, and turned
into the same metadata a DCP root gives, with one chunk per tensor whose bytes are the tensor's own,
little-endian and contiguous (`dcp.RawStorage`). Inventory, validation and consolidation then read
it as they read any checkpoint; only decoding a chunk differs (`torch.frombuffer`, no
`torch.load`). Key paths are the tensors' names, as the model's `state_dict()` has them.

A header is checked before anything is built from it: at most `MAX_HEADER` bytes of strict
JSON (duplicate keys refused), every entry a known dtype with a shape whose byte size is its
range's, the ranges tiling the data section to the file's end (as safetensors itself reads a
file), no name twice across the files. Proving the header's bytes is the caller's: read from
the descriptor a push checked (and read back once stored), proved in the one pass validation
and promotion make over the file (validation/deferred.py, promotion/proven.py), or streamed
whole through sha256 (`storage.verified_stream.verified_header`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from registry.errors import InvalidCheckpoint, UsageError
from registry.formats.dcp import DTYPE_SIZES, MAX_DIMS, MAX_INT, RawStorage
from registry.formats.hf_folder import parse_strict

SUFFIX = ".safetensors"
TRAINER_STATE = "trainer_state.json"
ADAPTER_CONFIG = "adapter_config.json"  # PEFT's save_pretrained, beside adapter_model.safetensors
MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit
LENGTH_BYTES = 8
# safetensors dtype -> torch's name (docs: huggingface/safetensors, "Format")
DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "U16": "uint16",
    "U32": "uint32",
    "U64": "uint64",
    "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
}


def roots(paths: Iterable[str]) -> tuple[str, ...]:
    """The safetensors roots of a checkpoint with no DCP root: its top-level `*.safetensors`
    files, where `trainer_state.json` says the transformers Trainer wrote it or
    `adapter_config.json` that PEFT's save_pretrained did; else ()."""
    paths = list(paths)
    if TRAINER_STATE not in paths and ADAPTER_CONFIG not in paths:
        return ()
    return tuple(sorted(p for p in paths if "/" not in p and p.endswith(SUFFIX)))


def is_root_name(path: str) -> bool:
    return "/" not in path and path.endswith(SUFFIX)


@dataclass(frozen=True, slots=True)
class Entry:
    name: str
    dtype: str  # torch's name
    shape: tuple[int, ...]
    offset: int  # in the file
    length: int


def header_length(first: bytes, size: int | None, label: str) -> int:
    """The header's length from a file's first 8 bytes: how many bytes after them to read
    (`size`: the file's, where known)."""
    if len(first) < LENGTH_BYTES:
        raise InvalidCheckpoint(f"{label} is {len(first)} bytes: not safetensors", _SAVE_AGAIN)
    n = int.from_bytes(first[:LENGTH_BYTES], "little")
    if n < 2 or n > MAX_HEADER or (size is not None and LENGTH_BYTES + n > size):
        raise InvalidCheckpoint(
            f"{label}: its safetensors header says {n} bytes"
            + (f", in a file of {size}" if size is not None else ""),
            f"{_SAVE_AGAIN} (a header is at most {MAX_HEADER >> 20} MiB)",
        )
    return n


_SAVE_AGAIN = "the file is truncated, corrupt or not safetensors; save it again"


def read_header(read: Callable[[int, int], bytes], size: int | None, label: str) -> bytes:
    """A file's header (its length, then the JSON) through `read(offset, length)`: the first
    8 bytes, checked (`header_length`), then the JSON they announce. Proving it is the caller's."""
    first = bytes(read(0, LENGTH_BYTES))
    n = header_length(first, size, label)
    return first + bytes(read(LENGTH_BYTES, n))


def parse(prefix: bytes, size: int | None, label: str) -> list[Entry]:
    """The tensors a safetensors file holds, from its first bytes (at least the header) and
    its size where known (else the callers check each range against it: `check_ranges`);
    InvalidCheckpoint, one line, for anything that is not a sound header."""
    n = header_length(prefix, size, label)
    if len(prefix) < LENGTH_BYTES + n:
        raise InvalidCheckpoint(f"{label}: {len(prefix)} bytes read of a {n}-byte header")
    try:
        doc = parse_strict(prefix[LENGTH_BYTES : LENGTH_BYTES + n], label, _SAVE_AGAIN)
    except UsageError as exc:
        raise InvalidCheckpoint(exc.message, exc.hint) from None
    if not isinstance(doc, dict):
        raise InvalidCheckpoint(f"{label}: its header is not a JSON object", _SAVE_AGAIN)
    base = LENGTH_BYTES + n
    data = MAX_INT if size is None else size - base
    out: list[Entry] = []
    for name, spec in doc.items():
        if name == "__metadata__":
            if not isinstance(spec, dict) or not all(isinstance(v, str) for v in spec.values()):
                raise InvalidCheckpoint(f"{label}: __metadata__ is not text to text", _SAVE_AGAIN)
            continue
        out.append(_entry(name, spec, base, data, label))
    # As safetensors itself reads a file: the tensors tile the data section, back to back from
    # its start to the file's end (a gap, an overlap or trailing bytes make it refuse to load).
    spans = sorted((e.offset, e.offset + e.length, e.name) for e in out)
    at = base
    for start, end, name in spans:
        if start != at:
            what = "overlaps the tensor before it" if start < at else "leaves a gap before it"
            raise InvalidCheckpoint(f"{label}: {name[:80]!r} {what}", _SAVE_AGAIN)
        at = end
    if size is not None and at != size:
        raise InvalidCheckpoint(
            f"{label}: its tensors end at byte {at} of {size}: not a whole safetensors file",
            _SAVE_AGAIN,
        )
    return out


def _entry(name: str, spec: Any, base: int, data: int, label: str) -> Entry:
    where = f"{label}: {name[:80]!r}"
    if not name or len(name) > 4096 or not isinstance(spec, dict):
        raise InvalidCheckpoint(f"{where} is not a tensor entry", _SAVE_AGAIN)
    named = spec.get("dtype")
    dtype = DTYPES.get(named) if isinstance(named, str) else None
    shape: Any = spec.get("shape")
    offsets: Any = spec.get("data_offsets")
    if dtype is None:
        raise InvalidCheckpoint(f"{where} has dtype {str(named)[:20]!r}", _SAVE_AGAIN)
    if not _whole_numbers(shape, MAX_DIMS) or not _whole_numbers(offsets, 2) or len(offsets) != 2:
        raise InvalidCheckpoint(f"{where}: shape or data_offsets are not numbers", _SAVE_AGAIN)
    begin, end = offsets
    if math.prod(d for d in shape if d) > MAX_INT:  # an empty tensor too: torch cannot make it
        raise InvalidCheckpoint(f"{where}: shape {shape[:8]} is too large", _SAVE_AGAIN)
    count = math.prod(shape)
    if count * DTYPE_SIZES[dtype] != end - begin or not 0 <= begin <= end <= data:
        raise InvalidCheckpoint(
            f"{where}: {dtype} {tuple(shape)} does not fill bytes {begin}..{end} of a "
            f"{data}-byte data section",
            _SAVE_AGAIN,
        )
    return Entry(name, dtype, tuple(shape), base + begin, end - begin)


def _whole_numbers(value: Any, most: int) -> bool:
    return (
        isinstance(value, list)
        and len(value) <= most
        and all(type(v) is int and 0 <= v <= MAX_INT for v in value)
    )


def metadata(
    headers: Mapping[str, bytes], *, light: bool, sizes: Mapping[str, int] | None = None
) -> Any:
    """One DCP metadata for the safetensors files `headers` (path -> first bytes, at least
    the header): a tensor per entry, one chunk covering it, stored raw. `light`: stand-ins,
    no torch. `sizes`: the files' sizes, where known (a push: the tensors must end the file)."""
    entries: dict[str, tuple[str, Entry]] = {}
    for path, prefix in sorted(headers.items()):
        for entry in parse(prefix, (sizes or {}).get(path), path):
            if entry.name in entries:
                raise InvalidCheckpoint(
                    f"{entry.name} is in both {entries[entry.name][0]} and {path}",
                    "a model's tensors are each in one file: save it again",
                )
            entries[entry.name] = (path, entry)
    return raw_metadata(
        {
            name: (
                e.dtype,
                e.shape,
                [((0,) * len(e.shape), e.shape, RawStorage(path, e.offset, e.length))],
            )
            for name, (path, e) in entries.items()
        },
        light=light,
    )


Shape = tuple[int, ...]
Placed = list[tuple[Shape, Shape, RawStorage]]  # a chunk's offsets, sizes, raw bytes


def raw_metadata(tensors: Mapping[str, tuple[str, Shape, Placed]], *, light: bool) -> Any:
    """One DCP metadata for `tensors` (key -> dtype, shape, chunks as (offsets, sizes, where the
    raw bytes are)). `light`: stand-ins, no torch; otherwise torch's own classes."""
    if light:
        out = _Metadata()
        for key, (dtype, shape, placed) in tensors.items():
            chunks = [_Chunk(o, size) for o, size, _ in placed]
            out.state_dict_metadata[key] = _Tensor(_Props(_Dtype(dtype)), shape, chunks)
            for o, _, raw in placed:
                out.storage_data[_Index(key, o)] = raw
        return out
    import torch
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    state: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    for key, (dtype, shape, placed) in tensors.items():
        props = TensorProperties(dtype=getattr(torch, dtype))
        pieces = [ChunkStorageMetadata(torch.Size(o), torch.Size(size)) for o, size, _ in placed]
        state[key] = TensorStorageMetadata(props, torch.Size(shape), pieces)
        for o, _, raw in placed:
            storage[MetadataIndex(key, torch.Size(o), 0)] = raw
    return Metadata(state_dict_metadata=state, storage_data=storage)


# Light stand-ins: what `inventory` reads (attributes only).
@dataclass(frozen=True, slots=True)
class _Dtype:
    name: str


@dataclass(frozen=True, slots=True)
class _Props:
    dtype: _Dtype


@dataclass(frozen=True, slots=True)
class _Chunk:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class _Tensor:
    properties: _Props
    size: tuple[int, ...]
    chunks: list[_Chunk]


@dataclass(frozen=True, slots=True)
class _Index:
    fqn: str
    offset: tuple[int, ...] | None = None
    index: int | None = None


@dataclass(slots=True)
class _Metadata:
    state_dict_metadata: dict[str, Any] = field(default_factory=dict)
    storage_data: dict[Any, Any] = field(default_factory=dict)
    planner_data: Any = None
