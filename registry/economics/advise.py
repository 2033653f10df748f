"""`reg advise RUN`: checkpoint economics from what the job really paid.

Reads the run's measured figures (`facts`), estimates the failure rate (the run's own history,
the project's runs pooled with `fleet`, or `--mtbf`), and answers the intervals (Young, Daly,
the availability optimum), the waste and regret of the current interval, the expected lost work
per failure, two Monte Carlo checks, and one sentence of advice. The model: `model`'s docstring.
"""

from __future__ import annotations

import math
import statistics
from typing import TYPE_CHECKING, Any

from sqlmodel import select

from registry.catalog import queries
from registry.catalog.models import Project, Run
from registry.core.refs import CheckpointRef, check_name
from registry.economics import levels, model, simulate
from registry.economics.facts import RunFacts, gather
from registry.errors import NotFound, UsageError

if TYPE_CHECKING:
    from registry.lifecycle.context import Context

ASSUMED_MTBF_S = 86400.0  # the prior: no failure measured, no --mtbf, no --fleet failures
MIN_GAPS = 2  # failures needed to resample their gaps
MIN_MTBF_S = 1.0  # --mtbf from 1 s (a measured one may be shorter: the model takes any M > 0)
MAX_MTBF_S = 100 * 365.25 * 86400.0  # --mtbf up to 100 years
MAX_GPUS = 1_000_000  # --gpus up to this (a heartbeat's world size has the same bound)
MIN_COST_S = 1e-4  # C_eff is recorded to 0.1 ms: the model takes a smaller one (0 too) as this
CONFIDENCE = 0.90
NEAR = 0.2  # an interval within 20% of the optimum is "near" it (waste is flat there)
ASSUMED_NODE_LOSS_SHARE = 0.5  # the prior share of failures that lose a node's local disk
LEVEL_TRIALS = 300  # the two-level simulation runs event by event: fewer trials


def advise(
    ctx: Context,
    run: str,
    *,
    project: str = "default",
    gpus: int | None = None,
    mtbf_s: float | None = None,
    fleet: bool = False,
    node_loss_share: float | None = None,
    trials: int = 2000,
    legacy: bool = False,
) -> dict[str, Any]:
    """The run's economics. `legacy`: also the keys `reg recovery --json` had (one release).
    `node_loss_share`: the share of failures that lose a node's local disk (tier 0), for a run
    that saves there (default: measured from its restores, else ASSUMED_NODE_LOSS_SHARE)."""
    check_name(run, "run name")
    check_name(project, "project name")
    if gpus is not None and (
        isinstance(gpus, bool) or not isinstance(gpus, int) or not 1 <= gpus <= MAX_GPUS
    ):
        raise UsageError(f"--gpus must be an integer from 1 to {MAX_GPUS}, got {gpus}")
    if mtbf_s is not None and (
        isinstance(mtbf_s, bool)
        or not isinstance(mtbf_s, int | float)
        or not MIN_MTBF_S <= mtbf_s <= MAX_MTBF_S  # NaN fails it too
    ):
        raise UsageError(f"--mtbf must be a duration from 1s to 100 years, got {mtbf_s}s")
    if node_loss_share is not None and (
        isinstance(node_loss_share, bool)
        or not isinstance(node_loss_share, int | float)
        or not 0.0 <= node_loss_share <= 1.0  # NaN fails it too
    ):
        raise UsageError(f"--node-loss-share must be from 0 to 1, got {node_loss_share}")
    ctx.authorize_read(project=project)
    label = CheckpointRef(project, run, None).run_label
    with ctx.catalog.session() as s:
        row = queries.find_run(s, project, run)
        if row is None:
            raise NotFound(f"run {label} not found", "reg ls lists the runs")
        facts = gather(s, project, row)
        pool = [facts]
        if fleet:
            others = s.exec(
                select(Run).join(Project).where(Project.name == project, Run.id != row.id)
            ).all()
            pool += [gather(s, project, other) for other in others]
    if not facts.checkpoints:
        raise NotFound(f"{label} has no saved checkpoints", "reg push-ckpt registers one")
    out = _compose(
        label,
        facts,
        pool,
        gpus=gpus,
        mtbf_s=mtbf_s,
        fleet=fleet,
        trials=trials,
        node_loss_share=node_loss_share,
    )
    return recovery_keys(out, facts) if legacy else out


