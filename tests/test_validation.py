"""Restore validation on real FSDP2 checkpoints: every check, reshard, refusals."""

from __future__ import annotations

from pathlib import Path

import pytest

from registry.errors import InvalidCheckpoint, UsageError
from tests import tamper

FACTORY = "examples.tiny_model:build_model"


def _push(reg, trained, step, run="r", **kw):
    return reg.push_checkpoint(
        trained.step_dir(step),
        run=run,
        step=step,
        metrics=trained.probe_metrics(step),
        **kw,
    )


def _checks(out):
    return {c["name"]: c for c in out["checks"]}


def test_validation_with_factory_passes_and_is_recorded(reg, ckpts):
    _push(reg, ckpts.ws2, 4)
    out = reg.validate("r@step4", device="cpu", model_factory=FACTORY)
    assert out["passed"] and out["device"] == "cpu" and out["world_size"] == 1
    checks = _checks(out)
    assert set(checks) == {
        "integrity",
        "restore",
        "shapes",
        "finite",
        "model",
        "probe",
        "resume_state",
    }
    assert "tied: embed.weight=lm_head.weight" in checks["model"]["detail"]
    assert "probe loss" in checks["probe"]["detail"]
    assert out["seconds"] > 0 and {"integrity_seconds", "restore_seconds"} <= set(out["phases"])
    assert [e["action"] for e in reg.audit_log()][-1] == "validate"


@pytest.mark.parametrize("world_size", [1, 3])
def test_reshard_ws2_checkpoint(reg, ckpts, world_size):
    _push(reg, ckpts.ws2, 2)
    out = reg.validate("r@step2", device="cpu", world_size=world_size)
    assert out["passed"], out["checks"]
    assert out["world_size"] == world_size
    expected = "at world size 1" if world_size == 1 else f"resharded onto {world_size} ranks"
    assert expected in _checks(out)["restore"]["detail"]


def test_ws3_checkpoint_restores_at_ws2(reg, ckpts):
    _push(reg, ckpts.ws3, 3)
    assert reg.validate("r@step3", device="cpu", world_size=2)["passed"]
    assert reg.validate("r@step3", device="cpu", model_factory=FACTORY)["passed"]


def test_nan_weight_fails_and_names_the_tensor(reg, bad_ckpts):
    _push(reg, bad_ckpts["nan"], 2)
    out = reg.validate("r@step2", device="cpu")
    assert not out["passed"]
    finite = _checks(out)["finite"]
    assert not finite["passed"]
    assert "model.blocks.0.up.bias" in finite["detail"] and "NaN" in finite["detail"]


def test_weights_only_checkpoint_is_not_resumable(reg, bad_ckpts):
    pushed = _push(reg, bad_ckpts["weights_only"], 2)
    assert pushed["resumable"] is False
    out = reg.validate("r@step2", device="cpu")
    # reported, but not counted: whether it may be promoted is the promotion gate's call
    assert out["passed"] and not _checks(out)["resume_state"]["passed"]
    assert _checks(out)["resume_state"]["detail"].startswith(
        "dcp layout: missing optimizer, train_state"
    )
    assert out["resumable"] is False and out["missing_state"] == ["optimizer", "train_state"]


def test_corrupt_shard_fails_integrity_and_loads_nothing(reg, ckpts):
    _push(reg, ckpts.ws2, 4)
    tamper.flip_byte(reg.store, "ckpt/default/r/step-4/__0_0.distcp")
    out = reg.validate("r@step4", device="cpu")
    assert not out["passed"]
    assert "__0_0.distcp: sha256" in _checks(out)["integrity"]["detail"]
    assert "restore" not in _checks(out)


def test_factory_errors(reg, ckpts):
    _push(reg, ckpts.ws2, 4)
    with pytest.raises(UsageError, match="cannot import no_such_module"):
        reg.validate("r@step4", device="cpu", model_factory="no_such_module:build")
    with pytest.raises(UsageError, match="write module:function"):
        reg.validate("r@step4", device="cpu", model_factory="examples.tiny_model")
    out = reg.validate("r@step4", device="cpu", model_factory="tests.factories:wrong_names")
    detail = _checks(out)["model"]["detail"]
    assert not out["passed"]
    assert "missing keys: 0.weight" in detail and "unexpected keys: embed.weight" in detail
    out = reg.validate("r@step4", device="cpu", model_factory="tests.factories:broken")
    assert "factory exploded" in _checks(out)["model"]["detail"]


