"""Who is asking: a bearer token, verified against the catalog, becomes the request's Principal.

Identity comes only from the token: `REG_USER`, headers and bodies name nobody. A request
without a valid token is refused before any work (401, exit 4) and the refusal is logged by the
server, not audited (an anonymous caller has no principal to record)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import Depends, Request

from registry.errors import Unauthenticated

if TYPE_CHECKING:
    from registry.context import Context
    from registry.server.app import ServerState


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
    from registry.context import Context
    from registry.events import Outbox
    from registry.policy_source import EffectivePolicy
    from registry.principal import Principal
    from registry.tokens import split, verify

    state: ServerState = request.app.state.reg
    token = bearer(request)
    request.state.token_id = split(token)[0]  # logged even when the token is refused
    verified = verify(state.catalog, token)
    policy = EffectivePolicy.load(
        state.catalog, policy_path=state.settings.policy_path, home=state.settings.home
    )
    principal = Principal.under(verified.principal, "token", policy, credential=verified.token_id)
    if principal.single_user:
        # A policy without grants is single-user mode embedded; behind the server it would make
        # every token holder an admin. No grant, no access: `reg server init` adds one.
        principal = Principal(verified.principal, "token", (), credential=verified.token_id)
    request.state.principal = verified.principal
    request.state.token_id = verified.token_id
    ctx = Context(
        catalog=state.catalog,
        store=state.store,
        policy=policy,
        principal=principal,
        events=Outbox(state.settings),
        workers=state.settings.workers,
        server=True,
    )
    request.state.events = ctx.events
    return ctx


CTX = Depends(context_for)  # an endpoint's `ctx: Context = CTX`
