"""The waste model of `reg advise` (registry.economics.model): the issue's worked
examples, chi-square quantiles against tables, properties of the optimum, and the Monte Carlo
simulator agreeing with the analytic waste."""

from __future__ import annotations

import math
import xml.etree.ElementTree as ET

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from registry.economics import model, simulate
from registry.economics.plot import svg

M = 3.09 * 3600  # the issue's MTBF: 3.09 h


def test_worked_examples_of_the_issue():
    # C = 148.8 s, M = 3.09 h: Young ~30.3 min, Daly ~28.7 min
    assert model.young(148.8, M) / 60 == pytest.approx(30.3, abs=0.05)
    assert model.daly(148.8, M) / 60 == pytest.approx(28.7, abs=0.05)
    # C = 6.3 s: ~6.2 min by both
    assert model.young(6.3, M) / 60 == pytest.approx(6.2, abs=0.05)
    assert model.daly(6.3, M) / 60 == pytest.approx(6.2, abs=0.05)


def test_the_availability_optimum_is_what_daly_approximates():
    for cost in (1.0, 6.3, 148.8, 600.0):
        best = model.optimal(cost, M)
        assert best == pytest.approx(model.daly(cost, M), rel=2e-3)
        # It is the maximum: a little either way is worse.
        a = model.availability(best, cost, 60.0, M)
        assert a > model.availability(best * 0.95, cost, 60.0, M)
        assert a > model.availability(best * 1.05, cost, 60.0, M)


def test_daly_for_a_cost_beyond_twice_the_mtbf_is_the_mtbf():
    assert model.daly(300.0, 100.0) == 100.0


def test_rto_lowers_availability_but_does_not_move_the_optimum():
    assert model.availability(1800, 148.8, 600, M) < model.availability(1800, 148.8, 0, M)
    assert model.waste(1800, 148.8, 0, M) == pytest.approx(
        1 - 1800 / (M * math.expm1((1800 + 148.8) / M))
    )


def test_lost_work_per_failure_is_about_half_a_segment_plus_the_rto():
    lost = model.lost_per_failure(1800, 148.8, 60, M)
    assert lost == pytest.approx((1800 + 148.8) / 2 + 60, rel=0.05)
    assert lost < (1800 + 148.8) / 2 + 60  # a failure comes sooner rather than later


def test_regret_is_zero_at_the_optimum_and_scales_with_gpus():
    best = model.optimal(148.8, M)
    assert model.regret_gpu_hours_per_day(best, best, 148.8, 60, M, 64) == 0
    one = model.regret_gpu_hours_per_day(4 * best, best, 148.8, 60, M, 1)
    assert one > 0
    assert model.regret_gpu_hours_per_day(4 * best, best, 148.8, 60, M, 64) == pytest.approx(
        64 * one
    )


@pytest.mark.parametrize(
    ("p", "dof", "table"),
    [
        (0.975, 2, 7.3778),
        (0.025, 2, 0.05064),
        (0.95, 10, 18.307),
        (0.05, 10, 3.9403),
        (0.5, 1, 0.45494),
        (0.99, 30, 50.892),
        (0.005, 4, 0.20699),
    ],
)
def test_chi_square_quantiles_match_the_tables(p, dof, table):
    assert model.chi2_ppf(p, dof) == pytest.approx(table, rel=1e-4)


def test_chi_square_quantiles_match_scipy_where_it_is_installed():
    stats = pytest.importorskip("scipy.stats")
    for dof in (1, 2, 3, 7, 20, 101):
        for p in (0.001, 0.05, 0.5, 0.95, 0.999):
            assert model.chi2_ppf(p, dof) == pytest.approx(stats.chi2.ppf(p, dof), rel=1e-7)


def test_failure_rate_interval():
    rate = model.failure_rate(2, 10.0, 0.90)
    assert rate.point == 0.2
    # exact Poisson interval: chi2(0.05; 4)/20, chi2(0.95; 6)/20
    assert rate.low == pytest.approx(0.71072 / 20, rel=1e-4)
    assert rate.high == pytest.approx(12.5916 / 20, rel=1e-4)
    none = model.failure_rate(0, 10.0, 0.90)
    assert none.low == 0 and none.high == pytest.approx(5.9915 / 20, rel=1e-4)
    assert model.mtbf_of(0.5, 4) == 1800.0 and model.mtbf_of(0.0, 4) == math.inf


costs = st.floats(min_value=0.5, max_value=3600.0)
mtbfs = st.floats(min_value=600.0, max_value=30 * 86400.0)


