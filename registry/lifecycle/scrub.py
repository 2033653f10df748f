"""`reg verify [--repair]` and scrubs (`reg verify --all`): re-hash an artifact's stored files
against the catalog's records, and on a versioned bucket restore each damaged one from the
version its record names (after proving that version still holds the recorded bytes). Repair is
an admin action, audited, and holds the GC lease (never beside a GC or `reg fsck --repair`).

Every complete re-hash is recorded on the artifact's row (`verified_at`, `verify_findings`),
shown by `reg show` and mirrored to MLflow; findings are audited. A scrub re-hashes every
committed checkpoint and release, the longest unverified first, within a bandwidth budget.
"""

from __future__ import annotations

import math
import re
import threading
import time
import warnings
from typing import TYPE_CHECKING, Any

from sqlmodel import Session, col, select

from registry import events
from registry.catalog import queries
from registry.catalog.models import (
    COMMITTED,
    RELEASE_PENDING,
    Checkpoint,
    Model,
    Project,
    Release,
    Run,
)
from registry.errors import Conflict, RegistryError, UsageError
from registry.layout import (
    checkpoint_prefix,
    parse_checkpoint_key,
    parse_release_key,
    release_prefix,
)
from registry.refs import CheckpointRef
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
    if ctx.principal.authorize("scrub").allowed:  # a viewer's check is its own, not a record
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
        row = _row_at(s, prefix)
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


def _row_at(s: Session, prefix: str) -> Checkpoint | Release | None:
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


# -- scrubs -----------------------------------------------------------------------------------

_RATE = re.compile(r"(\d+(?:\.\d+)?)\s*([kKMGT]?)(i?)B/s")
MIN_RATE, MAX_RATE = 1.0, 1e13  # 1 B/s .. 10 TB/s
SCRUB_LEASE, SCRUB_LEASE_SECONDS = "scrub", 600.0


def parse_rate(text: str) -> float:
    """`200MB/s` (decimal units; `MiB/s` binary; bytes, never bits) -> bytes per second."""
    match = _RATE.fullmatch(text.strip())
    hint = "write it like 200MB/s, 1GB/s or 50MiB/s (bytes per second, 1 B/s to 10 TB/s)"
    if match is None:
        raise UsageError(f"--rate {text!r} is not a bandwidth", hint)
    base = 1024 if match.group(3) else 1000
    power = " KMGT".index(match.group(2).upper() or " ")
    return check_rate(float(match.group(1)) * float(base**power), hint)


def check_rate(rate: float, hint: str = "give bytes per second, 1 to 1e13") -> float:
    if not math.isfinite(rate) or not MIN_RATE <= rate <= MAX_RATE:
        raise UsageError(f"a scrub rate of {rate:g} bytes/s is out of range", hint)
    return rate


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
    from registry.catalog import leases

    ctx.authorize("scrub", target="scrub")
    if rate is not None:
        check_rate(rate)
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
    from registry.lifecycle.checkpoints.read import kept_manifest
    from registry.lifecycle.releases import stored_files
    from registry.lifecycle.views import ReleaseView

    with ctx.catalog.session() as s:
        row = _row_at(s, prefix)
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
    from registry.lifecycle.checkpoints.read import rehashed

    with ctx.catalog.session() as s:
        row = _row_at(s, prefix)
    if isinstance(row, Checkpoint) and row.digests_reported_by is not None:
        rehashed(ctx, row.id or 0, name)
