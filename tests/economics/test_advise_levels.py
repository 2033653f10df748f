"""`reg advise` for a run that saves at tier 0: the two-level model (its optimum
against a brute-force search, its Monte Carlo check), `replicate_every` (every k-th save copied
to the store, the others tier 0 only: never adopted, evictable), and the advice from what a
job really paid: restores from each tier, the failures each recovered from, the copies' cost."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from registry import Registry
from registry.economics.levels import MAX_K, Levels, simulate
from registry.errors import UsageError
from registry.training import CheckpointManager


def _brute(lv: Levels) -> tuple[float, float, int]:
    return min(
        (lv.waste(tau, k), tau, k)
        for k in range(1, 40)
        for tau in [i * 0.5 for i in range(1, 4000)]
    )


@pytest.mark.parametrize(
    "lv",
    [
        Levels(5, 20, 30, 20, 120, 10_000, 0.3),
        Levels(2, 0, 10, 10, 60, 3600, 0.5),
        Levels(1, 30, 60, 10, 300, 20_000, 0.1),
        Levels(5, 20, 30, 20, 120, 10_000, 1.0),
    ],
)
def test_the_two_level_optimum_is_the_least_waste_and_the_simulation_agrees(lv: Levels):
    tau, k = lv.best()
    waste, tau_b, k_b = _brute(lv)
    assert k == k_b and abs(tau - tau_b) <= 0.5
    assert lv.waste(tau, k) <= waste + 1e-9
    simulated, left_out = simulate(lv, tau, k)
    assert left_out == 0 and simulated is not None
    assert abs(simulated - lv.waste(tau, k)) / lv.waste(tau, k) < 0.1  # first order: close


def test_the_copy_period_follows_what_each_level_costs_and_guards():
    free_copies = Levels(5, 0, 30, 20, 120, 10_000, 0.3)
    assert free_copies.best()[1] == 1  # a copy that costs the loop nothing: every save
    rare_loss = Levels(5, 20, 30, 20, 120, 10_000, 0.05)
    common_loss = Levels(5, 20, 30, 20, 120, 10_000, 0.6)
    assert rare_loss.best()[1] > common_loss.best()[1] >= 1
    assert Levels(5, 20, 30, 20, 120, 10_000, 0.0).best()[1] == MAX_K  # no node is ever lost
    assert Levels(5, 20, 30, 20, 120, 10_000, 1.0).young0() is None  # tier 0 guards nothing


def test_the_simulation_is_bounded_when_failures_outpace_restarts():
    hopeless = Levels(5, 5, 5, 50, 50, 10, 0.5)  # MTBF 10 s, restarts of 50 s
    simulated, left_out = simulate(hopeless, 10, 1, trials=50)
    assert simulated is None and left_out == 50


# -- a job's saves -----------------------------------------------------------------------------
def _state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(128, 256, generator=g)}, "train_state": {"step": step}}


def _work() -> None:
    x = torch.ones(150, 150)
    for _ in range(4):
        x = x @ x / 150


def _manager(reg: Registry, local: Path, **kw: Any) -> CheckpointManager:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return CheckpointManager(
            "lv", registry=reg, local_dir=local, node_id="n0", heartbeat_s=0, **kw
        )


def _attempt(reg: Registry, local: Path, until: int, **kw: Any) -> int | None:
    """Restore, train to `until` saving every 3 steps at tier 0 (every 2nd save copied), wait
    for the copies, then crash (the manager left as a SIGKILL leaves it)."""
    mgr = _manager(reg, local, replicate_every=2, keep_local=2, **kw)
    state = _state(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        start = mgr.restore(state)
        for step in range((start or 0) + 1, until + 1):
            _work()
            mgr.step_done(step)
            if step % 3 == 0:
                mgr.save(_state(step), step)
        mgr.wait(replicated=True)
        mgr.step_done(until)  # the copies' tracks end, and their figures go out
    mgr.flush()
    return start


def test_replicate_every_copies_every_kth_save_and_advise_weighs_both_levels(reg, tmp_path):
    local = tmp_path / "node"
    assert _attempt(reg, local, 13) is None  # saves 3 6 9 12: 3 and 9 copied
    states = {c["step"]: c["state"] for c in reg.list_checkpoints("lv")}
    # 6 was never to be copied, and keep_local evicted its only copy: it is lost
    assert states == {3: "committed", 6: "lost", 9: "committed", 12: "local"}
    shown = reg.show("lv@step6")
    assert shown["save_costs"]["tier0_only"] is True
    copied = reg.show("lv@step9")["save_costs"]
    assert "copy_steps_during" in copied  # the copy's cost to the loop, measured apart
    # keep_local=2: the node kept 9 and 12; 6 (tier 0 only, never to be copied) was evicted
    # (3 too, unless its copy was still on its way at the last eviction).
    held = {p.name for p in (local / "default" / "lv").iterdir()}
    assert {"step-9", "step-12"} <= held <= {"step-3", "step-9", "step-12"}
    assert [t["held"] for t in reg.show("lv@step6")["tiers"]] == [False]

    # A crash: the node survived, the restore reads step 12 from it (a tier-0 failure), and
    # does not copy 12 (tier 0 only by design).
    assert _attempt(reg, local, 16) == 12
    assert reg.show("lv@step12")["state"] == "local"
    restores = reg.show("lv@step12")["restores"]
    assert restores[0]["kind"] == "failure" and restores[0]["phases"]["store_bytes"] == 0
    # A crash that took the node's disk: the newest step the store holds (9... or 15, copied).
    shutil.rmtree(local)
    restored = _attempt(reg, local, 19)
    assert restored == 15  # 15 was the first save of the second attempt: copied
    phases = reg.show("lv@step15")["restores"][0]["phases"]
    assert phases["local_bytes"] == 0 and phases["store_bytes"] > 0

    out = reg.advise("lv").to_json()
    lv = out["levels"]
    assert (lv["failures_tier0"], lv["failures_store"]) == (1, 1)
    assert lv["node_loss_share"] == 0.5 and lv["node_loss_share_source"].startswith("measured")
    assert lv["current_copy_every"] == 2 and lv["saves"] >= 6 and lv["copied"] >= 3
    assert lv["lag_source"].startswith("copies committed") and lv["lag_s"] > 0
    assert lv["r0_source"].startswith("restores from tier 0")
    assert lv["r1_source"].startswith("restores from the store")
    assert lv["advised_copy_every"] >= 1 and lv["advised_tier0_s"] > 0
    assert lv["advised_store_s"] == pytest.approx(
        lv["advised_tier0_s"] * lv["advised_copy_every"], rel=1e-3
    )
    assert lv["simulation"]["advised_fraction"] is not None
    assert f"replicate_every={lv['advised_copy_every']}" in lv["advice"]
    # --node-loss-share overrides the measured share; out of range is one line.
    forced = reg.advise("lv", node_loss_share=0.0).to_json()["levels"]
    assert forced["node_loss_share_source"] == "--node-loss-share"
    assert forced["advised_copy_every"] >= lv["advised_copy_every"]
    with pytest.raises(UsageError, match="--node-loss-share must be from 0 to 1"):
        reg.advise("lv", node_loss_share=1.5)


def test_reg_advise_shows_the_levels_and_a_run_without_tier0_has_none(clean_env, cli, tmp_path):
    with Registry() as reg:
        _attempt(reg, tmp_path / "node", 7)
        plain = CheckpointManager("flat", registry=reg, heartbeat_s=0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for step in (1, 2):
                plain.save(_state(step), step)
        plain.close()
    got = cli("advise", "lv", "--json")
    assert got.returncode == 0, got.stderr
    assert json.loads(got.stdout)["levels"]["current_copy_every"] == 2
    table = cli("advise", "lv")
    assert table.returncode == 0, table.stderr
    assert "two-level optimum" in table.stdout and "replicate_every=" in table.stdout
    flat = cli("advise", "flat", "--json")
    assert flat.returncode == 0 and json.loads(flat.stdout)["levels"] is None
    bad = cli("advise", "lv", "--node-loss-share", "2")
    assert bad.returncode != 0 and "Traceback" not in bad.stderr
    assert "--node-loss-share must be from 0 to 1" in bad.stderr


def test_replicate_every_is_checked(reg, tmp_path):
    for value, message in ((0, "1 copies every save"), (1.5, "a whole number")):
        with pytest.raises(UsageError, match=message):
            _manager(reg, tmp_path, replicate_every=value)
