"""The S3 store (AWS S3, MinIO, Ceph RGW, ... through boto3; the client and the translation of
its errors are in s3_client.py).

Every write is conditional (`If-None-Match: *` on PutObject and CompleteMultipartUpload): 412 means
the object exists (the caller compares digests), 409 a concurrent write (the upload is retried
whole). Large objects go up as multipart uploads with parallel parts, the part size growing with
the file (S3 allows 10,000 parts), a bounded number of parts in memory, and sha256 computed in
the same pass: S3's own multipart checksums are composites of part checksums, so the manifest
is the record of each file's digest. Reads are ranged GETs. Where the bucket has Object Lock,
release objects get a retention; on versioned buckets a delete removes every version, so freed
bytes are real. boto3 itself is imported when the first request is made, so opening the store
costs nothing for a command that never touches it.
"""

from __future__ import annotations

import base64
import builtins
import contextlib
import datetime as dt
import hashlib
import os
import random
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from botocore.exceptions import BotoCoreError, ClientError

from registry.core import faults
from registry.errors import CompletedOver, Conflict, NotFound, ObjectExists, UsageError
from registry.storage.base import (
    CHUNK,
    BaseStore,
    ObjectInfo,
    Producer,
    Progress,
    Swept,
    check_key,
)
from registry.storage.parts import MIN_PART, file_parts, part_size_for, stream_parts
from registry.storage.s3_bucket import Bucket
from registry.storage.s3_client import (
    content_type,
    error_code,
    new_client,
    retryable,
    translate,
)

if TYPE_CHECKING:
    from registry.core.config import S3Settings

IN_FLIGHT = 4  # parts in memory per upload
PART_RETRIES = 4


