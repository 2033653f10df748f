"""Promotion end to end: gates, bit-exact releases, immutability, idempotency, races, crashes."""

from __future__ import annotations

import json
import os
import signal
import stat
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from registry import Registry
from registry.errors import (
    Conflict,
    GateNotMet,
    IntegrityError,
    MalformedRef,
    NotFound,
    UsageError,
    ValidationFailed,
)
from tests import tamper
from tests.helpers import docs_text
from tests.zygote import Running, run_reg

FACTORY = "examples.tiny_model:build_model"


def _push(reg, trained, step, run="r"):
    return reg.push_checkpoint(
        trained.step_dir(step), run=run, step=step, metrics=trained.probe_metrics(step)
    )


def _release_dir(out) -> Path:
    return Path(out["uri"].removeprefix("file://"))


@pytest.mark.parametrize("which", ["ws2", "ws3"])
def test_release_is_bit_exact_with_the_trained_weights(cpu_policy, reg, ckpts, which):
    trained = getattr(ckpts, which)
    step = trained.steps[-1]
    _push(reg, trained, step)
    out = reg.promote(f"r@step{step}", model="tiny", alias="prod")
    assert out["release"] == "tiny:v1" and out["aliases"] == ["prod"] and not out["existing"]
    weights = load_file(_release_dir(out) / "model.safetensors")
    full = trained.full_weights(step)
    assert set(weights) == set(full)
    for name, tensor in full.items():
        assert weights[name].dtype == tensor.dtype
        assert torch.equal(weights[name].view(torch.uint8), tensor.contiguous().view(torch.uint8))
    with safe_open(_release_dir(out) / "model.safetensors", "pt") as f:
        meta = f.metadata()
    assert meta["reg.source"] == f"r@step{step}" and meta["reg.release"] == "tiny:v1"
    assert meta["reg.manifest_sha256"] == reg.show(f"r@step{step}")["manifest_sha256"]
    document = json.loads((_release_dir(out) / "release.json").read_text())
    assert document["format"] == "reg.release/2"
    assert document["files"] == [{**f, "version": None} for f in out["files"]]  # local: none


def test_dtype_ties_extras_and_shards(cpu_policy, reg, ckpts, tmp_path):
    _push(reg, ckpts.ws2, 4)
    config = tmp_path / "config.json"
    config.write_text('{"dim": 64}')
    out = reg.promote(
        "r@step4",
        model="tiny",
        dtype="bf16",
        model_factory=FACTORY,
        max_shard_size="100KB",
        extras=[config],
    )
    names = [f["path"] for f in out["files"]]
    assert "config.json" in names and "model.safetensors.index.json" in names
    shards = [n for n in names if n.endswith(".safetensors")]
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((_release_dir(out) / "model.safetensors.index.json").read_text())
    loaded = {}
    for shard in set(index["weight_map"].values()):
        loaded |= load_file(_release_dir(out) / shard)
    assert set(loaded) == set(index["weight_map"])
    full = ckpts.ws2.full_weights(4)
    # Tied as HF does: lm_head.weight is written once, as embed.weight, and recorded.
    assert out["tied"] == [["lm_head.weight", "embed.weight"]]
    assert "lm_head.weight" not in loaded and set(loaded) == set(full) - {"lm_head.weight"}
    for name, tensor in loaded.items():
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, full[name].to(torch.bfloat16))


def test_promote_again_returns_the_existing_release(cpu_policy, reg, ckpts):
    _push(reg, ckpts.ws2, 2)
    _push(reg, ckpts.ws2, 4)
    first = reg.promote("r@step4", model="tiny")
    again = reg.promote("r@step4", model="tiny", alias="prod")
    assert again["existing"] and again["release"] == "tiny:v1" and again["aliases"] == ["prod"]
    assert again["sha256"] == first["sha256"]
    # a repeated promote reports the folder as the first one did (reg promote --json)
    assert again["hf"] == first["hf"] and again["hf_config"] == first["hf_config"] is None
    assert again["hf"]["missing"] == ["config.json"]
    assert reg.promote("r@step4", model="tiny", dtype="bf16")["release"] == "tiny:v2"
    assert reg.promote("r@step2", model="tiny")["release"] == "tiny:v3"
    assert [r["release"] for r in reg.releases("tiny")] == ["tiny:v1", "tiny:v2", "tiny:v3"]


