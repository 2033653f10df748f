"""MANIFEST.json and release.json read strictly: every key known, every value in shape, each
problem one line naming the document and the key."""

from __future__ import annotations

import json

import pytest

from registry.core.layout import (
    checkpoint_prefix,
    manifest_key,
    parse_checkpoint_key,
    parse_release_key,
    release_document_key,
    release_prefix,
)
from registry.core.refs import CheckpointRef
from registry.errors import InvalidDocument
from registry.formats.documents import (
    FileRecord,
    Manifest,
    ReleaseDocument,
    ResumeRecord,
    SourceRecord,
    TensorSummary,
    ValidationRecord,
)

SHA = "ab" * 32
RESUME = ResumeRecord({"model": ["model"]}, ["rng"], False, [], "dcp", ("model.w",), ("meta.pt",))
PRE_3 = ResumeRecord({"model": ["model"]}, ["rng"], False, [])  # formats 1 and 2: no key paths


def _manifest(**changes: object) -> Manifest:
    fields: dict[str, object] = dict(
        project="team-a",
        run="r",
        step=9000,
        world_size=2,
        world_size_inferred=False,
        files=(FileRecord(".metadata", 10, SHA), FileRecord("__0_0.distcp", 20, SHA, 0)),
        tensors=TensorSummary(3, 120, 1),
        resume=RESUME,
        metrics={"val_loss": 2.5},
        pushed_by="alice",
        created_at="2026-11-30T10:00:00Z",
    )
    fields.update(changes)
    return Manifest(**fields)  # type: ignore[arg-type]


def _edited(manifest: Manifest, edit) -> bytes:  # type: ignore[no-untyped-def]
    doc = json.loads(manifest.to_bytes())
    edit(doc)
    return json.dumps(doc).encode()


def test_manifest_round_trip_and_shape():
    m = _manifest()
    data = m.to_bytes()
    assert Manifest.from_bytes(data, "m") == m
    doc = json.loads(data)
    assert doc["format"] == "reg.manifest/3" and doc["bytes"] == 30
    assert doc["resume"]["layout"] == "dcp" and doc["resume"]["keys"] == ["model.w"]
    assert doc["files"][1] == {
        "path": "__0_0.distcp",
        "size": 20,
        "sha256": SHA,
        "rank": 0,
        "version": None,
    }


def test_versions_round_trip_and_format_1_still_reads():
    versioned = _manifest(
        files=(FileRecord(".metadata", 10, SHA, None, "v-1"), FileRecord("a", 20, SHA, 0, "v-2"))
    )
    assert Manifest.from_bytes(versioned.to_bytes(), "m") == versioned
    # A manifest written before versions were recorded: format 1, no `version` keys.
    old = json.loads(_manifest(resume=PRE_3).to_bytes())
    old["format"] = "reg.manifest/1"
    for f in old["files"]:
        del f["version"]
    assert Manifest.from_bytes(json.dumps(old).encode(), "m") == _manifest(resume=PRE_3)
    # Format 2: versions, no key paths; and key paths in format 2 are refused.
    two = json.loads(_manifest(resume=PRE_3).to_bytes())
    two["format"] = "reg.manifest/2"
    assert Manifest.from_bytes(json.dumps(two).encode(), "m") == _manifest(resume=PRE_3)
    two["resume"]["layout"] = "dcp"
    with pytest.raises(InvalidDocument, match=r"resume\.layout is not a known key"):
        Manifest.from_bytes(json.dumps(two).encode(), "m")
    # ... and format 1 with a `version` key, or format 2 without one, is refused.
    old["files"][0]["version"] = "v"
    with pytest.raises(InvalidDocument, match=r"files\[0\]\.version is not a known key"):
        Manifest.from_bytes(json.dumps(old).encode(), "m")
    new = json.loads(_manifest().to_bytes())
    del new["files"][0]["version"]
    with pytest.raises(InvalidDocument, match=r"files\[0\]\.version is missing"):
        Manifest.from_bytes(json.dumps(new).encode(), "m")
    release = json.loads(_release().to_bytes())
    release["format"] = "reg.release/1"
    for f in release["files"]:
        del f["version"]
    assert ReleaseDocument.from_bytes(json.dumps(release).encode(), "d") == _release()


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d.update(extra=1), "m: extra is not a known key"),
        (lambda d: d.pop("world_size"), "m: world_size is missing"),
        (lambda d: d.update(format="reg.manifest/9"), "format is 'reg.manifest/9'; this reg reads"),
        (lambda d: d.update(step=-1), "step is -1, below 0"),
        (lambda d: d.update(step="9000"), "step is '9000', not a whole number"),
        (lambda d: d.update(step=True), "step is True, not a whole number"),
        (lambda d: d.update(project="../b"), "project is not a valid name"),
        (lambda d: d["files"][0].update(sha256="AB" * 32), "files[0].sha256 is 'ABAB"),
        (lambda d: d["files"][0].update(size=-5), "files[0].size is -5, below 0"),
        (lambda d: d["files"][0].update(path="../../etc/passwd"), "not a safe relative path"),
        (lambda d: d["files"][0].update(path="/abs"), "not a safe relative path"),
        (lambda d: d["files"][1].update(path=".metadata"), "files[1].path repeats .metadata"),
        (lambda d: d["files"][0].update(owner="x"), "files[0].owner is not a known key"),
        (lambda d: d.update(bytes=31), "bytes is not the sum of the file sizes"),
        (lambda d: d["metrics"].update(val_loss="NaN"), "metrics.val_loss is 'NaN', not a number"),
        (lambda d: d["resume"].update(resumable="yes"), "resume.resumable is 'yes'"),
        (lambda d: d["resume"].update(layout="zero3"), "resume.layout is 'zero3', not one"),
        (lambda d: d["resume"].update(keys=["b", "a"]), "resume.keys is not sorted"),
        (lambda d: d["resume"].update(keys=["a", "a"]), "resume.keys is not sorted"),
        (lambda d: d["resume"].update(keys=[1]), "resume.keys is not a list of strings"),
        (lambda d: d["resume"].pop("sidecars"), "resume.sidecars is missing"),
        (lambda d: d.update(created_at="yesterday"), "created_at is 'yesterday', not an ISO"),
    ],
)
def test_manifest_refusals_name_the_key(edit, message):
    with pytest.raises(InvalidDocument) as info:
        Manifest.from_bytes(_edited(_manifest(), edit), "m")
    assert message in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("data", [b"", b"not json", b"[1, 2]", b'{"format": 1}', b"\xff\xfe"])
