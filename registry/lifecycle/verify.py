"""`reg verify [--repair]`: re-hash an artifact's stored files against the catalog's records,
and on a versioned bucket restore each damaged one from the version its record names (after
proving that version still holds the recorded bytes). Repair is an admin action, audited, and
holds the GC lease (never beside a GC or `reg fsck --repair`).

Every complete re-hash is recorded on the artifact's row (`verified_at`, `verify_findings`),
shown by `reg show` and mirrored to MLflow; findings are audited. Scrubs (`scrub.py`) re-hash
every artifact through here.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

from sqlmodel import Session, col, select

from policies.access import Action
from registry.catalog.models import (
    COMMITTED,
    RELEASE_PENDING,
    Checkpoint,
    Model,
    Project,
    Release,
    Run,
)
from registry.core.layout import (
    parse_checkpoint_key,
    parse_release_key,
)
from registry.core.timeutil import now
from registry.errors import RegistryError
from registry.journal import outbox as events
from registry.lifecycle.transfer import repair_stored, verify_stored

if TYPE_CHECKING:
    from registry.core.progress import Progress
    from registry.formats.documents import FileRecord
    from registry.lifecycle.context import Context


def verify_files(
    ctx: Context,
    prefix: str,
    files: list[FileRecord],
    *,
    name: str,
    scope: dict[str, str],
    repair: bool,
    immutable: bool,
    progress: Progress | None,
) -> dict[str, Any]:
    """The verify report of one artifact (`name`, its files under `prefix`); `scope` is the
    project or model the repair is authorized on. The outcome is recorded on its row."""
    problems = verify_stored(
        ctx.store, prefix, files, label=f"verify {name}", workers=ctx.workers, progress=progress
    )
    out: dict[str, Any] = {
        "ok": not problems,
        "files": len(files),
        "bytes": sum(f.size for f in files),
        "problems": [p.to_json() for p in problems],
    }
    if repair:
        out["repaired"] = []
    if repair and problems:
        ctx.authorize(Action.REPAIR, target=name, **scope)
        from registry.lifecycle import retention

        with retention.gc_lease(ctx):
            repaired, left = repair_stored(ctx.store, prefix, files, problems, immutable=immutable)
        with ctx.catalog.session(write=True) as s:
            ctx.audit(s, "repair", name, repaired=repaired, left=len(left))
        after = verify_stored(
            ctx.store,
            prefix,
            [f for f in files if f.path in set(repaired)],
            label=f"verify {name}",
            workers=ctx.workers,
        )
        out.update(
            ok=not left and not after,
            repaired=[p for p in repaired if p not in {a.path for a in after}],
            problems=[p.to_json() for p in [*left, *after]],
        )
    if ctx.principal.authorize(Action.SCRUB).allowed:  # a viewer's check is its own, not a record
        record(ctx, prefix, name, out["problems"])
    return out


def record(ctx: Context, prefix: str, name: str, problems: list[dict[str, str]]) -> None:
    """`verified_at` and the findings on the artifact's row while it is still committed; a new
    verdict is audited and told to MLflow. A failed write is a warning: the report stands."""
    try:
        _record(ctx, prefix, name, problems)
    except RegistryError as exc:
        warnings.warn(f"could not record the verification of {name}: {exc}", stacklevel=2)


def _record(ctx: Context, prefix: str, name: str, problems: list[dict[str, str]]) -> None:
    at = now()
    with ctx.catalog.session(write=True) as s:
        row = row_at(s, prefix)
        if row is None:
            return  # collected or never committed meanwhile: nothing to say of it
        before = row.verify_findings
        row.verified_at, row.verify_findings = at, problems
        s.add(row)
        if isinstance(row, Checkpoint):
            ckpt = parse_checkpoint_key(prefix)
            assert ckpt is not None
            fields = {"project": ckpt[0], "run": ckpt[1], "step": ckpt[2], "ref": name}
            ctx.events.emit(s, events.CHECKPOINT_VERIFIED, **fields, at=at, damaged=len(problems))
        else:
            rel = parse_release_key(prefix)
            assert rel is not None
            ctx.events.emit(s, events.RELEASE_VERIFIED, model=rel[0], version=rel[1], at=at)
        if problems and problems != before:  # a new verdict, not the same one again
            ctx.audit(s, "verify", name, "failed", problems=problems[:20], count=len(problems))
        elif not problems and before:
            ctx.audit(s, "verify", name, note="every file matches its record again")


def row_at(s: Session, prefix: str) -> Checkpoint | Release | None:
    """The committed checkpoint or the release (not pending) stored under `prefix`."""
    ckpt = parse_checkpoint_key(prefix)
    if ckpt is not None:
        project, run, step, _ = ckpt
        return s.exec(
            select(Checkpoint)
            .join(Run, col(Run.id) == Checkpoint.run_id)
            .join(Project, col(Project.id) == Run.project_id)
            .where(
                Project.name == project,
                Run.name == run,
                Checkpoint.step == step,
                Checkpoint.state == COMMITTED,
            )
        ).first()
    rel = parse_release_key(prefix)
    if rel is None:
        return None
    return s.exec(
        select(Release)
        .join(Model, col(Model.id) == Release.model_id)
        .where(Model.name == rel[0], Release.version == rel[1], Release.status != RELEASE_PENDING)
    ).first()
