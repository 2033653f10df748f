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
import functools
import hashlib
import os
import random
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from botocore.exceptions import BotoCoreError, ClientError

from registry import faults
from registry.errors import Conflict, NotFound, ObjectExists, UsageError
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
from registry.storage.s3_client import error_code, new_client, retryable, translate

IN_FLIGHT = 4  # parts in memory per upload
MAX_COPY = 5 * 1024**3  # the largest object CopyObject copies in one request
PART_RETRIES = 4


class S3Store(BaseStore):
    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        client: Any = None,
        *,
        release_lock: Callable[[], tuple[str, int]] | None = None,
    ) -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.url = f"s3://{bucket}/{self.prefix}".rstrip("/")
        self._client = client
        self._client_lock = threading.Lock()
        self._release_lock = release_lock
        self._bucket_lock: bool | None = None
        self._versioned: bool | None = None
        self._written: dict[str, str] = {}  # key -> the version our put of it created
        self._pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="reg-s3")

    @classmethod
    def from_url(
        cls, url: str, *, release_lock: Callable[[], tuple[str, int]] | None = None
    ) -> S3Store:
        parsed = urlparse(url)
        if not parsed.netloc:
            raise UsageError(f"bad S3 URL {url!r}", "write s3://bucket/prefix")
        return cls(parsed.netloc, parsed.path, release_lock=release_lock)

    @property
    def client(self) -> Any:
        if self._client is None:
            with self._client_lock:
                if self._client is None:
                    self._client = new_client()
        return self._client

    # -- keys ----------------------------------------------------------------------------------
    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def full_key(self, key: str) -> str:
        """The bucket key of a store key (checked)."""
        return self._key(check_key(key))

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
                ContentType=_content_type(key),
                **self._lock_args(immutable),
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
                    ContentType=_content_type(key),
                    **self._lock_args(immutable),
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
            except BaseException:
                self._abort(full_key, upload_id)
                raise
            self.confirm_completed(key, completed)
            self._retain(full_key, completed.get("VersionId"), immutable)
            self._record_version(key, completed.get("VersionId"))
            return size, digest.hexdigest()
        raise Conflict(f"{key}: concurrent writes kept conflicting", "retry")

    def confirm_completed(self, key: str, completed: dict[str, Any]) -> None:
        """Do not take a successful conditional complete as proof that the key holds our bytes:
        some stores let two concurrent `CompleteMultipartUpload ... If-None-Match: *` of one key
        both succeed (SeaweedFS 4.48 does), the later replacing the earlier. The key must hold
        what we completed (our version on a versioned bucket, our ETag elsewhere); if it holds
        another, we lost the race: ObjectExists, as the 412 of a strict store (the caller
        compares digests, and replaces the object only while it holds the step's claim).

        A rival complete landing after this check is the claim protocol's to prevent: one live
        holder writes a step (DESIGN §3). On a versioned bucket even that cannot mislead a
        reader: the manifest records our version, and every read asks for it."""
        version = completed.get("VersionId")
        head = self.head_response(key)
        if version and version != "null":
            ours = head is not None and head.get("VersionId") == version
        else:
            ours = head is not None and head.get("ETag") == completed.get("ETag")
        if not ours:
            raise ObjectExists(key)

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

    def _retain(self, full_key: str, version_id: str | None, immutable: bool) -> None:
        """Set the retention explicitly after a multipart upload: some S3-compatible servers
        ignore the lock headers of CreateMultipartUpload (moto does), and on AWS this only
        repeats what the headers set."""
        args = self._lock_args(immutable)
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

    def restore_version(self, key: str, version: str, *, immutable: bool = False) -> None:
        self.copy_within(key, key, version=version, immutable=immutable)

    def copy_within(
        self,
        source_key: str,
        key: str,
        *,
        version: str | None = None,
        immutable: bool = False,
        metadata: dict[str, str] | None = None,
    ) -> None:
        """Copy `source_key` (at `version`, else its current one) onto `key`, in the bucket:
        no byte passes through this process. `metadata`: the copy's user metadata."""
        full_key = self._key(check_key(key))
        source = {"Bucket": self.bucket, "Key": self._key(check_key(source_key))}
        if version is not None:
            source["VersionId"] = version
        head = self._head(source_key, version)
        if head is None:
            raise NotFound(f"{source_key} (version {version or 'current'}) is gone")
        args: dict[str, Any] = {
            "ContentType": _content_type(key),
            "MetadataDirective": "REPLACE",
            "ChecksumAlgorithm": "SHA256",
            "Metadata": metadata or {},
        }
        if head.size <= MAX_COPY:
            out = self._call(
                key,
                lambda: self.client.copy_object(
                    Bucket=self.bucket, Key=full_key, CopySource=source, **args
                ),
            )
            created = out.get("VersionId")
        else:  # S3 copies objects over 5 GB part by part
            created = self._copy_parts(key, source, head.size, metadata or {})
        # The lock is set on the new version afterwards, as after a multipart upload (only on
        # the version this copy created: with no id reported, nothing is locked).
        if created:
            self._retain(full_key, created, immutable)

    def _copy_parts(
        self, key: str, source: dict[str, str], size: int, metadata: dict[str, str]
    ) -> str | None:
        """UploadPartCopy of `source` onto `key`; the version the completion created (exactly
        that one gets the lock, never one a concurrent writer put meanwhile)."""
        full_key = self._key(key)
        upload_id = self._call(
            key,
            lambda: self.client.create_multipart_upload(
                Bucket=self.bucket, Key=full_key, ContentType=_content_type(key), Metadata=metadata
            ),
        )["UploadId"]
        part = part_size_for(size)
        try:
            done = []
            for number, start in enumerate(range(0, size, part), start=1):
                span = f"bytes={start}-{min(size, start + part) - 1}"
                copy_part = functools.partial(
                    self.client.upload_part_copy,
                    Bucket=self.bucket,
                    Key=full_key,
                    UploadId=upload_id,
                    PartNumber=number,
                    CopySource=source,
                    CopySourceRange=span,
                )
                out = self._call(key, copy_part)
                done.append({"PartNumber": number, "ETag": out["CopyPartResult"]["ETag"]})
            completed = self._call(
                key,
                lambda: self.client.complete_multipart_upload(
                    Bucket=self.bucket,
                    Key=full_key,
                    UploadId=upload_id,
                    MultipartUpload={"Parts": done},
                ),
            )
        except BaseException:
            self._abort(full_key, upload_id)
            raise
        version = completed.get("VersionId")
        return str(version) if version else None

    def _record_version(self, key: str, version_id: str | None) -> None:
        if version_id and version_id != "null":
            with self._client_lock:
                self._written[key] = version_id

    def _written_version(self, key: str) -> str | None:
        with self._client_lock:
            return self._written.pop(key, None)

    def _lock_args(self, immutable: bool) -> dict[str, Any]:
        if not immutable or self._release_lock is None or not self.bucket_has_lock():
            return {}
        mode, days = self._release_lock()
        if mode == "off":
            return {}
        until = dt.datetime.now(dt.UTC) + dt.timedelta(days=days)
        return {"ObjectLockMode": mode, "ObjectLockRetainUntilDate": until}

    def lock_compliance(self, key: str, version: str | None) -> str | None:
        """A COMPLIANCE retention on `version` of `key` (the audit log's anchors: nobody, the
        bucket's owner included, deletes or replaces that version until it runs out), for the
        policy's `[release] lock_days`; None where the bucket has no Object Lock or the policy
        turned locks off."""
        args = self._lock_args(immutable=True)
        if not args:
            return None
        until = args["ObjectLockRetainUntilDate"]
        full = self._key(check_key(key))
        extra = {"VersionId": version} if version else {}
        self._call(
            key,
            lambda: self.client.put_object_retention(
                Bucket=self.bucket,
                Key=full,
                Retention={"Mode": "COMPLIANCE", "RetainUntilDate": until},
                **extra,
            ),
        )
        return f"COMPLIANCE until {until.date().isoformat()}"

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

    # -- deletes -------------------------------------------------------------------------------
    def _delete_many(self, keys: builtins.list[str]) -> tuple[int, dict[str, str]]:
        """DeleteObjects, 1,000 keys a call; on versioned buckets every version by id."""
        wanted = {self._key(k): k for k in keys}
        targets: builtins.list[dict[str, str]] = []
        sizes: dict[tuple[str, str], int] = {}
        if self.versioned():
            for prefix in sorted({full.rsplit("/", 1)[0] + "/" for full in wanted}):
                pages = self.client.get_paginator("list_object_versions").paginate(
                    Bucket=self.bucket, Prefix=prefix
                )
                for page in pages:
                    for v in page.get("Versions", []) + page.get("DeleteMarkers", []):
                        if v["Key"] in wanted:
                            targets.append({"Key": v["Key"], "VersionId": v["VersionId"]})
                            sizes[(v["Key"], v["VersionId"])] = int(v.get("Size", 0))
        else:
            for full, key in wanted.items():
                head = self._head(key, None)
                if head is not None:
                    targets.append({"Key": full})
                    sizes[(full, "")] = head.size
        freed, errors = 0, {}
        for start in range(0, len(targets), 1000):
            batch = targets[start : start + 1000]

            def call(batch: builtins.list[dict[str, str]] = batch) -> Any:
                return self.client.delete_objects(
                    Bucket=self.bucket, Delete={"Objects": batch, "Quiet": False}
                )

            out = self._call("", call)
            for err in out.get("Errors", []):
                key = wanted.get(err["Key"], err["Key"])
                errors[key] = f"{err.get('Code')}: {err.get('Message')}"
            for done in out.get("Deleted", []):
                freed += sizes.get((done["Key"], done.get("VersionId", "")), 0)
        return freed, errors

    def _delete(self, key: str) -> int:
        full = self._key(key)
        if not self.versioned():
            head = self._head(key, None)
            if head is None:
                return 0
            self._call(key, lambda: self.client.delete_object(Bucket=self.bucket, Key=full))
            return head.size
        # Versioned (Object Lock needs it): a plain delete only adds a marker, so delete every
        # version and marker of this key by id; the freed bytes are then real.
        freed = 0
        out = self._call(
            key, lambda: self.client.list_object_versions(Bucket=self.bucket, Prefix=full)
        )
        for version in out.get("Versions", []) + out.get("DeleteMarkers", []):
            if version["Key"] != full:
                continue
            version_id = str(version["VersionId"])

            def remove(version_id: str = version_id) -> Any:
                return self.client.delete_object(Bucket=self.bucket, Key=full, VersionId=version_id)

            self._call(
                key,
                remove,
            )
            freed += int(version.get("Size", 0))
        return freed

    def sweep_incomplete(
        self, prefix: str, older_than: float, *, skip: Callable[[str], bool] | None = None
    ) -> builtins.list[Swept]:
        """Abort multipart uploads under `prefix` started more than `older_than` seconds ago
        (their parts cost storage until then; `reg storage init` also sets a lifecycle rule)."""
        cutoff = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=older_than)
        strip = len(self.prefix) + 1 if self.prefix else 0
        swept: builtins.list[Swept] = []
        pages = self.client.get_paginator("list_multipart_uploads").paginate(
            Bucket=self.bucket, Prefix=self._key(prefix)
        )
        try:
            uploads = [u for page in pages for u in page.get("Uploads", [])]
        except (ClientError, BotoCoreError) as exc:
            raise translate(exc, prefix) from exc
        for upload in uploads:
            key = upload["Key"][strip:]
            if upload["Initiated"] >= cutoff or (skip is not None and skip(key)):
                continue
            size = self._parts_size(upload["Key"], upload["UploadId"])
            self._abort(upload["Key"], upload["UploadId"])
            swept.append(Swept(f"multipart upload {upload['UploadId']}", key, size))
        return swept

    def _parts_size(self, full_key: str, upload_id: str) -> int:
        try:
            out = self.client.list_parts(Bucket=self.bucket, Key=full_key, UploadId=upload_id)
        except (ClientError, BotoCoreError):
            return 0
        return sum(int(p.get("Size", 0)) for p in out.get("Parts", []))

    # -- bucket --------------------------------------------------------------------------------
    def versioned(self) -> bool:
        if self._versioned is None:
            out = self._call("", lambda: self.client.get_bucket_versioning(Bucket=self.bucket))
            self._versioned = out.get("Status") in ("Enabled", "Suspended")
        return self._versioned

    def bucket_has_lock(self) -> bool:
        if self._bucket_lock is None:
            try:
                out = self.client.get_object_lock_configuration(Bucket=self.bucket)
                self._bucket_lock = (
                    out.get("ObjectLockConfiguration", {}).get("ObjectLockEnabled") == "Enabled"
                )
            except ClientError:
                self._bucket_lock = False
        return self._bucket_lock

    def init(self) -> dict[str, Any]:
        """Check the bucket and merge reg's lifecycle rule into the bucket's (`reg storage
        init`): rules of other teams and tools stay as they are; reg's own (named by ID, one per
        registry prefix) are replaced, so running init again changes nothing.

        No rule expires noncurrent versions: reg deletes every version itself (GC), and a
        noncurrent version exists only when someone put other bytes over a recorded one; that
        recorded version is what reads by version and `reg verify --repair` need."""
        self._call("", lambda: self.client.head_bucket(Bucket=self.bucket))
        versioned, locked = self.versioned(), self.bucket_has_lock()
        base = f"{self.prefix}/" if self.prefix else ""
        ours = _rule_id("reg-abort-incomplete-multipart", self.prefix)
        rules: list[dict[str, Any]] = [
            {
                "ID": ours,
                "Status": "Enabled",
                "Filter": {"Prefix": base},
                "AbortIncompleteMultipartUpload": {"DaysAfterInitiation": 1},
            }
        ]
        kept = [r for r in self._lifecycle_rules() if not _is_ours(r, ours, base)]
        self._call(
            "",
            lambda: self.client.put_bucket_lifecycle_configuration(
                Bucket=self.bucket, LifecycleConfiguration={"Rules": kept + rules}
            ),
        )
        return {
            "bucket": self.bucket,
            "prefix": self.prefix,
            "versioning": versioned,
            "object_lock": locked,
            "lifecycle_rules": [r["ID"] for r in rules],
            "other_lifecycle_rules": [r.get("ID", "") for r in kept],
        }

    def _lifecycle_rules(self) -> list[dict[str, Any]]:
        try:
            out = self.client.get_bucket_lifecycle_configuration(Bucket=self.bucket)
        except ClientError as exc:
            if error_code(exc) == "NoSuchLifecycleConfiguration":
                return []
            raise translate(exc, "") from exc
        except BotoCoreError as exc:
            raise translate(exc, "") from exc
        return list(out.get("Rules", []))

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


