"""Typed results (`registry.api.results`): every `Registry` method returns a frozen dataclass whose
`to_json()` is exactly the JSON `--json` prints and `reg server` answers, embedded and remote."""

from __future__ import annotations

import dataclasses
import inspect
import json

import pytest

from registry import Registry, Settings
from registry.api.results import (
    BY_NAME,
    CheckpointDetails,
    CheckpointPushed,
    CheckpointSummary,
    GcReport,
    ReleaseDetails,
    Result,
    read,
)
from registry.errors import RegistryError

SUMMARY = {
    "ref": "p/r@step3",
    "project": "p",
    "run": "r",
    "step": 3,
    "world_size": 2,
    "state": "committed",
    "bytes": 10,
    "files": [{"path": "__0_0.distcp", "size": 10, "sha256": "ab"}],
    "layout": "dcp",
    "resumable": True,
    "missing_state": [],
    "pinned": False,
    "created_at": "2026-12-02T00:00:00Z",
    "upload_seconds": None,
}


def test_every_method_of_the_contract_returns_a_typed_result():
    untyped = []
    for name, member in vars(Registry).items():
        if name.startswith("_") or not inspect.isfunction(member) or name == "close":
            continue
        annotation = str(inspect.signature(member).return_annotation)
        names = annotation.removeprefix("list[").removesuffix("]").split(" | ")
        if name != "export_policy" and not all(n in BY_NAME for n in names):
            untyped.append(f"{name} -> {annotation}")
    assert untyped == []


def test_the_json_comes_back_exactly_with_a_key_this_version_does_not_know():
    doc = {**SUMMARY, "from_a_newer_server": {"x": 1}}
    result = CheckpointSummary.from_json(doc)
    assert result.ref == "p/r@step3" and result.step == 3 and result.upload_seconds is None
    assert result.to_json() == doc and list(result.to_json()) == list(doc)
    assert json.loads(json.dumps(result.to_json())) == doc


def test_a_result_is_frozen_and_reads_as_the_mapping_it_was_for_one_release():
    result = CheckpointSummary.from_json(SUMMARY)
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.ref = "other"  # type: ignore[misc]
    with pytest.raises(TypeError):
        result["ref"] = "other"  # type: ignore[index]
    assert result["ref"] == result.ref and dict(result) == SUMMARY and result == SUMMARY
    assert result.get("absent") is None and "pinned" in result and len(result) == len(SUMMARY)
    with pytest.raises(KeyError):
        result["absent"]


def test_a_result_made_directly_has_the_json_of_its_fields():
    made = CheckpointPushed(**{**SUMMARY, "unchanged": True}, reused_files=2)
    assert made.to_json() == {**SUMMARY, "unchanged": True, "reused_files": 2}
    assert CheckpointPushed.from_json(made.to_json()) == made


def test_an_optional_key_absent_stays_absent():
    pushed = CheckpointPushed.from_json({**SUMMARY, "unchanged": False})
    assert pushed.reused_files is None and "reused_files" not in pushed.to_json()


def test_an_answer_without_a_key_the_type_needs_is_one_line():
    with pytest.raises(RegistryError, match="a GcReport without decisions"):
        GcReport.from_json({"applied": True, "freed_bytes": 0, "errors": [], "orphans": []})
    with pytest.raises(RegistryError, match="expected a JSON object"):
        GcReport.from_json(["not", "an", "object"])  # type: ignore[arg-type]


def test_show_is_read_as_a_checkpoint_or_a_release_by_its_keys():
    checkpoint = {**SUMMARY, "uri": "file:///x", "tensor_count": 4}
    assert type(read("CheckpointDetails | ReleaseDetails", checkpoint)) is CheckpointDetails
    release = {
        "release": "m:v1",
        "model": "m",
        "version": 1,
        "sha256": "ab",
        "files": [],
        "source": "p/r@step3",
        "aliases": ["prod"],
        "status": "active",
        "status_reason": None,
        "bytes": 1,
        "tensor_count": 1,
        "dtype": None,
        "tied": [],
        "created_at": "t",
        "created_by": "me",
        "validation": None,
        "uri": "file:///m",
    }
    shown = read("CheckpointDetails | ReleaseDetails", release)
    assert type(shown) is ReleaseDetails and shown.aliases == ["prod"]
    with pytest.raises(RegistryError, match="none of"):
        read("CheckpointDetails | ReleaseDetails", {"neither": True})


def test_embedded_results_are_typed_and_print_as_before(reg, ckpts, cli):
    pushed = reg.push_checkpoint(ckpts.ws2.step_dir(2), run="typed", step=2)
    assert isinstance(pushed, CheckpointPushed) and pushed.ref == "typed@step2"
    listed = reg.list_checkpoints("typed")
    assert [type(c) for c in listed] == [CheckpointSummary] and listed[0].step == 2
    shown = reg.show("typed@step2")
    assert isinstance(shown, CheckpointDetails) and shown.world_size == 2
    res = cli("ls", "typed", "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout) == [c.to_json() for c in reg.list_checkpoints("typed")]
    report = reg.gc(dry_run=True)
    assert isinstance(report, GcReport) and report.applied is False


def test_remote_results_are_the_same_types_with_the_same_json(reg_server, ckpts):
    settings = Settings.from_env(reg_server.client_env("admin"))
    with Registry(settings) as remote:
        pushed = remote.push_checkpoint(ckpts.ws2.step_dir(2), run="typed", step=2)
        assert isinstance(pushed, CheckpointPushed) and pushed.ref == "typed@step2"
        listed = remote.list_checkpoints("typed")
        assert [type(c) for c in listed] == [CheckpointSummary]
        shown = remote.show(pushed.ref)
        assert isinstance(shown, CheckpointDetails)
        assert {f["path"] for f in shown.files} == {f["path"] for f in pushed.files}
        raw = remote.client.call("GET", "/checkpoints", params={"run": "typed"})
        assert raw == [c.to_json() for c in listed]
        assert isinstance(remote.gc(dry_run=True), GcReport)


def test_every_result_type_is_a_keyword_only_frozen_dataclass():
    for name, kind in BY_NAME.items():
        assert issubclass(kind, Result) and dataclasses.is_dataclass(kind), name
        params = dataclasses.fields(kind)
        assert all(f.kw_only for f in params), name
        assert kind.__dataclass_params__.frozen, name  # type: ignore[attr-defined]
