"""`CheckpointManager(local_dir=...)`: saves at tier 0 first, the store behind it.

`save()` writes each rank's files into its node's local directory with DCP's own file writer
(`local_tier.LocalWriter`) and returns once they are durable there (synchronous) or staged
(async); hashing, the claim and the tier-0 commit follow in a background thread on every rank
(`_finish`), then each rank's replicator copies its node's files to the store and rank 0
commits them at tier 1. `wait()` returns when the last save is committed at tier 0,
`wait(replicated=True)` when every save is at tier 1.

`locate()` (restore) takes the newest step committed at some tier whose every file this job can
read; `LocalTier` inherits it from `TierRestore` (tier_restore.py, with `TieredStore`, what a
restore reads through).

Each node's first rank keeps the node's copies within bounds: the newest `keep_local` steps and
`local_budget_bytes`; a step not yet in the store is kept unless `evict_unreplicated`.

`replicate_every=k` copies every k-th save to the store (the first included), the two-level
scheme `reg advise` weighs (SCR's per-level intervals): the others stay at tier 0 only, by
design (`tier0_only` in their save costs): no later job copies them, and eviction may drop them.
"""

from __future__ import annotations

import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._nested_dict import flatten_state_dict

from registry.catalog.models import LOCAL
from registry.core.refs import CheckpointRef
from registry.errors import RegistryError, Unfinished, UsageError
from registry.lifecycle.checkpoints.shared import SharedClaim
from registry.training import local_tier, ranks
from registry.training.local_tier import LocalWriter, RankFiles
from registry.training.replicator import Job, Replicator
from registry.training.saves import checked
from registry.training.tier_catalog import TierCatalog, tier_catalog
from registry.training.tier_restore import TierOwner, TierRestore

if TYPE_CHECKING:
    from concurrent.futures import Future


ON_ERROR = ("warn", "raise")
# Room a tier-0 save needs beyond its ranks' tensor bytes: DCP's metadata and pickled values.
ROOM_MARGIN = 1.05
ROOM_SLACK_BYTES = 256 << 10


@dataclass(slots=True)
class TierSave:
    """One tier-0 save in flight: its writer, DCP's future (async), its stall."""

    ref: CheckpointRef
    writer: LocalWriter
    future: Future[Any] | None
    started: float
    stall: float
    metrics: dict[str, float] | None
    async_: bool
    copy: bool  # copied to the store once committed at tier 0
    thread: threading.Thread | None = None
    result: dict[str, Any] | None = None
    error: BaseException | None = None

    def done(self) -> bool:
        """Its background work (writing, hashing, the tier-0 commit) ended."""
        return self.thread is not None and not self.thread.is_alive()


