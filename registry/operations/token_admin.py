"""Tokens of `reg server`, administered (admin): create, list, revoke; each change audited."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from policies.access import Action
from policies.loader import PRINCIPAL
from registry.errors import UsageError
from registry.trust import tokens

if TYPE_CHECKING:
    from registry.lifecycle.context import Context

MAX_EXPIRY_S = 10 * 365 * 86400.0
SERVER_PRINCIPAL = "reg-server"  # who the server's own scheduled work acts as


def create(ctx: Context, principal: str, *, expires_s: float | None) -> dict[str, Any]:
    """A new token for `principal`, returned in full once (only its hash is kept)."""
    if not PRINCIPAL.fullmatch(principal) or principal == SERVER_PRINCIPAL:
        raise UsageError(
            f"{principal[:64]!r} cannot hold a token",
            "a principal as grants name them: letters, digits, . _ @ -, not reg-server",
        )
    if expires_s is not None and not (math.isfinite(expires_s) and 0 < expires_s <= MAX_EXPIRY_S):
        raise UsageError(f"--expires must be positive and at most {MAX_EXPIRY_S / 86400:.0f} days")
    ctx.authorize(Action.TOKEN, target=f"token for {principal}")
    token = tokens.mint(
        ctx.catalog, principal, created_by=ctx.actor, expires_s=expires_s, key=ctx.audit_key
    )
    token_id, _ = tokens.split(token)
    with ctx.catalog.session(write=True) as s:
        ctx.audit(s, "token-create", f"token {token_id}", principal=principal, expires_s=expires_s)
    return {"id": token_id, "principal": principal, "token": token}


def listing(ctx: Context) -> list[dict[str, Any]]:
    ctx.authorize(Action.TOKEN, target="tokens")
    return tokens.listing(ctx.catalog)


def revoke(ctx: Context, token_id: str) -> dict[str, Any]:
    ctx.authorize(Action.TOKEN, target=f"token {token_id[:32]}")
    out = tokens.revoke(ctx.catalog, token_id, revoked_by=ctx.actor)
    with ctx.catalog.session(write=True) as s:
        ctx.audit(s, "token-revoke", f"token {out['id']}", principal=out["principal"])
    return out
