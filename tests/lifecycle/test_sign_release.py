"""`reg sign-release`: a release committed before signing existed is signed by an
admin afterwards. Its stored bytes are re-hashed against the catalog first; the provenance
statement, model card and model.sig are added as new objects (release.json, immutable, cannot
list them); a pull then carries five files that the stock model_signing CLI verifies."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from registry import Registry
from registry.errors import Conflict, GateNotMet, PermissionDenied
from tests.helpers import lose_catalog, stock_verify

ADDED = ["README.md", "model.sig", "provenance.intoto.json"]


def _unsigned(reg: Registry, ckpts, step: int = 4, model: str = "tiny") -> dict:
    """A release promoted where no key is active (embedded, `require_signature = "auto"`)."""
    reg.push_checkpoint(
        ckpts.ws2.step_dir(step), run="r", step=step, metrics=ckpts.ws2.probe_metrics(step)
    )
    out = reg.promote(f"r@step{step}", model=model)
    assert out["signature"] is None
    return out


def _pem(tmp_path: Path, reg: Registry, key_id: str) -> Path:
    path = tmp_path / f"{key_id[:8]}.pub"
    path.write_text(next(k.public_pem for k in reg.signing_keys() if k.key_id == key_id))
    return path


def _signature_rows(reg: Registry) -> int:
    from sqlalchemy import text

    with reg.catalog.engine.connect() as c:  # type: ignore[attr-defined]
        return int(c.execute(text("SELECT count(*) FROM release_signature")).scalar_one())


def test_an_unsigned_release_is_signed_later_and_verifies_everywhere(
    cpu_policy, ckpts, tmp_path, cli
):
    with Registry() as reg:
        _unsigned(reg, ckpts)
        with pytest.raises(GateNotMet, match="no active signing key"):
            reg.sign_release("tiny:v1")
        key = reg.create_signing_key()
        before = reg.show("tiny:v1")
        out = reg.sign_release("tiny:v1")
        assert out.added == ADDED and out.rehashed == before["bytes"]
        assert out.signature["key_id"] == key.key_id and out.bytes == before["bytes"]
        assert reg.show("tiny:v1")["signature"]["signed_by"] == out.signature["signed_by"]
        report = reg.verify("tiny:v1", provenance=True)
        assert report.ok and report.files == 5, report.problems
        with pytest.raises(Conflict, match="signed already"):
            reg.sign_release("tiny:v1")
        pem = _pem(tmp_path, reg, key.key_id)
        pulled = reg.pull_release("tiny:v1", tmp_path / "rel", public_key=pem.read_text())
        audit = reg.audit_log(action="sign-release")
        assert [(e.target, e.outcome) for e in audit] == [("tiny:v1", "allowed")]
        assert reg.fsck()["clean"]
    dest = Path(pulled.dest)
    assert sorted(p.name for p in dest.iterdir()) == sorted(
        [*ADDED, "model.safetensors", "release.json"]
    )
    listed = [f["path"] for f in json.loads((dest / "release.json").read_text())["files"]]
    assert listed == ["model.safetensors"]  # release.json is the promotion's, unchanged
    ok = stock_verify(dest, pem)
    assert ok.returncode == 0, ok.stderr + ok.stdout
    statement = json.loads((dest / "provenance.intoto.json").read_text())
    assert statement["predicate"]["runDetails"]["metadata"]["signedAfterPromotion"] is True
    assert statement["predicate"]["buildDefinition"]["externalParameters"]["source"] == (
        "default/r@step4"
    )
    assert "Signed after promotion" in (dest / "README.md").read_text()
    # reg verify --dir knows the added files: by the signature's digests, and with a key
    for flags in ((), ("--public-key", str(pem))):
        res = cli("verify", "--dir", str(dest), *flags)
        assert res.returncode == 0, res.stdout + res.stderr
    card = dest / "README.md"
    card.write_text(card.read_text() + "edited\n")
    for flags in ((), ("--public-key", str(pem))):
        res = cli("verify", "--dir", str(dest), *flags)
        assert res.returncode == 1 and "README.md" in res.stdout + res.stderr
    assert stock_verify(dest, pem).returncode != 0


def test_altered_stored_bytes_are_refused_and_nothing_is_signed(cpu_policy, ckpts, cli):
    """The signature would vouch for the altered bytes: the re-hash refuses first, in one line,
    and nothing is stored or recorded. With the bytes put back, the signing goes through."""
    with Registry() as reg:
        _unsigned(reg, ckpts)
        reg.create_signing_key()
        home = reg.settings.home
    weights = next(home.rglob("release/tiny/v1/model.safetensors"))
    mode = weights.stat().st_mode
    os.chmod(weights, mode | stat.S_IWUSR)
    original = weights.read_bytes()
    weights.write_bytes(original[:100] + bytes([original[100] ^ 1]) + original[101:])
    res = cli("sign-release", "tiny:v1")
    assert res.returncode == 1 and len(res.stderr.strip().splitlines()) <= 2, res.stderr
    assert "was not signed" in res.stderr and "model.safetensors" in res.stderr
    assert "Traceback" not in res.stderr
    with Registry() as reg:
        assert _signature_rows(reg) == 0
        for name in ADDED:
            assert reg.store.head(f"release/tiny/v1/{name}") is None
    weights.write_bytes(original)
    os.chmod(weights, mode)
    res = cli("sign-release", "tiny:v1", "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["added"] == ADDED


def test_a_killed_signing_completes_and_a_rebuild_keeps_the_files(cpu_policy, ckpts, tmp_path, cli):
    """Killed once model.sig is stored: the catalog records nothing, and the rerun keeps the
    stored objects (never replaced). A lost catalog, rebuilt, keeps the added files as the
    release's: a pull still carries all five and the pinned key still verifies them."""
    from tests.zygote import Running

    with Registry() as reg:
        _unsigned(reg, ckpts)
        key = reg.create_signing_key()
        pem = _pem(tmp_path, reg, key.key_id)
    proc = Running(("sign-release", "tiny:v1"), fault="sign-release-signed")
    assert proc.wait(timeout=300) != 0, proc.err()
    with Registry() as reg:
        assert reg.show("tiny:v1")["signature"] is None
        stored = reg.store.get_bytes("release/tiny/v1/model.sig")
        assert reg.sign_release("tiny:v1").signature["key_id"] == key.key_id
        assert reg.store.get_bytes("release/tiny/v1/model.sig") == stored
        assert reg.verify("tiny:v1", provenance=True).ok
        home = reg.settings.home
    lose_catalog(home)
    res = cli("catalog", "rebuild", "--json")
    assert res.returncode == 0 and json.loads(res.stdout)["releases_added"] == ["tiny:v1"]
    with Registry() as reg:
        pulled = reg.pull_release("tiny:v1", tmp_path / "rel", public_key=pem.read_text())
        assert reg.verify("tiny:v1")["ok"] and reg.fsck()["clean"]
    assert sorted(p.name for p in Path(pulled.dest).iterdir()) == sorted(
        [*ADDED, "model.safetensors", "release.json"]
    )
    assert stock_verify(Path(pulled.dest), pem).returncode == 0


