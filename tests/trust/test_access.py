"""Access policies and the audit log: roles x actions x scopes, enforcement in the library,
denials audited, the applied policy beating local files, the S3 export."""

from __future__ import annotations

import json

import pytest

from policies.access import ACTIONS, check, gives, scoped_admin_grants
from policies.loader import parse_policy
from registry import Registry
from registry.errors import MalformedRef, NotFound, PermissionDenied, PolicyError

POLICY = """
[promotion]
require_device = "any"

[[access.grants]]
principals = ["alice"]
role = "trainer"
projects = ["team-a"]

[[access.grants]]
principals = ["bob"]
role = "viewer"
projects = ["team-a"]
models = ["tiny*"]

[[access.grants]]
principals = ["carol"]
role = "releaser"
projects = ["team-*"]
models = ["tiny*"]

[[access.grants]]
principals = ["dave"]
role = "admin"

[access.aws]
alice = "arn:aws:iam::123456789012:role/trainer-alice"
carol = "arn:aws:iam::123456789012:role/releaser-carol"
dave = "arn:aws:iam::123456789012:role/admin-dave"
"""


def grants():
    return parse_policy(POLICY).access.grants


ROLE_OF = {"bob": "viewer", "alice": "trainer", "carol": "releaser", "dave": "admin"}


@pytest.mark.parametrize("principal", sorted(ROLE_OF))
@pytest.mark.parametrize("action", sorted(ACTIONS))
def test_every_role_and_action_in_scope(principal, action):
    allowed = gives(ROLE_OF[principal], ACTIONS[action])
    in_scope = check(
        grants(), principal, action, project="team-a", model="tiny-lm", model_owner="team-a"
    )
    assert in_scope.allowed == allowed, in_scope.reason


@pytest.mark.parametrize(
    ("principal", "project", "model", "owner", "allowed"),
    [
        # models left out: the models its projects own, nothing else
        ("alice", "team-a", "tiny-lm", "team-a", True),
        ("alice", "team-a", "tiny-lm", "team-b", False),  # team-b's model from team-a's ckpt
        ("alice", None, "tiny-lm", "team-b", False),  # an alias move, a deprecation
        ("alice", None, "tiny-lm", None, False),  # owner unknown (unsigned behind the server)
        # an explicit models list crosses projects
        ("carol", "team-b", "tiny-x", "team-a", True),
        ("carol", "team-b", "llama", "team-b", False),
        # every project: every owner, even an unknown one
        ("dave", None, "anything", None, True),
    ],
)
def test_a_grant_without_models_covers_the_models_its_projects_own(
    principal, project, model, owner, allowed
):
    decision = check(
        grants(),
        principal,
        "promote" if project else "alias",
        project=project,
        model=model,
        model_owner=owner,
    )
    if principal == "alice":  # a trainer: allowed here means the scope matched
        decision = check(
            grants(), principal, "read", project=project, model=model, model_owner=owner
        )
    assert decision.allowed == allowed, decision.reason


@pytest.mark.parametrize(
    ("principal", "project", "model", "allowed"),
    [
        ("alice", "team-a", None, True),
        ("alice", "team-b", None, False),
        ("carol", "team-b", "tiny-x", True),
        ("carol", "other", "tiny-x", False),
        ("carol", "team-a", "llama", False),
        ("bob", "team-a", "llama", False),
        ("dave", "anything", "anything", True),
        ("erin", "team-a", None, False),
    ],
)
def test_scopes(principal, project, model, allowed):
    action = "read"
    assert check(grants(), principal, action, project=project, model=model).allowed == allowed


@pytest.mark.parametrize(
    ("role", "action", "allowed"),
    [
        ("validator", "attest", True),
        ("validator", "read", True),
        ("validator", "push", False),
        ("validator", "validate", False),
        ("admin", "attest", True),
        ("releaser", "attest", False),
        ("trainer", "attest", False),
    ],
)
def test_validator_stands_beside_the_ordered_roles(role, action, allowed):
    doc = f'[[access.grants]]\nprincipals = ["x"]\nrole = "{role}"\n'
    assert check(parse_policy(doc).access.grants, "x", action, project="p").allowed == allowed