def test_a_model_factory_is_part_of_what_makes_a_release_the_same(cpu_policy, reg, ckpts):
    """The factory finds the ties (written once) and names config.json's architectures: a
    promotion with one is not the same as one without, and each returns its own again."""
    _push(reg, ckpts.ws2, 4)
    plain = reg.promote("r@step4", model="tiny")
    assert plain["release"] == "tiny:v1" and plain["tied"] == []
    tied = reg.promote("r@step4", model="tiny", model_factory=FACTORY)
    assert tied["release"] == "tiny:v2" and not tied["existing"]
    assert tied["tied"] == [["lm_head.weight", "embed.weight"]]
    assert "lm_head.weight" not in load_file(_release_dir(tied) / "model.safetensors")
    again = reg.promote("r@step4", model="tiny", model_factory=FACTORY)
    assert again["existing"] and again["release"] == "tiny:v2"
    assert reg.promote("r@step4", model="tiny")["release"] == "tiny:v1"


def test_a_factory_release_made_before_the_factory_was_in_the_key_gets_one_new_version(
    cpu_policy, reg, ckpts, monkeypatch
):
    """What the docs' "The model factory is part of a release's identity" says of an older
    release made with --model-factory: its key is the one without a factory, so promoting again
    with the factory makes one new version (then returns it); without the factory returns the
    old one. reg does not try to match the older key."""
    import hashlib

    from registry.lifecycle.promotion.plan import PromotionPlan

    keyed = PromotionPlan.__post_init__

    def as_an_older_reg(plan: PromotionPlan) -> None:  # no model_factory in the key
        keyed(plan)
        legacy = {k: v for k, v in plan.options.items() if k != "model_factory"}
        key = hashlib.sha256(json.dumps(legacy, sort_keys=True).encode()).hexdigest()[:32]
        object.__setattr__(plan, "options", legacy)
        object.__setattr__(plan, "options_key", key)

    _push(reg, ckpts.ws2, 4)
    with monkeypatch.context() as older:
        older.setattr(PromotionPlan, "__post_init__", as_an_older_reg)
        made = reg.promote("r@step4", model="tiny", model_factory=FACTORY)
    assert made["release"] == "tiny:v1"
    again = reg.promote("r@step4", model="tiny", model_factory=FACTORY)
    assert again["release"] == "tiny:v2" and not again["existing"]
    repeated = reg.promote("r@step4", model="tiny", model_factory=FACTORY)
    assert repeated["release"] == "tiny:v2" and repeated["existing"]
    plain = reg.promote("r@step4", model="tiny")
    assert plain["release"] == "tiny:v1" and plain["existing"]
    documented = docs_text()
    assert "keep their identity (these options are added to the key only when given)" in documented
    assert "again with the factory makes one new version" in documented
    assert "promoting it again without the factory returns the older release" in documented
    assert "releases made before these rewrites existed keep their identity" not in documented


def test_reserved_names_are_refused_as_extras(cpu_policy, reg, ckpts, tmp_path):
    _push(reg, ckpts.ws2, 4)
    for name in ("MANIFEST.json", "release.json", "model.safetensors.index.json"):
        extra = tmp_path / name
        extra.write_text("{}")
        with pytest.raises(UsageError, match=f"the name {name} is taken or reserved"):
            reg.promote("r@step4", model="tiny", extras=[extra])
    assert reg.releases() == []


def test_default_policy_requires_cuda(reg, ckpts, cli):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    _push(reg, ckpts.ws2, 4)
    with pytest.raises(GateNotMet, match=r'require_device = "cuda"') as info:
        reg.promote("r@step4", model="tiny")
    assert "reg validate REF --device cuda" in str(info.value)
    res = cli("promote", "r@step4", "--model", "tiny")
    assert res.returncode == 1 and res.stderr.count("\n") == 1 and "require_device" in res.stderr
    # ... and names the way out on a machine without a GPU: the CPU policy.
    assert 'require_device = "any"' in res.stderr and "REG_POLICY=" in res.stderr
    assert "examples/cpu-policy.toml" in res.stderr and "cpu-promotion.md" in res.stderr
    assert reg.releases() == []
    # A passing CUDA validation recorded on a GPU node satisfies the gate from anywhere.
    from registry.catalog import queries
    from registry.catalog.models import Validation
    from registry.core.refs import CheckpointRef

    with reg.catalog.session(write=True) as s:
        _, row = queries.resolve_checkpoint(s, CheckpointRef("default", "r", 4))
        s.add(
            Validation(
                checkpoint_id=row.id,
                passed=True,
                device="cuda",
                device_name="NVIDIA H200",
                torch_version="2.13.0",
                world_size=1,
                seconds=1.0,
                created_at=time.time(),
                created_by="gpu-node",
            )
        )
    out = reg.promote("r@step4", model="tiny")
    assert out["validation"]["device"] == "cuda"


def test_nan_checkpoint_is_refused_and_consumes_no_version(cpu_policy, reg, ckpts, bad_ckpts):
    _push(reg, bad_ckpts["nan"], 2, run="nan")
    with pytest.raises(ValidationFailed, match="model.blocks.0.up.bias"):
        reg.promote("nan@step2", model="tiny")
    assert reg.releases() == []
    _push(reg, ckpts.ws2, 4)
    assert reg.promote("r@step4", model="tiny")["release"] == "tiny:v1"


