"""Who is asking: the only source of identity below the CLI (DESIGN §6, §9).

A `Principal` is a name, how that name was established, and the grants of the policy in force
that name it. Embedded, the name is asserted by the environment (`REG_USER`, config.toml or the
OS login): advisory, as DESIGN §9 says. `reg server` builds one per request from a verified
token. Lifecycle code never reads the environment for identity; it asks the Principal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from policies.access import (
    ACTIONS,
    SINGLE_USER,
    Action,
    Decision,
    check_grants,
    gives,
    is_scoped_admin,
)

if TYPE_CHECKING:
    from policies.loader import Grant
    from registry.trust.policy_source import EffectivePolicy


@dataclass(frozen=True, slots=True)
class Principal:
    name: str
    authenticated_by: str  # "REG_USER", "config.toml", "OS login", "caller", "token", ...
    grants: tuple[Grant, ...] = ()  # the policy's grants that name this principal
    single_user: bool = False  # the policy has no grants at all: everyone is admin
    credential: str | None = None  # the id of the token that proved the name (reg server)

    @classmethod
    def under(
        cls,
        name: str,
        authenticated_by: str,
        policy: EffectivePolicy,
        credential: str | None = None,
    ) -> Principal:
        """`name` with what `policy` grants it. A policy without grants is single-user mode,
        decided without validating the whole document (listings stay fast)."""
        if not policy.has_grants:
            return cls(name, authenticated_by, single_user=True, credential=credential)
        mine = tuple(g for g in policy.access.grants if name in g.principals)
        return cls(name, authenticated_by, mine, credential=credential)

    def authorize(
        self,
        action: Action,
        *,
        project: str | None = None,
        model: str | None = None,
        model_owner: str | None = None,
    ) -> Decision:
        """May this principal do `action` on the project and/or model named (owned by project
        `model_owner`; None: unknown)?"""
        if self.single_user:
            return Decision(True, SINGLE_USER)
        return check_grants(
            self.grants, self.name, action, project=project, model=model, model_owner=model_owner
        )

    def may_anywhere(self, action: Action) -> bool:
        """Could any project or model allow `action`? (A cheap first check before reading a
        large request; the real check names the target.)"""
        if self.single_user:
            return True
        needed = ACTIONS[action]
        return any(gives(g.role, needed) and not is_scoped_admin(g) for g in self.grants)

    def can_read(
        self,
        *,
        project: str | None = None,
        model: str | None = None,
        model_owner: str | None = None,
    ) -> bool:
        return self.authorize(
            Action.READ, project=project, model=model, model_owner=model_owner
        ).allowed
