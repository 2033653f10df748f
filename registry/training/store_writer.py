"""A DCP `StorageWriter` whose files go straight into the registry's store.

Every rank writes its own `__<rank>_<i>.distcp` files into the checkpoint's prefix: each file
is streamed into the store as DCP serializes it (put-if-absent, hashed as written; no staging
directory, no copy). The coordinator's `finish()` receives every rank's file records through
DCP's write results, writes `.metadata` (its storage data stripped back to DCP's own
`_StorageInfo`, so the safe reader accepts it) and hands everything to `on_commit`, which
commits the catalog row: one transaction whatever the world size.

DCP's file writer is reused for everything but the bytes' destination: `fs` is a
`FileSystemBase` whose streams are store objects. Write results carry one extra entry per rank
(`_RankWrites`, under a reserved FQN) with the rank's files, bytes and seconds; `finish` takes
those out before DCP's metadata is built from the rest.
"""

from __future__ import annotations

import io
import os
import pickle
import queue
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

from torch.distributed.checkpoint import filesystem
from torch.distributed.checkpoint.filesystem import FileSystemBase, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from registry.errors import Conflict, ObjectExists, RegistryError
from registry.formats.dcp_scan import RANK_FILE
from registry.formats.documents import FileRecord
from registry.storage.base import BaseStore, ObjectWriter, PutResult

RANK_WRITES_FQN = "__reg_rank_writes__"  # never a real key: DCP keys are the state dict's FQNs
BUFFER = 8 * 1024 * 1024  # bytes gathered before they go to the store's writer thread


class ObjectSink(Protocol):
    """Where a writer's objects go, put-if-absent: the store itself (`StoreSink`), or the
    store behind `reg server` (`registry.training.backends.ServerSink`). Each put returns the
    object's size and sha256 as the sink measured them."""

    def put_chunks(self, key: str, chunks: Iterator[bytes]) -> PutResult: ...

    def put_bytes(self, key: str, data: bytes) -> PutResult: ...


class StoreSink:
    """The registry's own store as an `ObjectSink` (embedded mode)."""

    def __init__(self, store: BaseStore) -> None:
        self.store = store

    def put_chunks(self, key: str, chunks: Iterator[bytes]) -> PutResult:
        def produce(write: Callable[[Any], None]) -> None:
            for chunk in chunks:
                write(chunk)

        return self.store.put_stream(key, produce)

    def put_bytes(self, key: str, data: bytes) -> PutResult:
        return self.store.put_bytes(key, data)

    def open_writer(self, key: str) -> ObjectWriter | None:
        return self.store.open_writer(key)


@dataclass(slots=True)
class _RankWrites:
    """What one rank wrote: its files, bytes and seconds (a write result, pickled to rank 0)."""

    rank: int
    files: list[FileRecord] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def bytes(self) -> int:
        return sum(f.size for f in self.files)


@dataclass(frozen=True, slots=True)
class Written:
    """Everything the coordinator's `finish()` knows: the checkpoint's files (`.metadata`
    included) and each rank's share."""

    files: list[FileRecord]
    ranks: list[_RankWrites]

    def rank_costs(self) -> list[dict[str, Any]]:
        return [
            {
                "rank": r.rank,
                "files": len(r.files),
                "bytes": r.bytes,
                "seconds": round(r.seconds, 4),
                "mb_per_s": round(r.bytes / r.seconds / 1e6, 1) if r.seconds > 0 else None,
            }
            for r in sorted(self.ranks, key=lambda r: r.rank)
        ]


