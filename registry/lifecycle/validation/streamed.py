"""Validation's one pass over a checkpoint, in bounded memory (the `streamed` mode).

Every stored file is read once, in order (several files at a time, `workers`), through the
verified reader: each byte is hashed, and each chunk is handed on as it passes. A tensor chunk's
storage streams straight into the device batches (batches.py) where it is checked and freed; a
chunk that cannot stream (a view with an offset or strides) is held whole, within the budget, and
loaded with `torch.load(weights_only=True)`; a non-tensor item likewise. What a chunk turned out
to be (its shape and dtype against the metadata, whether it loads at all) is noted as it
completes; whether the file it came from is the one pushed is known at the file's end, and an
integrity failure there outranks anything noted from its bytes.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from registry.core.progress import Counter
from registry.core.timeutil import human_bytes
from registry.errors import IntegrityError, RegistryError
from registry.formats.dcp import ChunkRange, Inventory, TensorInfo
from registry.formats.torch_archive import ITEMSIZE, ArchiveStream, NotStreamable
from registry.lifecycle.validation.batches import Batches, OutOfDeviceMemory, Target
from registry.lifecycle.validation.budget import Budget, out_of_memory
from registry.storage.verified_stream import Span, read_verified

if TYPE_CHECKING:
    from registry.core.progress import Progress
    from registry.formats.documents import FileRecord
    from registry.storage.base import BaseStore


HELD_COPIES = 3


@dataclass(frozen=True, slots=True)
class _TensorChunk:
    info: TensorInfo
    chunk: ChunkRange


@dataclass(frozen=True, slots=True)
class _ObjectChunk:
    fqn: str
    chunk: ChunkRange


@dataclass(frozen=True, slots=True)
class _Expected:
    """Bytes read before the pass (a model file's header, a large sidecar's ends), which the
    pass must find there (deferred.py)."""

    path: str
    offset: int
    data: bytes

    @property
    def fqn(self) -> str:  # as overlaps name a span
        return f"bytes {self.offset}..{self.offset + len(self.data)} read before the pass"


@dataclass
class PassResult:
    integrity: list[str] = field(default_factory=list)  # files that are not what was pushed
    restore: list[str] = field(default_factory=list)  # chunks that do not load
    shapes: list[str] = field(default_factory=list)
    nonfinite: dict[str, tuple[int, bool]] = field(default_factory=dict)
    files: int = 0
    bytes_read: int = 0
    chunks: int = 0
    seconds: float = 0.0


class StreamPass:
    def __init__(
        self,
        store: BaseStore,
        prefix: str,
        files: Sequence[FileRecord],
        inv: Inventory,
        device: str,
        budget: Budget,
        *,
        label: str,
        workers: int,
        targets: dict[str, Target] | None = None,
        expected: dict[str, list[tuple[int, bytes]]] | None = None,
    ) -> None:
        self.store, self.prefix, self.files, self.inv = store, prefix, list(files), inv
        self.device, self.budget, self.label = device, budget, label
        self.workers = max(1, min(workers, len(self.files) or 1))
        self.held_limit = budget.held(self.workers)
        self.batches = Batches(device, budget.batch, targets)
        self.result = PassResult()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._spans: dict[str, list[Span]] = {}
        for info in inv.tensors.values():
            for c in info.chunks:
                if c.raw and not c.length:  # a tensor with no elements: no byte to read
                    self.result.chunks += 1
                    continue
                self._spans.setdefault(c.file, []).append(
                    Span(c.offset, c.offset + c.length, _TensorChunk(info, c))
                )
        for fqn, chunks in inv.byte_items.items():
            for c in chunks:
                self._spans.setdefault(c.file, []).append(
                    Span(c.offset, c.offset + c.length, _ObjectChunk(fqn, c))
                )
        for path, parts in (expected or {}).items():  # bytes read before the pass
            for offset, data in parts:
                self._spans.setdefault(path, []).append(
                    Span(offset, offset + len(data), _Expected(path, offset, data))
                )
        for path, spans in self._spans.items():  # DCP never writes two items over one byte
            spans.sort(key=lambda s: (s.start, s.end))
            # (bytes read before the pass may hold chunks: a DeepSpeed archive's head)
            items = [s for s in spans if not isinstance(s.key, _Expected)]
            for before, after in itertools.pairwise(items):
                if after.start < before.end:
                    self.result.restore.append(
                        f"{_name(before.key)} and {_name(after.key)} overlap in {path} (bytes "
                        f"{after.start}...{min(before.end, after.end)}): the metadata is corrupt "
                        "or crafted"
                    )

    def run(self, progress: Progress | None = None) -> PassResult:
        started = time.perf_counter()
        if progress:
            progress.start(f"validate {self.label}", sum(f.size for f in self.files))
        counter = Counter(progress)
        pool = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="reg-validate")
        try:
            futures = [pool.submit(self._one_file, f, counter) for f in self.files]
            for future in as_completed(futures):
                future.result()
            if not self.result.integrity:
                self.result.nonfinite = self.batches.close()
        except OutOfDeviceMemory as exc:
            self._stop.set()
            self.result.restore.append(out_of_memory(self.device, self.budget, exc))
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
            if progress:
                progress.finish()
        self.result.seconds = time.perf_counter() - started
        return self.result

    def changed(self, path: str) -> None:
        """Bytes of `path` read before the pass differ from those it hashes."""
        with self._lock:
            self.result.integrity.append(
                f"{path} changed while it was validated (its first read and the pass differ)"
            )
        self._stop.set()

    def _one_file(self, record: FileRecord, counter: Callable[[int], None]) -> None:
        reader = _FileReader(self, record.path)
        try:
            n = read_verified(
                self.store,
                self.prefix,
                record,
                self._spans.get(record.path, []),
                reader.deliver,
                label=self.label,
                stop=self._stop,
                advance=counter,
            )
        except IntegrityError as exc:
            if not self._stop.is_set() or "stopped" not in exc.message:
                with self._lock:
                    self.result.integrity.append(exc.message.removeprefix(f"{self.label}: "))
            self._stop.set()  # fail fast: the checkpoint is not what was pushed
            return
        with self._lock:
            self.result.files += 1
            self.result.bytes_read += n
            self.result.chunks += reader.chunks
            self.result.restore.extend(reader.restore)
            self.result.shapes.extend(reader.shapes)


class RawStream:
    """A chunk that is the tensor's own bytes (a safetensors file's), handed on in pieces of
    whole elements as they pass."""

    def __init__(self, dtype: str, where: str) -> None:
        self.item, self.where = ITEMSIZE[dtype], where
        self.head = bytearray()  # nothing is held: a raw chunk always streams
        self._carry = b""

    def feed(self, view: memoryview) -> list[memoryview | bytes]:
        out: list[memoryview | bytes] = []
        if self._carry:  # an element split between two reads
            need = self.item - len(self._carry)
            self._carry += bytes(view[:need])
            view = view[need:]
            if len(self._carry) < self.item:
                return out
            out.append(self._carry)
            self._carry = b""
        whole = len(view) - len(view) % self.item
        if whole:
            out.append(view[:whole])
        self._carry = bytes(view[whole:])
        return out

    def finish(self) -> None:
        if self._carry:
            raise IntegrityError(f"{self.where}: it ends inside an element", "run `reg verify`")


class _FileReader:
    """The chunks of one file as its bytes pass (spans arrive in order)."""

    def __init__(self, owner: StreamPass, path: str) -> None:
        self.owner, self.path = owner, path
        self.chunks = 0
        self.restore: list[str] = []
        self.shapes: list[str] = []
        self._key: object = None
        self._stream: ArchiveStream | RawStream | None = None
        self._held: bytearray | None = None
        self._elements = 0  # elements of the current tensor chunk handed to the batches
        self._failed = False

    def deliver(self, key: Any, at: int, view: memoryview) -> None:
        if isinstance(key, _Expected):
            if view != key.data[at : at + len(view)]:
                self.owner.changed(self.path)
            return
        if key is not self._key:
            self._begin(key)
        if not self._failed:
            try:
                self._take(key, view)
            except (RegistryError, NotStreamable) as exc:
                self._fail(key, str(exc))
        if at + len(view) == key.chunk.length:
            self._end(key)

    def _where(self, key: Any) -> str:
        fqn = key.info.fqn if isinstance(key, _TensorChunk) else key.fqn
        return f"{fqn} in {self.path}"

    def _begin(self, key: Any) -> None:
        self._key, self._failed, self._elements, self._held = key, False, 0, None
        self._stream = None
        if isinstance(key, _TensorChunk) and key.chunk.raw:
            self._stream = RawStream(key.info.dtype, self._where(key))
        elif isinstance(key, _TensorChunk):
            self._stream = ArchiveStream(
                key.chunk.length, key.info.dtype, key.chunk.sizes, self._where(key)
            )
        else:
            self._hold(key, bytearray())

    def _hold(self, key: Any, start: bytearray) -> None:
        # Held, copied once for torch.load, and loaded: three times the chunk's size.
        if key.chunk.length * HELD_COPIES > self.owner.held_limit:
            need = key.chunk.length * HELD_COPIES * 4 * self.owner.workers
            self._failed = True
            what = "is not a plain tensor (it cannot be read in sub-ranges)"
            if isinstance(key, _ObjectChunk):
                what = "is a non-tensor item (loaded whole)"
            self.restore.append(
                f"{self._where(key)} ({human_bytes(key.chunk.length)}) {what} and does not fit "
                f"--memory-budget {human_bytes(self.owner.budget.total)}: it needs --memory-budget "
                f"{human_bytes(need)} or more"
            )
            return
        self._held = start

    def _take(self, key: Any, view: memoryview) -> None:
        if self._held is not None:
            self._held += view
            return
        assert self._stream is not None
        try:
            pieces = self._stream.feed(view)
        except NotStreamable:
            head, self._stream = self._stream.head, None
            self._hold(key, head)
            return
        info = key.info
        if not self.owner.batches.wants(info.fqn, info.dtype):
            return
        for piece in pieces:
            self.owner.batches.add(info.fqn, info.dtype, piece, key.chunk, self._elements)
            self._elements += len(piece) // _itemsize(info.dtype)

    def _fail(self, key: Any, problem: str) -> None:
        self._failed, self._held, self._stream = True, None, None
        self.restore.append(
            problem if self._where(key) in problem else f"{self._where(key)}: {problem}"
        )

    def _end(self, key: Any) -> None:
        if self._failed:
            return
        try:
            if isinstance(key, _ObjectChunk):
                from registry.formats.dcp_load import load_object

                assert self._held is not None
                load_object(bytes(self._held), self._where(key))  # loads, then is let go
            elif self._stream is not None:
                self._stream.finish()
            else:
                self._load_held(key)
            self.chunks += 1
        except (RegistryError, NotStreamable) as exc:
            self._fail(key, str(exc))
        finally:
            self._held, self._stream = None, None

    def _load_held(self, key: _TensorChunk) -> None:
        """A chunk that could not stream: loaded with torch, then into the batches."""
        import torch

        from registry.formats.dcp_load import load_chunk

        assert self._held is not None
        info, chunk = key.info, key.chunk
        tensor = load_chunk(bytes(self._held), self._where(key))
        if tuple(tensor.shape) != chunk.sizes and len(tensor.shape) == len(chunk.sizes):
            tensor = tensor[tuple(slice(0, s) for s in chunk.sizes)]  # narrowed, as DCP does
        if tuple(tensor.shape) != chunk.sizes or str(tensor.dtype) != f"torch.{info.dtype}":
            self.shapes.append(
                f"{self._where(key)}: chunk at {chunk.offsets} loaded as "
                f"{tuple(tensor.shape)} {tensor.dtype}, metadata says {chunk.sizes} {info.dtype}"
            )
            return
        if self.owner.batches.wants(info.fqn, info.dtype) and tensor.numel():
            data = tensor.contiguous().view(-1).view(torch.uint8).numpy()
            self.owner.batches.add(info.fqn, info.dtype, data, chunk, 0)


def _name(key: Any) -> str:
    return str(key.info.fqn if isinstance(key, _TensorChunk) else key.fqn)


def _itemsize(dtype: str) -> int:
    return ITEMSIZE[dtype]


def model_bytes(inv: Inventory, names: dict[str, str]) -> int:
    """What holding the model's tensors takes (tied names share one tensor)."""
    return sum(
        math.prod(inv.tensors[fqn].shape) * _itemsize(inv.tensors[fqn].dtype)
        for fqn in set(names.values())
        if fqn in inv.tensors
    )
