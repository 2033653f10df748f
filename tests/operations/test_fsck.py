"""`reg fsck`: the whole registry, catalog against store. Damage is named and exits 1;
leftovers of interrupted work are reported as such and `--repair` clears exactly them."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
from pathlib import Path

from registry import Registry
from tests.storage import test_s3

locked_bucket = test_s3.locked_bucket  # fixtures: a versioned bucket with Object Lock
locked_registry = test_s3.locked_registry


def _store() -> Path:
    return Path(os.environ["REG_HOME"]) / "store"


def _kinds(out: dict) -> list[tuple[str, str]]:  # type: ignore[type-arg]
    return sorted((p["kind"], p["key"] or p["target"]) for p in out["problems"])


def test_a_sound_registry_is_clean_and_full_hashes_every_byte(filled, cli):
    res = cli("fsck", "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["clean"] and out["problems"] == []
    assert out["checked"]["checkpoints"] == 2 and out["checked"]["releases"] == 1
    full = json.loads(cli("fsck", "--full", "--json").stdout)
    assert full["checked"]["hashed_bytes"] == full["checked"]["bytes"]  # every object, once
    none = json.loads(cli("fsck", "--sample", "0", "--json").stdout)
    assert none["checked"]["hashed_files"] == 3  # the two manifests and release.json only
    human = cli("fsck")
    assert human.returncode == 0 and human.stdout.strip().endswith("clean")


def test_damage_is_named_and_exits_1_and_repair_without_versions_leaves_it(filled, cli):
    step4 = _store() / "ckpt/default/r/step-4"
    shard = sorted(step4.glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[100] ^= 1
    shard.chmod(0o644)
    shard.write_bytes(bytes(data))  # same size, other bytes
    (_store() / "ckpt/default/r/step-2/.metadata").unlink()
    other = sorted((_store() / "ckpt/default/r/step-2").glob("*.distcp"))[0]
    other.chmod(0o644)
    with other.open("r+b") as f:
        f.truncate(10)
    res = cli("fsck", "--full", "--json")
    assert res.returncode == 1, res.stderr
    out = json.loads(res.stdout)
    assert not out["clean"], out
    assert _kinds(out) == [
        ("missing-object", "ckpt/default/r/step-2/.metadata"),
        ("sha256-mismatch", f"ckpt/default/r/step-4/{shard.name}"),
        ("size-mismatch", f"ckpt/default/r/step-2/{other.name}"),
    ]
    assert all(not p["sweepable"] for p in out["problems"])
    # Sampling finds what sizes show without reading a byte.
    sampled = json.loads(cli("fsck", "--sample", "0", "--json").stdout)
    assert {k for k, _ in _kinds(sampled)} == {"missing-object", "size-mismatch"}
    fixed = cli("fsck", "--repair", "--full", "--json")
    assert fixed.returncode == 1
    left = json.loads(fixed.stdout)["left"]
    assert len(left) == 3 and all("no version was recorded" in p["detail"] for p in left)
    human = cli("fsck")
    assert human.returncode == 1 and "Traceback" not in human.stderr
    assert human.stderr.count("\n") == 1 and "3 stored file(s) missing or different" in human.stderr


def _sql(*statements: str) -> None:
    db = sqlite3.connect(Path(os.environ["REG_HOME"]) / "catalog.db")
    with db:
        for statement in statements:
            db.execute(statement)
    db.close()


def test_leftovers_are_clean_and_repair_clears_them(filled, ckpts, cli):
    store = _store()
    # A stray object in a committed checkpoint, objects under a step no row names, a dead
    # claim older than orphan_grace, a collected step whose deletion stopped after its
    # MANIFEST.json, and an unknown object under a release.
    (store / "ckpt/default/r/step-4/stray.bin").write_bytes(b"x")
    (store / "ckpt/default/ghost/step-1").mkdir(parents=True)
    (store / "ckpt/default/ghost/step-1/__0_0.distcp").write_bytes(b"y" * 10)
    filled.claim_checkpoint("r", 6, lease_s=1)
    (store / "ckpt/default/r/step-6").mkdir()
    shutil.copy(sorted(ckpts.ws2.step_dir(4).glob("*.distcp"))[0], store / "ckpt/default/r/step-6/")
    old = "created_at = created_at - 30 * 86400"
    _sql(
        f"UPDATE checkpoint SET lease_until = 0, {old} WHERE step = 6",
        "UPDATE checkpoint SET state = 'deleting' WHERE step = 2",
        "UPDATE checkpoint SET state = 'deleted' WHERE step = 2",
    )
    (store / "ckpt/default/r/step-2/MANIFEST.json").unlink()  # GC deletes it first
    (store / "release/tiny/v1/extra.txt").write_bytes(b"z")
    out = json.loads(cli("fsck", "--json").stdout)
    found = {(p["kind"], p["sweepable"]) for p in out["problems"]}
    assert found == {
        ("unlisted-object", True),  # stray.bin and ghost's file
        ("stale-claim", True),
        ("tombstone-objects", True),
        ("unlisted-object", False),  # under release/: never deleted
    }
    assert not out["clean"]  # the release's stray object needs a person
    res = cli("fsck", "--repair", "--json")
    assert res.returncode == 1, res.stderr
    assert "1 finding(s) need a person" in res.stderr
    fixed = json.loads(res.stdout)
    assert [p["key"] for p in fixed["left"]] == ["release/tiny/v1/extra.txt"]
    assert not (store / "ckpt/default/r/step-4/stray.bin").exists()
    assert not any((store / "ckpt/default/ghost").rglob("*.distcp"))
    assert not any((store / "ckpt/default/r/step-2").glob("*"))
    assert not any((store / "ckpt/default/r/step-6").glob("*"))
    (store / "release/tiny/v1/extra.txt").unlink()
    after = cli("fsck", "--full", "--json")
    assert after.returncode == 0 and json.loads(after.stdout)["problems"] == []
    with Registry() as reg:
        assert reg.verify("r@step4")["ok"] and reg.verify("tiny:v1")["ok"]
        assert [c["step"] for c in reg.list_checkpoints("r")] == [4]
        audited = [e for e in reg.audit_log() if e["action"] == "fsck-repair"]
        assert "swept ckpt/default/r/step-6/" in audited[0]["details"]["done"]


def test_what_only_looks_like_a_leftover_is_left_alone(filled, ckpts, cli):
    """A tombstone over a MANIFEST.json (not how GC leaves one), a dead upload younger than
    orphan_grace (it may have written its MANIFEST.json: pushed again, it commits), and a key
    reg refuses: reported, and --repair deletes none of them."""
    store = _store()
    _sql(
        "UPDATE checkpoint SET state = 'deleting' WHERE step = 2",
        "UPDATE checkpoint SET state = 'deleted' WHERE step = 2",
    )
    filled.claim_checkpoint("r", 6, lease_s=1)
    shutil.copytree(store / "ckpt/default/r/step-4", store / "ckpt/default/r/step-6")
    _sql("UPDATE checkpoint SET lease_until = 0 WHERE step = 6")
    (store / "ckpt/default/odd/step-9").mkdir(parents=True)
    (store / "ckpt/default/odd/step-9/__0_0.distcp~").write_bytes(b"editor backup")
    (store / "ckpt/default/odd/step-9/__1_0.distcp").write_bytes(b"data")
    out = json.loads(cli("fsck", "--json").stdout)
    by_kind = {p["kind"]: p for p in out["problems"]}
    assert not by_kind["tombstone-objects"]["sweepable"]
    assert "MANIFEST.json" in by_kind["tombstone-objects"]["detail"]
    assert (
        by_kind["stale-claim"]["sweepable"] and "push it again" in by_kind["stale-claim"]["detail"]
    )
    assert not by_kind["invalid-key"]["sweepable"]
    res = cli("fsck", "--repair", "--json")
    assert res.returncode == 1
    left = {p["kind"] for p in json.loads(res.stdout)["left"]}
    assert {"tombstone-objects", "stale-claim", "invalid-key"} <= left
    assert len(list((store / "ckpt/default/r/step-2").iterdir())) == 4
    assert len(list((store / "ckpt/default/r/step-6").iterdir())) == 4
    assert len(list((store / "ckpt/default/odd/step-9").iterdir())) == 2
    # No placeholder row stays behind: that step can be pushed.
    pushed = cli("push-ckpt", ckpts.ws2.step_dir(4), "--run", "odd", "--step", "9")
    assert pushed.returncode == 0, pushed.stderr


def test_a_project_scoped_repair_touches_only_that_project(filled, ckpts, cli):
    filled.claim_checkpoint("r", 6, lease_s=1)
    (_store() / "ckpt/default/r/step-6").mkdir()
    (_store() / "ckpt/default/r/step-6/__0_0.distcp").write_bytes(b"uploading")
    _sql("UPDATE checkpoint SET lease_until = 0, created_at = 0 WHERE step = 6")
    filled.push_checkpoint(ckpts.ws2.step_dir(2), run="x", step=1, project="other")
    (_store() / "ckpt/other/x/step-1/stray.bin").write_bytes(b"x")
    out = json.loads(cli("fsck", "--project", "other", "--repair", "--json").stdout)
    assert out["repaired"] == ["deleted ckpt/other/x/step-1/stray.bin (in no manifest)"]
    assert out["checked"]["checkpoints"] == 1 and out["checked"]["releases"] == 0
    assert (_store() / "ckpt/default/r/step-6/__0_0.distcp").exists()


def test_damage_reported_only_while_it_is_so(filled):
    """A checkpoint committed after the listing, or collected while fsck reads, is no damage."""
    from registry.operations import fsck

    ctx = filled.context
    snap = fsck.snapshot(ctx, None)
    late = "ckpt/default/r/step-4/MANIFEST.json"
    del snap.objects[late]  # as if listed just before the push wrote it
    found, _ = fsck.check(ctx, snap, full=True, sample=0)
    assert found == []
    snap = fsck.snapshot(ctx, None)
    (_store() / "ckpt/default/r/step-2/.metadata").unlink()
    _sql(
        "UPDATE checkpoint SET state = 'deleting' WHERE step = 2",
        "UPDATE checkpoint SET state = 'deleted' WHERE step = 2",
    )
    found, _ = fsck.check(ctx, snap, full=True, sample=0)
    assert [f.kind for f in found] == []  # the row says collected now: not damage


def test_a_live_claim_is_not_a_leftover_and_an_uncataloged_checkpoint_is_kept(filled, cli):
    filled.claim_checkpoint("r", 8, lease_s=600)
    step8 = _store() / "ckpt/default/r/step-8"
    step8.mkdir(parents=True, exist_ok=True)
    (step8 / "__0_0.distcp").write_bytes(b"in flight")
    # A committed checkpoint the catalog has no row for (a catalog restored from a backup).
    shutil.copytree(_store() / "ckpt/default/r/step-2", _store() / "ckpt/default/lost/step-2")
    out = json.loads(cli("fsck", "--json").stdout)
    uncataloged = [p for p in out["problems"] if p["kind"] == "uncataloged"]
    assert [p["key"] for p in uncataloged] == ["ckpt/default/lost/step-2/MANIFEST.json"]
    assert {p["kind"] for p in out["problems"]} == {"uncataloged"}  # the live claim is no finding
    fixed = json.loads(cli("fsck", "--repair", "--json").stdout)
    assert {p["kind"] for p in fixed["left"]} == {"uncataloged"}
    assert len(list((_store() / "ckpt/default/lost/step-2").iterdir())) == 4  # never swept
    assert (step8 / "__0_0.distcp").exists()


def test_repair_restores_damage_from_recorded_versions_on_s3(
    s3_env, locked_registry, locked_bucket, s3_server, cli
):
    client = s3_server.client()
    manifest = json.loads(
        client.get_object(Bucket=locked_bucket, Key="ckpt/default/r/step-4/MANIFEST.json")[
            "Body"
        ].read()
    )
    shard = "ckpt/default/r/step-4/" + manifest["files"][0]["path"]
    original = client.get_object(Bucket=locked_bucket, Key=shard)["Body"].read()
    client.put_object(Bucket=locked_bucket, Key=shard, Body=b"not the shard")
    client.put_object(Bucket=locked_bucket, Key="release/tiny/v1/model.safetensors", Body=b"no")
    found = json.loads(cli("fsck", "--json").stdout)
    assert {p["key"] for p in found["problems"]} == {shard, "release/tiny/v1/model.safetensors"}
    res = cli("fsck", "--repair", "--json")
    assert res.returncode == 0, res.stdout + res.stderr
    out = json.loads(res.stdout)
    assert out["clean"] and out["left"] == [] and len(out["repaired"]) == 2
    assert client.get_object(Bucket=locked_bucket, Key=shard)["Body"].read() == original
    assert json.loads(cli("fsck", "--full", "--json").stdout)["problems"] == []


def test_fsck_is_an_admin_action_through_the_server(reg_server, cli):
    denied = cli("fsck", env=reg_server.client_env("alice"))
    assert denied.returncode == 4 and "Traceback" not in denied.stderr
    res = cli("fsck", "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["clean"]


def test_repairs_wait_for_a_running_gc(filled, cli):
    from registry.catalog import leases

    (_store() / "ckpt/default/r/step-4/stray.bin").write_bytes(b"x")
    shard = sorted((_store() / "ckpt/default/r/step-2").glob("*.distcp"))[0]
    shard.chmod(0o644)
    shard.write_bytes(b"other")
    token, _ = leases.try_acquire(filled.catalog, "gc", "someone-else", 600)
    assert token is not None
    for args in (["fsck", "--repair"], ["verify", "r@step2", "--repair"]):
        res = cli(*args)
        assert res.returncode == 5, res.stderr
        assert "another GC is running: someone-else" in res.stderr and "Traceback" not in res.stderr
    assert (_store() / "ckpt/default/r/step-4/stray.bin").exists()  # nothing was done