@settings(max_examples=200, deadline=None)
@given(cost=costs, mtbf=mtbfs, factor=st.floats(min_value=1.1, max_value=10.0))
def test_the_optimum_moves_the_right_way(cost, mtbf, factor):
    """A dearer checkpoint: checkpoint less often; failing more often: checkpoint more often."""
    assume(cost * factor * factor < mtbf)  # a checkpoint far cheaper than a failure's gap
    for formula in (model.young, model.daly, model.optimal):
        assert formula(cost * factor, mtbf) > formula(cost, mtbf)
        assert formula(cost, mtbf / factor) < formula(cost, mtbf)
    best = model.optimal(cost, mtbf)
    assert 0 < best < mtbf
    assert 0 <= model.waste(best, cost, 0, mtbf) <= model.waste(best * factor, cost, 0, mtbf)


@settings(max_examples=50, deadline=None)
@given(cost=costs, mtbf=mtbfs)
def test_daly_is_below_young_and_within_a_few_percent_of_the_exact_optimum(cost, mtbf):
    if cost >= 2 * mtbf:
        return
    assert model.daly(cost, mtbf) <= model.young(cost, mtbf)
    if cost <= 1.3 * mtbf:  # beyond, Daly's series drifts past 3% (e.g. C = 798, M = 600)
        assert model.daly(cost, mtbf) == pytest.approx(model.optimal(cost, mtbf), rel=0.03)


@pytest.mark.parametrize(
    ("cost", "rto", "mtbf"),
    [(148.8, 60.0, M), (6.3, 30.0, M), (20.0, 50.0, 300.0), (0.17, 0.18, 21.9)],
)
def test_monte_carlo_with_exponential_failures_agrees_with_the_analytic_waste(cost, rto, mtbf):
    best = model.optimal(cost, mtbf)
    analytic = model.waste(best, cost, rto, mtbf)
    simulated = simulate.waste(best, cost, rto, simulate.exponential(mtbf, seed=7))
    assert simulated == pytest.approx(analytic, rel=0.05)
    # seeded: the same figures again
    assert simulate.waste(best, cost, rto, simulate.exponential(mtbf, seed=7)) == simulated


def test_monte_carlo_with_resampled_gaps():
    """Gaps all far longer than a segment: almost nothing is lost; a gap shorter than a
    segment never lets one finish... unless another, longer gap comes."""
    calm = simulate.waste(100.0, 1.0, 5.0, simulate.resampled([1e9]), trials=50, segments=20)
    assert calm == pytest.approx(1.0 / 101.0, rel=1e-6)
    mixed = simulate.waste(100.0, 1.0, 5.0, simulate.resampled([50.0, 500.0]), trials=200)
    assert calm < mixed < 1.0
    with pytest.raises(ValueError):
        simulate.resampled([])
    # Every gap shorter than a restart plus a segment: no progress, all wasted (and it ends).
    assert simulate.waste(100.0, 1.0, 5.0, simulate.resampled([50.0]), trials=10) == 1.0
    assert simulate.waste(1.0, 1.0, 60.0, simulate.resampled([50.0]), trials=10) == 1.0


def test_the_plot_is_svg_with_both_intervals_marked():
    doc = svg(
        cost_s=148.8,
        rto_s=60.0,
        mtbf_s=M,
        gpus=64,
        advised_s=1721.7,
        current_s=7200.0,
        title="r: waste",
    )
    root = ET.fromstring(doc)
    assert root.tag.endswith("svg")
    text = "".join(root.itertext())
    assert "advised 28.7min" in text and "current 2h" in text and "GPU-hours/day" in text


def test_a_simulation_is_bounded_whatever_the_gaps():
    """Gaps shorter than a restart made one `reg advise` (a viewer's request to the server)
    run for minutes: the simulation stops at MAX_STEPS vectorised steps, leaves the trials it
    did not finish out (counted) and keeps its figures sound."""
    calls = 0
    inner = simulate.resampled([1.0, 2.0], seed=1, censored_s=[10.0])

    def counted(n):
        nonlocal calls
        calls += 1
        return inner(n)

    out = simulate.run(60.0, 1.0, 5.0, counted, trials=2000, segments=200)
    assert calls <= simulate.MAX_STEPS + 2
    assert 0.0 <= out.fraction <= 1.0 and 0.0 < out.capped_share <= 1.0
    # An input the bound does not reach gives what it gave before.
    calm = simulate.run(60.0, 1.0, 5.0, simulate.resampled([1.0, 1.0], seed=1, censored_s=[200.0]))
    assert calm.capped_share == 0.0 and calm.fraction == pytest.approx(0.1009, abs=1e-3)
