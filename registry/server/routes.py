"""The JSON endpoints of `reg server` written by hand: those whose client does work of its own
(a validation run on the validator's device, a promotion's extras, a policy file, a heartbeat's
figures) and `/whoami`. The other `Registry` methods' endpoints are derived from the contract
(`contract_routes.py`); the data path (push, file reads) is `data.py`, claims `claims.py`.
Each builds the request's Context from its token and calls the same lifecycle function as the
embedded mode; access checks and audit happen there.
"""

from __future__ import annotations

import base64
import binascii
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from policies.access import Action
from registry.catalog.leases import HOLD_PREFIX, release, take_hold
from registry.core.layout import checkpoint_prefix
from registry.core.refs import CheckpointRef, check_name, parse_checkpoint_ref
from registry.economics.records import record_heartbeat
from registry.errors import UsageError
from registry.lifecycle.checkpoints.read import resolve
from registry.lifecycle.checkpoints.resume_facts import facts_of_checkpoint
from registry.lifecycle.context import Context
from registry.lifecycle.promotion.run import promote as run_promotion
from registry.lifecycle.validation import Attempt, record
from registry.operations.policy_admin import apply_text
from registry.server.auth import CTX, context_for
from registry.server.presigned import read_urls
from registry.server.requests import MAX_PROMOTE_BYTES, authed_body, flag, json_body, opt_text, text
from registry.server.upload import private_dir, release_dir

router = APIRouter()
VALIDATOR_HOLD_S = 6 * 3600.0


# -- who am I --------------------------------------------------------------------------------------


@router.get("/whoami")
def whoami(ctx: Context = CTX) -> dict[str, Any]:
    return {
        "principal": ctx.actor,
        "authenticated_by": ctx.principal.authenticated_by,  # token or oidc
        "token": ctx.principal.credential,
        "grants": [g.model_dump(mode="json") for g in ctx.principal.grants],
        "single_user": ctx.principal.single_user,
    }


# -- validation: a validator's report --------------------------------------------------------------


@router.post("/validations/begin")
async def validation_begin(request: Request) -> dict[str, Any]:
    """A validator is about to validate `ref` on its own device: refused now (and audited)
    unless it may attest; answers what it needs (the checkpoint's files and the policy)."""
    ctx, doc = await authed_body(request)
    ref = parse_checkpoint_ref(text(doc, "ref"))

    def work() -> dict[str, Any]:
        ctx.authorize(Action.ATTEST, project=ref.project, target=str(ref))
        _, ckpt, files = resolve(ctx, ref)
        full = CheckpointRef(ref.project, ref.run, ckpt.step)
        # Retention keeps it while the validator works (given back with the report, or it
        # runs out after VALIDATOR_HOLD_S if the validator dies).
        name, token = take_hold(
            ctx.catalog, ctx.actor, ckpt.id or 0, f"validate {full}", VALIDATOR_HOLD_S
        )
        prefix = checkpoint_prefix(full.project, full.run, full.step or 0)
        urls = read_urls(ctx, prefix, files)  # on S3 the validator reads the bucket directly
        return {
            "ref": str(full),
            "layout": facts_of_checkpoint(ctx, full, ckpt, files, record=True).layout,
            "hold": {"name": name, "token": token},
            "metrics": dict(ckpt.metrics),
            "files": [
                f.to_json() | {"rank": f.rank} | ({"url": urls[f.path]} if urls else {})
                for f in files
            ],
            "policy": ctx.policy.text,
        }

    return await run_in_threadpool(work)


@router.post("/validations")
async def validation_record(request: Request) -> dict[str, Any]:
    """Record a validator's validation: attested, the only kind the server's GPU gate takes."""
    ctx, doc = await authed_body(request)
    ref = parse_checkpoint_ref(text(doc, "ref"))
    attempt = Attempt.from_json(doc.get("attempt"))
    hold = doc.get("hold")

    def work() -> dict[str, Any]:
        ctx.authorize(Action.ATTEST, project=ref.project, target=str(ref))
        _, ckpt, _ = resolve(ctx, ref)
        full = CheckpointRef(ref.project, ref.run, ckpt.step)
        out = record(ctx, full, ckpt, attempt, attested=True)
        if isinstance(hold, dict) and str(hold.get("name", "")).startswith(
            f"{HOLD_PREFIX}{ckpt.id}:"
        ):
            release(ctx.catalog, str(hold["name"]), str(hold.get("token", "")))
        return out

    return await run_in_threadpool(work)


