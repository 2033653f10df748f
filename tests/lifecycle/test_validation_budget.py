"""Validation within --memory-budget, measured: `reg validate` runs as a child process and its
peak RSS is read with wait4 (ru_maxrss, through a small launcher: see LAUNCHER).

The checkpoints are real: written by 2 torchrun ranks through DCP (bench/make_checkpoint.py),
float32 matrices sharded Shard(0) with their AdamW state. The stated overhead is what the same
command peaks at on a tiny checkpoint with the same budget (the interpreter, torch, the catalog),
plus the store's read pieces (8 MiB per worker, two workers).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from tests import helpers, tamper
from tests.conftest import ROOT
from tests.sharing import build_once

# Peak-memory measurements: nothing else runs beside them (tests/sharing.py).
pytestmark = pytest.mark.exclusive

MiB = 2**20
WORKERS = 2
READ_PIECES = 2 * 8 * MiB * WORKERS  # a piece being hashed and the next, per worker


def make(out: Path, gib: float, dim: int, *extra: str) -> Path:
    helpers.torchrun(
        "bench.make_checkpoint",
        2,
        ["--out", str(out), "--gib", str(gib), "--dim", str(dim), *extra],
        clean=out,
    )
    return out


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """About 260 MiB: 1024x1024 float32 layers and their AdamW state, and one 1 MiB weight
    saved as a transposed view (a chunk that cannot stream: it is held whole)."""
    return build_once(
        tmp_path_factory,
        "budget-big",
        lambda base: make(base / "ckpt", 0.25, 1024, "--transposed", "512"),
    )


@pytest.fixture(scope="module")
def poisoned(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """About 40 MiB with a NaN as the very last element of the last rank's last weight."""
    return build_once(
        tmp_path_factory,
        "budget-poisoned",
        lambda base: make(base / "ckpt", 0.04, 512, "--poison-last"),
    )


def size_of(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.iterdir())


# A child's ru_maxrss starts at its parent's RSS when it forks (and exec keeps it): forked from
# a pytest process of 2 GB, every child "peaks" at 2 GB. A small launcher process forks the
# command instead and reports its rusage.
LAUNCHER = """
import os, subprocess, sys
child = subprocess.Popen(sys.argv[2:])
_, status, usage = os.wait4(child.pid, 0)
with open(sys.argv[1], "w") as f:
    f.write(f"{os.waitstatus_to_exitcode(status)} {usage.ru_maxrss * 1024}")
"""


def reg_peak(*args: str) -> tuple[int, str, str, int]:
    """(exit code, stdout, stderr, peak RSS in bytes) of `reg ARGS` in a child process."""
    env = dict(os.environ, REG_WORKERS=str(WORKERS))
    with (
        tempfile.TemporaryFile("w+") as out,
        tempfile.TemporaryFile("w+") as err,
        tempfile.NamedTemporaryFile("r") as report,
    ):
        cmd = [sys.executable, "-c", LAUNCHER, report.name, sys.executable, "-m", "cli", *args]
        subprocess.run(cmd, cwd=ROOT, env=env, stdout=out, stderr=err, check=True, timeout=600)
        code, peak = map(int, Path(report.name).read_text().split())
        out.seek(0)
        err.seek(0)
        return code, out.read(), err.read(), peak


def push(cli: Any, directory: Path, run: str) -> str:
    pushed = cli("push-ckpt", directory, "--project", "p", "--run", run, "--step", "1")
    assert pushed.returncode == 0, pushed.stderr
    return f"p/{run}@step1"


def checks(stdout: str) -> dict[str, dict[str, Any]]:
    """The validation's checks from `--json` (a failure adds its error document as a second
    line)."""
    return {c["name"]: c for c in json.loads(stdout.splitlines()[0])["checks"]}


def test_a_checkpoint_four_times_the_budget_validates_within_it(big, ckpts, cli):
    budget = 48 * MiB
    assert size_of(big) >= 4 * budget + 60 * MiB
    tiny = push(cli, ckpts.ws2.step_dir(2), "tiny")
    code, _, err, baseline = reg_peak(
        "validate", tiny, "--device", "cpu", "--memory-budget", "48MiB", "--json"
    )
    assert code == 0, err

    ref = push(cli, big, "big")
    code, out, err, peak = reg_peak(
        "validate", ref, "--device", "cpu", "--memory-budget", "48MiB", "--json"
    )
    assert code == 0, err
    found = checks(out)
    assert "within --memory-budget 48.0 MiB" in found["restore"]["detail"]
    assert json.loads(out)["mode"] == "streamed"
    grew = peak - baseline
    assert grew <= budget + READ_PIECES, (
        f"peak {peak / MiB:.0f} MiB is {grew / MiB:.0f} MiB over the tiny checkpoint's "
        f"{baseline / MiB:.0f} MiB; the budget allows {(budget + READ_PIECES) / MiB:.0f}"
    )

    # The bound is real: with a budget above the checkpoint's size the batches grow with it.
    code, _, err, roomy = reg_peak(
        "validate", ref, "--device", "cpu", "--memory-budget", "1GiB", "--json"
    )
    assert code == 0, err
    assert roomy > peak + 64 * MiB, (roomy / MiB, peak / MiB)


