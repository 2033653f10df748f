"""Restoring under `CheckpointManager(local_dir=...)`: `LocalTier.locate()` (tiered.py), here as
the methods of `TierRestore`, which `LocalTier` inherits, and `TieredStore`, what the restore
reads through.

`locate()` takes the newest step committed at some tier whose every file this job can read:
from each rank's own node where that node holds a verified copy, from the store otherwise.
A tier-0 step is read only at the world size it was saved at, and only if every node of the job
holds all of it (DCP stores a tensor every rank saves alike once, in one rank's file, so no
rank's files alone make a restore); otherwise it is skipped with a note saying why. Steps an
earlier job saved at tier 0 and died before copying are adopted: this job copies them.

Apart from tiered.py (the saving side: the tier-0 commit, the copy to the store, eviction): a
restore shares only the tier's settings, its catalog and its replicator with the saves.
"""

from __future__ import annotations

import os
import socket
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch.distributed as dist

from registry.core.layout import checkpoint_prefix
from registry.core.refs import CheckpointRef
from registry.core.timeutil import now
from registry.errors import IntegrityError, RegistryError
from registry.formats.documents import FileRecord
from registry.lifecycle.checkpoints.shared import SharedClaim
from registry.training import local_tier, ranks
from registry.training.replicator import Job, Replicator

if TYPE_CHECKING:
    from registry.api.contract import Registry
    from registry.training.tier_catalog import TierCatalog

ADOPT_WAIT_S = 150.0  # a restore waits this long at most for a dead job's copy claims to lapse


class TierOwner(Protocol):
    """What tier 0 reads of its `CheckpointManager`."""

    project: str
    run: str

    @property
    def registry(self) -> Registry: ...
    @property
    def thread_count(self) -> int: ...
    def save_group(self) -> Any:
        """The process group async saves' collectives run on."""


