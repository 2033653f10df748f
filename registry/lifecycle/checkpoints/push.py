"""Push: register a DCP checkpoint directory as project/run@step (DESIGN §3, §4).

Claim the step in the catalog (a pending row with a claim), upload every file put-if-absent
while hashing it, write MANIFEST.json last, then commit the row under the claim. Readers trust
only committed rows, so a crash at any point leaves nothing visible, and the next push of the
step takes over the stale claim and reuses what was uploaded.

The copy starts before the claim is taken, into staged files no reader can see (unnamed files
on a local store); they are published under their keys only once the claim is held, so the
protocol is unchanged while the copy overlaps the catalog layer's import and the claim. This
module therefore imports only light modules at the top; `commit.py` (SQLAlchemy, the catalog
models) and the policy models are imported once the copy runs.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from policies.access import Action
from policies.layouts import check_layout
from registry.catalog.lookups import step_state
from registry.core import faults
from registry.core.layout import checkpoint_prefix, manifest_key
from registry.core.progress import Counter, Progress
from registry.core.refs import CheckpointRef, check_name
from registry.core.timeutil import iso, now
from registry.errors import IntegrityError, UsageError
from registry.formats.dcp_scan import ScannedDir, scan_directory
from registry.formats.documents import FileRecord, Manifest, ResumeRecord, TensorSummary
from registry.formats.recorded import recorded, resolve_step, resolve_world_size
from registry.lifecycle.checkpoints.pulled import KeptManifest
from registry.lifecycle.transfer import OnMismatch, Stored, put_reconciled
from registry.storage.base import Staged

if TYPE_CHECKING:
    from registry.lifecycle.checkpoints.commit import PushResult
    from registry.lifecycle.context import Context


def push(
    ctx: Context,
    src: Path,
    *,
    run: str,
    step: int,
    project: str,
    world_size: int | None = None,
    metrics: dict[str, float] | None = None,
    progress: Progress | None = None,
    notes: list[str] | None = None,
    received: dict[str, tuple[int, str]] | None = None,
    layout: str | None = None,
) -> PushResult:
    """Register the DCP checkpoint in `src` as project/run@step. `received` (reg server) says
    `src` is the server's own private copy of an upload, with each file's size and sha256 as
    it landed: the store may then take the files as they are instead of copying them.
    `layout` forces the checkpoint's layout (policies/layouts.py) instead of detecting it."""
    ref = check_request(project, run, step)
    check_layout(layout)
    checked_metrics = check_metrics(metrics or {})
    ctx.authorize(Action.PUSH, project=project, target=str(ref))
    # A pulled folder is pushed against the manifest it kept. Not in the server: `received` is
    # what a client sent, and a MANIFEST.json there is a reserved name (refused by the scan),
    # never a document to parse (the client checked its own kept manifest before sending).
    kept = KeptManifest.of(Path(src)) if received is None else None
    scanned = scan_directory(Path(src), skip=kept.skip if kept else frozenset())
    if kept is not None:
        kept.check_files(scanned.files)
    # what the trainer's own files record (a server's received copy has no name of its own)
    found = recorded(Path(src).name if received is None else "", scanned.files, scanned.read)
    resolve_step(step, found)
    source = "--world-size" if world_size is not None else found.world_source
    world = world_size_of(scanned, resolve_world_size(world_size, found), notes, source)
    with _Uploader(ctx, ref, scanned, progress, received) as uploader:
        # A server's received files are taken, not copied: nothing to overlap, and a file
        # taken before the claim would be gone for comparing with a step committed meanwhile.
        if received is None and _looks_free(ctx, ref):
            uploader.start()
        # Imported here, not at the top: the catalog layer (SQLAlchemy) and the policy models
        # load while the copy runs.
        from registry.lifecycle.checkpoints import commit
        from registry.lifecycle.checkpoints.resume_facts import facts_of, fields

        facts = facts_of(scanned.inventory, scanned.files, scanned.read, layout, scanned.read_ends)
        resume_record = facts.record(ctx.policy.resume)
        claim, existing = commit.claim_step(ctx, ref)
        resume = fields(facts, ctx.policy.resume)
        if existing is not None:
            uploader.cancel()
            return commit.compare_existing(ctx, ref, scanned, existing)
        with commit.held(ctx.catalog, claim):

            def still_ours() -> None:
                commit.ensure_held(ctx, claim, ref)

            uploaded = uploader.finish(still_ours)
            if kept is not None:  # each digest as the copy hashed it, before the manifest
                prefix = checkpoint_prefix(project, run, step)
                kept.check_digests((u.key.removeprefix(prefix), u.sha256) for u in uploaded)
            faults.point("push-published")
            manifest = build_manifest(
                ctx, ref, scanned, uploaded, world, resume_record, checked_metrics
            )
            data = manifest.to_bytes()
            stored = put_reconciled(
                ctx.store,
                manifest_key(project, run, step),
                data=data,
                on_mismatch=OnMismatch.REPLACE,  # a leftover of our own earlier attempt
                before_replace=still_ours,
            )
            faults.point("push-manifest")
            reused = sum(u.reused for u in uploaded)
            result = commit.commit(
                ctx, claim, manifest, data, stored.version, uploader.seconds, reused
            )
            return replace(result, resume=resume)


