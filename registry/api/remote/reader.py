"""A read-only store over `reg server`'s file endpoint, for one pull or one validation.

Keys are the artifact's prefix plus a file path, as the lifecycle code builds them; each read is
a request for that file of the artifact (`GET /v1/read?ref=...&path=...`), which the server
authorizes and serves from the version the catalog recorded. Sizes come from the catalog's file
list; every byte read is checked against the recorded sha256 by the code that reads it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import httpx

from registry.errors import IntegrityError, NotFound, RegistryError, UsageError
from registry.storage.base import BaseStore, ObjectInfo, Producer

if TYPE_CHECKING:
    from registry.api.remote.client import Client
    from registry.formats.documents import FileRecord

MAX_RANGE = 64 << 20  # the server's limit for one ranged read


class RemoteReader(BaseStore):
    def __init__(
        self,
        client: Client,
        ref: str,
        prefix: str,
        files: Sequence[FileRecord],
        urls: Callable[[], dict[str, str]] | None = None,
    ) -> None:
        """`urls`, on a server with an S3 store: fresh presigned GET URLs by file path; reads
        then go straight to S3 (and to the server only if S3 refuses)."""
        self.client, self.ref, self.prefix = client, ref, prefix
        self.sizes = {prefix + f.path: f.size for f in files}
        self.url = f"{client.url} {ref}"
        self._fresh_urls = urls
        self._urls: dict[str, str] | None = None
        self._s3: httpx.Client | None = None
        self._lock = threading.Lock()

    def _signed(self, path: str, *, renew: bool = False) -> str | None:
        if self._fresh_urls is None:
            return None
        with self._lock:
            if self._urls is None or renew:
                self._urls = self._fresh_urls()
            if self._s3 is None:
                self._s3 = httpx.Client(timeout=httpx.Timeout(60.0), follow_redirects=False)
            return self._urls.get(path)

    def _direct(self, path: str, headers: dict[str, str]) -> httpx.Response | None:
        """GET `path` from S3 with a presigned URL (a fresh one if the first expired); None
        when there is no URL or S3 keeps refusing: the server then serves it."""
        for renew in (False, True):
            url = self._signed(path, renew=renew)
            if url is None or self._s3 is None:
                return None
            try:
                response = self._s3.get(url, headers=headers)
            except httpx.HTTPError:
                return None
            if response.status_code < 300:
                return response
            if response.status_code != 403:
                return None
        return None

    def close(self) -> None:
        if self._s3 is not None:
            self._s3.close()

    def __enter__(self) -> RemoteReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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
            direct = self._direct(path, {"range": f"bytes={offset}-{offset + n - 1}"})
            if direct is not None and direct.status_code == 206 and len(direct.content) == n:
                parts.append(direct.content)
            else:
                parts.append(self.client.read(self.ref, path, offset=offset, length=n))
            offset += n
        data = parts[0] if len(parts) == 1 else b"".join(parts)
        return bytearray(data)  # type: ignore[return-value]  # writable, like the local store

    def _stream(self, key: str, version: str | None) -> Iterator[bytes]:
        """The file's bytes, cut off as soon as more arrive than the catalog records (a server
        gone wrong cannot fill the destination's disk)."""
        path, size = self._path(key), self.sizes[key]
        got = 0
        for piece in self._pieces(path):
            got += len(piece)
            if got > size:
                raise IntegrityError(
                    f"{self.ref}: the server sent more than the {size} bytes of {path}",
                    "check REG_URL; the file is refused",
                )
            yield piece

    def _pieces(self, path: str) -> Iterator[bytes]:
        url = self._signed(path)
        if url is None or self._s3 is None:
            yield from self.client.stream(self.ref, path)
            return
        sent = False
        try:
            with self._s3.stream("GET", url) as response:
                if response.status_code == 200:
                    for piece in response.iter_bytes(1 << 20):
                        sent = True
                        yield piece
                    return
        except httpx.HTTPError as exc:
            if sent:
                raise RegistryError(
                    f"{self.ref}: reading {path} from the store broke off", "pull again"
                ) from exc
        yield from self.client.stream(self.ref, path)  # expired, or S3 unreachable from here

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
