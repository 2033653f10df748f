"""The administration endpoints (admin, or the role each names): GC, fsck, scrubs, catalog
rebuild, storage init, the audit log, policy, the MLflow drain, tokens."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from policies.access import Action
from registry.context import Context
from registry.errors import UsageError
from registry.server.auth import CTX
from registry.server.requests import authed_body, flag, opt_text, text

router = APIRouter()


# -- administration --------------------------------------------------------------------------------


@router.post("/gc")
async def gc(request: Request) -> dict[str, Any]:
    from registry.operations.gc import run_gc

    ctx, doc = await authed_body(request)
    return await run_in_threadpool(lambda: run_gc(ctx, dry_run=flag(doc, "dry_run")))


@router.post("/fsck")
async def fsck(request: Request) -> dict[str, Any]:
    from registry.operations.fsck import fsck as run_fsck

    ctx, doc = await authed_body(request)
    sample = doc.get("sample", 32)
    if not isinstance(sample, int) or isinstance(sample, bool) or sample < 0:
        raise UsageError("sample must be a number of files, 0 or more")
    return await run_in_threadpool(
        lambda: run_fsck(
            ctx,
            project=opt_text(doc, "project"),
            full=flag(doc, "full"),
            sample=sample,
            repair=flag(doc, "repair"),
        )
    )


@router.post("/catalog/rebuild")
async def rebuild(request: Request) -> dict[str, Any]:
    from registry.operations.rebuild import rebuild as run_rebuild

    ctx, doc = await authed_body(request)
    return await run_in_threadpool(lambda: run_rebuild(ctx, dry_run=flag(doc, "dry_run")))


@router.post("/storage/init")
def storage_init(ctx: Context = CTX) -> dict[str, Any]:
    from registry.operations.admin import storage_init as run_init

    return run_init(ctx)


@router.get("/audit")
def audit_log(
    since: float | None = None,
    actor: str | None = None,
    action: str | None = None,
    ctx: Context = CTX,
) -> list[dict[str, Any]]:
    from registry.operations.admin import audit_log as query

    return query(ctx, since=since, actor=actor, action=action)


@router.post("/audit/verify")
def audit_verify(
    max_unsealed_age: float | None = None,
    max_anchor_age: float | None = None,
    ctx: Context = CTX,
) -> dict[str, Any]:
    """The bounds are seconds; by default the server's own (its sealing intervals)."""
    from registry.audit_chain.service import verify

    return verify(ctx, max_unsealed_age_s=max_unsealed_age, max_anchor_age_s=max_anchor_age)


@router.post("/audit/seal")
def audit_seal(ctx: Context = CTX) -> dict[str, Any]:
    from registry.audit_chain.service import seal

    return seal(ctx)


@router.get("/policy")
def policy_show(ctx: Context = CTX) -> dict[str, Any]:
    from registry.operations.policy_admin import show as run_show

    return run_show(ctx)


@router.post("/policy")
async def policy_apply(request: Request) -> dict[str, Any]:
    from registry.operations.policy_admin import apply_text

    ctx, doc = await authed_body(request)
    return await run_in_threadpool(
        apply_text, ctx, text(doc, "text"), text(doc, "name", "policy")[:200]
    )


@router.get("/policy/export")
def policy_export(bucket: str | None = None, ctx: Context = CTX) -> dict[str, Any]:
    from registry.operations.policy_admin import export

    document, missing = export(ctx, bucket)
    return {"document": document, "missing": missing}


@router.post("/mlflow/sync")
async def mlflow_sync(request: Request) -> dict[str, Any]:
    from registry.mirror.drain import drain, skip_event

    ctx, doc = await authed_body(request)
    budget = doc.get("budget_s", 300.0)
    if isinstance(budget, bool) or not isinstance(budget, int | float) or not 0 < budget <= 3600:
        raise UsageError("budget_s must be a number of seconds in (0, 3600]")
    skip = doc.get("skip")
    if skip is not None and (isinstance(skip, bool) or not isinstance(skip, int) or skip < 1):
        raise UsageError("skip must be an event id (a positive integer)")
    settings = request.app.state.reg.settings

    def work() -> dict[str, Any]:
        ctx.authorize(Action.MLFLOW_SYNC, target="the MLflow mirror")
        skipped = skip_event(ctx, skip) if skip is not None else None
        out = drain(ctx.catalog, settings, float(budget), wait=True, holder=ctx.actor)
        return out | ({"skipped": skipped} if skipped else {})

    return await run_in_threadpool(work)


@router.post("/scrub")
async def scrub(request: Request) -> dict[str, Any]:
    from registry.operations.scrub import check_rate
    from registry.operations.scrub import scrub as run_scrub

    ctx, doc = await authed_body(request)
    rate, limit = doc.get("rate"), doc.get("limit")
    if rate is not None:
        if isinstance(rate, bool) or not isinstance(rate, int | float):
            raise UsageError("rate must be bytes per second")
        try:
            rate = check_rate(float(rate))
        except OverflowError:
            raise UsageError("rate must be bytes per second, 1 to 1e13") from None
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise UsageError("limit must be a number of artifacts, 1 or more")
    return await run_in_threadpool(lambda: run_scrub(ctx, rate=rate, limit=limit))


# -- tokens ----------------------------------------------------------------------------------------


@router.post("/tokens")
async def token_create(request: Request) -> dict[str, Any]:
    from registry.operations import token_admin

    ctx, doc = await authed_body(request)
    expires = doc.get("expires_s")
    if expires is not None and (isinstance(expires, bool) or not isinstance(expires, int | float)):
        raise UsageError("expires_s must be a number of seconds")
    return await run_in_threadpool(
        lambda: token_admin.create(ctx, text(doc, "principal"), expires_s=expires)
    )


@router.get("/tokens")
def token_list(ctx: Context = CTX) -> list[dict[str, Any]]:
    from registry.operations import token_admin

    return token_admin.listing(ctx)


@router.delete("/tokens/{token_id}")
def token_revoke(token_id: str, ctx: Context = CTX) -> dict[str, Any]:
    from registry.operations import token_admin

    return token_admin.revoke(ctx, token_id)