def test_a_nan_in_the_last_element_is_found_with_a_small_budget(poisoned, cli):
    ref = push(cli, poisoned, "nan")
    code, out, err, _ = reg_peak(
        "validate", ref, "--device", "cpu", "--memory-budget", "16MiB", "--json"
    )
    assert code == 1, err
    finite = checks(out)["finite"]
    assert not finite["passed"]
    assert "weight (1 non-finite, NaN)" in finite["detail"], finite
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_a_tampered_file_is_named_and_nothing_else_is_judged(big, cli, clean_env):
    from registry.api.contract import Registry

    ref = push(cli, big, "tampered")
    with Registry() as reg:
        store = reg.store
        key = "ckpt/p/tampered/step-1/__1_0.distcp"
        tamper.flip_byte(store, key, len(store.get_bytes(key)) - 100)
    code, out, err, _ = reg_peak(
        "validate", ref, "--device", "cpu", "--memory-budget", "32MiB", "--json"
    )
    assert code == 1
    found = checks(out)
    assert "__1_0.distcp is not the file that was pushed (sha256" in found["integrity"]["detail"]
    assert set(found) == {"integrity", "resume_state"}  # no verdict on bytes that were not pushed
    assert "__1_0.distcp" in err and "Traceback" not in err


def test_a_chunk_that_cannot_stream_and_exceeds_the_budget_is_refused_by_name(big, cli):
    ref = push(cli, big, "held")
    code, out, err, _ = reg_peak(
        "validate", ref, "--device", "cpu", "--memory-budget", "16MiB", "--json"
    )
    assert code == 1
    restore = checks(out)["restore"]
    assert not restore["passed"]
    assert "model.transposed.weight in __" in restore["detail"]
    assert "(1.0 MiB) is not a plain tensor" in restore["detail"]
    assert "needs --memory-budget 24.0 MiB or more" in restore["detail"]
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_a_budget_too_small_or_malformed_is_a_usage_error(ckpts, cli):
    ref = push(cli, ckpts.ws2.step_dir(2), "usage")
    for bad in ("1MiB", "lots", "-5GB"):
        got = cli("validate", ref, "--device", "cpu", "--memory-budget", bad)
        assert got.returncode == 2, (bad, got.stderr)
        assert "--memory-budget" in got.stderr and "Traceback" not in got.stderr


@pytest.mark.cuda
@helpers.needs_cuda
def test_cuda_batches_check_every_tensor_and_find_the_nan(big, poisoned, cli):
    ref = push(cli, big, "cuda-big")
    got = cli("validate", ref, "--device", "cuda", "--memory-budget", "64MiB", "--json")
    assert got.returncode == 0, got.stderr
    out = json.loads(got.stdout)
    assert out["device"] == "cuda" and out["mode"] == "streamed" and out["driver"], out
    assert (
        "on cuda in batches within --memory-budget 64.0 MiB"
        in checks(got.stdout)["restore"]["detail"]
    )
    bad = cli("validate", push(cli, poisoned, "cuda-nan"), "--device", "cuda", "--json")
    assert bad.returncode == 1
    assert "weight (1 non-finite, NaN)" in checks(bad.stdout)["finite"]["detail"]


@pytest.mark.cuda
@helpers.needs_cuda
def test_cuda_out_of_memory_is_a_failed_check_naming_the_budget(reg, ckpts):
    """The GPU nearly full (another job's memory): the batches do not fit, and the check says
    which budget to try instead of a traceback."""
    import torch

    reg.push_checkpoint(ckpts.ws2.step_dir(4), run="oom", step=4)
    free, _ = torch.cuda.mem_get_info()
    hog = torch.empty(max(0, free - 96 * MiB), dtype=torch.uint8, device="cuda")
    try:
        out = reg.validate("oom@step4", device="cuda", memory_budget="4GiB")
    finally:
        del hog
        torch.cuda.empty_cache()
    restore = {c["name"]: c for c in out["checks"]}["restore"]
    assert not out["passed"] and not restore["passed"]
    assert "out of memory on cuda with --memory-budget 4.0 GiB" in restore["detail"]
    assert "try --memory-budget 2.0 GiB" in restore["detail"]