def test_garbage_is_one_line(data):
    with pytest.raises(InvalidDocument, match=r"^m: "):
        Manifest.from_bytes(data, "m")


def _release(**changes: object) -> ReleaseDocument:
    fields: dict[str, object] = dict(
        model="tiny",
        version=3,
        files=(FileRecord("model.safetensors", 100, SHA),),
        source=SourceRecord(CheckpointRef("default", "r", 4), SHA, 2),
        validation=ValidationRecord(7, True, "cuda", "NVIDIA H200", "2.13.0", 1.5),
        dtype=None,
        tied={"lm_head.weight": "embed.weight"},
        created_at="2026-11-30T10:00:00Z",
        created_by="bob",
    )
    fields.update(changes)
    return ReleaseDocument(**fields)  # type: ignore[arg-type]


def test_release_round_trip_and_refusals():
    doc = _release()
    assert ReleaseDocument.from_bytes(doc.to_bytes(), "d") == doc
    assert json.loads(doc.to_bytes())["release"] == "tiny:v3"
    cases = [
        (lambda d: d.update(release="tiny:v4"), "release says 'tiny:v4', model and version say"),
        (lambda d: d["source"].update(ref="r@latest"), "source.ref is 'r@latest', which names no"),
        (lambda d: d["source"].update(ref="tiny:v1"), "source.ref is not a checkpoint ref"),
        (lambda d: d["validation"].pop("device"), "validation.device is missing"),
        (lambda d: d.update(tied=["a"]), "tied is not an object of strings"),
        (lambda d: d.update(version=0), "version is 0, below 1"),
    ]
    for edit, message in cases:
        data = json.loads(doc.to_bytes())
        edit(data)
        with pytest.raises(InvalidDocument, match="^d: ") as info:
            ReleaseDocument.from_bytes(json.dumps(data).encode(), "d")
        assert message in str(info.value)


def test_layout_and_its_inverses():
    assert checkpoint_prefix("p", "r", 7) == "ckpt/p/r/step-7/"
    assert manifest_key("p", "r", 7) == "ckpt/p/r/step-7/MANIFEST.json"
    assert release_prefix("m", 2) == "release/m/v2/"
    assert release_document_key("m", 2) == "release/m/v2/release.json"
    assert parse_checkpoint_key("ckpt/p/r/step-7/sub/x") == ("p", "r", 7, "sub/x")
    assert parse_release_key("release/m/v2/model.safetensors") == ("m", 2, "model.safetensors")
    for junk in (
        "ckpt/p/r/step-07/x",
        "ckpt/p/r/7/x",
        "ckpt/p/../step-1/x",
        "ckpt/a..b/r/step-1/x",
        "release/m/v0/x",
        "ckpt/p/r/step-1",
    ):
        assert parse_checkpoint_key(junk) is None and parse_release_key(junk) is None


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d.update(pushed_by="\ud800"), "pushed_by is not valid UTF-8 text"),
        (lambda d: d.update(step=10**18), "step is 1000000000000000000, too large"),
        (lambda d: d.update(world_size=10**30), "too large"),
        (lambda d: d["files"][0].update(size=10**19), "files[0].size is 10000000000000000000"),
        (lambda d: d["files"][0].update(path="MANIFEST.json"), "is MANIFEST.json, the document"),
        (lambda d: d.update(created_at="2026-11-30T10:00:00"), "a time without its zone"),
        (lambda d: d["resume"]["classes"].update({"\udcff": []}), "not valid UTF-8 text"),
    ],
)
def test_values_the_catalog_cannot_hold_are_refused(edit, message):
    doc = json.loads(_manifest().to_bytes())
    edit(doc)
    data = json.dumps(doc).encode()  # json escapes lone surrogates as \\udXXX
    with pytest.raises(InvalidDocument) as info:
        Manifest.from_bytes(data, "m")
    assert message in str(info.value)


def test_deep_nesting_is_a_document_error():
    data = b'{"format": "reg.manifest/1", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with pytest.raises(InvalidDocument, match="nested too deeply"):
        Manifest.from_bytes(data, "m")


def test_release_numbers_are_finite():
    data = json.loads(_release().to_bytes())
    data["validation"]["seconds"] = float("nan")
    with pytest.raises(InvalidDocument, match="validation.seconds is nan, not a finite number"):
        ReleaseDocument.from_bytes(json.dumps(data).encode(), "d")
