"""The BaseStore contract, run against every backend (the S3 store runs the same suite)."""

from __future__ import annotations

import hashlib
import os
import threading
import uuid
from pathlib import Path

import pytest

from registry.errors import Conflict, IntegrityError, NotFound, ObjectExists, UsageError
from registry.storage import BaseStore, open_store


@pytest.fixture(params=["memory", "local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> BaseStore:
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
        except BaseException as exc:  # recorded, so a crashed thread fails the test
            results.append(f"failed: {exc!r}")

    threads = [threading.Thread(target=put, args=(bytes([i]) * 100_000,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == ["lost"] * 7 + ["won"]
    body = store.get_bytes("ckpt/race/obj")
    assert len(set(body)) == 1 and len(body) == 100_000


def test_ranged_reads(store):
    data = bytes(range(256)) * 10
    store.put_bytes("ckpt/r/bin", data)
    assert store.read_range("ckpt/r/bin", 0, 10) == data[:10]
    assert store.read_range("ckpt/r/bin", 1000, 500) == data[1000:1500]
    with pytest.raises(IntegrityError, match="truncated"):
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


def test_streams_in_order_and_empty_objects(store):
    data = os.urandom(17 * 1024 * 1024 + 5)  # more than two CHUNK pieces
    store.put_stream(
        "ckpt/s/big",
        lambda write: [write(data[i : i + 999_999]) for i in range(0, len(data), 999_999)],
    )
    assert b"".join(store.stream("ckpt/s/big")) == data
    assert store.sha256("ckpt/s/big") == hashlib.sha256(data).hexdigest()
    empty = store.put_stream("ckpt/s/empty", lambda write: None)
    assert (empty.size, empty.sha256) == (0, hashlib.sha256(b"").hexdigest())
    assert store.get_bytes("ckpt/s/empty") == b"" and store.head("ckpt/s/empty").size == 0
    with pytest.raises(NotFound):
        list(store.stream("ckpt/s/none"))


def test_ranges_are_checked(store):
    store.put_bytes("ckpt/r/x", b"0123456789")
    assert store.read_range("ckpt/r/x", 3, 0) == b""
    with pytest.raises(UsageError, match="bad range"):
        store.read_range("ckpt/r/x", -1, 2)
    with pytest.raises(UsageError, match="bad range"):
        store.read_range("ckpt/r/x", 0, -2)
    with pytest.raises(IntegrityError, match="truncated"):
        store.read_range("ckpt/r/x", 8, 5)


def test_staged_files_are_invisible_until_published(store, tmp_path):
    src = _file(tmp_path, "s", os.urandom(2_000_000))
    staged = store.stage_file("ckpt/st/a", src)
    assert store.head("ckpt/st/a") is None and list(store.list("ckpt/st/")) == []
    size, digest = staged.digest()
    assert (size, digest) == (2_000_000, hashlib.sha256(src.read_bytes()).hexdigest())
    done = staged.publish()
    assert (done.size, done.sha256) == (size, digest)
    assert store.get_bytes("ckpt/st/a") == src.read_bytes()
    staged.discard()
    assert store.get_bytes("ckpt/st/a") == src.read_bytes()  # discard keeps what was published
    with (
        store.stage_file("ckpt/st/a", _file(tmp_path, "t", b"other")) as again,
        pytest.raises(ObjectExists),
    ):
        again.publish()
    assert store.get_bytes("ckpt/st/a") == src.read_bytes()
    with store.stage_file("ckpt/st/b", src):
        pass  # discarded unpublished
    assert store.head("ckpt/st/b") is None


def test_describe_and_init(store):
    uri = store.describe("ckpt/p/r/step-1/")
    assert uri == f"{store.url}/ckpt/p/r/step-1/"
    assert store.describe("release/m/v1/model.safetensors") == (
        f"{store.url}/release/m/v1/model.safetensors"
    )
    out = store.init()
    expected = {
        "MemoryStore": {"store", "kind", "note"},
        "LocalStore": {"store", "kind", "note", "modes_tightened"},
        "S3Store": {
            "bucket",
            "prefix",
            "versioning",
            "object_lock",
            "lifecycle_rules",
            "other_lifecycle_rules",
        },
    }[type(store).__name__]
    assert set(out) == expected


@pytest.mark.parametrize("key", [".tmp/x", ".reg/a/b", ".metadata"])
def test_the_stores_own_namespace_is_not_a_key(store, key):
    with pytest.raises(UsageError, match="store's own"):
        store.put_bytes(key, b"x")
    store.put_bytes(f"ckpt/p/r/step-1/{key.rsplit('/', 1)[-1]}", b"x")  # fine one level down


def test_delete_many_refuses_before_deleting_anything(store):
    store.put_bytes("ckpt/dm2/a", b"1")
    store.put_bytes("release/m/v9/r", b"2", immutable=True)
    with pytest.raises(Conflict, match="immutable"):
        store.delete_many(["ckpt/dm2/a", "release/m/v9/r"])
    assert store.get_bytes("ckpt/dm2/a") == b"1"


def test_nothing_incomplete_after_clean_writes(store, tmp_path):
    store.put_file("ckpt/sw/a", _file(tmp_path, "a", b"x" * 100))
    assert store.sweep_incomplete("ckpt/", 0) == []
    assert store.get_bytes("ckpt/sw/a") == b"x" * 100


def test_a_producer_that_fails_midway_leaves_no_object(store):
    def produce(write):  # type: ignore[no-untyped-def]
        for _ in range(5):  # 40 MiB: on S3, parts are already uploaded when it fails
            write(os.urandom(8 * 1024 * 1024))
        raise RuntimeError("reading the checkpoint failed")

    with pytest.raises(RuntimeError, match="reading the checkpoint failed"):
        store.put_stream("release/m/v1/model.safetensors", produce, immutable=True)
    assert store.head("release/m/v1/model.safetensors") is None
    assert list(store.list("release/")) == []
