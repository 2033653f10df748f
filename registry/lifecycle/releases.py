"""The release lifecycle: immutable content; only status (active, deprecated, yanked) and aliases
move, and every move is recorded (DESIGN §1, §3)."""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlmodel import Session, col, select

from policies.access import Action
from registry.catalog.models import (
    DEPRECATED,
    RELEASE_PENDING,
    YANKED,
    Alias,
    AliasEvent,
    Model,
    Release,
    ReleaseStatus,
)
from registry.core.layout import release_prefix
from registry.core.refs import ReleaseRef, check_alias, check_name, check_reason
from registry.core.timeutil import iso, now
from registry.errors import Conflict, NotFound, RegistryError, UsageError
from registry.formats.documents import FileRecord
from registry.journal import outbox as events
from registry.journal.event import ALIAS
from registry.journal.write import record as journal_record
from registry.lifecycle import alias_requests
from registry.lifecycle.promotion.hf import release_hf
from registry.lifecycle.transfer import download
from registry.lifecycle.verify import verify_files
from registry.lifecycle.views import ReleaseView, signing_key_states
from registry.storage.mlflow_artifacts import unpublish_everywhere
from registry.trust.release_signing.bundle import check_pulled

if TYPE_CHECKING:
    from registry.core.progress import Progress
    from registry.lifecycle.context import Context


# -- lookups ----------------------------------------------------------------------------------


def _model_hint(ref: ReleaseRef) -> str:
    """The likely slip behind a release ref naming no model, said without looking anything
    else up (a run of that name may be one the caller may not read)."""
    if ref.alias is not None and re.fullmatch(r"v\d+", ref.alias):
        return f"a version is written MODEL:vK ({ref.model}:{ref.alias}); reg releases lists models"
    return "reg releases lists the models you may read; a checkpoint is RUN@stepN or RUN@latest"


def resolve_release(session: Session, ref: ReleaseRef) -> tuple[Model, Release]:
    model = session.exec(select(Model).where(Model.name == ref.model)).first()
    if model is None:  # no list of names here: the caller may not be allowed to read them
        raise NotFound(f"model {ref.model} not found", _model_hint(ref))
    if ref.alias is not None:
        alias = session.exec(
            select(Alias).where(Alias.model_id == model.id, Alias.name == ref.alias)
        ).first()
        if alias is None:
            aliases = session.exec(select(Alias.name).where(Alias.model_id == model.id)).all()
            raise NotFound(
                f"alias {ref} not found",
                f"{ref.model} has aliases {', '.join(sorted(aliases))}"
                if aliases
                else f"{ref.model} has no aliases (reg alias set)",
            )
        release = session.get(Release, alias.release_id)
    else:
        release = session.exec(
            select(Release).where(Release.model_id == model.id, Release.version == ref.version)
        ).first()
    if release is None or release.status == RELEASE_PENDING:
        versions = _visible_versions(session, model.id or 0)
        raise NotFound(
            f"{ref} not found",
            f"{ref.model} has versions {', '.join(f'v{v}' for v in versions)}"
            if versions
            else f"{ref.model} has no releases yet",
        )
    return model, release


def _visible_versions(session: Session, model_id: int) -> list[int]:
    return list(
        session.exec(
            select(Release.version)
            .where(Release.model_id == model_id, Release.status != RELEASE_PENDING)
            .order_by(col(Release.version))
        ).all()
    )


def uri_of(ctx: Context, model: str, version: int) -> str:
    return ctx.store.describe(release_prefix(model, version))


def stored_files(view: ReleaseView) -> list[FileRecord]:
    """Every file of the release in the store, release.json included."""
    document = view.document_record()
    return list(view.files) + ([document] if document is not None else [])


# -- reads --------------------------------------------------------------------------------------


def list_releases(ctx: Context, model: str | None = None) -> list[dict[str, Any]]:
    if model is not None:
        check_name(model, "model name")
        owner = ctx.model_owner(model)
        if not ctx.principal.can_read(model=model, model_owner=owner):  # names leak
            raise NotFound(f"model {model} not found", "reg releases lists the models you may read")
    with ctx.catalog.session() as s:
        stmt = (
            select(Model, Release)
            .join(Release, col(Release.model_id) == Model.id)
            .where(Release.status != RELEASE_PENDING)
            .order_by(col(Model.name), col(Release.version))
        )
        if model is not None:
            stmt = stmt.where(Model.name == model)
        rows = s.exec(stmt).all()
        if model is not None and not rows:
            resolve_release(s, ReleaseRef(model, version=1))  # raises a helpful NotFound
        owners: dict[str, str | None] = {}
        keys = signing_key_states(s, ctx.audit_key)  # once, not once per release
        out = []
        for m, r in rows:
            if m.name not in owners:
                owners[m.name] = None if ctx.principal.single_user else ctx.trusted_owner(s, m)
            if ctx.principal.can_read(model=m.name, model_owner=owners[m.name]):
                out.append(ReleaseView.load(s, m, r, ctx.audit_key, keys).to_json())
        return out


