"""Write safetensors files as a stream: the header is computed from shapes and dtypes before any
tensor is read, then tensors are appended one at a time, so memory holds one tensor, not the
model. Output is byte-compatible with `safetensors.torch.save_file` (header padded to 8 bytes,
tensors in the header's offset order).
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from typing import Any

# torch dtype name -> (safetensors dtype, itemsize)
DTYPES: dict[str, tuple[str, int]] = {
    "float64": ("F64", 8),
    "float32": ("F32", 4),
    "float16": ("F16", 2),
    "bfloat16": ("BF16", 2),
    "int64": ("I64", 8),
    "int32": ("I32", 4),
    "int16": ("I16", 2),
    "int8": ("I8", 1),
    "uint8": ("U8", 1),
    "uint16": ("U16", 2),
    "uint32": ("U32", 4),
    "uint64": ("U64", 8),
    "bool": ("BOOL", 1),
    "float8_e4m3fn": ("F8_E4M3", 1),
    "float8_e5m2": ("F8_E5M2", 1),
}


@dataclass(frozen=True, slots=True)
class Entry:
    name: str
    dtype: str  # torch dtype name
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype][1]


def header_bytes(entries: list[Entry], metadata: dict[str, str]) -> bytes:
    """The 8-byte length prefix and the JSON header for `entries`, laid out in order."""
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for e in entries:
        header[e.name] = {
            "dtype": DTYPES[e.dtype][0],
            "shape": list(e.shape),
            "data_offsets": [offset, offset + e.nbytes],
        }
        offset += e.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def plan_shards(entries: list[Entry], max_shard_bytes: int) -> list[list[Entry]]:
    """Split entries into files of at most `max_shard_bytes` of tensor data (a tensor larger
    than that gets a file of its own), keeping their order."""
    shards: list[list[Entry]] = [[]]
    size = 0
    for e in entries:
        if shards[-1] and size + e.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += e.nbytes
    return shards


def shard_names(count: int) -> list[str]:
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
