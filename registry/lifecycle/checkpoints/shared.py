"""A checkpoint written by many writers under one claim (DESIGN §3).

A push copies one directory; a training job on many nodes has no directory that holds every
rank's files. Here one process claims the step and hands the claim's token to every writer;
each writer puts its own files straight into the step's prefix (put-if-absent, hashed as
written); one commit then checks the files against `.metadata` and makes the step visible.

    claim(ctx, ref)                    the pending row and its token; an earlier attempt's
                                       leftovers are deleted (the claim makes them ours)
    find(ctx, token)                   the claim a token names (push-ckpt --claim, commit-ckpt)
    record_part(ctx, claim, files)     a writer outside Python says which files it put
    commit_written(ctx, claim, files)  every file `.metadata` names is there: commit

The training loop (`registry.training`) gets every rank's file records through DCP's write
results and commits with one catalog transaction; `reg claim-ckpt` / `push-ckpt --claim` /
`commit-ckpt` record each writer's files as a small object beside the files instead
(`.reg-claim-<id>.json`, a reserved name), which the commit reads back and deletes.

Whose word are the digests: each writer hashed the bytes as it wrote them, as a push does;
embedded mode trusts its writers as it trusts a pusher (DESIGN §9).
"""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeGuard

from sqlmodel import col, select

from policies.access import Action
from registry.catalog import claims
from registry.catalog.claims import Claim
from registry.catalog.models import LOCAL, PENDING, Checkpoint, CheckpointTier, Project, Run
from registry.core.layout import checkpoint_prefix, manifest_key
from registry.core.refs import CheckpointRef
from registry.core.timeutil import now
from registry.errors import Conflict, IntegrityError, NotFound, UsageError
from registry.formats import deepspeed_root
from registry.formats.dcp import METADATA
from registry.formats.dcp_roots import merged_metadata, metadata_paths
from registry.formats.dcp_scan import (
    CLAIM_RECORD_PREFIX,
    RANK_FILE,
    check_file_set,
    check_path,
    is_reserved,
    scan_merged,
)
from registry.formats.documents import FileRecord
from registry.lifecycle.checkpoints.push import (
    build_manifest,
    check_metrics,
    check_request,
    world_size_of,
)
from registry.lifecycle.checkpoints.resume_facts import facts_of, fields
from registry.lifecycle.transfer import OnMismatch, Stored, put_reconciled

if TYPE_CHECKING:
    from collections.abc import Callable

    from registry.catalog.claims import Claim
    from registry.lifecycle.checkpoints.commit import PushResult
    from registry.lifecycle.context import Context

_TOKEN = re.compile(r"[0-9a-f]{32}")
_HEX = re.compile(r"[0-9a-f]{64}")
MAX_RECORDS = 1_000_000  # files of one checkpoint (4,096 ranks x 244 files each)
MAX_LEASE_S = 7 * 86400.0
MAX_PART_RECORD = 64 << 20


@dataclass(frozen=True, slots=True)
class LocalCopy:
    """A step committed at tier 0: its files are on the nodes' local disks, not in
    the store. `read` gives a file whole from the coordinator's local directory; `nodes` says
    which node holds which ranks' files; the manifest is written beside the files
    (`write_manifest`) for the replicator, which holds the claim `token` from the commit on
    (`held`; else the claim is left for whoever copies it later)."""

    read: Callable[[str], bytes]
    nodes: dict[str, tuple[list[int], list[str]]]
    write_manifest: Callable[[bytes], None]
    token: str
    held: bool = True  # False: nobody copies it now (the claim is free to take at once)


@dataclass(frozen=True, slots=True)
class SharedClaim:
    """The claim on one step that every writer of the checkpoint holds."""

    ref: CheckpointRef
    row_id: int
    token: str

    @property
    def prefix(self) -> str:
        return checkpoint_prefix(self.ref.project, self.ref.run, self.ref.step or 0)

    def catalog_claim(self) -> Claim:
        return Claim(Checkpoint, self.row_id, self.token)

    def to_json(self) -> dict[str, Any]:
        return {"ref": str(self.ref), "claim": self.token}


