"""A checkpoint's key paths, kept in the catalog, and the resume verdict decided from them.

Push records what the checkpoint is (every DCP key path, the files beside the shards, its layout:
`KeyFacts`); whether it is resumable is decided each time it matters (show, ls, validate,
promote) under the policy in force (`verdict`), so fixing the policy after a push fixes every
answer at once. Verdicts are cached per key set, layout and resume policy: the steps of a run
share one key set, so `reg ls` classifies each distinct set once.

A checkpoint committed before the catalog kept key paths gets them once, from its stored
`.metadata` proven against the catalog's digest (`facts_of_checkpoint`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

from policies.layouts import check_layout, detect
from policies.resume import ResumeVerdict, classify, missing_from_heads

if TYPE_CHECKING:
    from policies.loader import ResumePolicy
    from registry.catalog.models import Checkpoint
    from registry.context import Context
    from registry.formats.dcp import Inventory
    from registry.formats.documents import FileRecord, ResumeRecord
    from registry.refs import CheckpointRef

_CACHE: dict[tuple[str, str, str], ResumeVerdict] = {}
_MISSING: dict[tuple[str, str, str], list[str]] = {}  # `reg ls`: the missing classes alone
_CACHE_SIZE = 512


@dataclass(frozen=True)
class KeyFacts:
    keys: tuple[str, ...]  # every DCP key path, sorted
    sidecars: tuple[str, ...]  # files beside the shards and .metadata (Lightning's meta.pt)
    layout: str  # as pushed: detected, or forced with --layout

    @cached_property
    def sha256(self) -> str:
        body = json.dumps({"keys": self.keys, "sidecars": self.sidecars}, separators=(",", ":"))
        return hashlib.sha256(body.encode()).hexdigest()

    def record(self, policy: ResumePolicy) -> ResumeRecord:
        """For MANIFEST.json: these facts, and the verdict at push for the record."""
        from registry.formats.documents import ResumeRecord

        v = verdict(self, policy)
        return ResumeRecord(
            v.classes, v.missing, v.resumable, v.unclassified, self.layout, self.keys, self.sidecars
        )


def facts_of(inv: Inventory, files: Iterable[str], layout: str | None = None) -> KeyFacts:
    """The key paths of a checkpoint's inventory; its sidecars are the files that are neither
    `.metadata` nor a shard the metadata names."""
    from registry.formats.dcp import METADATA

    keys = tuple(sorted({*inv.tensors, *inv.byte_items}))
    sidecars = tuple(sorted(p for p in files if p != METADATA and p not in inv.files))
    chosen = check_layout(layout) or detect(keys, sidecars).name
    return KeyFacts(keys, sidecars, chosen)


def verdict(facts: KeyFacts, policy: ResumePolicy, layout: str | None = None) -> ResumeVerdict:
    """The resume verdict under `policy`, with the pushed layout unless `layout` forces one."""
    chosen = check_layout(layout) or facts.layout
    found = _CACHE.get((facts.sha256, chosen, _policy_key(policy)))
    if found is None:
        found = classify(facts.keys, facts.sidecars, policy, chosen)
        if len(_CACHE) >= _CACHE_SIZE:
            _CACHE.pop(next(iter(_CACHE)))
        _CACHE[(facts.sha256, chosen, _policy_key(policy))] = found
    return found


def missing_of(
    sha256: str,
    layout: str,
    policy: ResumePolicy,
    summary: tuple[list[str], list[str], list[str]],
    keys: Callable[[], Sequence[str]],
) -> list[str]:
    """The required classes a key set lacks under `policy` (for `reg ls`): from the verdict
    this process already made, else from the set's (heads, optimizer roots, sidecars), else
    from its keys (`keys()` reads them)."""
    key = (sha256, layout, _policy_key(policy))
    found = _CACHE.get(key)
    if found is not None:
        return found.missing
    missing = _MISSING.get(key)
    if missing is None:
        key_heads, roots, sidecars = summary
        missing = missing_from_heads(key_heads, roots, sidecars, policy, layout)
        if missing is None:
            missing = verdict(KeyFacts(tuple(keys()), tuple(sidecars), layout), policy).missing
        if len(_MISSING) >= _CACHE_SIZE * 8:
            _MISSING.pop(next(iter(_MISSING)))
        _MISSING[key] = missing
    return missing


def _policy_key(policy: ResumePolicy) -> str:
    return policy.model_dump_json()


def resume_json(
    ctx: Context, ref: CheckpointRef, ckpt: Checkpoint, files: Sequence[FileRecord]
) -> dict[str, Any]:
    """`reg show`'s resume fields, decided now; a collected checkpoint committed before the
    catalog kept key paths answers with what was decided at its push."""
    from registry.catalog.models import COMMITTED
    from registry.errors import RegistryError

    try:
        facts = facts_of_checkpoint(ctx, ref, ckpt, files)
    except RegistryError:
        if ckpt.state == COMMITTED:
            raise
        return {
            "layout": None,
            "resumable": ckpt.resumable,
            "missing_state": list(ckpt.missing_state),
            "resume_state": ckpt.resume_classes,
            "unclassified": [],
            "warnings": ["decided at push: its key paths were not recorded"],
        }
    return fields(facts, ctx.policy.resume)


def fields(facts: KeyFacts, policy: ResumePolicy, layout: str | None = None) -> dict[str, Any]:
    """The verdict as commands show it (--json): layout, resumable, missing_state,
    resume_state, unclassified, warnings, and suggestions for what was not placed."""
    from policies.resume import suggest

    v = verdict(facts, policy, layout)
    return {**v.to_json(), "suggestions": suggest(facts.keys, facts.sidecars, policy, v)}


def save(session: object, checkpoint_id: int, facts: KeyFacts) -> None:
    """Record `facts` for a checkpoint being committed (in the caller's transaction): the key
    set is shared with every checkpoint that has the same one."""
    from sqlalchemy.exc import IntegrityError
    from sqlmodel import Session, select

    from policies.resume import heads, optimizer_roots
    from registry.catalog.models import CheckpointKeys, KeySet

    assert isinstance(session, Session)
    found = session.exec(select(KeySet.id).where(KeySet.sha256 == facts.sha256)).first()
    if found is None:
        try:
            with session.begin_nested():
                row = KeySet(
                    sha256=facts.sha256,
                    key_count=len(facts.keys),
                    keys=list(facts.keys),
                    sidecars=list(facts.sidecars),
                    heads=heads(facts.keys),
                    optimizer_roots=optimizer_roots(facts.keys),
                )
                session.add(row)
            found = row.id
        except IntegrityError:  # another commit added the same set meanwhile
            found = session.exec(select(KeySet.id).where(KeySet.sha256 == facts.sha256)).one()
    assert found is not None
    session.add(CheckpointKeys(checkpoint_id=checkpoint_id, key_set_id=found, layout=facts.layout))


def emit_changes(ctx: Context, session: object, old: ResumePolicy, new: ResumePolicy) -> int:
    """A policy change: a `checkpoint.resume` event for every committed checkpoint whose verdict
    it changes (each distinct key set classified once under each policy). Returns how many."""
    from sqlmodel import Session, col, select

    from registry import events
    from registry.catalog.models import COMMITTED, Checkpoint, CheckpointKeys, KeySet, Project, Run
    from registry.refs import CheckpointRef

    assert isinstance(session, Session)
    if old == new:
        return 0
    projects = {p.id: p.name for p in session.exec(select(Project)).all()}
    rows = session.exec(
        select(Run, Checkpoint.step, CheckpointKeys.layout, KeySet)
        .join(Checkpoint, col(Checkpoint.run_id) == Run.id)
        .join(CheckpointKeys, col(CheckpointKeys.checkpoint_id) == Checkpoint.id)
        .join(KeySet, col(KeySet.id) == CheckpointKeys.key_set_id)
        .where(Checkpoint.state == COMMITTED)
    ).all()
    count = 0
    for run_row, step, layout, key_set in rows:
        project, run = projects[run_row.project_id], run_row.name
        facts = KeyFacts(tuple(key_set.keys), tuple(key_set.sidecars), layout)
        before, after = verdict(facts, old), verdict(facts, new)
        if (before.resumable, before.missing, before.layout) == (
            after.resumable,
            after.missing,
            after.layout,
        ):
            continue
        ref = CheckpointRef(project, run, step)
        ctx.events.emit(
            session,
            events.CHECKPOINT_RESUME,
            project=project,
            ref=str(ref),
            resumable=after.resumable,
            missing_state=after.missing,
            layout=after.layout,
        )
        count += 1
    return count


def facts_of_checkpoint(
    ctx: Context, ref: CheckpointRef, ckpt: Checkpoint, files: Sequence[FileRecord]
) -> KeyFacts:
    """The recorded facts of a committed checkpoint; for one committed before the catalog kept
    them, read once from its `.metadata` (proven against the catalog's sha256) and recorded."""
    from sqlmodel import col, select

    from registry.catalog.models import CheckpointKeys, KeySet

    with ctx.catalog.session() as s:
        row = s.exec(
            select(KeySet.keys, KeySet.sidecars, CheckpointKeys.layout)
            .join(CheckpointKeys, col(CheckpointKeys.key_set_id) == KeySet.id)
            .where(CheckpointKeys.checkpoint_id == ckpt.id)
        ).first()
    if row is not None:
        return KeyFacts(tuple(row[0]), tuple(row[1]), row[2])
    facts = _from_stored_metadata(ctx, ref, ckpt, files)
    from sqlalchemy.exc import IntegrityError

    try:
        with ctx.catalog.session(write=True) as s:
            save(s, ckpt.id or 0, facts)
    except IntegrityError:
        pass  # recorded by a concurrent reader: the same facts
    return facts


def _from_stored_metadata(
    ctx: Context, ref: CheckpointRef, ckpt: Checkpoint, files: Sequence[FileRecord]
) -> KeyFacts:
    from registry.errors import IntegrityError
    from registry.formats.dcp import METADATA, inventory
    from registry.formats.dcp_metadata import load_metadata
    from registry.layout import checkpoint_prefix

    record = next((f for f in files if f.path == METADATA), None)
    prefix = checkpoint_prefix(ref.project, ref.run, ckpt.step)
    data = ctx.store.get_bytes(prefix + METADATA, version=record.version if record else None)
    if record is None or hashlib.sha256(data).hexdigest() != record.sha256:
        raise IntegrityError(
            f"{prefix}{METADATA} does not match the catalog's sha256",
            "run `reg verify` on the checkpoint",
        )
    inv = inventory(load_metadata(data, light=True))
    return facts_of(inv, [f.path for f in files])