def check_request(project: str, run: str, step: int) -> CheckpointRef:
    check_name(project, "project name")
    check_name(run, "run name")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise UsageError(f"step must be a whole number >= 0, got {step!r}")
    if step >= 10**18:
        raise UsageError(f"step {step} is too large", "steps are below 10^18")
    return CheckpointRef(project, run, step)


def check_metrics(metrics: dict[str, float]) -> dict[str, float]:
    out = {}
    for name, value in metrics.items():
        check_name(name, "metric name")
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise UsageError(f"metric {name} is {value!r}, not a number")
        try:
            value = float(value)
        except OverflowError:
            value = math.inf
        if not math.isfinite(value):
            raise UsageError(
                f"metric {name} is {value}", "metrics are finite numbers; leave it out"
            )
        out[name] = float(value)
    return out


def world_size_of(
    scanned: ScannedDir,
    given: int | None,
    notes: list[str] | None,
    source: str | None = "--world-size",
) -> tuple[int, bool]:
    """The world size to record and whether it was inferred; `source` names where a given one
    came from (the option, or the trainer's files)."""
    inferred = scanned.inferred_world_size
    if given is None:
        if notes is not None and not scanned.ranks:  # a safetensors save: no rank files
            notes.append(
                f"world size {inferred} assumed: no file records one "
                "(pass --world-size to record the real one)"
            )
        elif notes is not None:
            notes.append(
                f"world size {inferred} inferred from rank file names "
                "(a lower bound; pass --world-size to record the real one)"
            )
        return inferred, True
    if isinstance(given, bool) or not isinstance(given, int) or given < 1:
        raise UsageError(f"--world-size must be a whole number >= 1, got {given!r}")
    if given >= 2**31:
        raise UsageError(f"--world-size {given} is too large", "world sizes are below 2^31")
    if given < inferred:
        raise UsageError(
            f"the world size {given} ({source}) is smaller than the {inferred} ranks the shard "
            "files show",
            "pass the world size the checkpoint was saved at",
        )
    return given, False


def _looks_free(ctx: Context, ref: CheckpointRef) -> bool:
    """Nobody holds the step or committed it (as far as a cheap read can tell): worth starting
    the copy before the claim. A wrong guess costs only time; the claim decides."""
    found = step_state(ctx.catalog, ref.project, ref.run, ref.step or 0)
    if found is None:
        return True
    state, lease_until = found
    return state == "pending" and (lease_until or 0.0) < now()


STAGE_AHEAD = 32  # files copied before the claim is held (each staged file holds a descriptor)