def test_weights_only_checkpoint_is_refused(cpu_policy, reg, bad_ckpts):
    _push(reg, bad_ckpts["weights_only"], 2)
    with pytest.raises(GateNotMet, match="not resumable .*require_resumable"):
        reg.promote("r@step2", model="tiny")


def test_release_is_immutable_everywhere(cpu_policy, reg, ckpts):
    _push(reg, ckpts.ws2, 4)
    out = reg.promote("r@step4", model="tiny")
    path = _release_dir(out) / "model.safetensors"
    assert not os.stat(path).st_mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH)
    with pytest.raises(Conflict, match="immutable"):
        reg.store.delete("release/tiny/v1/model.safetensors")
    from sqlalchemy import text
    from sqlalchemy.exc import DBAPIError

    reg.apply_policy(cpu_policy)  # a policy document to attack
    for statement in (
        "UPDATE release SET sha256 = 'x'",
        "UPDATE release SET document_version = 'attacker-chosen'",
        "DELETE FROM release",
        "UPDATE release_file SET sha256 = 'x'",
        "DELETE FROM release_file",
        # As the database owner: back to pending to forge it and commit it again,
        # any content column, and the policy history.
        "UPDATE release SET status = 'pending'",
        "UPDATE release SET source_ref = 'r@step2'",
        "UPDATE release SET validation_id = NULL",
        "UPDATE release SET created_by = 'someone-else'",
        "UPDATE release SET dtype = 'fp16'",
        "UPDATE policy_document SET text = ''",
        "DELETE FROM policy_document",
    ):
        with (
            pytest.raises(
                DBAPIError, match="immutable|append-only|never deleted|never returns to pending"
            ),
            reg.catalog.engine.begin() as conn,
        ):
            conn.execute(text(statement))
    reg.yank("tiny:v1", "bad data")
    with (
        pytest.raises(DBAPIError, match="never un-yanked"),
        reg.catalog.engine.begin() as conn,
    ):
        conn.execute(text("UPDATE release SET status = 'active'"))
    assert reg.verify("tiny:v1")["ok"]


def test_tampered_release_fails_verify_and_pull(cpu_policy, reg, ckpts, tmp_path, cli):
    _push(reg, ckpts.ws2, 4)
    reg.promote("r@step4", model="tiny", alias="prod")
    tamper.flip_byte(reg.store, "release/tiny/v1/model.safetensors")
    report = reg.verify("tiny:v1")
    assert not report["ok"] and report["problems"][0]["path"] == "model.safetensors"
    with pytest.raises(IntegrityError, match="corrupt"):
        reg.pull_release("tiny@prod", tmp_path / "o")
    assert not (tmp_path / "o").exists()
    assert cli("verify", "tiny:v1").returncode == 1


def test_aliases_status_and_history(cpu_policy, reg, ckpts, tmp_path):
    _push(reg, ckpts.ws2, 2)
    _push(reg, ckpts.ws2, 4)
    reg.promote("r@step2", model="tiny", alias="prod")
    reg.promote("r@step4", model="tiny")
    moved = reg.set_alias("tiny", "prod", "v2")
    assert moved["previous"] == "v1" and reg.show("tiny@prod")["version"] == 2
    history = reg.show("tiny:v2")["alias_history"]
    assert [(h["alias"], h["from"], h["to"]) for h in history] == [("prod", "v1", "v2")]
    assert reg.deprecate("tiny:v1")["status"] == "deprecated"
    with pytest.raises(UsageError, match="needs a reason"):
        reg.yank("tiny:v1", "")
    assert reg.yank("tiny:v1", "leaked eval data")["status"] == "yanked"
    with pytest.raises(Conflict, match="yanked"):
        reg.set_alias("tiny", "canary", "v1")
    with pytest.raises(Conflict, match="leaked eval data"):
        reg.pull_release("tiny:v1", tmp_path / "y")
    reg.pull_release("tiny@prod", tmp_path / "p")
    assert (tmp_path / "p" / "model.safetensors").exists()
    actions = [e["action"] for e in reg.audit_log()]
    assert actions.count("alias") == 2 and "yank" in actions and "deprecate" in actions


def test_unknown_models_versions_and_aliases(cpu_policy, reg, ckpts):
    with pytest.raises(NotFound, match="model nope not found"):
        reg.show("nope:v1")
    _push(reg, ckpts.ws2, 4)
    reg.promote("r@step4", model="tiny", alias="prod")
    with pytest.raises(NotFound, match="tiny has versions v1"):
        reg.show("tiny:v7")
    with pytest.raises(NotFound, match="tiny has aliases prod"):
        reg.show("tiny@staging")
    with pytest.raises(MalformedRef):
        reg.set_alias("tiny", "latest", "v1")


