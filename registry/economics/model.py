"""The waste model behind `reg advise`: pure functions of measured figures (no I/O).

Symbols (all in seconds of wall-clock time of the whole job, which runs on N GPUs):
  tau  the checkpoint interval: training time between the ends of two saves
  C    the effective cost of one checkpoint (C_eff): what the save stalled the loop, plus the
       slowdown of the training steps while a background save persisted
  R    the time to restart (RTO): fetch, load/reshard, first step
  M    the job's mean time between failures: 1 / (failure rate per GPU-hour x N) x 3600

The model is Daly's full model (Daly 2006, "A higher order estimate of the optimum checkpoint
interval for restart dumps"): failures arrive as a Poisson process of mean M, at any moment,
during work, saves and restarts alike; a failure loses the work since the last completed
checkpoint and costs a restart R. The expected wall time to complete one segment of tau work
plus its checkpoint is

    T(tau) = M e^(R/M) (e^((tau + C)/M) - 1)

and the waste is the share of the job's time that is not kept training work:

    waste(tau) = 1 - tau / T(tau)        availability(tau) = tau / T(tau)

- Young's first-order optimum: sqrt(2 C M) (waste ~ C/tau + tau/(2M)).
- Daly's higher-order optimum: sqrt(2 C M) (1 + sqrt(C/(2M))/3 + C/(18M)) - C, for C < 2M.
- The availability-maximising interval: argmax tau / T(tau), exactly: the root of
  (1 - tau/M) e^((tau + C)/M) = 1, i.e. tau = M (1 + W0(-e^(-1 - C/M))). R scales T by the
  constant e^(R/M): it lowers the availability every interval reaches, not where the optimum is.
- Lost work per failure: the expected time since the last completed checkpoint when a failure
  strikes a segment of length L = tau + C, M - L / (e^(L/M) - 1) (about L/2), plus R.
- Regret of an interval: (waste(tau) - waste(optimum)) x N GPUs x 24 h, in GPU-hours per day.

Failure rates: n failures in T GPU-hours of exposure estimate lambda = n/T per GPU-hour; the
two-sided confidence interval is the exact (chi-square) one for a Poisson count:
[chi2(a/2; 2n) / 2T, chi2(1 - a/2; 2n + 2) / 2T]. The chi-square quantile is computed here
(bisection on the regularized incomplete gamma function), so scipy is not needed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

HOURS_PER_DAY = 24.0
SERIES_BELOW = 1e-8  # C/M below this: optimal() is u = sqrt(2x) - 2x/3 (relative error ~x)
EXP_MAX = 700.0  # math.exp overflows a float just above 709


def young(cost_s: float, mtbf_s: float) -> float:
    """Young's first-order optimum interval sqrt(2 C M)."""
    return math.sqrt(2.0 * cost_s * mtbf_s)


