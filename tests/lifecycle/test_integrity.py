"""Damaged stored objects on every store (memory, local, S3 over HTTP): verify names each damaged
file, pull and pull-release refuse with exit 1 and write nothing, promotion refuses to consolidate
a checkpoint that fails its digests."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from registry import Registry
from registry.errors import IntegrityError, UsageError, ValidationFailed
from registry.formats.dcp import ChunkRange, inventory
from registry.formats.dcp_metadata import load_metadata
from tests import tamper


@pytest.fixture(params=["memory", "local", "s3"])
def store_kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "memory":
        monkeypatch.setenv("REG_STORE_URL", f"memory://{uuid.uuid4().hex}")
    elif request.param == "s3":
        request.getfixturevalue("s3_env")
    return str(request.param)


@pytest.fixture
def pushed(store_kind, cpu_policy, ckpts):  # type: ignore[no-untyped-def]
    with Registry() as reg:
        reg.push_checkpoint(
            ckpts.ws2.step_dir(4), run="r", step=4, metrics=ckpts.ws2.probe_metrics(4)
        )
        yield reg


KEY = "ckpt/default/r/step-4/"


def _nothing_written(tmp_path: Path, name: str) -> None:
    assert not (tmp_path / name).exists()
    assert not list(tmp_path.glob(f".{name}.reg-pull-*"))


def test_flipped_byte_fails_verify_and_pull(pushed, tmp_path):
    tamper.flip_byte(pushed.store, KEY + "__0_0.distcp")
    report = pushed.verify("r@step4")
    assert not report["ok"]
    assert [p["path"] for p in report["problems"]] == ["__0_0.distcp"]
    assert report["problems"][0]["problem"].startswith("sha256 ")
    with pytest.raises(IntegrityError, match=r"r@step4: stored file __0_0.distcp is corrupt"):
        pushed.pull("r@step4", tmp_path / "out")
    _nothing_written(tmp_path, "out")


def test_a_missing_file_is_named(pushed, tmp_path):
    tamper.remove(pushed.store, KEY + "__1_0.distcp")
    assert pushed.verify("r@step4")["problems"] == [{"path": "__1_0.distcp", "problem": "missing"}]
    with pytest.raises(IntegrityError, match="stored file __1_0.distcp is missing") as info:
        pushed.pull("r@step4", tmp_path / "out")
    assert info.value.exit_code == 1
    _nothing_written(tmp_path, "out")


def test_a_truncated_file_is_named(pushed, tmp_path):
    tamper.truncate(pushed.store, KEY + "__0_0.distcp", 100)
    [problem] = pushed.verify("r@step4")["problems"]
    assert problem["path"] == "__0_0.distcp"
    assert problem["problem"].startswith("size 100, expected ")
    with pytest.raises(IntegrityError, match="stored file __0_0.distcp is corrupt") as info:
        pushed.pull("r@step4", tmp_path / "out")
    assert info.value.exit_code == 1
    _nothing_written(tmp_path, "out")


def test_promotion_refuses_a_corrupt_shard_and_consumes_no_version(pushed):
    tamper.flip_byte(pushed.store, KEY + "__1_0.distcp")
    with pytest.raises(
        ValidationFailed, match=r"integrity: __1_0.distcp is not the file that was pushed \(sha256"
    ):
        pushed.promote("r@step4", model="tiny")
    assert pushed.releases() == []
    assert pushed.store.head("release/tiny/v1/model.safetensors") is None


def _model_chunk(store, key: str) -> ChunkRange:  # type: ignore[no-untyped-def]
    inv = inventory(load_metadata(store.get_bytes(key + ".metadata"), light=True))
    model = [f for f in inv.tensors if f.startswith("model.")]
    fqn = max(model, key=lambda f: inv.tensors[f].nbytes)
    return max(inv.tensors[fqn].chunks, key=lambda c: c.length)


def test_a_shard_changed_after_validation_is_refused_before_any_version(pushed):
    """Validate, then change 256 bytes of a model chunk in the store, then promote: the
    promotion proves every consolidated byte against the manifest and refuses."""
    assert pushed.validate("r@step4")["passed"]
    chunk = _model_chunk(pushed.store, KEY)
    original = pushed.store.get_bytes(KEY + chunk.file)
    body = bytearray(original)
    middle = chunk.offset + chunk.length // 2
    body[middle : middle + 256] = bytes(b ^ 0x5A for b in body[middle : middle + 256])
    tamper.replace(pushed.store, KEY + chunk.file, bytes(body))
    with pytest.raises(IntegrityError, match=f"r@step4: {chunk.file} is not the file that was"):
        pushed.promote("r@step4", model="tiny")
    assert pushed.releases() == []
    assert list(pushed.store.list("release/")) == []
    tamper.replace(pushed.store, KEY + chunk.file, original)  # repaired: the promotion goes on
    assert pushed.promote("r@step4", model="tiny")["version"] == 1


def test_a_changed_metadata_is_refused_before_it_is_parsed(pushed):
    assert pushed.validate("r@step4")["passed"]
    tamper.flip_byte(pushed.store, KEY + ".metadata", 10)
    with pytest.raises(IntegrityError, match=r"r@step4: \.metadata is not the file that was"):
        pushed.promote("r@step4", model="tiny")
    assert pushed.releases() == []


def test_damaged_release_fails_verify_and_pull(pushed, tmp_path):
    out = pushed.promote("r@step4", model="tiny", alias="prod")
    assert pushed.verify("tiny:v1")["ok"]
    tamper.flip_byte(pushed.store, "release/tiny/v1/model.safetensors")
    tamper.replace(pushed.store, "release/tiny/v1/release.json", b"{}")
    report = pushed.verify("tiny@prod")
    assert {p["path"] for p in report["problems"]} == {"model.safetensors", "release.json"}
    with pytest.raises(IntegrityError, match="tiny:v1: stored file .* is corrupt"):
        pushed.pull_release("tiny@prod", tmp_path / "rel")
    _nothing_written(tmp_path, "rel")
    assert out["files"] == pushed.show("tiny:v1")["files"]  # the catalog's record is unchanged


def test_missing_release_file_exits_1(pushed, tmp_path):
    pushed.promote("r@step4", model="tiny")
    tamper.remove(pushed.store, "release/tiny/v1/model.safetensors")
    with pytest.raises(IntegrityError, match="stored file model.safetensors is missing") as info:
        pushed.pull_release("tiny:v1", tmp_path / "rel")
    assert info.value.exit_code == 1
    _nothing_written(tmp_path, "rel")
    assert pushed.verify("tiny:v1")["problems"] == [
        {"path": "model.safetensors", "problem": "missing"}
    ]


def test_memory_store_is_not_shared_with_validation_ranks(monkeypatch, ckpts):
    monkeypatch.setenv("REG_STORE_URL", f"memory://{uuid.uuid4().hex}")
    with Registry() as reg:
        reg.push_checkpoint(ckpts.ws2.step_dir(2), run="r", step=2)
        with pytest.raises(UsageError, match="memory store cannot be shared"):
            reg.validate(
                "r@step2",
                device="cpu",
                world_size=2,
                model_factory="examples.tiny_model:build_model",
            )


def test_cli_missing_release_file_is_one_line_exit_1(cpu_policy, ckpts, cli, tmp_path):
    with Registry() as reg:
        reg.push_checkpoint(ckpts.ws2.step_dir(4), run="r", step=4)
        reg.promote("r@step4", model="tiny")
        tamper.remove(reg.store, "release/tiny/v1/model.safetensors")
    res = cli("pull-release", "tiny:v1", tmp_path / "rel")
    assert res.returncode == 1
    assert res.stderr.count("\n") == 1
    assert "stored file model.safetensors is missing" in res.stderr


def test_repair_on_a_store_without_versions_says_so(cpu_policy, ckpts, cli):
    assert cli("push-ckpt", ckpts.ws2.step_dir(2), "--run", "r", "--step", "2").returncode == 0
    with Registry() as reg:
        tamper.flip_byte(reg.store, "ckpt/default/r/step-2/__0_0.distcp")
    res = cli("verify", "r@step2", "--repair")
    assert res.returncode == 1, res.stderr
    assert "__0_0.distcp: sha256" in res.stdout and "no version was recorded" in res.stdout
    assert "Traceback" not in res.stderr
