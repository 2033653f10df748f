"""Restore validation on real FSDP2 checkpoints: every check, reshard, refusals."""

from __future__ import annotations

from pathlib import Path

import pytest

from registry.errors import UsageError
from tests.helpers import flip_byte

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
def test_reshard_ws2_checkpoint(reg_lite, ckpts, world_size):
    _push(reg_lite, ckpts.ws2, 2)
    out = reg_lite.validate("r@step2", device="cpu", world_size=world_size)
    assert out["passed"], out["checks"]
    assert out["world_size"] == world_size
    assert f"{world_size} ranks" in _checks(out)["restore"]["detail"] or world_size == 1


def test_ws3_checkpoint_restores_at_ws2(reg_lite, ckpts):
    _push(reg_lite, ckpts.ws3, 3)
    assert reg_lite.validate("r@step3", device="cpu", world_size=2)["passed"]
    assert reg_lite.validate("r@step3", device="cpu", model_factory=FACTORY)["passed"]


def test_nan_weight_fails_and_names_the_tensor(reg_lite, bad_ckpts):
    _push(reg_lite, bad_ckpts["nan"], 2)
    out = reg_lite.validate("r@step2", device="cpu")
    assert not out["passed"]
    finite = _checks(out)["finite"]
    assert not finite["passed"]
    assert "model.blocks.0.up.bias" in finite["detail"] and "NaN" in finite["detail"]


def test_weights_only_checkpoint_is_not_resumable(reg_lite, bad_ckpts):
    pushed = _push(reg_lite, bad_ckpts["weights_only"], 2)
    assert pushed["resumable"] is False
    out = reg_lite.validate("r@step2", device="cpu")
    assert not out["passed"]
    assert _checks(out)["resume_state"]["detail"].startswith("missing optimizer")


def test_corrupt_shard_fails_integrity_and_loads_nothing(reg_lite, ckpts):
    _push(reg_lite, ckpts.ws2, 4)
    stored = Path(reg_lite.show("r@step4")["uri"].removeprefix("file://"))
    flip_byte(stored / "__0_0.distcp")
    out = reg_lite.validate("r@step4", device="cpu")
    assert not out["passed"]
    assert "__0_0.distcp: sha256" in _checks(out)["integrity"]["detail"]
    assert "restore" not in _checks(out)


def test_factory_errors(reg_lite, ckpts):
    _push(reg_lite, ckpts.ws2, 4)
    with pytest.raises(UsageError, match="cannot import no_such_module"):
        reg_lite.validate("r@step4", device="cpu", model_factory="no_such_module:build")
    with pytest.raises(UsageError, match="write module:function"):
        reg_lite.validate("r@step4", device="cpu", model_factory="examples.tiny_model")
    out = reg_lite.validate("r@step4", device="cpu", model_factory="tests.factories:wrong_names")
    detail = _checks(out)["model"]["detail"]
    assert not out["passed"]
    assert "missing keys: 0.weight" in detail and "unexpected keys: embed.weight" in detail
    out = reg_lite.validate("r@step4", device="cpu", model_factory="tests.factories:broken")
    assert "factory exploded" in _checks(out)["model"]["detail"]


def test_probe_mismatch_fails(reg_lite, ckpts):
    reg_lite.push_checkpoint(ckpts.ws2.step_dir(4), run="r", step=4, metrics={"probe_loss": 99.0})
    out = reg_lite.validate("r@step4", device="cpu", model_factory=FACTORY)
    assert not _checks(out)["probe"]["passed"] and "recorded 99" in _checks(out)["probe"]["detail"]


def test_cuda_request_without_cuda_is_a_clear_error(reg_lite, ckpts):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA; the refusal only applies without one")
    _push(reg_lite, ckpts.ws2, 4)
    with pytest.raises(UsageError, match="no CUDA device here"):
        reg_lite.validate("r@step4", device="cuda")


@pytest.mark.cuda
def test_cuda_validation_and_reshard(reg_lite, ckpts):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (CI has none; run tests/gpu/run.sh on a GPU machine)")
    _push(reg_lite, ckpts.ws2, 4)
    out = reg_lite.validate("r@step4", device="cuda", model_factory=FACTORY)
    assert out["passed"] and out["device"] == "cuda", out["checks"]
