"""Issue 32: an MTBF below 1 s is refused as the message says (the CLI: one line, exit 2;
`reg server`: a 400 with the usual error body), and no accepted MTBF, no measured one and no
checkpoint cost (0 s included) reaches a math domain error, an overflow or a division by zero.
"""

from __future__ import annotations

import importlib
import json
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from registry.economics import model
from registry.economics.advise import summary
from registry.economics.facts import RunFacts
from registry.economics.plot import svg
from tests.economics.test_advise import _attempt
from tests.economics.test_advise_review import failure, saved_every_100

advise_mod = importlib.import_module("registry.economics.advise")


def test_an_mtbf_below_a_second_is_one_line_and_exit_2(clean_env: Path, cli: Any) -> None:
    _attempt("tiny", 5)
    for text in ("0.0001s", "0.5s", "0s"):
        res = cli("advise", "tiny", "--mtbf", text)
        assert res.returncode == 2, res.stderr
        assert len(res.stderr.strip().splitlines()) == 1, res.stderr
        assert "from 1s to 100 years" in res.stderr
        assert "Traceback" not in res.stderr and "internal error" not in res.stderr
    res = cli("advise", "tiny", "--mtbf", "1s", "--json")  # the shortest one accepted
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["failures"]["mtbf_s"] == 1.0 and 0 < doc["interval"]["advised_s"] <= 1.0
    res = cli("advise", "tiny", "--gpus", str(10**400))
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr


def _facts(cost: float, *, step_s: float | None = 1.0, failures: int = 0) -> RunFacts:
    """A run saved every 100 steps at C_eff `cost`, restores of 5 s; `failures` failures, each
    after 1 GPU-second (a measured MTBF below 1 s with --gpus)."""
    run = SimpleNamespace(step_seconds=step_s, last_step=1000, gpu_seconds=2.0, name="m")
    ckpts = saved_every_100(cost, cost)
    restores = [failure(100 * i, 100 * i + 50, float(i), step_s) for i in range(1, failures + 1)]
    facts = RunFacts("default", run)  # type: ignore[arg-type]
    facts.checkpoints, facts.restores = ckpts, restores  # type: ignore[assignment]
    return facts


@pytest.mark.parametrize("cost", [0.0, 5e-324, 1e-12, 1e-4, 60.0, 1e7])
@pytest.mark.parametrize("mtbf", [1.0, 1.5, 86400.0, advise_mod.MAX_MTBF_S, None])
def test_any_accepted_mtbf_and_any_cost_give_finite_advice(cost: float, mtbf: float | None) -> None:
    """`None`: the measured MTBF of 2 failures in 2 GPU-seconds, on 1000 GPUs (1 ms)."""
    facts = _facts(cost, failures=2 if mtbf is None else 0)
    gpus = 1000 if mtbf is None else None
    out = advise_mod._compose("m", facts, [facts], gpus=gpus, mtbf_s=mtbf, fleet=False, trials=20)
    json.dumps(out, allow_nan=False)  # every figure finite (or null)
    used = out["waste"]["cost_s"]
    assert used == max(cost, advise_mod.MIN_COST_S)
    assert ("model_floor_s" in out["c_eff"]) == (cost < advise_mod.MIN_COST_S)
    assert out["interval"]["advised_s"] is not None and out["advice"].startswith("Checkpoint")
    assert 0 < out["interval"]["advised_s"] <= max(out["failures"]["mtbf_s"], 1e-4)
    assert summary(facts)["advised_interval_s"] >= 0  # what MLflow gets from a heartbeat
    svg(
        cost_s=used,
        rto_s=5.0,
        mtbf_s=out["failures"]["mtbf_s"],
        gpus=out["gpus"],
        advised_s=out["interval"]["advised_s"] or 1e-4,
        current_s=out["interval"]["current_s"],
        title="m",
    )


def test_the_model_past_its_floating_point_edges() -> None:
    # C/M past ~36: the optimum's u is within an ulp of 1 (log1p(-1) had no value)
    assert model.optimal(0.0566, 1e-4) == pytest.approx(1e-4)
    assert model.optimal(1e7, 1.0) == pytest.approx(1.0)
    # e^(L/M) overflows: the loss is M (all of a segment's exposure) plus R
    assert model.lost_per_failure(1e6, 0.0, 5.0, 1.0) == pytest.approx(6.0)
    assert model.lost_per_failure(math.inf, 0.0, 0.0, 1.0) == 1.0
    # (tau + C)/M below e^x - 1's reach: no failure strikes, availability tau/(tau + C)
    assert model.availability(1e-300, 1e-300, 0.0, 1e10) == pytest.approx(0.5)
    assert model.waste(1e6, 60.0, 1e6, 1.0) == 1.0


def test_an_mtbf_below_a_second_is_a_400_through_the_server(reg_server: Any) -> None:
    _attempt("srv", 5)  # through the server: the test's environment is the admin's client
    headers = {"authorization": f"Bearer {reg_server.token('vera')}"}
    for path in ("/v1/advise", "/v1/recovery"):
        for value in ("1e-10", "0.5", "nan", "inf"):
            r = httpx.get(
                reg_server.url + path,
                params={"run": "srv", "mtbf_s": value},
                headers=headers,
                timeout=60,
            )
            assert r.status_code == 400, (path, value, r.text)
            body = r.json()
            assert body["exit_code"] == 2 and "from 1s to 100 years" in body["message"]
        r = httpx.get(
            reg_server.url + path,
            params={"run": "srv", "mtbf_s": 1.0},
            headers=headers,
            timeout=60,
        )
        assert r.status_code == 200, r.text
    assert "Traceback" not in reg_server.log_text()
