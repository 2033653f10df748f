"""A read-only store over `reg server`'s file endpoint, for one pull or one validation.

Keys are the artifact's prefix plus a file path, as the lifecycle code builds them; each read is
a request for that file of the artifact (`GET /v1/read?ref=...&path=...`), which the server
authorizes and serves from the version the catalog recorded. Sizes come from the catalog's file
list; every byte read is checked against the recorded sha256 by the code that reads it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from registry.errors import IntegrityError, NotFound, UsageError
from registry.storage.base import BaseStore, ObjectInfo, Producer

if TYPE_CHECKING:
    from registry.formats.documents import FileRecord
    from registry.remote.client import Client

MAX_RANGE = 64 << 20  # the server's limit for one ranged read


class RemoteReader(BaseStore):
    def __init__(self, client: Client, ref: str, prefix: str, files: Sequence[FileRecord]) -> None:
        self.client, self.ref, self.prefix = client, ref, prefix
        self.sizes = {prefix + f.path: f.size for f in files}
        self.url = f"{client.url} {ref}"

    def _path(self, key: str) -> str:
        if key not in self.sizes:  # only the files the listing named
            raise NotFound(f"{self.ref} has no file {key.removeprefix(self.prefix)}")
        return key.removeprefix(self.prefix)

    def _head(self, key: str, version: str | None) -> ObjectInfo | None:
        return ObjectInfo(key, self.sizes[key], version) if key in self.sizes else None

    def _read_range(self, key: str, offset: int, length: int, version: str | None) -> bytes:
        path = self._path(key)
        parts = []
        end = offset + length
        while offset < end:
            n = min(MAX_RANGE, end - offset)
            parts.append(self.client.read(self.ref, path, offset=offset, length=n))
            offset += n
        data = parts[0] if len(parts) == 1 else b"".join(parts)
        return bytearray(data)  # type: ignore[return-value]  # writable, like the local store

    def _stream(self, key: str, version: str | None) -> Iterator[bytes]:
        """The file's bytes, cut off as soon as more arrive than the catalog records (a server
        gone wrong cannot fill the destination's disk)."""
        path, size = self._path(key), self.sizes[key]
        got = 0
        for piece in self.client.stream(self.ref, path):
            got += len(piece)
            if got > size:
                raise IntegrityError(
                    f"{self.ref}: the server sent more than the {size} bytes of {path}",
                    "check REG_URL; the file is refused",
                )
            yield piece

    def _list(self, prefix: str) -> Iterator[ObjectInfo]:
        return iter(
            [ObjectInfo(k, s) for k, s in sorted(self.sizes.items()) if k.startswith(prefix)]
        )

    def _describe(self, key: str) -> str:
        return f"{self.client.url} ({self.ref})"

    def _put_stream(self, key: str, produce: Producer, immutable: bool) -> tuple[int, str]:
        raise UsageError("a remote reader does not write", "writes go through reg server")

    def _delete(self, key: str) -> int:
        raise UsageError("a remote reader does not delete", "deletes go through reg server")
