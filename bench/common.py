"""Benchmark plumbing: timing commands, medians, the reg environment, report lines."""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
REG = [PY, "-m", "cli"]


def env(home: Path, **extra: str) -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if not k.startswith(("REG_", "AWS_", "MLFLOW_"))}
    # No MLflow drain in the background: it would take CPU from the next measured run.
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    out.update(REG_HOME=str(home), OMP_NUM_THREADS="1", PYTHONPATH=path, REG_MLFLOW="off", **extra)
    return out


def run(cmd: list[str], environ: dict[str, str] | None = None) -> float:
    """Wall seconds of one command (which must succeed)."""
    return measured(cmd, environ)[0]


def measured(cmd: list[str], environ: dict[str, str] | None) -> tuple[float, Any, str]:
    """Run one command (which must succeed): wall seconds, its own rusage (os.wait4: CPU
    seconds and peak RSS of this child alone), and its stdout."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, env=environ, cwd=ROOT, stdout=out, stderr=err, text=True)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(map(str, cmd[:4]))} failed: {err.read()[-2000:]}")
        return wall, usage, out.read()


def median_of(n: int, fn: Callable[[int], float]) -> float:
    return statistics.median(fn(i) for i in range(n))


def settle(seconds: float = 3.0) -> None:
    """Let the host flush what the last run wrote: this VM's disk acknowledges `sync` from a
    host-side cache, and the next run would otherwise pay for the previous one's writes."""
    subprocess.run(["sync"], check=True)
    time.sleep(seconds)


def evict(*paths: Path) -> None:
    """Data cold, tools warm: flush, then drop these files' pages from the page cache
    (posix_fadvise DONTNEED), leaving Python and its libraries cached as they are in real use."""
    settle()
    for root in paths:
        for f in [root] if root.is_file() else [p for p in root.rglob("*") if p.is_file()]:
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def rm(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def report(
    name: str,
    ours: float,
    base: float,
    base_name: str,
    unit: str = "s",
    higher_is_better: bool = False,
) -> str:
    ratio = (ours / base) if higher_is_better else (base / ours)
    line = f"{name:<44} reg {ours:8.3f}{unit}   {base_name} {base:8.3f}{unit}   ratio {ratio:5.2f}x"
    print(line, flush=True)
    return line
