"""The bounded torture run: registry operations SIGKILLed at random moments and at
named crash points, on local+SQLite, S3 (SeaweedFS over HTTP)+PostgreSQL and through `reg server`,
every invariant checked after each kill and after the rerun (tests/torture/harness.py).

Bounded by count and time: TORTURE_KILLS kills per operation on each backend (default
`local=38,s3pg=12,server=5`: 50 per operation over the two embedded backends, 55 for the four a
client does through reg server; the S3+PostgreSQL cycle costs about 2x the local one, and the
suite's CPU is what CI waits on),
round-robin within TORTURE_BUDGET_S seconds (default 1200, set-up included; the counts end it
sooner: 11 minutes in a CI run where two other xdist workers ran the rest of the suite beside
it, which CPU-bound kill cycles feel), and each operation must reach TORTURE_MIN_PER_OP
(default 50) kills in all. TORTURE_SEED replays a run; a failure
prints its seed and, for each violation, the operation, the iteration, the moment of the kill
and what broke. `python -m bench.torture --n 500` is the large run.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from collections import Counter

import pytest

from tests.conftest import ROOT
from tests.helpers import pg_available
from tests.torture.harness import OPS, format_report

KILLS = os.environ.get("TORTURE_KILLS", "local=38,s3pg=12,server=5")
BUDGET_S = float(os.environ.get("TORTURE_BUDGET_S", "1200"))
MIN_PER_OP = int(os.environ.get("TORTURE_MIN_PER_OP", "50"))  # over the backends, in the budget


@pytest.mark.long
@pytest.mark.timeout(BUDGET_S + 360)  # the budget, the final checks, the session's checkpoints
def test_killed_operations_leave_every_invariant_standing(ckpts, tmp_path):
    if not pg_available():
        pytest.fail("PostgreSQL is not reachable on 127.0.0.1:5432 (.ci/run starts it)")
    seed = int(os.environ.get("TORTURE_SEED") or random.SystemRandom().randrange(10**6))
    out = tmp_path / "report.json"
    cmd = [
        sys.executable,
        "-m",
        "tests.torture.harness",
        "--n",
        KILLS,
        "--seed",
        str(seed),
        "--budget-s",
        str(BUDGET_S),
        # The session's torchrun-written checkpoint (ws=2, FSDP2), as a trainer pushes it.
        "--src",
        str(ckpts.ws2.step_dir(2)),
        "--work",
        str(tmp_path / "work"),
        "--out",
        str(out),
    ]
    proc = subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=BUDGET_S + 240, check=False
    )
    assert out.exists(), (
        f"seed {seed}: the harness ended ({proc.returncode}):\n{proc.stderr[-4000:]}"
    )
    report = json.loads(out.read_text())
    text = format_report(report)
    print(text)
    assert not report["skipped"], text
    per_op: Counter[str] = Counter()
    for name, c in report["campaigns"].items():
        op = name.split(":")[1]
        if op in OPS:
            per_op[op] += c["kills"]
            assert c["reruns"] == c["kills"] or c["violations"], (name, text)
    short = {op: per_op[op] for op in OPS if per_op[op] < MIN_PER_OP}
    assert not short, (
        f"seed {seed}: fewer than {MIN_PER_OP} kills within {BUDGET_S:.0f}s: {short}\n{text}"
    )
    violations = [
        f"{name}: {v.get('where')} [{v.get('phase', '')}] {v.get('what')}"
        for name, c in report["campaigns"].items()
        for v in c["violations"]
    ]
    assert not violations, f"seed {seed} (TORTURE_SEED={seed} replays it):\n" + "\n".join(
        violations
    )
