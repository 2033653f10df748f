"""`reg catalog rebuild`: a lost catalog comes back from the store's manifests."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from registry import Registry


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
    for name in ("catalog.db", "catalog.db-wal", "catalog.db-shm"):
        (home / name).unlink(missing_ok=True)
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