class S3Store(BaseStore):
    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        client: Any = None,
        *,
        release_lock: Callable[[], tuple[str, int]] | None = None,
        settings: S3Settings | None = None,
    ) -> None:
        self.bucket = bucket
        self.settings = settings
        self.prefix = prefix.strip("/")
        self.url = f"s3://{bucket}/{self.prefix}".rstrip("/")
        self._client = client
        self._client_lock = threading.Lock()
        self._release_lock = release_lock
        self.admin = Bucket(self)
        self._written: dict[str, str] = {}  # key -> the version our put of it created
        self._pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="reg-s3")

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        release_lock: Callable[[], tuple[str, int]] | None = None,
        settings: S3Settings | None = None,
    ) -> S3Store:
        parsed = urlparse(url)
        if not parsed.netloc:
            raise UsageError(f"bad S3 URL {url!r}", "write s3://bucket/prefix")
        return cls(parsed.netloc, parsed.path, release_lock=release_lock, settings=settings)

    @property
    def client(self) -> Any:
        if self._client is None:
            with self._client_lock:
                if self._client is None:
                    self._client = new_client(self.settings)
        return self._client

    # -- keys ----------------------------------------------------------------------------------
    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def full_key(self, key: str) -> str:
        """The bucket key of a store key (checked)."""
        return self._key(check_key(key))

    def full_prefix(self, prefix: str) -> str:
        """The bucket key prefix of a store prefix (`ckpt/`: every checkpoint)."""
        return self._key(prefix)

    def _describe(self, key: str) -> str:
        return f"s3://{self.bucket}/{self._key(key)}"

    # -- writes --------------------------------------------------------------------------------
    def _put_bytes(self, key: str, data: bytes, immutable: bool) -> tuple[int, str]:
        sha = hashlib.sha256(data)
        out = self._call(
            key,
            lambda: self.client.put_object(
                Bucket=self.bucket,
                Key=self._key(key),
                Body=data,
                IfNoneMatch="*",
                # S3 recomputes this and refuses the PUT if the bytes it received differ.
                ChecksumAlgorithm="SHA256",
                ChecksumSHA256=base64.b64encode(sha.digest()).decode(),
                ContentType=content_type(key),
                **self.lock_args(immutable),
            ),
        )
        self._record_version(key, out.get("VersionId"))
        return len(data), sha.hexdigest()

    def _put_file(
        self, key: str, src: Path, immutable: bool, progress: Progress
    ) -> tuple[int, str]:
        size = os.path.getsize(src)
        part = part_size_for(size)
        with open(src, "rb") as f:
            if size <= part:
                data = f.read()
                result = self._put_bytes(key, data, immutable)
                if progress:
                    progress(len(data))
                return result

            def from_start() -> Iterator[bytes]:
                f.seek(0)
                return file_parts(f, part)

            return self._multipart(key, from_start, immutable, progress)

    def _put_stream(self, key: str, produce: Producer, immutable: bool) -> tuple[int, str]:
        def upload(parts: Iterator[bytes]) -> tuple[int, str]:
            given = [parts]

            def once() -> Iterator[bytes]:  # a stream is read once: no retry re-reads it
                if not given:
                    raise Conflict(f"{key}: a concurrent write conflicted with it", "retry")
                return given.pop()

            return self._multipart(key, once, immutable, None)

        return stream_parts(produce, MIN_PART * 2, upload)

    def _multipart(
        self,
        key: str,
        parts_from_start: Callable[[], Iterator[bytes]],
        immutable: bool,
        progress: Progress,
    ) -> tuple[int, str]:
        """Upload parts in parallel (at most IN_FLIGHT in memory), hashing them in order. A
        retry after a conflicting concurrent write reads the parts again from the start."""
        full_key = self._key(key)
        for attempt in range(3):
            parts = parts_from_start()
            upload_id = self._call(
                key,
                lambda: self.client.create_multipart_upload(
                    Bucket=self.bucket,
                    Key=full_key,
                    ChecksumAlgorithm="CRC32",
                    ChecksumType="FULL_OBJECT",
                    ContentType=content_type(key),
                    **self.lock_args(immutable),
                ),
            )["UploadId"]
            digest, crc, size, done = hashlib.sha256(), 0, 0, []
            in_flight: list[tuple[int, Future[dict[str, Any]]]] = []
            try:
                for number, data in enumerate(parts, start=1):
                    digest.update(data)
                    crc = zlib.crc32(data, crc)
                    size += len(data)
                    in_flight.append(
                        (
                            number,
                            self._pool.submit(
                                self._upload_part, full_key, upload_id, number, data, progress
                            ),
                        )
                    )
                    while len(in_flight) >= IN_FLIGHT:
                        n, fut = in_flight.pop(0)
                        done.append(_completed(n, fut.result()))
                for n, fut in in_flight:
                    done.append(_completed(n, fut.result()))
                if not done:  # an empty object
                    done.append(_completed(1, self._upload_part(full_key, upload_id, 1, b"", None)))
                completed = self.client.complete_multipart_upload(
                    Bucket=self.bucket,
                    Key=full_key,
                    UploadId=upload_id,
                    MultipartUpload={"Parts": done},
                    IfNoneMatch="*",
                    # The whole object's CRC32: S3 checks it against the assembled parts.
                    ChecksumCRC32=base64.b64encode(crc.to_bytes(4, "big")).decode(),
                    ChecksumType="FULL_OBJECT",
                )
            except ClientError as exc:
                self._abort(full_key, upload_id)
                code = error_code(exc)
                if code in ("PreconditionFailed", "412"):
                    raise ObjectExists(key) from None
                if code in ("ConditionalRequestConflict", "409") and attempt < 2:
                    continue  # a concurrent write: retry the whole upload (parts are gone)
                raise translate(exc, key) from exc
            except BotoCoreError as exc:  # the connection failed past botocore's retries
                self._abort(full_key, upload_id)
                raise translate(exc, key) from exc
            except BaseException:
                self._abort(full_key, upload_id)
                raise
            self.confirm_completed(key, completed)
            self.retain(full_key, completed.get("VersionId"), immutable)
            self._record_version(key, completed.get("VersionId"))
            return size, digest.hexdigest()
        raise Conflict(f"{key}: concurrent writes kept conflicting", "retry")

    def confirm_completed(self, key: str, completed: dict[str, Any]) -> None:
        """Do not take a successful conditional complete as proof that the key holds our bytes:
        some stores let two concurrent `CompleteMultipartUpload ... If-None-Match: *` of one key
        both succeed (SeaweedFS 4.48 does), the later replacing the earlier. The key must hold
        what we completed (our version on a versioned bucket, our ETag elsewhere); if it holds
        another, we lost the race: CompletedOver, an ObjectExists as a strict store's 412 (the
        caller compares digests, and replaces the object only while it holds the step's claim).
        Where the store reports neither, there is nothing to compare and nothing is refused.

        This narrows the race, it does not close it: a rival landing after this check is a
        writer that lost its claim (stalled past its lease) completing at the same moment. On a
        versioned bucket even that cannot mislead reg's reads, which ask for the recorded
        version; on an unversioned one `reg verify` would find it."""
        version = completed.get("VersionId")
        head = self.head_response(key)
        if head is None:
            raise CompletedOver(key)  # gone already: whatever is there later is not ours
        if version and version != "null" and head.get("VersionId"):
            ours = head["VersionId"] == version
        elif completed.get("ETag") and head.get("ETag"):
            ours = _etag(head["ETag"]) == _etag(completed["ETag"])
        else:
            ours = True
        if not ours:
            raise CompletedOver(key)

    def _upload_part(
        self, full_key: str, upload_id: str, number: int, data: bytes, progress: Progress
    ) -> dict[str, Any]:
        for attempt in range(PART_RETRIES):
            try:
                # CRC32 per part, as boto3's own transfers do: the server checks each part.
                out = self.client.upload_part(
                    Bucket=self.bucket,
                    Key=full_key,
                    UploadId=upload_id,
                    PartNumber=number,
                    Body=data,
                    ChecksumAlgorithm="CRC32",
                )
                if progress:
                    progress(len(data))
                return dict(out)
            except (ClientError, BotoCoreError) as exc:
                if attempt == PART_RETRIES - 1 or not retryable(exc):
                    raise
                _backoff(attempt)
        raise AssertionError("unreachable")

    def abort_multipart(self, full_key: str, upload_id: str) -> None:
        self._abort(full_key, upload_id)

    def _abort(self, full_key: str, upload_id: str) -> None:
        # On failure the lifecycle rule of `reg storage init` cleans up what is left.
        with contextlib.suppress(ClientError, BotoCoreError):
            self.client.abort_multipart_upload(Bucket=self.bucket, Key=full_key, UploadId=upload_id)

    def retain(self, full_key: str, version_id: str | None, immutable: bool) -> None:
        """Set the retention explicitly after a multipart upload: some S3-compatible servers
        ignore the lock headers of CreateMultipartUpload (moto does), and on AWS this only
        repeats what the headers set."""
        args = self.lock_args(immutable)
        if not args:
            return
        extra = {"VersionId": version_id} if version_id else {}
        self._call(
            full_key,
            lambda: self.client.put_object_retention(
                Bucket=self.bucket,
                Key=full_key,
                Retention={
                    "Mode": args["ObjectLockMode"],
                    "RetainUntilDate": args["ObjectLockRetainUntilDate"],
                },
                **extra,
            ),
        )

    def _record_version(self, key: str, version_id: str | None) -> None:
        if version_id and version_id != "null":
            with self._client_lock:
                self._written[key] = version_id

    def _written_version(self, key: str) -> str | None:
        with self._client_lock:
            return self._written.pop(key, None)

    def lock_args(self, immutable: bool) -> dict[str, Any]:
        if not immutable or self._release_lock is None or not self.bucket_has_lock():
            return {}
        mode, days = self._release_lock()
        if mode == "off":
            return {}
        until = dt.datetime.now(dt.UTC) + dt.timedelta(days=days)
        return {"ObjectLockMode": mode, "ObjectLockRetainUntilDate": until}

    # -- reads ---------------------------------------------------------------------------------
    def _head(self, key: str, version: str | None) -> ObjectInfo | None:
        out = self.head_response(key, version=version)
        if out is None:
            return None
        return ObjectInfo(key, int(out["ContentLength"]), out.get("VersionId"))

    def head_response(
        self, key: str, *, version: str | None = None, checksum: bool = False
    ) -> dict[str, Any] | None:
        """S3's HeadObject answer for `key` (with its stored checksums if `checksum`), or None
        when there is no such object."""
        try:
            return dict(
                self.client.head_object(
                    Bucket=self.bucket,
                    Key=self._key(key),
                    **_version_arg(version),
                    **({"ChecksumMode": "ENABLED"} if checksum else {}),
                )
            )
        except ClientError as exc:
            if error_code(exc) in ("404", "NoSuchKey", "NotFound"):
                return None
            raise translate(exc, key) from exc
        except BotoCoreError as exc:
            raise translate(exc, key) from exc

    def _read_range(self, key: str, offset: int, length: int, version: str | None) -> bytes:
        # botocore retries a request, not the reading of its body: a body cut short (a
        # connection lost mid-transfer) is read again here, a bounded number of times.
        span = f"bytes={offset}-{offset + length - 1}"
        for attempt in range(PART_RETRIES):
            try:
                body = self.client.get_object(
                    Bucket=self.bucket, Key=self._key(key), Range=span, **_version_arg(version)
                )["Body"]
                try:
                    data = body.read()
                finally:
                    body.close()
                return bytearray(data)  # type: ignore[return-value]  # writable, like local
            except (ClientError, BotoCoreError) as exc:
                if attempt == PART_RETRIES - 1 or not retryable(exc):
                    raise translate(exc, key) from exc
                _backoff(attempt)
        raise AssertionError("unreachable")

    def _stream(self, key: str, version: str | None) -> Iterator[bytes]:
        first = self._get_response(key, version)

        def pieces() -> Iterator[bytes]:
            # A body cut short is resumed where it broke, from the same object (its ETag),
            # a bounded number of times in a row.
            response, offset, failures = first, 0, 0
            while True:
                body = response["Body"]
                try:
                    for piece in body.iter_chunks(CHUNK):
                        offset += len(piece)
                        failures = 0
                        yield piece
                    return
                except (ClientError, BotoCoreError) as exc:
                    failures += 1
                    if failures >= PART_RETRIES or not retryable(exc):
                        raise translate(exc, key) from exc
                finally:
                    body.close()
                _backoff(failures - 1)
                response = self._get_response(
                    key, version, Range=f"bytes={offset}-", IfMatch=first["ETag"]
                )

        return pieces()

    def _get_response(self, key: str, version: str | None, **kwargs: Any) -> Any:
        return self._call(
            key,
            lambda: self.client.get_object(
                Bucket=self.bucket, Key=self._key(key), **_version_arg(version), **kwargs
            ),
        )

    def _get_file(
        self, key: str, dest: Path, progress: Progress, version: str | None
    ) -> tuple[int, str]:
        """Parallel ranged GETs, written in order while hashing; fsynced."""
        head = self._head(key, version)
        if head is None:
            raise NotFound(f"object {key} is missing from the store")
        part = part_size_for(head.size)
        ranges = [(o, min(part, head.size - o)) for o in range(0, head.size, part)]
        digest = hashlib.sha256()
        fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            futures: list[Future[bytes]] = []
            for offset, length in ranges:
                futures.append(
                    self._pool.submit(self.read_range, key, offset, length, version=version)
                )
                while len(futures) > IN_FLIGHT:
                    self._write_part(fd, futures.pop(0).result(), digest, progress)
                    faults.point("pull-write", dest)
            for fut in futures:
                self._write_part(fd, fut.result(), digest, progress)
                faults.point("pull-write", dest)
            os.fsync(fd)
        finally:
            os.close(fd)
        return head.size, digest.hexdigest()

    @staticmethod
    def _write_part(fd: int, data: bytes, digest: Any, progress: Progress) -> None:
        digest.update(data)
        view = memoryview(data)
        written = 0
        while written < len(view):
            written += os.write(fd, view[written:])
        if progress:
            progress(len(data))

    def _list(self, prefix: str) -> Iterator[ObjectInfo]:
        base = f"{self.prefix}/" if self.prefix else ""
        full = base + prefix
        strip = len(self.prefix) + 1 if self.prefix else 0
        paginator = self.client.get_paginator("list_objects_v2")
        try:
            for page in paginator.paginate(Bucket=self.bucket, Prefix=full):
                for obj in page.get("Contents", []):
                    yield ObjectInfo(obj["Key"][strip:], int(obj["Size"]))
        except (ClientError, BotoCoreError) as exc:
            raise translate(exc, prefix) from exc

    # -- deletes (s3_bucket.py: every version, where versioned) ------------------------------
    def _delete_many(self, keys: builtins.list[str]) -> tuple[int, dict[str, str]]:
        return self.admin.delete_many(keys)

    def _delete(self, key: str) -> int:
        return self.admin.delete(key)

    def restore_version(self, key: str, version: str, *, immutable: bool = False) -> None:
        self.admin.copy_within(key, key, version=version, immutable=immutable)

    def copy_within(
        self,
        source_key: str,
        key: str,
        *,
        version: str | None = None,
        immutable: bool = False,
        metadata: dict[str, str] | None = None,
    ) -> None:
        self.admin.copy_within(
            source_key, key, version=version, immutable=immutable, metadata=metadata
        )

    def lock_compliance(self, key: str, version: str | None) -> str | None:
        return self.admin.lock_compliance(key, version)

    # -- bucket (s3_bucket.py) ----------------------------------------------------------------
    def versioned(self) -> bool:
        return self.admin.versioned()

    def bucket_has_lock(self) -> bool:
        return self.admin.has_lock()

    def init(self) -> dict[str, Any]:
        return self.admin.init()

    def sweep_incomplete(
        self, prefix: str, older_than: float, *, skip: Callable[[str], bool] | None = None
    ) -> builtins.list[Swept]:
        return self.admin.sweep_incomplete(prefix, older_than, skip=skip)

    # -- errors --------------------------------------------------------------------------------
    def call(self, key: str, fn: Callable[[], Any]) -> Any:
        """One boto3 request about `key`, its errors translated (412: ObjectExists)."""
        return self._call(key, fn)

    def _call(self, key: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except ClientError as exc:
            if error_code(exc) in ("PreconditionFailed", "412"):
                raise ObjectExists(key) from None
            raise translate(exc, key) from exc
        except BotoCoreError as exc:
            raise translate(exc, key) from exc


def _completed(number: int, part: dict[str, Any]) -> dict[str, Any]:
    out = {"PartNumber": number, "ETag": part["ETag"]}
    if part.get("ChecksumCRC32"):
        out["ChecksumCRC32"] = part["ChecksumCRC32"]
    return out


def _backoff(attempt: int) -> None:
    time.sleep(min(8.0, 0.2 * 2**attempt) * (0.5 + random.random()))


def _etag(value: str) -> str:
    """An ETag as compared: without its quotes or weak marker."""
    return value.removeprefix("W/").strip('"')


def _version_arg(version: str | None) -> dict[str, str]:
    return {"VersionId": version} if version else {}