class StoreWriter(FileSystemWriter):
    """`dcp.save(state, storage_writer=StoreWriter(sink, prefix, on_commit))` on every rank.
    `on_commit(written, metadata_bytes)` runs on the coordinator once every rank's files and
    `.metadata` are in the store; what it raises fails the save on every rank."""

    def __init__(
        self,
        sink: ObjectSink,
        prefix: str,
        on_commit: Callable[[Written], None] | None,
        *,
        thread_count: int = 1,
    ) -> None:
        # sync_files=False: the store makes each object durable before it is visible (a local
        # store fsyncs the file and its directory); DCP's fallback would `os.sync()` the host.
        super().__init__(prefix, thread_count=thread_count, sync_files=False, overwrite=True)
        self.store_fs = _StoreFileSystem(sink, prefix)
        self.fs = self.store_fs  # type: ignore[assignment]  # DCP's writer takes any FileSystemBase
        self.path = prefix
        self.sink, self.prefix, self.on_commit = sink, prefix, on_commit

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan  # no directory to make, and the prefix is fresh under the claim

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        started = time.monotonic()
        self.store_fs.written.clear()
        results = super().write_data(plan, planner).wait()
        mine = _RankWrites(self.rank or 0, list(self.store_fs.written), time.monotonic() - started)
        marker = WriteResult(
            index=MetadataIndex(RANK_WRITES_FQN, None, self.rank or 0),
            size_in_bytes=0,
            storage_data=mine,
        )
        done: Future[list[WriteResult]] = Future()
        done.set_result([*results, marker])
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        ranks = [r.storage_data for rs in results for r in rs if r.index.fqn == RANK_WRITES_FQN]
        plain = [[r for r in rs if r.index.fqn != RANK_WRITES_FQN] for rs in results]
        metadata.version = _dcp_version()
        metadata.storage_data = {r.index: r.storage_data for rs in plain for r in rs}
        metadata.storage_meta = StorageMeta(checkpoint_id=self.prefix, save_id=self.save_id)
        data = pickle.dumps(metadata)
        # The stored file must pass the registry's own safe reader, as any pushed one does.
        from registry.formats.dcp_metadata import load_metadata

        load_metadata(data)
        put = _put_new(self.sink, self.prefix + ".metadata", data)
        files = [f for r in ranks for f in r.files]
        files.append(FileRecord(".metadata", put.size, put.sha256, None, put.version))
        if self.on_commit is not None:
            self.on_commit(Written(sorted(files, key=lambda f: f.path), ranks))


def _dcp_version() -> str:
    return str(getattr(filesystem, "CURRENT_DCP_VERSION", "1.0.0"))


def _put_new(sink: ObjectSink, key: str, data: bytes) -> PutResult:
    try:
        return sink.put_bytes(key, data)
    except ObjectExists:
        raise _exists(key) from None


class _StoreFileSystem(FileSystemBase):
    """DCP's view of the checkpoint's prefix: streams that are store objects. Paths are the
    file names DCP chooses (`__0_0.distcp`), joined to nothing."""

    def __init__(self, sink: ObjectSink, prefix: str) -> None:
        self.sink, self.prefix = sink, prefix
        self.written: list[FileRecord] = []
        self._lock = threading.Lock()

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[io.IOBase]:
        if mode != "wb":
            raise ValueError(f"the store writer only writes ({mode!r})")
        name = str(path)
        stream = _ObjectStream(self.sink, self.prefix + name)
        try:
            yield stream
        except BaseException:
            stream.abort()
            raise
        record = stream.finish()
        if record is not None:
            with self._lock:
                self.written.append(
                    FileRecord(name, record.size, record.sha256, _rank_of(name), record.version)
                )

    def concat_path(self, path: str | os.PathLike[str], suffix: str) -> str:
        return suffix

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        raise NotImplementedError("objects are written once under their final names")

    def init_path(self, path: str | os.PathLike[str]) -> str:
        return str(path)

    def mkdir(self, path: str | os.PathLike[str]) -> None:
        pass

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False

    def exists(self, path: str | os.PathLike[str]) -> bool:
        raise NotImplementedError("not asked: the claim makes the prefix fresh")

    def rm_file(self, path: str | os.PathLike[str]) -> None:
        raise NotImplementedError("the store writer never deletes")

    def ls(self, path: str | os.PathLike[str]) -> list[str]:
        raise NotImplementedError("not asked: the writer records what it wrote")


def _rank_of(name: str) -> int | None:
    match = RANK_FILE.fullmatch(name)
    return int(match.group(1)) if match else None


_END, _ABORT = object(), object()
SMALL = 1 << 20  # writes below this are gathered (zip headers, pickles); larger go as they are


class _Aborted(Exception):
    pass


