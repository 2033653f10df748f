"""Administration that is neither checkpoint nor release: the store's set-up and the audit log."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from policies.access import Action
from registry.trust import audit

if TYPE_CHECKING:
    from registry.lifecycle.context import Context


def storage_init(ctx: Context) -> dict[str, Any]:
    """Check the store and set what it needs: lifecycle rules on S3, the root directory on a
    local store (`reg storage init`)."""
    # Through reg server a denial names no location: the store is the server's business.
    ctx.authorize(Action.STORAGE, target="the store" if ctx.server else ctx.store.url)
    out = ctx.store.init()
    with ctx.catalog.session(write=True) as s:
        ctx.audit(
            s,
            "storage-init",
            ctx.store.url,
            **{k: v for k, v in out.items() if isinstance(v, bool | str)},
        )
    return out


def audit_log(
    ctx: Context,
    *,
    since: float | None = None,
    actor: str | None = None,
    action: str | None = None,
) -> list[dict[str, Any]]:
    ctx.authorize(Action.AUDIT, target="audit log")
    with ctx.catalog.session() as s:
        return audit.query(s, since=since, actor=actor, action=action)