def _promote_process(*args: str, fault: str | None = None) -> Running:
    return Running(("promote", *args), fault=fault)


def test_concurrent_promotions_get_distinct_versions(cpu_policy, catalog_url, ckpts):
    with Registry() as reg:
        _push(reg, ckpts.ws2, 2)
        _push(reg, ckpts.ws2, 4)
        for step in (2, 4):  # validations first, so the race is over version allocation
            reg.validate(f"r@step{step}", device="cpu")
    procs = [_promote_process(f"r@step{s}", "--model", "tiny", "--json") for s in (2, 4)]
    outs = [(p.wait(timeout=300), p.out(), p.err()) for p in procs]
    assert [rc for rc, _, _ in outs] == [0, 0], outs
    versions = sorted(json.loads(out)["version"] for _, out, _ in outs)
    assert versions == [1, 2]
    with Registry() as reg:
        assert all(reg.verify(f"tiny:v{v}")["ok"] for v in versions)


@pytest.mark.parametrize("fault", ["promote-consolidated", "promote-documented"])
def test_promotion_killed_before_commit_then_rerun_completes_same_version(
    cpu_policy, catalog_url, big_ckpt, fault
):
    with Registry() as reg:
        reg.push_checkpoint(big_ckpt.step_dir(1), run="big", step=1)
        reg.validate("big@step1", device="cpu")
    proc = _promote_process("big@step1", "--model", "big", fault=fault)
    assert proc.wait(timeout=300) == -signal.SIGKILL, proc.err()
    with Registry() as reg:
        assert reg.store.head("release/big/v1/model.safetensors") is not None  # written, unseen
        assert reg.releases() == []
        with pytest.raises(NotFound):
            reg.show("big:v1")
        out = reg.promote("big@step1", model="big")
        assert out["release"] == "big:v1" and not out["existing"]
        assert reg.verify("big:v1")["ok"]
        assert [r["release"] for r in reg.releases()] == ["big:v1"]
        weights = load_file(_release_dir(out) / "model.safetensors")
        full = big_ckpt.full_weights(1)
        assert set(weights) == set(full) and all(torch.equal(weights[k], full[k]) for k in full)


def test_cli_validate_promote_releases_json(cpu_policy, cli, ckpts, tmp_path):
    step_dir = ckpts.ws2.step_dir(4)
    assert (
        cli(
            "push-ckpt",
            step_dir,
            "--run",
            "r",
            "--step",
            "4",
            "--metric",
            f"probe_loss={ckpts.ws2.probe_loss(4)}",
        ).returncode
        == 0
    )
    res = cli("validate", "r@step4", "--device", "cpu", "--model-factory", FACTORY, "--json")
    assert res.returncode == 0, res.stderr
    v = json.loads(res.stdout)
    assert {"ref", "passed", "device", "seconds", "checks"} <= set(v)
    assert all({"name", "passed", "detail"} == set(c) for c in v["checks"])
    res = cli("promote", "r@step4", "--model", "tiny", "--alias", "prod", "--json")
    assert res.returncode == 0, res.stderr
    rel = json.loads(res.stdout)
    for key in ("release", "model", "version", "sha256", "files", "source", "aliases", "status"):
        assert key in rel
    listed = json.loads(cli("releases", "--json").stdout)
    assert [r["release"] for r in listed] == ["tiny:v1"]
    res = cli("pull-release", "tiny@prod", tmp_path / "rel")
    assert res.returncode == 0 and (tmp_path / "rel" / "release.json").exists()
    res = cli("alias", "set", "tiny", "canary", "v1")
    assert res.returncode == 0 and "tiny@canary -> tiny:v1" in res.stdout
    res = cli("yank", "tiny:v1", "--reason", "bad")
    assert res.returncode == 0
    res = cli("pull-release", "tiny:v1", tmp_path / "y")
    assert res.returncode == 5 and "yanked" in res.stderr


def test_a_rerun_adopts_leftovers_only_when_their_bytes_match(cpu_policy, catalog_url, ckpts):
    with Registry() as reg:
        _push(reg, ckpts.ws2, 4)
        reg.validate("r@step4", device="cpu")
    proc = _promote_process("r@step4", "--model", "tiny", fault="promote-consolidated")
    assert proc.wait(timeout=300) == -signal.SIGKILL, proc.err()
    with Registry() as reg:
        tamper.flip_byte(reg.store, "release/tiny/v1/model.safetensors")
        with pytest.raises(Conflict, match="release/tiny/v1/model.safetensors exists with other"):
            reg.promote("r@step4", model="tiny")
        assert reg.releases() == []
    res = run_reg("promote", "r@step4", "--model", "tiny")
    assert res.returncode == 5 and res.stderr.count("\n") == 1, res.stderr