def test_a_scoped_admin_grant_grants_nothing():
    doc = '[[access.grants]]\nprincipals = ["x"]\nrole = "admin"\nprojects = ["team-a"]\n'
    scoped = parse_policy(doc).access.grants
    assert scoped_admin_grants(scoped) and "grants nothing" in scoped_admin_grants(scoped)[0]
    for action in ("read", "push", "promote", "yank", "gc", "policy"):
        assert not check(scoped, "x", action, project="team-a").allowed


def test_no_grants_is_single_user_mode():
    decision = check([], "anyone", "gc")
    assert decision.allowed and "single-user" in decision.reason


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ('[[access.grants]]\nprincipals = ["x"]\nrole = "owner"\n', "access.grants.0.role"),
        ('[[access.grants]]\nprincipals = ["a*"]\nrole = "viewer"\n', "invalid principal 'a\\*'"),
        (
            '[[access.grants]]\nprincipals = ["x"]\nrole = "viewer"\nprojects = ["a/../b"]\n',
            "invalid glob",
        ),
    ],
)
def test_malformed_grants_are_refused_at_load(doc, message):
    with pytest.raises(PolicyError, match=message):
        parse_policy(doc, "p.toml")


@pytest.fixture
def applied(reg, tmp_path, ckpts):
    """Team-a and team-b checkpoints, then the policy applied by the bootstrap admin."""
    reg.push_checkpoint(ckpts.ws2.step_dir(4), run="r", step=4, project="team-a")
    reg.push_checkpoint(ckpts.ws2.step_dir(2), run="r", step=2, project="team-b")
    path = tmp_path / "policy.toml"
    path.write_text(POLICY)
    with as_user("dave") as dave:  # before any policy, everyone is admin; dave stays one
        assert dave.apply_policy(path)["version"] == 1
    return path


def as_user(name: str) -> Registry:
    return Registry(user=name)


def test_enforced_in_the_library(applied, ckpts):
    with as_user("alice") as alice:
        alice.push_checkpoint(ckpts.ws2.step_dir(2), run="r", step=2, project="team-a")
        with pytest.raises(PermissionDenied) as info:
            alice.push_checkpoint(ckpts.ws2.step_dir(2), run="r", step=9, project="team-b")
        assert info.value.exit_code == 4
        assert str(info.value).startswith(
            "alice may not push team-b/r@step9 (needs a trainer grant covering project team-b"
        )
        with pytest.raises(PermissionDenied):
            alice.promote("team-a/r@step4", model="tiny")
    with as_user("bob") as bob:
        assert {c["project"] for c in bob.list_checkpoints()} == {"team-a"}
        with pytest.raises(PermissionDenied):
            bob.pin("team-a/r@step4")
        with pytest.raises(PermissionDenied):
            bob.show("team-b/r@step2")
    with as_user("erin") as erin:
        assert erin.list_checkpoints() == []
        with pytest.raises(PermissionDenied):
            erin.audit_log()
    with as_user("carol") as carol:
        out = carol.promote("team-a/r@step4", model="tiny-lm", alias="prod")
        assert out["release"] == "tiny-lm:v1"
        with pytest.raises(PermissionDenied):
            carol.yank("tiny-lm:v1", "no")
    with as_user("dave") as dave:
        dave.yank("tiny-lm:v1", "drill")
        events = dave.audit_log()
    denied = [e for e in events if e["outcome"] == "denied"]
    assert {(e["actor"], e["action"]) for e in denied} == {
        ("alice", "push"),
        ("alice", "promote"),
        ("bob", "pin"),
        ("bob", "read"),
        ("erin", "audit"),
        ("carol", "yank"),
    }
    assert any(e["action"] == "alias" and e["target"] == "tiny-lm@prod" for e in events)
    assert any(e["action"] == "yank" and e["details"]["reason"] == "drill" for e in events)


