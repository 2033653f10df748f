"""`reg advise` on a real multi-restart job: a torchrun job (2 ranks, gloo) that saves async
every 5 steps is SIGKILLed twice mid-run, whatever is in flight, and restored each time;
`reg advise` reports the two failures, the work each lost, and a C_eff larger than the bare
stall (the steps a background save overlapped were slower)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.helpers import torchrun


def _job(*args: str, killed: bool = False) -> None:
    torchrun(
        "examples.train_with_manager",
        2,
        [
            "--run-name",
            "e2e",
            "--until",
            "40",
            "--every",
            "5",
            "--async",
            "--heartbeat",
            "0",
            *args,
        ],
        keep=Path(os.environ["REG_HOME"]),
        env_extra={"PYTHONWARNINGS": "ignore"},
        killed=killed,
    )


@pytest.mark.timeout(600)
def test_a_job_killed_twice_is_advised_from_what_it_paid(cli, tmp_path: Path) -> None:
    _job("--kill-at", "13", killed=True)  # saves 5, 10; killed at 13
    _job("--kill-at", "27", killed=True)  # restores 10 (or 5); saves 15..25; killed at 27
    _job()  # restores 25 (or 20), trains to 40, closes
    plot = tmp_path / "e2e.svg"
    res = cli("advise", "e2e", "--json", "--plot", str(plot))
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    fail = out["failures"]
    assert fail["count"] == 2 and fail["planned_restarts"] == 0
    assert [e["reached_step"] for e in fail["events"]] == [13, 27]
    for event in fail["events"]:
        assert event["restored_step"] % 5 == 0 and event["lost_steps"] > 0
        assert event["lost_s"] > 0
    c_eff = out["c_eff"]
    assert c_eff["source"] == "step times around saves"
    assert c_eff["median_s"] > c_eff["stall_median_s"] > 0
    assert out["rto"]["restores"] == 2 and out["rto"]["first_step_s"] > 0
    assert out["simulation"]["exponential"]["difference_pct"] < 5
    assert out["simulation"]["measured_gaps"]["gaps"] == 2
    assert out["gpus"] == 2 and plot.read_text().startswith("<svg")
    (tmp_path / "advise.json").write_text(res.stdout)
    table = cli("advise", "e2e")
    assert table.returncode == 0 and "failure 2" in table.stdout
    print(table.stdout)  # the figures docs/concepts/economics.md quotes (pytest -s)
