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
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

from policies.layouts import check_layout, detect, known_layout
from policies.resume import (
    ResumeVerdict,
    classify,
    heads,
    missing_from_heads,
    optimizer_roots,
    suggest,
)
from registry.core.layout import checkpoint_prefix
from registry.errors import IntegrityError, RegistryError
from registry.formats import deepspeed_root, file_roots, sidecars
from registry.formats.dcp import inventory
from registry.formats.dcp_roots import metadata_paths, stored_metadata
from registry.formats.documents import ResumeRecord
from registry.storage.verified_stream import verified_ends, verified_root

if TYPE_CHECKING:
    from policies.loader import ResumePolicy
    from registry.catalog.models import Checkpoint
    from registry.core.refs import CheckpointRef
    from registry.formats.dcp import Inventory
    from registry.formats.documents import FileRecord, ResumeRecord
    from registry.lifecycle.context import Context
    from registry.storage.base import BaseStore

_LOCK = threading.Lock()
_CACHE: dict[tuple[str, str, str], ResumeVerdict] = {}
_MISSING: dict[tuple[str, str, str], list[str]] = {}  # `reg ls`: the missing classes alone
_CACHE_SIZE = 512


@dataclass(frozen=True)
class KeyFacts:
    keys: tuple[str, ...]  # every DCP key path, sorted
    # the files beside the shards and .metadata, and what reg read in them (Lightning's meta.pt:
    # "meta.pt", "meta.pt:", "meta.pt:global_step", ...; registry/formats/sidecars.py)
    sidecars: tuple[str, ...]
    layout: str  # as pushed: detected, or forced with --layout

    @cached_property
    def sha256(self) -> str:
        body = json.dumps({"keys": self.keys, "sidecars": self.sidecars}, separators=(",", ":"))
        return hashlib.sha256(body.encode()).hexdigest()

    def record(self, policy: ResumePolicy) -> ResumeRecord:
        """For MANIFEST.json: these facts, and the verdict at push for the record."""
        v = verdict(self, policy)
        return ResumeRecord(
            v.classes, v.missing, v.resumable, v.unclassified, self.layout, self.keys, self.sidecars
        )


def facts_of(
    inv: Inventory,
    files: Mapping[str, int],
    read: Callable[[str], bytes],
    layout: str | None = None,
    read_ends: sidecars.ReadEnds | None = None,
) -> KeyFacts:
    """The key paths of a checkpoint's inventory; its sidecars are the files (path -> size)
    that are neither a `.metadata` nor a shard the metadata names, with what reg reads in them
    through `read(path)` and `read_ends` (bytes the caller vouches for)."""
    metadata = set(metadata_paths(files))
    beside = [  # DeepSpeed's model states are a root, and hold the step, scheduler, world size
        p
        for p in files
        if (p in metadata and deepspeed_root.is_model_states(p))
        or (p not in metadata and p not in inv.files)
    ]
    entries = tuple(sorted(sidecars.entries(beside, dict(files), read, read_ends)))
    keys = key_paths(inv)
    chosen = check_layout(layout) or detect(keys, entries).name
    return KeyFacts(keys, entries, chosen)


def key_paths(inv: Inventory) -> tuple[str, ...]:
    return tuple(sorted({*inv.tensors, *inv.byte_items}))


def verdict(facts: KeyFacts, policy: ResumePolicy, layout: str | None = None) -> ResumeVerdict:
    """The resume verdict under `policy`, with the pushed layout unless `layout` forces one (a
    recorded layout this reg does not know, from a newer one, is detected again)."""
    chosen = check_layout(layout) or known_layout(facts.layout)
    key = (facts.sha256, chosen or "", _policy_key(policy))
    found = _CACHE.get(key)
    if found is None:
        found = classify(facts.keys, facts.sidecars, policy, chosen)
        _remember(_CACHE, key, found, _CACHE_SIZE)
    return found


def _remember(cache: dict[Any, Any], key: Any, value: Any, size: int) -> None:
    """Bounded, and safe when server threads evict at once."""
    with _LOCK:
        while len(cache) >= size:
            cache.pop(next(iter(cache)), None)
        cache[key] = value


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
        if known_layout(layout):
            missing = missing_from_heads(key_heads, roots, sidecars, policy, layout)
        if missing is None:
            missing = verdict(KeyFacts(tuple(keys()), tuple(sidecars), layout), policy).missing
        _remember(_MISSING, key, missing, _CACHE_SIZE * 8)
    return missing