def show(ctx: Context, ref: ReleaseRef) -> dict[str, Any]:
    ctx.authorize_read(model=ref.model)
    with ctx.catalog.session() as s:
        model, release = resolve_release(s, ref)
        view = ReleaseView.load(s, model, release, ctx.audit_key)
        out = view.to_json(uri_of(ctx, model.name, release.version))
        history = s.exec(
            select(AliasEvent).where(AliasEvent.model_id == model.id).order_by(col(AliasEvent.id))
        ).all()
    out["alias_history"] = [
        {
            "alias": e.name,
            "from": f"v{e.from_version}" if e.from_version else None,
            "to": f"v{e.to_version}",
            "at": iso(e.ts),
            "by": e.actor,
            # a protected alias's move: its request, who asked and who approved
            **(
                {
                    "request": e.request_id,
                    "requested_by": e.requested_by,
                    "approved_by": (e.approved_by or "").split(",") if e.approved_by else [],
                }
                if e.request_id is not None
                else {}
            ),
        }
        for e in history
        if release.version in (e.to_version, e.from_version)
    ]
    out.update(release_hf(ctx, view))  # a complete Hugging Face folder? (reads two small files)
    return out


def verify(
    ctx: Context,
    ref: ReleaseRef,
    *,
    repair: bool = False,
    provenance: bool = False,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Re-hash the stored release, release.json included; `repair` restores damaged files from
    their recorded (locked) versions; `provenance` also checks its signature and provenance
    statement against the catalog (`provenance_check`)."""
    ctx.authorize_read(model=ref.model)
    with ctx.catalog.session() as s:
        model, release = resolve_release(s, ref)
        view = ReleaseView.load(s, model, release, ctx.audit_key)
    files = stored_files(view)
    out = {
        "release": view.name,
        **verify_files(
            ctx,
            release_prefix(model.name, release.version),
            files,
            name=view.name,
            scope={"model": model.name},
            repair=repair,
            immutable=True,
            progress=progress,
        ),
    }
    if provenance:
        from registry.lifecycle import provenance_check

        signed = provenance_check.check(ctx, view, files)
        out["signature"] = signed
        out["problems"] = list(out["problems"]) + signed["problems"]
        out["ok"] = out["ok"] and signed["ok"]
    return out


def pullable(ctx: Context, ref: ReleaseRef) -> ReleaseView:
    """The release `ref` names, if the caller may read it and it was not yanked (a pull's,
    and reg server's file reads', one rule)."""
    ctx.authorize_read(model=ref.model)
    with ctx.catalog.session() as s:
        model, release = resolve_release(s, ref)
        view = ReleaseView.load(s, model, release, ctx.audit_key)
    if release.status == YANKED:
        raise Conflict(
            f"{view.name} was yanked: {release.status_reason}",
            f"pull another version of {model.name} (reg releases {model.name})",
        )
    return view


def pull(
    ctx: Context,
    ref: ReleaseRef,
    dest: Path,
    *,
    public_key: str | None = None,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Copy a release to `dest` (new or empty), every byte verified; all or nothing. With
    `public_key` (a pinned PEM) the folder is handed over only if that key signed exactly it."""
    view = pullable(ctx, ref)
    files = stored_files(view)

    def signed(folder: Path) -> None:
        if public_key is not None:
            written = [(f.path, f.sha256) for f in files]
            check_pulled(folder, written, public_key, ref.model, ref.version)

    where = download(
        ctx.store,
        release_prefix(view.model.name, view.row.version),
        files,
        dest,
        label=view.name,
        workers=ctx.workers,
        progress=progress,
        before_publish=signed,
    )
    out = view.to_json()
    out["dest"] = str(where)
    return out


# -- status and aliases -------------------------------------------------------------------------


def apply_alias_move(
    ctx: Context,
    session: Session,
    model: Model,
    alias: str,
    release: Release,
    approval: dict[str, Any] | None = None,
) -> int | None:
    """Point `alias` at `release` (in the caller's transaction); returns the previous version.
    Only once the alias's protection allowed it: `alias_workflow.change_alias` decides, and
    `approval` names a protected alias's request, its requester and the approvers counted
    ({"request", "requested_by", "approved_by"})."""
    check_alias(alias)
    if release.status == YANKED:
        raise Conflict(
            f"{model.name}:v{release.version} is yanked ({release.status_reason}); "
            f"an alias cannot point at it",
            "choose an active version",
        )
    row = session.exec(select(Alias).where(Alias.model_id == model.id, Alias.name == alias)).first()
    previous = None
    when = now()  # the row's, its history's and the journal's time: a replay recognizes it
    if row is None:
        row = Alias(
            model_id=model.id or 0,
            name=alias,
            release_id=release.id or 0,
            updated_at=when,
            updated_by=ctx.actor,
        )
    else:
        old = session.get(Release, row.release_id)
        previous = old.version if old else None
        row.release_id, row.updated_at, row.updated_by = release.id or 0, when, ctx.actor
    session.add(row)
    if previous != release.version:
        approval = approval or {}
        session.add(
            AliasEvent(
                model_id=model.id or 0,
                name=alias,
                from_version=previous,
                to_version=release.version,
                ts=when,
                actor=ctx.actor,
                request_id=approval.get("request"),
                requested_by=approval.get("requested_by"),
                approved_by=",".join(approval.get("approved_by") or ()) or None,
            )
        )
        ctx.audit(
            session,
            "alias",
            f"{model.name}@{alias}",
            to=f"v{release.version}",
            **{"from": f"v{previous}" if previous else None},
            **approval,
        )
        ctx.events.emit(
            session,
            events.ALIAS_MOVED,
            model=model.name,
            alias=alias,
            version=release.version,
            previous=previous,
            **approval,
        )
        journal_record(
            ctx,
            session,
            ALIAS,
            {"model": model.name, "version": release.version},
            {"alias": alias, "from": previous, **approval},
            ts=when,
        )
    return previous


def set_status(
    ctx: Context, ref: ReleaseRef, status: ReleaseStatus, reason: str | None = None
) -> dict[str, Any]:
    action = {DEPRECATED: Action.DEPRECATE, YANKED: Action.YANK}[status]
    reason = check_reason(reason, f"{action} reason")
    ctx.authorize(action, model=ref.model, target=str(ref))
    if status == YANKED and not (reason and reason.strip()):
        raise UsageError("a yank needs a reason", "reg yank NAME:vK --reason TEXT")
    with ctx.catalog.session(write=True) as s:
        model, release = resolve_release(s, ref)
        if release.status == YANKED:
            raise Conflict(
                f"{model.name}:v{release.version} is already yanked ({release.status_reason})",
                "a yank is final",
            )
        release.status, release.status_reason = status, reason
        release.status_changed_at, release.status_changed_by = now(), ctx.actor
        s.add(release)
        # no protected alias moves to a version withdrawn while its request waited
        cancelled = alias_requests.cancel_for_release(ctx, s, model, release, status)
        ctx.audit(s, action, f"{model.name}:v{release.version}", reason=reason)
        ctx.events.emit(
            s,
            events.RELEASE_STATUS,
            model=model.name,
            version=release.version,
            status=status,
            reason=reason,
        )
        out = ReleaseView.load(s, model, release, ctx.audit_key).to_json()
        journal_record(  # last: the commit follows it (registry.journal.write)
            ctx,
            s,
            action,
            {"model": model.name, "version": release.version},
            {"reason": reason},
            ts=release.status_changed_at,
        )
    out["requests_cancelled"] = cancelled
    if status == YANKED:
        out.update(_stop_serving(ctx, model.name, release.version))
    return out


def _stop_serving(ctx: Context, model: str, version: int) -> dict[str, Any]:
    """A yank takes the release's bytes out of what `reg ui` serves to MLflow clients at once,
    without waiting for the MLflow drain (which does it again). The yank itself is committed:
    a failure here is a warning and `served_error` in the result; every drain retries."""
    try:
        return {"served_files_removed": unpublish_everywhere(ctx.store, model, version)}
    except (RegistryError, OSError) as exc:
        message = f"{model}:v{version} is yanked, but MLflow may still serve it: {exc}"
        warnings.warn(message + " (reg mlflow sync retries)", stacklevel=2)
        return {"served_files_removed": 0, "served_error": str(exc)}


def _version_number(version: str | int) -> int:
    text = str(version).removeprefix("v")
    if not text.isdigit() or len(text) > 9 or int(text) < 1:
        raise UsageError(f"bad version {version!r}", "write vK, e.g. v3")
    return int(text)