def claim(
    ctx: Context, ref: CheckpointRef, *, lease_s: float | None = None, store_later: bool = False
) -> SharedClaim:
    """Claim `ref` for writers that will share the token. `lease_s`: the claim outlives this
    process (a launcher's `reg claim-ckpt`) and runs out after that many seconds unless a
    writer renews it; None: held by this process, which renews it (`claims.held`).
    `store_later`: the writers write elsewhere first (tier 0), so a new step's claim does not
    touch the store (an unreachable store does not stop the save)."""
    from registry.lifecycle.checkpoints import commit

    check_request(ref.project, ref.run, ref.step or 0)
    if lease_s is not None and not 1 <= lease_s <= MAX_LEASE_S:
        raise UsageError(f"--lease {lease_s:g}s is out of range", "1 second to 7 days")
    ctx.authorize(Action.PUSH, project=ref.project, target=str(ref))
    taken, existing = commit.claim_step(ctx, ref)
    if existing is not None:
        raise Conflict(f"{ref} is already committed", "save under a new step")
    shared = SharedClaim(ref, taken.row_id, taken.token)
    if lease_s is not None:
        with ctx.catalog.session(write=True) as s:
            # No process holds it: the lease alone says when it may be taken over.
            claims.guarded_update(s, taken, claim_pid=None, lease_until=now() + float(lease_s))
    if store_later and taken.fresh:
        return shared  # no earlier attempt in the catalog: the prefix holds nothing of one
    # An earlier attempt's files are ours now (the claim was stale or the step new): gone, so
    # that every writer's put-if-absent finds the keys free and a leftover is never committed.
    for info in list(ctx.store.list(shared.prefix)):
        ctx.store.delete(info.key)
    return shared


def is_token(value: object) -> bool:
    return isinstance(value, str) and _TOKEN.fullmatch(value) is not None


def is_digest(value: object) -> TypeGuard[str]:
    """A sha256 as the registry records it: 64 lowercase hex digits."""
    return isinstance(value, str) and _HEX.fullmatch(value) is not None


def check_token(token: str) -> str:
    """`token` if it has a claim token's form (it goes into queries and URLs)."""
    if not is_token(token):
        raise UsageError("not a claim token", "use the token `reg claim-ckpt` printed")
    return token


def find(ctx: Context, token: str, *, local: bool = False) -> SharedClaim:
    """The pending step `token` holds (authorized to push in its project); `local`: or the
    tier-0 step whose copy to the store it holds (`tiers.copying`)."""

    check_token(token)
    states = (PENDING, LOCAL) if local else (PENDING,)
    with ctx.catalog.session() as s:
        found = s.exec(
            select(Checkpoint, Run, Project)
            .where(col(Checkpoint.claim_token) == token, col(Checkpoint.state).in_(states))
            .where(col(Checkpoint.run_id) == col(Run.id), col(Run.project_id) == col(Project.id))
        ).first()
    if found is None:
        raise NotFound(
            "no checkpoint is being written under this claim (committed, abandoned or taken over)",
            "claim the step again with `reg claim-ckpt`",
        )
    row, run, project = found
    ref = CheckpointRef(project.name, run.name, row.step)
    ctx.authorize(Action.PUSH, project=ref.project, target=str(ref))
    return SharedClaim(ref, row.id or 0, token)


def renew(ctx: Context, shared: SharedClaim, seconds: float) -> None:
    """Keep a launcher's claim alive for `seconds` more (each `push-ckpt --claim` does)."""
    with ctx.catalog.session(write=True) as s:
        row = s.get(Checkpoint, shared.row_id)
        current = (row.lease_until or 0.0) if row is not None else 0.0
        lease = max(current, now() + max(seconds, claims.LEASE_SECONDS))  # never shortened
        if not claims.guarded_update(s, shared.catalog_claim(), lease_until=lease):
            raise _lost(shared.ref)


def give_up(ctx: Context, shared: SharedClaim) -> None:
    """The writers failed: the claim may be taken over at once (the step saved again)."""
    claims.expire(ctx.catalog, shared.catalog_claim())


def record_part(ctx: Context, shared: SharedClaim, files: list[Stored]) -> str:
    """Write which files one writer put (its part of the checkpoint); returns the record key."""
    doc = {
        "format": "reg.claim-part/1",
        "ref": str(shared.ref),
        "actor": ctx.actor,
        "files": [
            {
                "path": f.key.removeprefix(shared.prefix),
                "size": f.size,
                "sha256": f.sha256,
                "version": f.version,
            }
            for f in files
        ],
    }
    key = f"{_records_of(shared)}{uuid.uuid4().hex}.json"
    renew(ctx, shared, 0)  # still ours (a writer whose claim was taken over stops here)
    ctx.store.put_bytes(key, json.dumps(doc, separators=(",", ":")).encode())
    return key


def _records_of(shared: SharedClaim) -> str:
    """Where the part records of this claim go: named by a digest of its token, so a commit
    reads only its own writers' records (never a taken-over attempt's), and the store does
    not hold the token itself."""
    tag = hashlib.sha256(shared.token.encode()).hexdigest()[:24]
    return f"{shared.prefix}{CLAIM_RECORD_PREFIX}{tag}-"