def daly(cost_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum interval (M itself once C >= 2M)."""
    if cost_s >= 2.0 * mtbf_s:
        return mtbf_s
    x = cost_s / (2.0 * mtbf_s)
    return math.sqrt(2.0 * cost_s * mtbf_s) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - cost_s


def segment_time(tau_s: float, cost_s: float, rto_s: float, mtbf_s: float) -> float:
    """Expected wall time to complete tau of work and its checkpoint (Daly's full model)."""
    return mtbf_s * math.exp(rto_s / mtbf_s) * math.expm1((tau_s + cost_s) / mtbf_s)


def availability(tau_s: float, cost_s: float, rto_s: float, mtbf_s: float) -> float:
    """The share of the job's time that is kept training work."""
    if tau_s <= 0:
        return 0.0
    try:
        segment = segment_time(tau_s, cost_s, rto_s, mtbf_s)
    except OverflowError:
        return 0.0
    # (tau + C)/M so small that e^that - 1 underflows: no failure strikes, T is tau + C
    return tau_s / (segment if segment > 0 else tau_s + cost_s)


def waste(tau_s: float, cost_s: float, rto_s: float, mtbf_s: float) -> float:
    return 1.0 - availability(tau_s, cost_s, rto_s, mtbf_s)


def optimal(cost_s: float, mtbf_s: float) -> float:
    """The interval that maximises availability: the root u = tau/M in (0, 1) of
    (1 - u) e^u = e^(-C/M) (decreasing in u on (0, 1)), by bisection; for tiny C/M the series
    u = sqrt(2C/M) - 2C/(3M)."""
    x = cost_s / mtbf_s
    if x < SERIES_BELOW:  # the bisection cannot resolve 1 - x here: the series is exact enough
        return mtbf_s * (math.sqrt(2.0 * x) - 2.0 * x / 3.0)
    # (1 - u) e^u = e^-x  <=>  -log(1 - u) - u = x, increasing in u (log1p keeps small u exact).
    # Once C/M passes ~36, u is 1 - e^-(x+1): within an ulp of 1, where the midpoint rounds to
    # 1.0 and log1p(-1) has no value; the left side is infinite there (the root lies below).
    lo, hi = 0.0, 1.0
    for _ in range(200):
        mid = (lo + hi) / 2.0
        if mid < 1.0 and -math.log1p(-mid) - mid < x:
            lo = mid
        else:
            hi = mid
    return mtbf_s * (lo + hi) / 2.0


def lost_per_failure(tau_s: float, cost_s: float, rto_s: float, mtbf_s: float) -> float:
    """Expected work lost per failure (time since the last completed checkpoint) plus R."""
    length = tau_s + cost_s
    x = length / mtbf_s
    if x < 1e-6:
        since = length / 2.0
    elif x > EXP_MAX:  # e^x overflows: length / (e^x - 1) is below an ulp of M
        since = mtbf_s
    else:
        since = mtbf_s - length / math.expm1(x)
    return since + rto_s


def regret_gpu_hours_per_day(
    tau_s: float, best_s: float, cost_s: float, rto_s: float, mtbf_s: float, gpus: int
) -> float:
    extra = waste(tau_s, cost_s, rto_s, mtbf_s) - waste(best_s, cost_s, rto_s, mtbf_s)
    return max(0.0, extra) * gpus * HOURS_PER_DAY


# -- failure rates ----------------------------------------------------------------------------


def gamma_p(a: float, x: float) -> float:
    """The regularized lower incomplete gamma function P(a, x): a series below a + 1, a
    continued fraction (Lentz) above, as in Numerical Recipes."""
    if x <= 0:
        return 0.0
    log_front = a * math.log(x) - x - math.lgamma(a)
    if x < a + 1.0:
        term = total = 1.0 / a
        n = a
        for _ in range(10_000):
            n += 1.0
            term *= x / n
            total += term
            if abs(term) < abs(total) * 1e-15:
                break
        return min(1.0, total * math.exp(log_front))
    tiny = 1e-300
    b = x + 1.0 - a
    c = 1.0 / tiny
    d = 1.0 / b
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2.0
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1.0 / d
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-15:
            break
    return max(0.0, 1.0 - math.exp(log_front) * h)


def chi2_ppf(p: float, dof: float) -> float:
    """The p-quantile of the chi-square distribution with `dof` degrees of freedom."""
    if not 0.0 < p < 1.0 or dof <= 0:
        raise ValueError("chi2_ppf needs 0 < p < 1 and dof > 0")
    lo, hi = 0.0, max(1.0, dof)
    while gamma_p(dof / 2.0, hi / 2.0) < p:
        hi *= 2.0
    for _ in range(200):
        mid = (lo + hi) / 2.0
        if gamma_p(dof / 2.0, mid / 2.0) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-12 * hi:
            break
    return (lo + hi) / 2.0


@dataclass(frozen=True, slots=True)
class Rate:
    """Failures per GPU-hour: the point estimate and its two-sided confidence interval."""

    failures: int
    gpu_hours: float
    point: float
    low: float
    high: float
    confidence: float


def failure_rate(failures: int, gpu_hours: float, confidence: float = 0.90) -> Rate:
    """n failures in T GPU-hours: n/T and the exact chi-square interval for a Poisson count."""
    if gpu_hours <= 0:
        raise ValueError("failure_rate needs a positive exposure")
    alpha = 1.0 - confidence
    low = chi2_ppf(alpha / 2.0, 2 * failures) / (2.0 * gpu_hours) if failures else 0.0
    high = chi2_ppf(1.0 - alpha / 2.0, 2 * failures + 2) / (2.0 * gpu_hours)
    return Rate(failures, gpu_hours, failures / gpu_hours, low, high, confidence)


def mtbf_of(rate_per_gpu_hour: float, gpus: int) -> float:
    """The job's mean time between failures in seconds (inf for a zero rate)."""
    if rate_per_gpu_hour <= 0:
        return math.inf
    return 3600.0 / (rate_per_gpu_hour * gpus)