def _policy_key(policy: ResumePolicy) -> str:
    return policy.model_dump_json()


def resume_json(
    ctx: Context,
    ref: CheckpointRef,
    ckpt: Checkpoint,
    files: Sequence[FileRecord],
    *,
    full: bool = True,
) -> dict[str, Any]:
    """The resume fields commands show, decided now under the policy in force.

    `full` (`reg show`): with suggestions; a checkpoint committed before the catalog kept key
    paths is decided from its `.metadata` (proven; an error if that cannot be had, except for a
    collected checkpoint). Otherwise (pull, pin, the server's listings of files): from recorded
    key paths only, without suggestions, no store read; a checkpoint without them answers with
    what was decided at its push, and says so."""
    from registry.catalog.models import COMMITTED

    if not full:
        facts = recorded_facts(ctx, ref, ckpt)
        if facts is None:
            return _push_time(ckpt, "`reg catalog migrate` records them")
        return fields(facts, ctx.policy.resume, suggestions=False)
    try:
        facts = facts_of_checkpoint(ctx, ref, ckpt, files)
    except RegistryError as exc:
        if ckpt.state == COMMITTED:
            raise
        return _push_time(ckpt, exc.message)
    return fields(facts, ctx.policy.resume)


def _push_time(ckpt: Checkpoint, why: str) -> dict[str, Any]:
    return {
        "layout": None,
        "resumable": ckpt.resumable,
        "missing_state": list(ckpt.missing_state),
        "resume_state": ckpt.resume_classes,
        "unclassified": [],
        "warnings": [f"decided at push: its key paths are not recorded ({why})"],
    }


def fields(
    facts: KeyFacts, policy: ResumePolicy, layout: str | None = None, *, suggestions: bool = True
) -> dict[str, Any]:
    """The verdict as commands show it (--json): layout, resumable, missing_state,
    resume_state, unclassified, warnings, and suggestions for what was not placed."""
    v = verdict(facts, policy, layout)
    out = v.to_json()
    if suggestions:
        out["suggestions"] = suggest(facts.keys, facts.sidecars, policy, v)
    return out


def save(session: object, checkpoint_id: int, facts: KeyFacts) -> None:
    """Record `facts` for a checkpoint being committed (in the caller's transaction): the key
    set is shared with every checkpoint that has the same one."""
    from sqlalchemy.exc import IntegrityError
    from sqlmodel import Session

    from registry.catalog.models import CheckpointKeys, KeySet

    assert isinstance(session, Session)
    found = _existing_set(session, facts)
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
            found = _existing_set(session, facts)
    assert found is not None
    session.add(CheckpointKeys(checkpoint_id=checkpoint_id, key_set_id=found, layout=facts.layout))


def _existing_set(session: Any, facts: KeyFacts) -> int | None:
    """The id of the key set `facts` names, checked to hold exactly these keys: a row under
    that sha256 with other keys was written by someone other than reg (the key paths are
    content-addressed and never change), and nothing is linked to it."""
    from sqlmodel import select

    from registry.catalog.models import KeySet

    row = session.exec(select(KeySet).where(KeySet.sha256 == facts.sha256)).first()
    if row is None:
        return None
    if tuple(row.keys) != facts.keys or tuple(row.sidecars) != facts.sidecars:
        raise IntegrityError(
            f"catalog key_set {row.id} does not hold the key paths its sha256 names",
            "the catalog was changed outside reg: run `reg audit verify` and tell an admin",
        )
    return int(row.id or 0)


def facts_of_checkpoint(
    ctx: Context,
    ref: CheckpointRef,
    ckpt: Checkpoint,
    files: Sequence[FileRecord],
    *,
    record: bool = False,
) -> KeyFacts:
    """The recorded facts of a committed checkpoint; for one committed before the catalog kept
    them, read from its `.metadata` (proven against the catalog's sha256), and recorded when
    `record` (commands that write anyway: validate, promote; reads never take the write lock)."""
    facts = recorded_facts(ctx, ref, ckpt)
    if facts is not None and record and ctx.server:
        # Behind the server the key paths decide a gate (resumability), and their rows could
        # have been written around it: proven again from the stored, digest-checked .metadata.
        from registry.errors import IntegrityError

        stored = from_stored_metadata(ctx, ref, ckpt, files)
        if stored.sha256 != facts.sha256:
            raise IntegrityError(
                f"{ref}: the catalog's key paths are not those of its stored .metadata",
                "the catalog was changed outside reg: run `reg audit verify` and tell an admin",
            )
    if facts is not None:
        return facts
    facts = from_stored_metadata(ctx, ref, ckpt, files)
    if record:
        record_facts(ctx, ckpt.id or 0, facts)
    return facts


