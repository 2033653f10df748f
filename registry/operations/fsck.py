"""`reg fsck`: the whole registry, catalog against store. `reg verify REF` checks one
artifact; fsck checks every one and what lies between them:

    missing-object        a file a committed checkpoint or a release lists is not in the store
    size-mismatch         ... is there with another size
    sha256-mismatch       ... holds other bytes (every document is hashed; data files are
                          sampled, or all with `full`)
    unlisted-object       an object no manifest lists, in a checkpoint's or a release's place
    invalid-key           an object under ckpt/ or release/ whose key reg refuses to read or delete
    uncataloged           a committed MANIFEST.json or release.json the catalog has no row for
                          (`reg catalog rebuild` adds it)
    stale-claim           a pending upload whose holder is gone, or a sweep a GC did not finish
    unfinished-deletion   a checkpoint GC marked `deleting` and did not finish
    tombstone-objects     objects left under a checkpoint that was collected
    unfinished-promotion  a reserved release version whose promotion is gone (promoting again
                          finishes it)
    policy-*, validation-*, model-*, signature-forged
                          where the audit key is at hand (the server, its host), for the whole
                          registry: a fact the server decides from that does not prove itself
                          (`registry.trust.fact_findings`)

A finding is `sweepable` when it is a leftover of interrupted work, not damage and not something
a person must look at: the registry is `clean` when every finding is. `repair` (fsck_repair.py)
does only what is safe, and only to what the findings name.

The store is listed before the catalog is read: a push claims its row before it writes, so an
object in the listing whose step has no row in the later snapshot was never part of a push in
flight. The other way round (a row committed after the listing, a checkpoint collected while
fsck reads) every damage finding is checked again before it is reported: the row must still be
committed and the object still missing or different.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from sqlmodel import Session, col, select

from policies.access import Action
from registry.catalog import claims
from registry.catalog.models import (
    COMMITTED,
    DELETED,
    DELETING,
    PENDING,
    RELEASE_PENDING,
    SWEEPING,
    Checkpoint,
    CheckpointFile,
    Model,
    Project,
    Release,
    ReleaseFile,
    ReleaseSignature,
    Run,
)
from registry.core.layout import (
    CHECKPOINTS,
    MANIFEST,
    RELEASE_DOCUMENT,
    RELEASES,
    checkpoint_prefix,
    parse_checkpoint_key,
    parse_release_key,
    release_prefix,
)
from registry.core.progress import Counter
from registry.core.refs import CheckpointRef, check_name
from registry.core.timeutil import iso, now
from registry.errors import NotFound, RegistryError, UsageError
from registry.formats.documents import FileRecord
from registry.lifecycle import retention
from registry.lifecycle.views import release_document
from registry.operations.fsck_findings import (
    DAMAGE,
    DIGEST,
    INVALID_KEY,
    MISSING,
    SIZE,
    STALE_CLAIM,
    TOMBSTONE_OBJECTS,
    UNCATALOGED,
    UNFINISHED_DELETION,
    UNFINISHED_PROMOTION,
    UNLISTED,
    Artifact,
    Finding,
    Snapshot,
)
from registry.operations.fsck_repair import repair as run_repair
from registry.storage.base import check_key

if TYPE_CHECKING:
    from registry.core.progress import Progress
    from registry.lifecycle.context import Context

DEFAULT_SAMPLE = 32  # data files hashed per fsck without `full` (documents are always hashed)


def fsck(
    ctx: Context,
    *,
    project: str | None = None,
    full: bool = False,
    sample: int = DEFAULT_SAMPLE,
    repair: bool = False,
    progress: Progress | None = None,
) -> dict[str, Any]:
    if project is not None:
        check_name(project, "project name")
    if sample < 0:
        raise UsageError("--sample must be a number of files, 0 or more")
    ctx.authorize(Action.FSCK, target=f"fsck {project or 'all projects'}")
    if not repair:
        return _run(ctx, project, full, sample, progress)

    ctx.authorize(Action.REPAIR, target="fsck --repair")
    with retention.gc_lease(ctx):
        return _run(ctx, project, full, sample, progress, repair=True)


def _run(
    ctx: Context,
    project: str | None,
    full: bool,
    sample: int,
    progress: Progress | None,
    *,
    repair: bool = False,
) -> dict[str, Any]:
    snap = snapshot(ctx, project)
    findings, hashed = check(ctx, snap, full=full, sample=sample, progress=progress)
    if project is None and ctx.audit_key is not None:  # where the key is: the signed facts
        from registry.trust.fact_findings import fact_problems

        with ctx.catalog.session() as s:
            findings += [
                Finding(p["kind"], p["target"], None, p["message"], sweepable=False)
                for p in fact_problems(s, ctx.store, ctx.audit_key)
            ]
    out: dict[str, Any] = {
        "project": project,
        "full": full,
        "checked": {
            "checkpoints": sum(not a.release for a in snap.artifacts.values()),
            "releases": sum(a.release for a in snap.artifacts.values()),
            "objects": len(snap.objects),
            "bytes": sum(o.size for o in snap.objects.values()),
            **hashed,
        },
        "problems": [f.to_json() for f in findings],
        "clean": all(f.sweepable for f in findings),
        "damaged": any(f.kind in DAMAGE for f in findings),
    }
    if repair:
        repaired, left = run_repair(ctx, snap, findings)
        out.update(
            repaired=repaired,
            left=[f.to_json() for f in left],
            clean=all(f.sweepable for f in left),
            damaged=any(f.kind in DAMAGE for f in left),
        )
    return out


# -- what there is ----------------------------------------------------------------------------


def snapshot(ctx: Context, project: str | None) -> Snapshot:
    """The store's listing, then the catalog's rows (in that order: see the module doc)."""
    ckpt_prefix = f"{CHECKPOINTS}{project}/" if project else CHECKPOINTS
    objects = {o.key: o for o in ctx.store.list(ckpt_prefix)}
    objects.update((o.key, o) for o in ctx.store.list(RELEASES))
    with ctx.catalog.session() as s:
        artifacts = {a.prefix: a for a in _checkpoints(s, project)}
        releases = list(_releases(s, project))
    artifacts.update((a.prefix, a) for a in releases)
    if project is not None:  # only the releases made from this project's checkpoints
        mine = {a.prefix for a in releases}
        objects = {
            k: o for k, o in objects.items() if not k.startswith(RELEASES) or _place(k) in mine
        }
    places = {p for p in map(_place, objects) if p is not None}
    return Snapshot(objects, artifacts, places, {a.target: a for a in artifacts.values()})


def _checkpoints(s: Session, project: str | None) -> Iterable[Artifact]:
    query = (
        select(Checkpoint, Run.name, Project.name)
        .join(Run, col(Run.id) == Checkpoint.run_id)
        .join(Project, col(Project.id) == Run.project_id)
    )
    if project is not None:
        query = query.where(Project.name == project)
    rows = s.exec(query).all()
    listed = [c.id for c, _, _ in rows if c.state in (COMMITTED, DELETING)]
    files: dict[int, list[FileRecord]] = {}
    for f in s.exec(select(CheckpointFile).where(col(CheckpointFile.checkpoint_id).in_(listed))):
        files.setdefault(f.checkpoint_id, []).append(f.record())
    for c, run, proj in rows:
        a = Artifact(
            str(CheckpointRef(proj, run, c.step)),
            checkpoint_prefix(proj, run, c.step),
            c,
            files.get(c.id or 0, []),
        )
        if c.manifest_sha256:  # its size is not recorded: the repair reads its version's
            a.files.append(FileRecord(MANIFEST, -1, c.manifest_sha256, version=c.manifest_version))
        yield a


def _releases(s: Session, project: str | None) -> Iterable[Artifact]:
    query = select(Release, Model.name).join(Model, col(Model.id) == Release.model_id)
    if project is not None:
        query = (
            query.join(Checkpoint, col(Checkpoint.id) == Release.source_checkpoint_id)
            .join(Run, col(Run.id) == Checkpoint.run_id)
            .join(Project, col(Project.id) == Run.project_id)
            .where(Project.name == project)
        )
    rows = s.exec(query).all()
    files: dict[int, list[FileRecord]] = {}
    ids = [r.id for r, _ in rows]
    for f in s.exec(select(ReleaseFile).where(col(ReleaseFile.release_id).in_(ids))):
        files.setdefault(f.release_id, []).append(
            FileRecord(f.path, f.size, f.sha256, version=f.version)
        )
    added = dict(  # what `reg sign-release` added: Release.bytes does not count it (0018)
        s.exec(
            select(ReleaseSignature.release_id, ReleaseSignature.added_bytes).where(
                col(ReleaseSignature.release_id).in_(ids)
            )
        ).all()
    )
    for r, model in rows:
        listed = files.get(r.id or 0, [])
        document = release_document(r, listed, added.get(r.id or 0, 0))
        if document is not None:
            listed.append(document)
        yield Artifact(f"{model}:v{r.version}", release_prefix(model, r.version), r, listed)


def _place(key: str) -> str | None:
    """The checkpoint's or release's prefix a key lies under; None for any other key."""
    ckpt = parse_checkpoint_key(key)
    if ckpt is not None:
        return checkpoint_prefix(ckpt[0], ckpt[1], ckpt[2])
    rel = parse_release_key(key)
    return release_prefix(rel[0], rel[1]) if rel is not None else None


def _valid(key: str) -> bool:
    try:
        check_key(key)
    except RegistryError:
        return False
    return True


# -- what is wrong ----------------------------------------------------------------------------


def check(
    ctx: Context,
    snap: Snapshot,
    *,
    full: bool,
    sample: int,
    progress: Progress | None = None,
) -> tuple[list[Finding], dict[str, int]]:
    findings: list[Finding] = []
    documents: list[tuple[Artifact, FileRecord]] = []
    data: list[tuple[Artifact, FileRecord]] = []
    for a in snap.artifacts.values():
        findings.extend(_state_findings(ctx, a, snap))
        if not a.committed:
            continue
        for f in a.files:
            key = a.prefix + f.path
            info = snap.objects.get(key)
            if info is None:
                findings.append(Finding(MISSING, a.target, key, "not in the store", False))
            elif f.size >= 0 and info.size != f.size:
                detail = f"{info.size} bytes, the record says {f.size}"
                findings.append(Finding(SIZE, a.target, key, detail, False))
            else:
                (documents if f.path in (MANIFEST, RELEASE_DOCUMENT) else data).append((a, f))
    chosen = data if full else random.sample(data, min(sample, len(data)))
    findings.extend(_unlisted(snap))
    digests, hashed = _hash(ctx, snap, documents + chosen, progress)
    findings.extend(digests)
    return _confirmed(ctx, snap, findings), hashed


def _state_findings(ctx: Context, a: Artifact, snap: Snapshot) -> Iterable[Finding]:
    present = a.prefix in snap.places
    manifest = a.prefix + MANIFEST in snap.objects
    row = a.row
    if isinstance(row, Release):
        if row.status == RELEASE_PENDING and present and not claims.is_live(row):
            yield Finding(
                UNFINISHED_PROMOTION,
                a.target,
                None,
                "a reserved version whose promotion is gone; `reg promote` again finishes it",
                True,
            )
        return
    if row.state == PENDING and not claims.is_live(row):
        detail = "an upload whose holder is gone"
        if manifest:
            detail += " after it wrote MANIFEST.json: push it again to commit it"
        grace_ends = row.created_at + ctx.policy.retention.orphan_grace
        if (row.lease_until or 0) >= now():
            detail += f"; its lease runs out at {iso(row.lease_until)}, then it can be swept"
        elif grace_ends > now():
            detail += f"; swept after orphan_grace, from {iso(grace_ends)}"
        yield Finding(STALE_CLAIM, a.target, None, detail, True)
    elif row.state == SWEEPING:
        yield Finding(STALE_CLAIM, a.target, None, "a sweep GC did not finish", True)
    elif row.state == DELETING:
        yield Finding(UNFINISHED_DELETION, a.target, None, "GC marked it and did not finish", True)
    elif row.state == DELETED and present:
        if manifest:  # GC deletes MANIFEST.json first and leaves the tombstone last
            detail = "collected, but its MANIFEST.json is still there: not a GC leftover"
            yield Finding(TOMBSTONE_OBJECTS, a.target, a.prefix + MANIFEST, detail, False)
        else:
            yield Finding(TOMBSTONE_OBJECTS, a.target, None, "collected, but objects remain", True)


def _unlisted(snap: Snapshot) -> Iterable[Finding]:
    """Objects no row explains: under a committed artifact but not in its list, or under a place
    no row names at all (an uncataloged document is kept for `reg catalog rebuild`)."""
    listed = {a.prefix + f.path for a in snap.artifacts.values() for f in a.files}
    for key in sorted(snap.objects):
        if key in listed:
            continue
        prefix = _place(key)
        if not _valid(key):
            where = prefix or key
            detail = "reg refuses this key: remove it with the store's own tools"
            yield Finding(INVALID_KEY, where, key, detail, False)
            continue
        if prefix is None:
            yield Finding(UNLISTED, key, key, "not in any checkpoint's or release's place", False)
            continue
        owner = snap.artifacts.get(prefix)
        is_release = key.startswith(RELEASES)
        if owner is None:
            document = prefix + (RELEASE_DOCUMENT if is_release else MANIFEST)
            if document in snap.objects:
                if key == document:
                    what = "a release" if is_release else "a committed checkpoint"
                    detail = f"{what} the catalog has no row for; `reg catalog rebuild` adds it"
                    yield Finding(UNCATALOGED, prefix, key, detail, False)
                continue
            detail = "no catalog row names this place"
            if is_release:
                detail += "; release objects are never deleted: left for a person"
            yield Finding(UNLISTED, prefix, key, detail, not is_release)
        elif owner.committed:
            detail = "not in its manifest"
            if owner.release:
                detail += "; release objects are never deleted: left for a person"
            yield Finding(UNLISTED, owner.target, key, detail, not owner.release)


def _hash(
    ctx: Context,
    snap: Snapshot,
    items: list[tuple[Artifact, FileRecord]],
    progress: Progress | None,
) -> tuple[list[Finding], dict[str, int]]:
    """sha256 of each current object (what every reader gets) against its record."""
    if progress:
        progress.start("fsck: hashing", sum(snap.objects[a.prefix + f.path].size for a, f in items))
    counter = Counter(progress)

    def one(item: tuple[Artifact, FileRecord]) -> Finding | None:
        a, f = item
        key = a.prefix + f.path
        try:
            got = ctx.store.sha256(key, progress=counter)
        except NotFound:
            return Finding(MISSING, a.target, key, "gone while fsck read it", False)
        if got == f.sha256:
            return None
        return Finding(DIGEST, a.target, key, f"sha256 {got}, the record says {f.sha256}", False)

    with ThreadPoolExecutor(max(1, ctx.workers)) as pool:
        found = [x for x in pool.map(one, items) if x is not None]
    return found, {"hashed_files": len(items), "hashed_bytes": counter.total}


def _confirmed(ctx: Context, snap: Snapshot, findings: list[Finding]) -> list[Finding]:
    """Damage is reported only if it is still so: the row still committed (not collected since
    the snapshot) and a missing or resized object still missing or resized (not written by a
    push that committed after the listing)."""
    damage = [f for f in findings if f.kind in DAMAGE]
    if not damage:
        return findings
    committed = _still_committed(ctx, {a for f in damage if (a := snap.by_target(f.target))})
    kept: list[Finding] = []
    for f in findings:
        if f.kind not in DAMAGE:
            kept.append(f)
            continue
        artifact = snap.by_target(f.target)
        if artifact is None or artifact.prefix not in committed:
            continue
        if f.kind in (MISSING, SIZE) and f.key is not None:
            record = next(r for r in artifact.files if artifact.prefix + r.path == f.key)
            info = ctx.store.head(f.key)
            if info is not None and (record.size < 0 or info.size == record.size):
                continue  # there now, as recorded: committed after the listing
        kept.append(f)
    return kept


def _still_committed(ctx: Context, artifacts: set[Artifact]) -> set[str]:
    """The prefixes, among `artifacts`, whose rows are committed now."""
    ckpts = {a.row.id: a.prefix for a in artifacts if not a.release}
    rels = {a.row.id: a.prefix for a in artifacts if a.release}
    with ctx.catalog.session() as s:
        now_ckpt = s.exec(
            select(Checkpoint.id).where(
                col(Checkpoint.id).in_(ckpts), Checkpoint.state == COMMITTED
            )
        ).all()
        now_rel = s.exec(
            select(Release.id).where(col(Release.id).in_(rels), Release.status != RELEASE_PENDING)
        ).all()
    return {ckpts[i] for i in now_ckpt} | {rels[i] for i in now_rel}
