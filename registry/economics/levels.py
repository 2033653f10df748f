"""Two checkpoint levels: saves at tier 0 (the node's own disk) every tau, every k-th
of them also copied to the store (tier 1). The model and a Monte Carlo check of it, pure
functions of measured figures (no I/O), as `model` is for one level.

Symbols (seconds of the whole job's wall-clock time):
  tau  training time between two tier-0 saves          k   tier-0 saves per copy to the store
  C0   what a tier-0 save costs the loop (C_eff)       C1  what a copy costs the loop besides
  L    a copy's lag: from the tier-0 commit until the store holds the step
  R0   a restart from tier 0 (the nodes' own copies)   R1  a restart from the store
  M    the job's MTBF; a share p of failures lose a node's disk (they need the store), the rest
       leave it (a process crash, a hung collective, a preempted job on the same nodes)

Failures of the two kinds arrive as Poisson processes of rates (1-p)/M and p/M. A failure the
node survives loses the work since the last tier-0 save and costs R0; one that loses the node
loses the work since the last step the store holds (on average k tau / 2 plus the lag L) and
costs R1. To first order (as Young's formula is for one level) the share of time wasted is

    W(tau, k) = (C0 + C1/k) / tau + (1-p)/M (tau/2 + R0) + p/M (k tau/2 + L + R1)

which for a given k is least at tau*(k) = sqrt(2 (C0 + C1/k) M / (1 - p + k p)), and over k
where (C0 + C1/k)(1 - p + k p) is least: k* = sqrt(C1 (1-p) / (C0 p)), the better integer
neighbour (Vaidya's two-level scheme; SCR advises its levels' intervals this way). Each level's
own Young interval (what it would choose alone: sqrt(2 C M) over the failures only it guards
against) is reported beside it. `simulate` checks the formula event by event.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

MAX_K = 1000  # copy at least every 1000th save (p near 0 would say never)
MAX_EVENTS = 200_000  # simulated events in one call, all trials together (a viewer may ask)


@dataclass(frozen=True)
class Levels:
    c0: float
    c1: float
    lag: float
    r0: float
    r1: float
    mtbf: float
    share: float  # p: the share of failures that lose a node's local disk

    @property
    def rate0(self) -> float:
        return (1.0 - self.share) / self.mtbf

    @property
    def rate1(self) -> float:
        return self.share / self.mtbf

    def waste(self, tau: float, k: int) -> float:
        """W(tau, k), the first-order share of wall time wasted (capped at 1)."""
        if tau <= 0:
            return 1.0
        w = (self.c0 + self.c1 / k) / tau
        w += self.rate0 * (tau / 2 + self.r0)
        w += self.rate1 * (k * tau / 2 + self.lag + self.r1)
        return min(1.0, w)

    def best_tau(self, k: int) -> float:
        return math.sqrt(2.0 * (self.c0 + self.c1 / k) / (self.rate0 + k * self.rate1))

    def best(self) -> tuple[float, int]:
        """(tau*, k*): the tier-0 interval and the copy period least wasteful to first order."""
        if self.rate1 <= 0 or self.c0 <= 0:
            k_real = float(MAX_K) if self.c1 > 0 else 1.0
        else:
            k_real = math.sqrt(self.c1 * self.rate0 / (self.c0 * self.rate1))
        low = max(1, min(MAX_K, math.floor(k_real)))
        choices = {low, min(MAX_K, low + 1)}
        k = min(sorted(choices), key=lambda j: self.waste(self.best_tau(j), j))
        return self.best_tau(k), k

    def young0(self) -> float | None:
        """Tier 0 alone, against the failures it guards against (the node survives)."""
        return math.sqrt(2.0 * self.c0 / self.rate0) if self.rate0 > 0 else None

    def young1(self) -> float | None:
        """The store alone, against the failures only it guards against (a node lost): the
        interval between copies it would choose, were each copy to cost C1 + C0."""
        if self.rate1 <= 0:
            return None
        return math.sqrt(2.0 * (self.c1 + self.c0) / self.rate1)


def simulate(
    levels: Levels, tau: float, k: int, *, trials: int = 300, segments: int = 200, seed: int = 0
) -> tuple[float | None, int]:
    """The simulated waste of (tau, k) over `trials` jobs of `segments` tier-0 saves each,
    with exponential failures; (None, trials left out) when the bound on events was reached
    before any trial finished. A trial that hits the bound is left out and counted."""
    if tau <= 0:
        return 1.0, 0
    rng = random.Random(seed)
    budget = MAX_EVENTS
    kept = wall_total = 0.0
    left_out = 0
    for _ in range(trials):
        done, wall, budget = _trial(levels, tau, k, segments, rng, budget)
        if not done:
            left_out += 1
            continue
        kept += segments * tau
        wall_total += wall
    if wall_total <= 0:
        return None, left_out
    return 1.0 - kept / wall_total, left_out


def _trial(
    lv: Levels, tau: float, k: int, segments: int, rng: random.Random, budget: int
) -> tuple[bool, float, int]:
    """One job: (finished, its wall time, the budget left)."""
    target = segments * tau
    wall = pos = last0 = last1 = 0.0
    saves = 0
    copies: list[tuple[float, float]] = []  # (the wall time the store holds it, its position)
    gap = rng.expovariate(1.0 / lv.mtbf)
    while pos < target - 1e-9:
        budget -= 1
        if budget < 0:
            return False, wall, budget
        copy = saves % k == 0  # the first save is copied, then every k-th
        segment = tau + lv.c0 + (lv.c1 if copy else 0.0)
        if gap >= segment:
            wall += segment
            gap -= segment
            pos += tau
            last0 = pos
            saves += 1
            if copy:
                copies.append((wall + lv.lag, pos))
            continue
        wall += gap  # a failure: the work since the restore point is lost
        for at, where in copies:
            if at <= wall:
                last1 = max(last1, where)
        if rng.random() < lv.share:  # the node is lost: back to what the store holds
            pos = last0 = last1
            copies = [c for c in copies if c[0] <= wall]
            restart = lv.r1
        else:  # the node's copy survives (its copy to the store goes on)
            pos = last0
            restart = lv.r0
        gap = rng.expovariate(1.0 / lv.mtbf)
        while gap < restart:  # the restart itself is at risk: it starts over
            budget -= 1
            if budget < 0:
                return False, wall, budget
            wall += gap
            gap = rng.expovariate(1.0 / lv.mtbf)
        wall += restart
        gap -= restart
    return True, wall, budget