# -- releases --------------------------------------------------------------------------------------


@router.post("/promote")
async def promote(request: Request) -> dict[str, Any]:
    """A promotion, run here: the client only asks, so no client publishes bytes of its own
    choosing. Extras (config.json, ...) come in the body, base64, within MAX_PROMOTE_BYTES."""
    ctx = await run_in_threadpool(context_for, request)
    if not ctx.principal.may_anywhere(Action.PROMOTE):  # refused before 64 MiB are read
        await run_in_threadpool(lambda: ctx.authorize(Action.PROMOTE, target="a promotion"))
    doc = await json_body(request, MAX_PROMOTE_BYTES)
    ref = parse_checkpoint_ref(text(doc, "ref"))
    extras = doc.get("extras") or []
    if not isinstance(extras, list):
        raise UsageError("extras must be a list of {name, data}")
    if doc.get("model_factory") is not None:
        raise UsageError(
            "a model factory runs where the validation runs, not in the server",
            "reg validate REF --model-factory MOD:FN with a validator token, then promote",
        )
    state = request.app.state.reg
    model = text(doc, "model")
    await run_in_threadpool(
        lambda: ctx.authorize(Action.PROMOTE, project=ref.project, model=model, target=str(ref))
    )
    workdir, lock = private_dir(state.settings.home / "uploads", "promote")
    try:
        paths = [_write_extra(workdir, e) for e in extras]
        return await run_in_threadpool(
            lambda: run_promotion(
                ctx,
                ref,
                model=model,
                alias=opt_text(doc, "alias"),
                dtype=opt_text(doc, "dtype"),
                max_shard_size=text(doc, "max_shard_size", "5GB"),
                extras=paths,
                layout=opt_text(doc, "layout"),
                allow_unclassified=doc.get("allow_unclassified") is True,
                strip_prefix=opt_text(doc, "strip_prefix"),
                convert=opt_text(doc, "convert"),
                base=opt_text(doc, "base"),
            )
        )
    finally:
        release_dir(workdir, lock)


def _write_extra(workdir: Path, entry: object) -> Path:
    if not isinstance(entry, dict):
        raise UsageError("an extra is an object {name, data}")
    name = check_name(text(entry, "name"), "extra file name")
    try:
        data = base64.b64decode(text(entry, "data"), validate=True)
    except binascii.Error:
        raise UsageError(f"extra {name}: data is not base64") from None
    target = workdir / name
    if target.exists():
        raise UsageError(f"--extra {name}: the name appears twice")
    target.write_bytes(data)
    return target


# -- checkpoint economics --------------------------------------------------------------------------


@router.post("/runs/heartbeat")
async def heartbeat(request: Request) -> dict[str, Any]:
    """A training job's heartbeat (`CheckpointManager`; trainer); checked in the lifecycle."""
    ctx, doc = await authed_body(request)
    keys = ("step", "seconds", "world_size", "step_seconds", "saves")
    figures: dict[str, Any] = {k: doc.get(k) for k in keys}
    ended = flag(doc, "ended")
    return await run_in_threadpool(
        lambda: record_heartbeat(
            ctx, text(doc, "project"), text(doc, "run"), ended=ended, **figures
        )
    )


# -- policy ----------------------------------------------------------------------------------------


@router.post("/policy")
async def policy_apply(request: Request) -> dict[str, Any]:
    """`apply_policy`: the client reads its policy file and sends the text."""
    ctx, doc = await authed_body(request)
    return await run_in_threadpool(
        apply_text, ctx, text(doc, "text"), text(doc, "name", "policy")[:200]
    )
