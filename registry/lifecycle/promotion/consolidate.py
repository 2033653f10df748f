"""DCP -> safetensors, streaming with bounded memory.

Each model tensor is assembled from its chunks (read from the proved copy of the shards, see
proven.py; each chunk one `torch.load(weights_only=True)` unless its bytes are a plain tensor),
optionally cast, and appended to the output while a background
thread hashes and writes the previous one: peak memory is about the largest tensor times three,
not the model. Headers are computed from the metadata before any tensor is read.

Tied weights (names that share one storage in the model, as the model factory reveals) are
written the way Hugging Face does: once, under the first name; the other names are recorded in
`__metadata__` and release.json so a loader re-ties them. A tie is applied only when the
checkpoint's copies are bit-identical; otherwise both are written and the break is recorded.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from registry.errors import UsageError
from registry.formats.dcp import Inventory
from registry.formats.documents import FileRecord
from registry.formats.safetensors_stream import (
    DTYPES,
    Entry,
    header_bytes,
    plan_shards,
    shard_names,
)
from registry.lifecycle.promotion.converters import Piece, piece_key, piece_shape
from registry.lifecycle.transfer import OnMismatch, put_reconciled

if TYPE_CHECKING:
    from registry.core.progress import Progress
    from registry.formats.dcp_load import ChunkSource
    from registry.storage.base import BaseStore

CAST = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
FLOATING = {"float64", "float32", "float16", "bfloat16"}
INDEX = "model.safetensors.index.json"


@dataclass
class Consolidated:
    files: list[FileRecord] = field(default_factory=list)
    tensor_count: int = 0
    tensor_bytes: int = 0
    tied: dict[str, str] = field(default_factory=dict)  # dropped alias -> kept name
    broken_ties: list[list[str]] = field(default_factory=list)


def target_dtype(source: str, cast: str | None) -> str:
    if cast is None or source not in FLOATING:
        return source
    if cast not in CAST:
        raise UsageError(f"unknown --dtype {cast!r}", "use bf16, fp16 or fp32")
    return CAST[cast]


def consolidate(
    source: ChunkSource,
    inv: Inventory,
    names: dict[str, Piece],
    store: BaseStore,
    dest_prefix: str,
    *,
    cast: str | None,
    max_shard_bytes: int,
    metadata: dict[str, str],
    tie_groups: list[list[str]],
    progress: Progress | None = None,
    file_name: str | None = None,
) -> Consolidated:
    """Write the tensors `names` (release name -> checkpoint FQN, or one layer of one: see
    converters.py), read from `source`, under `dest_prefix` of `store`."""
    result = Consolidated()
    dropped = _resolve_ties(source, inv, names, tie_groups, result)
    entries = []
    for name in sorted(names):
        if name in dropped:
            continue
        info = inv.tensors[piece_key(names[name])]
        dtype = target_dtype(info.dtype, cast)
        if dtype not in DTYPES:
            raise UsageError(f"{name} has dtype {info.dtype}, which safetensors cannot hold")
        entries.append(Entry(name, dtype, piece_shape(names[name], inv.tensors)))
    if result.tied:
        metadata = {**metadata, "reg.tied": json.dumps(result.tied, sort_keys=True)}
    shards = plan_shards(entries, max_shard_bytes)
    files = shard_names(len(shards))
    if file_name is not None:  # a loader that reads one file of this name (PEFT's adapter)
        if len(shards) > 1:
            raise UsageError(
                f"{file_name} would be split into {len(shards)} shards, and its loader reads one",
                "raise --max-shard-size",
            )
        files = [file_name]
    if progress:
        progress.start(f"consolidate {len(entries)} tensors", sum(e.nbytes for e in entries))

    for path, shard in zip(files, shards, strict=True):
        produce = _shard_writer(source, inv, names, shard, metadata, progress)
        result.files.append(_put_once(store, dest_prefix, path, produce=produce))
    if len(files) > 1:
        weight_map = {
            e.name: path for path, shard in zip(files, shards, strict=True) for e in shard
        }
        index = {
            "metadata": {"total_size": sum(e.nbytes for e in entries), **metadata},
            "weight_map": dict(sorted(weight_map.items())),
        }
        data = json.dumps(index, indent=2, sort_keys=True).encode()
        result.files.append(_put_once(store, dest_prefix, INDEX, data=data))
    if progress:
        progress.finish()
    result.tensor_count = len(entries)
    result.tensor_bytes = sum(e.nbytes for e in entries)
    return result


def _shard_writer(
    source: ChunkSource,
    inv: Inventory,
    names: dict[str, Piece],
    shard: list[Entry],
    metadata: dict[str, str],
    progress: Progress | None,
) -> Callable[[Any], None]:
    """A producer of one safetensors file: the header, then each tensor's bytes in order, read
    chunk by chunk from the checkpoint (cast where asked)."""
    import torch

    def produce(write: Any) -> None:
        write(header_bytes(shard, metadata))
        for entry in shard:
            info = inv.tensors[piece_key(names[entry.name])]
            for part in _pieces(source, inv, names[entry.name]):
                if entry.dtype != info.dtype:
                    part = part.to(getattr(torch, entry.dtype))
                write(part.reshape(-1).view(torch.uint8).numpy())
            if progress:
                progress.advance(entry.nbytes)

    return produce


def _pieces(source: ChunkSource, inv: Inventory, piece: Piece) -> Iterator[Any]:
    """A release tensor's bytes in row-major pieces."""
    from registry.formats.dcp_load import iter_tensor_bytes

    if isinstance(piece, str):
        yield from iter_tensor_bytes(source, inv.tensors[piece])
    else:
        yield _read(source, inv, piece)


def _read(source: ChunkSource, inv: Inventory, piece: Piece) -> Any:
    """A release tensor whole: the checkpoint's, or a layer of it (its rows, in order)."""
    import torch

    from registry.formats.dcp_load import read_layer, read_tensor

    if isinstance(piece, str):
        return read_tensor(source, inv.tensors[piece])
    layer = read_layer(source, inv.tensors[piece.key], piece.layer)
    if not piece.rows:
        return layer
    return torch.cat([layer[a:b] for a, b in piece.rows]).contiguous()


def _put_once(store: BaseStore, prefix: str, path: str, **source: Any) -> FileRecord:
    """Write one release file. One already there is from a killed attempt of this promotion
    (same inputs): adopted only if its bytes are exactly what this run produces."""
    done = put_reconciled(
        store, prefix + path, immutable=True, on_mismatch=OnMismatch.CONFLICT, **source
    )
    return FileRecord(path, done.size, done.sha256, version=done.version)


def _resolve_ties(
    source: ChunkSource,
    inv: Inventory,
    names: dict[str, Piece],
    groups: list[list[str]],
    result: Consolidated,
) -> set[str]:
    import torch

    dropped: set[str] = set()
    for group in groups:
        present = [n for n in group if n in names]
        if len(present) < 2:
            continue
        keep, *aliases = present
        kept = _read(source, inv, names[keep])
        for alias in aliases:
            other = _read(source, inv, names[alias])
            if (
                other.shape == kept.shape
                and other.dtype == kept.dtype
                and torch.equal(
                    other.reshape(-1).view(torch.uint8), kept.reshape(-1).view(torch.uint8)
                )
            ):
                result.tied[alias] = keep
                dropped.add(alias)
            else:
                result.broken_ties.append([keep, alias])
    return dropped
