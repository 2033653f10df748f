"""Checkpoint layouts end to end: real torchrun (ws=2) DCP checkpoints in each trainer's shape
push, validate and promote with the default resume rules; resume state is decided when used."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from registry import Registry
from registry.errors import GateNotMet, IntegrityError
from tests.conftest import LAYOUTS
from tests.helpers import Trained

FACTORY = "examples.tiny_model:build_model"


def _policy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str = "") -> None:
    """A policy file with CPU validation allowed; `text` adds to it."""
    monkeypatch.setenv("REG_POLICY", str(_policy_file(tmp_path, text)))


def _policy_file(tmp_path: Path, text: str = "") -> Path:
    path = tmp_path / f"policy-{abs(hash(text))}.toml"
    path.write_text('[promotion]\nrequire_device = "any"\n' + text)
    return path


def _assert_release_is_the_model(out: dict, trained: Trained) -> None:  # type: ignore[type-arg]
    weights = load_file(Path(out["uri"].removeprefix("file://")) / "model.safetensors")
    full = trained.full_weights(2)  # the model's own state_dict(), gathered by the trainer
    assert set(weights) == set(full)
    for name, tensor in full.items():
        assert torch.equal(weights[name].view(torch.uint8), tensor.contiguous().view(torch.uint8))


@pytest.mark.parametrize("name", LAYOUTS)
def test_each_layout_pushes_validates_and_promotes(
    catalog_url, layouts, name, tmp_path, monkeypatch
):
    _policy(tmp_path, monkeypatch)
    trained = layouts[name]
    with Registry() as reg:
        pushed = reg.push_checkpoint(trained.step_dir(2), run=name, step=2)
        assert pushed["layout"] == name and pushed["resumable"] is True
        assert pushed["unclassified"] == [] and pushed["missing_state"] == []
        validated = reg.validate(f"{name}@step2", device="cpu")
        checks = {c["name"]: c for c in validated["checks"]}
        assert validated["passed"] and checks["resume_state"]["passed"]
        assert checks["resume_state"]["detail"].startswith(f"{name} layout: complete")
        assert validated["layout"] == name
        out = reg.promote(f"{name}@step2", model=f"m-{name}")
        _assert_release_is_the_model(out, trained)
        assert reg.list_checkpoints(name)[0]["layout"] == name


def test_model_only_promotes_only_without_require_resumable(
    catalog_url, layouts, tmp_path, monkeypatch
):
    _policy(tmp_path, monkeypatch)
    trained = layouts["model-only"]
    with Registry() as reg:
        reg.push_checkpoint(trained.step_dir(2), run="last", step=2)
        shown = reg.show("last@step2")
        assert shown["layout"] == "torchtitan" and shown["resumable"] is False
        assert shown["missing_state"] == ["optimizer", "lr_scheduler", "train_state"]
        validated = reg.validate("last@step2", device="cpu")
        checks = {c["name"]: c for c in validated["checks"]}
        # reported, not counted: the gate decides under the policy in force
        assert validated["passed"] and not checks["resume_state"]["passed"]
        with pytest.raises(GateNotMet, match="not resumable .*missing optimizer"):
            reg.promote("last@step2", model="titan")
    _policy(tmp_path, monkeypatch, "require_resumable = false\n")
    with Registry() as reg:
        out = reg.promote("last@step2", model="titan")
        _assert_release_is_the_model(out, trained)


def test_policy_change_after_push_changes_show_validate_promote_alike(
    catalog_url, layouts, tmp_path, monkeypatch
):
    trained = layouts["stateful"]
    _policy(tmp_path, monkeypatch, '[resume]\nrequired = ["model", "optimizer", "grad_scaler"]\n')
    with Registry() as reg:
        pushed = reg.push_checkpoint(trained.step_dir(2), run="s", step=2)
        assert pushed["resumable"] is False and pushed["missing_state"] == ["grad_scaler"]
        assert reg.show("s@step2")["missing_state"] == ["grad_scaler"]
        assert reg.list_checkpoints("s")[0]["resumable"] is False
        validated = reg.validate("s@step2", device="cpu")
        detail = {c["name"]: c for c in validated["checks"]}["resume_state"]["detail"]
        assert "missing grad_scaler" in detail
        with pytest.raises(GateNotMet, match="missing grad_scaler"):
            reg.promote("s@step2", model="s")
    _policy(tmp_path, monkeypatch)  # the shipped rules again: the same push is resumable now
    with Registry() as reg:
        assert reg.show("s@step2")["resumable"] is True
        assert reg.list_checkpoints("s")[0]["resumable"] is True
        validated = reg.validate("s@step2", device="cpu")
        assert {c["name"]: c for c in validated["checks"]}["resume_state"]["passed"]
        _assert_release_is_the_model(reg.promote("s@step2", model="s"), trained)


def test_forced_layout_is_recorded_and_a_better_one_is_suggested(
    cli, layouts, tmp_path, monkeypatch, catalog_url
):
    _policy(tmp_path, monkeypatch)
    step_dir = layouts["stateful"].step_dir(2)
    pushed = cli("push-ckpt", step_dir, "--run", "t", "--step", "2", "--layout", "dcp", "--json")
    assert pushed.returncode == 0, pushed.stderr
    out = json.loads(pushed.stdout)
    # "app.optim" has an optimizer's shape, the rest under "app" is placed by no dcp entry
    unplaced = ["app.dataloader", "app.lr_scheduler", "app.model", "app.rng", "app.train_state"]
    assert out["layout"] == "dcp" and out["unclassified"] == unplaced
    assert out["suggestions"] == ["--layout stateful"]
    assert f"keys in no resume class: {', '.join(unplaced)}; try --layout stateful" in (
        pushed.stderr
    )
    manifest = Path(json.loads(cli("show", "t@step2", "--json").stdout)["uri"][7:], "MANIFEST.json")
    assert json.loads(manifest.read_text())["resume"]["layout"] == "dcp"
    refused = cli("promote", "t@step2", "--model", "t")
    assert refused.returncode == 1
    assert "not resumable (missing model, train_state)" in refused.stderr
    assert "Traceback" not in refused.stderr and len(refused.stderr.strip().splitlines()) <= 2
    validated = cli("validate", "t@step2", "--device", "cpu", "--layout", "stateful", "--json")
    assert validated.returncode == 0, validated.stderr
    assert json.loads(validated.stdout)["layout"] == "stateful"
    promoted = cli("promote", "t@step2", "--model", "t", "--layout", "stateful", "--json")
    assert promoted.returncode == 0, promoted.stderr
    _assert_release_is_the_model(json.loads(promoted.stdout), layouts["stateful"])
    bad = cli("push-ckpt", step_dir, "--run", "t", "--step", "3", "--layout", "zero3")
    assert bad.returncode == 2 and "unknown layout 'zero3'" in bad.stderr


def test_optimizer_state_in_the_model_set_is_refused_by_name(
    catalog_url, layouts, tmp_path, monkeypatch
):
    _policy(
        tmp_path,
        monkeypatch,
        'require_resumable = false\n[resume]\nmodel_key = "app"\n',
    )
    with Registry() as reg:
        reg.push_checkpoint(layouts["stateful"].step_dir(2), run="o", step=2, layout="dcp")
        with pytest.raises(GateNotMet, match=r"optimizer state \(\d+ keys, e\.g\. app\.optim\."):
            reg.promote("o@step2", model="o")


def test_a_checkpoint_without_recorded_keys_gets_them_from_its_proven_metadata(
    cli, layouts, tmp_path, monkeypatch
):
    """Pushed before the catalog kept key paths: `reg show` decides from its `.metadata`
    (proven against the catalog's digest) without writing; validate, promote and `reg catalog
    migrate` record them; a tampered `.metadata` is refused and named."""
    from sqlalchemy import text

    monkeypatch.setenv("REG_CATALOG_URL", f"sqlite:///{tmp_path / 'c.db'}")
    _policy(tmp_path, monkeypatch)
    with Registry() as reg:
        for run in ("a", "b", "c", "d"):
            reg.push_checkpoint(layouts["lightning"].step_dir(2), run=run, step=2)
        with reg.catalog.engine.begin() as conn:  # as a catalog from before migration 0010
            conn.execute(text("DROP TRIGGER checkpoint_keys_kept"))  # 0020's delete guard
            conn.execute(text("DELETE FROM checkpoint_keys"))

    def layouts_listed() -> list[str | None]:
        with Registry() as reg:
            return [r["layout"] for r in reg.list_checkpoints()]

    with Registry() as reg:
        listed = reg.list_checkpoints()
        assert [r["layout"] for r in listed] == [None] * 4  # push-time verdicts
        assert all(r["resumable"] for r in listed)
        shown = reg.show("a@step2")
        assert shown["layout"] == "lightning" and shown["resume_state"]["train_state"] == [
            "meta.pt:global_step",
            "meta.pt:loops.fit_loop",
        ]
        pulled = reg.pull("b@step2", tmp_path / "b")  # no store read, no write: push-time
        assert pulled["layout"] is None and "reg catalog migrate" in pulled["warnings"][0]
    assert layouts_listed() == [None] * 4  # reads write nothing
    with Registry() as reg:
        reg.validate("d@step2", device="cpu")
    assert layouts_listed() == [None, None, None, "lightning"]
    applied = cli("policy", "apply", _policy_file(tmp_path), "--json")
    assert json.loads(applied.stdout)["resume_undecided"] == 3
    metadata = Path(shown["uri"][7:]).parent.parent / "c" / "step-2" / ".metadata"
    metadata.chmod(0o644)
    metadata.write_bytes(metadata.read_bytes() + b"x")
    with Registry() as reg, pytest.raises(IntegrityError, match="does not match the catalog"):
        reg.show("c@step2")
    migrated = cli("catalog", "migrate", "--json")
    assert migrated.returncode == 0, migrated.stderr
    keys = json.loads(migrated.stdout)["key_paths"]
    assert keys["recorded"] == 2 and [f["ref"] for f in keys["failed"]] == ["c@step2"]
    assert "does not match the catalog" in keys["failed"][0]["error"]
    assert layouts_listed() == ["lightning", "lightning", None, "lightning"]


def test_tensors_in_no_class_are_refused_unless_left_out(
    catalog_url, layouts, tmp_path, monkeypatch
):
    """The stateful checkpoint read as dcp with the model at app.model: its per-rank RNG state
    (tensors under app.rng) is in no dcp class."""
    _policy(tmp_path, monkeypatch, 'require_resumable = false\n[resume]\nmodel_key = "app.model"\n')
    trained = layouts["stateful"]
    with Registry() as reg:
        reg.push_checkpoint(trained.step_dir(2), run="u", step=2, layout="dcp")
        assert "app.rng" in reg.show("u@step2")["unclassified"]
        with pytest.raises(GateNotMet, match=r"tensors are in no resume class, under .*app\.rng"):
            reg.promote("u@step2", model="u")
        out = reg.promote("u@step2", model="u", allow_unclassified=True)
        _assert_release_is_the_model(out, trained)
        # leaving tensors out is part of what makes two promotions the same: asked again
        # without it, the refusal stands rather than returning that release
        with pytest.raises(GateNotMet, match="in no resume class"):
            reg.promote("u@step2", model="u")
        again = reg.promote("u@step2", model="u", allow_unclassified=True)
        assert again["existing"] and again["release"] == out["release"]
        audited = [e for e in reg.audit_log() if e["action"] == "promote"][-1]
        assert audited["details"]["allow_unclassified"] is True
        assert audited["details"]["model_path"] == "app.model"
        assert audited["details"]["layout"] == "dcp" and "forced_layout" not in audited["details"]


def test_a_validation_names_count_only_for_the_same_model_path(
    catalog_url, layouts, tmp_path, monkeypatch
):
    _policy(tmp_path, monkeypatch, "require_resumable = false\n")
    with Registry() as reg:
        trained = layouts["stateful"]
        reg.push_checkpoint(trained.step_dir(2), run="v", step=2, metrics=trained.probe_metrics(2))
        first = reg.validate("v@step2", device="cpu", model_factory=FACTORY)
        assert first["passed"] and first["model_path"] == "app.model"
        same = reg.promote("v@step2", model="v1")
        assert same["validation"]["id"] == first["validation_id"]
        # another model path: the model check's names were another path's, so it runs again
        other = reg.promote("v@step2", model="v2", layout="torchtitan")
        assert other["validation"]["id"] != first["validation_id"]


def test_a_key_set_row_that_lies_about_its_keys_is_never_linked(catalog_url, layouts):
    from registry.catalog.models import KeySet
    from registry.formats.dcp_scan import scan_directory
    from registry.lifecycle.checkpoints.resume_facts import facts_of

    scanned = scan_directory(layouts["torchtitan"].step_dir(2))
    facts = facts_of(scanned.inventory, scanned.files, scanned.read)
    with Registry() as reg:
        with reg.catalog.session(write=True) as s:  # as whoever holds the catalog's credentials
            s.add(
                KeySet(
                    sha256=facts.sha256,
                    key_count=1,
                    keys=["w"],
                    sidecars=[],
                    heads=["w"],
                    optimizer_roots=[],
                )
            )
        with pytest.raises(IntegrityError, match="does not hold the key paths its sha256 names"):
            reg.push_checkpoint(layouts["torchtitan"].step_dir(2), run="p", step=2)
        assert reg.list_checkpoints() == []  # nothing committed
