"""Presigned S3 requests: how `reg server` lets a client move bytes without lending it credentials.

Every URL is SigV4 (a SigV2 URL signs no headers, so `If-None-Match` would not bind), lives
`ttl_s` seconds and names exactly one key:

    put_url        PutObject of one whole file: `If-None-Match: *`, its size and its sha256 are
                   signed headers, so the URL writes those bytes there once, or nothing
    part_url       UploadPart of a multipart upload the server created: the part's size and
                   sha256 are signed (UploadPart takes no If-None-Match; the server completes the
                   upload itself, with If-None-Match: *)
    get_url        GetObject of the version the catalog recorded (ranged reads send `Range`)

S3 checks a signed checksum against the bytes it receives and refuses a mismatch, so a stored
object whose upload went through one of these URLs holds the bytes the client declared. What the
client declared is still the client's word until the server re-hashes it (`reg verify`, a
promotion): a client that lies about a file lies about its own checkpoint, and the catalog says
whose word its digest is.
"""

from __future__ import annotations

import base64
import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from registry.errors import IntegrityError

if TYPE_CHECKING:
    from registry.storage.s3 import S3Store

TTL_S = 900  # read URLs; upload URLs live shorter (presigned.URL_TTL_S) and are asked for as used


@dataclass(frozen=True, slots=True)
class Presigned:
    url: str
    headers: dict[str, str]  # what the request must carry: the signature covers them

    def to_json(self) -> dict[str, Any]:
        return {"url": self.url, "headers": self.headers}


def b64_sha256(hex_digest: str) -> str:
    return base64.b64encode(bytes.fromhex(hex_digest)).decode()


def composite_sha256(part_digests: list[str]) -> str:
    """S3's checksum of a multipart object: the sha256 of its parts' sha256s (base64)."""
    joined = b"".join(bytes.fromhex(d) for d in part_digests)
    return base64.b64encode(hashlib.sha256(joined).digest()).decode()


class Presigner:
    def __init__(self, store: S3Store, ttl_s: int = TTL_S) -> None:
        self.store, self.ttl_s = store, ttl_s

    def _sign(self, operation: str, key: str, **params: Any) -> str:
        return str(
            self.store.client.generate_presigned_url(
                operation,
                Params={"Bucket": self.store.bucket, "Key": self.store.full_key(key), **params},
                ExpiresIn=self.ttl_s,
            )
        )

    def put_url(self, key: str, size: int, sha256: str) -> Presigned:
        checksum = b64_sha256(sha256)
        url = self._sign(
            "put_object", key, IfNoneMatch="*", ChecksumSHA256=checksum, ContentLength=size
        )
        return Presigned(url, {"if-none-match": "*", "x-amz-checksum-sha256": checksum})

    def part_url(self, key: str, upload_id: str, number: int, size: int, sha256: str) -> Presigned:
        checksum = b64_sha256(sha256)
        url = self._sign(
            "upload_part",
            key,
            UploadId=upload_id,
            PartNumber=number,
            ChecksumSHA256=checksum,
            ContentLength=size,
        )
        return Presigned(url, {"x-amz-checksum-sha256": checksum})

    def get_url(self, key: str, version: str | None) -> str:
        return self._sign("get_object", key, **({"VersionId": version} if version else {}))

    # -- multipart, done by the server -------------------------------------------------------
    def create_multipart(self, key: str) -> str:
        out = self.store.call(
            key,
            lambda: self.store.client.create_multipart_upload(
                Bucket=self.store.bucket,
                Key=self.store.full_key(key),
                ChecksumAlgorithm="SHA256",
                ContentType="application/octet-stream",
            ),
        )
        return str(out["UploadId"])

    def complete(self, key: str, upload_id: str, parts: list[tuple[int, str]]) -> str | None:
        """Complete the upload of `key` from exactly the expected parts (size, sha256 each), as
        S3 lists them, with If-None-Match: *; the version it created on a versioned bucket. A
        part that is missing, of another size, or with another checksum is refused
        (IntegrityError) and nothing is assembled; an upload that is gone (completed already)
        is NotFound, an object already there (or another complete's, landed over ours on a
        store where both succeed) ObjectExists."""
        listed = self._parts(key, upload_id)
        if len(listed) != len(parts):
            raise IntegrityError(
                f"{key}: {len(listed)} of {len(parts)} parts arrived",
                "the upload did not finish; push again",
            )
        done = []
        for number, (size, sha256) in enumerate(parts, start=1):
            got = listed.get(number)
            if got is None or int(got.get("Size", -1)) != size:
                raise IntegrityError(
                    f"{key}: part {number} is missing or not {size} bytes",
                    "the upload did not finish; push again",
                )
            checksum = b64_sha256(sha256)
            if got.get("ChecksumSHA256") not in (None, checksum):
                raise IntegrityError(
                    f"{key}: part {number} holds other bytes than declared", "push again"
                )
            done.append({"PartNumber": number, "ETag": got["ETag"], "ChecksumSHA256": checksum})
        completed = self.store.call(
            key,
            lambda: self.store.client.complete_multipart_upload(
                Bucket=self.store.bucket,
                Key=self.store.full_key(key),
                UploadId=upload_id,
                MultipartUpload={"Parts": done},
                IfNoneMatch="*",
            ),
        )
        self.store.confirm_completed(key, completed)
        version = completed.get("VersionId")
        return str(version) if version and version != "null" else None

    def _parts(self, key: str, upload_id: str) -> dict[int, dict[str, Any]]:
        pages = self.store.client.get_paginator("list_parts").paginate(
            Bucket=self.store.bucket, Key=self.store.full_key(key), UploadId=upload_id
        )
        return dict(
            self.store.call(
                key,
                lambda: {int(p["PartNumber"]): p for page in pages for p in page.get("Parts", [])},
            )
        )

    def abort(self, key: str, upload_id: str) -> None:
        self.store.abort_multipart(self.store.full_key(key), upload_id)

    def head(
        self, key: str, version: str | None = None
    ) -> tuple[int, str | None, str | None] | None:
        """(size, version id, S3's sha256 checksum if it keeps one) of `key` (that version of
        it), or None."""
        out = self.store.head_response(key, version=version, checksum=True)
        if out is None:
            return None
        version = out.get("VersionId")
        return (
            int(out["ContentLength"]),
            version if version != "null" else None,
            out.get("ChecksumSHA256"),
        )