def test_probe_mismatch_fails(reg, ckpts):
    reg.push_checkpoint(ckpts.ws2.step_dir(4), run="r", step=4, metrics={"probe_loss": 99.0})
    out = reg.validate("r@step4", device="cpu", model_factory=FACTORY)
    assert not _checks(out)["probe"]["passed"] and "recorded 99" in _checks(out)["probe"]["detail"]


def test_cuda_request_without_cuda_is_a_clear_error(reg, ckpts):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA; the refusal only applies without one")
    _push(reg, ckpts.ws2, 4)
    with pytest.raises(UsageError, match="no CUDA device here"):
        reg.validate("r@step4", device="cuda")


@pytest.mark.cuda
def test_cuda_validation_and_reshard(reg, ckpts):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (CI has none; run `pytest -m cuda` on a GPU machine)")
    _push(reg, ckpts.ws2, 4)
    out = reg.validate("r@step4", device="cuda", model_factory=FACTORY)
    assert out["passed"] and out["device"] == "cuda", out["checks"]


@pytest.mark.cuda
def test_cuda_reshard_onto_two_gpus(reg, ckpts):
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("NCCL needs one GPU per rank: this machine has fewer than 2")
    _push(reg, ckpts.ws2, 4)
    out = reg.validate("r@step4", device="cuda", world_size=2, model_factory=FACTORY)
    assert out["passed"], out["checks"]
    assert "resharded onto 2 ranks (cuda)" in _checks(out)["restore"]["detail"]


def test_reshard_runs_the_model_factory_on_the_gathered_tensors(reg, ckpts):
    _push(reg, ckpts.ws2, 4)
    out = reg.validate("r@step4", device="cpu", world_size=2, model_factory=FACTORY)
    checks = _checks(out)
    assert out["passed"], out["checks"]
    assert "resharded onto 2 ranks" in checks["restore"]["detail"]
    assert "tied: embed.weight=lm_head.weight" in checks["model"]["detail"]
    assert checks["probe"]["passed"] and "probe loss" in checks["probe"]["detail"]
    wrong = reg.validate(
        "r@step4", device="cpu", world_size=2, model_factory="tests.factories:wrong_names"
    )
    assert _checks(wrong)["restore"]["passed"], wrong["checks"]
    assert not wrong["passed"]
    assert "missing keys: 0.weight" in _checks(wrong)["model"]["detail"]


def _drop_a_chunk(src: Path, dest: Path) -> str:
    """A copy of the checkpoint whose .metadata lists one chunk fewer for a sharded tensor: the
    tensor is then partly covered, and a load would leave the rest uninitialised."""
    import pickle
    import shutil

    shutil.copytree(src, dest)
    with open(dest / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # our own test checkpoint, not an untrusted file
    fqn = next(
        k
        for k, m in metadata.state_dict_metadata.items()
        if hasattr(m, "chunks") and len(m.chunks) == 2
    )
    dropped = metadata.state_dict_metadata[fqn].chunks.pop()
    for index in [i for i in metadata.storage_data if i.fqn == fqn]:
        if tuple(index.offset) == tuple(dropped.offsets):
            del metadata.storage_data[index]
    with open(dest / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    return fqn


def test_partly_covered_tensor_is_refused_at_push(reg, ckpts, tmp_path):
    """Half a tensor's chunks missing from .metadata: loading it would leave that half as
    uninitialised memory. Refused at push now (validation used to catch it afterwards)."""
    fqn = _drop_a_chunk(ckpts.ws2.step_dir(4), tmp_path / "partial")
    with pytest.raises(InvalidCheckpoint, match=f"the chunks of {fqn} hold .* elements") as info:
        reg.push_checkpoint(tmp_path / "partial", run="p", step=4)
    assert info.value.exit_code == 2
    assert reg.list_checkpoints("p") == []
