"""The ObjectStore contract, run against every backend (the S3 store runs the same suite)."""

from __future__ import annotations

import hashlib
import os
import threading
import uuid
from pathlib import Path

import pytest

from registry.errors import Conflict, NotFound, ObjectExists, UsageError
from registry.storage import ObjectStore, open_store


@pytest.fixture(params=["memory", "local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> ObjectStore:
    if request.param == "local":
        return open_store((tmp_path / "store").as_uri())
    if request.param == "memory":
        return open_store(f"memory://{uuid.uuid4().hex}")
    return open_store(request.getfixturevalue("s3_env"))


def _file(tmp_path: Path, name: str, data: bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


def test_put_file_records_size_and_sha256(store, tmp_path):
    data = os.urandom(3 * 1024 * 1024 + 17)
    put = store.put_file("ckpt/p/r/step-1/a.bin", _file(tmp_path, "a", data))
    assert put.size == len(data)
    assert put.sha256 == hashlib.sha256(data).hexdigest()
    assert store.head("ckpt/p/r/step-1/a.bin").size == len(data)
    assert store.sha256("ckpt/p/r/step-1/a.bin") == put.sha256
    assert store.get_bytes("ckpt/p/r/step-1/a.bin") == data


def test_put_is_never_an_overwrite(store, tmp_path):
    store.put_bytes("ckpt/x/one", b"first")
    with pytest.raises(ObjectExists):
        store.put_bytes("ckpt/x/one", b"second")
    with pytest.raises(ObjectExists):
        store.put_file("ckpt/x/one", _file(tmp_path, "f", b"third"))
    assert store.get_bytes("ckpt/x/one") == b"first"


def test_concurrent_puts_of_one_key_have_one_winner(store):
    results: list[str] = []

    def put(payload: bytes) -> None:
        try:
            store.put_bytes("ckpt/race/obj", payload)
            results.append("won")
        except ObjectExists:
            results.append("lost")

    threads = [threading.Thread(target=put, args=(bytes([i]) * 100_000,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results.count("won") == 1
    body = store.get_bytes("ckpt/race/obj")
    assert len(set(body)) == 1 and len(body) == 100_000


def test_ranged_reads(store):
    data = bytes(range(256)) * 10
    store.put_bytes("ckpt/r/bin", data)
    assert store.read_range("ckpt/r/bin", 0, 10) == data[:10]
    assert store.read_range("ckpt/r/bin", 1000, 500) == data[1000:1500]
    with pytest.raises(Exception, match="truncated|range|Range"):
        store.read_range("ckpt/r/bin", len(data) - 5, 10)


def test_get_file_streams_and_hashes(store, tmp_path):
    data = os.urandom(1_000_003)
    store.put_bytes("ckpt/g/f", data)
    got = store.get_file("ckpt/g/f", tmp_path / "out.bin")
    assert got.sha256 == hashlib.sha256(data).hexdigest()
    assert (tmp_path / "out.bin").read_bytes() == data


def test_missing_objects(store, tmp_path):
    assert store.head("ckpt/none") is None
    with pytest.raises(NotFound):
        store.get_bytes("ckpt/none")
    with pytest.raises(NotFound):
        store.get_file("ckpt/none", tmp_path / "x")
    assert store.delete("ckpt/none") == 0


def test_list_is_prefix_ordered_and_complete(store):
    keys = [f"ckpt/p/run{i % 3}/step-{i}/f" for i in range(30)]
    for k in keys:
        store.put_bytes(k, b"x")
    assert [o.key for o in store.list("ckpt/p/run1/")] == sorted(k for k in keys if "/run1/" in k)
    assert [o.key for o in store.list("ckpt/p/")] == sorted(keys)
    assert list(store.list("ckpt/other/")) == []


def test_delete_frees_bytes_and_refuses_release_objects(store):
    store.put_bytes("ckpt/d/a", b"12345")
    assert store.delete("ckpt/d/a") == 5
    assert store.head("ckpt/d/a") is None
    store.put_bytes("release/m/v1/model.safetensors", b"w", immutable=True)
    with pytest.raises(Conflict, match="immutable"):
        store.delete("release/m/v1/model.safetensors")
    assert store.get_bytes("release/m/v1/model.safetensors") == b"w"


@pytest.mark.parametrize(
    "key", ["../x", "a/../../b", "/abs", "a//b", "a/./b", "", "a/b/", "a\\b", "ckpt/..hidden"]
)
def test_keys_cannot_escape(store, key):
    with pytest.raises(UsageError):
        store.put_bytes(key, b"x")


def test_delete_many_frees_bytes_and_reports_failures(store):
    keys = [f"ckpt/dm/run/step-1/f{i}" for i in range(5)]
    for i, key in enumerate(keys):
        store.put_bytes(key, b"x" * (i + 1))
    freed, errors = store.delete_many([*keys, "ckpt/dm/run/step-1/absent"])
    assert freed == 15 and errors == {}
    assert list(store.list("ckpt/dm/")) == []
    with pytest.raises(Conflict, match="immutable"):
        store.delete_many(["release/m/v1/model.safetensors"])
