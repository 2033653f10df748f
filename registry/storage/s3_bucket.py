"""The bucket-level half of the S3 store: whether the bucket keeps versions and has Object Lock
(asked once), reg's lifecycle rule (`reg storage init`), the sweep of multipart uploads a
crashed writer left, copies inside the bucket (no byte through this process) and COMPLIANCE
retention. `S3Store` holds one (`store.admin`) and answers BaseStore through it."""

from __future__ import annotations

import builtins
import datetime as dt
import functools
import hashlib
from collections.abc import Callable
from typing import Any, Protocol

from botocore.exceptions import BotoCoreError, ClientError

from registry.errors import NotFound
from registry.storage.base import ObjectInfo, Swept
from registry.storage.parts import part_size_for
from registry.storage.s3_client import content_type, error_code, translate

MAX_COPY = 5 * 1024**3  # the largest object CopyObject copies in one request


class BucketStore(Protocol):
    """What the bucket's administration uses of its `S3Store` (which holds the Bucket)."""

    @property
    def bucket(self) -> str: ...
    @property
    def prefix(self) -> str: ...
    @property
    def client(self) -> Any: ...
    def full_key(self, key: str) -> str: ...
    def full_prefix(self, prefix: str) -> str: ...
    def call(self, key: str, fn: Callable[[], Any]) -> Any: ...
    def head(self, key: str, *, version: str | None = None) -> ObjectInfo | None: ...
    def abort_multipart(self, full_key: str, upload_id: str) -> None: ...
    def retain(self, full_key: str, version_id: str | None, immutable: bool) -> None: ...
    def lock_args(self, immutable: bool) -> dict[str, Any]: ...