def recovery_keys(out: dict[str, Any], facts: RunFacts) -> dict[str, Any]:
    """`reg recovery --json`'s old keys, mapped from the new document, for one release (then
    `reg recovery` goes): save_cost_seconds (C_eff), transfer_rate_bytes_per_second (pushes'
    upload rate), restore_seconds and rto_seconds (RTO), observed_interval_seconds,
    mtbf_seconds, optimal_interval_seconds (the advised one), overheads, expected losses, and
    `advice` as a list (the sentence; the new document's string is `advice_sentence`)."""
    rates = [c.bytes / c.upload_seconds for c in facts.checkpoints if c.upload_seconds]
    c, rto = out["c_eff"], out.get("rto") or {}
    interval, waste = out.get("interval") or {}, out.get("waste") or {}
    cost, best, now = c.get("median_s"), interval.get("advised_s"), interval.get("current_s")
    old: dict[str, Any] = {
        "save_cost_seconds": cost,
        "transfer_rate_bytes_per_second": _r(statistics.median(rates)) if rates else None,
        "restore_seconds": rto.get("median_s"),
        "rto_seconds": rto.get("median_s"),
        "observed_interval_seconds": now,
        "mtbf_seconds": out["failures"].get("mtbf_s"),
    }
    if cost is not None and best:
        old |= {
            "optimal_interval_seconds": best,
            "overhead_at_optimal": _r(cost / best),
            "expected_loss_at_optimal_seconds": waste.get("lost_per_failure_advised_s"),
        }
        if now:
            old |= {
                "overhead_now": _r(cost / now),
                "expected_loss_now_seconds": waste.get("lost_per_failure_now_s"),
            }
    sentence = out.pop("advice")
    return out | old | {"advice_sentence": sentence, "advice": [sentence] if sentence else []}


