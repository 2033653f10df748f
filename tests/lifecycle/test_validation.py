"""Restore validation on real FSDP2 checkpoints: every check, reshard, refusals."""

from __future__ import annotations

from pathlib import Path

import pytest

from registry.errors import InvalidCheckpoint, UsageError
from tests import helpers, tamper

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
    assert "match the checkpoint's names, shapes and dtypes" in checks["model"]["detail"]
    assert "probe loss" in checks["probe"]["detail"]
    assert out["mode"] == "streamed" and out["driver"] is None  # no GPU driver on CPU
    assert out["seconds"] > 0 and {"metadata_seconds", "restore_seconds"} <= set(out["phases"])
    assert [e["action"] for e in reg.audit_log()][-1] == "validate"


def test_ws2_checkpoint_at_world_size_1(reg, ckpts):
    _push(reg, ckpts.ws2, 2)
    out = reg.validate("r@step2", device="cpu")
    assert out["passed"], out["checks"]
    assert out["world_size"] == 1 and out["mode"] == "streamed"
    assert "loaded on cpu in batches within --memory-budget" in _checks(out)["restore"]["detail"]


def test_sharded_mode_restores_as_the_factory_shards(reg, ckpts):
    """--world-size 3 on a world-size-2 FSDP2 checkpoint: every parameter a DTensor with the
    factory's placements, each rank holding about a third, the probe matching the loss
    recorded at push; the optimizer restored too."""
    _push(reg, ckpts.ws2, 4)
    out = reg.validate(
        "r@step4", device="cpu", world_size=3, model_factory=FACTORY, with_optimizer=True
    )
    checks = _checks(out)
    assert out["passed"], out["checks"]
    assert out["mode"] == "sharded" and out["world_size"] == 3
    assert (
        "model and optimizer restored through examples.tiny_model.parallelize onto 3 ranks"
        in (checks["restore_sharded"]["detail"])
    )
    sharding = out["sharding"]
    assert sharding and all(p["dtensor"] for p in sharding.values())
    assert {p["placements"] for p in sharding.values()} == {"(Shard(dim=0),)"}
    for name, p in sharding.items():
        assert len(p["local"]) == 3 and sum(p["local"]) >= p["numel"], name
        assert 0.30 <= p["largest_share"] <= 0.40, (name, p)
    assert checks["probe"]["passed"] and "probe loss" in checks["probe"]["detail"]


def test_sharded_mode_needs_the_factorys_hooks(reg, ckpts):
    _push(reg, ckpts.ws3, 3)
    with pytest.raises(UsageError, match="needs --model-factory") as info:
        reg.validate("r@step3", device="cpu", world_size=2)
    assert info.value.exit_code == 2
    with pytest.raises(UsageError, match=r"tests.helpers defines no parallelize\(model, mesh\)"):
        reg.validate("r@step3", device="cpu", world_size=2, model_factory="tests.helpers:train")
    assert reg.validate("r@step3", device="cpu", world_size=2, model_factory=FACTORY)["passed"]
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
    assert (
        "__0_0.distcp is not the file that was pushed (sha256"
        in _checks(out)["integrity"]["detail"]
    )
    assert "restore" not in _checks(out)


def test_factory_errors(reg, ckpts):
    _push(reg, ckpts.ws2, 4)
    with pytest.raises(UsageError, match="cannot import no_such_module"):
        reg.validate("r@step4", device="cpu", model_factory="no_such_module:build")
    with pytest.raises(UsageError, match="write module:function"):
        reg.validate("r@step4", device="cpu", model_factory="examples.tiny_model")
    out = reg.validate(
        "r@step4", device="cpu", model_factory="tests.lifecycle.factories:wrong_names"
    )
    detail = _checks(out)["model"]["detail"]
    assert not out["passed"]
    assert "missing keys: 0.weight" in detail and "unexpected keys: embed.weight" in detail
    out = reg.validate("r@step4", device="cpu", model_factory="tests.lifecycle.factories:broken")
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
@helpers.needs_cuda
def test_cuda_validation_and_reshard(reg, ckpts):
    _push(reg, ckpts.ws2, 4)
    out = reg.validate("r@step4", device="cuda", model_factory=FACTORY)
    assert out["passed"] and out["device"] == "cuda", out["checks"]


