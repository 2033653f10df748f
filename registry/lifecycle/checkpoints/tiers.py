"""Checkpoints at tiers: a training job's save is committed once every rank's files
are durable on its node's local disk (tier 0, `shared.commit_written(local=...)`: the row is
`local`), and a replicator copies it to the registry's store (tier 1) under a claim of its own.

The tier-1 commit is the claim protocol of DESIGN §3, not a shortcut around it: each writer
puts its files into the step's prefix (put-if-absent, hashed as written) and records them
(`shared.record_part`); the commit takes nothing on the writers' word alone: every file the
tier-0 commit recorded must be recorded by a writer with the same size and digest and be in the
store at that size, and the manifest object must hash to the digest recorded at tier 0. Only
then is the row `committed`: visible to pulls, promotion and retention, and mirrored.

    tiers_json(session, row)           which tiers hold a checkpoint, on which nodes
    missing_parts(ctx, claim)          files no writer has recorded yet, and the manifest
    commit_replicated(ctx, claim, s)   local -> committed
    claim_replication(ctx, ref)        take over the copy of a step whose replicator died
    copying(ctx, claim)                the claim is a copy's (the row is local), not a save's
    expected(ctx, claim, path)         what a copy's file must be: tier 0's size and sha256
    record_eviction(ctx, ref, node)    a node dropped its tier-0 copy (the last one: lost.py)
    restore_candidates(ctx, ref)       the newest steps a restore may read, with their copies
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

from sqlalchemy import update
from sqlmodel import col, select

from policies.access import Action
from registry.catalog import claims, queries
from registry.catalog.models import (
    COMMITTED,
    LOCAL,
    Checkpoint,
    CheckpointFile,
    CheckpointTier,
)
from registry.core.layout import MANIFEST, manifest_key
from registry.core.refs import CheckpointRef
from registry.core.timeutil import iso, now
from registry.errors import Conflict, IntegrityError
from registry.formats.documents import Manifest
from registry.lifecycle.checkpoints.commit import emit_committed, lift_resume_protection
from registry.lifecycle.checkpoints.lost import held_copies, lose_if_gone
from registry.lifecycle.checkpoints.shared import SharedClaim, check_listed, recorded_parts

if TYPE_CHECKING:
    from sqlmodel import Session

    from registry.lifecycle.context import Context

MAX_MANIFEST = 64 << 20  # a manifest's bytes at most (a copy's upload of it stops there)
MAX_CANDIDATES = 8  # tier-0 steps a restore looks at, newest first, above the newest stored
STORE = ""  # the node of the tier-1 row: the registry's store


def tiers_json(session: Session, row: Checkpoint) -> list[dict[str, Any]]:
    """`reg show`'s `tiers`: each copy of the checkpoint, tier 0 per node, then the store. A
    checkpoint pushed from a directory is at tier 1 only."""
    copies = session.exec(
        select(CheckpointTier)
        .where(CheckpointTier.checkpoint_id == row.id)
        .order_by(col(CheckpointTier.tier), col(CheckpointTier.node))
    ).all()
    out = [
        {
            "tier": c.tier,
            "node": c.node or None,
            "ranks": list(c.ranks),
            "files": row.file_count if c.tier == 1 else len(c.files),
            "bytes": c.bytes,
            "at": iso(c.at),
            "seconds": c.seconds,
            "held": c.evicted_at is None and (c.tier == 0 or row.state == COMMITTED),
            "evicted_at": iso(c.evicted_at),
        }
        for c in copies
    ]
    if row.state == COMMITTED and not any(c.tier == 1 for c in copies):
        out.append(
            {
                "tier": 1,
                "node": None,
                "ranks": [],
                "files": row.file_count,
                "bytes": row.bytes,
                "at": iso(row.committed_at),
                "seconds": row.upload_seconds,
                "held": True,
                "evicted_at": None,
            }
        )
    return out


def missing_parts(ctx: Context, shared: SharedClaim) -> list[str]:
    """The files of a tier-0 step that no writer has recorded in the store yet, and MANIFEST
    while its manifest is not in the store either (what a copy still has to put)."""
    with ctx.catalog.session() as s:
        files = queries.files_of(s, shared.row_id)
    recorded, _ = recorded_parts(ctx, shared)
    have = {r.path for r in recorded}
    missing = sorted(f.path for f in files if f.path not in have)
    ref = shared.ref
    if ctx.store.head(manifest_key(ref.project, ref.run, ref.step or 0)) is None:
        missing.append(MANIFEST)
    return missing


def commit_replicated(ctx: Context, shared: SharedClaim, seconds: float) -> dict[str, Any]:
    """The step is in the store: every file as tier 0 recorded it, and its manifest. Commits
    it at tier 1 (`local` -> `committed`), only while the replication claim is ours."""
    ref = shared.ref
    with ctx.catalog.session() as s:
        row = s.get(Checkpoint, shared.row_id)
        files = queries.files_of(s, shared.row_id)
    if row is None or row.state != LOCAL:
        raise Conflict(f"{ref} is not waiting for its copy to the store", "check `reg show`")
    recorded, keys = recorded_parts(ctx, shared)
    by_path = {r.path: r for r in recorded}
    missing = sorted(f.path for f in files if f.path not in by_path)
    if missing:
        raise IntegrityError(
            f"{ref}: {len(missing)} file(s) were not copied to the store "
            f"({', '.join(missing[:5])})",
            "the replicator of the node that holds them did not finish; it retries",
        )
    for f in files:
        got = by_path[f.path]
        if (got.size, got.sha256) != (f.size, f.sha256):
            raise IntegrityError(
                f"{ref}: the store's copy of {f.path} is not the file tier 0 recorded "
                f"({got.size} bytes, sha256 {got.sha256[:12]}; recorded {f.size} bytes, "
                f"{f.sha256[:12]})",
                "the node's local copy changed after the save; it is not replicated",
            )
    check_listed(ctx, shared, {f.path: f.size for f in files})
    key = manifest_key(ref.project, ref.run, ref.step or 0)
    info = ctx.store.head(key)
    data = bytes(ctx.store.get_bytes(key, version=info.version_id if info else None))
    if hashlib.sha256(data).hexdigest() != row.manifest_sha256:
        raise IntegrityError(
            f"{ref}: the manifest in the store is not the one recorded at tier 0",
            "the replicator retries the copy",
        )
    manifest = Manifest.from_bytes(data, key)
    with ctx.catalog.session(write=True) as s:
        done = claims.guarded_update(
            s,
            shared.catalog_claim(),
            state=COMMITTED,
            manifest_version=info.version_id if info else None,
            claim_token=None,
            lease_until=None,
        )
        if not done:
            raise Conflict(
                f"lost the claim on the copy of {ref} to the store (another replicator took it)",
                "check `reg show`",
            )
        s.add(
            CheckpointTier(
                checkpoint_id=shared.row_id,
                tier=1,
                node=STORE,
                ranks=sorted({f.rank for f in files if f.rank is not None}),
                files=[],
                bytes=row.bytes,
                at=now(),
                seconds=round(seconds, 4),
            )
        )
        lift_resume_protection(s, ref)
        emit_committed(ctx, s, manifest, row.manifest_sha256 or "")
        ctx.audit(s, "replicate", str(ref), bytes=row.bytes, files=len(files), tier=1)
    for k in keys:  # the writers' records served their purpose
        ctx.store.delete(k)
    with ctx.catalog.session() as s:
        committed = s.get(Checkpoint, shared.row_id)
        assert committed is not None
        return {"ref": str(ref), "state": committed.state, "tiers": tiers_json(s, committed)}


def copying(ctx: Context, shared: SharedClaim) -> bool:
    """`shared` is the claim on a tier-0 step's copy to the store (not a pending save's)."""
    with ctx.catalog.session() as s:
        row = s.get(Checkpoint, shared.row_id)
    return row is not None and row.state == LOCAL and row.claim_token == shared.token


def expected(ctx: Context, shared: SharedClaim, path: str) -> tuple[int, str] | None:
    """(size, sha256) the tier-0 commit recorded for `path` (MANIFEST: the manifest, at most
    MAX_MANIFEST bytes); None for a path it did not record: its copy puts nothing else."""
    with ctx.catalog.session() as s:
        if path == MANIFEST:
            row = s.get(Checkpoint, shared.row_id)
            digest = None if row is None else row.manifest_sha256
            return None if digest is None else (MAX_MANIFEST, digest)
        found = s.exec(
            select(CheckpointFile).where(
                CheckpointFile.checkpoint_id == shared.row_id, CheckpointFile.path == path
            )
        ).first()
        return None if found is None else (found.size, found.sha256)


def claim_replication(ctx: Context, ref: CheckpointRef) -> SharedClaim:
    """Take over the copy to the store of a tier-0 step whose replicator died (its claim ran
    out); what that replicator had put under the prefix is deleted first."""
    ctx.authorize(Action.PUSH, project=ref.project, target=str(ref))
    with ctx.catalog.session(write=True) as s:
        _, row = queries.resolve_checkpoint(s, ref, local=True)
        if row.state != LOCAL:
            raise Conflict(f"{ref} is already in the store", "nothing to replicate")
        if claims.is_live(row):
            raise Conflict(
                f"{ref} is being copied to the store {claims.holder(row)}",
                "wait for that copy, or until its lease runs out",
            )
        taken = claims.take_over(s, row)
        if taken is None:
            raise Conflict(f"another replicator took {ref} first", "check `reg show`")
        if ctx.server:  # held by a job through the server: its lease alone says so
            claims.guarded_update(s, taken, claim_pid=None)
    shared = SharedClaim(ref, taken.row_id, taken.token)
    # In batches, under the new claim's lease: what the dead copy put goes before ours starts.
    _, failed = ctx.store.delete_many([info.key for info in ctx.store.list(shared.prefix)])
    if failed:
        key, why = next(iter(failed.items()))
        raise IntegrityError(f"{ref}: could not clear {key} ({why})", "adopt the copy again")
    return shared


def record_eviction(ctx: Context, ref: CheckpointRef, node: str) -> None:
    """`node` deleted its tier-0 copy of `ref`."""
    ctx.authorize(Action.PUSH, project=ref.project, target=str(ref))
    with ctx.catalog.session(write=True) as s:
        run = queries.find_run(s, ref.project, ref.run)
        if run is None:
            return
        row = s.exec(
            select(Checkpoint).where(Checkpoint.run_id == run.id, Checkpoint.step == ref.step)
        ).first()
        if row is None:
            return
        done = s.exec(
            update(CheckpointTier)
            .where(
                col(CheckpointTier.checkpoint_id) == row.id,
                col(CheckpointTier.tier) == 0,
                col(CheckpointTier.node) == node,
                col(CheckpointTier.evicted_at).is_(None),
            )
            .values(evicted_at=now())
        )
        if done.rowcount:  # who said the node dropped it is recorded
            ctx.audit(s, "evict-tier0", str(ref), node=node, state=row.state)
            lose_if_gone(ctx, s, row, ref)


def restore_candidates(ctx: Context, project: str, run: str) -> list[dict[str, Any]]:
    """The steps a restore may read, newest first: tier-0 steps and the newest step in the
    store (where the list ends: it can always be read). Each with its world size, its files
    (path, size, sha256, rank) and the nodes still holding a tier-0 copy (node -> files)."""
    ctx.authorize_read(project=project)
    out: list[dict[str, Any]] = []
    with ctx.catalog.session() as s:
        found = queries.find_run(s, project, run)
        if found is None:
            return out
        stored = s.exec(
            select(Checkpoint)
            .where(Checkpoint.run_id == found.id, Checkpoint.state == COMMITTED)
            .order_by(col(Checkpoint.step).desc())
        ).first()
        newer = s.exec(
            select(Checkpoint)
            .where(
                Checkpoint.run_id == found.id,
                Checkpoint.state == LOCAL,
                col(Checkpoint.step) > (stored.step if stored is not None else -1),
            )
            .order_by(col(Checkpoint.step).desc())
            .limit(MAX_CANDIDATES)
        ).all()
        for row in [*newer, *([stored] if stored is not None else [])]:
            out.append(
                {
                    "step": row.step,
                    "state": row.state,
                    "world_size": row.world_size,
                    "files": [
                        (f.path, f.size, f.sha256, f.rank, f.version)
                        for f in queries.files_of(s, row.id or 0)
                    ],
                    "nodes": held_copies(s, row.id or 0),
                }
            )
    return out


TIER0_ONLY = "tier0_only"  # a local step the manager never copies (`replicate_every`)


def is_tier0_only(row: Checkpoint) -> bool:
    return (
        row.state == LOCAL
        and isinstance(row.save_costs, dict)
        and bool(row.save_costs.get(TIER0_ONLY))
    )


def step_states(ctx: Context, project: str, run: str, steps: list[int]) -> dict[int, str]:
    """The catalog state of each of `steps` of the run that has a row (TIER0_ONLY for a local
    step that is never copied to the store)."""
    ctx.authorize_read(project=project)
    if not steps:
        return {}
    with ctx.catalog.session() as s:
        found = queries.find_run(s, project, run)
        if found is None:
            return {}
        rows = s.exec(
            select(Checkpoint).where(Checkpoint.run_id == found.id, col(Checkpoint.step).in_(steps))
        ).all()
        return {row.step: TIER0_ONLY if is_tier0_only(row) else row.state for row in rows}


def stranded(ctx: Context, project: str, run: str, *, live: bool = False) -> list[dict[str, Any]]:
    """The run's tier-0 steps whose copy to the store nobody is making (the job that saved
    them died): each with its files (path, size, sha256, rank) and the nodes holding a copy.
    `live`: instead, those whose copy's claim is still held (`live_until`: its lease). A step
    saved never to be copied (`replicate_every`) is not stranded."""
    ctx.authorize_read(project=project)
    out: list[dict[str, Any]] = []
    with ctx.catalog.session() as s:
        found = queries.find_run(s, project, run)
        if found is None:
            return out
        rows = s.exec(
            select(Checkpoint)
            .where(Checkpoint.run_id == found.id, Checkpoint.state == LOCAL)
            .order_by(col(Checkpoint.step))
        ).all()
        for row in rows:
            if claims.is_live(row) != live or is_tier0_only(row):
                continue
            out.append(
                {
                    "live_until": row.lease_until,
                    "holder": (row.claim_host, row.claim_pid),
                    "step": row.step,
                    "files": [
                        (f.path, f.size, f.sha256, f.rank) for f in queries.files_of(s, row.id or 0)
                    ],
                    "nodes": held_copies(s, row.id or 0),
                }
            )
    return out
