"""reg on a store where two conditional completes of one key can both succeed.

S3 promises that of two `CompleteMultipartUpload ... If-None-Match: *` of one key exactly one
wins; SeaweedFS 4.48 lets both win now and then when they race (the later replacing the
earlier). reg does not rely on the promise: after each complete the key must hold what was
completed (`S3Store.confirm_completed`), a writer that finds another's bytes there replaces them
only while it holds the step's claim, and on a versioned bucket the manifest records the
version each file was written as. These tests make the race deterministic: a client wrapper
lands a rival's complete right after reg's, sent without If-None-Match so the real server
(SeaweedFS, SigV4 enforced) takes it as the racing store would.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import update

from registry import Registry
from registry.core.refs import CheckpointRef
from registry.errors import Conflict, IntegrityError, ObjectExists
from registry.storage.s3 import S3Store
from registry.storage.s3_client import new_client
from tests.zygote import Running

SHARD = "__0_0.distcp"


class RivalLandsAfter:
    """A boto3 client whose first CompleteMultipartUpload of a key ending in `suffix` is
    followed at once by a rival's complete of `rival` bytes at the same key; both succeed.
    `before_rival` runs first (a test takes the claim away there)."""

    def __init__(
        self, suffix: str, rival: bytes, before_rival: Callable[[], None] | None = None
    ) -> None:
        self._client, self._suffix, self._rival = new_client(), suffix, rival
        self._before_rival = before_rival
        self.landed: dict[str, Any] | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def complete_multipart_upload(self, **kwargs: Any) -> Any:
        out = self._client.complete_multipart_upload(**kwargs)
        if self.landed is None and kwargs["Key"].endswith(self._suffix):
            if self._before_rival is not None:
                self._before_rival()
            self.landed = self._rival_complete(kwargs["Bucket"], kwargs["Key"])
        return out

    def _rival_complete(self, bucket: str, key: str) -> dict[str, Any]:
        c = self._client
        upload = c.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
        part = c.upload_part(
            Bucket=bucket, Key=key, UploadId=upload, PartNumber=1, Body=self._rival
        )
        return dict(
            c.complete_multipart_upload(  # no If-None-Match: the racing store let it through
                Bucket=bucket,
                Key=key,
                UploadId=upload,
                MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": part["ETag"]}]},
            )
        )


@pytest.fixture(params=["unversioned", "versioned"])
def bucket_kind(request: pytest.FixtureRequest, s3_env: str, s3_server: Any) -> str:
    if request.param == "versioned":
        s3_server.client().put_bucket_versioning(
            Bucket=s3_env.removeprefix("s3://").split("/")[0],
            VersioningConfiguration={"Status": "Enabled"},
        )
    return str(request.param)


def _store(url: str, client: Any) -> S3Store:
    bucket, prefix = url.removeprefix("s3://").split("/", 1)
    return S3Store(bucket, prefix, client)


def test_a_complete_a_rival_landed_over_is_not_taken_as_written(bucket_kind, s3_env, tmp_path):
    ours, rival = b"o" * (9 << 20), b"rival bytes"
    (tmp_path / "f").write_bytes(ours)
    key = "ckpt/p/r/step-1/" + SHARD
    store = _store(s3_env, RivalLandsAfter(SHARD, rival))
    with pytest.raises(ObjectExists):
        store.put_file(key, tmp_path / "f")
    assert store.get_bytes(key) == rival  # nothing claims the key holds ours


def test_a_push_raced_by_a_rival_complete_commits_its_own_bytes(
    bucket_kind, s3_env, big_ckpt, tmp_path
):
    """The pusher holds the claim: the rival's object is a stale writer's, replaced."""
    src = big_ckpt.step_dir(1)
    with Registry() as reg:
        rival = os.urandom((src / SHARD).stat().st_size)  # the same size: only bytes differ
        racer = RivalLandsAfter(SHARD, rival)
        reg.store._client = racer  # type: ignore[attr-defined]
        out = reg.push_checkpoint(src, run="r", step=1)
        assert racer.landed is not None  # the race happened
        assert out["state"] == "committed"
        assert reg.verify("r@step1")["ok"]
        reg.pull("r@step1", tmp_path / "back")
    shard = f"ckpt/default/r/step-1/{SHARD}"
    assert (tmp_path / "back" / SHARD).read_bytes() == (src / SHARD).read_bytes()
    current = _store(s3_env, new_client()).get_bytes(shard)
    assert hashlib.sha256(current).digest() == hashlib.sha256((src / SHARD).read_bytes()).digest()


def test_a_writer_that_lost_its_claim_leaves_the_rivals_object_alone(bucket_kind, s3_env, big_ckpt):
    """The other way round: the step was taken over while our complete was in flight, and
    the new holder's complete landed after ours. We find another's bytes at the key, may not
    replace them (the claim is gone), and fail without committing."""
    from registry.catalog.models import PENDING, Checkpoint

    with Registry() as reg:

        def take_the_claim() -> None:
            with reg.catalog.session(write=True) as s:
                s.exec(
                    update(Checkpoint)
                    .where(Checkpoint.state == PENDING)  # type: ignore[arg-type]
                    .values(claim_token=uuid.uuid4().hex, claim_host="elsewhere", claim_pid=1)
                )

        racer = RivalLandsAfter(SHARD, b"the new holder's bytes", take_the_claim)
        reg.store._client = racer  # type: ignore[attr-defined]
        with pytest.raises(Conflict, match="lost the claim"):
            reg.push_checkpoint(big_ckpt.step_dir(1), run="r", step=1)
        assert racer.landed is not None
        assert reg.store.get_bytes(f"ckpt/default/r/step-1/{SHARD}") == b"the new holder's bytes"
        assert reg.list_checkpoints() == []


def test_concurrent_pushes_of_multipart_files_commit_once(s3_env, big_ckpt, tmp_path: Path):
    """Three processes push the same ~200 MB step at once: one commits; the others are told
    who holds it (exit 5) or, arriving after the commit, find the same content (exit 0)."""
    src = big_ckpt.step_dir(1)
    procs = [
        Running(("push-ckpt", str(src), "--run", "r", "--step", "1", "--json")) for _ in range(3)
    ]
    outs = [(p.wait(timeout=600), p.out(), p.err()) for p in procs]
    assert all(rc in (0, 5) for rc, _, _ in outs), outs
    committed = [json.loads(o) for rc, o, _ in outs if rc == 0]
    assert [c["unchanged"] for c in committed].count(False) == 1, outs
    assert all("is being pushed by" in e for rc, _, e in outs if rc == 5), outs
    with Registry() as reg:
        assert reg.verify("r@step1")["ok"]
        reg.pull("r@step1", tmp_path / "back")
    for f in src.iterdir():
        assert (tmp_path / "back" / f.name).read_bytes() == f.read_bytes()


def _presigned_upload(ctx: Any, src: Path, step: int) -> dict[str, Any]:
    """Begin a presigned push of `src` as reg server would, and upload every item through its
    URLs (as `reg push` through the server does); the begin's answer."""
    import httpx

    from registry.lifecycle.checkpoints import presigned
    from registry.lifecycle.checkpoints.upload_plan import DeclaredFile, part_sizes

    files, data = [], {}
    for path in sorted(p for p in src.iterdir() if p.is_file()):
        body = data[path.name] = path.read_bytes()
        parts, at = None, 0
        if sizes := part_sizes(len(body)):
            parts = []
            for size in sizes:
                parts.append(hashlib.sha256(body[at : at + size]).hexdigest())
                at += size
        digest = hashlib.sha256(body).hexdigest()
        files.append(DeclaredFile(path.name, len(body), digest, parts))
    doc = presigned.begin(ctx, "default", "r", step, world_size=2, metrics={}, files=files)
    items, ref = doc["urls"], CheckpointRef("default", "r", step)
    while len(items) < doc["items"]:
        items += presigned.urls(ctx, ref, doc["upload"], len(items), 100)["urls"]
    for item in items:
        body = data[item["path"]][item["offset"] : item["offset"] + item["size"]]
        headers = {**item["headers"], "content-length": str(len(body))}
        assert httpx.put(item["url"], content=body, headers=headers, timeout=120).status_code == 200
    return doc


