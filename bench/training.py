"""Checkpoint saves from a training loop (issue 15): `CheckpointManager` against `dcp.save` and
`reg push-ckpt`, synchronous and async, and reg's write throughput by world size.

    python -m bench.training [--gib 0.5] [--repeat 3] [--nproc 2] [--world-sizes 1,2,4]

Every figure comes from torchrun jobs of `bench.training_worker` (random-data model + AdamW
state sharded across ranks, each rank writing about gib/world), each job with a fresh REG_HOME;
in a job the cases alternate, each output deleted and synced before the next; medians.

1. Sync save, the training loop's stall (slowest rank): (a) `manager.save(state, step)`,
   (b) `dcp.save` to a directory + `reg push-ckpt` from rank 0, (c) bare `dcp.save`.
   Ratios (b)/(a) (target >= 1.5x) and (c)/(a) (target >= 0.9x); (t) the tier-0 save
   (`local_dir`, issue 36) to the same disk as (c): (c)/(t) (target >= 0.9x).
2. Async save: the stall, the time until committed (reg) or pushed (`dcp.async_save` + `reg
   push-ckpt`), and a fixed compute step's time while the save persists against before it;
   the same for the tier-0 save (`local_dir`), whose stall is compared with `dcp.async_save`'s.
3. Restore (issue 36), each case's files dropped from the page cache first: `restore()` from
   tier 0 (every node holds its copy), from the store (a replaced node), and a bare
   `dcp.load` of the same state as the baseline.
4. Aggregate write throughput of the sync save at each world size.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from bench.common import PY, ROOT, env, report, rm


def torchrun(work: Path, name: str, nproc: int, args: list[str]) -> dict[str, Any]:
    """One job of the worker under torchrun with a fresh REG_HOME; rank 0's results."""
    home, out, scratch = work / f"home-{name}", work / f"{name}.json", work / f"scratch-{name}"
    rm(home)
    scratch.mkdir(parents=True, exist_ok=True)
    cmd = [PY, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    cmd += ["-m", "bench.training_worker", "--work", str(scratch), "--out", str(out), *args]
    proc = subprocess.run(
        cmd, cwd=ROOT, env=env(home, REG_USER="bench"), capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    result: dict[str, Any] = json.loads(out.read_text())
    rm(home)
    rm(scratch)
    return result


def med(values: list[Any]) -> float:
    return statistics.median(float(v) for v in values if v is not None)


def say(line: str) -> str:
    print(line, flush=True)
    return line


def bench_sync(work: Path, gib: float, repeat: int, nproc: int) -> tuple[list[str], float, int]:
    r = torchrun(
        work, "sync", nproc, ["--mode", "sync", "--gib", str(gib), "--repeat", str(repeat)]
    )
    total = sum(r["bytes_per_rank"])
    lines = [
        say(
            f"sync save, world size {nproc}, {total / 2**30:.2f} GiB of state "
            f"({total / nproc / 2**20:.0f} MiB a rank), median of {repeat}, slowest rank"
        )
    ]
    a, b, c = med(r["a"]), med(r["b"]), med(r["c"])
    lines.append(report("(a) manager.save vs (b) dcp.save+push-ckpt", a, b, "dcp+push"))
    lines.append(report("(a) manager.save vs (c) bare dcp.save", a, c, "dcp.save"))
    lines.append(
        say(
            f"{'  targets':<44} (b)/(a) {b / a:.2f}x (>= 1.5x)   (c)/(a) {c / a:.2f}x (>= 0.9x)"
            f"   runs: a {_list(r['a'])} b {_list(r['b'])} c {_list(r['c'])}"
        )
    )
    persist = med([cost["persist_seconds"] for cost in r["a_costs"]])
    lines.append(say(f"{'  (a) recorded persist_seconds':<44} {persist:.3f}s"))
    t, committed = med(r["t"]), med(r["t_commit"])
    lines.append(report("(t) tier-0 save vs (c) bare dcp.save", t, c, "dcp.save"))
    lines.append(
        say(
            f"{'  targets':<44} (c)/(t) {c / t:.2f}x (>= 0.9x)   runs: t {_list(r['t'])}   "
            f"until committed at tier 0 {committed:.3f}s"
        )
    )
    return lines, a, total


def bench_async(work: Path, gib: float, repeat: int, nproc: int) -> list[str]:
    r = torchrun(
        work, "async", nproc, ["--mode", "async", "--gib", str(gib), "--repeat", str(repeat)]
    )
    lines = [say(f"async save, world size {nproc}, median of {repeat}")]
    lines.append(
        report("stall (call until return)", med(r["reg_stall"]), med(r["dcp_stall"]), "dcp.async")
    )
    lines.append(
        report(
            "until committed / pushed",
            med(r["reg_persist"]),
            med(r["dcp_persist"]),
            "async+push",
        )
    )
    lines.append(
        say(
            f"{'  recorded save_costs':<44} stall_seconds {med(r['reg_recorded_stall']):.3f}s"
            f"   persist_seconds {med(r['reg_recorded_persist']):.3f}s"
        )
    )
    lines.append(
        report(
            "tier-0 stall vs dcp.async_save's",
            med(r["tier_stall"]),
            med(r["dcp_stall"]),
            "dcp.async",
        )
    )
    lines.append(
        say(
            f"{'  tier 0, until committed there':<44} {med(r['tier_persist']):.3f}s"
            f"   runs: tier {_list(r['tier_stall'])} dcp {_list(r['dcp_stall'])}"
        )
    )
    for who, name in (
        ("reg", "reg"),
        ("tier", "reg, tier 0"),
        ("dcp", "dcp.async_save + push-ckpt"),
    ):
        outside, during = med(r[f"{who}_outside"]), _med_or_nan(r[f"{who}_during"])
        lines.append(
            say(
                f"{'  step time, ' + name:<44} outside {outside * 1e3:6.1f}ms   during "
                f"{during * 1e3:6.1f}ms   ({during / outside:.2f}x, "
                f"{len(r[f'{who}_during'])} steps during)"
            )
        )
    return lines


def bench_restore(work: Path, gib: float, repeat: int, nproc: int) -> list[str]:
    r = torchrun(
        work, "restore", nproc, ["--mode", "restore", "--gib", str(gib), "--repeat", str(repeat)]
    )
    total = sum(r["bytes_per_rank"])
    lines = [
        say(
            f"restore, world size {nproc}, {total / 2**30:.2f} GiB, cold page cache, median of "
            f"{repeat}, slowest rank"
        )
    ]
    r0, r1, rd = med(r["r0"]), med(r["r1"]), med(r["rd"])
    lines.append(report("restore from tier 0 vs bare dcp.load", r0, rd, "dcp.load"))
    lines.append(report("restore from the store vs bare dcp.load", r1, rd, "dcp.load"))
    local = med(r["r0_local_bytes"]) if r["r0_local_bytes"] else 0.0
    lines.append(
        say(
            f"{'  tier 0 vs the store':<44} {r1 / r0:.2f}x   runs: r0 {_list(r['r0'])} "
            f"r1 {_list(r['r1'])} dcp {_list(r['rd'])}   tier 0 read {local / 2**20:.0f} MiB "
            "locally (slowest rank)"
        )
    )
    return lines


def bench_throughput(
    work: Path, gib: float, repeat: int, sizes: list[int], known: dict[int, tuple[float, int]]
) -> list[str]:
    lines = [say(f"reg sync save, aggregate write throughput (median of {repeat}, slowest rank)")]
    for ws in sizes:
        if ws in known:
            seconds, total = known[ws]
            how = "(from the sync run)"
        else:
            r = torchrun(
                work,
                f"ws{ws}",
                ws,
                ["--mode", "sync", "--cases", "a", "--gib", str(gib), "--repeat", str(repeat)],
            )
            seconds, total = med(r["a"]), sum(r["bytes_per_rank"])
            recorded = med([c["persist_seconds"] for c in r["a_costs"]])
            how = f"(recorded persist_seconds {recorded:.3f}s)"
        lines.append(
            say(
                f"  world size {ws}: {total / 2**30:.2f} GiB in {seconds:.3f}s = "
                f"{total / seconds / 1e6:7.1f} MB/s {how}"
            )
        )
    return lines


def _med_or_nan(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _list(values: list[float]) -> str:
    return "/".join(f"{v:.2f}" for v in values)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, default=0.5)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=2, help="world size of parts 1 and 2")
    parser.add_argument("--world-sizes", default="1,2,4", help="part 3")
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument(
        "--skip", default="", help="comma-separated: sync, async, restore, throughput"
    )
    args = parser.parse_args()
    skip = set(args.skip.split(","))
    work = args.work or Path(tempfile.mkdtemp(prefix="reg-bench-", dir=ROOT / "bench"))
    known: dict[int, tuple[float, int]] = {}
    try:
        if "sync" not in skip:
            _, a, total = bench_sync(work, args.gib, args.repeat, args.nproc)
            known[args.nproc] = (a, total)
        if "async" not in skip:
            bench_async(work, args.gib, args.repeat, args.nproc)
        if "restore" not in skip:
            bench_restore(work, args.gib, args.repeat, args.nproc)
        if "throughput" not in skip:
            sizes = [int(s) for s in args.world_sizes.split(",") if s]
            bench_throughput(work, args.gib, args.repeat, sizes, known)
    finally:
        if args.work is None:
            rm(work)


if __name__ == "__main__":
    main()
