"""Checkpoints with several DCP roots one level down (accelerate's sharded save_state), and the
ways such a directory can be wrong (registry/formats/dcp_roots.py). The real accelerate
checkpoint is tests/formats/test_frameworks.py's; these are written by dcp.save in this process."""

from __future__ import annotations

import io
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from registry import Registry
from registry.errors import InvalidCheckpoint
from registry.formats.dcp_roots import check_roots, roots_of

W = torch.arange(16, dtype=torch.float32).reshape(4, 4)


def accelerate_like(root: Path) -> Path:
    """pytorch_model_fsdp_0/ and optimizer_0/ as accelerate writes them, and its sidecars."""
    dcp.save(
        {"model": {"w": W.clone(), "b": torch.ones(4)}}, checkpoint_id=root / "pytorch_model_fsdp_0"
    )
    optimizer = {
        "state": {"w": {"exp_avg": torch.zeros(4, 4), "step": torch.tensor(3.0)}},
        "param_groups": [{"lr": 0.1, "params": ["w"]}],
    }
    dcp.save({"optimizer": optimizer}, checkpoint_id=root / "optimizer_0")
    torch.save({"last_epoch": 3}, root / "scheduler.bin")
    torch.save({"step": 3}, root / "custom_checkpoint_0.pkl")
    return root


def test_roots_are_found_at_the_top_or_one_level_down() -> None:
    assert roots_of([".metadata", "__0_0.distcp", "sub/.metadata"]) == ("",)
    assert roots_of(["b/.metadata", "a/.metadata", "a/__0_0.distcp", "x/y/.metadata"]) == ("a", "b")
    assert roots_of(["__0_0.distcp", "x/y/.metadata"]) == ()


@pytest.mark.parametrize(
    ("paths", "message"),
    [
        (["__0_0.distcp"], "has no .metadata"),
        (["opt.v1/.metadata"], "the DCP root 'opt.v1' has a name reg cannot prefix"),
        (["a/.metadata", "b/__0_0.distcp"], "b/ holds DCP shards (__0_0.distcp) but no .metadata"),
        ([f"r{i}/.metadata" for i in range(65)], "65 DCP roots"),
    ],
)
def test_roots_that_are_refused(paths: list[str], message: str) -> None:
    with pytest.raises(InvalidCheckpoint, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_roots("ckpt", paths)


@pytest.mark.process
def test_several_roots_push_validate_promote_and_pull_as_one(
    catalog_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    policy = tmp_path / "p.toml"
    policy.write_text('[promotion]\nrequire_device = "any"\n')
    monkeypatch.setenv("REG_POLICY", str(policy))
    src = accelerate_like(tmp_path / "src")
    with Registry() as reg:
        pushed = reg.push_checkpoint(src, run="acc", step=3)
        assert pushed["layout"] == "accelerate" and pushed["resumable"], pushed
        shown = reg.show("acc@step3")
        assert shown["resume_state"]["model"] == ["pytorch_model_fsdp_0.model"]
        assert shown["resume_state"]["optimizer"] == ["optimizer_0.optimizer"]
        assert shown["resume_state"]["train_state"] == ["custom_checkpoint_0.pkl"]
        assert {f["path"] for f in shown["files"]} >= {
            "pytorch_model_fsdp_0/.metadata",
            "optimizer_0/.metadata",
            "scheduler.bin",
        }
        validated = reg.validate("acc@step3", device="cpu")
        assert validated["passed"], validated["checks"]
        out = reg.promote("acc@step3", model="acc")
        weights = load_file(Path(out["uri"].removeprefix("file://")) / "model.safetensors")
        assert sorted(weights) == ["b", "w"] and torch.equal(weights["w"], W)
        reg.pull("acc@step3", tmp_path / "pulled")
    for f in src.rglob("*"):
        if f.is_file():
            assert (tmp_path / "pulled" / f.relative_to(src)).read_bytes() == f.read_bytes()


def _rewrite_metadata(path: Path, change: object) -> None:
    metadata = pickle.loads(path.read_bytes())  # our own file, written by dcp.save above
    change(metadata)  # type: ignore[operator]
    buf = io.BytesIO()
    pickle.dump(metadata, buf)
    path.write_bytes(buf.getvalue())


def test_a_root_cannot_point_into_another_root(tmp_path: Path) -> None:
    """A chunk's file is the root's own: "../optimizer_0/__0_0.distcp" in the model root's
    .metadata names no file of the checkpoint, so the push refuses it."""
    src = accelerate_like(tmp_path / "src")

    def escape(metadata: object) -> None:
        for info in metadata.storage_data.values():  # type: ignore[attr-defined]
            info.relative_path = "../optimizer_0/__0_0.distcp"

    _rewrite_metadata(src / "pytorch_model_fsdp_0" / ".metadata", escape)
    with Registry() as reg, pytest.raises(InvalidCheckpoint, match="named in .metadata is missing"):
        reg.push_checkpoint(src, run="acc", step=3)


def test_a_truncated_shard_in_a_nested_root_is_named(tmp_path: Path) -> None:
    src = accelerate_like(tmp_path / "src")
    shard = src / "optimizer_0" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    with (
        Registry() as reg,
        pytest.raises(InvalidCheckpoint, match="optimizer_0/__0_0.distcp is truncated"),
    ):
        reg.push_checkpoint(src, run="acc", step=3)


def test_an_unfinished_optimizer_root_is_refused(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    src = accelerate_like(tmp_path / "src")
    (src / "optimizer_0" / ".metadata").unlink()  # the save died before DCP's last write
    got = cli("push-ckpt", src, "--run", "acc", "--step", "3")
    assert got.returncode == 2 and "Traceback" not in got.stderr
    assert "optimizer_0/ holds DCP shards (__0_0.distcp) but no .metadata" in got.stderr
    shutil.rmtree(src / "pytorch_model_fsdp_0")
    shutil.rmtree(src / "optimizer_0")
    got = cli("push-ckpt", src, "--run", "acc", "--step", "3")
    assert got.returncode == 2 and "has no .metadata" in got.stderr


def test_a_corrupt_nested_metadata_is_named(tmp_path: Path) -> None:
    src = accelerate_like(tmp_path / "src")
    (src / "optimizer_0" / ".metadata").write_bytes(b"\x80\x04garbage")
    with Registry() as reg, pytest.raises(InvalidCheckpoint, match=r"^optimizer_0/\.metadata"):
        reg.push_checkpoint(src, run="acc", step=3)


def test_a_crafted_chunk_offset_is_refused_before_it_is_hashed(tmp_path: Path) -> None:
    """An offset that is a tuple sharing itself 60 levels deep (a 2 KB file) would take for
    ever to hash as a dict key: merging checks it first."""
    src = accelerate_like(tmp_path / "src")
    shared: object = (0,)
    for _ in range(60):
        shared = (shared, shared)

    def bomb(metadata: object) -> None:
        for index in metadata.storage_data:  # type: ignore[attr-defined]
            object.__setattr__(index, "offset", shared)

    _rewrite_metadata(src / "pytorch_model_fsdp_0" / ".metadata", bomb)
    assert (src / "pytorch_model_fsdp_0" / ".metadata").stat().st_size < 10_000
    with Registry() as reg, pytest.raises(InvalidCheckpoint, match="a chunk offset of"):
        reg.push_checkpoint(src, run="acc", step=3)
