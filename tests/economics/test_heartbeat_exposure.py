"""Issue 32: heartbeats cannot add exposure faster than wall time (200 in a burst add at most
the burst's duration; before, each could add its elapsed time plus 600 s: 1.4 days for 200),
and gpu_seconds is priced at the world size the registry knows for the run (its newest saved
checkpoint's), never the heartbeat's claim (10^6 GPUs: 33 M GPU-hours before). Embedded on
SQLite and PostgreSQL, and through `reg server` with the beats sent from 8 threads at once.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from registry import Registry

BEATS = 200
WORLD = 8  # the world size the pushed checkpoint records
SLACK_S = 0.05  # clock reads and the 4-digit rounding of each beat's answer


def _dcp(path: Path) -> Path:
    """A one-file DCP checkpoint, written in this process."""
    import torch
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no process group: "assuming a single process"
        dcp.save({"model": {"w": torch.ones(16)}}, checkpoint_id=str(path))
    return path


def _beat(send: Callable[[dict[str, Any]], dict[str, Any]], i: int) -> dict[str, Any]:
    """What the issue saw: an hour at risk claimed per call, on a million GPUs."""
    return send({"step": i, "seconds": 3600.0, "world_size": 10**6})


def _exposure_gpu_s(reg: Registry, run: str, project: str) -> float:
    return float(reg.advise(run, project=project)["failures"]["exposure_gpu_hours"]) * 3600.0


def _check_burst(answers: list[dict[str, Any]], elapsed: float, gpu_s: float) -> None:
    assert all(a["recorded"] and a["world_size"] == WORLD for a in answers)
    added = sum(a["seconds"] for a in answers)
    # Unbounded, each beat added up to its elapsed time + 600 s (1.4 days for 200).
    assert 0 < added <= elapsed + SLACK_S, (added, elapsed)
    # each answer's seconds has 4 digits, the document's GPU-hours 6
    assert gpu_s == pytest.approx(added * WORLD, abs=len(answers) * 5e-5 * WORLD + 0.002)


def test_a_burst_of_heartbeats_adds_at_most_wall_time_embedded(
    reg: Registry, tmp_path: Path
) -> None:
    """On SQLite and PostgreSQL (the `reg` fixture)."""
    reg.claim_checkpoint("fresh", 1)  # a run with a claim and nothing saved: no world size yet
    assert reg.heartbeat("fresh", step=1, seconds=10.0, world_size=4) == {"recorded": False}

    started = time.time()
    reg.push_checkpoint(_dcp(tmp_path / "ck"), run="hb", step=1, world_size=WORLD)
    answers = [_beat(lambda doc: reg.heartbeat("hb", **doc), i) for i in range(BEATS)]
    elapsed = time.time() - started
    _check_burst(answers, elapsed, _exposure_gpu_s(reg, "hb", "default"))
    # The field may be left out (it is ignored either way); a claim of 1 is no smaller either.
    assert reg.heartbeat("hb", step=1, seconds=1.0)["world_size"] == WORLD
    assert reg.heartbeat("hb", step=1, seconds=1.0, world_size=1)["world_size"] == WORLD
    from registry.catalog import queries

    with reg.context.catalog.session() as s:
        row = queries.find_run(s, "default", "hb")
        assert row is not None and row.train_seconds is not None
        assert row.train_seconds <= time.time() - started
        assert row.gpu_seconds == pytest.approx(row.train_seconds * WORLD)


@pytest.mark.timeout(300)
def test_a_concurrent_burst_through_the_server_adds_at_most_wall_time(
    reg_server: Any, tmp_path: Path
) -> None:
    """A trainer (alice, team-a) sends the 200 beats from 8 threads at once: each is added
    under the run's lock, so none counts a stretch another already did."""
    started = time.time()
    with Registry() as admin:
        admin.push_checkpoint(
            _dcp(tmp_path / "ck"), run="hb", step=1, project="team-a", world_size=WORLD
        )
    headers = {"authorization": f"Bearer {reg_server.token('alice')}"}
    with httpx.Client(base_url=reg_server.url, headers=headers, timeout=60) as client:

        def send(doc: dict[str, Any]) -> dict[str, Any]:
            r = client.post("/v1/runs/heartbeat", json={"project": "team-a", "run": "hb", **doc})
            assert r.status_code == 200, r.text
            return dict(r.json())

        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda i: _beat(send, i), range(BEATS)))
        # The field may be left out (ignored either way), and is still checked when given.
        answers.append(send({"step": 1, "seconds": 1.0}))
        elapsed = time.time() - started
        body = {"project": "team-a", "run": "hb", "step": 1, "seconds": 1.0}
        r = client.post("/v1/runs/heartbeat", json=body | {"world_size": 10**6 + 1})
        assert r.status_code == 400 and r.json()["exit_code"] == 2, r.text
    with Registry() as admin:
        _check_burst(answers, elapsed, _exposure_gpu_s(admin, "hb", "team-a"))
