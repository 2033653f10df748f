"""The replicator: copies each tier-0 step from this rank's node-local directory to
the registry's store (tier 1), in a background thread at low CPU and I/O priority, at most
`bytes_per_s`, and never in the training loop's way.

Each rank uploads the files its node holds of a step (`Job.files`: assigned by the tier-0
commit, one uploader per file), hashing them as they go, and records them under the step's
replication claim (`shared.record_part`), as any writer under a claim does; through `reg
server` each file goes through the server's push path, hashed and recorded there
(`tier_catalog`). Rank 0 then waits
until every file is recorded and commits the step at tier 1 (`tiers.commit_replicated`, which
checks each recorded digest against the one tier 0 recorded and the store's sizes). A failed
copy is retried (`RETRIES`, with backoff). With `on_error="warn"` what still fails (the store
unreachable) is said once for the outage and tried again every `RETRY_LATER_S` while the job
runs, its claim kept alive, so every step left at tier 0 is copied once the store is back;
with `"raise"` it is raised by the next `save()` or `wait()` and its claim runs out, so the
next job's restore takes the copy over. Rank 0's commit waiting for another rank's part does
not hold up the copies of later steps: the job is looked at again every `POLL_S`.
"""

from __future__ import annotations

import contextlib
import ctypes
import heapq
import itertools
import os
import platform
import queue
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from registry.catalog.claims import LEASE_SECONDS
from registry.catalog.leases import Heartbeat
from registry.core.layout import MANIFEST
from registry.errors import Conflict, RegistryError
from registry.formats.documents import FileRecord
from registry.lifecycle.checkpoints.shared import SharedClaim

if TYPE_CHECKING:
    from registry.training.tier_catalog import TierCatalog

RETRIES = 3
BACKOFF_S = 1.0
RETRY_LATER_S = 10.0  # on_error="warn": a copy that failed RETRIES times is tried again after this
POLL_S = 0.25  # rank 0's look at whether every part is recorded
PARTS_TIMEOUT_S = 3600.0  # rank 0 gives up waiting for another rank's part after this


class _PartsPending(Exception):
    """Rank 0's commit waits for another rank's part: the job is looked at again soon, and the
    copies of later steps go on meanwhile."""


@dataclass(slots=True)
class Job:
    """One step to copy from this rank: its files (and the manifest, on the node holding it);
    `commit`: this rank (rank 0) commits the step once every rank's part is recorded."""

    claim: SharedClaim
    directory: Path
    files: list[FileRecord]
    manifest: bool
    commit: bool
    queued: float = field(default_factory=time.monotonic)
    stage: str = "queued behind earlier copies"  # what it is doing now (a bounded wait names it)
    parts_deadline: float | None = None  # rank 0 gives up on the other ranks' parts then
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    result: dict[str, Any] | None = None

    @property
    def step(self) -> int:
        return self.claim.ref.step or 0


class RateLimit:
    """At most `bytes_per_s` on average (None: unlimited)."""

    def __init__(self, bytes_per_s: float | None) -> None:
        self.rate = bytes_per_s if bytes_per_s and bytes_per_s > 0 else None
        self.free_at = time.monotonic()

    def take(self, n: int) -> None:
        if self.rate is None:
            return
        now = time.monotonic()
        self.free_at = max(self.free_at, now) + n / self.rate
        if self.free_at > now:
            time.sleep(self.free_at - now)


