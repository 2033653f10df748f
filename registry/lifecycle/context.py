"""`Context`: everything a lifecycle function needs, and nothing it should reach around for.

    catalog    the source of truth (visibility, claims, leases, audit, outbox)
    store      where the bytes are
    policy     the policy in force, parsed on first use
    principal  who is asking, with their grants: the only identity below the CLI
    events     where catalog events go (the outbox for the MLflow mirror)
    workers    parallel transfers per operation
    server     True inside `reg server`: identities are verified, so the GPU gate accepts only
               validations a validator attested
    audit_key  the audit log's HMAC key where this process holds it (the server, an operator
               on its host): events are then signed at insert (`registry.trust.audit_chain`)
    signing_dir  where this process keeps release signing keys (`release_signing.keys`):
               REG_HOME/signing of the server, or of the one embedded user

Lifecycle functions take a Context; `Registry` builds one from local settings (embedded mode),
and `reg server` builds one per request around the authenticated Principal, sharing catalog and
store. A Context is frozen: a changed policy or principal is a new Context.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from policies.access import Action
from registry.errors import PermissionDenied

if TYPE_CHECKING:
    from sqlmodel import Session

    from registry.catalog.engine import Catalog
    from registry.journal.outbox import EventSink
    from registry.storage.base import BaseStore
    from registry.trust.policy_source import EffectivePolicy
    from registry.trust.principal import Principal


@dataclass(frozen=True, kw_only=True)
class Context:
    catalog: Catalog
    store: BaseStore
    policy: EffectivePolicy
    principal: Principal
    events: EventSink
    workers: int = 4
    server: bool = False
    audit_key: bytes | None = field(default=None, repr=False)
    signing_dir: Path | None = None

    @property
    def actor(self) -> str:
        """The name that goes into the audit log and onto what this Context creates."""
        return self.principal.name

    def audit(
        self,
        session: Session,
        action: str,
        target: str,
        outcome: str = "allowed",
        /,
        **details: Any,
    ) -> None:
        """Record an audit event by this Context's principal (with the token it used, if any)."""
        from registry.trust import audit

        audit.record(
            session,
            self.actor,
            action,
            target,
            outcome,
            audit_key=self.audit_key,
            token=self.principal.credential,
            **details,
        )

    def authorize(
        self,
        action: Action,
        *,
        project: str | None = None,
        model: str | None = None,
        target: str = "",
    ) -> None:
        """Raise PermissionDenied, and audit the denial, unless the principal may do it. A
        model is judged by the project that owns it (a model not created yet: `project`, whose
        promotion would create it)."""
        owner = self.model_owner(model, new=project) if model is not None else None
        decision = self.principal.authorize(action, project=project, model=model, model_owner=owner)
        if decision.allowed:
            return
        what = target or project or model or ""
        with self.catalog.session(write=True) as s:
            self.audit(s, action, what, "denied", reason=decision.reason)
        raise PermissionDenied(
            f"{self.actor} may not {action} {what}".rstrip(),
            decision.reason + " (ask an admin to add it to the policy)",
        )

    def model_owner(self, model: str, *, new: str | None = None) -> str | None:
        """The project that owns `model`; `new` where there is no such model yet. Behind the
        server only a signed owner counts (`registry.trust.signed_facts`): an unsigned or forged
        one is unknown (None), which only grants on every project cover."""
        from sqlmodel import select

        from registry.catalog.models import Model

        if self.principal.single_user:
            return None  # decided without it
        with self.catalog.session() as s:
            row = s.exec(select(Model).where(Model.name == model)).first()
            if row is None:
                return new
            return self.trusted_owner(s, row)

    def trusted_owner(self, session: Session, row: Any) -> str | None:
        """`row.project` (a Model row) where this Context may rely on it."""
        if not self.server or row.project is None:
            return row.project  # type: ignore[no-any-return]
        from registry.trust.signed_facts import model_is_signed

        if self.audit_key is not None and model_is_signed(session, self.audit_key, row):
            return row.project  # type: ignore[no-any-return]
        _log_unsigned_model(row.name)
        return None

    def authorize_read(self, *, project: str | None = None, model: str | None = None) -> None:
        target = f"project {project}" if project else f"model {model}" if model else "registry"
        self.authorize(Action.READ, project=project, model=model, target=target)


_WARNED: set[str] = set()


def _log_unsigned_model(name: str) -> None:
    if name not in _WARNED:
        _WARNED.add(name)
        logging.getLogger("reg.policy").warning(
            json.dumps(
                {
                    "model": name,
                    "owner": "ignored",
                    "message": f"model {name}'s owner is unsigned or forged: only grants on "
                    "every project, or naming the model, cover it (reg catalog sign)",
                }
            )
        )
