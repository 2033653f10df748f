"""The replicator (issue 36): copies each tier-0 step from this rank's node-local directory to
the registry's store (tier 1), in a background thread at low CPU and I/O priority, at most
`bytes_per_s`, and never in the training loop's way.

Each rank uploads the files its node holds of a step (`Job.files`: assigned by the tier-0
commit, one uploader per file), hashing them as they go, and records them under the step's
replication claim (`shared.record_part`), as any writer under a claim does. Rank 0 then waits
until every file is recorded and commits the step at tier 1 (`tiers.commit_replicated`, which
checks each recorded digest against the one tier 0 recorded and the store's sizes). A failed
copy is retried (`RETRIES`, with backoff); what still fails is reported (`on_error="warn"`:
a warning, training goes on; `"raise"`: raised by the next `save()` or `wait()`), and its
claim runs out, so the next job's restore takes the copy over.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import platform
import queue
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from registry.catalog.claims import LEASE_SECONDS
from registry.catalog.leases import Heartbeat
from registry.errors import Conflict, ObjectExists, RegistryError
from registry.formats.documents import FileRecord
from registry.layout import MANIFEST, manifest_key
from registry.lifecycle.checkpoints.shared import SharedClaim, record_part, renew
from registry.transfer import Stored

if TYPE_CHECKING:
    from registry.local import LocalRegistry

RETRIES = 3
BACKOFF_S = 1.0
POLL_S = 0.25  # rank 0's look at whether every part is recorded
PARTS_TIMEOUT_S = 3600.0  # rank 0 gives up waiting for another rank's part after this
CHUNK = 8 << 20


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
        registry: LocalRegistry,
        *,
        bytes_per_s: float | None,
        on_error: str,
    ) -> None:
        self.registry = registry
        self.limit = RateLimit(bytes_per_s)
        self.on_error = on_error
        self.jobs: dict[int, Job] = {}
        self.failed: list[tuple[int, BaseException]] = []
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._beat: Heartbeat | None = None

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
                    renew(self.registry.context, job.claim, 0)

    def wait(self, timeout: float | None = None) -> None:
        """Until every submitted job is done (copied and, on rank 0, committed at tier 1)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for job in list(self.jobs.values()):
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            job.done.wait(left)

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
        while (job := self._queue.get()) is not None:
            try:
                self._attempts(job)
            finally:
                job.done.set()

    def _attempts(self, job: Job) -> None:
        for attempt in range(RETRIES):
            try:
                self._copy(job)
                return
            except Conflict as exc:  # the step was taken over, or is gone: nothing to retry
                job.error = exc
                break
            except Exception as exc:
                job.error = exc
                if attempt + 1 < RETRIES:
                    time.sleep(BACKOFF_S * 2**attempt)
        assert job.error is not None
        self.failed.append((job.step, job.error))
        if self.on_error == "warn":
            warnings.warn(
                f"reg: copying {job.claim.ref} to the store failed ({job.error}); it stays at "
                "tier 0 and the next job's restore takes the copy over",
                stacklevel=1,
            )

    def _copy(self, job: Job) -> None:
        self.copy(job, commit=job.commit)

    def copy(self, job: Job, *, commit: bool) -> None:
        """Put this rank's files of `job` (and the manifest) and record them; `commit`: then
        wait for every rank's part and commit the step at tier 1."""
        from registry.catalog import claims

        ctx = self.registry.context
        hold = claims.held(ctx.catalog, job.claim.catalog_claim()) if commit else None
        with hold or contextlib.nullcontext():
            prefix, claim = job.claim.prefix, job.claim
            stored = [
                self._put(prefix + f.path, job.directory / f.path, f, claim) for f in job.files
            ]
            if job.manifest:
                key = manifest_key(claim.ref.project, claim.ref.run, job.step)
                self._put(key, job.directory / MANIFEST, None, claim)
            record_part(ctx, job.claim, stored)
            if commit:
                job.result = self._commit(job)

    def _still_ours(self, claim: SharedClaim) -> None:
        from registry.catalog import claims

        if not claims.still_held(self.registry.context.catalog, claim.catalog_claim()):
            raise Conflict(
                f"lost the claim on the copy of {claim.ref} (another job took it over)",
                "nothing to do: that job copies it",
            )

    def _put(self, key: str, path: Path, record: FileRecord | None, claim: SharedClaim) -> Stored:
        store = self.registry.store
        limit = self.limit

        def produce(write: Callable[[Any], None]) -> None:
            with open(path, "rb") as f:
                while chunk := f.read(CHUNK):
                    limit.take(len(chunk))
                    write(chunk)

        try:
            put = store.put_stream(key, produce)
        except ObjectExists:  # an earlier attempt of this copy, under the same claim
            self._still_ours(claim)  # never delete what another replicator put
            store.delete(key)
            put = store.put_stream(key, produce)
        if record is not None and (put.size, put.sha256) != (record.size, record.sha256):
            self._still_ours(claim)
            store.delete(key)
            raise RegistryError(
                f"{path} is not the file the save recorded ({put.size} bytes now, "
                f"{record.size} recorded): the node's copy changed, so it is not copied"
            )
        return Stored(key, put.size, put.sha256, False, put.version)

    def _commit(self, job: Job) -> dict[str, Any]:
        from registry.lifecycle.checkpoints.tiers import commit_replicated, missing_parts

        ctx = self.registry.context
        deadline = time.monotonic() + PARTS_TIMEOUT_S
        key = manifest_key(job.claim.ref.project, job.claim.ref.run, job.step)
        while missing_parts(ctx, job.claim) or self.registry.store.head(key) is None:
            if time.monotonic() > deadline:
                raise RegistryError(f"{job.claim.ref}: another rank's copy never arrived")
            time.sleep(POLL_S)
        return commit_replicated(ctx, job.claim, time.monotonic() - job.queued)


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
