"""A Monte Carlo simulator of a job that checkpoints every tau, event by event.

Each trial runs `segments` segments of tau work followed by a checkpoint of cost C. A failure
loses the segment in progress (the work since the last completed checkpoint) and is followed
by a restart of R, itself at risk; the segment is then run again. Failure gaps are drawn either
from an exponential distribution of mean M (the analytic model's assumption: the simulation
then checks the formulas) or resampled, with replacement, from the gaps the job really saw
between failures (a renewal process: what the run would really see). Seeded: the same inputs
give the same figures. A job that cannot finish a segment (every measured gap shorter than a
restart plus a segment) wastes everything: 1.0.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

Draw = Callable[[int], Any]  # n -> n failure gaps (a numpy array)
MAX_ROUNDS = 1000  # failures in a row before a segment (or a restart) is taken as impossible


def exponential(mtbf_s: float, seed: int = 0) -> Draw:
    import numpy as np

    rng = np.random.default_rng(seed)
    return lambda n: rng.exponential(mtbf_s, n)


def resampled(gaps_s: Sequence[float], seed: int = 0) -> Draw:
    import numpy as np

    rng = np.random.default_rng(seed)
    pool = np.asarray([g for g in gaps_s if g > 0], dtype=float)
    if pool.size == 0:
        raise ValueError("resampled needs at least one positive gap")
    return lambda n: rng.choice(pool, n, replace=True)


def waste(
    tau_s: float,
    cost_s: float,
    rto_s: float,
    draw: Draw,
    *,
    trials: int = 2000,
    segments: int = 200,
) -> float:
    """The simulated waste: 1 - kept work / wall time, over every trial together."""
    import numpy as np

    if tau_s <= 0:
        return 1.0
    length = tau_s + cost_s
    wall = np.zeros(trials)
    until_failure = draw(trials)  # time left until each trial's next failure
    for _ in range(segments):
        todo = np.ones(trials, dtype=bool)  # the trials whose segment is not done yet
        rounds = 0
        while todo.any():
            rounds += 1
            if rounds > MAX_ROUNDS:
                return 1.0  # no progress: the gaps never cover a restart and a segment
            idx = np.flatnonzero(todo)
            left = until_failure[idx]
            ok = left >= length
            done = idx[ok]
            wall[done] += length
            until_failure[done] -= length
            todo[done] = False
            failed = idx[~ok]
            if failed.size == 0:
                break
            wall[failed] += until_failure[failed]  # the work lost
            until_failure[failed] = draw(failed.size)
            if not _restart(failed, rto_s, wall, until_failure, draw):
                return 1.0
    kept = tau_s * segments * trials
    return float(1.0 - kept / wall.sum())


def _restart(idx: Any, rto_s: float, wall: Any, until_failure: Any, draw: Draw) -> bool:
    """A restart of R for each trial in idx; one that fails starts over. False: some never
    get through."""
    for _ in range(MAX_ROUNDS):
        if not idx.size:
            return True
        left = until_failure[idx]
        ok = left >= rto_s
        good = idx[ok]
        wall[good] += rto_s
        until_failure[good] -= rto_s
        bad = idx[~ok]
        wall[bad] += until_failure[bad]
        until_failure[bad] = draw(bad.size)
        idx = bad
    return not idx.size
