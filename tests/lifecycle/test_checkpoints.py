"""The checkpoint lifecycle on SQLite and PostgreSQL: push, ls, show, pull, verify, pin."""

from __future__ import annotations

import filecmp
import hashlib
import json
from pathlib import Path

import pytest

from registry.errors import Conflict, InvalidCheckpoint, NotFound, UsageError
from tests.helpers import flip_byte


def _same_tree(a: Path, b: Path) -> bool:
    names_a = sorted(p.relative_to(a) for p in a.rglob("*"))
    names_b = sorted(p.relative_to(b) for p in b.rglob("*"))
    return names_a == names_b and all(
        filecmp.cmp(a / n, b / n, shallow=False) for n in names_a if (a / n).is_file()
    )


def test_push_records_every_fact_a_resume_needs(reg, ckpts):
    notes: list[str] = []
    out = reg.push_checkpoint(
        ckpts.ws2.step_dir(4), run="run42", step=4, metrics={"val_loss": 2.5}, notes=notes
    )
    assert out["ref"] == "run42@step4" and out["state"] == "committed"
    assert out["world_size"] == 2 and "inferred" in notes[0]
    assert out["resumable"] is True and out["missing_state"] == []
    src = ckpts.ws2.step_dir(4)
    assert {f["path"] for f in out["files"]} == {p.name for p in src.iterdir()}
    assert out["bytes"] == sum(p.stat().st_size for p in src.iterdir())
    shown = reg.show("run42@step4")
    assert shown["tensor_count"] > 40 and shown["tensor_bytes"] > 0
    assert shown["metrics"] == {"val_loss": 2.5}
    assert set(shown["resume_state"]) == {
        "model",
        "optimizer",
        "lr_scheduler",
        "train_state",
        "rng",
        "dataloader",
    }
    assert {f["rank"] for f in shown["files"]} == {None, 0, 1}
    manifest = json.loads(Path(shown["uri"].removeprefix("file://"), "MANIFEST.json").read_text())
    assert manifest["format"] == "reg.manifest/3"
    assert {f["sha256"] for f in manifest["files"]} == {f["sha256"] for f in out["files"]}


def test_explicit_world_size_and_projects(reg, ckpts):
    out = reg.push_checkpoint(
        ckpts.ws3.step_dir(3), run="r", step=3, project="team-a", world_size=3
    )
    assert out["ref"] == "team-a/r@step3" and out["world_size"] == 3
    assert reg.show("team-a/r@step3")["world_size_inferred"] is False
    with pytest.raises(UsageError, match="smaller than the 3 ranks"):
        reg.push_checkpoint(ckpts.ws3.step_dir(3), run="r", step=4, world_size=2)
    assert [c["ref"] for c in reg.list_checkpoints(project="team-a")] == ["team-a/r@step3"]
    assert reg.list_checkpoints(project="default") == []


def test_ls_latest_and_not_found_says_what_exists(reg, ckpts):
    reg.push_checkpoint(ckpts.ws2.step_dir(2), run="run42", step=2)
    reg.push_checkpoint(ckpts.ws2.step_dir(4), run="run42", step=4)
    assert [c["step"] for c in reg.list_checkpoints("run42")] == [2, 4]
    assert reg.show("run42@latest")["step"] == 4
    with pytest.raises(NotFound, match="run42 has steps 2, 4"):
        reg.show("run42@step3")
    with pytest.raises(NotFound, match="run nope not found"):
        reg.show("nope@latest")


def test_pull_is_byte_identical_and_atomic(reg, ckpts, tmp_path):
    reg.push_checkpoint(ckpts.ws2.step_dir(4), run="r", step=4)
    out = reg.pull("r@latest", tmp_path / "restore")
    assert out["step"] == 4 and out["kept"] == "MANIFEST.json"
    # The checkpoint's files, and beside them the MANIFEST.json the store holds (exactly)
    kept = (tmp_path / "restore" / "MANIFEST.json").read_bytes()
    assert hashlib.sha256(kept).hexdigest() == out["manifest_sha256"]
    (tmp_path / "restore" / "MANIFEST.json").unlink()
    assert _same_tree(ckpts.ws2.step_dir(4), tmp_path / "restore")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("keep me")
    with pytest.raises(UsageError, match="not an empty directory"):
        reg.pull("r@step4", tmp_path / "busy")
    assert (tmp_path / "busy" / "x").read_text() == "keep me"
    (tmp_path / "empty").mkdir()
    reg.pull("r@step4", tmp_path / "empty")
    (tmp_path / "empty" / "MANIFEST.json").unlink()
    assert _same_tree(ckpts.ws2.step_dir(4), tmp_path / "empty")


def test_identical_repush_copies_nothing_and_different_content_conflicts(reg, ckpts, tmp_path):
    reg.push_checkpoint(ckpts.ws2.step_dir(4), run="r", step=4)
    again = reg.push_checkpoint(ckpts.ws2.step_dir(4), run="r", step=4)
    assert again["unchanged"] is True
    with pytest.raises(Conflict, match="already committed with different content") as info:
        reg.push_checkpoint(ckpts.ws2.step_dir(2), run="r", step=4)
    assert info.value.exit_code == 5
    # Same names and sizes, one flipped byte: still a conflict (digests are compared).
    tampered = ckpts.ws2.copy_step(4, tmp_path / "t")
    flip_byte(tampered / "__1_0.distcp")
    with pytest.raises(Conflict):
        reg.push_checkpoint(tampered, run="r", step=4)
    assert reg.verify("r@step4")["ok"]


def test_bad_directories_leave_nothing_behind(reg, ckpts, tmp_path):
    d = ckpts.ws2.copy_step(4, tmp_path / "d")
    (d / "__1_0.distcp").unlink()
    with pytest.raises(InvalidCheckpoint):
        reg.push_checkpoint(d, run="r", step=4)
    assert reg.list_checkpoints() == []
    assert not (reg.settings.home / "store" / "ckpt").exists()


def test_pin_and_unpin(reg, ckpts):
    reg.push_checkpoint(ckpts.ws2.step_dir(2), run="r", step=2)
    reg.push_checkpoint(ckpts.ws2.step_dir(4), run="r", step=4)
    assert reg.pin("r@step2", reason="paper baseline")["pinned"] is True
    shown = reg.show("r@step2")
    assert shown["protection"]["reason"] == "kept: pinned by tester (paper baseline)"
    assert shown["protection"]["protected"] is True
    reg.unpin("r@step2")
    assert reg.show("r@step2")["protection"]["protected"] is False
    actions = [e["action"] for e in reg.audit_log()]
    assert actions == ["push", "push", "pin", "unpin"]


@pytest.mark.parametrize("name", ["sub/MANIFEST.json", "release.json", "a/b/release.json"])
def test_push_refuses_the_registrys_own_document_names(reg, ckpts, tmp_path, name):
    d = ckpts.ws2.copy_step(4, tmp_path / "d")
    (d / name).parent.mkdir(parents=True, exist_ok=True)
    (d / name).write_text("{}")
    with pytest.raises(InvalidCheckpoint, match=f"contains {name}, a name the registry reserves"):
        reg.push_checkpoint(d, run="r", step=4)
    assert reg.list_checkpoints() == []


def test_push_refuses_a_world_size_the_catalog_cannot_hold(reg, ckpts):
    with pytest.raises(UsageError, match="--world-size 2147483648 is too large"):
        reg.push_checkpoint(ckpts.ws2.step_dir(4), run="r", step=4, world_size=2**31)
    assert reg.list_checkpoints() == []
