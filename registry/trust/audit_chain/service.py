"""`reg audit seal` and `reg audit verify` as library calls on a Context (admin, like `reg audit`).

Both need the audit key: the server has it, and so does an operator on its host (the key file is
readable there). A client without it is told to go through the server.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from policies.access import Action
from registry.errors import RegistryError, UsageError
from registry.trust.audit_chain import anchors
from registry.trust.audit_chain.keys import AuditKeyMissing
from registry.trust.audit_chain.sealer import anchor_head, seal_pending
from registry.trust.audit_chain.verify import verify_chain

if TYPE_CHECKING:
    from registry.catalog.engine import Catalog
    from registry.lifecycle.context import Context
    from registry.storage.base import BaseStore


def _key(ctx: Context, what: str) -> bytes:
    if ctx.audit_key is None:
        raise AuditKeyMissing(
            f"{what} the audit log needs the server's audit key, which this process cannot read",
            "run it through the server (REG_URL) or on the server's host (REG_AUDIT_KEY_FILE)",
        )
    return ctx.audit_key


def seal(ctx: Context) -> dict[str, Any]:
    """Seal every signed event not sealed yet (the whole log is scanned) and anchor the head
    in the store now: {seals, sealed, refused, head, anchor}."""
    ctx.authorize(Action.AUDIT, target="audit log")
    key = _key(ctx, "sealing")
    with ctx.catalog.session(write=True) as s:
        ctx.audit(s, "audit-seal", "audit log")
    run = seal_pending(ctx.catalog, key, full=True)
    with ctx.catalog.session() as s:
        head = anchor_head(s)
    anchor = anchors.write(ctx.store, key, head) if head is not None else None
    return {
        **run.to_json(),
        "head": None if head is None else {"seq": head.seq, "mac": head.mac, "events": head.events},
        "anchor": anchor,
    }


def verify(
    ctx: Context,
    *,
    max_unsealed_age_s: float | None = None,
    max_anchor_age_s: float | None = None,
) -> dict[str, Any]:
    """Check the whole log against the key and the anchors: {ok, events, sealed, unsealed,
    seals, anchors, problems: [{kind, message, event?, seal?, anchor?}], ...}. The bounds
    (seconds) default to this process's sealing intervals (`schedule.bounds`)."""
    ctx.authorize(Action.AUDIT, target="audit log")
    for flag, value in (
        ("--max-unsealed-age", max_unsealed_age_s),
        ("--max-anchor-age", max_anchor_age_s),
    ):
        if value is not None and not 0 < value < float("inf"):
            raise UsageError(f"{flag} must be a positive, finite duration", "e.g. 15m")
    key = _key(ctx, "verifying")
    out = verify_chain(
        ctx.catalog,
        ctx.store,
        key,
        max_unsealed_age_s=max_unsealed_age_s,
        max_anchor_age_s=max_anchor_age_s,
    )
    # The signed facts beside the log: a policy, validation or owner the server would ignore
    # (or a policy it cannot prove) is a problem of the history too.
    from registry.trust.fact_findings import fact_problems

    with ctx.catalog.session() as s:
        problems = fact_problems(s, ctx.store, key)
    out["problems"] += problems
    out["facts"] = {"problems": len(problems)}
    out["ok"] = not out["problems"]
    return out


def seal_now(catalog: Catalog, store: BaseStore, key: bytes) -> dict[str, Any] | None:
    """Seal what is pending and anchor the head at once, with no lease (as `seal`, unaudited):
    a policy just applied (or signed) is then provably in force when the command returns,
    instead of after the sealer's next cycle and anchor (`registry.trust.proven_policy`). The
    caller's work is committed: a failure here is logged, and the scheduled sealer retries."""
    try:
        seal_pending(catalog, key)
        with catalog.session() as s:
            head = anchor_head(s)
        return anchors.write(store, key, head) if head is not None else None
    except RegistryError as exc:
        logging.getLogger("reg.audit").warning("sealing now failed: %s", exc.message)
        return None