def _compose(
    label: str,
    facts: RunFacts,
    pool: list[RunFacts],
    *,
    gpus: int | None,
    mtbf_s: float | None,
    fleet: bool,
    trials: int,
    node_loss_share: float | None = None,
) -> dict[str, Any]:
    world = next((int(c.world_size) for c in reversed(facts.checkpoints) if c.world_size), 1)
    n_gpus = gpus or world
    c_eff, stalls, extra, c_source = facts.costs()
    rto = facts.rto()
    tau_now, every, tau_source = facts.interval()
    step_s = facts.run.step_seconds
    failures = facts.failures()
    losses = facts.losses()
    out: dict[str, Any] = {
        "run": label,
        "gpus": n_gpus,
        "gpus_source": "--gpus" if gpus else "the run's world size",
        "checkpoints": len(facts.checkpoints),
        "bytes": facts.checkpoints[-1].bytes,
        "step_seconds": _r(step_s),
        "last_step": facts.run.last_step,
        "c_eff": {
            "median_s": _r(statistics.median(c_eff)) if c_eff else None,
            "p10_s": _r(_quantile(c_eff, 0.1)),
            "p90_s": _r(_quantile(c_eff, 0.9)),
            "stall_median_s": _r(statistics.median(stalls)) if stalls else None,
            "interference_median_s": _r(statistics.median(extra)) if extra else None,
            "saves": len(c_eff),
            "source": c_source,
        },
        "rto": {k: _r(v) if isinstance(v, float) else v for k, v in (rto or {}).items()} or None,
        "failures": {
            "count": len(failures),
            "planned_restarts": facts.planned(),
            "lost_steps": sum(f.lost_steps for f in losses),
            "events": [_event(f) for f in failures],
            "other_losses": [_event(f) for f in losses if f.kind != "failure"],
        },
        "interval": {"current_s": _r(tau_now), "current_steps": every, "source": tau_source},
        "advice": "",
    }
    mtbf, rate_doc = choose_mtbf(pool, n_gpus, mtbf_s, fleet=fleet)
    out["failures"] |= rate_doc
    if not c_eff:
        out["advice"] = "no checkpoint cost measured yet: save from the training loop first"
        return out
    cost = statistics.median(c_eff)
    if cost < MIN_COST_S:  # an optimum of 0 s (and divisions by it) for a cost of 0
        out["c_eff"]["model_floor_s"] = MIN_COST_S
        cost = MIN_COST_S
    r = float(rto["median_s"]) if rto else 0.0
    best = model.optimal(cost, mtbf)
    out["interval"] |= {
        "young_s": _r(model.young(cost, mtbf)),
        "daly_s": _r(model.daly(cost, mtbf)),
        "availability_s": _r(best),
        "advised_s": _r(best),
        "advised_steps": _steps(best, step_s),
    }
    waste = {
        "model": "Daly's full model: Poisson failures of mean M at any time; a failure loses the "
        "work since the last completed checkpoint plus a restart R (also at risk)",
        "mtbf_s": _r(mtbf),
        "cost_s": _r(cost),
        "advised_fraction": _r(model.waste(best, cost, r, mtbf), 6),
        "availability_advised": _r(model.availability(best, cost, r, mtbf), 6),
        "lost_per_failure_advised_s": _r(model.lost_per_failure(best, cost, r, mtbf)),
    }
    if tau_now:
        waste |= {
            "current_fraction": _r(model.waste(tau_now, cost, r, mtbf), 6),
            "availability_now": _r(model.availability(tau_now, cost, r, mtbf), 6),
            "lost_per_failure_now_s": _r(model.lost_per_failure(tau_now, cost, r, mtbf)),
            "regret_gpu_hours_per_day": _r(
                model.regret_gpu_hours_per_day(tau_now, best, cost, r, mtbf, n_gpus)
            ),
        }
    out["waste"] = waste
    out["simulation"] = _simulate(cost, r, mtbf, best, tau_now, pool, n_gpus, trials)
    out["levels"] = _two_levels(facts, cost, r, mtbf, tau_now, step_s, n_gpus, node_loss_share)
    advice = _sentence(out, cost, r, mtbf, best, tau_now, step_s, n_gpus)
    del out["advice"]
    out["advice"] = advice  # last, as the table ends with it
    return out


