"""Who is asking: a bearer credential becomes the request's Principal. A reg token
(`reg_<id>_<secret>`) is verified against the catalog; a JWT (three dotted parts) against the
configured OIDC issuer (registry/server/oidc.py). Either way the policy's grants apply.

Identity comes only from the token: `REG_USER`, headers and bodies name nobody. A request
without a valid token is refused before any work (401, exit 4) and the refusal is logged by the
server, not audited (an anonymous caller has no principal to record)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import Depends, Request

from registry.errors import Unauthenticated
from registry.journal.outbox import Outbox
from registry.lifecycle.context import Context
from registry.server.oidc import looks_like_jwt
from registry.trust.audit_chain import keys as audit_keys
from registry.trust.principal import Principal
from registry.trust.tokens import PREFIX, split, verify

if TYPE_CHECKING:
    from registry.lifecycle.context import Context
    from registry.server.state import ServerState


def bearer(request: Request) -> str:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise Unauthenticated(
            "this registry needs a token", "reg login URL, or set REG_TOKEN (an admin mints one)"
        )
    return token.strip()


def context_for(request: Request) -> Context:
    """The Context of this request: the verified principal under the policy in force now."""
    state: ServerState = request.app.state.reg
    token = bearer(request)
    name, how, credential = _identify(state, request, token)
    policy = state.policy()
    principal = Principal.under(name, how, policy, credential=credential)
    if principal.single_user:
        # A policy without grants is single-user mode embedded; behind the server it would make
        # every token holder an admin. No grant, no access: `reg server init` adds one.
        principal = Principal(name, how, (), credential=credential)
    request.state.principal = name
    request.state.token_id = credential
    ctx = Context(
        catalog=state.catalog,
        store=state.store,
        policy=policy,
        principal=principal,
        events=Outbox(state.settings, audit_key=state.key),
        workers=state.settings.workers,
        server=True,
        audit_key=state.key,  # signs its events and facts
        signing_dir=state.settings.signing_dir,  # signs releases (the key never leaves)
    )
    request.state.events = ctx.events
    return ctx


def _identify(state: ServerState, request: Request, token: str) -> tuple[str, str, str]:
    """(principal, how it was proven, credential id) of a reg token or an OIDC JWT."""
    if not token.startswith(PREFIX) and looks_like_jwt(token):
        request.state.token_id = "oidc"  # logged even when the JWT is refused
        if state.oidc is None:
            raise Unauthenticated(
                "this server accepts no JWTs (OIDC is not configured)",
                "use a reg token (reg token create), or have REG_OIDC_* set on the server",
            )
        identity = state.oidc.verify(token)
        return identity.principal, "oidc", identity.credential
    if not token.startswith(PREFIX):
        raise Unauthenticated(
            "the token is malformed: neither a reg token (reg_...) nor a JWT",
            "log in again with a valid token (reg login, or REG_TOKEN)",
        )
    request.state.token_id = split(token)[0]  # logged even when the token is refused

    verified = verify(state.catalog, token, audit_keys.for_server(state.settings.audit_key_path))
    return verified.principal, "token", verified.token_id


CTX = Depends(context_for)  # an endpoint's `ctx: Context = CTX`
