"""The release lifecycle: immutable content; only status (active, deprecated, yanked) and aliases
move, and every move is recorded (DESIGN §1, §3)."""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlmodel import Session, col, select

from registry import audit, outbox
from registry.catalog.models import (
    DEPRECATED,
    RELEASE_PENDING,
    YANKED,
    Alias,
    AliasEvent,
    Model,
    Release,
    ReleaseFile,
    Validation,
)
from registry.checkpoints import check_stored_files
from registry.errors import Conflict, IntegrityError, NotFound, UsageError
from registry.refs import ReleaseRef, check_alias, check_name
from registry.timeutil import iso, now

if TYPE_CHECKING:
    from registry.api import Registry
    from registry.progress import Progress

RELEASE_FORMAT = "reg.release/1"
RELEASE_JSON = "release.json"


def release_prefix(model: str, version: int) -> str:
    return f"release/{model}/v{version}/"


# -- lookups ----------------------------------------------------------------------------------


def resolve_release(session: Session, ref: ReleaseRef) -> tuple[Model, Release]:
    model = session.exec(select(Model).where(Model.name == ref.model)).first()
    if model is None:
        names = session.exec(select(Model.name).order_by(col(Model.name))).all()
        hint = f"models: {', '.join(names[-8:])}" if names else "reg promote makes the first one"
        raise NotFound(f"model {ref.model} not found", hint)
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
        versions = visible_versions(session, model.id or 0)
        raise NotFound(
            f"{ref} not found",
            f"{ref.model} has versions {', '.join(f'v{v}' for v in versions)}"
            if versions
            else f"{ref.model} has no releases yet",
        )
    return model, release


def visible_versions(session: Session, model_id: int) -> list[int]:
    return list(
        session.exec(
            select(Release.version)
            .where(Release.model_id == model_id, Release.status != RELEASE_PENDING)
            .order_by(col(Release.version))
        ).all()
    )


def view(
    session: Session, model: Model, release: Release, store_uri: str | None = None
) -> dict[str, Any]:
    files = session.exec(
        select(ReleaseFile)
        .where(ReleaseFile.release_id == release.id)
        .order_by(col(ReleaseFile.path))
    ).all()
    aliases = session.exec(
        select(Alias.name).where(Alias.release_id == release.id).order_by(col(Alias.name))
    ).all()
    validation = session.get(Validation, release.validation_id) if release.validation_id else None
    out = {
        "release": f"{model.name}:v{release.version}",
        "model": model.name,
        "version": release.version,
        "sha256": release.sha256,
        "files": [{"path": f.path, "size": f.size, "sha256": f.sha256} for f in files],
        "source": release.source_ref,
        "aliases": list(aliases),
        "status": release.status,
        "status_reason": release.status_reason,
        "bytes": release.bytes,
        "tensor_count": release.tensor_count,
        "dtype": release.dtype,
        "tied": release.tied,
        "created_at": iso(release.created_at),
        "created_by": release.created_by,
        "validation": {
            "id": validation.id,
            "passed": validation.passed,
            "device": validation.device,
            "device_name": validation.device_name,
            "seconds": validation.seconds,
        }
        if validation
        else None,
    }
    if store_uri is not None:
        out["uri"] = store_uri
    return out


def list_releases(reg: Registry, model: str | None = None) -> list[dict[str, Any]]:
    if model is not None:
        check_name(model, "model name")
    with reg.catalog.session() as s:
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
        return [view(s, m, r) for m, r in rows if reg.can_read_model(m.name)]


def show(reg: Registry, ref: ReleaseRef) -> dict[str, Any]:
    reg.authorize_read(model=ref.model)
    with reg.catalog.session() as s:
        model, release = resolve_release(s, ref)
        out = view(
            s, model, release, reg.store.describe(release_prefix(model.name, release.version))
        )
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
            }
            for e in history
            if e.to_version == release.version or e.from_version == release.version
        ]
    return out


def verify(reg: Registry, ref: ReleaseRef, *, progress: Progress | None = None) -> dict[str, Any]:
    reg.authorize_read(model=ref.model)
    with reg.catalog.session() as s:
        model, release = resolve_release(s, ref)
        files = s.exec(select(ReleaseFile).where(ReleaseFile.release_id == release.id)).all()
        name = f"{model.name}:v{release.version}"
        prefix = release_prefix(model.name, release.version)
    listed = [(f.path, f.size, f.sha256) for f in files]
    if release.sha256:
        head = reg.store.head(prefix + RELEASE_JSON)
        listed.append((RELEASE_JSON, head.size if head else -1, release.sha256))
    problems = check_stored_files(reg, prefix, listed, progress, f"verify {name}")
    return {
        "release": name,
        "ok": not problems,
        "files": len(listed),
        "bytes": sum(size for _, size, _ in listed),
        "problems": problems,
    }