class LocalTier(TierRestore):
    def __init__(
        self,
        manager: TierOwner,
        local_dir: Path,
        *,
        node_id: str | None,
        keep_local: int,
        local_budget_bytes: int | None,
        evict_unreplicated: bool,
        replicate: bool,
        replicate_every: int,
        replicate_bytes_per_s: float | None,
        on_error: str,
        staging_budget_bytes: int | None,
    ) -> None:
        if on_error not in ON_ERROR:
            raise UsageError(f"on_error={on_error!r}", "'warn' or 'raise'")
        if keep_local < 1:
            raise UsageError(f"keep_local={keep_local}", "keep at least the newest step")
        if isinstance(replicate_every, bool) or not isinstance(replicate_every, int):
            raise UsageError(f"replicate_every={replicate_every!r}", "a whole number from 1")
        if replicate_every < 1:
            raise UsageError(f"replicate_every={replicate_every}", "1 copies every save")
        self.manager, self.local_dir = manager, local_dir
        self.node = local_tier.node_name(node_id)
        self.keep_local, self.budget = keep_local, local_budget_bytes
        self.evict_unreplicated, self.replicate = evict_unreplicated, replicate
        self.on_error, self.staging_budget = on_error, staging_budget_bytes
        self.bytes_per_s = replicate_bytes_per_s
        self.replicate_every = replicate_every
        self._uncopied = replicate_every - 1  # saves since the last copied one: the first copies
        self.pending: TierSave | None = None
        self.newest_saved: int | None = None
        self.notes: list[str] = []  # the last restore's, on the tier-0 steps it skipped
        self.verify_seconds = 0.0  # the last restore's re-hashing of this rank's node copies
        self._replicator: Replicator | None = None
        self._catalog: TierCatalog | None = None
        self._warned_staging = False
        self._warned_room: str | None = None  # the last reason a save skipped tier 0
        self._unwritable: str | None = None  # this rank's step directory could not be made
        self.layout_checked = False  # the ranks' nodes and directories (the first save)
        self.failures: list[dict[str, Any]] = []  # saves given up (on_error="warn")

    @property
    def catalog(self) -> TierCatalog:
        """The catalog and store: this process's own, or `reg server`'s (REG_URL)."""
        if self._catalog is None:
            self._catalog = tier_catalog(self.manager.registry)
        return self._catalog

    @property
    def replicator(self) -> Replicator:
        if self._replicator is None:
            self._replicator = Replicator(
                self.catalog, bytes_per_s=self.bytes_per_s, on_error=self.on_error
            )
        return self._replicator

    # -- saving ---------------------------------------------------------------------------------
    def prepare(self, ref: CheckpointRef) -> None:
        """Every rank, before the ranks agree to save: the step's directory for this save
        (`step-N.partial`, renamed to `step-N` once the step is claimed: a save never writes
        over a copy the catalog records). What fails here fails every rank, before a byte is
        written. A node directory that stopped being writable (a disk remounted read-only)
        is not an error here: `has_room` sends the save to the store."""
        self.catalog  # noqa: B018
        try:
            local_tier.check_local_dir(self._partial(ref))
            self._unwritable = None
        except UsageError as exc:
            self._unwritable = exc.message

    def _partial(self, ref: CheckpointRef) -> Path:
        final = local_tier.step_dir(self.local_dir, ref.project, ref.run, ref.step or 0)
        return final.with_name(final.name + ".partial")

    def save(
        self,
        state: dict[str, Any],
        ref: CheckpointRef,
        metrics: dict[str, float] | None,
        async_: bool,
        started: float,
    ) -> TierSave:
        if async_ and self._over_staging_budget(state):
            async_ = False
        copy = self.replicate and self._uncopied + 1 >= self.replicate_every
        self._uncopied = 0 if copy else self._uncopied + 1
        writer = LocalWriter(self._partial(ref), thread_count=self.manager.thread_count)
        # The manager's own group, made here: making it is a collective on the default group,
        # which the background thread must never run beside the loop's own collectives.
        group = self.manager.save_group()
        future = None
        if async_:
            future = checked(
                lambda: dcp.async_save(state, storage_writer=writer, process_group=group)
            )
        else:
            checked(lambda: dcp.save(state, storage_writer=writer))
        stall = time.monotonic() - started
        save = TierSave(ref, writer, future, started, stall, metrics, async_, copy)
        save.thread = threading.Thread(
            target=self._finish, args=(save,), name="reg-tier0-commit", daemon=True
        )
        self.pending = save
        save.thread.start()
        return save

    def _over_staging_budget(self, state: dict[str, Any]) -> bool:
        """An async save stages a copy of the state in host memory: above the budget, this one
        is saved synchronously instead (it waits rather than exceed it)."""
        if self.staging_budget is None:
            return False

        mine = _rank_bytes(state)
        # Decided together: a rank saving synchronously while another returns to training
        # would meet the loop's collectives with DCP's.
        size = int(ranks.gather_max({"bytes": float(mine)})["bytes"])
        if size <= self.staging_budget:
            return False
        if not self._warned_staging:
            self._warned_staging = True
            warnings.warn(
                f"reg: staging {size} bytes (the largest rank's) would exceed staging_budget_bytes="
                f"{self.staging_budget}: saving synchronously instead",
                stacklevel=3,
            )
        return True

    def has_room(self, state: dict[str, Any], ref: CheckpointRef) -> bool:
        """Every rank, before a tier-0 save: whether every node has room for its ranks' files
        (free space, and `local_budget_bytes`), after its first rank evicted copies the store
        already holds, oldest first. False (decided together): this save goes to the store,
        said once, by rank 0."""
        every = ranks.gathered((self.node, _rank_bytes(state)))
        need = sum(size for node, size in every if node == self.node)
        need = int(need * ROOM_MARGIN) + ROOM_SLACK_BYTES  # DCP's metadata and pickled values
        first = min(r for r, (node, _) in enumerate(every) if node == self.node)
        why = self._unwritable
        if why is None and first == ranks.current_rank():
            try:
                if not self._make_room(need):
                    why = (
                        f"{self.local_dir}: no room for {need} bytes once the copies already "
                        "in the store were evicted"
                    )
            except Exception as exc:  # the check never stops a save: the write says ENOSPC
                warnings.warn(f"reg: checking room at tier 0 failed: {exc}", stacklevel=2)
        reasons = [r for r in ranks.gathered(why) if r is not None]
        if not reasons:
            return True
        local_tier.evict(self._partial(ref))  # made ready by `prepare`, empty
        if ranks.current_rank() == 0 and reasons[0] != self._warned_room:
            self._warned_room = reasons[0]  # said again only when the reason changes
            warnings.warn(
                f"reg: {ref} cannot be saved at tier 0 ({reasons[0]}): saved straight to the "
                "store, as is every later save until tier 0 has room again",
                stacklevel=3,
            )
        return False

    def _make_room(self, need: int) -> bool:
        """This node's first rank: room for `need` bytes, evicting the node's copies oldest
        first: of steps the store holds, steps never to be copied (`replicate_every`), lost
        ones and leftovers; with `evict_unreplicated`, of any step."""
        m = self.manager
        steps = local_tier.local_steps(self.local_dir, m.project, m.run)

        def room() -> int:
            free = local_tier.free_bytes(self.local_dir)
            if self.budget is not None:
                free = min(free, self.budget - sum(_tree_bytes(p) for p in steps.values()))
            return free

        if room() >= need:
            return True
        states = self.catalog.states(m.project, m.run, sorted(steps))
        for step in sorted(steps):
            state = states.get(step)
            if state == LOCAL and not self.evict_unreplicated:
                continue  # the only durable copy of a step on its way to the store
            local_tier.evict(steps.pop(step))
            if state is not None:
                self.catalog.evicted(CheckpointRef(m.project, m.run, step), self.node)
            if room() >= need:
                return True
        return False

    def wait(self, timeout: float | None = None) -> dict[str, Any] | None:
        """Until the save in flight is committed at tier 0: its view (rank 0), or its error
        (raised on every rank). After `timeout` seconds: `Unfinished`, naming it (the save
        stays in flight)."""
        save = self.pending
        if save is None:
            return None
        assert save.thread is not None
        save.thread.join(timeout)
        if save.thread.is_alive():
            raise Unfinished(
                f"{save.ref}: its tier-0 commit (hashing, claim, commit) is still running after "
                f"{timeout:.3g} s",
                "its files are on the node; the next job's restore adopts the step",
            )
        self.pending = None
        if save.error is not None:
            if self.on_error == "raise":
                raise save.error
            self.gave_up(save.ref, save.error)
        return save.result

    def gave_up(self, ref: CheckpointRef, error: BaseException) -> None:
        """on_error="warn": a save that failed on every rank is recorded (`failures`) and said
        once, by rank 0; the loop goes on (the next save is a new attempt)."""
        self.failures.append({"step": ref.step, "error": str(error)})
        if ranks.current_rank() == 0:
            warnings.warn(f"reg: {ref} was not saved: {error}", stacklevel=4)

    def wait_replicated(self, timeout: float | None = None) -> None:
        """Until every save so far is in the store, or `timeout` seconds: then `Unfinished`,
        naming each copy still running and what it waits for."""
        left = [] if self._replicator is None else self._replicator.wait(timeout)
        if left:
            what = "; ".join(f"step {job.step}: {job.stage}" for job in left)
            raise Unfinished(
                f"copies to the store still running after {timeout:.3g} s ({what})",
                "they stay at tier 0; the next job's restore takes the copies over",
            )
        self.raise_failures()

    def raise_failures(self) -> None:
        """With on_error="raise": a copy to the store that failed for good, raised here."""
        if self._replicator is not None:
            self._replicator.raise_failures()

    def _finish(self, save: TierSave) -> None:
        """Every rank, in the background: hash, gather, claim (rank 0), move the step's
        directory into place, commit (rank 0), hand to the replicator. Every rank takes part in
        every collective whatever failed, or the others would wait."""
        try:
            self._finish_collectively(save)
        except BaseException as exc:  # a collective failed: a rank died, the group broke
            if save.error is None and save.result is None:
                save.error = RegistryError(f"saving {save.ref} at tier 0 failed: {exc}")

    def _finish_collectively(self, save: TierSave) -> None:
        mine: RankFiles | BaseException
        try:
            if save.future is not None:
                checked(save.future.result)
            mine = local_tier.hash_own(save.writer, self.node)
        except BaseException as exc:
            mine = exc if isinstance(exc, RegistryError) else RegistryError(f"save failed: {exc}")
        reports = self._every_rank(mine)
        failed = next((r for r in reports if isinstance(r, BaseException)), None)
        claimed = self._from_rank0(lambda: failed or self._claim(save))
        partial = save.writer.directory
        final = local_tier.step_dir(
            self.local_dir, save.ref.project, save.ref.run, save.ref.step or 0
        )
        leader = min(r.rank for r in reports if r.node == self.node) if failed is None else -1
        if isinstance(claimed, BaseException):
            if leader == ranks.current_rank() or failed is not None:
                local_tier.evict(partial)
            save.error = claimed
            return
        moved: RegistryError | None = None
        if leader == ranks.current_rank():  # this node's copy: where the catalog will say
            try:
                local_tier.evict(final)  # a leftover: the claim says no row has a copy there
                partial.rename(final)
            except OSError as exc:
                moved = RegistryError(f"{final}: {exc.strerror or exc}")
        moves = self._every_rank(moved)
        problem = next((m for m in moves if m is not None), None)
        got = self._from_rank0(lambda: self._commit(save, reports, claimed, final, problem))
        if isinstance(got, BaseException):
            save.error = got
            return
        view, token = got
        save.result = view
        self.newest_saved = save.ref.step
        assert isinstance(mine, RankFiles)
        try:
            if save.copy:
                self._replicate(save, final, mine, token)
        except Exception as exc:  # the step is committed at tier 0; its copy waits for a job
            message = f"reg: the copy of {save.ref} to the store did not start: {exc}"
            warnings.warn(message, stacklevel=1)
        self._evict(reports)

    def _every_rank(self, value: Any) -> list[Any]:
        """Every rank's `value`, on the manager's own group (a background thread)."""
        if not dist.is_initialized():
            return [value]
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, value, group=self.manager.save_group())
        return every

    def _from_rank0(self, call: Any) -> Any:
        """Rank 0's `call()` (a value or an error) on every rank, on the manager's group."""
        got: list[Any] = [None]
        if ranks.current_rank() == 0:
            try:
                got[0] = call()
            except RegistryError as exc:
                got[0] = exc
            except Exception as exc:
                got[0] = RegistryError(f"tier 0: {type(exc).__name__}: {exc}")
        if dist.is_initialized():
            dist.broadcast_object_list(got, src=0, group=self.manager.save_group())
        return got[0]

    def _claim(self, save: TierSave) -> Any:
        return self.catalog.claim(save.ref)

    def _commit(
        self,
        save: TierSave,
        reports: list[Any],
        shared: Any,
        final: Path,
        problem: RegistryError | None,
    ) -> Any:
        """Rank 0, holding the claim: the tier-0 commit; (view, replication token). A node
        that could not move its copy into place: the claim is given up, the error returned."""
        if problem is not None:
            self.catalog.give_up(shared)
            return problem
        try:
            files = [f for r in reports for f in r.files]
            persist = time.monotonic() - save.started
            costs = {
                "async": save.async_,
                "stall_seconds": round(save.stall, 4),
                "persist_seconds": round(persist, 4),
                "bytes": sum(f.size for f in files),
                "world_size": ranks.world_size(),
                "tier": 0,
                **({"tier0_only": True} if self.replicate and not save.copy else {}),
                "ranks": [
                    {
                        "rank": r.rank,
                        "node": r.node,
                        "files": len(r.files),
                        "bytes": r.bytes,
                        "seconds": round(r.write_seconds, 4),
                        "hash_seconds": round(r.hash_seconds, 4),
                    }
                    for r in sorted(reports, key=lambda r: r.rank)
                ],
            }
            view, token = self.catalog.commit_local(
                shared,
                files,
                directory=final,
                nodes=local_tier.nodes_of(reports),
                world_size=ranks.world_size(),
                metrics=save.metrics,
                costs=costs,
                upload_seconds=persist,
                held=save.copy,
            )
            return view | {"tier": 0}, token
        except RegistryError as exc:
            return exc
        except Exception as exc:
            return RegistryError(f"committing {save.ref} at tier 0 failed: {exc}")

    def _replicate(
        self, save: TierSave, final: Path, mine: RankFiles, token: tuple[int, str]
    ) -> None:

        claim = SharedClaim(save.ref, token[0], token[1])
        rank0 = ranks.current_rank() == 0
        self.replicator.submit(Job(claim, final, mine.files, manifest=rank0, commit=rank0))

    # -- eviction -------------------------------------------------------------------------------
    def _evict(self, reports: list[RankFiles]) -> None:
        """This node's first rank: drop the node's old copies (never the newest save)."""
        here = [r.rank for r in reports if r.node == self.node]
        if not here or min(here) != ranks.current_rank() or self.newest_saved is None:
            return
        try:
            self._evict_old()
        except Exception as exc:  # eviction never stops training
            warnings.warn(f"reg: evicting old tier-0 copies failed: {exc}", stacklevel=1)

    def _evict_old(self) -> None:
        m = self.manager
        steps = local_tier.local_steps(self.local_dir, m.project, m.run)
        assert self.newest_saved is not None
        older = sorted(s for s in steps if s < self.newest_saved)
        states = self.catalog.states(m.project, m.run, older)
        kept = sorted(steps)[-self.keep_local :]
        size = {s: _tree_bytes(steps[s]) for s in steps}
        total = sum(size.values())
        for step in older:
            over = self.budget is not None and total > self.budget
            if step in kept and not over:
                continue
            state = states.get(step)
            if state == LOCAL and not self.evict_unreplicated:
                continue  # its only durable copy, and the store's is on its way
            local_tier.evict(steps[step])
            total -= size[step]
            if state is not None:
                self.catalog.evicted(CheckpointRef(m.project, m.run, step), self.node)

    def copied(self, step: int) -> bool:
        """The copy of `step` to the store ended (or there is none to wait for)."""
        job = None if self._replicator is None else self._replicator.jobs.get(step)
        return job is None or job.done.is_set()

    def close(self) -> None:
        if self._replicator is not None:
            self._replicator.close()


def _rank_bytes(state: dict[str, Any]) -> int:
    """The bytes of this rank's tensors in `state` (a DTensor's local shard)."""
    flat, _ = flatten_state_dict(state)
    return sum(
        (v.to_local() if hasattr(v, "to_local") else v).nbytes
        for v in flat.values()
        if isinstance(v, torch.Tensor)
    )


def _tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
