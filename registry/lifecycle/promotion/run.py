"""`promote`: the stages of a promotion in order (see the package); this package's `__init__`
imports nothing, so its modules (hf.py, signed.py) load without the whole promotion."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlmodel import col, select

from registry.catalog import claims
from registry.catalog.leases import hold
from registry.catalog.mlflow_names import refuse_colliding_model
from registry.catalog.models import ACTIVE, Model, Release
from registry.core.refs import CheckpointRef, ReleaseRef
from registry.errors import RegistryError
from registry.lifecycle.alias_workflow import change_alias
from registry.lifecycle.promotion.hf import release_hf
from registry.lifecycle.promotion.plan import (
    PromotionPlan,
    check_resumable,
    plan_promotion,
    validation_for,
)
from registry.lifecycle.promotion.signed import signer_for
from registry.lifecycle.promotion.stages import (
    AlreadyReleased,
    build,
    commit,
    proved,
    reserve,
)
from registry.lifecycle.releases import resolve_release, uri_of
from registry.lifecycle.views import ReleaseView

if TYPE_CHECKING:
    from registry.core.progress import Progress
    from registry.lifecycle.context import Context


def promote(
    ctx: Context,
    ref: CheckpointRef,
    *,
    model: str,
    alias: str | None = None,
    dtype: str | None = None,
    max_shard_size: str = "5GB",
    extras: list[Path] | None = None,
    model_factory: str | None = None,
    progress: Progress | None = None,
    layout: str | None = None,
    allow_unclassified: bool = False,
    strip_prefix: str | None = None,
    convert: str | None = None,
    base: str | None = None,
) -> dict[str, Any]:
    plan = plan_promotion(
        ctx,
        ref,
        model=model,
        alias=alias,
        dtype=dtype,
        max_shard_size=max_shard_size,
        extras=list(extras or []),
        model_factory=model_factory,
        layout=layout,
        allow_unclassified=allow_unclassified,
        strip_prefix=strip_prefix,
        convert=convert,
        base=base,
    )
    existing = _existing(ctx, plan)
    if existing is not None:
        return _with_hf(ctx, existing)
    with ctx.catalog.session() as s:  # before any validation work; again when it is created
        refuse_colliding_model(s, plan.model)
    check_resumable(ctx, plan)
    signer = signer_for(ctx)  # a registry that signs refuses before any work without a key
    validation = validation_for(ctx, plan)
    with (
        hold(ctx.catalog, ctx.actor, plan.checkpoint.id or 0, f"promote {plan.source}"),
        proved(ctx, plan, progress) as source,
    ):
        try:
            reservation = reserve(ctx, plan, validation)
        except AlreadyReleased:  # a concurrent twin won the race: its release is this one
            existing = _existing(ctx, plan)
            if existing is not None:
                return _with_hf(ctx, existing)
            raise
        with claims.held(ctx.catalog, reservation.claim):
            built = build(ctx, plan, reservation, source, progress)
            out = commit(ctx, plan, reservation, built, signer)
    out["existing"] = False
    return _with_hf(ctx, out)


def _with_hf(ctx: Context, out: dict[str, Any]) -> dict[str, Any]:
    """`hf` and `hf_config` of the release (as `reg show` has them). The release is made: a
    file that cannot be read back now is a note, not a failed promotion."""
    try:
        with ctx.catalog.session() as s:
            model, release = resolve_release(s, ReleaseRef(out["model"], version=out["version"]))
            view = ReleaseView.load(s, model, release)
        out.update(release_hf(ctx, view))
    except RegistryError as exc:
        out["hf"] = {"complete": False, "missing": [], "notes": [str(exc)]}
        out.setdefault("hf_config", None)
        out.setdefault("code_extras", None)  # not known: the release could not be read back
    return out


def _existing(ctx: Context, plan: PromotionPlan) -> dict[str, Any] | None:
    """The active release this checkpoint already made with these options (the alias moved to
    it when one is asked for)."""
    with ctx.catalog.session(write=plan.alias is not None) as s:
        row = s.exec(
            select(Model, Release)
            .join(Release, col(Release.model_id) == Model.id)
            .where(
                Model.name == plan.model,
                Release.source_checkpoint_id == plan.checkpoint.id,
                Release.options_key == plan.options_key,
                Release.status == ACTIVE,
            )
            .order_by(col(Release.version).desc())
        ).first()
        if row is None:
            return None
        model, release = row
        moved = change_alias(ctx, s, model, plan.alias, release) if plan.alias else {}
        out = ReleaseView.load(s, model, release).to_json(uri_of(ctx, model.name, release.version))
        out["alias_request"] = moved.get("request")
    out["existing"] = True
    return out