_LEGACY_RULES = ("reg-abort-incomplete-multipart", "reg-expire-noncurrent-checkpoints")


def _rule_id(name: str, prefix: str) -> str:
    """Rule IDs are at most 255 characters: a long prefix is named by its digest."""
    if not prefix:
        return name
    tag = prefix if len(prefix) <= 200 else hashlib.sha256(prefix.encode()).hexdigest()[:32]
    return f"{name}:{tag}"


def _is_ours(rule: dict[str, Any], ours: str, base: str) -> bool:
    """This registry's rule, or one an earlier reg wrote for the same prefix (unprefixed IDs,
    and the noncurrent-version expiry it no longer sets)."""
    if rule.get("ID") == ours:
        return True
    prefix = rule.get("Filter", {}).get("Prefix", rule.get("Prefix"))
    return rule.get("ID") in _LEGACY_RULES and prefix in (base, f"{base}ckpt/")


def _content_type(key: str) -> str:
    return "application/json" if key.endswith(".json") else "application/octet-stream"


def _completed(number: int, part: dict[str, Any]) -> dict[str, Any]:
    out = {"PartNumber": number, "ETag": part["ETag"]}
    if part.get("ChecksumCRC32"):
        out["ChecksumCRC32"] = part["ChecksumCRC32"]
    return out


def _backoff(attempt: int) -> None:
    time.sleep(min(8.0, 0.2 * 2**attempt) * (0.5 + random.random()))


def _version_arg(version: str | None) -> dict[str, str]:
    return {"VersionId": version} if version else {}
