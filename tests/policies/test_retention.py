"""The retention planner: every rule and protection, table-driven, plus properties over random
histories (hypothesis)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.loader import parse_policy
from policies.retention import DELETE, KEEP, CheckpointRecord, Protections, plan

DAY = 86400.0
NOW = 1_000 * DAY


def rec(
    step: int,
    age_days: float,
    *,
    run: str = "r",
    project: str = "default",
    pinned: bool = False,
    size: int = 100,
    metrics: dict | None = None,
    id: int | None = None,
) -> CheckpointRecord:
    return CheckpointRecord(
        id if id is not None else hash((project, run, step)) % 10**9,
        project,
        run,
        step,
        NOW - age_days * DAY,
        size,
        pinned,
        metrics or {},
    )


def policy(text: str):
    return parse_policy(text).retention


def actions(decisions) -> dict[str, str]:
    return {d.ref: d.action for d in decisions}


BASE = '[retention]\nkeep_last = 1\nttl = "7d"\n'


@pytest.mark.parametrize(
    ("doc", "records", "protections", "expected"),
    [
        # ttl: old goes, young stays; the newest of the run always stays
        (
            BASE,
            [rec(1, 10), rec(2, 3), rec(3, 10)],
            None,
            {"r@step1": DELETE, "r@step2": KEEP, "r@step3": KEEP},
        ),
        # keep_last
        (
            '[retention]\nkeep_last = 2\nttl = "0s"\n',
            [rec(1, 9), rec(2, 9), rec(3, 9)],
            None,
            {"r@step1": DELETE, "r@step2": KEEP, "r@step3": KEEP},
        ),
        # milestones, with and without milestone_ttl
        (
            '[retention]\nkeep_last = 1\nttl = "0s"\nkeep_every_steps = 100\n',
            [rec(100, 400), rec(150, 9), rec(200, 9), rec(250, 1)],
            None,
            {"r@step100": KEEP, "r@step150": DELETE, "r@step200": KEEP, "r@step250": KEEP},
        ),
        (
            '[retention]\nkeep_last = 1\nttl = "0s"\nkeep_every_steps = 100\n'
            'milestone_ttl = "30d"\n',
            [rec(100, 400), rec(200, 9), rec(250, 1)],
            None,
            {"r@step100": DELETE, "r@step200": KEEP, "r@step250": KEEP},
        ),
        # keep_best
        (
            '[retention]\nkeep_last = 1\nttl = "0s"\nkeep_best = { metric = "val_loss", n = 1 }\n',
            [
                rec(1, 9, metrics={"val_loss": 2.0}),
                rec(2, 9, metrics={"val_loss": 1.0}),
                rec(3, 9, metrics={"val_loss": 3.0}),
                rec(4, 9),
            ],
            None,
            {"r@step1": DELETE, "r@step2": KEEP, "r@step3": DELETE, "r@step4": KEEP},
        ),
        (
            '[retention]\nkeep_last = 1\nttl = "0s"\n'
            'keep_best = { metric = "acc", mode = "max", n = 1 }\n',
            [rec(1, 9, metrics={"acc": 0.9}), rec(2, 9, metrics={"acc": 0.5}), rec(3, 9)],
            None,
            {"r@step1": KEEP, "r@step2": DELETE, "r@step3": KEEP},
        ),
        # protections beat every rule
        (
            '[retention]\nkeep_last = 1\nttl = "0s"\n',
            [
                rec(1, 99, pinned=True),
                rec(2, 99, id=2),
                rec(3, 99, id=3),
                rec(4, 99, id=4),
                rec(5, 99),
            ],
            Protections(
                release_sources={2: "m:v1"}, held=frozenset({3}), resumed_from={("default", "r"): 4}
            ),
            {"r@step1": KEEP, "r@step2": KEEP, "r@step3": KEEP, "r@step4": KEEP, "r@step5": KEEP},
        ),
        # per-project overrides
        (
            '[retention]\nkeep_last = 1\nttl = "0s"\n'
            '[retention.projects."team-a"]\nkeep_last = 3\n',
            [rec(1, 9, project="team-a"), rec(2, 9, project="team-a"), rec(1, 9), rec(2, 9)],
            None,
            {"team-a/r@step1": KEEP, "team-a/r@step2": KEEP, "r@step1": DELETE, "r@step2": KEEP},
        ),
        # quota: oldest unprotected first, never a protected one
        (
            '[retention]\nkeep_last = 5\nttl = "30d"\nmax_bytes = "250B"\n',
            [rec(1, 5, pinned=True), rec(2, 4), rec(3, 3), rec(4, 2)],
            None,
            {"r@step1": KEEP, "r@step2": DELETE, "r@step3": DELETE, "r@step4": KEEP},
        ),
    ],
)
def test_rules_and_protections(doc, records, protections, expected):
    decisions = plan(records, policy(doc), NOW, protections)
    assert actions(decisions) == expected
    assert all(d.reason.startswith(("kept: ", "deleted: ")) for d in decisions)


def test_reasons_explain_each_decision():
    decisions = plan([rec(1, 10), rec(2, 3), rec(3, 1, pinned=True)], policy(BASE), NOW)
    reasons = {d.ref: d.reason for d in decisions}
    assert reasons == {
        "r@step1": "deleted: older than ttl 7d",
        "r@step2": "kept: younger than ttl 7d",
        "r@step3": "kept: pinned",
    }
    young = next(d for d in decisions if d.ref == "r@step2")
    assert young.expires_at == pytest.approx(NOW - 3 * DAY + 7 * DAY)


def test_ttl_zero_deletes_at_once_and_never_keeps_forever():
    decisions = plan(
        [rec(1, 0.0001), rec(2, 0)], policy('[retention]\nkeep_last = 1\nttl = "0s"\n'), NOW
    )
    assert actions(decisions) == {"r@step1": DELETE, "r@step2": KEEP}
    forever = plan([rec(1, 9999), rec(2, 0)], policy('[retention]\nttl = "never"\n'), NOW)
    assert actions(forever)["r@step1"] == KEEP


histories = st.lists(
    st.tuples(
        st.sampled_from(["a", "b", "c"]),
        st.integers(0, 50),
        st.floats(0, 60),
        st.booleans(),
        st.integers(1, 1000),
    ),
    min_size=1,
    max_size=60,
    unique_by=lambda t: (t[0], t[1]),
)


@settings(max_examples=200, deadline=None)
@given(
    histories,
    st.sampled_from(
        [
            '[retention]\nkeep_last = 1\nttl = "0s"\n',
            '[retention]\nkeep_last = 2\nttl = "7d"\nkeep_every_steps = 10\n',
            '[retention]\nkeep_last = 1\nttl = "1d"\nmax_bytes = "500B"\n',
        ]
    ),
    st.sets(st.integers(0, 59)),
)
def test_properties_over_random_histories(history, doc, special):
    records = [
        CheckpointRecord(i, "p", run, step, NOW - age * DAY, size, pinned)
        for i, (run, step, age, pinned, size) in enumerate(history)
    ]
    protections = Protections(
        release_sources={i: "m:v1" for i in special if i % 2},
        held=frozenset(i for i in special if not i % 2),
    )
    decisions = plan(records, policy(doc), NOW, protections)
    by_id = {d.id: d for d in decisions}
    assert len(decisions) == len(records)
    for r in records:
        protected = r.pinned or r.id in protections.release_sources or r.id in protections.held
        newest = r.step == max(x.step for x in records if x.run == r.run)
        if protected or newest:
            assert by_id[r.id].action == KEEP, (r, by_id[r.id])
    # Applying the plan, then planning again over what is left, deletes nothing more.
    kept = [r for r in records if by_id[r.id].action == KEEP]
    again = plan(kept, policy(doc), NOW, protections)
    assert all(d.action == KEEP for d in again)