class _ObjectStream(io.RawIOBase):
    """A write-only stream that is one object; nothing is visible until `finish()`, an aborted
    stream leaves no object, and a stream nothing was written to makes none (a rank with no
    items of its own).

    Where the sink has an inline writer (a local store) each large write (a tensor's storage,
    in one call from torch.save) is hashed and written from the caller's thread, without a
    copy, as DCP's own writer does. Otherwise (S3, `reg server`) bytes go in BUFFER-sized
    chunks to a thread running the sink's `put_chunks`, two queued at most: memory stays
    bounded whatever the tensor's size."""

    def __init__(self, sink: ObjectSink, key: str) -> None:
        super().__init__()
        self.sink, self.key = sink, key
        self._small = bytearray()
        self._position = 0
        self._writer: Any = None  # an ObjectWriter, opened at the first write
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=2)
        self._thread: threading.Thread | None = None
        self._result: Any = None
        self._error: BaseException | None = None
        self._finished = False

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        n = len(view)
        self._position += n
        if n < SMALL:
            self._small += view
            if len(self._small) >= BUFFER:
                self._flush_small()
            return n
        self._flush_small()
        if self._inline():
            self._writer.write(view)
            return n
        for start in range(0, n, BUFFER):  # one copy per chunk: the caller's memory is its own
            self._send(bytes(view[start : start + BUFFER]))
        return n

    def close(self) -> None:
        pass  # DCP closes the stream before the context ends; `finish` publishes

    def _inline(self) -> bool:
        if self._writer is None and self._thread is None:
            opener = getattr(self.sink, "open_writer", None)
            try:
                self._writer = opener(self.key) if opener is not None else None
            except ObjectExists:
                raise _exists(self.key) from None
            if self._writer is None:
                self._writer = False
        return bool(self._writer)

    def _flush_small(self) -> None:
        if not self._small:
            return
        chunk, self._small = self._small, bytearray()  # handed over, not copied
        if self._inline():
            self._writer.write(chunk)
        else:
            self._send(chunk)

    def _send(self, item: Any) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._put, name="reg-store-writer", daemon=True)
            self._thread.start()
        while True:
            if self._error is not None and item is not _ABORT:
                raise _mapped(self.key, self._error)
            try:
                self._queue.put(item, timeout=0.5)
                return
            except queue.Full:
                if not self._thread.is_alive():
                    if item is _ABORT:
                        return
                    continue  # its error is set: raised above

    def _put(self) -> None:
        def chunks() -> Iterator[bytes]:
            while True:
                item = self._queue.get()
                if item is _END:
                    return
                if item is _ABORT:
                    raise _Aborted
                yield item

        try:
            self._result = self.sink.put_chunks(self.key, chunks())
        except BaseException as exc:
            self._error = exc
            while True:  # let a writer blocked on a full queue go on to see the error
                try:
                    self._queue.get_nowait()
                except queue.Empty:
                    break

    def finish(self) -> Any:
        """Publish the object; its PutResult (None when nothing was written)."""
        if self._finished:
            return self._result
        self._flush_small()
        self._finished = True
        if self._writer:
            try:
                self._result = self._writer.publish()
            except ObjectExists:
                raise _exists(self.key) from None
            finally:
                self._writer.discard()
            return self._result
        if self._thread is None:
            return None
        self._send(_END)
        self._thread.join()
        if self._error is not None:
            raise _mapped(self.key, self._error)
        return self._result

    def abort(self) -> None:
        if self._finished:
            return
        self._finished = True
        if self._writer:
            self._writer.discard()
        elif self._thread is not None:
            self._send(_ABORT)
            self._thread.join()


def _exists(key: str) -> Conflict:
    return Conflict(
        f"{key} already exists in the store: another writer is writing this step",
        "a stale writer of an earlier attempt is still running; save under a new step",
    )


def _mapped(key: str, error: BaseException) -> BaseException:
    """The store's error as the user should read it."""
    if isinstance(error, ObjectExists):
        return _exists(key)
    if isinstance(error, RegistryError):
        return error
    return RegistryError(f"writing {key} failed: {error}")
