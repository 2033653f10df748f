"""Retention planning over 100,000 checkpoints in 1,000 runs (target: <= 2 s).

    python -m bench.gc

Measures the pure planner and `reg gc --dry-run` end to end over a SQLite catalog holding them.
"""

from __future__ import annotations

import json
import random
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from bench.common import REG, ROOT, env, rm
from policies.loader import parse_policy
from policies.retention import CheckpointRecord, Protections, plan

POLICY = (
    '[retention]\nkeep_last = 3\nkeep_every_steps = 1000\nttl = "7d"\n'
    'keep_best = { metric = "val_loss", n = 2 }\nmax_bytes = "5PB"\n'
)


def records(n_runs: int = 1000, per_run: int = 100) -> list[CheckpointRecord]:
    rng = random.Random(0)
    now = time.time()
    out = []
    for r in range(n_runs):
        for k in range(per_run):
            out.append(
                CheckpointRecord(
                    len(out) + 1,
                    f"p{r % 10}",
                    f"run{r}",
                    k * 100,
                    now - (per_run - k) * 3600 * 4,
                    10**11,
                    rng.random() < 0.01,
                    {"val_loss": rng.random()},
                )
            )
    return out


def main() -> None:
    recs = records()
    policy = parse_policy(POLICY).retention
    times = []
    for _ in range(5):
        start = time.perf_counter()
        decisions = plan(recs, policy, time.time(), Protections())
        times.append(time.perf_counter() - start)
    deletes = sum(d.action == "delete" for d in decisions)
    print(
        f"plan(): {len(recs):,} checkpoints in 1,000 runs: {statistics.median(times):.2f}s "
        f"median ({deletes:,} deletions; target <= 2s)",
        flush=True,
    )

    work = Path(tempfile.mkdtemp(prefix="reg-bench-gc-", dir=ROOT / "bench"))
    try:
        home = work / "home"
        home.mkdir()
        (home / "policy.toml").write_text(POLICY)
        _populate(home, recs)
        e = env(home)
        wall = []
        for _ in range(3):
            start = time.perf_counter()
            out = subprocess.run(
                [*REG, "gc", "--dry-run", "--json"],
                env=e,
                cwd=ROOT,
                capture_output=True,
                text=True,
                check=True,
            )
            wall.append(time.perf_counter() - start)
        assert len(json.loads(out.stdout)["decisions"]) == len(recs)
        print(
            f"reg gc --dry-run --json over the same catalog: {statistics.median(wall):.2f}s "
            "(CLI, catalog read included)"
        )
    finally:
        rm(work)


def _populate(home: Path, recs: list[CheckpointRecord]) -> None:
    from registry.catalog.engine import Catalog

    cat = Catalog(f"sqlite:///{home / 'catalog.db'}")
    conn = cat._sqlite_connect()
    projects = sorted({r.project for r in recs})
    conn.execute("BEGIN")
    conn.executemany(
        "INSERT INTO project (id, name, created_at) VALUES (?, ?, 0)",
        [(i + 1, p) for i, p in enumerate(projects)],
    )
    runs = sorted({(r.project, r.run) for r in recs})
    run_ids = {key: i + 1 for i, key in enumerate(runs)}
    conn.executemany(
        "INSERT INTO run (id, project_id, name, created_at) VALUES (?, ?, ?, 0)",
        [(run_ids[(p, r)], projects.index(p) + 1, r) for p, r in runs],
    )
    conn.executemany(
        "INSERT INTO checkpoint (id, run_id, step, state, world_size, world_size_inferred, "
        "bytes, file_count, tensor_count, tensor_bytes, resumable, missing_state, "
        "resume_classes, metrics, pinned, created_at, committed_at, pushed_by) VALUES "
        "(?, ?, ?, 'committed', 8, 0, ?, 3, 0, 0, 1, '[]', '{}', ?, ?, ?, ?, 'bench')",
        [
            (
                r.id,
                run_ids[(r.project, r.run)],
                r.step,
                r.bytes,
                json.dumps(r.metrics),
                r.pinned,
                r.committed_at,
                r.committed_at,
            )
            for r in recs
        ],
    )
    conn.execute("COMMIT")
    conn.close()


if __name__ == "__main__":
    main()