def test_a_presigned_push_a_rival_completed_over_fails_and_commits_nothing(
    bucket_kind, s3_env, big_ckpt
):
    """The server assembles a presigned push's multipart files itself: the same check, and
    the push fails (its retry clears the key under the claim) instead of taking the object."""
    from registry.lifecycle.checkpoints import presigned

    src = big_ckpt.step_dir(1)
    rival = os.urandom((src / SHARD).stat().st_size)  # the same size: only the bytes differ
    with Registry() as reg:
        doc = _presigned_upload(reg.context, src, 1)
        reg.store._client = RivalLandsAfter(SHARD, rival)  # type: ignore[attr-defined]
        ref = CheckpointRef("default", "r", 1)
        with pytest.raises(IntegrityError, match="another write landed on it"):
            presigned.assemble(reg.context, ref, doc["upload"], SHARD)
        assert reg.store.head(f"ckpt/default/r/step-1/{SHARD}") is None  # cleared, claim held
        with pytest.raises(IntegrityError, match=f"{SHARD} was not uploaded"):
            presigned.complete(reg.context, ref, doc["upload"])
        assert reg.list_checkpoints() == []


def test_a_version_landed_after_a_presigned_assembly_is_refused_at_complete(s3_env, big_ckpt):
    """The client asks the server to assemble each file as soon as its parts are up; a write
    that lands on the key after that (a second winner, late) is a second version, and
    `complete` refuses the push rather than record whichever is current."""
    from registry.lifecycle.checkpoints import presigned

    bucket, prefix = s3_env.removeprefix("s3://").split("/", 1)
    client = new_client()
    client.put_bucket_versioning(Bucket=bucket, VersioningConfiguration={"Status": "Enabled"})
    src = big_ckpt.step_dir(1)
    with Registry() as reg:
        doc = _presigned_upload(reg.context, src, 1)
        ref = CheckpointRef("default", "r", 1)
        for path in (SHARD, "__1_0.distcp"):
            presigned.assemble(reg.context, ref, doc["upload"], path)
        key = f"{prefix}/ckpt/default/r/step-1/{SHARD}"
        client.put_object(Bucket=bucket, Key=key, Body=os.urandom((src / SHARD).stat().st_size))
        with pytest.raises(IntegrityError, match="after it was assembled"):
            presigned.complete(reg.context, ref, doc["upload"])
        assert reg.list_checkpoints() == []