def test_local_policy_files_cannot_grant_rights_once_one_is_applied(applied, tmp_path, monkeypatch):
    own = tmp_path / "mine.toml"
    own.write_text('[[access.grants]]\nprincipals = ["mallory"]\nrole = "admin"\n')
    monkeypatch.setenv("REG_POLICY", str(own))
    with (
        pytest.warns(UserWarning, match="ignoring .*mine.toml: the catalog has policy v1"),
        as_user("mallory") as mallory,
        pytest.raises(PermissionDenied),
    ):
        mallory.audit_log()


def test_refs_cannot_escape_their_project(applied):
    with as_user("alice") as alice:
        for ref in ("team-a/../team-b/r@step2", "../team-b/r@step2", "team-a/..@step2"):
            with pytest.raises(MalformedRef):
                alice.show(ref)


def test_cli_denial_is_one_line_exit_4(applied, cli, ckpts):
    res = cli(
        "push-ckpt",
        ckpts.ws2.step_dir(2),
        "--run",
        "r",
        "--step",
        "3",
        "--project",
        "team-b",
        env={"REG_USER": "alice"},
    )
    assert res.returncode == 4
    assert res.stderr.strip().splitlines() == [
        "reg: error: alice may not push team-b/r@step3 (needs a trainer grant covering project "
        "team-b (ask an admin to add it to the policy))"
    ]
    res = cli("audit", "--json", env={"REG_USER": "dave"})
    assert res.returncode == 0
    assert json.loads(res.stdout)[-1]["outcome"] == "denied"
    assert cli("gc", "--dry-run", env={"REG_USER": "bob"}).returncode == 4


def test_policy_show_and_export(applied, cli):
    shown = json.loads(cli("policy", "show", "--json", env={"REG_USER": "bob"}).stdout)
    assert shown["source"].startswith("catalog policy v1")
    res = cli("policy", "export", "--bucket", "ml/reg", env={"REG_USER": "dave"})
    assert res.returncode == 0
    assert "left out principals with no [access.aws] ARN: bob" in res.stderr
    doc = json.loads(res.stdout)
    sids = {s["Sid"]: s for s in doc["Statement"]}
    alice_write = next(
        s
        for s in doc["Statement"]
        if s["Sid"].endswith("WriteCheckpoints") and "trainer-alice" in str(s["Principal"])
    )
    assert alice_write["Resource"] == ["arn:aws:s3:::ml/reg/ckpt/team-a/*"]
    deny = sids["NoReleaseDeletes"]
    assert deny["Effect"] == "Deny" and "s3:DeleteObject" in deny["Action"]
    assert "admin-dave" not in str(deny["Principal"])
    assert sids["ReleaseWritesMustNotOverwrite"]["Condition"] == {
        "Null": {"s3:if-none-match": "true"}
    }
    # The audit chain's anchors: nobody deletes them, nobody overwrites them (admins included).
    anchors = sids["AuditAnchorsAreNeverDeleted"]
    assert anchors["Principal"] == "*" and anchors["Resource"] == "arn:aws:s3:::ml/reg/audit/*"
    assert {"s3:DeleteObject", "s3:DeleteObjectVersion"} <= set(anchors["Action"])
    assert sids["AuditAnchorsAreWriteOnce"]["Condition"] == {"Null": {"s3:if-none-match": "true"}}
    assert cli("policy", "export", "--bucket", "ml", env={"REG_USER": "bob"}).returncode == 4


def test_policy_check_cli(tmp_path, cli):
    bad = tmp_path / "bad.toml"
    bad.write_text('[[access.grants]]\nprincipals = ["x"]\nrole = "owner"\n')
    res = cli("policy", "check", bad)
    assert res.returncode == 2 and f"{bad}:3: access.grants.0.role" in res.stderr


def test_policy_show_needs_a_grant(applied):
    with as_user("erin") as erin, pytest.raises(PermissionDenied):
        erin.policy_show()
    with as_user("bob") as bob:
        assert "[[access.grants]]" in bob.policy_show()["document"]


def test_an_access_table_of_the_wrong_shape_is_a_policy_error(tmp_path, monkeypatch, cli):
    bad = tmp_path / "p.toml"
    bad.write_text('access = "x"\n')
    res = cli("ls", env={"REG_POLICY": str(bad)})
    assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr
    assert "access" in res.stderr


