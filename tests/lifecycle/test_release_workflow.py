"""Protected aliases: a move waits for approvals from other principals, of that exact
version, before it expires; yanks cancel; every path that moves an alias is gated; replay too.

Embedded, identities are asserted (REG_USER): the rules hold, the names are advisory. The
server's own checks (tokens, MACs) are in test_release_workflow_server.py."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from registry import Registry
from registry.api.results import AliasMoved, AliasRequest
from registry.core.config import Settings
from registry.errors import Conflict, NotFound, PermissionDenied, PolicyError, UsageError
from tests.helpers import lose_catalog

CPU = '[promotion]\nrequire_device = "any"\n'


def protected(approvals: int = 1, expires: str = "7d", extra: str = "") -> str:
    return CPU + (
        f'[[protected_aliases]]\nalias = "prod"\napprovers = ["role:releaser"]\n'
        f'approvals = {approvals}\nexpires = "{expires}"\n{extra}'
    )


@pytest.fixture
def policy_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    path = tmp_path / "policy.toml"

    def write(text: str) -> Path:
        path.write_text(text)
        monkeypatch.setenv("REG_POLICY", str(path))
        return path

    return write


def as_user(name: str) -> Registry:
    return Registry(Settings.from_env(), user=name)


@pytest.fixture
def two_versions(policy_file, ckpts):  # type: ignore[no-untyped-def]
    """tiny:v1 and tiny:v2 under a policy that protects prod (one approval)."""
    policy_file(protected())
    with as_user("alice") as reg:
        for step in (2, 4):
            reg.push_checkpoint(ckpts.ws2.step_dir(step), run="r", step=step)
        reg.promote("r@step2", model="tiny")
        reg.promote("r@step4", model="tiny")
    return ckpts


def test_a_protected_alias_moves_only_when_another_principal_approves_that_version(two_versions):
    with as_user("alice") as alice:
        asked = alice.set_alias("tiny", "prod", "v1")
        assert isinstance(asked, AliasRequest) and asked.state == "open"
        assert asked.requested_by == "alice" and asked.approvals_needed == 1
        assert "asserted" in (asked.advisory or "")
        with pytest.raises(NotFound):
            alice.show("tiny@prod")  # nothing moved
        assert alice.set_alias("tiny", "prod", "v1").request == asked.request  # the same one
        with pytest.raises(PermissionDenied, match="four eyes"):
            alice.approve(asked.request)
        canary = alice.set_alias("tiny", "canary", "v1")  # not protected: moves at once
        assert isinstance(canary, AliasMoved) and canary.alias == "canary"
    with as_user("bob") as bob:
        with pytest.raises(Conflict, match="not v2: an approval names the exact version"):
            bob.approve(asked.request, "v2")
        assert bob.show("tiny@canary")["version"] == 1
        done = bob.approve(asked.request, "v1")
        assert done.moved and done.state == "approved" and done.approved_by == ["bob"]
        assert bob.show("tiny@prod")["version"] == 1
        with pytest.raises(Conflict, match="is approved"):
            bob.approve(asked.request)
        history = [h for h in bob.show("tiny:v1")["alias_history"] if h["alias"] == "prod"]
        assert history == [
            {
                "alias": "prod",
                "from": None,
                "to": "v1",
                "at": history[0]["at"],
                "by": "bob",
                "request": asked.request,
                "requested_by": "alice",
                "approved_by": ["bob"],
            }
        ]
        audit = [(e["actor"], e["action"], e["outcome"]) for e in bob.audit_log()]
        assert ("alice", "alias-request", "allowed") in audit
        assert ("alice", "alias-approve", "denied") in audit
        assert ("bob", "alias-approve", "allowed") in audit and ("bob", "alias", "allowed") in audit
        listed = bob.alias_requests("tiny")
        assert [(r.request, r.state) for r in listed] == [(asked.request, "approved")]


def test_two_approvals_are_two_people_and_a_rejection_closes_it(policy_file, two_versions):
    policy_file(protected(approvals=2))
    with as_user("alice") as alice:
        asked = alice.set_alias("tiny", "prod", "v2")
    with as_user("bob") as bob:
        assert not bob.approve(asked.request).moved
        with pytest.raises(Conflict, match="already approved"):
            bob.approve(asked.request)
        with pytest.raises(NotFound):
            bob.show("tiny@prod")
    with as_user("carol") as carol:
        assert carol.approve(asked.request).approved_by == ["bob", "carol"]
        assert carol.show("tiny@prod")["version"] == 2
        again = carol.set_alias("tiny", "prod", "v1")
        with pytest.raises(UsageError, match="needs a reason"):
            carol.reject(again.request, " ")
        rejected = carol.reject(again.request, "v1 regressed on evals")
        assert rejected.state == "rejected" and rejected.closed_by == "carol"
    with as_user("dave") as dave:
        with pytest.raises(Conflict, match="rejected by carol"):
            dave.approve(again.request)
        assert [r.request for r in dave.alias_requests(state="rejected")] == [again.request]
        assert dave.show("tiny@prod")["version"] == 2


def test_an_expired_request_cannot_be_approved(policy_file, two_versions):
    policy_file(protected(expires="1s"))
    with as_user("alice") as alice:
        asked = alice.set_alias("tiny", "prod", "v1")
    time.sleep(1.2)
    with as_user("bob") as bob:
        with pytest.raises(Conflict, match="is expired"):
            bob.approve(asked.request)
        assert bob.alias_requests("tiny")[0].state == "expired"
        with pytest.raises(NotFound):
            bob.show("tiny@prod")


def test_a_yank_or_deprecation_cancels_the_requests_for_that_version(two_versions):
    with as_user("alice") as alice:
        to_v1 = alice.set_alias("tiny", "prod", "v1")
        to_v2 = alice.set_alias("tiny", "prod", "v2")
        assert to_v1.request != to_v2.request
        assert alice.deprecate("tiny:v1", "superseded")["requests_cancelled"] == [to_v1.request]
        assert alice.yank("tiny:v2", "leaked eval data")["requests_cancelled"] == [to_v2.request]
    with as_user("bob") as bob:
        for asked in (to_v1, to_v2):
            with pytest.raises(Conflict, match="is cancelled"):
                bob.approve(asked.request)
        states = {r.request: (r.state, r.reason) for r in bob.alias_requests("tiny")}
        assert states[to_v1.request] == ("cancelled", "tiny:v1 deprecated")
        with pytest.raises(Conflict, match="only to an active release"):
            bob.set_alias("tiny", "prod", "v1")


def test_promote_with_a_protected_alias_opens_a_request(policy_file, ckpts, cli):
    policy_file(protected())
    with as_user("alice") as alice:
        alice.push_checkpoint(ckpts.ws2.step_dir(2), run="r", step=2)
        made = alice.promote("r@step2", model="tiny", alias="prod")
        assert made.release == "tiny:v1" and made.aliases == []
        assert made.alias_request is not None and made.alias_request["state"] == "open"
        request = made.alias_request["request"]
    res = cli("approve", str(request), "--version", "v1", "--json", env={"REG_USER": "bob"})
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["moved"] is True
    res = cli("requests", "tiny", env={"REG_USER": "bob"})
    assert res.returncode == 0 and "approved" in res.stdout and "alice" in res.stdout


def test_requesters_and_approvers_come_from_the_policy(policy_file, two_versions, cli):
    grants = (
        '[[access.grants]]\nprincipals = ["ops"]\nrole = "admin"\n'
        '[[access.grants]]\nprincipals = ["rel", "rel2"]\nrole = "releaser"\n'
        '[[access.grants]]\nprincipals = ["tr"]\nrole = "trainer"\n'
    )
    policy_file(protected(extra='requesters = ["rel"]\n') + grants)
    with as_user("rel2") as rel2, pytest.raises(PermissionDenied, match="protected_aliases"):
        rel2.set_alias("tiny", "prod", "v1")
    with as_user("rel") as rel:
        asked = rel.set_alias("tiny", "prod", "v1")
    with as_user("tr") as tr, pytest.raises(PermissionDenied, match="may not approve"):
        tr.approve(asked.request)  # a trainer is not role:releaser
    res = cli("approve", str(asked.request), env={"REG_USER": "ops"})  # admin includes releaser
    assert res.returncode == 0, res.stderr
    assert "approved by ops; moved" in res.stdout
    with as_user("ops") as ops:
        denied = [e for e in ops.audit_log() if e["outcome"] == "denied"]
        assert {(e["actor"], e["action"]) for e in denied} >= {
            ("rel2", "alias-request"),
            ("tr", "alias-approve"),
        }


def test_cli_alias_set_on_a_protected_alias_prints_the_request(two_versions, cli):
    res = cli("alias", "set", "tiny", "prod", "v2", "--json", env={"REG_USER": "alice"})
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["state"] == "open" and doc["version"] == 2 and isinstance(doc["request"], int)
    res = cli("alias", "set", "tiny", "prod", "v2", env={"REG_USER": "alice"})
    assert f"request {doc['request']}: tiny@prod -> v2 waits for 1 approval(s)" in res.stdout
    assert f"reg approve {doc['request']} --version v2" in res.stdout
    res = cli("approve", "nope")
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1
    res = cli("approve", "999")
    assert res.returncode == 3 and "request 999 not found" in res.stderr


def test_bad_protection_rules_are_refused_with_their_line(policy_file):
    for bad, why in (
        ('alias = "prod"\napprovers = []\n', "approvers"),
        ('alias = "prod"\napprovers = ["role:boss"]\n', "unknown role"),
        ('alias = "prod"\napprovers = ["a b"]\n', "invalid principal"),
        ('alias = "pr/od"\napprovers = ["x"]\n', "invalid alias glob"),
        ('alias = "prod"\napprovers = ["x"]\nexpires = "never"\n', "1s to 366d"),
        ('alias = "prod"\napprovers = ["x"]\napprovals = 0\n', "approvals"),
    ):
        policy_file(CPU + "[[protected_aliases]]\n" + bad)
        with Registry() as reg, pytest.raises(PolicyError, match=why):
            reg.set_alias("tiny", "prod", "v1")


def test_a_journal_replay_keeps_approved_moves_and_skips_unapproved_ones(
    two_versions, tmp_path: Path
):
    with as_user("alice") as alice:
        asked = alice.set_alias("tiny", "prod", "v1")
    with as_user("bob") as bob:
        bob.approve(asked.request)
    home = Settings.from_env().home
    # A journal event of a move nobody approved, as a store writer could add it:
    from registry.journal.write import make, store

    with as_user("mallory") as mallory:
        forged = make(
            mallory.context,
            "alias",
            {"model": "tiny", "version": 2},
            {"alias": "prod", "from": 1},
            None,
        )
        store(mallory.context, forged)
    lose_catalog(home)
    with as_user("ops") as ops:
        rebuilt = ops.rebuild_catalog()
        skipped = rebuilt.events_skipped
        assert any("is protected (approvals = 1)" in s["reason"] for s in skipped), skipped
        assert ops.show("tiny@prod")["version"] == 1
        moved = [h for h in ops.show("tiny:v1")["alias_history"] if h["alias"] == "prod"]
        assert moved[0]["requested_by"] == "alice" and moved[0]["approved_by"] == ["bob"]


def test_a_policy_change_applies_to_the_requests_already_open(policy_file, two_versions):
    rule = '[[protected_aliases]]\nalias = "prod"\napprovers = {who}\napprovals = {n}\n'
    policy_file(CPU + rule.format(who='["bob", "carol"]', n=1))
    with as_user("alice") as alice:
        asked = alice.set_alias("tiny", "prod", "v1")
    policy_file(CPU + rule.format(who='["bob", "carol", "dave"]', n=2))  # stricter since
    with as_user("bob") as bob:
        assert not bob.approve(asked.request).moved  # 2 are needed now
    policy_file(CPU + rule.format(who='["carol", "dave"]', n=2))  # bob is no approver any more
    with as_user("carol") as carol:
        counted = carol.approve(asked.request)
        assert not counted.moved and counted.state == "open"  # bob's approval no longer counts
        with pytest.raises(NotFound):
            carol.show("tiny@prod")
    with as_user("dave") as dave:
        assert dave.approve(asked.request).moved
        moved = [h for h in dave.show("tiny:v1")["alias_history"] if h["alias"] == "prod"]
        assert moved[0]["approved_by"] == ["carol", "dave"]


def test_a_rebuild_keeps_a_move_made_before_its_alias_was_protected(two_versions, tmp_path: Path):
    open_policy, strict = tmp_path / "open.toml", tmp_path / "strict.toml"
    open_policy.write_text(CPU)
    strict.write_text(protected(approvals=2))
    with as_user("alice") as alice:
        alice.apply_policy(open_policy)
    with as_user("alice") as alice:
        assert isinstance(alice.set_alias("tiny", "prod", "v2"), AliasMoved)  # free then
        alice.apply_policy(strict)
    lose_catalog(Settings.from_env().home)
    with as_user("ops") as ops:
        rebuilt = ops.rebuild_catalog()
        assert not [s for s in rebuilt.events_skipped if "protected" in s["reason"]]
        assert ops.show("tiny@prod")["version"] == 2


def test_request_ids_out_of_range_are_one_line(two_versions, cli):
    for bad in ("99999999999999999999", "0", "-3"):
        res = cli("approve", "--", bad) if bad.startswith("-") else cli("approve", bad)
        assert res.returncode == 2, (bad, res.stderr)
        assert "Traceback" not in res.stderr and "internal error" not in res.stderr


def test_two_approvals_at_once_move_the_alias(catalog_url, policy_file, ckpts):
    """The second of two concurrent approvals sees the first (they take turns on the release's
    row), so a two-approval request moves the alias, on SQLite and PostgreSQL."""
    import threading

    policy_file(protected(approvals=2))
    with as_user("alice") as alice:
        alice.push_checkpoint(ckpts.ws2.step_dir(2), run="r", step=2)
        alice.promote("r@step2", model="tiny")
        asked = alice.set_alias("tiny", "prod", "v1")
    start, results = threading.Barrier(2), {}

    def approve(who: str) -> None:
        with as_user(who) as reg:
            start.wait()
            results[who] = reg.approve(asked.request)

    threads = [threading.Thread(target=approve, args=(w,)) for w in ("bob", "carol")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(r.moved for r in results.values()) == [False, True]
    with as_user("dave") as dave:
        assert dave.show("tiny@prod")["version"] == 1
        assert dave.alias_requests("tiny")[0].approved_by in (["bob", "carol"], ["carol", "bob"])
