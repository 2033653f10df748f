"""`reg server init --admin NAME`: the first admin of a shared registry and its token.

Run on the server's host with the server's settings (whoever can read the catalog credentials
is already trusted with everything). With no grants in force it applies the policy in force
plus an admin grant for NAME, so the registry leaves single-user mode; when grants exist, NAME
must already be an admin under them. Either way it mints a token for NAME, shown once.

It also creates the audit key (`REG_AUDIT_KEY_FILE`, default `REG_HOME/audit.key`: 32 random
bytes, mode 0600, never over an existing one) that `reg server` signs the audit log with; its
own events are the first it signs, and it seals them before it returns. Replicas share that
one file. And, unless one is active, the release signing key
(`REG_HOME/signing/<key_id>.pem`, 0600), which replicas share likewise.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from policies.access import Action, check_grants
from registry.catalog.engine import Catalog
from registry.core.config import checked_user
from registry.errors import PolicyError
from registry.journal.outbox import Outbox
from registry.lifecycle.context import Context
from registry.operations.policy_admin import apply_text
from registry.storage import open_store
from registry.trust.audit_chain import keys
from registry.trust.audit_chain.service import seal_now
from registry.trust.policy_source import EffectivePolicy
from registry.trust.principal import Principal
from registry.trust.release_signing import keys as signing_keys
from registry.trust.tokens import mint

if TYPE_CHECKING:
    from registry.core.config import Settings


def init_admin(settings: Settings, admin: str, *, operator: str) -> dict[str, Any]:
    checked_user(admin, "--admin")
    created = keys.create(settings.audit_key_path)
    key = keys.read(settings.audit_key_path)
    catalog = Catalog.of(settings.catalog)
    try:
        policy = EffectivePolicy.load(catalog, policy_path=settings.policy_path, home=settings.home)
        applied = None
        if not policy.has_grants:
            name = json.dumps(admin, ensure_ascii=False)  # a TOML basic string, escaped
            text = policy.text.rstrip() + (
                f"\n\n[[access.grants]]  # added by reg server init\nprincipals = [{name}]\n"
                'role = "admin"\n'
            )
            # the policy (its grants) goes to the store's journal, as every apply does
            ctx = _as_admin(settings, catalog, policy, admin, operator, key)
            applied = apply_text(ctx, text, "reg server init")
        elif not check_grants(policy.access.grants, admin, Action.POLICY).allowed:
            raise PolicyError(
                f"{admin} is not an admin under the policy in force ({policy.source})",
                "name an admin of that policy, or have an admin add one",
            )
        signing = _signing_key(settings, catalog, admin, operator, key)
        created_by = f"reg server init ({operator})"
        token = mint(catalog, admin, created_by=created_by, expires_s=None, key=key)
        with catalog.session(write=True) as s:
            from registry.trust import audit

            audit.record(
                s,
                operator,
                "token-create",
                f"token {token.split('_')[1]}",
                audit_key=key,
                principal=admin,
            )
        # sealed and anchored now: the server may start minutes later, and its first seal
        # would otherwise take these events late (`sealed-late` in `reg audit verify`)
        seal_now(catalog, open_store(settings.store_url, s3=settings.s3), key)
        return {
            "principal": admin,
            "token": token,
            "policy": applied,
            "audit_key": {"path": str(settings.audit_key_path), "created": created},
            "signing_key": signing,
        }
    finally:
        catalog.dispose()


def _signing_key(
    settings: Settings, catalog: Catalog, admin: str, operator: str, audit_key: bytes
) -> dict[str, Any]:
    """The release signing key: created unless one is active already, its private
    half under REG_HOME/signing beside the audit key (a registry behind the server signs every
    release: `[promotion] require_signature = "auto"`)."""
    policy = EffectivePolicy.load(catalog, policy_path=settings.policy_path, home=settings.home)
    ctx = _as_admin(settings, catalog, policy, admin, operator, audit_key)
    with catalog.session() as s:
        current = signing_keys.active(s, audit_key)
    if current is not None:
        return {"key_id": current.key_id, "created": False}
    return {"key_id": signing_keys.create(ctx).key_id, "created": True}


def _as_admin(
    settings: Settings,
    catalog: Catalog,
    policy: EffectivePolicy,
    admin: str,
    operator: str,
    audit_key: bytes,
) -> Context:
    """What `reg server init` does, it does as the first admin, signing with the audit key."""
    return Context(
        catalog=catalog,
        store=open_store(settings.store_url, s3=settings.s3),
        policy=policy,
        principal=Principal.under(admin, f"reg server init by {operator}", policy),
        events=Outbox(settings, audit_key=audit_key),
        audit_key=audit_key,
        signing_dir=settings.signing_dir,
    )
