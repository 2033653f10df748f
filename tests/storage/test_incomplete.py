"""What crashed writers leave behind, per backend: nothing on a local store with O_TMPFILE,
locked temp files under .tmp/ without it, multipart uploads on S3; and the sweep that removes
them only when their writer is gone and never touches a committed object."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from registry.storage import open_store
from registry.storage.local import TEMP_DIR, LocalStore


def _named_temp_store(tmp_path: Path) -> LocalStore:
    store = LocalStore(tmp_path / "store")
    store._tmpfile = False  # a filesystem without O_TMPFILE (NFS, some overlays)
    return store


@pytest.mark.process
def test_a_killed_writer_leaves_no_named_file_with_o_tmpfile(tmp_path):
    code = (
        "import os, signal, sys\n"
        "from registry.storage.local import LocalStore\n"
        "store = LocalStore(sys.argv[1])\n"
        "def produce(write):\n"
        "    write(b'x' * 1000)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "store.put_stream('ckpt/p/r/step-1/f', produce)\n"
    )
    root = tmp_path / "store"
    proc = subprocess.run([sys.executable, "-c", code, str(root)], cwd=Path(__file__).parents[2])
    assert proc.returncode == -9
    assert [p for p in root.rglob("*") if p.is_file()] == []


def test_named_temp_files_are_swept_only_when_abandoned(tmp_path):
    store = _named_temp_store(tmp_path)
    store.put_bytes("ckpt/p/r/step-1/.tmp-looking", b"committed")  # a committed name
    temp_dir = store.root / TEMP_DIR / "ckpt" / "p" / "r" / "step-2"
    temp_dir.mkdir(parents=True)
    abandoned = temp_dir / "__0_0.distcp~0123456789ab"
    abandoned.write_bytes(b"half")
    live = temp_dir / "__1_0.distcp~ba9876543210"
    live.write_bytes(b"being written")
    held = os.open(live, os.O_RDONLY)
    fcntl.flock(held, fcntl.LOCK_EX)
    old = time.time() - 3600
    for p in (abandoned, live):
        os.utime(p, (old, old))
    try:
        swept = store.sweep_incomplete("ckpt/", 60)
    finally:
        os.close(held)
    assert [(s.key, s.size) for s in swept] == [("ckpt/p/r/step-2/__0_0.distcp", 4)]
    assert not abandoned.exists() and live.exists()
    assert store.get_bytes("ckpt/p/r/step-1/.tmp-looking") == b"committed"
    assert [o.key for o in store.list("")] == ["ckpt/p/r/step-1/.tmp-looking"]


def test_a_young_or_skipped_temp_file_is_kept(tmp_path):
    store = _named_temp_store(tmp_path)
    temp = store.root / TEMP_DIR / "ckpt" / "p" / "r" / "step-3" / "f~0123456789ab"
    temp.parent.mkdir(parents=True)
    temp.write_bytes(b"young")
    assert store.sweep_incomplete("ckpt/", 3600) == []
    assert store.sweep_incomplete("ckpt/", 0, skip=lambda key: key.startswith("ckpt/p/r/")) == []
    assert temp.exists()
    assert [s.key for s in store.sweep_incomplete("ckpt/", 0)] == ["ckpt/p/r/step-3/f"]


def test_writes_through_named_temp_files_work(tmp_path):
    store = _named_temp_store(tmp_path)
    store.put_bytes("ckpt/a/b", b"bytes")
    assert store.get_bytes("ckpt/a/b") == b"bytes"
    assert not any((store.root / TEMP_DIR).rglob("*~*"))


def test_s3_abandoned_multipart_uploads_are_aborted(s3_env, s3_server):
    store = open_store(s3_env)
    store.put_bytes("ckpt/p/r/step-1/committed", b"kept")
    client = s3_server.client()
    bucket, prefix = store.bucket, store.prefix
    for name in ("abandoned", "held"):
        upload = client.create_multipart_upload(
            Bucket=bucket, Key=f"{prefix}/ckpt/p/r/step-2/{name}"
        )
        client.upload_part(
            Bucket=bucket,
            Key=f"{prefix}/ckpt/p/r/step-2/{name}",
            UploadId=upload["UploadId"],
            PartNumber=1,
            Body=b"part",
        )
    # A real server records when each upload began (moto says 2010 for all): a young upload
    # is left alone; at age 0, the skip predicate, the sizes, and committed objects stay.
    assert store.sweep_incomplete("ckpt/", 3600, skip=lambda key: False) == []
    swept = store.sweep_incomplete("ckpt/", 0, skip=lambda key: key.endswith("/held"))
    assert [(s.key, s.size) for s in swept] == [("ckpt/p/r/step-2/abandoned", 4)]
    left = client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])
    assert [u["Key"] for u in left] == [f"{prefix}/ckpt/p/r/step-2/held"]
    assert store.get_bytes("ckpt/p/r/step-1/committed") == b"kept"
