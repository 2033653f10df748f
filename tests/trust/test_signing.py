"""Signed releases: `reg promote` signs every release in the OpenSSF model-signing
format with the registry's key, over every file of the folder (weights, release.json, the
provenance statement, the model card); the stock `model_signing` CLI verifies a pulled copy
with no reg code, and catches a changed byte, an added or a removed file and another key."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from registry import Registry
from registry.errors import GateNotMet, IntegrityError, UsageError
from tests.helpers import lose_catalog, stock_verify


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
    ok = stock_verify(dest, pem)
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
    assert stock_verify(dest, pem).returncode != 0
    weights.write_bytes(original)
    (dest / "extra.txt").write_text("not signed")
    assert stock_verify(dest, pem).returncode != 0
    (dest / "extra.txt").unlink()
    card = (dest / "README.md").read_bytes()
    (dest / "README.md").unlink()
    assert stock_verify(dest, pem).returncode != 0
    (dest / "README.md").write_bytes(card)
    assert stock_verify(dest, pem).returncode == 0
    other = tmp_path / "other.pub"
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    other.write_bytes(
        ec.generate_private_key(ec.SECP256R1())
        .public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    assert stock_verify(dest, other).returncode != 0


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
        stray = home / "signing" / f"{second.key_id}.pem"
        private.chmod(0o644)
        os.replace(private, stray)  # a readable key file, and another key's
        with pytest.raises(IntegrityError, match="not a private file"):
            _promoted(reg, ckpts)
        stray.chmod(0o600)
        with pytest.raises(IntegrityError, match="holds another key"):
            reg.promote("r@step4", model="tiny")
        (tmp_path / "model.sig").write_text("{}")
        with pytest.raises(UsageError, match="taken or reserved"):
            reg.promote("r@step4", model="tiny", extras=[tmp_path / "model.sig"])
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    from registry.trust.release_signing.bundle import read_public_key

    k1 = tmp_path / "k1.pub"
    k1.write_bytes(
        ec.generate_private_key(ec.SECP256K1())
        .public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    for bad in (k1, tmp_path):  # another curve; a directory
        with pytest.raises(IntegrityError, match="ECDSA key on|not a PEM public key"):
            read_public_key(bad)


def test_verify_provenance_and_the_keys_life(cpu_policy, ckpts, tmp_path):
    """`reg verify --provenance` checks signature and statement against the catalog; a
    rotated key's releases still verify, a revoked key's are reported; `pull-release
    --verify-signature` refuses, leaving nothing, an unsigned release or another key."""
    with Registry() as reg:
        unsigned = _promoted(reg, ckpts, step=2, model="plain")  # before any key: unsigned
        assert unsigned["signature"] is None
        first = reg.create_signing_key()
        _promoted(reg, ckpts, step=4)
        shown = reg.show("tiny:v1")
        assert shown["signature"]["key_id"] == first.key_id
        assert shown["signature"]["key_state"] == "active"
        report = reg.verify("tiny:v1", provenance=True)
        assert report.ok and report.signature["ok"], report.problems
        assert reg.fsck()["clean"]  # the signature files are the release's own
        bad = reg.verify("plain:v1", provenance=True)
        assert not bad.ok and bad.problems[-1]["problem"] == "the release is not signed"
        pem = _pem(tmp_path, reg, first.key_id)
        pinned = pem.read_text()
        got = reg.pull_release("tiny:v1", tmp_path / "ok", public_key=pinned)
        assert (Path(got.dest) / "model.sig").exists()
        with pytest.raises(IntegrityError, match="is not signed"):
            reg.pull_release("plain:v1", tmp_path / "refused", public_key=pinned)
        assert not (tmp_path / "refused").exists()
        second = reg.create_signing_key(rotate=True)
        assert reg.verify("tiny:v1", provenance=True).signature["key_state"] == "retired"
        assert reg.verify("tiny:v1", provenance=True).ok
        reg.promote("r@step4", model="tiny", dtype="bf16")  # tiny:v2, by the new key
        assert reg.show("tiny:v2")["signature"]["key_id"] == second.key_id
        (tmp_path / "empty").mkdir()
        with pytest.raises(IntegrityError, match="not a valid signature by this key"):
            reg.pull_release("tiny:v2", tmp_path / "empty", public_key=pinned)
        assert list((tmp_path / "empty").iterdir()) == []  # emptied again
        reg.change_signing_key(first.key_id[:12], "revoked", "leaked")
        revoked = reg.verify("tiny:v1", provenance=True)
        assert not revoked.ok and "revoked: leaked" in revoked.problems[0]["problem"]
        assert reg.verify("tiny:v2", provenance=True).ok


def test_a_forged_provenance_or_signature_in_the_store_is_caught(cpu_policy, ckpts, tmp_path):
    """Whoever can write the store but holds no key: a provenance naming another device, or
    a signature file swapped for another release's, fails `reg verify --provenance` (and
    the pulled folder fails the stock CLI)."""
    with Registry() as reg:
        key = reg.create_signing_key()
        _promoted(reg, ckpts, step=4)
        _promoted(reg, ckpts, step=2, model="other")
        store = Path(os.environ["REG_HOME"]) / "store" / "release"
        statement = store / "tiny" / "v1" / "provenance.intoto.json"
        doc = json.loads(statement.read_text())
        doc["predicate"]["runDetails"]["byproducts"][0]["annotations"]["device"] = "cuda"
        statement.chmod(0o640)
        statement.write_text(json.dumps(doc))
        forged = reg.verify("tiny:v1", provenance=True)
        assert not forged.ok
        assert {p["path"] for p in forged.problems} >= {"provenance.intoto.json"}
        signature = store / "tiny" / "v1" / "model.sig"
        signature.chmod(0o640)
        signature.write_bytes((store / "other" / "v1" / "model.sig").read_bytes())
        swapped = reg.verify("tiny:v1", provenance=True)
        assert any(p["path"] == "model.sig" for p in swapped.problems), swapped.problems
        pem = _pem(tmp_path, reg, key.key_id)
        dest = tmp_path / "pulled"
        dest.mkdir()
        for f in ("model.safetensors", "README.md", "release.json"):
            (dest / f).write_bytes((store / "tiny" / "v1" / f).read_bytes())
        (dest / "provenance.intoto.json").write_text(json.dumps(doc))
        (dest / "model.sig").write_bytes((store / "tiny" / "v1" / "model.sig").read_bytes())
    assert stock_verify(dest, pem).returncode != 0


def test_behind_reg_server_every_release_is_signed(reg_server, ckpts, cpu_policy, tmp_path):
    """`reg server init` creates the signing key; `require_signature = "auto"`: through the
    server a promotion without an active key is refused before any work; with a key (created
    by an operator on the server's host) it is signed, and the consumer pins the key the
    server publishes."""
    from registry.core.config import Settings

    def operator() -> Registry:  # on the server's host, with its settings
        return Registry(Settings.from_env(reg_server.env), user="admin")

    with Registry() as remote:  # a client of the server (the admin's token)
        [initial] = [k for k in remote.signing_keys() if k.state == "active"]  # server init's
        remote.push_checkpoint(
            ckpts.ws2.step_dir(4), run="r", step=4, metrics=ckpts.ws2.probe_metrics(4)
        )
        with operator() as op:
            op.change_signing_key(initial.key_id, "retired", "test: none active")
        with pytest.raises(GateNotMet, match="no active signing key"):
            remote.promote("r@step4", model="tiny")
        with operator() as op:
            key = op.create_signing_key()
        assert (reg_server.home / "signing" / f"{key.key_id}.pem").exists()
        out = remote.promote("r@step4", model="tiny")
        assert out["signature"]["key_id"] == key.key_id
        pinned = {k.key_id: k.public_pem for k in remote.signing_keys()}[key.key_id]
        pulled = remote.pull_release("tiny:v1", tmp_path / "pulled", public_key=pinned)
        assert remote.verify("tiny:v1", provenance=True).ok
        # A key written into the catalog around the server (no MAC) is no key there.
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from sqlalchemy import text

        from registry.trust.release_signing.keys import key_id_of

        forged = (
            ec.generate_private_key(ec.SECP256R1())
            .public_key()
            .public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            )
        )
        with operator() as op, op.catalog.engine.begin() as c:  # type: ignore[attr-defined]
            c.execute(
                text(
                    "INSERT INTO signing_key_event (key_id, event, public_pem, at, by) "
                    "VALUES (:k, 'created', :p, 0, 'mallory')"
                ),
                {"k": key_id_of(forged), "p": forged.decode()},
            )
        assert key_id_of(forged) not in {k.key_id for k in remote.signing_keys()}
        with operator() as op:  # on the host, holding the audit key: not listed either
            assert key_id_of(forged) not in {k.key_id for k in op.signing_keys()}
            with op.catalog.engine.connect() as c:  # type: ignore[attr-defined]
                rows = c.execute(
                    text("SELECT count(*) FROM signing_key_event WHERE by = 'mallory'")
                )
                assert rows.scalar_one() == 1  # it is there, and counts for nothing
        with pytest.raises(UsageError, match="runs on the host of reg server"):
            from cli.keys import _on_this_host

            _on_this_host(remote, "create")
    pem = tmp_path / "reg.pub"
    pem.write_text(pinned)
    assert stock_verify(Path(pulled.dest), pem).returncode == 0


def test_the_cli_keys_and_a_pinned_key_one_line_each(cpu_policy, ckpts, cli, tmp_path):
    """`reg keys` as scripts use it (`--json`, `public`), `pull-release --verify-signature` with
    a pinned key, and each refusal one line with its exit code."""
    created = cli("keys", "create", "--json")
    assert created.returncode == 0, created.stderr
    key_id = json.loads(created.stdout)["key_id"]
    again = cli("keys", "create")
    assert again.returncode != 0 and again.stderr.count("\n") == 1, again.stderr
    assert "reg keys rotate" in again.stderr
    public = cli("keys", "public")
    assert public.returncode == 0 and public.stdout.startswith("-----BEGIN PUBLIC KEY-----")
    pinned = tmp_path / "reg.pub"
    pinned.write_text(public.stdout)
    listed = json.loads(cli("keys", "ls", "--json").stdout)
    assert [(k["key_id"], k["state"]) for k in listed] == [(key_id, "active")]
    assert "PRIVATE" not in cli("keys", "ls", "--json").stdout
    with Registry() as reg:
        _promoted(reg, ckpts)
    ok = cli(
        "pull-release", "tiny:v1", tmp_path / "ok", "--verify-signature", "--public-key", pinned
    )
    assert ok.returncode == 0, ok.stderr
    assert "(5 files verified, signature verified)" in ok.stdout
    assert stock_verify(tmp_path / "ok", pinned).returncode == 0
    offline = cli("verify", "--dir", tmp_path / "ok", "--public-key", pinned)
    assert offline.returncode == 0 and "signed by the pinned key" in offline.stdout, offline
    (tmp_path / "ok" / "README.md").write_text("# edited card\n")
    edited = cli("verify", "--dir", tmp_path / "ok", "--public-key", pinned, "--json")
    assert edited.returncode == 1 and not json.loads(edited.stdout)["ok"]
    checked = cli("verify", "tiny:v1", "--provenance")
    assert checked.returncode == 0 and f"signed by key {key_id[:16]} (active)" in checked.stdout
    for args, message in (
        (("--verify-signature",), "go together"),
        (("--public-key", str(pinned)), "go together"),
        (("--verify-signature", "--public-key", str(tmp_path / "nope.pub")), "not a PEM"),
    ):
        refused = cli("pull-release", "tiny:v1", tmp_path / "refused", *args)
        assert refused.returncode != 0 and message in refused.stderr, refused.stderr
        assert refused.stderr.count("\n") == 1 and not (tmp_path / "refused").exists()
    wrong = cli("pull", "tiny@latest", tmp_path / "x")
    assert wrong.returncode != 0  # `latest` of a run named tiny: no such run
    release = cli("pull", "tiny:v1", tmp_path / "y")
    assert "reg pull-release tiny:v1 DIR" in release.stderr, release.stderr
    revoked = cli("keys", "revoke", key_id[:10], "--reason", "test")
    assert revoked.returncode == 0, revoked.stderr
    bad = cli("verify", "tiny:v1", "--provenance")
    assert bad.returncode != 0 and "revoked: test" in bad.stdout + bad.stderr


def test_a_release_in_s3_is_signed_verified_and_clean(s3_env, cpu_policy, ckpts, tmp_path):
    """From an S3 store: the pulled release verifies with the stock CLI, `reg verify
    --provenance` reads model.sig and the statement by their recorded versions, and fsck
    counts the signature files as the release's own."""
    with Registry() as reg:
        key = reg.create_signing_key()
        _promoted(reg, ckpts)
        pulled = reg.pull_release("tiny:v1", tmp_path / "pulled")
        assert reg.verify("tiny:v1", provenance=True).ok
        assert reg.fsck()["clean"]
        pem = _pem(tmp_path, reg, key.key_id)
    assert stock_verify(Path(pulled.dest), pem).returncode == 0


def test_a_rebuilt_catalog_keeps_the_release_s_signature_file(cpu_policy, ckpts, tmp_path, cli):
    """The catalog lost: `reg catalog rebuild` registers model.sig as the release's (release.json
    cannot list it), so a pull still carries it and the pinned key still verifies the folder;
    fsck is clean. The key itself lived in the catalog: verify --provenance says unsigned."""
    with Registry() as reg:
        key = reg.create_signing_key()
        _promoted(reg, ckpts)
        pem = _pem(tmp_path, reg, key.key_id)
        home = reg.settings.home
    lose_catalog(home)
    res = cli("catalog", "rebuild", "--json")
    assert res.returncode == 0 and json.loads(res.stdout)["releases_added"] == ["tiny:v1"]
    with Registry() as reg:
        pulled = reg.pull_release("tiny:v1", tmp_path / "rel", public_key=pem.read_text())
        assert reg.verify("tiny:v1")["ok"] and reg.fsck()["clean"]
    assert stock_verify(Path(pulled.dest), pem).returncode == 0


def test_a_promotion_killed_after_signing_completes_after_a_key_rotation(cpu_policy, ckpts):
    """Killed once model.sig is stored (immutable, never replaced): the rerun, after the key
    was rotated, keeps that signature (a key not revoked signed exactly these files) and
    records the key that made it."""
    from tests.zygote import Running

    with Registry() as reg:
        first = reg.create_signing_key()
        reg.push_checkpoint(
            ckpts.ws2.step_dir(4), run="r", step=4, metrics=ckpts.ws2.probe_metrics(4)
        )
    proc = Running(("promote", "r@step4", "--model", "tiny"), fault="promote-signed")
    assert proc.wait(timeout=300) != 0, proc.err()
    with Registry() as reg:
        assert reg.releases() == [] and reg.store.head("release/tiny/v1/model.sig") is not None
        reg.create_signing_key(rotate=True)
        out = reg.promote("r@step4", model="tiny")
        assert out["release"] == "tiny:v1" and out["signature"]["key_id"] == first.key_id
        assert reg.verify("tiny:v1", provenance=True).ok


def test_a_promotion_killed_before_commit_completes_after_an_upgrade(
    cpu_policy, ckpts, monkeypatch
):
    """The statement names reg's version and is stored (immutable) before release.json: a rerun
    by an upgraded reg keeps the stored statement where nothing else differs."""
    from tests.zygote import Running

    with Registry() as reg:
        reg.create_signing_key()
        reg.push_checkpoint(
            ckpts.ws2.step_dir(4), run="r", step=4, metrics=ckpts.ws2.probe_metrics(4)
        )
    proc = Running(("promote", "r@step4", "--model", "tiny"), fault="promote-documented")
    assert proc.wait(timeout=300) != 0, proc.err()
    monkeypatch.setattr("registry.trust.release_signing.provenance.reg_version", lambda: "99.0.0")
    with Registry() as reg:
        out = reg.promote("r@step4", model="tiny")
        assert out["release"] == "tiny:v1" and reg.verify("tiny:v1", provenance=True).ok
        statement = json.loads(reg.store.get_bytes("release/tiny/v1/provenance.intoto.json"))
    assert statement["predicate"]["buildDefinition"]["internalParameters"]["reg_version"] != (
        "99.0.0"
    )
