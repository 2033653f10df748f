"""`reg fsck`: the whole registry, catalog against store (issue 17). `reg verify REF` checks one
artifact; fsck checks every one and what lies between them:

    missing-object        a file a committed checkpoint or a release lists is not in the store
    size-mismatch         ... is there with another size
    sha256-mismatch       ... holds other bytes (every document is hashed; data files are
                          sampled, or all with `full`)
    unlisted-object       an object no manifest lists, in a checkpoint's or a release's place
    uncataloged           a committed MANIFEST.json or release.json the catalog has no row for
                          (`reg catalog rebuild` adds it)
    stale-claim           a pending upload whose holder is gone, or a sweep a GC did not finish
    unfinished-deletion   a checkpoint GC marked `deleting` and did not finish
    tombstone-objects     objects left under a checkpoint that was collected
    unfinished-promotion  a reserved release version (promoting again finishes it)

A finding is `sweepable` when it is a leftover of an interrupted operation, not damage: the
registry is `clean` when every finding is. `repair` (fsck_repair.py) does only what is safe.

The store is listed before the catalog is read: a push claims its row before it writes, so an
object in the listing whose step has no row in the later snapshot was never part of a push in
flight.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from sqlmodel import Session, col, select

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
    Run,
)
from registry.errors import NotFound
from registry.formats.documents import FileRecord
from registry.layout import (
    CHECKPOINTS,
    MANIFEST,
    RELEASE_DOCUMENT,
    RELEASES,
    checkpoint_prefix,
    parse_checkpoint_key,
    parse_release_key,
    release_prefix,
)
from registry.progress import Counter
from registry.refs import CheckpointRef, check_name

if TYPE_CHECKING:
    from registry.context import Context
    from registry.progress import Progress
    from registry.storage.base import ObjectInfo

MISSING, SIZE, DIGEST = "missing-object", "size-mismatch", "sha256-mismatch"
UNLISTED, UNCATALOGED = "unlisted-object", "uncataloged"
STALE_CLAIM, UNFINISHED_DELETION = "stale-claim", "unfinished-deletion"
TOMBSTONE_OBJECTS, UNFINISHED_PROMOTION = "tombstone-objects", "unfinished-promotion"
DAMAGE = (MISSING, SIZE, DIGEST)
DEFAULT_SAMPLE = 32  # data files hashed per fsck without `full` (documents are always hashed)


@dataclass(frozen=True, slots=True)
class Finding:
    kind: str
    target: str  # the checkpoint ref or release name it concerns
    key: str | None  # the object, where one is concerned
    detail: str
    sweepable: bool

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(slots=True)
class Artifact:
    """A catalog row with the files it lists (documents included), under `prefix`."""

    target: str
    prefix: str
    state: str
    files: list[FileRecord] = field(default_factory=list)
    release: bool = False
    live: bool = False  # a pending upload whose holder still holds its claim


@dataclass(slots=True)
class Snapshot:
    objects: dict[str, ObjectInfo]
    artifacts: dict[str, Artifact]  # by prefix


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
    ctx.authorize("fsck", target=f"fsck {project or 'all projects'}")
    snap = snapshot(ctx, project)
    findings, hashed = check(ctx, snap, full=full, sample=sample, progress=progress)
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
    }
    if repair:
        from registry.lifecycle.fsck_repair import repair as run_repair

        repaired, left = run_repair(ctx, snap, findings)
        out.update(
            repaired=repaired,
            left=[f.to_json() for f in left],
            clean=all(f.sweepable for f in left),
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
            k: o for k, o in objects.items() if not k.startswith(RELEASES) or _under(k, mine)
        }
    return Snapshot(objects, artifacts)


def _under(key: str, prefixes: set[str]) -> bool:
    parsed = parse_release_key(key)
    return parsed is not None and release_prefix(parsed[0], parsed[1]) in prefixes


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
            c.state,
            files.get(c.id or 0, []),
            live=c.state == PENDING and claims.is_live(c),
        )
        if c.manifest_sha256:
            a.files.append(FileRecord(MANIFEST, -1, c.manifest_sha256))  # size: not recorded
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
    for r, model in rows:
        listed = files.get(r.id or 0, [])
        if r.sha256:
            size = r.bytes - sum(f.size for f in listed)
            listed.append(FileRecord(RELEASE_DOCUMENT, size, r.sha256, version=r.document_version))
        yield Artifact(
            f"{model}:v{r.version}", release_prefix(model, r.version), r.status, listed, True
        )


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
    to_hash: list[tuple[Artifact, FileRecord]] = []
    data: list[tuple[Artifact, FileRecord]] = []
    for a in snap.artifacts.values():
        findings.extend(_state_findings(a, snap))
        if not _committed(a):
            continue
        for f in a.files:
            info = snap.objects.get(a.prefix + f.path)
            if info is None:
                findings.append(
                    Finding(MISSING, a.target, a.prefix + f.path, "not in the store", False)
                )
            elif f.size >= 0 and info.size != f.size:
                detail = f"{info.size} bytes, the record says {f.size}"
                findings.append(Finding(SIZE, a.target, a.prefix + f.path, detail, False))
            elif f.path in (MANIFEST, RELEASE_DOCUMENT):
                to_hash.append((a, f))
            else:
                data.append((a, f))
    to_hash.extend(data if full else random.sample(data, min(sample, len(data))))
    findings.extend(_unlisted(snap))
    digests, hashed = _hash(ctx, snap, to_hash, progress)
    findings.extend(digests)
    return findings, hashed


def _state_findings(a: Artifact, snap: Snapshot) -> Iterable[Finding]:
    present = any(k.startswith(a.prefix) for k in snap.objects)
    if a.release:
        if a.state == RELEASE_PENDING and present:
            yield Finding(
                UNFINISHED_PROMOTION,
                a.target,
                None,
                "a reserved version with objects; `reg promote` again finishes it",
                True,
            )
        return
    if a.state in (PENDING, SWEEPING) and not a.live:
        why = "an upload whose holder is gone" if a.state == PENDING else "a sweep GC left"
        yield Finding(STALE_CLAIM, a.target, None, f"{why}; GC sweeps it", True)
    elif a.state == DELETING:
        yield Finding(UNFINISHED_DELETION, a.target, None, "GC marked it and did not finish", True)
    elif a.state == DELETED and present:
        yield Finding(TOMBSTONE_OBJECTS, a.target, None, "collected, but objects remain", True)


def _unlisted(snap: Snapshot) -> Iterable[Finding]:
    """Objects no row explains: under a committed artifact but not in its list, or under a place
    no row names at all (an uncataloged document is kept for `reg catalog rebuild`)."""
    listed = {a.prefix + f.path for a in snap.artifacts.values() for f in a.files}
    for key in sorted(snap.objects):
        if key in listed:
            continue
        prefix = _prefix_of(key)
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
                    yield Finding(
                        UNCATALOGED,
                        prefix,
                        key,
                        f"{what} the catalog has no row for; `reg catalog rebuild` adds it",
                        False,
                    )
                continue
            yield Finding(UNLISTED, prefix, key, "no catalog row names this place", not is_release)
        elif _committed(owner):
            yield Finding(UNLISTED, owner.target, key, "not in its manifest", not owner.release)


def _committed(a: Artifact) -> bool:
    """A committed checkpoint, or a release that left `pending` (active, deprecated, yanked)."""
    return a.state != RELEASE_PENDING if a.release else a.state == COMMITTED


def _prefix_of(key: str) -> str | None:
    ckpt = parse_checkpoint_key(key)
    if ckpt is not None:
        return checkpoint_prefix(ckpt[0], ckpt[1], ckpt[2])
    rel = parse_release_key(key)
    return release_prefix(rel[0], rel[1]) if rel is not None else None


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
