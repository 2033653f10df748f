"""`reg advise RUN`: checkpoint economics from what the job really paid; `reg recovery` (its
old name, for one release); `reg run restart RUN --planned`."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import typer

from cli.common import JSON_OPTION, open_registry
from cli.render import emit_json, note
from policies.durations import parse_duration
from registry.core.refs import split_run
from registry.errors import RegistryError, UsageError


def advise(
    run: str = typer.Argument(..., help="Run name."),
    project: str = typer.Option("default", "--project", help="Project name."),
    gpus: int | None = typer.Option(
        None, "--gpus", help="GPUs the job runs on (default: its world size); scales regret."
    ),
    mtbf: str | None = typer.Option(
        None, "--mtbf", help="The job's mean time between failures (default: measured)."
    ),
    fleet: bool = typer.Option(
        False, "--fleet", help="Estimate the failure rate from every run of the project."
    ),
    plot: Path | None = typer.Option(
        None, "--plot", help="Write expected waste vs interval to this .svg file."
    ),
    node_loss_share: float | None = typer.Option(
        None,
        "--node-loss-share",
        help="Share of failures that lose a node's local disk, 0 to 1 (runs saving at tier 0; "
        "default: measured from its restores).",
    ),
    json_output: bool = JSON_OPTION,
) -> None:
    """Checkpoint economics of a run from what it paid: C_eff, RTO, failures, the optimum
    interval (Young, Daly, availability), waste, regret and one sentence of advice. A run
    that saves at tier 0 (`local_dir`) also gets each level's figures and the tier-0 interval
    and copy period (`replicate_every`) the two-level model advises."""
    from registry.economics.advise import MAX_GPUS

    mtbf_s = _mtbf(mtbf) if mtbf is not None else None
    if gpus is not None and not 1 <= gpus <= MAX_GPUS:
        raise UsageError(f"--gpus must be an integer from 1 to {MAX_GPUS}, got {gpus}")
    if plot is not None and plot.suffix.lower() != ".svg":
        raise UsageError(f"--plot writes SVG: name the file *.svg, not {plot.name}")
    with open_registry() as reg:
        out = reg.advise(
            run,
            project=project,
            gpus=gpus,
            mtbf_s=mtbf_s,
            fleet=fleet,
            node_loss_share=node_loss_share,
        )
    if plot is not None:
        _plot(out.to_json(), plot)
    if json_output:
        emit_json(out)
    else:
        render(out.to_json())
    if plot is not None and not json_output:
        print(f"plot: {plot}")


def _mtbf(text: str) -> float:
    """--mtbf: a duration from MIN_MTBF_S to MAX_MTBF_S; the error suggests only what it
    takes."""
    from registry.economics.advise import MAX_MTBF_S, MIN_MTBF_S

    problem = "--mtbf must be a duration from 1s to 100 years, like '24h', '90m' or '30d'"
    try:
        seconds = parse_duration(text)
    except ValueError:
        raise UsageError(f"{problem}, got {text!r}") from None
    if not MIN_MTBF_S <= seconds <= MAX_MTBF_S or not math.isfinite(seconds):
        raise UsageError(f"{problem}, got {text!r}")
    return seconds


def recovery(
    run: str = typer.Argument(..., help="Run name."),
    project: str = typer.Option("default", "--project", help="Project name."),
    mtbf: str | None = typer.Option(None, "--mtbf", help="Mean time between failures."),
    json_output: bool = JSON_OPTION,
) -> None:
    """Deprecated: use `reg advise` (this alias goes in the next release)."""
    mtbf_s = _mtbf(mtbf) if mtbf is not None else None
    with open_registry() as reg:
        out = reg.recovery(run, project=project, mtbf_s=mtbf_s)
    if json_output:
        emit_json(out)  # the new document with the old keys (advice: a list) for this release
    else:
        render(out.to_json() | {"advice": out.advice_sentence or ""})
    # After the output, so that an error stays one line.
    note("`reg recovery` is deprecated and goes in the next release: use `reg advise`")


def restart(
    run: str = typer.Argument(..., help="RUN or PROJECT/RUN."),
    planned: bool = typer.Option(
        False, "--planned", help="The next restore is a planned restart, not a failure."
    ),
    json_output: bool = JSON_OPTION,
) -> None:
    """Announce a planned restart of a run (before stopping the job): `reg advise` does not
    count its next restore as a failure."""
    if not planned:
        raise UsageError(
            "say --planned: only a planned restart is announced", "reg run restart RUN --planned"
        )
    project, name = split_run(run)
    with open_registry() as reg:
        out = reg.plan_restart(name, project=project)
    if json_output:
        emit_json(out)
    else:
        print(f"{project}/{name}: the next restore is a planned restart")


def _plot(out: dict[str, Any], path: Path) -> None:
    from registry.economics.plot import svg

    c = out.get("c_eff") or {}
    waste = out.get("waste") or {}
    interval = out.get("interval") or {}
    if c.get("median_s") is None or not interval.get("advised_s"):
        raise RegistryError(
            f"{out['run']}: nothing measured to plot", "save from the training loop first"
        )
    document = svg(
        cost_s=float(waste.get("cost_s") or c["median_s"]),  # the model's (a floor for ~0)
        rto_s=float((out.get("rto") or {}).get("median_s") or 0.0),
        mtbf_s=float(waste["mtbf_s"]),
        gpus=int(out["gpus"]),
        advised_s=float(interval["advised_s"]),
        current_s=interval.get("current_s"),
        title=f"{out['run']}: expected waste vs checkpoint interval",
    )
    try:
        path.write_text(document)
    except OSError as exc:
        raise RegistryError(f"cannot write {path}: {exc.strerror}", "choose another path") from exc


def render(out: dict[str, Any]) -> None:
    """The figures as a table people read, then the advice."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from registry.economics.advise import human

    def h(value: float | None) -> str:
        return "-" if value is None else human(float(value))

    table = Table(title=f"checkpoint economics of {out['run']}", title_justify="left")
    table.add_column("figure", style="bold")
    table.add_column("value")
    c, rto, fail = out["c_eff"], out.get("rto") or {}, out["failures"]
    interval, waste = out.get("interval") or {}, out.get("waste") or {}
    sim = out.get("simulation") or {}
    rows: list[tuple[str, str]] = [
        ("GPUs", f"{out['gpus']} ({out['gpus_source']})"),
        ("step time", h(out.get("step_seconds"))),
        (
            "C_eff (median, p10-p90)",
            f"{h(c['median_s'])} ({h(c['p10_s'])}-{h(c['p90_s'])}) over {c['saves']} saves; "
            f"bare stall {h(c['stall_median_s'])}, interference "
            f"{h(c['interference_median_s'])} [{c['source']}]",
        ),
    ]
    if rto:
        phases = (
            f" = fetch {h(rto['fetch_s'])} + load/reshard {h(rto['load_reshard_s'])} + first "
            f"step {h(rto['first_step_s'])}"
            if rto.get("fetch_s") is not None
            else ""
        )
        rows.append(("RTO (median)", f"{h(rto['median_s'])}{phases} [{rto['source']}]"))
    else:
        rows.append(("RTO", "not measured yet (no restore, no validation)"))
    rows.append(
        (
            "failures",
            f"{fail['count']}, {fail['lost_steps']} steps lost "
            f"({fail['planned_restarts']} planned restarts: not failures)",
        )
    )
    for i, event in enumerate(fail["events"], 1):
        rows.append(
            (
                f"  failure {i}",
                f"reached step {event['reached_step']}, restored {event['restored_step']}: "
                f"lost {event['lost_steps']} steps ({h(event['lost_s'])})",
            )
        )
    for event in fail.get("other_losses") or []:
        rows.append(
            (
                f"  {event['kind']} (not a failure)",
                f"reached step {event['reached_step']}, restored {event['restored_step']}: "
                f"lost {event['lost_steps']} steps ({h(event['lost_s'])})",
            )
        )
    if fail.get("rate_per_gpu_hour") is not None:
        conf = f"{fail['confidence']:.0%}"
        rows.append(
            (
                "failure rate",
                f"{fail['rate_per_gpu_hour']:.4g}/GPU-hour ({conf} CI {fail['rate_low']:.3g}-"
                f"{fail['rate_high']:.3g}) over {fail['exposure_gpu_hours']:.4g} GPU-hours"
                + (f", {fail['pooled_runs']} runs pooled" if fail["pooled_runs"] > 1 else ""),
            )
        )
    rows.append(("MTBF of the job", f"{h(fail.get('mtbf_s'))} [{fail.get('mtbf_source')}]"))
    if fail.get("mtbf_low_s") is not None:
        high = fail.get("mtbf_high_s")
        rows.append(
            (
                f"MTBF range ({fail['confidence']:.0%})",
                f"{h(fail['mtbf_low_s'])} to " + (h(high) if high is not None else "unbounded"),
            )
        )
    if interval.get("current_s") is not None:
        every = interval.get("current_steps")
        rows.append(
            (
                "interval now",
                f"{h(interval['current_s'])}" + (f" (every {every} steps)" if every else ""),
            )
        )
    if "young_s" in interval:
        adv = interval.get("advised_steps")
        rows += [
            ("Young sqrt(2CM)", h(interval["young_s"])),
            ("Daly higher-order", h(interval["daly_s"])),
            (
                "availability optimum",
                h(interval["availability_s"]) + (f" (every {adv} steps)" if adv else ""),
            ),
        ]
    if waste:
        gpd = 24 * out["gpus"]
        if "current_fraction" in waste:
            rows.append(
                (
                    "waste now",
                    f"{waste['current_fraction']:.2%} ({waste['current_fraction'] * gpd:.3g} "
                    "GPU-h/day)",
                )
            )
        rows.append(
            (
                "waste at the optimum",
                f"{waste['advised_fraction']:.2%} "
                f"({waste['advised_fraction'] * gpd:.3g} GPU-h/day)",
            )
        )
        if "regret_gpu_hours_per_day" in waste:
            rows.append(("regret", f"{waste['regret_gpu_hours_per_day']:.3g} GPU-hours/day"))
            rows.append(("lost per failure now", h(waste["lost_per_failure_now_s"])))
        rows.append(("lost per failure at optimum", h(waste["lost_per_failure_advised_s"])))
    if sim:
        e = sim["exponential"]
        rows.append(
            (
                "Monte Carlo, exponential",
                f"{e['simulated_fraction']:.2%} vs analytic {e['analytic_fraction']:.2%} "
                f"({e['difference_pct']:.2f}% apart, {e['trials']} trials)",
            )
        )
        m = sim.get("measured_gaps")
        if not m:
            measured = "no failure gaps measured yet"
        elif m.get("skipped"):
            measured = str(m["skipped"])
        else:
            now = m.get("current_fraction")
            measured = (
                (f"waste {now:.2%} now, " if now is not None else "")
                + f"{m['advised_fraction']:.2%} at the optimum ({m['gaps']} gaps, median "
                f"{h(m['gap_median_s'])}, and a failure-free tail of {h(m['censored_s'])})"
            )
            capped = max(m.get("advised_capped_share") or 0, m.get("current_capped_share") or 0)
            if capped:
                measured += f"; {capped:.1%} of trials never got through (left out)"
        rows.append(("Monte Carlo, measured gaps", measured))
    rows += _level_rows(out.get("levels"), h)
    for name, value in rows:
        table.add_row(Text(name), Text(value))  # no rich markup: "[source]" is text
    console = Console(file=sys.stdout, width=max(100, Console().width))
    console.print(table)
    console.print(Text(out["advice"]), soft_wrap=True)
    if out.get("levels"):
        console.print(Text(out["levels"]["advice"]), soft_wrap=True)