def recorded_parts(ctx: Context, shared: SharedClaim) -> tuple[list[FileRecord], list[str]]:
    """Every file the writers recorded, and the record objects; one file recorded twice with
    different bytes is a conflict."""
    records: dict[str, FileRecord] = {}
    keys = []
    for info in ctx.store.list(_records_of(shared)):
        keys.append(info.key)
        if len(keys) > MAX_RECORDS:
            raise IntegrityError(f"{shared.ref}: over {MAX_RECORDS} part records")
        if info.size > MAX_PART_RECORD:
            raise IntegrityError(f"{info.key} is {info.size} bytes: not a part record")
        for r in _parse_part(info.key, ctx.store.get_bytes(info.key)):
            seen = records.get(r.path)
            if seen is not None and (seen.size, seen.sha256) != (r.size, r.sha256):
                raise Conflict(
                    f"{shared.ref}: two writers put different bytes as {r.path}",
                    "claim the step again and push each file from one node",
                )
            records[r.path] = r
    return sorted(records.values(), key=lambda r: r.path), keys


def _parse_part(key: str, data: bytes) -> list[FileRecord]:
    """One part record's files, each field checked: a record is read back from the store, and
    what it says becomes the checkpoint's file list."""
    bad = IntegrityError(f"{key} is not a part record", "push that part again")
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError):
        raise bad from None
    entries = doc.get("files") if isinstance(doc, dict) else None
    if not isinstance(entries, list):
        raise bad
    out = []
    for e in entries:
        if not isinstance(e, dict):
            raise bad
        path, size, digest, version = (e.get(k) for k in ("path", "size", "sha256", "version"))
        if (
            not isinstance(path, str)
            or isinstance(size, bool)
            or not isinstance(size, int)
            or not 0 <= size < 1 << 50
            or not is_digest(digest)
            or not (version is None or (isinstance(version, str) and len(version) <= 1024))
        ):
            raise bad
        try:
            check_path(key, path)
        except UsageError:
            raise bad from None
        if is_reserved(path):
            raise bad
        out.append(FileRecord(path, size, digest, None, version))
    return out


def commit_written(
    ctx: Context,
    shared: SharedClaim,
    files: list[FileRecord],
    *,
    world_size: int | None,
    metrics: dict[str, float] | None = None,
    layout: str | None = None,
    save_costs: dict[str, Any] | None = None,
    upload_seconds: float = 0.0,
    own_writer: bool = False,
    local: LocalCopy | None = None,
) -> PushResult:
    """Commit the checkpoint the writers put under `shared`, from their file records (path,
    size, sha256, version): each must be in the store at its size, `.metadata` must hash to
    its record and name only recorded files (else IntegrityError naming the missing ranks'
    files). `own_writer`: reg's StoreWriter wrote the shards (no shard is read). `local`: the
    files are on the nodes' local disks: committed at tier 0 (DCP's own writer wrote them)."""
    from registry.lifecycle.checkpoints import commit

    ref, prefix = shared.ref, shared.prefix
    checked_metrics = check_metrics(metrics or {})
    if len(files) > MAX_RECORDS:
        raise UsageError(f"{len(files)} files in one checkpoint; at most {MAX_RECORDS}")
    by_path = {f.path: f for f in files}
    if len(by_path) != len(files):
        raise Conflict(f"{ref}: a file was written twice", "each file has one writer")
    sizes = {f.path: f.size for f in files}
    paths = metadata_paths(sizes)
    if not paths or not paths[0].endswith(METADATA):  # a Trainer's plain save is one writer's
        raise IntegrityError(
            f"{ref}: no .metadata was written", "DCP's coordinator writes it last: push it too"
        )
    # Names, roots and .metadata sizes as a pushed directory's, before a byte is read.
    check_file_set(str(ref), sizes)
    if local is None:
        check_listed(ctx, shared, sizes)

    def read(path: str) -> bytes:  # a file whole, refused unless it holds the recorded bytes
        if deepspeed_root.is_root_name(path):  # read only as a DeepSpeed root: none in DCP
            return b""
        if local is not None:
            data = local.read(path)
        else:
            data = bytes(ctx.store.get_bytes(prefix + path, version=by_path[path].version))
        if hashlib.sha256(data).hexdigest() != by_path[path].sha256:
            raise IntegrityError(f"{ref}: {path} holds other bytes than its writer recorded")
        return data

    metadata = {path: read(path) for path in paths}
    merged = merged_metadata(metadata, light=True)
    _check_named_files(ref, merged, sizes)

    def read_head(path: str, offset: int) -> bytes:
        if offset >= sizes[path]:
            return b""
        return bytes(ctx.store.read_range(prefix + path, offset, min(9, sizes[path] - offset)))

    label = str(ref)
    heads = None if own_writer or local is not None else read_head
    scanned = scan_merged(Path(label), sizes, merged, metadata, heads)
    world = world_size_of(scanned, world_size, None)
    facts = facts_of(scanned.inventory, sizes, read, layout)
    stored = [Stored(prefix + f.path, f.size, f.sha256, False, f.version) for f in files]
    committing = _take_for_commit(ctx, shared)
    with claims.held(ctx.catalog, committing):
        manifest = build_manifest(
            ctx, ref, scanned, stored, world, facts.record(ctx.policy.resume), checked_metrics
        )
        data = manifest.to_bytes()
        if local is not None:
            _check_nodes(ref, local, sizes)
            local.write_manifest(data)
            copies = [
                CheckpointTier(
                    checkpoint_id=shared.row_id,
                    tier=0,
                    node=node,
                    ranks=sorted(node_ranks),
                    files=sorted(node_files),
                    bytes=sum(sizes[p] for p in node_files),
                    at=now(),
                )
                for node, (node_ranks, node_files) in sorted(local.nodes.items())
            ]
            result = commit.commit(
                ctx,
                committing,
                manifest,
                data,
                None,
                upload_seconds,
                0,
                save_costs=save_costs,
                local=(local.token, local.held, copies),
            )
            return replace(result, resume=fields(facts, ctx.policy.resume))
        version = put_reconciled(
            ctx.store,
            manifest_key(ref.project, ref.run, ref.step or 0),
            data=data,
            on_mismatch=OnMismatch.REPLACE,  # an earlier commit of ours died after writing it
            before_replace=lambda: commit.ensure_held(ctx, committing, ref),
        ).version
        result = commit.commit(
            ctx,
            committing,
            manifest,
            data,
            version,
            upload_seconds,
            0,
            save_costs=save_costs,
        )
    return replace(result, resume=fields(facts, ctx.policy.resume))


