"""Checkpoint economics from measured save and restore times."""

from __future__ import annotations

import json
import math

import pytest

from registry.errors import NotFound
from registry.lifecycle.recovery import expected_loss, young_daly_interval


def test_young_daly_and_expected_loss():
    assert young_daly_interval(60, 86400) == pytest.approx(math.sqrt(2 * 60 * 86400))
    assert expected_loss(600, 30) == 330


def test_economics_of_a_run(reg, ckpts, cli):
    for step in (2, 4):
        reg.push_checkpoint(ckpts.ws2.step_dir(step), run="r", step=step)
    out = reg.recovery("r", mtbf_s=3600)
    assert out["checkpoints"] == 2 and out["save_cost_seconds"] > 0
    assert out["restore_seconds"] is None and "no passing validation" in out["advice"][-1]
    assert out["optimal_interval_seconds"] == pytest.approx(
        math.sqrt(2 * out["save_cost_seconds"] * 3600), rel=1e-3
    )
    reg.validate("r@step4", device="cpu")
    out = reg.recovery("r", mtbf_s=3600)
    assert out["restore_seconds"] > 0 and out["rto_seconds"] >= out["restore_seconds"]
    assert any(w in out["advice"][0] for w in ("checkpoint more", "checkpoint less", "near the"))
    res = cli("recovery", "r", "--mtbf", "1h", "--json")
    assert res.returncode == 0 and json.loads(res.stdout)["run"] == "r"
    with pytest.raises(NotFound):
        reg.recovery("nope")