def _two_levels(
    facts: RunFacts,
    cost: float,
    rto: float,
    mtbf: float,
    tau_now: float | None,
    step_s: float | None,
    gpus: int,
    share: float | None,
) -> dict[str, Any] | None:
    """A run that saves at tier 0: each level's figures, the tier-0 interval and copy period
    the two-level model advises (`levels`), the waste now and advised, and a simulation."""
    t = facts.tiers()
    if t is None:
        return None

    def figure(
        values: list[float], fallback: float, measured: str, otherwise: str
    ) -> tuple[float, str]:
        if values:
            return statistics.median(values), f"{measured} ({len(values)})"
        return fallback, otherwise

    c0, c0_src = figure(t["c0"], cost, "tier-0 saves", "the run's C_eff")
    c1, c1_src = figure(
        t["c1"], 0.0, "copies measured", "not measured (no step times around the copies): 0"
    )
    lag, lag_src = figure(t["lag"], 0.0, "copies committed", "no copy committed yet: 0")
    r0, r0_src = figure(t["r0"], rto, "restores from tier 0", "no restore from tier 0: the RTO")
    r1, r1_src = figure(
        t["r1"], rto, "restores from the store", "no restore from the store: the RTO"
    )
    n0, n1 = t["failures_tier0"], t["failures_store"]
    if share is not None:
        p, p_src = float(share), "--node-loss-share"
    elif n0 + n1:
        p = (n1 + 0.5) / (n0 + n1 + 1.0)  # smoothed: two failures never say "never"
        p_src = f"measured: {n1} of {n0 + n1} failures restored from the store"
    else:
        p = ASSUMED_NODE_LOSS_SHARE
        p_src = "assumed (no failure yet; give --node-loss-share)"
    lv = levels.Levels(max(c0, MIN_COST_S), c1, lag, r0, r1, mtbf, p)
    tau, k = lv.best()
    young0, young1 = lv.young0(), lv.young1()
    out: dict[str, Any] = {
        "model": "first-order two-level model: tier-0 saves every tau, every k-th copied to "
        "the store; a share p of failures lose a node and restore from the store",
        "c0_s": _r(c0),
        "c0_source": c0_src,
        "c1_s": _r(c1),
        "c1_source": c1_src,
        "lag_s": _r(lag),
        "lag_source": lag_src,
        "r0_s": _r(r0),
        "r0_source": r0_src,
        "r1_s": _r(r1),
        "r1_source": r1_src,
        "failures_tier0": n0,
        "failures_store": n1,
        "node_loss_share": _r(p),
        "node_loss_share_source": p_src,
        "saves": t["saves"],
        "copied": t["copied"],
        "young_tier0_s": _r(young0),
        "young_store_s": _r(young1),
        "advised_tier0_s": _r(tau),
        "advised_tier0_steps": _steps(tau, step_s),
        "advised_copy_every": k,
        "advised_store_s": _r(k * tau),
        "advised_fraction": _r(lv.waste(tau, k), 6),
        "current_tier0_s": _r(tau_now),
        "current_copy_every": t["k_now"],
    }
    simulated, left_out = levels.simulate(lv, tau, k, trials=LEVEL_TRIALS)
    out["simulation"] = {
        "advised_fraction": _r(simulated, 6),
        "model_fraction": out["advised_fraction"],
        "trials": LEVEL_TRIALS,
        "left_out": left_out,
    }
    if tau_now and t["k_now"]:
        now = lv.waste(tau_now, t["k_now"])
        out["current_fraction"] = _r(now, 6)
        out["regret_gpu_hours_per_day"] = _r(
            max(0.0, now - lv.waste(tau, k)) * gpus * model.HOURS_PER_DAY
        )
    out["advice"] = _levels_sentence(out, tau, k, step_s, gpus)
    return out


def _levels_sentence(
    out: dict[str, Any], tau: float, k: int, step_s: float | None, gpus: int
) -> str:
    every = _steps(tau, step_s)
    steps = f" (every {every} steps)" if every else ""
    copy = "copy every save" if k == 1 else f"copy one save in {k}"
    basis = (
        f"tier 0 C {human(out['c0_s'])}, a copy C {human(out['c1_s'])} and lag "
        f"{human(out['lag_s'])}, RTO {human(out['r0_s'])} from tier 0 and "
        f"{human(out['r1_s'])} from the store, {out['node_loss_share']:.0%} of failures "
        "losing a node"
    )
    advice = f"Save at tier 0 every {human(tau)}{steps} and {copy} to the store"
    advice += f" (replicate_every={k})"
    regret = out.get("regret_gpu_hours_per_day")
    if regret:
        advice += f": that saves {regret:.3g} GPU-hours a day on {gpus} GPU(s)"
    return f"{advice} ({basis})."


def _event(f: Any) -> dict[str, Any]:
    return {
        "kind": f.kind,
        "restored_step": f.restored_step,
        "reached_step": f.reached_step,
        "lost_steps": f.lost_steps,
        "lost_s": _r(f.lost_seconds),
    }