@pytest.mark.cuda
@helpers.needs_two_gpus
def test_cuda_reshard_onto_two_gpus(reg, ckpts):
    _push(reg, ckpts.ws2, 4)
    out = reg.validate(
        "r@step4", device="cuda", world_size=2, model_factory=FACTORY, with_optimizer=True
    )
    assert out["passed"], out["checks"]
    assert "onto 2 ranks (cuda)" in _checks(out)["restore_sharded"]["detail"]
    assert out["driver"]  # nvidia-smi's driver version is recorded


def test_sharded_mode_with_a_mismatched_model_stops_before_the_ranks(reg, ckpts):
    _push(reg, ckpts.ws2, 4)
    wrong = reg.validate(
        "r@step4", device="cpu", world_size=2, model_factory="tests.lifecycle.factories:wrong_names"
    )
    checks = _checks(wrong)
    assert checks["restore"]["passed"] and not wrong["passed"]
    assert "missing keys: 0.weight" in checks["model"]["detail"]
    assert "restore_sharded" not in checks


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


def test_policy_modes_and_probe_decide_which_validations_promote(
    catalog_url, ckpts, tmp_path, monkeypatch
):
    """[promotion] modes = ["sharded"]: the streamed validation promotion runs itself is not
    enough, a recorded sharded one is; require_probe: a validation without a probe is not."""
    from registry import Registry
    from registry.errors import GateNotMet, ValidationFailed

    policy = tmp_path / "policy.toml"
    policy.write_text('[promotion]\nrequire_device = "any"\nmodes = ["sharded"]\n')
    monkeypatch.setenv("REG_POLICY", str(policy))
    with Registry() as reg:
        _push(reg, ckpts.ws2, 4)
        assert reg.validate("r@step4", device="cpu", model_factory=FACTORY)["mode"] == "streamed"
        for factory in (None, FACTORY):
            with pytest.raises(GateNotMet, match=r"modes = \[sharded\] does not accept"):
                reg.promote("r@step4", model="m", model_factory=factory)
        sharded = reg.validate("r@step4", device="cpu", world_size=2, model_factory=FACTORY)
        assert sharded["passed"] and sharded["mode"] == "sharded"
        out = reg.promote("r@step4", model="m", model_factory=FACTORY)
        assert out["version"] == 1 and out["validation"]["id"] == sharded["validation_id"]

    policy.write_text('[promotion]\nrequire_device = "any"\nrequire_probe = true\n')
    with Registry() as reg:
        _push(reg, ckpts.ws2, 2, run="p")
        assert reg.validate("p@step2", device="cpu")["passed"]  # no factory: no probe
        with pytest.raises(
            ValidationFailed, match="require_probe = true and validation .* ran no probe"
        ):
            reg.promote("p@step2", model="n")
        assert [r["model"] for r in reg.releases()] == ["m"]  # nothing of n
        assert reg.promote("p@step2", model="n", model_factory=FACTORY)["version"] == 1


def test_overlapping_chunks_in_metadata_are_refused_by_name(reg, ckpts, tmp_path):
    """Two items over the same bytes of a shard: DCP never writes that, and a pass would check
    one of them only in part."""
    import pickle
    import shutil

    dest = shutil.copytree(ckpts.ws2.step_dir(4), tmp_path / "overlap")
    with open(dest / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # our own test checkpoint, not an untrusted file
    items = sorted(
        (i for i in metadata.storage_data.items() if i[1].relative_path == "__0_0.distcp"),
        key=lambda i: i[1].offset,
    )
    (_, first), (index, second) = items[0], items[1]
    second.offset = first.offset + 1  # inside the first item, same length
    with open(dest / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    try:
        reg.push_checkpoint(dest, run="o", step=4)
    except InvalidCheckpoint as exc:  # refused at push already: as good
        assert "overlap" in str(exc) or "__0_0.distcp" in str(exc)
        return
    out = reg.validate("o@step4", device="cpu")
    restore = _checks(out)["restore"]
    assert not out["passed"] and not restore["passed"]
    assert f"{index.fqn} overlap in __0_0.distcp" in restore["detail"]
