"""Who may do what: roles, grants and a pure check (DESIGN §6).

Roles are ordered viewer < trainer < releaser < admin; each adds actions to the one below.
`validator` stands beside them: it reads and attests validations (through `reg server`, only a
validator's validation passes the GPU gate); admin includes it. A grant gives one role to
principals on project globs (checkpoints) and model globs (releases). A grant that leaves
`models` out covers the models its projects own: a model belongs to the project it was first
released from, so a releaser of team-b cannot publish into, move the aliases of or deprecate
team-a's model unless a grant names that model explicitly. Admin grants are
registry-wide: one scoped to some projects or models is no grant at all (`scoped_admin_grants`
names them; `policy apply` refuses them). No grants at all is single-user mode: everyone is
admin.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol


class Grant(Protocol):
    """What a check reads of a grant (`policies.loader.Grant`, whose module costs pydantic's
    import and imports this one)."""

    @property
    def principals(self) -> list[str]: ...
    @property
    def role(self) -> str: ...
    @property
    def projects(self) -> list[str]: ...
    @property
    def models(self) -> list[str] | None: ...


ROLES = ("viewer", "trainer", "releaser", "admin")
VALIDATOR = "validator"
SINGLE_USER = "single-user mode (no grants in the policy)"


class Action(StrEnum):
    """What a policy grants: each action needs one role (ACTIONS)."""

    READ = "read"
    PUSH = "push"
    PIN = "pin"
    UNPIN = "unpin"
    VALIDATE = "validate"
    PROMOTE = "promote"
    ALIAS = "alias"
    DEPRECATE = "deprecate"
    GC = "gc"
    YANK = "yank"
    AUDIT = "audit"
    POLICY = "policy"
    STORAGE = "storage"
    MLFLOW_SYNC = "mlflow-sync"
    CATALOG = "catalog"
    REPAIR = "repair"
    FSCK = "fsck"
    SCRUB = "scrub"
    TOKEN = "token"
    ATTEST = "attest"


ACTIONS: dict[Action, str] = {
    # viewer
    Action.READ: "viewer",
    # trainer
    Action.PUSH: "trainer",
    Action.PIN: "trainer",
    Action.UNPIN: "trainer",
    Action.VALIDATE: "trainer",
    # releaser
    Action.PROMOTE: "releaser",
    Action.ALIAS: "releaser",
    Action.DEPRECATE: "releaser",
    # admin
    Action.GC: "admin",
    Action.YANK: "admin",
    Action.AUDIT: "admin",
    Action.POLICY: "admin",
    Action.STORAGE: "admin",
    Action.MLFLOW_SYNC: "admin",
    Action.CATALOG: "admin",
    Action.REPAIR: "admin",
    Action.FSCK: "admin",
    Action.SCRUB: "admin",
    Action.TOKEN: "admin",
    # validator (beside the others; admin includes it)
    Action.ATTEST: VALIDATOR,
}


@dataclass(frozen=True, slots=True)
class Decision:
    allowed: bool
    reason: str


def gives(role: str, needed: str) -> bool:
    """Does holding `role` give what `needed` (a role) allows?"""
    if needed == VALIDATOR:
        return role in (VALIDATOR, "admin")
    if role == VALIDATOR:
        return needed == "viewer"
    return ROLES.index(role) >= ROLES.index(needed)


def is_scoped_admin(grant: Grant) -> bool:
    """An admin grant limited to some projects or models: registry-wide or nothing."""
    return grant.role == "admin" and (grant.projects != ["*"] or grant.models not in (None, ["*"]))


def scoped_admin_grants(grants: Sequence[Grant]) -> list[str]:
    """One line per scoped admin grant (which count as no grant at all)."""
    return [
        f"access.grants[{i}]: admin grant for {', '.join(g.principals)} is scoped to "
        f"{_scope(g)}; admin grants are registry-wide, so it grants nothing"
        for i, g in enumerate(grants)
        if is_scoped_admin(g)
    ]


def _matches(globs: list[str], name: str | None) -> bool:
    return name is None or any(fnmatch.fnmatchcase(name, g) for g in globs)


def _covers(grant: Grant, project: str | None, model: str | None, model_owner: str | None) -> bool:
    """Does a grant's scope cover the target? A scoped admin grant covers nothing: an admin of
    one project is not an admin of the registry (and could otherwise promote itself). Without
    a `models` list a grant covers the models its projects own; a model whose owner is not
    known (None) only by a grant on every project."""
    if is_scoped_admin(grant) or not _matches(grant.projects, project):
        return False
    if model is None:
        return True
    if grant.models is not None:
        return _matches(grant.models, model)
    if model_owner is None:
        return grant.projects == ["*"]
    return _matches(grant.projects, model_owner)


def check(
    grants: Sequence[Grant],
    principal: str,
    action: Action,
    *,
    project: str | None = None,
    model: str | None = None,
    model_owner: str | None = None,
) -> Decision:
    """Allow `principal` to do `action` on the project and/or model named (owned by project
    `model_owner`, None where unknown), under a policy whose grants are `grants` (none at all:
    single-user mode)?"""
    if not grants:
        return Decision(True, SINGLE_USER)
    return check_grants(
        grants, principal, action, project=project, model=model, model_owner=model_owner
    )


def check_grants(
    grants: Sequence[Grant],
    principal: str,
    action: Action,
    *,
    project: str | None = None,
    model: str | None = None,
    model_owner: str | None = None,
) -> Decision:
    """Does one of `grants` allow it? No grant, no access (single-user mode is `check`'s)."""
    needed = ACTIONS[action]
    for grant in grants:
        if principal not in grant.principals or not gives(grant.role, needed):
            continue
        if _covers(grant, project, model, model_owner):
            return Decision(True, f"granted {grant.role} on {_scope(grant)}")
    scope = (
        ", ".join(
            part
            for part in (f"project {project}" if project else "", f"model {model}" if model else "")
            if part
        )
        or "the registry"
    )
    if model and model_owner and model_owner != project:
        scope += f" (owned by project {model_owner})"
    article = "an" if needed[0] in "aeiou" else "a"
    return Decision(False, f"needs {article} {needed} grant covering {scope}")


def _scope(grant: Grant) -> str:
    models = "theirs" if grant.models is None else ",".join(grant.models)
    return f"projects {','.join(grant.projects)} / models {models}"
