"""The checkpoint bytes a promotion consolidates, proved to be the bytes the manifest recorded.

A checkpoint's files can change in the store after they were pushed and validated (a tampered
shard, a bad restore from backup, a disk error). Checking digests first and reading chunks later
would leave a window in which the store hands out other bytes, so promotion reads each shard
that holds model chunks exactly once, front to back, through the reader validation uses too
(storage/verified_stream.py): every byte goes through sha256, and the
byte ranges of the model's chunks are copied, as they pass, into a local spool (an unnamed temp
file, gone when the promotion ends). Consolidation reads its chunks from the spool only, and
only after the whole file hashed to the digest the catalog recorded. `.metadata` is proved the
same way before it is parsed. A safetensors model file's header (the Trainer's plain save) is
read by range first, to place its chunks, and proved in the same pass as them: the spooled copy
of its first bytes must equal what was parsed, or nothing is promoted. Shards are proved in
parallel (hashlib releases the GIL).

On a versioned bucket each read names the version the manifest recorded, so a newer object put
under the same key is never read.
"""

from __future__ import annotations

import bisect
import hashlib
import os
import tempfile
import threading
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from registry.core.progress import Counter
from registry.errors import IntegrityError, RegistryError
from registry.formats import file_roots
from registry.formats.dcp import ChunkRange
from registry.formats.dcp_roots import metadata_paths
from registry.storage.verified_stream import Span, read_verified

if TYPE_CHECKING:
    from registry.core.progress import Progress
    from registry.formats.documents import FileRecord
    from registry.storage.base import BaseStore


@dataclass(frozen=True)
class _Span:
    start: int
    end: int
    spool_at: int


