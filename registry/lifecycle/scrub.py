"""`reg verify [--repair]` and scrubs (`reg verify --all`): re-hash an artifact's stored files
against the catalog's records, and on a versioned bucket restore each damaged one from the
version its record names (after proving that version still holds the recorded bytes). Repair is
an admin action, audited, and holds the GC lease (never beside a GC or `reg fsck --repair`).

Every complete re-hash is recorded on the artifact's row (`verified_at`, `verify_findings`),
shown by `reg show` and mirrored to MLflow; findings are audited. A scrub re-hashes every
committed checkpoint and release, the longest unverified first, within a bandwidth budget.
"""

from __future__ import annotations

import re
import threading
import time
from typing import TYPE_CHECKING, Any

from sqlalchemy import update
from sqlmodel import col, select

from registry import events
from registry.catalog.models import (
    COMMITTED,
    RELEASE_PENDING,
    Checkpoint,
    CheckpointFile,
    Model,
    Project,
    Release,
    Run,
)
from registry.errors import RegistryError, UsageError
from registry.layout import (
    checkpoint_prefix,
    parse_checkpoint_key,
    parse_release_key,
    release_prefix,
)
from registry.timeutil import now
from registry.transfer import repair_stored, verify_stored

if TYPE_CHECKING:
    from registry.context import Context
    from registry.formats.documents import FileRecord
    from registry.progress import Progress


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
        ctx.authorize("repair", target=name, **scope)
        from registry.catalog import leases
        from registry.lifecycle import gc

        with leases.renewed(ctx.catalog, gc.GC_LEASE, gc.acquire(ctx), gc.GC_LEASE_SECONDS):
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
    record(ctx, prefix, name, out["problems"])
    return out


def record(ctx: Context, prefix: str, name: str, problems: list[dict[str, str]]) -> None:
    """`verified_at` and the findings on the artifact's row; findings audited; MLflow told."""
    at = now()
    with ctx.catalog.session(write=True) as s:
        ckpt = parse_checkpoint_key(prefix)
        if ckpt is not None:
            project, run, step, _ = ckpt
            ids = (
                select(Checkpoint.id)
                .join(Run, col(Run.id) == Checkpoint.run_id)
                .join(Project, col(Project.id) == Run.project_id)
                .where(Project.name == project, Run.name == run, Checkpoint.step == step)
            )
            s.exec(
                update(Checkpoint)
                .where(col(Checkpoint.id).in_(ids.scalar_subquery()))
                .values(verified_at=at, verify_findings=problems)
            )
            fields = {"project": project, "run": run, "step": step, "ref": name}
            ctx.events.emit(s, events.CHECKPOINT_VERIFIED, **fields, at=at, damaged=len(problems))
        else:
            rel = parse_release_key(prefix)
            if rel is None:
                return
            model, version, _ = rel
            ids = select(Release.id).join(Model, col(Model.id) == Release.model_id)
            s.exec(
                update(Release)
                .where(
                    col(Release.id).in_(
                        ids.where(Model.name == model, Release.version == version).scalar_subquery()
                    )
                )
                .values(verified_at=at, verify_findings=problems)
            )
            ctx.events.emit(s, events.RELEASE_VERIFIED, model=model, version=version, at=at)
        if problems:
            ctx.audit(s, "verify", name, "failed", problems=problems[:20], count=len(problems))


# -- scrubs -----------------------------------------------------------------------------------

_RATE = re.compile(r"(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B/s", re.IGNORECASE)


def parse_rate(text: str) -> float:
    """`200MB/s` (decimal units; `MiB/s` binary) -> bytes per second."""
    match = _RATE.fullmatch(text.strip())
    if match is None or float(match.group(1)) <= 0:
        raise UsageError(
            f"--rate {text!r} is not a bandwidth", "write it like 200MB/s, 1GB/s or 50MiB/s"
        )
    base = 1024 if match.group(3) else 1000
    power = " KMGT".index(match.group(2).upper() or " ")
    return float(match.group(1)) * float(base**power)


