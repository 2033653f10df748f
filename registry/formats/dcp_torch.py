"""Build torch's DCP `Metadata` from the stand-ins the safe unpickler made (dcp_metadata.py).

Each object is constructed explicitly from checked fields (the same checks as the inventory's,
formats/dcp.py): strings are strings, numbers whole and below 2^63, shapes bounded, dtypes and
layouts names torch knows, memory formats one of DCP's three codes. Nothing from the stream is
handed to torch as it came, so torch's own classes are never touched by the pickle.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint import metadata as dcp
from torch.distributed.checkpoint.filesystem import _StorageInfo

from registry.errors import InvalidCheckpoint
from registry.formats.dcp import (
    STRUCTURE_ERRORS,
    HashCount,
    checked_dims,
    checked_int,
    checked_path,
    checked_text,
)

_MEMORY_FORMATS = {0: torch.contiguous_format, 1: torch.channels_last, 2: torch.preserve_format}


def to_torch(light: Any) -> dcp.Metadata:
    try:
        return _metadata(light)
    except STRUCTURE_ERRORS as exc:
        raise _bad(f"not DCP's structure ({type(exc).__name__}: {exc})") from None


def _metadata(light: Any) -> dcp.Metadata:
    state = _mapping(getattr(light, "state_dict_metadata", None), "state_dict_metadata")
    storage = _mapping(getattr(light, "storage_data", None) or {}, "storage_data")
    hashes = HashCount("storage_data")  # torch's MetadataIndex hashes its offsets
    storage_data: dict[dcp.MetadataIndex, _StorageInfo] = {}
    for k, v in storage.items():
        index = hashes.check(_index(k))
        if index in storage_data:  # equal by fqn and offsets, as torch looks chunks up
            raise _bad(f"{index.fqn} has two storage locations at offsets {index.offset}")
        storage_data[index] = _storage(v)
    return dcp.Metadata(
        state_dict_metadata={checked_text(k, "an fqn"): _item(k, v) for k, v in state.items()},
        planner_data=_plain(
            getattr(light, "planner_data", None), "planner_data", [16 * len(state) + 10_000]
        ),
        storage_data=storage_data,
        storage_meta=_storage_meta(getattr(light, "storage_meta", None)),
        version=_optional_text(getattr(light, "version", None), "version"),
    )


def _item(fqn: str, value: Any) -> dcp.TensorStorageMetadata | dcp.BytesStorageMetadata:
    kind = type(value).__name__
    if kind == "BytesStorageMetadata":
        return dcp.BytesStorageMetadata()
    if kind != "TensorStorageMetadata":
        raise _bad(f"{fqn} is a {kind}, not tensor or bytes metadata")
    props = value.properties
    if type(props).__name__ != "TensorProperties":
        raise _bad(f"{fqn}: properties are a {type(props).__name__}")
    chunks = value.chunks
    if not isinstance(chunks, list):
        raise _bad(f"{fqn}: chunks are not a list")
    return dcp.TensorStorageMetadata(
        properties=dcp.TensorProperties(
            dtype=_dtype(props.dtype, fqn),
            layout=_layout(props.layout, fqn),
            requires_grad=bool(props.requires_grad),
            memory_format=_memory_format(props.memory_format, fqn),
            pin_memory=bool(props.pin_memory),
        ),
        size=torch.Size(checked_dims(value.size, f"{fqn}.size")),
        chunks=[
            dcp.ChunkStorageMetadata(
                offsets=torch.Size(checked_dims(c.offsets, f"{fqn} chunk offsets")),
                sizes=torch.Size(checked_dims(c.sizes, f"{fqn} chunk sizes")),
            )
            for c in chunks
        ],
    )


def _index(key: Any) -> dcp.MetadataIndex:
    if type(key).__name__ != "MetadataIndex":
        raise _bad(f"a storage_data key is a {type(key).__name__}")
    offset = getattr(key, "offset", None)
    index = getattr(key, "index", None)
    return dcp.MetadataIndex(
        fqn=checked_text(key.fqn, "a storage fqn"),
        offset=None if offset is None else torch.Size(checked_dims(offset, "a storage offset")),
        index=None if index is None else checked_int(index, "a storage index"),
    )


def _storage(info: Any) -> _StorageInfo:
    if type(info).__name__ != "_StorageInfo":
        raise _bad(f"a storage_data value is a {type(info).__name__}")
    transforms = getattr(info, "transform_descriptors", None)
    return _StorageInfo(
        relative_path=checked_path(info.relative_path),
        offset=checked_int(info.offset, "a storage offset"),
        length=checked_int(info.length, "a storage length"),
        transform_descriptors=None
        if transforms is None
        else [checked_text(t, "a transform") for t in transforms],
    )


def _storage_meta(meta: Any) -> dcp.StorageMeta | None:
    if meta is None:
        return None
    if type(meta).__name__ != "StorageMeta":
        raise _bad(f"storage_meta is a {type(meta).__name__}")
    checkpoint_id = getattr(meta, "checkpoint_id", None)
    modules = getattr(meta, "modules", None) or []
    return dcp.StorageMeta(
        checkpoint_id=None if checkpoint_id is None else str(checkpoint_id),
        save_id=_optional_text(getattr(meta, "save_id", None), "save_id"),
        load_id=_optional_text(getattr(meta, "load_id", None), "load_id"),
        modules=[checked_text(m, "a module name") for m in modules],
    )


def _plain(value: Any, where: str, budget: list[int], depth: int = 0) -> Any:
    """planner_data: dicts of lists and tuples of strings and ints (DCP writes fqn -> key path),
    at most 8 deep and within a budget of nodes visited: shared references cannot make it
    exponential."""
    budget[0] -= 1
    if depth > 8 or budget[0] < 0:
        raise _bad(f"{where} is nested too deeply or too large")
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, list | tuple):
        return type(value)(_plain(v, where, budget, depth + 1) for v in value)
    if isinstance(value, dict):
        return {
            _plain(k, where, budget, depth + 1): _plain(v, where, budget, depth + 1)
            for k, v in value.items()
        }
    raise _bad(f"{where} holds a {type(value).__name__}")


def _dtype(value: Any, fqn: str) -> torch.dtype:
    name = getattr(value, "name", None)
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise _bad(f"{fqn}: unknown dtype {value!r}")
    return dtype


def _layout(value: Any, fqn: str) -> torch.layout:
    name = value.removeprefix("torch.") if isinstance(value, str) else None
    layout = getattr(torch, name, None) if name else None
    if not isinstance(layout, torch.layout):
        raise _bad(f"{fqn}: unknown layout {value!r}")
    return layout


def _memory_format(value: Any, fqn: str) -> torch.memory_format:
    code = getattr(value, "value", value)  # an enum member or its code
    if not isinstance(code, int) or isinstance(code, bool) or code not in _MEMORY_FORMATS:
        raise _bad(f"{fqn}: unknown memory format {value!r}")
    return _MEMORY_FORMATS[code]


def _optional_text(value: Any, where: str) -> str | None:
    return None if value is None else checked_text(value, where)


def _mapping(value: Any, where: str) -> dict[Any, Any]:
    if not isinstance(value, dict):
        raise _bad(f"{where} is a {type(value).__name__}, not a mapping")
    return value


def _bad(detail: str) -> InvalidCheckpoint:
    return InvalidCheckpoint(f".metadata: {detail}", "the file is corrupt or crafted")
