"""Scrubs (`reg verify --all`): every committed checkpoint and release re-hashed through
`verify.py`, the longest unverified first, within a bandwidth budget, one scrub at a time.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

from sqlmodel import col, select

from policies.access import Action
from registry.catalog import leases, queries
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
    checkpoint_prefix,
    release_prefix,
)
from registry.core.refs import CheckpointRef
from registry.core.timeutil import check_rate
from registry.errors import Conflict, RegistryError, UsageError
from registry.lifecycle.checkpoints.read import kept_manifest, rehashed
from registry.lifecycle.releases import stored_files
from registry.lifecycle.verify import record, row_at, verify_files
from registry.lifecycle.views import ReleaseView

if TYPE_CHECKING:
    from registry.core.progress import Progress
    from registry.formats.documents import FileRecord
    from registry.lifecycle.context import Context


# -- scrubs -----------------------------------------------------------------------------------

SCRUB_LEASE, SCRUB_LEASE_SECONDS = "scrub", 600.0


class Throttle:
    """A Progress in front of another that holds readers to `rate` bytes per second on average,
    with at most one second of bytes in a burst (idle time does not save up): a scrub reads at
    a bounded pace beside training jobs that read the same store. Each reader reserves its
    slot under the lock and sleeps outside it."""

    BURST_S = 1.0

    def __init__(self, rate: float | None, inner: Progress | None) -> None:
        self.rate, self.inner = rate, inner
        self.first: float | None = None
        self.total = 0
        self._free_at = 0.0  # when the bytes reserved so far may all have been read
        self._lock = threading.Lock()

    def start(self, description: str, total: int) -> None:
        if self.inner:
            self.inner.start(description, total)

    def advance(self, n: int) -> None:
        wait = 0.0
        with self._lock:
            clock = time.monotonic()
            if self.first is None:
                self.first = clock
            self.total += n
            if self.rate:
                self._free_at = max(self._free_at, clock - self.BURST_S) + n / self.rate
                wait = self._free_at - clock
        if wait > 0:
            time.sleep(wait)
        if self.inner:
            self.inner.advance(n)

    def finish(self) -> None:
        if self.inner:
            self.inner.finish()

    def seconds(self) -> float:
        return time.monotonic() - self.first if self.first is not None else 0.0


def scrub(
    ctx: Context,
    *,
    rate: float | None = None,
    limit: int | None = None,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Re-hash every committed checkpoint and release (admin), the longest unverified first
    (never verified before all), at most `rate` bytes/s and `limit` artifacts. One scrub at a
    time (the `scrub` lease). An artifact collected or yanked meanwhile is skipped."""
    if rate is not None:
        check_rate(rate)
    if limit is not None and limit < 1:
        raise UsageError("--limit must be a number of artifacts, 1 or more")
    ctx.authorize(Action.SCRUB, target="scrub")
    token, holder = leases.try_acquire(ctx.catalog, SCRUB_LEASE, ctx.actor, SCRUB_LEASE_SECONDS)
    if token is None:
        assert holder is not None
        raise Conflict(
            f"another scrub is running: {holder.holder} on {holder.host} (pid {holder.pid})",
            f"wait for it; a crashed scrub's lease expires within {SCRUB_LEASE_SECONDS:.0f}s",
        )
    with leases.renewed(ctx.catalog, SCRUB_LEASE, token, SCRUB_LEASE_SECONDS):
        return _scrub(ctx, rate, limit, progress)


def _scrub(
    ctx: Context, rate: float | None, limit: int | None, progress: Progress | None
) -> dict[str, Any]:
    started = time.monotonic()
    throttle = Throttle(rate, progress)
    damaged: list[dict[str, Any]] = []
    done = skipped = 0
    for name, prefix in _oldest_verified_first(ctx)[:limit]:
        files = _files_now(ctx, prefix)
        if files is None:
            skipped += 1  # collected, or pending again never: gone since the listing
            continue
        try:
            report = verify_files(
                ctx,
                prefix,
                files,
                name=name,
                scope={},
                repair=False,
                immutable=prefix.startswith("release/"),
                progress=throttle,
            )
        except RegistryError as exc:  # one artifact's store error does not stop the scrub
            report = {"ok": False, "problems": [{"path": "", "problem": str(exc)}]}
            record(ctx, prefix, name, report["problems"])
        if not report["ok"] and _files_now(ctx, prefix) is None:
            skipped += 1  # collected while it was read: not damage
            continue
        done += 1
        if report["ok"] and prefix.startswith("ckpt/"):
            _rehashed_if_reported(ctx, prefix, name)
        if not report["ok"]:
            damaged.append({"target": name, "problems": report["problems"]})
    seconds = time.monotonic() - started
    return {
        "ok": not damaged,
        "artifacts": done,
        "skipped": skipped,
        "bytes": throttle.total,
        "seconds": round(seconds, 3),
        "bytes_per_second": round(throttle.total / seconds) if seconds > 0 else 0,
        "rate_limit": rate,
        "damaged": damaged,
    }


def _oldest_verified_first(ctx: Context) -> list[tuple[str, str]]:
    """(name, prefix) of every committed checkpoint and release (not pending), the longest
    unverified first; nothing read from the store yet."""
    out: list[tuple[float, float, str, str]] = []
    with ctx.catalog.session() as s:
        for c, run, project in s.exec(
            select(Checkpoint, Run.name, Project.name)
            .join(Run, col(Run.id) == Checkpoint.run_id)
            .join(Project, col(Project.id) == Run.project_id)
            .where(Checkpoint.state == COMMITTED)
        ).all():
            name = str(CheckpointRef(project, run, c.step))
            prefix = checkpoint_prefix(project, run, c.step)
            out.append((c.verified_at or 0.0, c.created_at, name, prefix))
        for r, model in s.exec(
            select(Release, Model.name)
            .join(Model, col(Model.id) == Release.model_id)
            .where(Release.status != RELEASE_PENDING)
        ).all():
            prefix = release_prefix(model, r.version)
            out.append((r.verified_at or 0.0, r.created_at, f"{model}:v{r.version}", prefix))
    out.sort(key=lambda x: (x[0], x[1]))
    return [(name, prefix) for _, _, name, prefix in out]


def _files_now(ctx: Context, prefix: str) -> list[FileRecord] | None:
    """The artifact's files, its document included, if it is still committed; else None."""
    with ctx.catalog.session() as s:
        row = row_at(s, prefix)
        if row is None:
            return None
        if isinstance(row, Checkpoint):
            files = queries.files_of(s, row.id or 0)
        else:
            model = s.get(Model, row.model_id)
            assert model is not None
            return stored_files(ReleaseView.load(s, model, row))
    manifest = kept_manifest(ctx, prefix, row)
    return files + ([manifest] if manifest is not None else [])


def _rehashed_if_reported(ctx: Context, prefix: str, name: str) -> None:
    """A scrub that matched every byte of a checkpoint whose digests a client reported makes
    them the registry's own, as `reg verify` does."""
    with ctx.catalog.session() as s:
        row = row_at(s, prefix)
    if isinstance(row, Checkpoint) and row.digests_reported_by is not None:
        rehashed(ctx, row.id or 0, name)