def test_behind_the_server_only_an_admin_signs_with_the_servers_key(
    reg_server, ckpts, tmp_path, monkeypatch
):
    """Through `reg server` (whose key init created), a release promoted while the policy did
    not require signing is signed by an admin's call with the server's key; a releaser is
    refused; a yanked release is not signed."""
    from registry.core.config import Settings
    from tests.serverproc import team_policy

    reg_server.apply_policy(
        team_policy().replace("[promotion]\n", "[promotion]\nrequire_signature = false\n", 1)
    )

    def client(who: str) -> Registry:
        env = {"REG_URL": reg_server.url, "REG_TOKEN": reg_server.token(who)}
        return Registry(Settings.from_env({**os.environ, **env}))

    with client("alice") as alice, client("rel") as rel, Registry() as admin:
        for step in (2, 4):
            alice.push_checkpoint(
                ckpts.ws2.step_dir(step),
                run="r",
                project="team-a",
                step=step,
                metrics=ckpts.ws2.probe_metrics(step),
            )
            assert rel.promote(f"team-a/r@step{step}", model="tiny-s")["signature"] is None
        with pytest.raises(PermissionDenied):
            rel.sign_release("tiny-s:v1")
        signed = admin.sign_release("tiny-s:v1")
        [active] = [k for k in admin.signing_keys() if k.state == "active"]
        assert signed.signature["key_id"] == active.key_id
        assert admin.verify("tiny-s:v1", provenance=True).ok
        admin.yank("tiny-s:v2", "bad")
        with pytest.raises(Conflict, match="yanked"):
            admin.sign_release("tiny-s:v2")
        # A signature record written around the server (no MAC) is shown as unverified, and
        # no signing goes over it.
        from sqlalchemy import text

        from registry.catalog.engine import Catalog

        catalog = Catalog(reg_server.env["REG_CATALOG_URL"])
        try:
            with catalog.engine.begin() as c:
                c.execute(
                    text(
                        "INSERT INTO release_signature (release_id, key_id, sha256, "
                        "provenance_sha256, signed_at, signed_by, added_bytes) SELECT r.id, "
                        ":k, :d, :d, 0, 'mallory', 0 FROM release r JOIN model m ON "
                        "m.id = r.model_id WHERE m.name = 'tiny-s' AND r.version = 2"
                    ),
                    {"k": active.key_id, "d": "0" * 64},
                )
        finally:
            catalog.dispose()
        assert admin.show("tiny-s:v2")["signature"]["key_state"] == "unverified"
        assert {r.release: (r.signature or {}).get("key_state") for r in admin.releases()} == {
            "tiny-s:v1": "active",
            "tiny-s:v2": "unverified",
        }
        with pytest.raises(Conflict, match="without the server's MAC"):
            admin.sign_release("tiny-s:v2")

        pulled = rel.pull_release("tiny-s:v1", tmp_path / "rel", public_key=active.public_pem)
    pem = tmp_path / "reg.pub"
    pem.write_text(active.public_pem)
    assert stock_verify(Path(pulled.dest), pem).returncode == 0


