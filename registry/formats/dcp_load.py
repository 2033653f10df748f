"""Load DCP checkpoints straight from the object store, safely.

`StoreReader` is a DCP `StorageReader` over an `BaseStore` prefix: it hands DCP the metadata
parsed by the allowlisting unpickler (never torch's own `pickle.load`) and reads every chunk with
a ranged read, so validation works the same on a local store and on S3 without downloading
whole shards. Each chunk is its own `torch.save` archive, loaded with `weights_only=True`.

`SafeLoadPlanner` fixes the one other unsafe spot: DCP's default planner unpickles non-tensor
items (`BytesStorageMetadata`) with `weights_only=False`; here they load with `weights_only=True`
and a refusal names the item.

`read_tensor` assembles one full tensor from its chunks, read from a `ChunkSource` (the
consolidation path: one tensor in memory at a time; promotion's source is the proved copy).
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import LoadPlan, LoadPlanner, ReadItem, StorageReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import LoadItemType
from torch.futures import Future

from registry.errors import IntegrityError, InvalidCheckpoint, UnsafeMetadata
from registry.formats.dcp import METADATA, ChunkRange, RawStorage, TensorInfo, inventory
from registry.formats.dcp_metadata import load_metadata
from registry.formats.sidecars import numpy_globals, torch_load
from registry.formats.torch_archive import HEAD_MAX, TAIL_MAX, plain_layout, read_layout
from registry.formats.torch_pickle_bounds import NotPlain, check_archive
from registry.formats.torch_zip import Region, canonical

if TYPE_CHECKING:
    from registry.storage.base import BaseStore


class ChunkSource(Protocol):
    def read(self, path: str, offset: int, length: int) -> bytearray:
        """`length` bytes of the checkpoint file `path` from `offset` (writable)."""
        ...


def load_chunk(data: bytes, where: str) -> torch.Tensor:
    try:
        check_archive(data)  # nothing that would make torch's unpickler quadratic
        tensor = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:
        raise IntegrityError(
            f"{where} does not load: {type(exc).__name__}: {exc}",
            "the shard is corrupt; run `reg verify`",
        ) from exc
    if not isinstance(tensor, torch.Tensor):
        raise InvalidCheckpoint(f"{where} holds a {type(tensor).__name__}, not a tensor")
    return tensor.resolve_conj().resolve_neg()  # the values torch means, as plain bytes


def raw_tensor(data: Any, dtype: str, sizes: tuple[int, ...], where: str) -> torch.Tensor:
    """A tensor whose bytes are its own, little-endian and contiguous (a safetensors file's):
    a view of `data`, which must be exactly that long."""
    torch_dtype = getattr(torch, dtype)
    count = 1
    for size in sizes:
        count *= size
    if len(data) != count * torch_dtype.itemsize:
        raise IntegrityError(
            f"{where}: {len(data)} bytes for {dtype} {sizes}", "the file is truncated or corrupt"
        )
    if not count:
        return torch.empty(sizes, dtype=torch_dtype)
    return torch.frombuffer(data, dtype=torch_dtype).view(sizes)


def load_object(data: bytes, where: str) -> Any:
    """A non-tensor item, with torch's restricted unpickler and exactly the numpy globals an
    RNG state's arrays need (Megatron's `rng_state` holds numpy's, as accelerate's files do)."""
    try:
        check_archive(data)  # nothing that would make torch's unpickler quadratic
        return torch_load(data, numpy_globals())
    except NotPlain as exc:
        raise UnsafeMetadata(
            f"{where} holds {exc}; refused", "the shard is corrupt or crafted: do not load it"
        ) from None
    except Exception as exc:
        if "weights_only" in str(exc) or "Unsupported global" in str(exc):
            raise UnsafeMetadata(
                f"{where} needs arbitrary unpickling to load; refused",
                "store resume state as tensors, numbers, strings, lists and dicts",
            ) from exc
        raise IntegrityError(
            f"{where} does not load: {type(exc).__name__}: {exc}",
            "the shard is corrupt; run `reg verify`",
        ) from exc


class StoreReader(StorageReader):
    def __init__(
        self,
        store: BaseStore,
        prefix: str,
        metadata: Any | None = None,
        versions: dict[str, str] | None = None,  # path -> the version to read (S3)
    ) -> None:
        super().__init__()
        self.store, self.prefix, self.versions = store, prefix, versions or {}
        self._metadata = metadata
        self.storage_data: dict[Any, Any] = {}
        self.tensors: dict[str, Any] = {}
        self.bytes_read = 0

    def reset(self, checkpoint_id: Any = None) -> None:
        self.storage_data = {}

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        if self._metadata is None:
            metadata = load_metadata(
                self.store.get_bytes(self.prefix + METADATA, version=self.versions.get(METADATA))
            )
            inventory(metadata)  # the same checks as everywhere: every tensor tiled exactly
            self._metadata = metadata
        return self._metadata

    def set_up_storage_reader(
        self, metadata: Any, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        self.storage_data = metadata.storage_data
        self.tensors = metadata.state_dict_metadata

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        for req in sorted(plan.items, key=self._position):
            info = self.storage_data[req.storage_index]
            if getattr(info, "transform_descriptors", None):
                raise InvalidCheckpoint(
                    f"{req.storage_index.fqn} uses DCP storage transforms "
                    f"({info.transform_descriptors}), which reg does not read",
                    "save without transforms (compression, encryption)",
                )
            path = str(info.relative_path)
            data = self.store.read_range(
                self.prefix + path, info.offset, info.length, version=self.versions.get(path)
            )
            self.bytes_read += len(data)
            where = f"{req.storage_index.fqn} in {info.relative_path}"
            if req.type == LoadItemType.BYTE_IO:
                planner.load_bytes(req, io.BytesIO(data))
                continue
            if type(info) is RawStorage:  # a safetensors tensor, whole
                target = planner.resolve_tensor(req).detach()
                stored = self.tensors[req.storage_index.fqn]
                chunk = raw_tensor(bytearray(data), _dtype_name(stored), tuple(stored.size), where)
            else:
                chunk = load_chunk(data, where)
            tensor = narrow_tensor_by_index(chunk, req.storage_offsets, req.lengths)
            target = planner.resolve_tensor(req).detach()
            if target.size() != tensor.size():
                raise IntegrityError(
                    f"{where}: chunk has shape {tuple(tensor.size())}, "
                    f"metadata says {tuple(target.size())}"
                )
            target.copy_(tensor)
            planner.commit_tensor(req, target)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _position(self, req: ReadItem) -> tuple[str, int]:
        info = self.storage_data[req.storage_index]
        return str(info.relative_path), int(info.offset)


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, but non-tensor items unpickle with `weights_only=True`."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = load_object(value.getvalue(), read_item.dest_index.fqn)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def _dtype_name(meta: Any) -> str:
    return str(meta.properties.dtype).removeprefix("torch.")


def read_chunk(source: ChunkSource, fqn: str, chunk: ChunkRange, dtype: str) -> torch.Tensor:
    data = source.read(chunk.file, chunk.offset, chunk.length)
    if chunk.raw:
        return raw_tensor(data, dtype, chunk.sizes, f"{fqn} in {chunk.file}")
    fast = stored_tensor_view(data, dtype, chunk.sizes)
    if fast is not None:
        return fast
    tensor = load_chunk(bytes(data), f"{fqn} in {chunk.file}")
    if tuple(tensor.shape) != chunk.sizes:
        # DCP may store a larger local tensor and a narrowed view: narrow like DCP does.
        tensor = tensor[tuple(slice(0, s) for s in chunk.sizes)]
    return tensor


def read_chunk_row(
    source: ChunkSource, fqn: str, chunk: ChunkRange, dtype: str, row: int
) -> torch.Tensor:
    """Index `row` of the chunk's first axis. A plain archive (the one torch.save writes of a
    contiguous tensor) is read by range: its head and tail, to find the storage, then that
    row's bytes alone, so a promotion reading one layer of Megatron's stacked layers at a time
    reads each chunk about once, not once per layer. Anything else is read whole."""
    if chunk.raw and chunk.sizes and chunk.sizes[0] > 0:
        size = chunk.length // chunk.sizes[0]
        data = source.read(chunk.file, chunk.offset + row * size, size)
        return raw_tensor(data, dtype, chunk.sizes[1:], f"{fqn} in {chunk.file}")
    if chunk.length > HEAD_MAX + TAIL_MAX and chunk.sizes and chunk.sizes[0] > 1:
        head = source.read(chunk.file, chunk.offset, HEAD_MAX)
        tail = source.read(chunk.file, chunk.offset + chunk.length - TAIL_MAX, TAIL_MAX)
        try:
            found = canonical(Region(head, chunk.length - HEAD_MAX - TAIL_MAX, tail))
            layout = plain_layout(read_layout(found.pickle)[0], dtype, chunk.sizes)
        except Exception:  # not canonical, or no plain layout: read whole below
            layout = None
        if (
            layout is not None
            and layout.key == found.key
            and found.byteorder in (None, b"little")
            and found.data_len == layout.nbytes
        ):
            size = layout.nbytes // chunk.sizes[0]
            data = source.read(chunk.file, chunk.offset + found.data_at + row * size, size)
            if len(data) != size:
                raise IntegrityError(
                    f"{fqn} in {chunk.file}: {len(data)} bytes of row {row}, not {size}",
                    "the shard is truncated; run `reg verify`",
                )
            return torch.frombuffer(data, dtype=getattr(torch, dtype)).view(chunk.sizes[1:])
    return read_chunk(source, fqn, chunk, dtype)[row]


# -- reading a chunk's bytes in place -----------------------------------------------------------
# A chunk is a `torch.save` zip archive: data.pkl describes the tensor, data/<key> holds the raw
# storage, uncompressed. For the common case (a contiguous tensor over its whole storage) the
# tensor is a view of the bytes already read: no torch.load, no copy. Anything else (views with
# offsets or strides, other rebuild functions) returns None and goes through torch.load.


def stored_tensor_view(data: Any, dtype: str, sizes: tuple[int, ...]) -> torch.Tensor | None:
    """The tensor as a view of `data` when the chunk is an archive torch.save writes, of a
    plain tensor (the one reading validation checked, `canonical`); None: load it with torch."""
    try:
        found = canonical(Region(data, 0, b""))
        layout = plain_layout(read_layout(found.pickle)[0], dtype, sizes)
    except Exception:  # not canonical, or a data.pkl that is no plain layout: torch decides
        return None
    if layout is None or layout.key != found.key or found.byteorder not in (None, b"little"):
        return None
    if found.data_len != layout.nbytes:
        return None
    if layout.nbytes == 0:
        return torch.empty(sizes, dtype=getattr(torch, dtype))
    view = memoryview(data)[found.data_at : found.data_at + found.data_len]
    return torch.frombuffer(view, dtype=getattr(torch, dtype)).view(sizes)


def row_parts(info: TensorInfo) -> list[ChunkRange] | None:
    """The chunks in order when they split the tensor by rows (as FSDP and TP Shard(0) do):
    their bytes, one after the other, are the tensor's row-major bytes."""
    if not info.shape or not info.chunks:
        return None
    parts = sorted(info.chunks, key=lambda c: c.offsets[0])
    row = 0
    for c in parts:
        if c.offsets[0] != row or any(c.offsets[1:]) or c.sizes[1:] != info.shape[1:]:
            return None
        row += c.sizes[0]
    return parts if row == info.shape[0] else None


