"""An in-memory store (`memory://NAME`): for tests and for trying the registry without a disk.

Stores of the same name are one store within a process, so a `Registry` reopened in the same
process finds what an earlier one wrote; nothing survives the process. Writes are put-if-absent
and appear whole: an object is added to the map only after its producer finished.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterator
from typing import Any, ClassVar

from registry.errors import NotFound, ObjectExists
from registry.storage.base import CHUNK, BaseStore, ObjectInfo, Producer


class MemoryStore(BaseStore):
    _named: ClassVar[dict[str, MemoryStore]] = {}
    _named_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, name: str = "") -> None:
        self.url = f"memory://{name}"
        self._objects: dict[str, bytes] = {}
        self._lock = threading.Lock()

    @classmethod
    def named(cls, name: str) -> MemoryStore:
        with cls._named_lock:
            if name not in cls._named:
                cls._named[name] = cls(name)
            return cls._named[name]

    @classmethod
    def from_url(cls, url: str) -> MemoryStore:
        return cls.named(url.removeprefix("memory://").strip("/"))

    def _describe(self, key: str) -> str:
        return f"{self.url}/{key}"

    def _put_stream(self, key: str, produce: Producer, immutable: bool) -> tuple[int, str]:
        if key in self._objects:
            raise ObjectExists(key)
        parts: list[bytes] = []
        digest = hashlib.sha256()

        def write(data: Any) -> None:
            piece = bytes(memoryview(data).cast("B"))
            digest.update(piece)
            parts.append(piece)

        produce(write)
        body = b"".join(parts)
        with self._lock:
            if key in self._objects:
                raise ObjectExists(key)
            self._objects[key] = body
        return len(body), digest.hexdigest()

    def _body(self, key: str) -> bytes:
        try:
            return self._objects[key]
        except KeyError:
            raise NotFound(f"object {key} is missing from the store") from None

    def _head(self, key: str, version: str | None) -> ObjectInfo | None:
        body = self._objects.get(key)
        return None if body is None else ObjectInfo(key, len(body))

    def _read_range(self, key: str, offset: int, length: int, version: str | None) -> bytes:
        return bytearray(self._body(key)[offset : offset + length])  # type: ignore[return-value]

    def _stream(self, key: str, version: str | None) -> Iterator[bytes]:
        body = self._body(key)
        return (body[i : i + CHUNK] for i in range(0, len(body), CHUNK))

    def _list(self, prefix: str) -> Iterator[ObjectInfo]:
        with self._lock:
            items = sorted((k, len(v)) for k, v in self._objects.items() if k.startswith(prefix))
        return (ObjectInfo(k, size) for k, size in items)

    def _delete(self, key: str) -> int:
        with self._lock:
            body = self._objects.pop(key, None)
        return 0 if body is None else len(body)

    def init(self) -> dict[str, Any]:
        return {"store": self.url, "kind": "memory", "note": "nothing survives the process"}
