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


@pytest.mark.parametrize(
    ("interval", "advice"),
    [
        (
            10_000,
            "checkpoint more often: every 54min instead of 2.8h cuts the expected loss per "
            "failure from 83min to 27min",
        ),
        (
            600,
            "checkpoint less often: every 54min instead of 10min cuts the save overhead from "
            "10.0% to 1.9% of training time, for an expected loss per failure of 27min instead "
            "of 5min",
        ),
        (3_000, "the interval (50min) is near the optimum (54min) for an MTBF of 24.0h"),
    ],
)
def test_advice_for_a_known_cost_and_mtbf(interval, advice):
    from registry.lifecycle.recovery import _advise

    out: dict = {"advice": []}
    _advise(out, cost=60.0, interval=float(interval), rto=0.0, mtbf_s=86_400.0)
    assert out["optimal_interval_seconds"] == pytest.approx(3219.94, abs=0.01)
    assert out["advice"] == [advice]


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
    # Pushed back to back: far more often than the optimum for a 1h MTBF.
    assert out["observed_interval_seconds"] < out["optimal_interval_seconds"] / 1.5
    assert out["advice"][0].startswith("checkpoint less often: every ")
    res = cli("recovery", "r", "--mtbf", "1h", "--json")
    assert res.returncode == 0 and json.loads(res.stdout)["run"] == "r"
    with pytest.raises(NotFound):
        reg.recovery("nope")
