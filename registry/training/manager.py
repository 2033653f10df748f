"""`CheckpointManager`: the registry inside a training loop (torch.distributed, any world size).

    manager = CheckpointManager("run42")
    start = manager.restore(state) or 0          # every rank; None when the run has none yet
    for step in range(start + 1, steps + 1):
        ...
        manager.step_done(step)                   # cheap: step times in memory, heartbeats
        if step % 1000 == 0:
            manager.save(state, step, metrics={"val_loss": loss}, async_=True)
    manager.close()                               # waits for the last save

`save` claims the step once (rank 0) and shares the claim with every rank; each rank writes its
own DCP files straight into the store (`StoreWriter`: no staging directory, no rank-0 funnel,
no shared filesystem needed on S3); rank 0's `finish()` gets every rank's file records through
DCP and commits the catalog row once. `async_=True` stages the state to CPU memory
(`dcp.async_save`) and returns; training goes on while the ranks upload, and the next `save`,
`wait()` or `close()` waits for it (one save in flight; its failure raises there). What each
save cost the loop (`stall_seconds`) and until it was committed (`persist_seconds`), with each
rank's writes, is recorded on the checkpoint; each restore records its phases.

`restore` loads the newest committed checkpoint straight from the store on every rank (ranged
reads, the safe metadata reader, resharding to the current world size) and records that the run
resumed from it, so retention keeps it.

`step_done(step)` after each training step feeds `reg advise`: rank 0 keeps step
times in memory; a step that overlapped a background save is slower than the median of the
steps that did not, and that slowdown (plus any time the next save waited for it) is the save's
interference: C_eff = stall + interference, recorded on the checkpoint. Every `heartbeat_s`, at
each save and at close, rank 0 reports the last step reached and the time at risk since the
previous report, so a restore after a crash knows the work the failure lost (the steps since
the restored checkpoint, to the last heartbeat). `restore(planned=True)` says this restart was
planned (not a failure); `close()` says the attempt ended, so the next restore is not one
either. Heartbeats (and the restore's record) go out from a background daemon thread with a
short timeout, never from inside `save()`: one still in flight when the next is due is dropped
(its time counts in the next), and whatever a heartbeat raises is warned about once and never
reaches the training loop. `heartbeat_s` is at least 1 s.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
import warnings
from collections import deque
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from registry.api.contract import Registry
from registry.core.refs import CheckpointRef, check_name
from registry.economics.records import MAX_HEARTBEAT_SECONDS, MAX_SAVES
from registry.errors import NotFound, RegistryError, Unfinished, UsageError
from registry.formats.dcp_load import SafeLoadPlanner
from registry.training import local_tier, ranks
from registry.training.backends import Backend, backend_for
from registry.training.saves import RestoreRecord, Save, Track, checked
from registry.training.store_writer import StoreWriter
from registry.training.tiered import LocalTier
from registry.training.timed_reader import TimedReader

if TYPE_CHECKING:
    from collections.abc import Callable

    from registry.lifecycle.checkpoints.shared import SharedClaim


HEARTBEAT_FLOOR_S = 1.0  # heartbeats no more often than this
CLOSE_TIMEOUT_S = 60.0  # close() waits this long for the last save and copies, then gives up
BEAT_JOIN_S = 10.0  # close() and flush() wait this long for a heartbeat in flight
_now: Callable[[], float] = time.monotonic  # the step-timing clock (a test's fake clock)


def _dcp_metadata(reader: Any, step: int, manager: Any) -> Any:
    """The checkpoint's DCP metadata; a step without one (a transformers Trainer's plain save
    or a PEFT folder pushed to this run) is named as such, not as damage to the store."""
    try:
        return reader.read_metadata()
    except NotFound:
        ref = f"{manager.project}/{manager.run}@step{step}"
        raise NotFound(
            f"{ref} has no DCP .metadata in the store: a save CheckpointManager did not write "
            "(a Trainer or PEFT save pushed to this run), or a damaged store",
            f"`reg verify {ref}` says which; restore a trainer's own save with that trainer",
        ) from None


class CheckpointManager:
    def __init__(
        self,
        run: str,
        *,
        project: str = "default",
        registry: Registry | None = None,
        thread_count: int = 1,
        staging: object = None,  # unused since saves write straight into the store
        heartbeat_s: float = 30.0,
        local_dir: str | os.PathLike[str] | None = None,
        node_id: str | None = None,
        keep_local: int = 2,
        local_budget_bytes: int | None = None,
        evict_unreplicated: bool = False,
        replicate: bool = True,
        replicate_every: int = 1,
        replicate_bytes_per_s: float | None = None,
        on_error: str = "warn",
        staging_budget_bytes: int | None = None,
        close_timeout_s: float = CLOSE_TIMEOUT_S,
    ) -> None:
        check_name(project, "project name")
        if not 0 < close_timeout_s < float("inf"):
            raise UsageError(f"close_timeout_s={close_timeout_s!r}", "a positive number of seconds")
        self.close_timeout_s = float(close_timeout_s)
        check_name(run, "run name")
        self.run, self.project = run, project
        # Tier 0: saves go to this node's local directory first (`tiered.py`).
        self._tier: LocalTier | None = None
        path = local_tier.check_local_dir(local_dir)
        if path is not None:
            self._tier = LocalTier(
                self,
                path,
                node_id=node_id,
                keep_local=keep_local,
                local_budget_bytes=local_budget_bytes,
                evict_unreplicated=evict_unreplicated,
                replicate=replicate,
                replicate_every=replicate_every,
                replicate_bytes_per_s=replicate_bytes_per_s,
                on_error=on_error,
                staging_budget_bytes=staging_budget_bytes,
            )
        self.thread_count = thread_count
        self._registry = registry
        self._backend: Backend | None = None
        self._pending: Save | None = None
        self._async_group: Any = None
        self._restore: RestoreRecord | None = None
        self.resume_notes: list[str] = []  # what per-rank state did not carry over (restore)
        self._saved_any = False  # a run exists once a save committed (or a restore found one)
        # Step timings (rank 0): `reg advise`'s C_eff and heartbeats.
        self.heartbeat_s = max(HEARTBEAT_FLOOR_S, float(heartbeat_s))
        self._flushed_at = _now()  # the time at risk is counted from here
        self._last_step: int | None = None
        self._last_step_time: float | None = None  # when the step being timed started
        self._clean: deque[float] = deque(maxlen=256)  # step times with no save in flight
        self._tracking: list[Track] = []  # background saves whose slowdown is measured
        self._finished: dict[str, dict[str, float]] = {}  # for the next heartbeat
        self._heartbeat_warned = False
        self._beat_due = False  # a save happened: the next step_done reports the step reached
        self._beat_thread: threading.Thread | None = None
        self._beat_lock = threading.Lock()

    @property
    def registry(self) -> Registry:
        if self._registry is None:
            self._registry = Registry()
        return self._registry

    @property
    def backend(self) -> Backend:
        """The store itself, or `reg server` when REG_URL is set (every rank alike)."""
        if self._backend is None:
            self._backend = backend_for(self.registry)
        return self._backend

    @property
    def failures(self) -> list[dict[str, Any]]:
        """With `local_dir`, on_error="warn": the saves given up (`{"step", "error"}` each)."""
        return [] if self._tier is None else list(self._tier.failures)

    # -- saving ---------------------------------------------------------------------------------
    def save(
        self,
        state: dict[str, Any],
        step: int,
        *,
        metrics: dict[str, float] | None = None,
        async_: bool = False,
        per_rank: dict[str, Any] | None = None,
    ) -> dict[str, Any] | None:
        """Save `state` as run@step on every rank. Synchronous: returns the committed
        checkpoint's view (every rank). `async_=True`: returns once the state is staged in CPU
        memory (None); `wait()` returns the view. With `local_dir` (tier 0): returns None once
        every rank's files are durable on its node (or staged); `wait()` returns the view once
        the step is committed at tier 0. `per_rank`: state that differs by rank, by
        class (`{"rng": ..., "dataloader": ...}`), saved as `<class>.rank_<r>` for each rank
        (DCP keeps one copy of a key every rank saves alike)."""
        entered = time.monotonic()
        try:
            return self._save(state, step, metrics, async_, per_rank, entered)
        except UsageError:
            raise  # the call itself is wrong (a step, the ranks' layout): fix the loop
        except RegistryError as exc:  # raised alike on every rank (`ranks.agree`, DCP)
            if self._tier is None or self._tier.on_error == "raise":
                raise
            self._tier.gave_up(CheckpointRef(self.project, self.run, step), exc)
            return None
        finally:
            # The next step is timed from here: neither the save itself nor what the loop did
            # between step_done and save (eval, logging) counts as the save's interference.
            self._last_step_time = _now()
            self._beat_due = True  # the step reached goes out with the next step_done

    def _save(
        self,
        state: dict[str, Any],
        step: int,
        metrics: dict[str, float] | None,
        async_: bool,
        per_rank: dict[str, Any] | None,
        entered: float,
    ) -> dict[str, Any] | None:

        pending: Any = self._pending or (self._tier.pending if self._tier is not None else None)
        self.wait()  # one save in flight: the previous one commits (or raises) first
        if pending is not None:  # the loop blocked on it: part of that save's cost
            self._track_done(pending, blocked=time.monotonic() - entered)
        started = time.monotonic()
        # What one rank finds wrong stops every rank, before anything is claimed: a rank that
        # raised alone would leave the others waiting in DCP's collectives.
        problem: RegistryError | None = None
        ref = CheckpointRef(self.project, self.run, step)
        try:
            state = ranks.with_per_rank(state, per_rank)
            problem = ranks.unloadable(state)
            if self._tier is not None:
                self._tier.prepare(ref)  # this node's directory for the step, writable
            else:  # a tier-0 save needs no store now: its copy waits for one
                self.backend.prepare()  # the store or the server, reachable from this rank
        except RegistryError as exc:
            problem = exc
        ranks.agree(problem)
        if self._tier is not None and not self._tier.layout_checked:
            self._tier.layout_checked = True
            ranks.agree(local_tier.layout_problem(self._tier.node, self._tier.local_dir))
        if self._tier is not None and self._tier.has_room(state, ref):
            self._saved_any = True
            tiered = self._tier.save(state, ref, metrics, async_, started)
            if ranks.current_rank() == 0:  # its hashing and commit run beside the next steps
                self._tracking.append(Track(tiered, step, tiered.done))
                if tiered.copy:  # and then its copy to the store: C of the second level
                    tier = self._tier
                    copied = Track(
                        ("copy", tiered), step, lambda: tiered.done() and tier.copied(step), "copy_"
                    )
                    self._tracking.append(copied)
            return None
        if self._tier is not None:  # no room at tier 0: the store, reachable on every rank
            problem = None
            try:
                self.backend.prepare()
            except RegistryError as exc:
                problem = exc
            ranks.agree(problem)
        shared = self._claim(ref)
        self._saved_any = True  # the claim made the run
        save = Save(self, shared, started, metrics, async_)
        writer = StoreWriter(
            self.backend.sink(shared),
            shared.prefix,
            save.commit if ranks.current_rank() == 0 else None,
            thread_count=self.thread_count,
        )
        save.hold()
        try:
            if not async_:
                checked(lambda: dcp.save(state, storage_writer=writer))
                save.staged(time.monotonic() - started)
                return save.result(sync=True)
            group = self.save_group()
            future = checked(
                lambda: dcp.async_save(state, storage_writer=writer, process_group=group)
            )
        except BaseException:
            save.release(failed=True)
            raise
        save.staged(time.monotonic() - started)
        save.future = future
        self._pending = save
        if ranks.current_rank() == 0:
            self._tracking.append(Track(save, step))
        return None

    def wait(
        self, *, replicated: bool = False, timeout: float | None = None
    ) -> dict[str, Any] | None:
        """Wait for the save in flight (if any); its committed view, or its error. With
        `local_dir`: until it is committed at tier 0 (rank 0 gets the view), and with
        `replicated=True` until every save so far is in the store (tier 1); `timeout`: at most
        that many seconds, then `Unfinished` names what still runs (it goes on running)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        view = self._wait_store_save() if self._pending is not None else None  # no room at tier 0
        if self._tier is None:
            return view
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        tier_view = self._tier.wait(left)
        if replicated:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            self._tier.wait_replicated(left)
        else:
            self._tier.raise_failures()  # with on_error="raise": a failed copy, here
        return view if view is not None else tier_view

    def _wait_store_save(self) -> dict[str, Any] | None:
        """The save in flight to the store: its committed view, or its error."""
        save, self._pending = self._pending, None
        if save is None:
            return None
        assert save.future is not None
        try:
            checked(save.future.result)
            return save.result(sync=False)
        except BaseException as exc:
            save.release(failed=True)
            # one that did not fit at tier 0: under on_error="warn" said, as a tier-0 save's
            if self._tier is None or self._tier.on_error == "raise":
                raise
            if not isinstance(exc, RegistryError) or isinstance(exc, UsageError):
                raise
            self._tier.gave_up(save.shared.ref, exc)
            return None

    def _claim(self, ref: CheckpointRef) -> SharedClaim:
        """Rank 0 claims the step; every rank gets the claim or rank 0's error."""
        return ranks.from_rank0(lambda: self.backend.claim(ref))  # type: ignore[no-any-return]

    def save_group(self) -> Any:
        """async_save's own gloo group: its collectives run on a background thread, which must
        not share a communicator with the training loop's (as torchtitan does)."""
        if self._async_group is None and dist.is_initialized():
            self._async_group = dist.new_group(backend="gloo")
        return self._async_group

    # -- restoring ------------------------------------------------------------------------------
    def restore(
        self,
        state: dict[str, Any],
        *,
        per_rank: dict[str, Any] | None = None,
        planned: bool = False,
    ) -> int | None:
        """Load the newest committed checkpoint into `state` (in place); returns its step.
        `planned`: this restart was planned (a config change, a move), not a failure.
        `per_rank` (as `save` took it: class -> a template of this rank's value) is filled in
        place with what this rank saved. At another world size a rank the checkpoint has no
        state for keeps its template, and ranks beyond the new world size are not loaded:
        `resume_notes` says which, class by class."""

        started = time.monotonic()

        tier_notes: list[str] = []
        if self._tier is not None:  # the newest step at any tier this job can read
            found = self._tier.locate()
            if found is None:
                self.resume_notes = self._tier.notes
                return None
            newest_step, tiered, prefix, versions, tier_notes = found
        else:
            # Rank 0 asks which step is newest; every rank then reads it (the same files).
            def newest() -> int | None:
                found = self.backend.latest(CheckpointRef(self.project, self.run, None))
                return None if found is None else found[0]

            newest_step = ranks.from_rank0(newest)
            if newest_step is None:
                return None
        self._saved_any = True
        step = int(newest_step)
        problem: RegistryError | None = None
        try:  # every rank finds the step and reads its .metadata, or every rank stops
            if self._tier is None:
                located = self.backend.latest(CheckpointRef(self.project, self.run, step))
                if located is None:
                    raise NotFound(f"{self.project}/{self.run}@step{step} is gone", "restore again")
                _, tiered, prefix, versions = located
            reader = TimedReader(tiered, prefix, versions=versions)
            loaded, notes = ranks.per_rank_to_load(_dcp_metadata(reader, step, self), per_rank)
            self.resume_notes = tier_notes + notes
            full = ranks.with_per_rank(state, loaded)
        except RegistryError as exc:
            problem = exc
        ranks.agree(problem)
        checked(lambda: dcp.load(full, storage_reader=reader, planner=SafeLoadPlanner()), "restore")
        self.resume_notes = ranks.summarised_notes(self.resume_notes)
        for cls in loaded:
            assert per_rank is not None
            per_rank[cls] = full[cls][f"rank_{ranks.current_rank()}"]
        total = time.monotonic() - started
        verify = self._tier.verify_seconds if self._tier is not None else 0.0
        phases = {
            "catalog_seconds": max(0.0, reader.opened_at - started - verify),
            "verify_seconds": verify,
            "metadata_seconds": reader.metadata_seconds,
            "fetch_seconds": reader.fetch_seconds,
            "load_reshard_seconds": max(
                0.0,
                total
                - (reader.opened_at - started)  # the verification included
                - reader.metadata_seconds
                - reader.fetch_seconds,
            ),
            "total_seconds": total,
            "bytes": float(reader.bytes_read),
        }
        if self._tier is not None:  # what this restore read from the nodes' own copies
            local = float(getattr(tiered, "local_bytes", 0))
            phases["local_bytes"] = local
            # the slowest rank's store reads: 0 when every rank read its own node's copy
            phases["store_bytes"] = max(0.0, reader.bytes_read - local)
        ref = CheckpointRef(self.project, self.run, step)
        self._restore = RestoreRecord(ref, ranks.gather_max(phases), planned)
        if ranks.current_rank() == 0:
            self.backend.resumed(ref)  # at once: retention keeps the step the run resumed from
        return step

    def first_step_done(self) -> None:
        """Call after the first training step that follows `restore`: the restore's record
        gets `first_step_seconds` (from the end of the load to now) and goes out (rank 0, from
        the heartbeat thread)."""
        if self._restore is not None and "first_step_seconds" not in self._restore.phases:
            self._restore.phases["first_step_seconds"] = round(
                time.monotonic() - self._restore.ended, 4
            )
        if ranks.current_rank() != 0:
            self._restore = None  # rank 0 records it
        elif self._restore is not None:
            self._send_beat(_now())

    def _record_restore(self, restore: RestoreRecord) -> None:
        """Rank 0, on the heartbeat thread (or at close): the restore's record."""
        if restore.planned:
            self.backend.plan_restart(restore.ref)
        self.backend.restored(restore.ref, ranks.world_size(), restore.phases)

    # -- step timings and heartbeats ------------------------------------------------
    def step_done(self, step: int) -> None:
        """Training step `step` is done (call on every rank, after the optimizer step). Cheap:
        rank 0 keeps the step's time in memory; a heartbeat goes out every `heartbeat_s`, from
        a background thread."""
        at = _now()
        if self._restore is not None:
            self.first_step_done()
        if ranks.current_rank() != 0:
            return
        before = self._last_step_time
        self._last_step = step
        if before is not None:
            took = max(0.0, at - before)
            if self._tracking:
                for track in self._tracking:
                    track.during.append(took)
            else:
                self._clean.append(took)
        for track in list(self._tracking):
            if track.done():
                self._track_done(track.save)
        if self._beat_due or self._restore is not None or at - self._flushed_at >= self.heartbeat_s:
            self._send_beat(at)
        self._last_step_time = _now()  # after the bookkeeping: the next step starts here

    def _track_done(self, save: Any, blocked: float = 0.0) -> None:
        """A background save finished: its slowdown of the steps it overlapped, for the next
        heartbeat (against the median of the steps no save overlapped)."""
        for track in [t for t in self._tracking if t.save is save]:
            self._tracking.remove(track)
            figures: dict[str, float] = {"steps_during": float(len(track.during))}
            if not track.prefix:
                figures["blocked_seconds"] = round(blocked, 4)
            if len(self._clean) >= 3:
                baseline = statistics.median(self._clean)
                extra = sum(d - baseline for d in track.during)
                figures["baseline_step_seconds"] = round(baseline, 6)
                figures["interference_seconds"] = round(max(0.0, extra), 4)
            if track.prefix:  # a copy to the store: its own figures, beside the save's
                figures = {
                    track.prefix + k: v for k, v in figures.items() if k != "baseline_step_seconds"
                }
            with self._beat_lock:
                self._finished.setdefault(str(track.step), {}).update(figures)

    def _beat_in_flight(self) -> bool:
        return self._beat_thread is not None and self._beat_thread.is_alive()

    def _send_beat(self, at: float, *, ended: bool = False, wait: bool = False) -> None:
        """Rank 0: the last step reached and the time at risk since the last heartbeat (with a
        restore's record first), from a background thread. Dropped while one is in flight."""
        if self._beat_in_flight():
            return
        try:
            restore, self._restore = self._restore, None
            self._beat_due = False
            with self._beat_lock:
                keys = sorted(self._finished, key=int)[:MAX_SAVES]  # the rest: the next beat
                saves = {k: dict(self._finished[k]) for k in keys}
            figures: dict[str, Any] = {
                "step": self._last_step,
                # a beat after a long outage says at most this much (else it is refused forever)
                "seconds": min(max(0.0, at - self._flushed_at), MAX_HEARTBEAT_SECONDS),
                "world_size": ranks.world_size(),
                "step_seconds": statistics.median(self._clean) if self._clean else None,
                "saves": saves,
                "ended": ended,
            }
            thread = threading.Thread(
                target=self._beat,
                args=(restore, figures, at),
                name=f"reg-heartbeat-{self.run}",
                daemon=True,
            )
            self._beat_thread = thread
            thread.start()
            if wait:
                thread.join(BEAT_JOIN_S)
        except Exception as exc:  # nothing from a heartbeat reaches the training loop
            self._warn(exc)

    def _beat(self, restore: RestoreRecord | None, figures: dict[str, Any], at: float) -> None:
        try:
            if restore is not None:
                self._record_restore(restore)
            got = self.backend.heartbeat(CheckpointRef(self.project, self.run, None), **figures)
        except Exception as exc:
            self._warn(exc)
            return
        if got.get("recorded"):  # else no run yet: the time keeps counting to the next one
            with self._beat_lock:
                self._flushed_at = max(self._flushed_at, at)
                for key, sent in figures["saves"].items():  # what came in since: the next beat
                    left = self._finished.get(key, {})
                    for name in sent:
                        left.pop(name, None)
                    if not left:
                        self._finished.pop(key, None)

    def _warn(self, exc: Exception) -> None:
        if not self._heartbeat_warned:
            self._heartbeat_warned = True
            warnings.warn(f"reg: a heartbeat of {self.run} failed: {exc}", stacklevel=2)

    def flush(self) -> None:
        """Rank 0: send a heartbeat now and wait for it (a bounded wait): e.g. before a job
        stops itself. Never raises."""
        if ranks.current_rank() != 0 or not self._saved_any:
            return
        if self._beat_thread is not None:
            self._beat_thread.join(BEAT_JOIN_S)
        self._send_beat(_now(), wait=True)

    def close(self, status: str | None = "finished") -> None:
        """Wait for the save in flight (with `local_dir`, and its copies to the store: at most
        `close_timeout_s`, then one warning names what was given up, or with
        `on_error="raise"` an `Unfinished` error once the rest is closed), record a pending
        restore, say the run ended with `status` (rank 0; None: the job goes on elsewhere),
        close the registry."""
        unfinished: Unfinished | None = None
        try:
            pending: Any = self._pending or (self._tier.pending if self._tier else None)
            if self._tier is None:
                self.wait()
            else:
                try:
                    self.wait(replicated=self._tier.replicate, timeout=self.close_timeout_s)
                except Unfinished as exc:
                    unfinished, pending = exc, None
                    if self._tier.on_error == "warn":
                        warnings.warn(f"reg: close gave up waiting: {exc}", stacklevel=2)
            if self._tier is not None:
                self._tier.close()
            if pending is not None and ranks.current_rank() == 0:
                self._track_done(pending)
            if ranks.current_rank() == 0 and (self._saved_any or self._restore is not None):
                if self._beat_thread is not None:
                    self._beat_thread.join(BEAT_JOIN_S)
                # a failed job's next restore is a failure
                self._send_beat(_now(), ended=status != "failed", wait=True)
            self._restore = None
            if status is not None and ranks.current_rank() == 0 and self._saved_any:
                self.registry.finish_run(self.run, project=self.project, status=status)
        finally:
            if self._registry is not None:
                self._registry.close()
        if unfinished is not None and self._tier is not None and self._tier.on_error == "raise":
            raise unfinished

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        """A `with` block: the run ends finished, failed on an exception, killed on Ctrl-C."""
        if kind is None:
            self.close("finished")
            return
        # The block's own exception is what the caller must see, not one from closing.
        try:
            self.close("killed" if issubclass(kind, KeyboardInterrupt) else "failed")
        except Exception as exc:
            warnings.warn(f"closing {self.project}/{self.run} failed: {exc}", stacklevel=2)