def choose_mtbf(
    pool: list[RunFacts], gpus: int, mtbf_s: float | None, *, fleet: bool
) -> tuple[float, dict[str, Any]]:
    """The job's MTBF (seconds) and how it was chosen: --mtbf; else the measured failures (the
    pooled runs' with --fleet when they have any, else the run's own) when there are some in
    some exposure; else the prior ASSUMED_MTBF_S. With no failure the
    confidence bound on the rate is shown as a range, never used as the advice: it shrinks
    with every clean hour's lack of data and would always say "checkpoint more often".
    `reg advise` and the MLflow metric (`summary`) both choose here."""
    own = pool[:1]
    n_pool = sum(len(f.failures()) for f in pool)
    h_pool = sum(f.gpu_seconds() for f in pool) / 3600.0
    n_own = sum(len(f.failures()) for f in own)
    h_own = sum(f.gpu_seconds() for f in own) / 3600.0
    n, gpu_hours = (n_pool, h_pool) if fleet else (n_own, h_own)
    doc: dict[str, Any] = {
        "pooled_runs": len(pool) if fleet else 1,
        "exposure_gpu_hours": _r(gpu_hours, 6),
        "rate_per_gpu_hour": None,
        "rate_low": None,
        "rate_high": None,
        "confidence": CONFIDENCE,
    }
    if gpu_hours > 0:
        rate = model.failure_rate(n, gpu_hours, CONFIDENCE)
        doc |= {
            "rate_per_gpu_hour": _r(rate.point, 6),
            "rate_low": _r(rate.low, 6),
            "rate_high": _r(rate.high, 6),
            # the MTBF the data allow, at CONFIDENCE (the high end is None with no failure)
            "mtbf_high_s": _r(model.mtbf_of(rate.low, gpus)),
            "mtbf_low_s": _r(model.mtbf_of(rate.high, gpus)),
        }
    if mtbf_s is not None:
        return mtbf_s, doc | {"mtbf_s": mtbf_s, "mtbf_source": "--mtbf"}
    # 0 s when the exposure is too small for a float to divide by (then as with none)
    m = model.mtbf_of(n / gpu_hours, gpus) if n > 0 and gpu_hours > 0 else 0.0
    if m > 0:
        where = "the project's runs pooled" if fleet else "the run's failures"
        return m, doc | {"mtbf_s": _r(m), "mtbf_source": f"measured: {where}"}
    why = (
        f"no failure yet in {gpu_hours:.3g} GPU-hours"
        if n == 0
        else f"{n} failure(s) in only {gpu_hours:.3g} GPU-hours"
    )
    bound = doc.get("mtbf_low_s")
    seen = f"; the {CONFIDENCE:.0%} bound puts the MTBF above {human(bound)}" if bound else ""
    return ASSUMED_MTBF_S, doc | {
        "mtbf_s": ASSUMED_MTBF_S,
        "mtbf_source": f"assumed: the prior {human(ASSUMED_MTBF_S)} ({why}{seen}; "
        "give --mtbf, or --fleet to pool the project's runs)",
    }


def _simulate(
    cost: float,
    rto: float,
    mtbf: float,
    best: float,
    tau_now: float | None,
    pool: list[RunFacts],
    gpus: int,
    trials: int,
) -> dict[str, Any]:
    """The exponential check of the formulas, and the waste with the measured failure gaps."""
    analytic = model.waste(best, cost, rto, mtbf)
    simulated = simulate.waste(best, cost, rto, simulate.exponential(mtbf, 0), trials=trials)
    out: dict[str, Any] = {
        "exponential": {
            "interval_s": _r(best),
            "analytic_fraction": _r(analytic, 6),
            "simulated_fraction": _r(simulated, 6),
            "difference_pct": _r(abs(simulated - analytic) / analytic * 100 if analytic else 0.0),
            "trials": trials,
        },
        "measured_gaps": None,
    }
    gaps = [g / gpus for f in pool for g in f.gaps_gpu_seconds()]  # this job's wall seconds
    tails = [f.censored_gpu_seconds() / gpus for f in pool]
    tails = [t for t in tails if t > 0]
    if len(gaps) < MIN_GAPS:
        out["measured_gaps"] = {
            "gaps": len(gaps),
            "skipped": f"too few failures to resample ({len(gaps)}; needs {MIN_GAPS})",
        }
        return out
    sim = simulate.run(
        best, cost, rto, simulate.resampled(gaps, 0, censored_s=tails), trials=trials
    )
    measured: dict[str, Any] = {
        "gaps": len(gaps),
        "censored_gaps": len(tails),
        "censored_s": _r(sum(tails)),
        "gap_median_s": _r(statistics.median(gaps)),
        "advised_fraction": _r(sim.fraction, 6),
        "advised_capped_share": _r(sim.capped_share, 6),
    }
    if tau_now:
        now = simulate.run(
            tau_now, cost, rto, simulate.resampled(gaps, 0, censored_s=tails), trials=trials
        )
        measured["current_fraction"] = _r(now.fraction, 6)
        measured["current_capped_share"] = _r(now.capped_share, 6)
    out["measured_gaps"] = measured
    return out