class _Uploader:
    """Copies the files into staged (invisible) objects on a pool of workers, largest first,
    and publishes them once the claim is held, reconciling leftovers of an earlier attempt.
    Before the claim only the largest STAGE_AHEAD files are staged (most of the bytes, a
    bounded number of open files); the rest are copied and published after."""

    def __init__(
        self,
        ctx: Context,
        ref: CheckpointRef,
        scanned: ScannedDir,
        progress: Progress | None,
        received: dict[str, tuple[int, str]] | None = None,
    ) -> None:
        self.ctx, self.ref, self.scanned, self.progress = ctx, ref, scanned, progress
        self.received = received
        self.prefix = checkpoint_prefix(ref.project, ref.run, ref.step or 0)
        self.order = sorted(scanned.files, key=lambda p: -scanned.files[p])
        self.pool = ThreadPoolExecutor(max_workers=ctx.workers, thread_name_prefix="reg-push")
        self.staging: dict[str, Future[Staged]] = {}
        self.sources = _Sources(scanned)
        self.counter = Counter(progress)
        self.started: float | None = None
        self.seconds = 0.0

    def start(self) -> None:
        if self.started is not None:
            return
        self.started = time.monotonic()
        if self.progress:
            self.progress.start(f"push {self.ref}", sum(self.scanned.files.values()))
        for path in self.order[:STAGE_AHEAD]:
            self.staging[path] = self.pool.submit(self._stage, path)

    def _stage(self, path: str) -> Staged:
        if self.received is not None:  # the server's own private copy: given up, not copied
            size, digest = self.received[path]
            staged = self.ctx.store.adopt_file(
                self.prefix + path, self.scanned.root / path, size=size, sha256=digest
            )
            self.counter(size)
            return staged
        source = self.sources.open(path)
        try:
            return self.ctx.store.stage_file(self.prefix + path, source, progress=self.counter)
        except IntegrityError as exc:  # named by the descriptor's path: say which file
            raise IntegrityError(
                f"{self.scanned.root / path} changed while being pushed", exc.hint
            ) from None

    def finish(self, still_ours: Callable[[], None]) -> list[Stored]:
        """Publish every file (the claim is held now). Returns or raises only once every task
        has ended, so nothing is written after the claim is given back; `still_ours` raises if
        the claim was lost before a leftover is replaced."""
        self.start()

        def publish(path: str) -> Stored:
            staged = self.staging[path].result() if path in self.staging else self._stage(path)
            # A file already there is a leftover of an earlier attempt at this step: reused if
            # it is the same bytes, replaced otherwise (the claim makes it ours).
            try:
                return put_reconciled(
                    self.ctx.store,
                    self.prefix + path,
                    staged=staged,
                    on_mismatch=OnMismatch.REPLACE,
                    before_replace=still_ours,
                )
            finally:
                self.sources.close(path)

        tasks = [self.pool.submit(publish, path) for path in self.order]
        wait(tasks)
        for task in tasks:
            if task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        results = [task.result() for task in tasks]
        self.seconds = time.monotonic() - (self.started or 0.0)
        for r in results:
            path = r.key.removeprefix(self.prefix)
            digest = self.scanned.metadata_digests.get(path)
            spans = self.scanned.spans.get(path, ())  # a file root's ranges: read back
            if (
                r.size != self.scanned.files[path]
                or (digest and r.sha256 != digest)
                or any(self._stored(r, at, len(data)) != data for at, data in spans)
            ):
                raise IntegrityError(
                    f"{self.scanned.root / path} changed while being pushed",
                    "push a checkpoint that is no longer being written",
                )
        return sorted(results, key=lambda r: r.key)

    def _stored(self, result: Any, at: int, length: int) -> bytes:
        """Bytes of a published object: a file root's ranges (a model file's header), to
        compare with those the scan parsed (its digest covers the whole file, which the scan
        did not read)."""
        return bytes(self.ctx.store.read_range(result.key, at, length, version=result.version))

    def cancel(self) -> None:
        for future in self.staging.values():
            future.cancel()

    def __enter__(self) -> _Uploader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cancel()
        self.pool.shutdown(wait=True)
        for future in self.staging.values():  # whatever was staged and not published
            if future.done() and not future.cancelled() and future.exception() is None:
                future.result().discard()
        self.sources.close_all()
        if self.progress and self.started is not None:
            self.progress.finish()


def build_manifest(
    ctx: Context,
    ref: CheckpointRef,
    scanned: ScannedDir,
    uploaded: list[Stored],
    world: tuple[int, bool],
    resume: ResumeRecord,
    metrics: dict[str, float],
) -> Manifest:
    prefix = checkpoint_prefix(ref.project, ref.run, ref.step or 0)
    files = []
    for u in uploaded:
        path = u.key.removeprefix(prefix)
        files.append(FileRecord(path, u.size, u.sha256, scanned.rank_of(path), u.version))
    summary = scanned.inventory.summary()
    return Manifest(
        project=ref.project,
        run=ref.run,
        step=ref.step or 0,
        world_size=world[0],
        world_size_inferred=world[1],
        files=tuple(files),
        tensors=TensorSummary(summary["tensors"], summary["tensor_bytes"], summary["objects"]),
        resume=resume,
        metrics=metrics,
        pushed_by=ctx.actor,
        created_at=iso(now()) or "",
    )


class _Sources:
    """The source files, each opened once as the scan checked it (`ScannedDir.open`) and kept
    open until its object is published: the store reads the open file through
    /proc/self/fd, never the path again, so a file swapped after the scan is not what gets
    copied."""

    def __init__(self, scanned: ScannedDir) -> None:
        self.scanned = scanned
        self.fds: dict[str, int] = {}
        self.lock = threading.Lock()
        self.by_descriptor = os.path.isdir("/proc/self/fd")

    def open(self, path: str) -> Path:
        fd = self.scanned.open(path)
        if not self.by_descriptor:  # no /proc: the path, checked just now
            os.close(fd)
            return self.scanned.root / path
        with self.lock:
            old = self.fds.pop(path, None)
            self.fds[path] = fd
        if old is not None:
            os.close(old)
        return Path(f"/proc/self/fd/{fd}")

    def close(self, path: str) -> None:
        with self.lock:
            fd = self.fds.pop(path, None)
        if fd is not None:
            os.close(fd)

    def close_all(self) -> None:
        for path in list(self.fds):
            self.close(path)
