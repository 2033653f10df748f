"""Bytes validation reads before its one pass, proved in that pass.

Validation needs a checkpoint's metadata before it reads the files (to know where each chunk
is). A `.metadata` or a small file beside the shards is read whole and proved against the
catalog's digest at once. A safetensors model file's header and a large sidecar's two ends
(the Trainer's `optimizer.pt`) are small parts of big files: read here by range, and kept as
expectations that the pass (streamed.py) compares with the bytes it hashes. Each big file is
then read once, and what was parsed from it counts only if the pass finds it unchanged and the
whole file hashes to the catalog's digest.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from registry.formats import file_roots
from registry.lifecycle.checkpoints.resume_facts import proven_reader

if TYPE_CHECKING:
    from registry.formats.documents import FileRecord
    from registry.storage.base import BaseStore


class DeferredReads:
    """`read` and `read_ends` as `facts_of` and `stored_metadata` call them; `expected`:
    path -> (offset, bytes) the pass must find there."""

    def __init__(self, store: BaseStore, prefix: str, files: Sequence[FileRecord]) -> None:
        self.store, self.prefix = store, prefix
        self.records = {f.path: f for f in files}
        self.whole = proven_reader(store, prefix, files)
        self.expected: dict[str, list[tuple[int, bytes]]] = {}

    def read(self, path: str) -> bytes:
        if not file_roots.is_root_name(path):
            return self.whole(path)
        size = self.records[path].size
        root, spans = file_roots.read_root(
            path,
            lambda at, n: self._range(path, at, min(n, size - at)),
            size,
            f"{self.prefix}{path}",
        )
        for at, data in spans:
            self._expect(path, at, data)
        return root

    def read_ends(self, path: str, head: int, tail: int) -> tuple[bytes, bytes]:
        size = self.records[path].size
        head = min(head, size)
        tail = min(tail, size - head)
        first, last = self._range(path, 0, head), self._range(path, size - tail, tail)
        self._expect(path, 0, first)
        self._expect(path, size - tail, last)
        return first, last

    def _range(self, path: str, offset: int, length: int) -> bytes:
        if not length:
            return b""
        version = self.records[path].version
        return bytes(self.store.read_range(self.prefix + path, offset, length, version=version))

    def _expect(self, path: str, offset: int, data: bytes) -> None:
        if data:
            self.expected.setdefault(path, []).append((offset, data))
