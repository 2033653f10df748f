"""Tensor bytes loaded onto the device a batch at a time, checked, and freed.

Pieces of tensors (whole elements, from validation's one pass over the shards) are copied into a
staging buffer; a full buffer is moved to the device and every floating piece in it is checked
for NaN and Inf there. Pieces of the model's tensors (when the probe's model is held) are copied
on into the model. On CUDA the staging buffers are pinned, two of them: one fills while the other
is copied (non-blocking) and checked; counts stay on the device until the end, so the host never
waits on a check. On CPU one buffer is enough. Memory: the batches (Budget.batch), whatever the
checkpoint's size.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import Any

from registry.formats.dcp import ChunkRange
from registry.formats.torch_archive import ITEMSIZE

# Checked for NaN and Inf: every floating and complex dtype. Those isfinite does not take
# (float8, complex32) are widened a slice at a time first.
WIDENED = {
    "float8_e4m3fn": "float32",
    "float8_e5m2": "float32",
    "float8_e4m3fnuz": "float32",
    "float8_e5m2fnuz": "float32",
    "float8_e8m0fnu": "float32",
    "complex32": "complex64",
}
FLOATING = frozenset({"float64", "float32", "float16", "bfloat16", "complex64", "complex128"})
FLOATING |= frozenset(WIDENED)
ALIGN = 64
SLICE = 1 << 24  # elements checked at once on CPU (bounds isfinite's temporary)
CUDA_BATCH = 256 << 20


class OutOfDeviceMemory(Exception):
    pass


@dataclass
class Target:
    """Where a model tensor's chunks go: the tensor on the device (full shape)."""

    tensor: Any
    partial: dict[tuple[int, ...], Any] = field(default_factory=dict)  # chunk -> its flat copy


@dataclass
class _Piece:
    fqn: str
    dtype: str
    at: int  # byte offset in the staging buffer
    nbytes: int
    chunk: ChunkRange | None  # with `first`: where the piece goes in a held model tensor
    first: int  # the piece's first element within its chunk