class TierRestore:
    """The restoring methods of `tiered.LocalTier`, which holds what they read (below)."""

    if TYPE_CHECKING:  # LocalTier's (tiered.py)
        manager: TierOwner
        local_dir: Path
        node: str
        replicate: bool
        notes: list[str]
        verify_seconds: float

        @property
        def catalog(self) -> TierCatalog: ...

        @property
        def replicator(self) -> Replicator: ...

        def wait(self) -> dict[str, Any] | None: ...

    def locate(self) -> tuple[int, Any, str, dict[str, str], list[str]] | None:
        """Every rank: (step, a store-like reader routing each file to this node's copy or the
        store, prefix, versions, notes) of the newest step this job can read; None if none."""
        m = self.manager
        self.verify_seconds = 0.0  # re-hashing the nodes' copies: a phase of its own
        try:
            self.wait()  # a save still in flight finishes first (its eviction included)
        except RegistryError as exc:
            warnings.warn(f"reg: the save in flight failed: {exc}", stacklevel=3)
        layout: list[Any] = [self.node]
        if dist.is_initialized():
            layout = [None] * dist.get_world_size()
            dist.all_gather_object(layout, self.node)
        chosen = self._choose(layout)
        # Steps an earlier job saved at tier 0 and died before copying: this job copies them.
        # Those newer than what it can read now are copied first, and read from the store.
        adopted = self._adopt(layout, -1 if chosen is None else chosen[0])
        newer = [j for j in adopted if chosen is None or j.step > chosen[0]]
        if newer:
            self._copy_now(newer)
            chosen = self._choose(layout)
        for job in adopted:
            if job not in newer:
                self.replicator.submit(job)
        if chosen is None:
            return None
        step, cand, usable, notes = chosen
        directory = local_tier.step_dir(self.local_dir, m.project, m.run, step)
        prefix = checkpoint_prefix(m.project, m.run, step)
        versions = {f[0]: f[4] for f in cand["files"] if f[4]}
        store = None  # a tier-0 step: nothing in the store
        if cand["state"] == "committed":
            store = self.catalog.store_for(m.project, m.run, step)
        reader = TieredStore(store, prefix, {p: directory / p for p in usable})
        return step, reader, prefix, versions, notes

    def _choose(self, layout: list[str]) -> tuple[int, dict[str, Any], set[str], list[str]] | None:
        """Every rank: the newest step this job can read (its candidate record and the files
        this rank reads from its node), with notes on the tier-0 steps it could not."""
        m = self.manager
        candidates = ranks.from_rank0(lambda: self.catalog.candidates(m.project, m.run))
        notes: list[str] = []
        self.notes = notes  # what the manager says (`resume_notes`) if nothing is found
        for cand in candidates:
            step = int(cand["step"])
            directory = local_tier.step_dir(self.local_dir, m.project, m.run, step)
            usable, note, gone = self._usable(cand, directory, layout)
            if note:
                notes.append(note)
            if gone and cand["state"] == "local":
                self._record_gone(step, gone)
            if usable is not None:
                return step, cand, usable, notes
        return None

    def _record_gone(self, step: int, nodes: list[str]) -> None:
        """Rank 0: these nodes of the job no longer hold a usable copy of tier-0 step `step`
        (its directory gone with a replaced disk, or damaged): the catalog records each copy
        evicted, and a step no node holds any more is lost (saving it again is a new attempt)."""
        if ranks.current_rank() != 0:
            return
        ref = CheckpointRef(self.manager.project, self.manager.run, step)
        for node in nodes:
            try:
                self.catalog.evicted(ref, node)
            except RegistryError as exc:
                warnings.warn(f"reg: recording that {node} lost {ref} failed: {exc}", stacklevel=1)

    def _copy_now(self, jobs: list[Job]) -> None:
        """Copy `jobs` to the store before the restore reads (every rank its share), then
        rank 0 commits each at tier 1; a failure on any rank leaves the step at tier 0."""
        now = Replicator(self.catalog, bytes_per_s=None, on_error="raise")
        for job in sorted(jobs, key=lambda j: j.step):
            problem: RegistryError | None = None
            try:
                now.copy(job, commit=False)
            except RegistryError as exc:
                problem = exc
            except Exception as exc:
                problem = RegistryError(f"copying {job.claim.ref} failed: {exc}")
            try:
                ranks.agree(problem)
                ranks.from_rank0(lambda job=job: self.catalog.commit_replicated(job.claim, 0.0))
            except RegistryError as exc:
                warnings.warn(f"reg: {exc}", stacklevel=1)

    def _adopt(self, layout: list[str], readable: int) -> list[Job]:
        """Take over the copy to the store of the run's tier-0 steps whose job died before it
        was done, where this job's nodes hold them: rank 0 takes each replication claim, and
        each node's ranks share the uploads of the node's files. A step newer than `readable`
        (the newest this job can read now) whose claim still looks held by another host (a job
        killed moments ago, its lease not yet run out) is waited for, at most ADOPT_WAIT_S."""

        if not self.replicate:
            return []
        m = self.manager

        def take() -> list[tuple[int, int, str, list[Any], dict[str, list[str]]]]:
            held_until = [
                s["live_until"]
                for s in self.catalog.stranded(m.project, m.run, live=True)
                if s["step"] > readable
                and tuple(s["holder"]) != (socket.gethostname(), os.getpid())
            ]
            if held_until and max(held_until) - now() < ADOPT_WAIT_S:
                time.sleep(max(0.0, max(held_until) - now()) + 1.0)
            taken = []
            for s in self.catalog.stranded(m.project, m.run, live=False):
                held = {p for files in s["nodes"].values() for p in files}
                if set(s["nodes"]) - set(layout) or held != {f[0] for f in s["files"]}:
                    continue  # a node that holds part of it is not in this job
                try:
                    shared = self.catalog.adopt(CheckpointRef(m.project, m.run, s["step"]))
                except RegistryError:  # another job took it, or its leftovers stay: later
                    continue
                taken.append((s["step"], shared.row_id, shared.token, s["files"], s["nodes"]))
            return taken

        peers = [r for r, node in enumerate(layout) if node == self.node]
        index = peers.index(ranks.current_rank())
        jobs = []
        for step, row_id, token, files, nodes in ranks.from_rank0(take):
            held = sorted(nodes.get(self.node, []))
            share = set(held[index :: len(peers)])
            records = [FileRecord(f[0], f[1], f[2], f[3]) for f in files if f[0] in share]
            claim = SharedClaim(CheckpointRef(m.project, m.run, step), row_id, token)
            directory = local_tier.step_dir(self.local_dir, m.project, m.run, step)
            manifest = index == 0 and local_tier.METADATA in held
            commit = ranks.current_rank() == 0
            jobs.append(Job(claim, directory, records, manifest, commit))
        return jobs

    def _usable(
        self, cand: dict[str, Any], directory: Path, layout: list[str]
    ) -> tuple[set[str] | None, str | None, list[str]]:
        """The files this rank reads from its node's copy (None: the step is not readable by
        this job), a note when a tier-0 copy could not be used, and the job's nodes whose
        recorded copy is gone or damaged."""
        step, world = cand["step"], ranks.world_size()
        records = {f[0]: (f[0], f[1], f[2]) for f in cand["files"]}
        same_world = cand["world_size"] == world
        held = cand["nodes"].get(self.node, []) if same_world else []
        peers = [r for r, node in enumerate(layout) if node == self.node]
        mine = sorted(held)[peers.index(ranks.current_rank()) :: len(peers)]
        hashing = time.monotonic()
        problems, wrong = local_tier.verify_local(
            directory, [records[p] for p in mine if p in records]
        )
        self.verify_seconds += time.monotonic() - hashing
        # What each rank verified, by file identity: a rank reads a file its peer verified
        # only if it is the same file (one directory per node, as node_id promises).
        seen = local_tier.file_ids(directory, mine)
        verdicts: list[Any] = [(self.node, problems, seen, wrong)]
        if dist.is_initialized():
            verdicts = [None] * dist.get_world_size()
            dist.all_gather_object(verdicts, (self.node, problems, seen, wrong))
        verified = {
            p: i for node, _, ids, _ in verdicts if node == self.node for p, i in ids.items()
        }
        gone = sorted({node for node, _, _, wrong in verdicts if wrong} & set(cand["nodes"]))
        mine_now = local_tier.file_ids(directory, held)
        if problems == [] and any(mine_now.get(p) != verified.get(p) for p in held):
            problems = [f"the ranks of node {self.node} do not share one local_dir"]
        if dist.is_initialized():  # again: a rank that found the directories differ says so
            dist.all_gather_object(verdicts, (self.node, problems, {}, wrong))
        else:
            verdicts = [(self.node, problems, {}, wrong)]
        damaged = {node: p for node, p, _, _ in verdicts if p}
        ok_here = self.node not in damaged and bool(held)
        local = set(held) if ok_here else set()
        if cand["state"] == "committed":
            return local, None, gone
        if not same_world:
            return (
                None,
                (
                    f"step {step} is at tier 0 only, saved at world size {cand['world_size']}: a "
                    f"restore at world size {world} reads the store, which does not hold it yet"
                ),
                gone,
            )
        for node in sorted(set(layout)):
            if node in damaged:
                return (
                    None,
                    (
                        f"step {step} is not yet in the store, and node {node}'s copy is gone or "
                        f"damaged ({damaged[node][0]})"
                    ),
                    gone,
                )
            lacking = sorted(set(records) - set(cand["nodes"].get(node, [])))
            if lacking:
                return (
                    None,
                    (
                        f"step {step} is not yet in the store, and node {node} does not hold "
                        f"{', '.join(lacking[:3])}{' ...' if len(lacking) > 3 else ''}"
                    ),
                    gone,
                )
        return local, None, gone