def iter_tensor_bytes(source: ChunkSource, info: TensorInfo) -> Iterator[torch.Tensor]:
    """The tensor as contiguous pieces in row-major order: chunk by chunk when the chunks split
    it by rows (memory: one chunk), else assembled whole."""
    parts = row_parts(info)
    if parts is None:
        yield read_tensor(source, info)
        return
    for chunk in parts:
        yield read_chunk(source, info.fqn, chunk, info.dtype).contiguous()


def read_layer(source: ChunkSource, info: TensorInfo, layer: int) -> torch.Tensor:
    """Index `layer` of the tensor's first axis (one layer of Megatron's stacked layers),
    assembled from the chunks that hold it (each read whole, one at a time)."""
    if not info.shape or not 0 <= layer < info.shape[0]:
        raise IntegrityError(f"{info.fqn} has no layer {layer}", "the converter misread it")
    return _assemble(
        source, info, torch.empty(info.shape[1:], dtype=getattr(torch, info.dtype)), layer
    )


def read_tensor(
    source: ChunkSource, info: TensorInfo, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The full tensor `info` describes, assembled from its chunks."""
    full = out if out is not None else torch.empty(info.shape, dtype=getattr(torch, info.dtype))
    return _assemble(source, info, full, None)


def _assemble(
    source: ChunkSource, info: TensorInfo, full: torch.Tensor, layer: int | None
) -> torch.Tensor:
    """`full` filled from the chunks (of one layer of the first axis, when `layer` is given);
    every element must come from one."""
    covered = 0
    for chunk in info.chunks:
        offsets, sizes = chunk.offsets, chunk.sizes
        if layer is not None and not offsets[0] <= layer < offsets[0] + sizes[0]:
            continue
        if layer is None:
            part = read_chunk(source, info.fqn, chunk, info.dtype)
        else:
            part = read_chunk_row(source, info.fqn, chunk, info.dtype, layer - offsets[0])
            offsets, sizes = offsets[1:], sizes[1:]
        full[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))].copy_(part)
        covered += part.numel()
    if covered != full.numel():
        which = "" if layer is None else f" of layer {layer}"
        raise IntegrityError(
            f"{info.fqn}: chunks cover {covered} of {full.numel()} elements{which}",
            "the checkpoint metadata is inconsistent",
        )
    return full