class Replicator:
    def __init__(
        self,
        catalog: TierCatalog,
        *,
        bytes_per_s: float | None,
        on_error: str,
    ) -> None:
        self.catalog = catalog
        self.limit = RateLimit(bytes_per_s)
        self.on_error = on_error
        self.jobs: dict[int, Job] = {}
        self.failed: list[tuple[int, BaseException]] = []
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._beat: Heartbeat | None = None
        self._failing = False  # the last attempt failed: warned once until a copy succeeds

    def submit(self, job: Job) -> None:
        self.jobs[job.step] = job
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="reg-replicator", daemon=True)
            self._thread.start()
            # Every job's claim is kept alive while it waits or runs: a claim left to run out
            # would let another job's restore take the copy over under this one.
            self._beat = Heartbeat(self._renew_all, LEASE_SECONDS / 4)
            self._beat.__enter__()
        self._queue.put(job)

    def _renew_all(self) -> None:
        for job in list(self.jobs.values()):
            if not job.done.is_set():
                with contextlib.suppress(RegistryError):
                    self.catalog.renew(job.claim)

    def wait(self, timeout: float | None = None) -> list[Job]:
        """Until every submitted job is done (copied and, on rank 0, committed at tier 1), or
        `timeout` seconds: the jobs still not done."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for job in list(self.jobs.values()):
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            job.done.wait(left)
        return [job for job in self.jobs.values() if not job.done.is_set()]

    def raise_failures(self) -> None:
        if self.on_error == "raise" and self.failed:
            step, error = self.failed.pop(0)
            raise RegistryError(f"copying step {step} to the store failed: {error}")

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
        if self._beat is not None:
            self._beat.__exit__(None, None, None)
            self._beat = None

    # -- the thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        _lower_priority()
        later: list[tuple[float, int, Job]] = []  # jobs to look at again, by when
        order = itertools.count()
        while True:
            if later and later[0][0] <= time.monotonic():
                job = heapq.heappop(later)[2]
            else:
                try:
                    wait = max(0.0, later[0][0] - time.monotonic()) if later else None
                    got = self._queue.get(timeout=wait)
                except queue.Empty:
                    continue
                if got is None:
                    return  # closed: what waits in `later` stays undone (close() named it)
                job = got
            again = None
            try:
                again = self._attempts(job)
            finally:
                if again is None:
                    job.done.set()
                else:
                    heapq.heappush(later, (time.monotonic() + again, next(order), job))

    def _attempts(self, job: Job) -> float | None:
        """Copy `job`: None when it is done (copied, or failed for good), else the seconds
        after which to look at it again (its commit waits for other ranks' parts, or the store
        is unreachable and on_error="warn": copies are retried for as long as the job runs)."""
        for attempt in range(RETRIES):
            try:
                self._copy(job)
                self._failing, job.error = False, None
                return None
            except _PartsPending:
                return POLL_S
            except Conflict as exc:  # the step was taken over, or is gone: nothing to retry
                job.error = exc
                break
            except Exception as exc:
                job.error = exc
                if attempt + 1 < RETRIES:
                    time.sleep(BACKOFF_S * 2**attempt)
        assert job.error is not None
        if self.on_error == "warn" and not isinstance(job.error, Conflict):
            if not self._failing:  # one warning for an outage, not one per step and retry
                self._failing = True
                warnings.warn(
                    f"reg: copying {job.claim.ref} to the store failed ({job.error}); it stays "
                    f"at tier 0, and the copies are retried every {RETRY_LATER_S:.0f} s while "
                    "the job runs (the next job's restore takes over what is left)",
                    stacklevel=1,
                )
            job.stage = f"waiting to retry its copy ({job.error})"
            return RETRY_LATER_S
        self.failed.append((job.step, job.error))
        if self.on_error == "warn":
            warnings.warn(
                f"reg: copying {job.claim.ref} to the store failed ({job.error}); it stays at "
                "tier 0 and the next job's restore takes the copy over",
                stacklevel=1,
            )
        return None

    def _copy(self, job: Job) -> None:
        self.copy(job, commit=job.commit)

    def copy(self, job: Job, *, commit: bool) -> None:
        """Put this rank's files of `job` (and the manifest) and record them; `commit`: then
        wait for every rank's part and commit the step at tier 1."""
        catalog, claim, take = self.catalog, job.claim, self.limit.take
        # A retry puts only what an earlier attempt did not: what is recorded stays as it is.
        job.stage = "copying this rank's files"
        missing = set(catalog.missing(claim))
        stored = [
            catalog.put(claim, f.path, job.directory / f.path, f, take)
            for f in job.files
            if f.path in missing
        ]
        if job.manifest and MANIFEST in missing:
            catalog.put(claim, MANIFEST, job.directory / MANIFEST, None, take)
        if stored:
            catalog.record(claim, stored)
        if commit:
            job.result = self._commit(job)

    def _commit(self, job: Job) -> dict[str, Any]:
        if job.parts_deadline is None:
            job.parts_deadline = time.monotonic() + PARTS_TIMEOUT_S
        if missing := self.catalog.missing(job.claim):
            job.stage = f"waiting for the other ranks' copies ({len(missing)} files not recorded)"
            if time.monotonic() > job.parts_deadline:
                raise Conflict(f"{job.claim.ref}: another rank's copy never arrived")
            raise _PartsPending
        job.stage = "committing it at tier 1"
        return self.catalog.commit_replicated(job.claim, time.monotonic() - job.queued)


def _lower_priority() -> None:
    """This thread at nice 10 and in the idle I/O class (Linux; best effort)."""
    tid = threading.get_native_id()
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, tid, 10)
    if platform.machine() != "x86_64":
        return
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(None, use_errno=True)
        ioprio_set, who_process, idle_class = 251, 1, 3  # x86_64
        libc.syscall(ioprio_set, who_process, tid, idle_class << 13)
