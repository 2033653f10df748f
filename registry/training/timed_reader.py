"""The store reader of a restore, timed: how long `.metadata` took, and the store's reads."""

from __future__ import annotations

import time
from typing import Any

from registry.formats.dcp_load import StoreReader
from registry.storage.base import BaseStore


class TimedReader(StoreReader):
    def __init__(self, store: BaseStore, prefix: str, versions: dict[str, str]) -> None:
        super().__init__(_TimedStore(store), prefix, versions=versions)  # type: ignore[arg-type]
        self.opened_at = time.monotonic()
        self.metadata_seconds = 0.0

    @property
    def fetch_seconds(self) -> float:
        return float(self.store.seconds)  # type: ignore[attr-defined]

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        started = time.monotonic()
        before = self.fetch_seconds
        try:
            return super().read_metadata(*args, **kwargs)
        finally:
            self.metadata_seconds += time.monotonic() - started
            self.store.seconds = before  # type: ignore[attr-defined]  # counted as metadata


class _TimedStore:
    """The two reads a StoreReader makes, timed; nothing else is reachable."""

    def __init__(self, store: BaseStore) -> None:
        self._store = store
        self.seconds = 0.0

    def get_bytes(self, key: str, *, version: str | None = None) -> bytes:
        started = time.monotonic()
        try:
            return self._store.get_bytes(key, version=version)
        finally:
            self.seconds += time.monotonic() - started

    def read_range(self, key: str, offset: int, length: int, *, version: str | None = None) -> Any:
        started = time.monotonic()
        try:
            return self._store.read_range(key, offset, length, version=version)
        finally:
            self.seconds += time.monotonic() - started