class ProvenCheckpoint:
    """Read access to the proved bytes of one checkpoint (see the module docstring)."""

    def __init__(
        self,
        store: BaseStore,
        prefix: str,
        files: Sequence[FileRecord],
        *,
        label: str,
        workers: int = 2,
    ) -> None:
        self.store, self.prefix, self.label, self.workers = store, prefix, label, max(1, workers)
        self.records = {f.path: f for f in files}
        self._spans: dict[str, list[_Span]] = {}
        self._starts: dict[str, list[int]] = {}
        self.bytes_hashed = 0
        self._stop = threading.Event()
        self._read: dict[str, list[tuple[int, bytes]]] = {}  # file roots' ranges: `prove`
        self.metadata = {p: self._root(p) for p in metadata_paths(self.records)}
        self._spool = tempfile.TemporaryFile(prefix="reg-promote-")  # noqa: SIM115 (closed by close())

    def __enter__(self) -> ProvenCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._spool.close()

    # -- proving --------------------------------------------------------------------------------

    def prove(self, chunks: Iterable[ChunkRange], progress: Progress | None = None) -> None:
        """One pass over every file that holds one of `chunks`, keeping those chunks' bytes."""
        wanted: dict[str, list[tuple[int, int]]] = {}
        for c in chunks:
            record = self._record(c.file)
            if c.offset < 0 or c.length < 0 or c.offset + c.length > record.size:
                raise IntegrityError(
                    f"{self.label}: .metadata puts a chunk at bytes {c.offset}..."
                    f"{c.offset + c.length} of {c.file}, which has {record.size}",
                    "the checkpoint metadata is inconsistent; it cannot be promoted",
                )
            wanted.setdefault(c.file, []).append((c.offset, c.offset + c.length))
        for path, ranges in self._read.items():  # the ranges the chunks were placed by
            wanted.setdefault(path, []).extend((at, at + len(data)) for at, data in ranges)
        at = 0
        for path in sorted(wanted):
            spans = []
            for start, end in _merged(wanted[path]):
                spans.append(_Span(start, end, at))
                at += end - start
            self._spans[path] = spans
            self._starts[path] = [s.start for s in spans]
        paths = sorted(wanted)
        if progress:
            progress.start(
                f"prove {len(paths)} shards of {self.label}",
                sum(self.records[p].size for p in paths),
            )
        counter = Counter(progress)
        pool = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="reg-prove")
        try:
            futures = [pool.submit(self._pass, p, counter) for p in paths]
            for future in as_completed(futures):
                self.bytes_hashed += future.result()  # the first failure stops the others
        except BaseException:
            self._stop.set()
            raise
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
            if progress:
                progress.finish()
        for path, ranges in self._read.items():
            if any(bytes(self.read(path, at, len(data))) != data for at, data in ranges if data):
                raise self._mismatch(path, "it changed between two reads")

    def _pass(self, path: str, counter: Counter) -> int:
        spans = [Span(s.start, s.end, s.spool_at) for s in self._spans[path]]

        def spool(spool_at: int, at: int, view: memoryview) -> None:
            self._spool_write(view, spool_at + at)

        try:
            return read_verified(
                self.store,
                self.prefix,
                self.records[path],
                spans,
                spool,
                label=self.label,
                stop=self._stop,
                advance=counter,
            )
        except IntegrityError as exc:
            raise IntegrityError(f"{exc.message}; nothing was promoted", exc.hint) from None

    def _root(self, path: str) -> bytes:
        """A root's metadata: a `.metadata` whole and proved; a file root's ranges (a
        safetensors header, a DeepSpeed archive's ends and record headers) by range, proved by
        `prove` in its pass over that file (which places the model's chunks from them, and must
        hash to the catalog's digest anyway)."""
        if not file_roots.is_root_name(path):
            return self._whole(path)
        record = self._record(path)
        key, version = self.prefix + path, record.version
        root, self._read[path] = file_roots.read_root(
            path,
            lambda at, n: bytes(self.store.read_range(key, at, n, version=version)),
            record.size,
            f"{self.label}: {path}",
        )
        return root

    def _whole(self, path: str) -> bytes:
        record = self._record(path)
        pieces, size = [], 0
        for piece in self._stream(path):
            pieces.append(piece)
            size += len(piece)
            if size > record.size:  # never hold more than the recorded size
                break
        data = b"".join(pieces)
        if len(data) != record.size:
            raise self._mismatch(
                path, f"it has {len(data)} bytes, the manifest recorded {record.size}"
            )
        actual = hashlib.sha256(data).hexdigest()
        if actual != record.sha256:
            raise self._mismatch(path, f"sha256 {actual[:16]}..., recorded {record.sha256[:16]}...")
        self.bytes_hashed += len(data)
        return data

    def _stream(self, path: str) -> Iterable[Any]:
        record = self.records[path]
        return self.store.stream(self.prefix + path, version=record.version)

    def _record(self, path: str) -> FileRecord:
        record = self.records.get(path)
        if record is None:
            raise IntegrityError(
                f"{self.label}: .metadata names {path}, which the manifest does not list",
                "the checkpoint is inconsistent; it cannot be promoted",
            )
        return record

    def _mismatch(self, path: str, detail: str) -> IntegrityError:
        return IntegrityError(
            f"{self.label}: {path} is not the file that was pushed ({detail}); nothing was "
            "promoted",
            f"the stored copy changed after the push: run `reg verify {self.label}`, and "
            "promote an intact checkpoint",
        )

    def _spool_write(self, view: memoryview, offset: int) -> None:
        try:
            while view:
                n = os.pwrite(self._spool.fileno(), view, offset)
                view, offset = view[n:], offset + n
        except OSError as exc:
            raise RegistryError(
                f"cannot write the promotion's spool in {tempfile.gettempdir()}: {exc.strerror}",
                "the spool holds the model's bytes: free space there or point TMPDIR elsewhere",
            ) from None

    # -- reading --------------------------------------------------------------------------------

    def read(self, path: str, offset: int, length: int) -> bytearray:
        """`length` proved bytes of `path` from `offset` (a chunk `prove` was given)."""
        spans = self._spans.get(path, [])
        i = bisect.bisect_right(self._starts.get(path, []), offset) - 1
        if i < 0 or offset + length > spans[i].end:
            raise IntegrityError(
                f"{self.label}: bytes {offset}..{offset + length} of {path} were not proved",
                "this is a bug in reg; please report it",
            )
        buf = bytearray(length)
        view, at = memoryview(buf), spans[i].spool_at + offset - spans[i].start
        while view:
            got = os.preadv(self._spool.fileno(), [view], at)
            if got <= 0:
                raise OSError(f"short read from the promotion spool at byte {at}")
            view, at = view[got:], at + got
        return buf


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for start, end in sorted(ranges):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out