def _level_rows(lv: dict[str, Any] | None, h: Any) -> list[tuple[str, str]]:
    """The two levels of a run that saves at tier 0."""
    if not lv:
        return []
    every = lv.get("advised_tier0_steps")
    k, now_k = lv["advised_copy_every"], lv.get("current_copy_every")
    rows = [
        ("tier 0: C", f"{h(lv['c0_s'])} [{lv['c0_source']}]"),
        ("copy to the store: C", f"{h(lv['c1_s'])} [{lv['c1_source']}]"),
        ("copy lag", f"{h(lv['lag_s'])} [{lv['lag_source']}]"),
        ("RTO from tier 0", f"{h(lv['r0_s'])} [{lv['r0_source']}]"),
        ("RTO from the store", f"{h(lv['r1_s'])} [{lv['r1_source']}]"),
        (
            "failures losing a node",
            f"{lv['node_loss_share']:.0%} [{lv['node_loss_share_source']}]",
        ),
        ("Young, tier 0 alone", h(lv.get("young_tier0_s"))),
        ("Young, the store alone", h(lv.get("young_store_s"))),
        (
            "two-level optimum",
            f"tier 0 every {h(lv['advised_tier0_s'])}"
            + (f" ({every} steps)" if every else "")
            + (", every save copied" if k == 1 else f", one save in {k} copied")
            + f" (the store every {h(lv['advised_store_s'])})",
        ),
        (
            "two-level waste",
            (
                f"{lv['current_fraction']:.2%} now (one save in {now_k} copied), "
                if "current_fraction" in lv
                else ""
            )
            + f"{lv['advised_fraction']:.2%} at the optimum",
        ),
    ]
    sim = lv.get("simulation") or {}
    if sim.get("advised_fraction") is not None:
        rows.append(
            (
                "two levels, Monte Carlo",
                f"{sim['advised_fraction']:.2%} vs model {sim['model_fraction']:.2%} "
                f"({sim['trials']} trials)",
            )
        )
    return rows