class Batches:
    def __init__(
        self, device: str, batch_bytes: int, targets: dict[str, Target] | None = None
    ) -> None:
        import torch

        self.device = device
        self.targets = targets or {}
        self.lock = threading.Lock()
        # On CUDA two buffers on each side, of at most CUDA_BATCH: larger copies gain nothing.
        if device == "cuda":
            self.size = max(ALIGN, min(batch_bytes // 2, CUDA_BATCH))
        else:
            self.size = max(ALIGN, batch_bytes)
        self.nonfinite: dict[str, list[Any]] = {}  # fqn -> [bad, nan] counts (tensors on CUDA)
        self._pieces: list[_Piece] = []
        self._used = 0
        self._slot = 0
        self._events: list[Any] = [None, None]
        try:
            if device == "cuda":
                self._host = [
                    torch.empty(self.size, dtype=torch.uint8, pin_memory=True) for _ in range(2)
                ]
                self._dev = [
                    torch.empty(self.size, dtype=torch.uint8, device=device) for _ in range(2)
                ]
            else:
                self._host = [torch.empty(self.size, dtype=torch.uint8)]
                self._dev = self._host
        except (torch.cuda.OutOfMemoryError, RuntimeError) as exc:  # RuntimeError: host memory
            raise OutOfDeviceMemory(str(exc).splitlines()[0]) from None
        self._views = [memoryview(h.numpy()) for h in self._host]  # type: ignore[arg-type]

    def wants(self, fqn: str, dtype: str) -> bool:
        """Whether pieces of this tensor need loading (floats are checked; the held model's
        tensors are copied on); other pieces only count toward coverage."""
        return dtype in FLOATING or fqn in self.targets

    def add(self, fqn: str, dtype: str, data: Any, chunk: ChunkRange | None, first: int) -> None:
        """Bytes of whole elements; `first` is the first element's index within `chunk`."""
        view = memoryview(data).cast("B")
        item = ITEMSIZE[dtype]
        with self.lock:
            while len(view):
                room = (self.size - self._used) // item * item
                if room == 0:
                    self._flush()
                    continue
                n = min(room, len(view))
                self._stage(view[:n])
                self._pieces.append(_Piece(fqn, dtype, self._used, n, chunk, first))
                self._used = _aligned(self._used + n)
                view, first = view[n:], first + n // item
                if self._used >= self.size:
                    self._flush()

    def _stage(self, view: memoryview) -> None:
        if self.device == "cuda" and self._events[self._slot] is not None:
            self._events[self._slot].synchronize()  # its last copy to the device is done
            self._events[self._slot] = None
        self._views[self._slot][self._used : self._used + len(view)] = view  # one memcpy

    def flush(self) -> None:
        with self.lock:
            self._flush()

    def _flush(self) -> None:
        import torch

        if not self._pieces:
            self._used = 0
            return
        slot = self._slot
        try:
            if self.device == "cuda":
                self._dev[slot][: self._used].copy_(
                    self._host[slot][: self._used], non_blocking=True
                )
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record()
                self._events[slot] = event
            for piece in self._pieces:
                self._check(self._dev[slot], piece)
        except torch.cuda.OutOfMemoryError as exc:
            raise OutOfDeviceMemory(str(exc).splitlines()[0]) from None
        self._pieces, self._used = [], 0
        if self.device == "cuda":
            self._slot = 1 - slot

    def _check(self, buffer: Any, piece: _Piece) -> None:
        import torch

        dtype = getattr(torch, piece.dtype)
        values = buffer[piece.at : piece.at + piece.nbytes].view(dtype)
        if piece.dtype in FLOATING:
            wide = getattr(torch, WIDENED[piece.dtype]) if piece.dtype in WIDENED else None
            counts = self.nonfinite.setdefault(piece.fqn, [0, 0])
            for lo in range(0, values.numel(), SLICE):
                part = values[lo : lo + SLICE]
                if wide is not None:
                    part = part.to(wide)
                if self.device == "cuda":  # counted on the device, read once at the end
                    counts[0] = counts[0] + (part.numel() - torch.isfinite(part).sum())
                    counts[1] = counts[1] + torch.isnan(part).sum()
                elif not bool(torch.isfinite(part).all()):
                    counts[0] += int((~torch.isfinite(part)).sum())
                    counts[1] += int(torch.isnan(part).sum())
        target = self.targets.get(piece.fqn)
        if target is not None and piece.chunk is not None:
            _copy_into(target, piece.chunk, piece.first, values)

    def close(self) -> dict[str, tuple[int, bool]]:
        """Flush what is left; fqn -> (non-finite elements, any NaN) for each offender."""
        import torch

        self.flush()
        if self.device == "cuda":
            torch.cuda.synchronize()
        out = {}
        for fqn, (bad, nan) in self.nonfinite.items():
            bad, nan = int(bad), int(nan)
            if bad:
                out[fqn] = (bad, nan > 0)
        self._host = self._dev = []
        self._views = []
        return out


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _copy_into(target: Target, chunk: ChunkRange, first: int, values: Any) -> None:
    """Elements [first, first + n) of `chunk` (row-major within it) into the model tensor."""
    tensor = target.tensor
    shape = tuple(tensor.shape)
    rows = not any(chunk.offsets[1:]) and tuple(chunk.sizes[1:]) == shape[1:]
    if rows:  # the chunk is a run of whole rows: contiguous in the full tensor too
        start = (chunk.offsets[0] * math.prod(shape[1:]) if shape else 0) + first
        tensor.view(-1)[start : start + values.numel()].copy_(values)
        return
    key = chunk.offsets
    flat = target.partial.get(key)
    if flat is None:
        flat = target.partial[key] = tensor.new_empty(math.prod(chunk.sizes))
    flat[first : first + values.numel()].copy_(values)
    if first + values.numel() == flat.numel():
        index = tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes, strict=True))
        tensor[index].copy_(flat.view(chunk.sizes))
        del target.partial[key]