def recorded_facts(ctx: Context, ref: CheckpointRef, ckpt: Checkpoint) -> KeyFacts | None:
    """The key paths the catalog holds for `ckpt` (checked against their sha256), or None."""
    from sqlmodel import col, select

    from registry.catalog.models import CheckpointKeys, KeySet

    with ctx.catalog.session() as s:
        row = s.exec(
            select(KeySet, CheckpointKeys.layout)
            .join(CheckpointKeys, col(CheckpointKeys.key_set_id) == KeySet.id)
            .where(CheckpointKeys.checkpoint_id == ckpt.id)
        ).first()
    if row is None:
        return None
    key_set, layout = row
    facts = KeyFacts(tuple(key_set.keys), tuple(key_set.sidecars), layout)
    if facts.sha256 != key_set.sha256:
        raise IntegrityError(
            f"{ref}: the catalog's key paths (key_set {key_set.id}) do not match their sha256",
            "the catalog was changed outside reg: run `reg audit verify` and tell an admin",
        )
    return facts


def record_facts(ctx: Context, checkpoint_id: int, facts: KeyFacts) -> bool:
    """Record the key paths of a checkpoint committed before the catalog kept them; best
    effort (a reader without write access, a locked catalog, a concurrent reader recording the
    same): whether they are recorded now."""
    from sqlalchemy.exc import SQLAlchemyError

    try:
        with ctx.catalog.session(write=True) as s:
            save(s, checkpoint_id, facts)
        return True
    except (SQLAlchemyError, RegistryError):
        return False


def proven_reader(
    store: BaseStore, prefix: str, files: Sequence[FileRecord]
) -> Callable[[str], bytes]:
    """Reads a stored file of a checkpoint whole (at its recorded version), refused unless it
    holds the bytes the catalog recorded; of a safetensors model file, its header."""
    records = {f.path: f for f in files}

    def read(path: str) -> bytes:
        record = records[path]
        if file_roots.is_root_name(path):
            return verified_root(store, prefix, path, **_recorded(prefix, record))
        data = bytes(store.get_bytes(prefix + path, version=record.version))
        if len(data) != record.size or hashlib.sha256(data).hexdigest() != record.sha256:
            raise IntegrityError(
                f"{prefix}{path} does not match the catalog's sha256",
                "run `reg verify` on the checkpoint",
            )
        return data

    return read


def proven_ends(store: BaseStore, prefix: str, files: Sequence[FileRecord]) -> sidecars.ReadEnds:
    """A stored file's first and last bytes (a large sidecar's), proven by one pass over it."""
    records = {f.path: f for f in files}

    def read_ends(path: str, head: int, tail: int) -> tuple[bytes, bytes]:
        record = _recorded(prefix, records[path])
        return verified_ends(store, prefix + path, **record, head=head, tail=tail)

    return read_ends


def _recorded(prefix: str, record: FileRecord) -> dict[str, Any]:
    """What a whole-file proof checks a stored file against, and how it names it."""
    return {
        "size": record.size,
        "sha256": record.sha256,
        "version": record.version,
        "label": f"{prefix}{record.path}",
    }


def from_stored_metadata(
    ctx: Context, ref: CheckpointRef, ckpt: Checkpoint, files: Sequence[FileRecord]
) -> KeyFacts:
    records = {f.path: f for f in files}
    prefix = checkpoint_prefix(ref.project, ref.run, ckpt.step)
    if not metadata_paths(records):
        raise IntegrityError(f"{ref}: the catalog lists no .metadata", "run `reg verify` on it")
    proven = proven_reader(ctx.store, prefix, files)
    inv = inventory(stored_metadata(proven, records, light=True))
    sizes = {p: r.size for p, r in records.items()}
    return facts_of(inv, sizes, proven, read_ends=proven_ends(ctx.store, prefix, files))