class Bucket:
    def __init__(self, store: BucketStore) -> None:
        self.store = store
        self._versioned: bool | None = None
        self._lock: bool | None = None

    def sweep_incomplete(
        self, prefix: str, older_than: float, *, skip: Callable[[str], bool] | None = None
    ) -> builtins.list[Swept]:
        """Abort multipart uploads under `prefix` started more than `older_than` seconds ago
        (their parts cost storage until then; `reg storage init` also sets a lifecycle rule)."""
        cutoff = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=older_than)
        strip = len(self.store.prefix) + 1 if self.store.prefix else 0
        swept: builtins.list[Swept] = []
        pages = self.store.client.get_paginator("list_multipart_uploads").paginate(
            Bucket=self.store.bucket, Prefix=self.store.full_prefix(prefix)
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
            self.store.abort_multipart(upload["Key"], upload["UploadId"])
            swept.append(Swept(f"multipart upload {upload['UploadId']}", key, size))
        return swept

    def _parts_size(self, full_key: str, upload_id: str) -> int:
        try:
            out = self.store.client.list_parts(
                Bucket=self.store.bucket, Key=full_key, UploadId=upload_id
            )
        except (ClientError, BotoCoreError):
            return 0
        return sum(int(p.get("Size", 0)) for p in out.get("Parts", []))

    def versioned(self) -> bool:
        if self._versioned is None:
            out = self.store.call(
                "", lambda: self.store.client.get_bucket_versioning(Bucket=self.store.bucket)
            )
            self._versioned = out.get("Status") in ("Enabled", "Suspended")
        return self._versioned

    def has_lock(self) -> bool:
        if self._lock is None:
            try:
                out = self.store.client.get_object_lock_configuration(Bucket=self.store.bucket)
                self._lock = (
                    out.get("ObjectLockConfiguration", {}).get("ObjectLockEnabled") == "Enabled"
                )
            except ClientError:
                self._lock = False
        return self._lock

    def init(self) -> dict[str, Any]:
        """Check the bucket and merge reg's lifecycle rule into the bucket's (`reg storage
        init`): rules of other teams and tools stay as they are; reg's own (named by ID, one per
        registry prefix) are replaced, so running init again changes nothing.

        No rule expires noncurrent versions: reg deletes every version itself (GC), and a
        noncurrent version exists only when someone put other bytes over a recorded one; that
        recorded version is what reads by version and `reg verify --repair` need."""
        self.store.call("", lambda: self.store.client.head_bucket(Bucket=self.store.bucket))
        versioned, locked = self.versioned(), self.has_lock()
        base = f"{self.store.prefix}/" if self.store.prefix else ""
        ours = _rule_id("reg-abort-incomplete-multipart", self.store.prefix)
        rules: list[dict[str, Any]] = [
            {
                "ID": ours,
                "Status": "Enabled",
                "Filter": {"Prefix": base},
                "AbortIncompleteMultipartUpload": {"DaysAfterInitiation": 1},
            }
        ]
        kept = [r for r in self._lifecycle_rules() if not _is_ours(r, ours, base)]
        self.store.call(
            "",
            lambda: self.store.client.put_bucket_lifecycle_configuration(
                Bucket=self.store.bucket, LifecycleConfiguration={"Rules": kept + rules}
            ),
        )
        return {
            "bucket": self.store.bucket,
            "prefix": self.store.prefix,
            "versioning": versioned,
            "object_lock": locked,
            "lifecycle_rules": [r["ID"] for r in rules],
            "other_lifecycle_rules": [r.get("ID", "") for r in kept],
        }

    def _lifecycle_rules(self) -> list[dict[str, Any]]:
        try:
            out = self.store.client.get_bucket_lifecycle_configuration(Bucket=self.store.bucket)
        except ClientError as exc:
            if error_code(exc) == "NoSuchLifecycleConfiguration":
                return []
            raise translate(exc, "") from exc
        except BotoCoreError as exc:
            raise translate(exc, "") from exc
        return list(out.get("Rules", []))

    # -- deletes: every version by id where versioned, so freed bytes are real --------------
    def delete_many(self, keys: builtins.list[str]) -> tuple[int, dict[str, str]]:
        """DeleteObjects, 1,000 keys a call; on versioned buckets every version by id."""
        wanted = {self.store.full_prefix(k): k for k in keys}
        targets: builtins.list[dict[str, str]] = []
        sizes: dict[tuple[str, str], int] = {}
        if self.versioned():
            for prefix in sorted({full.rsplit("/", 1)[0] + "/" for full in wanted}):
                for v in self._versions_under(prefix):
                    if v["Key"] in wanted:
                        targets.append({"Key": v["Key"], "VersionId": v["VersionId"]})
                        sizes[(v["Key"], v["VersionId"])] = int(v.get("Size", 0))
        else:
            for full, key in wanted.items():
                head = self.store.head(key)
                if head is not None:
                    targets.append({"Key": full})
                    sizes[(full, "")] = head.size
        freed, errors = 0, {}
        for start in range(0, len(targets), 1000):
            batch = targets[start : start + 1000]

            def call(batch: builtins.list[dict[str, str]] = batch) -> Any:
                return self.store.client.delete_objects(
                    Bucket=self.store.bucket, Delete={"Objects": batch, "Quiet": False}
                )

            out = self.store.call("", call)
            for err in out.get("Errors", []):
                key = wanted.get(err["Key"], err["Key"])
                errors[key] = f"{err.get('Code')}: {err.get('Message')}"
            for done in out.get("Deleted", []):
                freed += sizes.get((done["Key"], done.get("VersionId", "")), 0)
        return freed, errors

    def _versions_under(self, full_prefix: str) -> builtins.list[dict[str, Any]]:
        """Every version and delete marker under `full_prefix` (a key in the bucket)."""
        pages = self.store.client.get_paginator("list_object_versions").paginate(
            Bucket=self.store.bucket, Prefix=full_prefix
        )
        try:
            return [
                entry
                for page in pages
                for entry in page.get("Versions", []) + page.get("DeleteMarkers", [])
            ]
        except (ClientError, BotoCoreError) as exc:
            raise translate(exc, full_prefix) from exc

    def delete(self, key: str) -> int:
        full = self.store.full_prefix(key)
        if not self.versioned():
            head = self.store.head(key)
            if head is None:
                return 0
            self.store.call(
                key, lambda: self.store.client.delete_object(Bucket=self.store.bucket, Key=full)
            )
            return head.size
        # Versioned (Object Lock needs it): a plain delete only adds a marker, so delete every
        # version and marker of this key by id; the freed bytes are then real.
        freed = 0
        for version in self._listed_versions(key):
            version_id = str(version["VersionId"])

            def remove(version_id: str = version_id) -> Any:
                return self.store.client.delete_object(
                    Bucket=self.store.bucket, Key=full, VersionId=version_id
                )

            self.store.call(key, remove)
            freed += int(version.get("Size", 0))
        return freed

    def versions(self, key: str) -> builtins.list[str]:
        """The ids of every version of `key` (delete markers included), newest first."""
        found = self._listed_versions(key)
        found.sort(key=lambda v: v["LastModified"], reverse=True)
        return [str(v["VersionId"]) for v in found]

    def _listed_versions(self, key: str) -> builtins.list[dict[str, Any]]:
        """ListObjectVersions' entries (versions and delete markers) of exactly `key`."""
        full = self.store.full_prefix(key)
        out = self.store.call(
            key,
            lambda: self.store.client.list_object_versions(Bucket=self.store.bucket, Prefix=full),
        )
        listed = out.get("Versions", []) + out.get("DeleteMarkers", [])
        return [v for v in listed if v["Key"] == full]

    # -- copies inside the bucket, and retention --------------------------------------------
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
        full_key = self.store.full_key(key)
        source = {"Bucket": self.store.bucket, "Key": self.store.full_key(source_key)}
        if version is not None:
            source["VersionId"] = version
        head = self.store.head(source_key, version=version)
        if head is None:
            raise NotFound(f"{source_key} (version {version or 'current'}) is gone")
        args: dict[str, Any] = {
            "ContentType": content_type(key),
            "MetadataDirective": "REPLACE",
            "ChecksumAlgorithm": "SHA256",
            "Metadata": metadata or {},
        }
        if head.size <= MAX_COPY:
            out = self.store.call(
                key,
                lambda: self.store.client.copy_object(
                    Bucket=self.store.bucket, Key=full_key, CopySource=source, **args
                ),
            )
            created = out.get("VersionId")
        else:  # S3 copies objects over 5 GB part by part
            created = self._copy_parts(key, source, head.size, metadata or {})
        # The lock is set on the new version afterwards, as after a multipart upload (only on
        # the version this copy created: with no id reported, nothing is locked).
        if created:
            self.store.retain(full_key, created, immutable)

    def _copy_parts(
        self, key: str, source: dict[str, str], size: int, metadata: dict[str, str]
    ) -> str | None:
        """UploadPartCopy of `source` onto `key`; the version the completion created (exactly
        that one gets the lock, never one a concurrent writer put meanwhile)."""
        full_key = self.store.full_prefix(key)
        upload_id = self.store.call(
            key,
            lambda: self.store.client.create_multipart_upload(
                Bucket=self.store.bucket,
                Key=full_key,
                ContentType=content_type(key),
                Metadata=metadata,
            ),
        )["UploadId"]
        part = part_size_for(size)
        try:
            done = []
            for number, start in enumerate(range(0, size, part), start=1):
                span = f"bytes={start}-{min(size, start + part) - 1}"
                copy_part = functools.partial(
                    self.store.client.upload_part_copy,
                    Bucket=self.store.bucket,
                    Key=full_key,
                    UploadId=upload_id,
                    PartNumber=number,
                    CopySource=source,
                    CopySourceRange=span,
                )
                out = self.store.call(key, copy_part)
                done.append({"PartNumber": number, "ETag": out["CopyPartResult"]["ETag"]})
            completed = self.store.call(
                key,
                lambda: self.store.client.complete_multipart_upload(
                    Bucket=self.store.bucket,
                    Key=full_key,
                    UploadId=upload_id,
                    MultipartUpload={"Parts": done},
                ),
            )
        except BaseException:
            self.store.abort_multipart(full_key, upload_id)
            raise
        version = completed.get("VersionId")
        return str(version) if version else None

    def lock_compliance(self, key: str, version: str | None) -> str | None:
        """A COMPLIANCE retention on `version` of `key` (the audit log's anchors: nobody, the
        bucket's owner included, deletes or replaces that version until it runs out), for the
        policy's `[release] lock_days`; None where the bucket has no Object Lock or the policy
        turned locks off."""
        args = self.store.lock_args(immutable=True)
        if not args:
            return None
        until = args["ObjectLockRetainUntilDate"]
        full = self.store.full_key(key)
        extra = {"VersionId": version} if version else {}
        self.store.call(
            key,
            lambda: self.store.client.put_object_retention(
                Bucket=self.store.bucket,
                Key=full,
                Retention={"Mode": "COMPLIANCE", "RetainUntilDate": until},
                **extra,
            ),
        )
        return f"COMPLIANCE until {until.date().isoformat()}"


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