def _check_nodes(ref: CheckpointRef, local: LocalCopy, sizes: dict[str, int]) -> None:
    """Each file of a tier-0 step is on exactly one node."""
    held = [p for _, files in local.nodes.values() for p in files]
    if sorted(held) != sorted(sizes):
        raise IntegrityError(
            f"{ref}: the nodes' local copies do not hold each file once",
            "save again (a rank's files were reported by two nodes, or by none)",
        )


def _take_for_commit(ctx: Context, shared: SharedClaim) -> Claim:
    """One committer: the claim's token is swapped for a fresh one held by this process, so a
    second `commit-ckpt` of the same claim (or a writer still renewing it) finds it gone
    instead of writing a MANIFEST.json the first commit does not record."""
    fresh = claims.new_token()
    with ctx.catalog.session(write=True) as s:
        if not claims.guarded_update(s, shared.catalog_claim(), **claims.claim_columns(fresh)):
            raise Conflict(
                f"{shared.ref} is being committed by another process, or its claim was lost",
                "check `reg show`; claim the step again if it is not committed",
            )
    return claims.Claim(Checkpoint, shared.row_id, fresh)


def check_listed(ctx: Context, shared: SharedClaim, sizes: dict[str, int]) -> None:
    """One listing of the prefix (not a request per file): each recorded file is there, at its
    size."""
    listed = {
        info.key.removeprefix(shared.prefix): info.size for info in ctx.store.list(shared.prefix)
    }
    missing = sorted(p for p in sizes if p not in listed)
    if missing:
        raise IntegrityError(
            f"{shared.ref}: {len(missing)} recorded file(s) are not in the store "
            f"({', '.join(missing[:5])})",
            "the writer's put did not land: save again",
        )
    wrong = sorted(p for p, size in sizes.items() if listed[p] != size)
    if wrong:
        raise IntegrityError(
            f"{shared.ref}: {wrong[0]} is {listed[wrong[0]]} bytes in the store, "
            f"{sizes[wrong[0]]} recorded",
            "something else wrote under the claim; claim the step again",
        )


def _check_named_files(ref: CheckpointRef, merged: Any, sizes: dict[str, int]) -> None:
    """Every shard `.metadata` names was recorded; else say which ranks' files are missing."""
    named = {str(info.relative_path) for info in merged.storage_data.values()}
    missing = sorted(named - set(sizes))
    if not missing:
        return
    ranks = sorted(
        {int(m.group(1)) for p in missing if (m := RANK_FILE.fullmatch(p.rsplit("/", 1)[-1]))}
    )
    which = f" of rank(s) {', '.join(map(str, ranks[:16]))}" if ranks else ""
    raise IntegrityError(
        f"{ref}: {len(missing)} file(s){which} that .metadata names were not pushed "
        f"({', '.join(missing[:5])})",
        "push them with `reg push-ckpt DIR --claim TOKEN` from the node that has them, "
        "then commit again",
    )


def _lost(ref: CheckpointRef) -> Conflict:
    return Conflict(
        f"lost the claim on {ref} (it ran out or was taken over)",
        "claim the step again and rewrite it",
    )