class TieredStore:
    """What a restore's StoreReader reads through: each file from this node's verified copy
    when it has one, from the store otherwise (None: a tier-0 step, nothing in the store)."""

    def __init__(self, store: Any, prefix: str, local: dict[str, Path]) -> None:
        self.store, self.prefix, self.local = store, prefix, local
        self.local_bytes = 0

    def _path(self, key: str) -> Path | None:
        path = self.local.get(key.removeprefix(self.prefix))
        if path is None and self.store is None:
            raise IntegrityError(f"{key}: no copy on this node and none in the store")
        return path

    def get_bytes(self, key: str, *, version: str | None = None) -> bytes:
        path = self._path(key)
        if path is None:
            return bytes(self.store.get_bytes(key, version=version))
        try:
            return path.read_bytes()  # `.metadata`: counted apart, as the store's reader does
        except OSError as exc:
            raise _unreadable(path, exc) from None

    def read_range(self, key: str, offset: int, length: int, *, version: str | None = None) -> Any:
        path = self._path(key)
        if path is None:
            return self.store.read_range(key, offset, length, version=version)
        data = bytearray(length)
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                got = f.readinto(data)
        except OSError as exc:
            raise _unreadable(path, exc) from None
        if got != length:
            raise IntegrityError(f"{path} is truncated", "restore again: it is skipped")
        self.local_bytes += length
        return data


def _unreadable(path: Path, exc: OSError) -> IntegrityError:
    return IntegrityError(
        f"{path}: {exc.strerror or exc} (the node's copy changed after it was verified)",
        "restore again",
    )
