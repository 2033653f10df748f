"""A Monte Carlo simulator of a job that checkpoints every tau, event by event.

Each trial runs `segments` segments of tau work followed by a checkpoint of cost C. A failure
loses the segment in progress (the work since the last completed checkpoint) and is followed
by a restart of R, itself at risk; the segment is then run again. Failure gaps are drawn either
from an exponential distribution of mean M (the analytic model's assumption: the simulation
then checks the formulas) or resampled, with replacement, from the gaps the job really saw
between failures (a renewal process: what the run would really see), the run's failure-free
tail counted as survival. Seeded: the same inputs give the same figures. A trial that cannot
finish a segment (MAX_ROUNDS failures in a row) is left out and counted: `capped_share`. The
whole simulation is bounded too (MAX_STEPS vectorised steps, a few seconds at most): gaps
shorter than a restart made one `reg advise` run for minutes, a request any viewer can send to
the server; a trial still in a segment at the bound is left out and counted the same way, and
the others count the segments they completed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

Draw = Callable[[int], Any]  # n -> n failure gaps (a numpy array)
MAX_ROUNDS = 1000  # failures in a row before a segment (or a restart) is taken as impossible
MAX_STEPS = 50_000  # vectorised steps in one run (segments, failures and restarts together)


def exponential(mtbf_s: float, seed: int = 0) -> Draw:
    import numpy as np

    rng = np.random.default_rng(seed)
    return lambda n: rng.exponential(mtbf_s, n)


def resampled(gaps_s: Sequence[float], seed: int = 0, *, censored_s: Sequence[float] = ()) -> Draw:
    """Failure gaps drawn with replacement from the measured ones. `censored_s`: failure-free
    stretches that ended without a failure (the run's time since its last failure): drawing
    one counts it as survival and draws again, so a clean tail lengthens the gaps (the
    renewal analogue of the exposure / failures estimate) instead of being dropped."""
    import numpy as np

    rng = np.random.default_rng(seed)
    done = np.asarray([g for g in gaps_s if g > 0], dtype=float)
    if done.size == 0:
        raise ValueError("resampled needs at least one positive gap")
    tail = np.asarray([g for g in censored_s if g > 0], dtype=float)
    values = np.concatenate([done, tail])
    is_censored = np.concatenate([np.zeros(done.size, bool), np.ones(tail.size, bool)])

    def draw(n: int) -> Any:
        pick = rng.integers(0, values.size, n)
        out = values[pick].copy()
        open_ = is_censored[pick]
        for _ in range(MAX_ROUNDS):  # a censored draw survives it, then draws again
            if not open_.any():
                break
            idx = np.flatnonzero(open_)
            pick = rng.integers(0, values.size, idx.size)
            out[idx] += values[pick]
            open_[idx] = is_censored[pick]
        return out

    return draw


@dataclass(frozen=True)
class Simulated:
    fraction: float  # the waste over the trials that finished
    capped_share: float  # trials that hit MAX_ROUNDS (no progress: their gaps never cover a
    # restart and a segment), left out of `fraction`; 1.0 when every trial did (fraction 1.0)


def waste(
    tau_s: float,
    cost_s: float,
    rto_s: float,
    draw: Draw,
    *,
    trials: int = 2000,
    segments: int = 200,
) -> float:
    """The simulated waste: 1 - kept work / wall time, over the trials that finished."""
    return run(tau_s, cost_s, rto_s, draw, trials=trials, segments=segments).fraction


def run(
    tau_s: float,
    cost_s: float,
    rto_s: float,
    draw: Draw,
    *,
    trials: int = 2000,
    segments: int = 200,
) -> Simulated:
    """The simulated waste and the share of trials that made no progress (hit the cap)."""
    import numpy as np

    if tau_s <= 0:
        return Simulated(1.0, 0.0)
    length = tau_s + cost_s
    wall = np.zeros(trials)
    completed = np.zeros(trials)  # segments each trial got through
    stuck = np.zeros(trials, dtype=bool)
    until_failure = draw(trials)  # time left until each trial's next failure
    budget = [MAX_STEPS]
    for _ in range(segments):
        todo = ~stuck  # the trials whose segment is not done yet
        rounds = 0
        while todo.any():
            rounds += 1
            budget[0] -= 1
            if rounds > MAX_ROUNDS or budget[0] < 0:
                stuck |= todo  # no progress: the gaps never cover a restart and a segment
                break
            idx = np.flatnonzero(todo)
            left = until_failure[idx]
            ok = left >= length
            done = idx[ok]
            wall[done] += length
            until_failure[done] -= length
            completed[done] += 1
            todo[done] = False
            failed = idx[~ok]
            if failed.size == 0:
                break
            wall[failed] += until_failure[failed]  # the work lost
            until_failure[failed] = draw(failed.size)
            never = _restart(failed, rto_s, wall, until_failure, draw, budget)
            stuck[never] = True
            todo[never] = False
        if budget[0] < 0:  # the bound: what has not finished its segments is left out
            break
    finished = ~stuck
    capped = float(stuck.mean())
    if not finished.any():
        return Simulated(1.0, capped)
    kept = tau_s * float(completed[finished].sum())
    return Simulated(float(1.0 - kept / wall[finished].sum()), capped)


def _restart(
    idx: Any, rto_s: float, wall: Any, until_failure: Any, draw: Draw, budget: list[int]
) -> Any:
    """A restart of R for each trial in idx; one that fails starts over. The trials that never
    got through (after MAX_ROUNDS tries, or when the run's budget of steps is spent)."""
    for _ in range(MAX_ROUNDS):
        if not idx.size:
            return idx
        budget[0] -= 1
        if budget[0] < 0:
            return idx
        left = until_failure[idx]
        ok = left >= rto_s
        good = idx[ok]
        wall[good] += rto_s
        until_failure[good] -= rto_s
        bad = idx[~ok]
        wall[bad] += until_failure[bad]
        until_failure[bad] = draw(bad.size)
        idx = bad
    return idx