def test_an_added_card_that_is_an_extra_is_left_alone(cpu_policy, ckpts, tmp_path):
    """A release whose extras hold a README.md keeps it: the signing adds no card."""
    (tmp_path / "README.md").write_text("# my model\n")
    with Registry() as reg:
        reg.push_checkpoint(
            ckpts.ws2.step_dir(4), run="r", step=4, metrics=ckpts.ws2.probe_metrics(4)
        )
        reg.promote("r@step4", model="tiny", extras=[tmp_path / "README.md"])
        reg.create_signing_key()
        out = reg.sign_release("tiny:v1")
        assert out.added == ["model.sig", "provenance.intoto.json"]
        assert reg.verify("tiny:v1", provenance=True).ok
        pulled = reg.pull_release("tiny:v1", tmp_path / "rel")
    assert (Path(pulled.dest) / "README.md").read_text() == "# my model\n"


def test_a_statement_planted_in_the_store_is_not_signed(cpu_policy, ckpts):
    """Whoever can write the store but not the catalog plants the statement sign-release will
    find, the same but for what it may differ in (reg's version) and a claim of their own:
    refused, nothing signed. Only reg's own rendering, naming another version, is kept."""
    from registry.core.refs import parse_release_ref
    from registry.lifecycle.late_signing import _release
    from registry.trust.release_signing import provenance

    with Registry() as reg:
        _unsigned(reg, ckpts)
        reg.create_signing_key()
        view, lineage = _release(reg.context, parse_release_ref("tiny:v1"))  # type: ignore[attr-defined]
        doc = provenance.statement(
            release=view.name,
            files=list(view.files),
            created_at=reg.show("tiny:v1")["created_at"],
            created_by=view.row.created_by,
            signed_later=True,
            **lineage,
        )
        doc["predicate"]["buildDefinition"]["internalParameters"]["security_review"] = "APPROVED"
        key = "release/tiny/v1/provenance.intoto.json"
        reg.store.put_bytes(key, provenance.to_bytes(doc), immutable=True)
        with pytest.raises(Conflict, match="provenance.intoto.json"):
            reg.sign_release("tiny:v1")
        assert reg.show("tiny:v1")["signature"] is None and _signature_rows(reg) == 0
        assert reg.store.head("release/tiny/v1/model.sig") is None


def test_a_release_yanked_while_it_is_signed_is_not_signed(cpu_policy, ckpts, monkeypatch):
    """The yank commits between the signature's upload and the catalog's record: the record
    is refused (the release row is read again, locked, in the committing transaction)."""
    import registry.core.faults

    with Registry() as reg:
        _unsigned(reg, ckpts)
        reg.create_signing_key()
    real = registry.core.faults.point

    def yank_now(name: str, path: object = None) -> None:
        if name == "sign-release-signed":
            with Registry() as other:
                other.yank("tiny:v1", "leaked eval data")
        real(name, path)

    monkeypatch.setattr(registry.core.faults, "point", yank_now)
    with Registry() as reg:
        with pytest.raises(Conflict, match="yanked while it was being signed"):
            reg.sign_release("tiny:v1")
        shown = reg.show("tiny:v1")
        assert shown["status"] == "yanked" and shown["signature"] is None
        assert _signature_rows(reg) == 0


def test_a_rebuilt_catalog_keeps_only_the_files_the_signature_names(
    cpu_policy, ckpts, tmp_path, cli
):
    """A card replaced in the store before the catalog is rebuilt is not the release's: the
    rebuild keeps the statement and card only where model.sig names their digests. A rebuilt
    release (its signer unknown, its options lost) is not signed again."""
    with Registry() as reg:
        _unsigned(reg, ckpts)
        reg.create_signing_key()
        reg.sign_release("tiny:v1")
        home = reg.settings.home
    card = next(home.rglob("release/tiny/v1/README.md"))
    os.chmod(card, card.stat().st_mode | stat.S_IWUSR)
    card.write_text("# trust me\n")
    lose_catalog(home)
    assert cli("catalog", "rebuild").returncode == 0
    with Registry() as reg:
        files = {f["path"] for f in reg.show("tiny:v1")["files"]}
        assert files == {"model.safetensors", "model.sig", "provenance.intoto.json"}
        with pytest.raises(GateNotMet, match="no record of"):
            reg.sign_release("tiny:v1")


def test_show_and_fsck_count_the_added_files(cpu_policy, ckpts):
    """release.json's size is what the catalog counts beyond the promotion's files: after a
    signing `reg show` still reads it (no damage note) and fsck checks its size."""
    with Registry() as reg:
        _unsigned(reg, ckpts)
        before = reg.show("tiny:v1")
        reg.create_signing_key()
        reg.sign_release("tiny:v1")
        after = reg.show("tiny:v1")
        assert after["hf"] == before["hf"] and after["hf_config"] == before["hf_config"]
        assert "does not match" not in json.dumps(after.to_json())
        assert reg.fsck(full=True)["clean"]
