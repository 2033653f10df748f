"""Signed releases (issue 37): `reg promote` signs every release in the OpenSSF model-signing
format with the registry's key, over every file of the folder (weights, release.json, the
provenance statement, the model card); the stock `model_signing` CLI verifies a pulled copy
with no reg code, and catches a changed byte, an added or a removed file and another key."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from registry import Registry
from registry.errors import GateNotMet, IntegrityError, UsageError

MODEL_SIGNING = str(Path(sys.executable).with_name("model_signing"))


def _stock_verify(folder: Path, public_key: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            MODEL_SIGNING,
            "verify",
            "key",
            str(folder),
            "--signature",
            str(folder / "model.sig"),
            "--public_key",
            str(public_key),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )


def _promoted(reg: Registry, ckpts, step: int = 4, model: str = "tiny") -> dict:
    reg.push_checkpoint(
        ckpts.ws2.step_dir(step), run="r", step=step, metrics=ckpts.ws2.probe_metrics(step)
    )
    return reg.promote(f"r@step{step}", model=model)


def _pem(tmp_path: Path, reg: Registry, key_id: str) -> Path:
    path = tmp_path / f"{key_id[:8]}.pub"
    path.write_text(next(k.public_pem for k in reg.signing_keys() if k.key_id == key_id))
    return path


def test_a_pulled_release_verifies_with_the_stock_cli_and_tampering_fails_it(
    cpu_policy, ckpts, tmp_path
):
    with Registry() as reg:
        key = reg.create_signing_key()
        assert key.state == "active" and len(key.key_id) == 64
        _promoted(reg, ckpts)
        manifest_sha256 = reg.show("r@step4")["manifest_sha256"]
        dest = tmp_path / "release"
        pulled = reg.pull_release("tiny:v1", dest)
        pem = _pem(tmp_path, reg, key.key_id)
    names = sorted(p.name for p in dest.iterdir())
    assert names == [
        "README.md",
        "model.safetensors",
        "model.sig",
        "provenance.intoto.json",
        "release.json",
    ], names
    listed = {f["path"] for f in json.loads((dest / "release.json").read_text())["files"]}
    assert listed == {"README.md", "model.safetensors", "provenance.intoto.json"}
    assert "model.sig" in {f["path"] for f in pulled.files}
    ok = _stock_verify(dest, pem)
    assert ok.returncode == 0, ok.stderr + ok.stdout
    # The provenance names the source, its manifest digest and the validation.
    doc = json.loads((dest / "provenance.intoto.json").read_text())
    build = doc["predicate"]["buildDefinition"]
    assert build["externalParameters"]["source"] == "default/r@step4"
    assert build["resolvedDependencies"][0]["digest"]["sha256"] == manifest_sha256
    assert doc["subject"] == [
        {"name": "model.safetensors", "digest": {"sha256": _sha(dest / "model.safetensors")}}
    ]
    validation = doc["predicate"]["runDetails"]["byproducts"][0]["annotations"]
    assert validation["device"] == "cpu" and validation["passed"] is True
    # One changed byte, an added file, a removed file, another key: each fails it.
    weights = dest / "model.safetensors"
    original = weights.read_bytes()
    weights.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
    assert _stock_verify(dest, pem).returncode != 0
    weights.write_bytes(original)
    (dest / "extra.txt").write_text("not signed")
    assert _stock_verify(dest, pem).returncode != 0
    (dest / "extra.txt").unlink()
    card = (dest / "README.md").read_bytes()
    (dest / "README.md").unlink()
    assert _stock_verify(dest, pem).returncode != 0
    (dest / "README.md").write_bytes(card)
    assert _stock_verify(dest, pem).returncode == 0
    other = tmp_path / "other.pub"
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    other.write_bytes(
        ec.generate_private_key(ec.SECP256R1())
        .public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    assert _stock_verify(dest, other).returncode != 0


def _sha(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_keys_are_private_files_and_one_is_active(cpu_policy, ckpts, tmp_path):
    home = Path(os.environ["REG_HOME"])
    with Registry() as reg:
        first = reg.create_signing_key()
        with pytest.raises(UsageError, match="is active already"):
            reg.create_signing_key()
        private = home / "signing" / f"{first.key_id}.pem"
        assert stat.S_IMODE(private.stat().st_mode) == 0o600
        assert stat.S_IMODE(private.parent.stat().st_mode) == 0o700
        second = reg.create_signing_key(rotate=True)
        states = {k.key_id: k.state for k in reg.signing_keys()}
        assert states == {first.key_id: "retired", second.key_id: "active"}
        private.chmod(0o644)
        os.replace(private, home / "signing" / f"{second.key_id}.pem")  # a readable key file
        with pytest.raises(IntegrityError, match="not a private file"):
            _promoted(reg, ckpts)