class Throttle:
    """A Progress in front of another that holds readers to `rate` bytes per second: a scrub
    reads at a bounded pace beside training jobs that read the same store."""

    def __init__(self, rate: float | None, inner: Progress | None) -> None:
        self.rate, self.inner = rate, inner
        self.started = time.monotonic()
        self.total = 0
        self._lock = threading.Lock()

    def start(self, description: str, total: int) -> None:
        if self.inner:
            self.inner.start(description, total)

    def advance(self, n: int) -> None:
        with self._lock:
            self.total += n
            if self.rate:
                ahead = self.total / self.rate - (time.monotonic() - self.started)
                if ahead > 0:
                    time.sleep(ahead)
        if self.inner:
            self.inner.advance(n)

    def finish(self) -> None:
        if self.inner:
            self.inner.finish()


def scrub(
    ctx: Context,
    *,
    rate: float | None = None,
    limit: int | None = None,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Re-hash every committed checkpoint and release (admin), the longest unverified first
    (never verified before all), at most `rate` bytes/s and `limit` artifacts."""
    ctx.authorize("scrub", target="scrub")
    throttle = Throttle(rate, progress)
    damaged: list[dict[str, Any]] = []
    done = 0
    for name, prefix, files, immutable in _oldest_verified_first(ctx)[:limit]:
        try:
            report = verify_files(
                ctx,
                prefix,
                files,
                name=name,
                scope={},
                repair=False,
                immutable=immutable,
                progress=throttle,
            )
        except RegistryError as exc:  # one artifact's store error does not stop the scrub
            report = {"ok": False, "problems": [{"path": "", "problem": str(exc)}]}
        done += 1
        if not report["ok"]:
            damaged.append({"target": name, "problems": report["problems"]})
    seconds = time.monotonic() - throttle.started
    return {
        "ok": not damaged,
        "artifacts": done,
        "bytes": throttle.total,
        "seconds": round(seconds, 3),
        "bytes_per_second": round(throttle.total / seconds) if seconds > 0 else 0,
        "rate_limit": rate,
        "damaged": damaged,
    }


def _oldest_verified_first(ctx: Context) -> list[tuple[str, str, list[FileRecord], bool]]:
    """(name, prefix, files with documents, immutable) of every committed artifact."""
    from registry.formats.documents import FileRecord
    from registry.layout import MANIFEST
    from registry.lifecycle.releases import stored_files
    from registry.lifecycle.views import ReleaseView

    out: list[tuple[float, float, str, str, list[FileRecord], bool]] = []
    with ctx.catalog.session() as s:
        rows = s.exec(
            select(Checkpoint, Run.name, Project.name)
            .join(Run, col(Run.id) == Checkpoint.run_id)
            .join(Project, col(Project.id) == Run.project_id)
            .where(Checkpoint.state == COMMITTED)
        ).all()
        files: dict[int, list[FileRecord]] = {}
        ids = [c.id for c, _, _ in rows]
        for f in s.exec(select(CheckpointFile).where(col(CheckpointFile.checkpoint_id).in_(ids))):
            files.setdefault(f.checkpoint_id, []).append(f.record())
        for c, run, project in rows:
            listed = files.get(c.id or 0, [])
            prefix = checkpoint_prefix(project, run, c.step)
            if c.manifest_sha256:
                head = ctx.store.head(prefix + MANIFEST, version=c.manifest_version)
                size = head.size if head is not None else 0  # missing: the verify says so
                listed.append(FileRecord(MANIFEST, size, c.manifest_sha256, version=None))
            name = (
                f"{project}/{run}@step{c.step}" if project != "default" else f"{run}@step{c.step}"
            )
            out.append((c.verified_at or 0.0, c.created_at, name, prefix, listed, False))
        for r, model in s.exec(
            select(Release, Model)
            .join(Model, col(Model.id) == Release.model_id)
            .where(Release.status != RELEASE_PENDING)
        ).all():
            view = ReleaseView.load(s, model, r)
            prefix = release_prefix(model.name, r.version)
            out.append(
                (r.verified_at or 0.0, r.created_at, view.name, prefix, stored_files(view), True)
            )
    out.sort(key=lambda x: (x[0], x[1]))
    return [(name, prefix, files, immutable) for _, _, name, prefix, files, immutable in out]