def test_the_cli_refuses_a_memory_store(cli):
    res = cli("ls", env={"REG_STORE_URL": "memory://x"})
    assert res.returncode == 2 and "a memory store lives inside one process" in res.stderr


def test_a_policy_that_locks_out_its_admins_is_refused(reg, tmp_path):
    no_admin = tmp_path / "no-admin.toml"
    no_admin.write_text('[[access.grants]]\nprincipals = ["alice"]\nrole = "releaser"\n')
    with pytest.raises(PolicyError, match='no grant has role = "admin"'):
        reg.apply_policy(no_admin)
    not_me = tmp_path / "not-me.toml"
    not_me.write_text('[[access.grants]]\nprincipals = ["dave"]\nrole = "admin"\n')
    with as_user("erin") as erin, pytest.raises(PolicyError, match="erin .applying it. would no"):
        erin.apply_policy(not_me)
    assert not reg.policy_show()["source"].startswith("catalog policy")  # nothing applied


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ("[retention]\nttl = -5", "retention.ttl: expected a duration >= 0"),
        ("[retention]\nttl = inf", "retention.ttl: expected a duration >= 0"),
        ("[retention]\nttl = nan", "retention.ttl: expected a duration >= 0"),
        ("[retention]\norphan_grace = -1.0", "retention.orphan_grace: expected a duration"),
        ("[retention]\nmax_bytes = -1", "retention.max_bytes: expected a size of at least 1"),
        ('[retention]\nmax_bytes = "0GB"', "retention.max_bytes: expected a size of at least"),
        ("[promotion]\nprobe_rtol = inf", "promotion.probe_rtol"),
        ("[promotion]\nprobe_rtol = -0.1", "promotion.probe_rtol"),
        ("[release]\nlock_days = 100000000000", "release.lock_days"),
        ("[retention]\nkeep_last = 0", "retention.keep_last"),
    ],
)
def test_policy_numbers_must_mean_something(doc, message):
    with pytest.raises(PolicyError, match=message) as info:
        parse_policy(doc, "p.toml")
    assert info.value.exit_code == 2


def test_only_a_trainer_pull_protects_a_checkpoint_from_retention(applied, tmp_path):
    """A resume record changes what retention may delete: a viewer's pull must not make one."""
    from sqlmodel import select

    from registry.catalog.models import Project, Run

    def resumed() -> int | None:
        with as_user("dave") as dave, dave.catalog.session() as s:
            return s.exec(
                select(Run.resumed_from_step)
                .join(Project)
                .where(Run.name == "r", Project.name == "team-a")
            ).one()

    with as_user("bob") as bob:
        bob.pull("team-a/r@step4", tmp_path / "viewer")
    assert resumed() is None
    with as_user("alice") as alice:
        alice.pull("team-a/r@step4", tmp_path / "trainer")
    assert resumed() == 4
    with as_user("dave") as dave:
        assert [e["target"] for e in dave.audit_log() if e["action"] == "resume"] == [
            "team-a/r@step4"
        ]


def test_not_found_hints_name_nothing_the_caller_cannot_read(applied):
    with as_user("bob") as bob, pytest.raises(NotFound) as info:
        bob.show("tiny-missing:v1")  # bob may read tiny*, not every model's name
    assert info.value.hint == (
        "reg releases lists the models you may read; a checkpoint is RUN@stepN or RUN@latest"
    )


def test_an_admin_of_one_project_is_not_an_admin_of_the_registry():
    scoped = parse_policy(
        '[[access.grants]]\nprincipals = ["erin"]\nrole = "admin"\nprojects = ["team-c"]\n'
        '[[access.grants]]\nprincipals = ["dave"]\nrole = "admin"\n'
    ).access.grants
    for action in ("policy", "gc", "storage", "catalog", "audit", "repair"):
        assert not check(scoped, "erin", action).allowed, action
        assert check(scoped, "dave", action).allowed, action
    # Admin grants are registry-wide or nothing: not even in its own project (DESIGN §6).
    assert not check(scoped, "erin", "yank", project="team-c").allowed
    assert not check(scoped, "erin", "read", project="team-c").allowed