def pull(
    reg: Registry, ref: ReleaseRef, dest: Path, *, progress: Progress | None = None
) -> dict[str, Any]:
    """Copy a release to `dest` (new or empty), every byte verified; all or nothing."""
    from registry.checkpoints import _check_dest

    reg.authorize_read(model=ref.model)
    with reg.catalog.session() as s:
        model, release = resolve_release(s, ref)
        out = view(s, model, release)
    if release.status == YANKED:
        raise Conflict(
            f"{out['release']} was yanked: {release.status_reason}",
            f"pull another version of {model.name} (reg releases {model.name})",
        )
    prefix = release_prefix(model.name, release.version)
    files = [*out["files"], {"path": RELEASE_JSON, "size": None, "sha256": release.sha256}]
    dest = Path(dest).absolute()
    _check_dest(dest)
    temp = dest.parent / f".{dest.name}.reg-pull-{uuid.uuid4().hex[:8]}"
    temp.mkdir(parents=True)
    try:
        if progress:
            progress.start(f"pull {out['release']}", sum(f["size"] or 0 for f in files))
        for f in files:
            got = reg.store.get_file(
                prefix + f["path"],
                temp / f["path"],
                progress=progress.advance if progress else None,
            )
            if got.sha256 != f["sha256"] or (f["size"] is not None and got.size != f["size"]):
                raise IntegrityError(
                    f"{out['release']}: stored file {f['path']} is corrupt (sha256 "
                    f"{got.sha256[:12]}..., expected {str(f['sha256'])[:12]}...); nothing was "
                    "written to the destination",
                    f"reg verify {out['release']} lists every damaged file",
                )
        if progress:
            progress.finish()
        _check_dest(dest)
        if dest.exists():
            dest.rmdir()
        os.rename(temp, dest)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    out["dest"] = str(dest)
    return out


# -- status and aliases -------------------------------------------------------------------------


def move_alias(
    session: Session, reg: Registry, model: Model, alias: str, release: Release
) -> int | None:
    """Point `alias` at `release` (in the caller's transaction); returns the previous version."""
    check_alias(alias)
    if release.status == YANKED:
        raise Conflict(
            f"{model.name}:v{release.version} is yanked ({release.status_reason}); "
            f"an alias cannot point at it",
            "choose an active version",
        )
    row = session.exec(select(Alias).where(Alias.model_id == model.id, Alias.name == alias)).first()
    previous = None
    if row is None:
        row = Alias(
            model_id=model.id or 0,
            name=alias,
            release_id=release.id or 0,
            updated_at=now(),
            updated_by=reg.user,
        )
    else:
        old = session.get(Release, row.release_id)
        previous = old.version if old else None
        row.release_id, row.updated_at, row.updated_by = release.id or 0, now(), reg.user
    session.add(row)
    if previous != release.version:
        session.add(
            AliasEvent(
                model_id=model.id or 0,
                name=alias,
                from_version=previous,
                to_version=release.version,
                ts=now(),
                actor=reg.user,
            )
        )
        audit.record(
            session,
            reg.user,
            "alias",
            f"{model.name}@{alias}",
            to=f"v{release.version}",
            **{"from": f"v{previous}" if previous else None},
        )
        outbox.emit(
            session, outbox.ALIAS_MOVED, model=model.name, alias=alias, version=release.version
        )
        reg.after_commit()
    return previous


def set_alias(reg: Registry, model_name: str, alias: str, version: str | int) -> dict[str, Any]:
    check_name(model_name, "model name")
    check_alias(alias)
    number = _version_number(version)
    target = f"{model_name}@{alias}"
    reg.authorize("alias", model=model_name, target=target)
    with reg.catalog.session(write=True) as s:
        model, release = resolve_release(s, ReleaseRef(model_name, version=number))
        previous = move_alias(s, reg, model, alias, release)
        out = view(s, model, release)
    out["alias"] = alias
    out["previous"] = f"v{previous}" if previous else None
    return out


def set_status(
    reg: Registry, ref: ReleaseRef, status: str, reason: str | None = None
) -> dict[str, Any]:
    action = {DEPRECATED: "deprecate", YANKED: "yank"}[status]
    reg.authorize(action, model=ref.model, target=str(ref))
    if status == YANKED and not (reason and reason.strip()):
        raise UsageError("a yank needs a reason", "reg yank NAME:vK --reason TEXT")
    with reg.catalog.session(write=True) as s:
        model, release = resolve_release(s, ref)
        if release.status == YANKED:
            raise Conflict(
                f"{model.name}:v{release.version} is already yanked ({release.status_reason})",
                "a yank is final",
            )
        release.status, release.status_reason = status, reason
        release.status_changed_at, release.status_changed_by = now(), reg.user
        s.add(release)
        audit.record(s, reg.user, action, f"{model.name}:v{release.version}", reason=reason)
        outbox.emit(
            s,
            outbox.RELEASE_STATUS,
            model=model.name,
            version=release.version,
            status=status,
            reason=reason,
        )
        reg.after_commit()
        return view(s, model, release)


def _version_number(version: str | int) -> int:
    text = str(version).removeprefix("v")
    if not text.isdigit() or int(text) < 1:
        raise UsageError(f"bad version {version!r}", "write vK, e.g. v3")
    return int(text)
