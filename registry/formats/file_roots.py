"""Checkpoint files whose own bytes describe their tensors, read as the roots of a checkpoint
with no DCP `.metadata`: the transformers Trainer's and PEFT's safetensors model files
(safetensors_root.py) and DeepSpeed's ZeRO states files (deepspeed_root.py).

A root is read in ranges (`read_root`): a safetensors file's header, a DeepSpeed archive's two
ends and the local headers of the records its tensors are in. Every reader hands back what
`metadata` takes for the file (its root bytes) and the ranges it read, which the caller proves
against the file's digest: the scan from the descriptor it checked (and by reading them back
once stored), validation and promotion in their one pass over the file, a server by streaming
the whole object (`storage.verified_stream.verified_ranges`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from registry.formats import deepspeed_root, deepspeed_zero, safetensors_root

Spans = list[tuple[int, bytes]]  # (offset, bytes) read of one file


def roots(paths: Iterable[str]) -> tuple[str, ...]:
    """The root files of a checkpoint with no DCP root: its safetensors model files (the
    Trainer's, PEFT's) or its DeepSpeed states files; else ()."""
    paths = list(paths)
    return safetensors_root.roots(paths) or deepspeed_root.roots(paths)


def is_root_name(path: str) -> bool:
    return safetensors_root.is_root_name(path) or deepspeed_root.is_root_name(path)


def read_root(
    path: str, read: Callable[[int, int], bytes], size: int, label: str
) -> tuple[bytes, Spans]:
    """(the root bytes `metadata` takes for `path`, the ranges read), through
    `read(offset, length)` of a file of `size` bytes."""
    if deepspeed_root.is_root_name(path):
        return deepspeed_root.read_root(read, size, label)
    header = safetensors_root.read_header(read, size, label)
    return header, [(0, header)]


def metadata(
    parts: Mapping[str, bytes], *, light: bool, sizes: Mapping[str, int] | None = None
) -> Any:
    """One DCP metadata for root files of one kind (path -> root bytes)."""
    if all(deepspeed_root.is_root_name(p) for p in parts):
        return deepspeed_zero.metadata(parts, light=light, sizes=sizes)
    return safetensors_root.metadata(parts, light=light, sizes=sizes)


def is_file_roots(parts: Iterable[str]) -> bool:
    parts = list(parts)
    return bool(parts) and all(is_root_name(p) for p in parts)
