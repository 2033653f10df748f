"""Identity and access below the CLI: the Principal is the only source of identity, the Context
enforces and audits, and the embedded identity says where it came from."""

from __future__ import annotations

import dataclasses

import pytest

from registry import Registry, Settings
from registry.errors import PermissionDenied
from registry.trust.policy_source import EffectivePolicy
from registry.trust.principal import Principal

GRANTS = """
[[access.grants]]
principals = ["alice"]
role = "trainer"
projects = ["team-a"]

[[access.grants]]
principals = ["root"]
role = "admin"
"""


def test_single_user_mode_decides_without_validating_the_document():
    policy = EffectivePolicy("[retention]\nkeep_last = 1\n", "p.toml")
    principal = Principal.under("anyone", "REG_USER", policy)
    assert principal.single_user and principal.authorize("gc").allowed
    assert "rules" not in vars(policy)  # the document was never validated


def test_grants_name_their_principals_and_nobody_else():
    policy = EffectivePolicy(GRANTS, "p.toml")
    alice = Principal.under("alice", "REG_USER", policy)
    erin = Principal.under("erin", "REG_USER", policy)
    assert alice.authorize("push", project="team-a").allowed
    decision = alice.authorize("push", project="team-b")
    assert (
        not decision.allowed and decision.reason == "needs a trainer grant covering project team-b"
    )
    assert not alice.authorize("gc").allowed
    assert erin.grants == () and not erin.single_user
    assert not erin.can_read(project="team-a") and not erin.authorize("read").allowed
    assert Principal.under("root", "REG_USER", policy).authorize("yank", model="m").allowed


def test_a_principal_with_no_grants_is_never_single_user():
    nobody = Principal("nobody", "token")
    assert not nobody.authorize("read").allowed


def test_context_denial_is_audited_and_one_line(tmp_path, monkeypatch):
    policy = tmp_path / "p.toml"
    policy.write_text(GRANTS)
    monkeypatch.setenv("REG_POLICY", str(policy))
    with Registry(user="alice") as alice, pytest.raises(PermissionDenied) as info:
        alice.gc(dry_run=True)
    assert str(info.value) == (
        "alice may not gc retention (needs an admin grant covering the registry "
        "(ask an admin to add it to the policy))"
    )
    with Registry(user="root") as root:
        denied = [e for e in root.audit_log() if e["outcome"] == "denied"]
        assert [(e["actor"], e["action"]) for e in denied] == [("alice", "gc")]
        ctx = root.context
        with pytest.raises(dataclasses.FrozenInstanceError):
            ctx.principal = Principal("root", "x")  # type: ignore[misc]


def test_embedded_identity_says_where_it_came_from(tmp_path, monkeypatch):
    assert Settings.from_env({"REG_HOME": str(tmp_path), "REG_USER": "bob"}).user_source == (
        "REG_USER"
    )
    (tmp_path / "config.toml").write_text('user = "carol"\n')
    from_file = Settings.from_env({"REG_HOME": str(tmp_path)})
    assert (from_file.user, from_file.user_source) == ("carol", "config.toml")
    (tmp_path / "config.toml").unlink()
    assert Settings.from_env({"REG_HOME": str(tmp_path)}).user_source == "OS login"
    with Registry(user="dave") as reg:
        assert reg.context.principal.name == "dave"
        assert reg.context.principal.authenticated_by == "caller"
