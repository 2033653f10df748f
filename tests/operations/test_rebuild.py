"""`reg catalog rebuild`: a lost catalog comes back from the store's manifests."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from registry import Registry
from tests.helpers import lose_catalog


def test_catalog_rebuilt_from_the_store(cpu_policy, ckpts, tmp_path, cli):
    with Registry() as reg:
        for step in (2, 4):
            reg.push_checkpoint(
                ckpts.ws2.step_dir(step),
                run="r",
                step=step,
                project="team-a",
                metrics={"val_loss": 1.0 * step},
            )
        reg.promote("team-a/r@step4", model="tiny", alias="prod")
        before = reg.list_checkpoints()
        home = reg.settings.home
    lose_catalog(home)
    dry = json.loads(cli("catalog", "rebuild", "--dry-run", "--json").stdout)
    assert dry["checkpoints_added"] == ["team-a/r@step2", "team-a/r@step4"] and not dry["applied"]
    res = cli("catalog", "rebuild", "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["releases_added"] == ["tiny:v1"]
    with Registry() as reg:
        after = reg.list_checkpoints()
        assert [(c["ref"], c["files"], c["world_size"], c["resumable"]) for c in after] == [
            (c["ref"], c["files"], c["world_size"], c["resumable"]) for c in before
        ]
        assert reg.show("team-a/r@step2")["metrics"] == {"val_loss": 2.0}
        assert reg.verify("team-a/r@step4")["ok"] and reg.verify("tiny:v1")["ok"]
        reg.pull_release("tiny:v1", tmp_path / "rel")
        again = json.loads(cli("catalog", "rebuild", "--json").stdout)
        assert again["checkpoints_added"] == [] and again["releases_added"] == []
    weights = load_file(tmp_path / "rel" / "model.safetensors")
    full = ckpts.ws2.full_weights(4)
    assert all(torch.equal(weights[k], full[k]) for k in weights)


def test_rebuild_trusts_only_manifests_in_their_own_place(ckpts, tmp_path, cli):
    """A crafted `sub/MANIFEST.json` inside a checkpoint (another project's run, a huge step, no
    files; push refuses such a directory now, an older registry did not), or a manifest that
    names another step, must not become that run's @latest after a rebuild."""
    with Registry() as reg:
        reg.push_checkpoint(ckpts.ws2.step_dir(4), run="victim", step=4, project="team-b")
        reg.push_checkpoint(ckpts.ws2.step_dir(2), run="r", step=2, project="team-a")
        reg.push_checkpoint(ckpts.ws2.step_dir(2), run="r", step=3, project="team-a")
        real = json.loads(reg.store.get_bytes("ckpt/team-b/victim/step-4/MANIFEST.json"))
        forged = json.dumps(dict(real, step=10**12, files=[], bytes=0)).encode()
        reg.store.put_bytes("ckpt/team-a/r/step-3/sub/MANIFEST.json", forged)
        reg.store.put_bytes("ckpt/team-a/r/step-5/MANIFEST.json", forged)
        empty = json.dumps(dict(real, project="team-a", run="r", step=6, files=[], bytes=0))
        reg.store.put_bytes("ckpt/team-a/r/step-6/MANIFEST.json", empty.encode())
        home = reg.settings.home
    lose_catalog(home)
    res = cli("catalog", "rebuild", "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["checkpoints_added"] == ["team-a/r@step2", "team-a/r@step3", "team-b/victim@step4"]
    skipped = " | ".join(out["skipped"])
    assert "ckpt/team-a/r/step-3/sub/MANIFEST.json: not where a checkpoint's manifest is kept" in (
        skipped
    )
    assert "ckpt/team-a/r/step-5/MANIFEST.json: the manifest names team-b/victim@step" in skipped
    assert "ckpt/team-a/r/step-6/MANIFEST.json: lists no .metadata" in skipped
    with Registry() as reg:
        assert reg.show("team-b/victim@latest")["step"] == 4
        assert reg.verify("team-b/victim@step4")["ok"]


def test_rebuild_skips_a_manifest_whose_files_are_gone(ckpts, cli):
    with Registry() as reg:
        reg.push_checkpoint(ckpts.ws2.step_dir(2), run="r", step=2)
        reg.push_checkpoint(ckpts.ws2.step_dir(4), run="r", step=4)
        from tests import tamper

        tamper.remove(reg.store, "ckpt/default/r/step-2/.metadata")
        home = reg.settings.home
    lose_catalog(home)
    out = json.loads(cli("catalog", "rebuild", "--json").stdout)
    assert out["checkpoints_added"] == ["r@step4"]
    assert any(".metadata is missing; not registered" in s for s in out["skipped"])


def test_malformed_documents_are_skipped_one_by_one_and_gc_still_runs(ckpts, cli):
    """One malformed manifest used to abort the whole rebuild (KeyError), and a rebuilt
    non-numeric metric crashed `gc --dry-run` for the whole registry."""
    with Registry() as reg:
        reg.push_checkpoint(ckpts.ws2.step_dir(2), run="r", step=2, metrics={"val_loss": 2.0})
        reg.push_checkpoint(ckpts.ws2.step_dir(4), run="r", step=4, metrics={"val_loss": 1.0})
        real = json.loads(reg.store.get_bytes("ckpt/default/r/step-2/MANIFEST.json"))
        home = reg.settings.home
        from tests import tamper

        tamper.replace(
            reg.store,
            "ckpt/default/r/step-2/MANIFEST.json",
            json.dumps(dict(real, metrics={"val_loss": "high"})).encode(),
        )
        reg.push_checkpoint(ckpts.ws3.step_dir(3), run="q", step=3)
        tamper.replace(reg.store, "ckpt/default/q/step-3/MANIFEST.json", b'{"format": 1}')
    lose_catalog(home)
    res = cli("catalog", "rebuild", "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["checkpoints_added"] == ["r@step4"]
    skipped = " | ".join(out["skipped"])
    assert "step-2/MANIFEST.json: metrics.val_loss is 'high'" in skipped
    assert "q/step-3/MANIFEST.json: format is 1" in skipped
    gc = cli("gc", "--dry-run", "--json")
    assert gc.returncode == 0, gc.stderr
    assert [d["ref"] for d in json.loads(gc.stdout)["decisions"]] == ["r@step4"]
