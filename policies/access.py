"""Who may do what: roles, grants and a pure check (DESIGN §6).

Roles are ordered viewer < trainer < releaser < admin; each adds actions to the one below.
A grant gives one role to principals on project globs (checkpoints) and model globs (releases).
No grants at all is single-user mode: everyone is admin.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from policies.loader import ROLES, Grant

ACTIONS: dict[str, str] = {
    # viewer
    "read": "viewer",
    # trainer
    "push": "trainer",
    "pin": "trainer",
    "unpin": "trainer",
    "validate": "trainer",
    # releaser
    "promote": "releaser",
    "alias": "releaser",
    "deprecate": "releaser",
    # admin
    "gc": "admin",
    "yank": "admin",
    "audit": "admin",
    "policy": "admin",
    "storage": "admin",
    "mlflow-sync": "admin",
    "catalog": "admin",
}


@dataclass(frozen=True, slots=True)
class Decision:
    allowed: bool
    reason: str


def _rank(role: str) -> int:
    return ROLES.index(role)


def _matches(globs: list[str], name: str | None) -> bool:
    return name is None or any(fnmatch.fnmatchcase(name, g) for g in globs)


def check(
    grants: list[Grant],
    principal: str,
    action: str,
    *,
    project: str | None = None,
    model: str | None = None,
) -> Decision:
    """Allow `principal` to do `action` on the project and/or model named?"""
    needed = ACTIONS[action]
    if not grants:
        return Decision(True, "single-user mode (no grants in the policy)")
    for grant in grants:
        if principal not in grant.principals or _rank(grant.role) < _rank(needed):
            continue
        if _matches(grant.projects, project) and _matches(grant.models, model):
            return Decision(True, f"granted {grant.role} on {_scope(grant)}")
    scope = (
        ", ".join(
            part
            for part in (f"project {project}" if project else "", f"model {model}" if model else "")
            if part
        )
        or "the registry"
    )
    return Decision(False, f"needs a {needed} grant covering {scope}")


def can_read_project(grants: list[Grant], principal: str, project: str) -> bool:
    return check(grants, principal, "read", project=project).allowed


def can_read_model(grants: list[Grant], principal: str, model: str) -> bool:
    return check(grants, principal, "read", model=model).allowed


def _scope(grant: Grant) -> str:
    return f"projects {','.join(grant.projects)} / models {','.join(grant.models)}"