def _sentence(
    out: dict[str, Any],
    cost: float,
    rto: float,
    mtbf: float,
    best: float,
    tau_now: float | None,
    step_s: float | None,
    gpus: int,
) -> str:
    basis = f"C_eff {human(cost)}, RTO {human(rto)}, MTBF {human(mtbf)}"
    every = _steps(best, step_s)
    steps = f" (every {every} steps)" if every else ""
    if not tau_now:
        return f"Checkpoint every {human(best)}{steps} ({basis})."
    if abs(tau_now / best - 1.0) <= NEAR:
        return (
            f"Keep checkpointing every {human(tau_now)}: it is within {NEAR:.0%} of the optimum "
            f"{human(best)} ({basis})."
        )
    regret = out["waste"]["regret_gpu_hours_per_day"]
    lost_now = out["waste"]["lost_per_failure_now_s"]
    lost_best = out["waste"]["lost_per_failure_advised_s"]
    how = "more" if best < tau_now else "less"
    return (
        f"Checkpoint {how} often, every {human(best)}{steps} instead of {human(tau_now)}: "
        f"that saves {regret:.3g} GPU-hours a day on {gpus} GPU(s), and the expected loss per "
        f"failure goes from {human(lost_now)} to {human(lost_best)} ({basis})."
    )


def _steps(seconds: float, step_s: float | None) -> int | None:
    """An interval in training steps (at least 1); None without a (usable) step time."""
    if not step_s:
        return None
    steps = seconds / step_s
    return max(1, round(steps)) if math.isfinite(steps) else None


def human(seconds: float) -> str:
    if math.isinf(seconds):
        return "never"
    if seconds < 1:
        return f"{seconds * 1000:.0f}ms"
    if seconds < 120:
        return f"{seconds:.1f}s"
    if seconds < 7200:
        return f"{seconds / 60:.1f}min"
    if seconds < 172800:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 86400:.1f}d"


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _r(value: float | None, digits: int = 4) -> float | None:
    if value is None or not math.isfinite(value):
        return None
    return round(value, digits)


def summary(facts: RunFacts) -> dict[str, float]:
    """The figures mirrored to MLflow: C_eff, RTO and the advised interval, chosen as
    `reg advise RUN` (no flags) chooses it."""
    c_eff, _, _, _ = facts.costs()
    rto = facts.rto()
    out: dict[str, float] = {}
    if c_eff:
        out["c_eff_s"] = round(statistics.median(c_eff), 4)
    if rto:
        out["rto_s"] = round(float(rto["median_s"]), 4)
    if c_eff:
        mtbf, _ = choose_mtbf([facts], max(1, _world(facts)), None, fleet=False)
        out["advised_interval_s"] = round(model.optimal(statistics.median(c_eff), mtbf), 2)
    return out


def _world(facts: RunFacts) -> int:
    for row in reversed(facts.checkpoints):
        if row.world_size:
            return int(row.world_size)
    return 1
