"""Rebuild the catalog from the store: the store is self-describing (DESIGN §3).

Every committed checkpoint has a MANIFEST.json and every release a release.json, written last;
both list each file's size and sha256. A lost or damaged catalog is rebuilt from them: rows that
already exist are left alone, missing ones are added. A document counts only where the registry
writes it (`ckpt/<project>/<run>/step-<N>/MANIFEST.json`, `release/<model>/v<K>/release.json`),
only if it reads strictly, and only if what it claims matches where it is: a manifest nested
inside a checkpoint, or naming another project, run or step, is skipped and reported.

What else lived only in the catalog (validations, applied policies and their grants, aliases,
deprecations and yanks, pins) comes back from the journal (`journal/`, registry.journal): each
decision was written there before the catalog committed it. After the checkpoints, the
validations are replayed (so that a restored release links the validation its release.json
names), then the releases, then the other decisions. Only what this rebuild re-created takes
a decision from the journal (registry.journal.replay): for every row the catalog kept, the
catalog is the truth. `events_replayed`, `events_current` and `events_superseded` count the
events by kind, `events_unsigned` the replayed ones no key signed, `events_skipped` names each
event not taken and why (malformed, implausible, unsigned or forged where the registry has an
audit key, or its target gone). A signed journal is not replayed without its key. Only the
audit log cannot come back, and is reported as such.
"""

from __future__ import annotations

import hashlib
from datetime import datetime
from typing import TYPE_CHECKING, Any

from sqlmodel import Session, select

from policies.access import Action
from registry.catalog import claims, queries
from registry.catalog.models import (
    ACTIVE,
    DELETED,
    PENDING,
    RELEASE_PENDING,
    Checkpoint,
    CheckpointFile,
    Model,
    Release,
    ReleaseFile,
)
from registry.core.layout import (
    CHECKPOINTS,
    MANIFEST,
    RELEASE_DOCUMENT,
    RELEASES,
    parse_checkpoint_key,
    parse_release_key,
    release_prefix,
)
from registry.core.timeutil import now
from registry.errors import IntegrityError, InvalidDocument
from registry.formats.dcp_roots import metadata_paths
from registry.formats.documents import FileRecord, Manifest, ReleaseDocument
from registry.journal import replay as journal
from registry.lifecycle.checkpoints.commit import save_key_facts
from registry.trust.release_signing.bundle import MAX_SIGNATURE, SIGNATURE_FILE, claimed_digests
from registry.trust.release_signing.provenance import CARD_FILE, PROVENANCE_FILE

if TYPE_CHECKING:
    from registry.lifecycle.context import Context


def _ts(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def rebuild(ctx: Context, *, dry_run: bool = False) -> dict[str, Any]:
    ctx.authorize(Action.CATALOG, target="catalog rebuild")
    out: dict[str, Any] = {
        "applied": not dry_run,
        "checkpoints_added": [],
        "releases_added": [],
        "skipped": [],
    }
    # read first: a journal that must not be replayed (signed, and no key) stops the rebuild
    # before it changes anything
    decisions = journal.read(ctx, dry_run=dry_run)
    for obj in ctx.store.list(CHECKPOINTS):
        if obj.key.endswith("/" + MANIFEST):
            manifest = _read_manifest(ctx, obj.key, out)
            if manifest is not None:
                _checkpoint(ctx, obj.key, manifest, out, dry_run, decisions)
    journal.apply_validations(ctx, decisions)
    for obj in ctx.store.list(RELEASES):
        if obj.key.endswith("/" + RELEASE_DOCUMENT):
            document = _read_release(ctx, obj.key, out)
            if document is not None:
                _release(ctx, document, out, dry_run, decisions)
    journal.apply_decisions(ctx, decisions)
    out.update(decisions.to_json())
    out["skipped"] += [f"{e['event']}: {e['reason']}" for e in out["events_skipped"]]
    out["not_recoverable"] = "the audit log lives only in the catalog"
    replayed = sum(decisions.replayed.values())
    if not dry_run and (out["checkpoints_added"] or out["releases_added"] or replayed):
        with ctx.catalog.session(write=True) as s:
            ctx.audit(
                s,
                "catalog-rebuild",
                "catalog",
                checkpoints=len(out["checkpoints_added"]),
                releases=len(out["releases_added"]),
                events=replayed or None,
            )
    if not dry_run and ctx.audit_key is not None and replayed:
        from registry.trust.audit_chain.service import seal_now

        seal_now(ctx.catalog, ctx.store, ctx.audit_key)  # a replayed policy is in force now
    return out


def _read_current(ctx: Context, key: str) -> tuple[bytes, str | None]:
    """The document at `key` and its version (on a versioned bucket), read as one."""
    head = ctx.store.head(key)
    version = head.version_id if head is not None else None
    return b"".join(ctx.store.stream(key, version=version)), version


def _read_manifest(
    ctx: Context, key: str, out: dict[str, Any]
) -> tuple[Manifest, str, str | None] | None:
    place = parse_checkpoint_key(key)
    if place is None or place[3] != MANIFEST:
        out["skipped"].append(f"{key}: not where a checkpoint's manifest is kept")
        return None
    data, version = _read_current(ctx, key)
    try:
        manifest = Manifest.from_bytes(data, key)
    except InvalidDocument as exc:
        out["skipped"].append(str(exc))
        return None
    if (manifest.project, manifest.run, manifest.step) != place[:3]:
        out["skipped"].append(f"{key}: the manifest names {manifest.ref}, not its own place")
        return None
    if not metadata_paths(f.path for f in manifest.files):
        out["skipped"].append(f"{key}: lists no .metadata, so it is no DCP checkpoint")
        return None
    damaged = _missing_files(ctx, key.removesuffix(MANIFEST), manifest.files)
    if damaged:
        out["skipped"].append(f"{key}: {damaged}; not registered (reg gc sweeps what is left)")
        return None
    return manifest, hashlib.sha256(data).hexdigest(), version


def _missing_files(ctx: Context, prefix: str, files: tuple[FileRecord, ...]) -> str | None:
    """A document's files must all be there at their recorded sizes to be registered (their
    digests are checked by `reg verify`, which reads every byte)."""
    for f in files:
        head = ctx.store.head(prefix + f.path, version=f.version)
        if head is None:
            return f"{f.path} is missing" + (f" (version {f.version})" if f.version else "")
        if head.size != f.size:
            return f"{f.path} has {head.size} bytes, the document says {f.size}"
    return None


def _read_release(
    ctx: Context, key: str, out: dict[str, Any]
) -> tuple[ReleaseDocument, bytes, str | None] | None:
    place = parse_release_key(key)
    if place is None or place[2] != RELEASE_DOCUMENT:
        out["skipped"].append(f"{key}: not where a release document is kept")
        return None
    data, version = _read_current(ctx, key)
    try:
        document = ReleaseDocument.from_bytes(data, key)
    except InvalidDocument as exc:
        out["skipped"].append(str(exc))
        return None
    if (document.model, document.version) != place[:2]:
        out["skipped"].append(f"{key}: the document names {document.release}, not its own place")
        return None
    damaged = _missing_files(ctx, key.removesuffix(RELEASE_DOCUMENT), document.files)
    if damaged:
        out["skipped"].append(f"{key}: {damaged}; not registered")
        return None
    return document, data, version


def _checkpoint(
    ctx: Context,
    key: str,
    read: tuple[Manifest, str, str | None],
    out: dict[str, Any],
    dry_run: bool,
    decisions: journal.Replay,
) -> None:
    manifest, digest, version = read
    with ctx.catalog.session(write=not dry_run) as s:
        _, run_row = queries.get_or_create_run(s, manifest.project, manifest.run)
        existing = s.exec(
            select(Checkpoint).where(
                Checkpoint.run_id == run_row.id, Checkpoint.step == manifest.step
            )
        ).first()
        if existing is not None and (existing.state != PENDING or claims.is_live(existing)):
            s.rollback()  # registered, or a push that is still committing it
            return
        out["checkpoints_added"].append(str(manifest.ref))
        decisions.checkpoints.add((manifest.project, manifest.run, manifest.step))
        if dry_run:
            s.rollback()
            return
        if existing is not None:  # a pending claim: the manifest shows it was complete
            s.delete(existing)
            s.flush()
        created = _ts(manifest.created_at)
        ckpt = Checkpoint(
            run_id=run_row.id or 0,
            step=manifest.step,
            created_at=created,
            committed_at=created,
            **Checkpoint.facts_of(manifest, digest, version),
        )
        s.add(ckpt)
        s.flush()
        s.add_all(CheckpointFile.of(ckpt.id or 0, f) for f in manifest.files)
        save_key_facts(s, ckpt.id or 0, manifest)


def _release(
    ctx: Context,
    read: tuple[ReleaseDocument, bytes, str | None],
    out: dict[str, Any],
    dry_run: bool,
    decisions: journal.Replay,
) -> None:
    doc, data, version = read
    with ctx.catalog.session(write=not dry_run) as s:
        model = s.exec(select(Model).where(Model.name == doc.model)).first()
        if model is None:
            # Owned by the project of its first release found (key order: v1 comes first).
            model = Model(
                name=doc.model, created_at=_ts(doc.created_at), project=doc.source.ref.project
            )
            s.add(model)
            s.flush()
            if ctx.audit_key is not None and not dry_run:
                from registry.trust.signed_facts import MODEL, model_content, sign

                sign(
                    s,
                    ctx.audit_key,
                    MODEL,
                    model.id or 0,
                    model_content(model),
                    signed_by=ctx.actor,
                )
            decisions.models.add(doc.model)
        existing = s.exec(
            select(Release).where(Release.model_id == model.id, Release.version == doc.version)
        ).first()
        if existing is not None and (
            existing.status != RELEASE_PENDING or claims.is_live(existing)
        ):
            s.rollback()  # registered, or a promotion that is still committing it
            return
        out["releases_added"].append(doc.release)
        decisions.releases.add((doc.model, doc.version))
        if dry_run:
            s.rollback()
            return
        if existing is not None:
            s.delete(existing)
            s.flush()
        source = doc.source.ref
        ckpt = _source_row(s, doc)
        validation = decisions.validation_for(
            source.project, source.run, source.step or 0, doc.validation.id
        )
        files = list(doc.files) + _unlisted_files(ctx, doc)
        release = Release(
            model_id=model.id or 0,
            version=doc.version,
            status=ACTIVE,
            sha256=hashlib.sha256(data).hexdigest(),
            document_version=version,
            bytes=sum(f.size for f in files) + len(data),
            source_checkpoint_id=ckpt.id or 0,
            source_ref=str(source),
            validation_id=validation,
            options_key="rebuilt",
            options={"dtype": doc.dtype},
            dtype=doc.dtype,
            tied=[[a, k] for a, k in sorted(doc.tied.items())],
            created_at=_ts(doc.created_at),
            created_by=doc.created_by,
            stage="committed",
            tensor_count=0,
        )
        s.add(release)
        s.flush()
        s.add_all(ReleaseFile.of(release.id or 0, f) for f in files)


def _unlisted_files(ctx: Context, doc: ReleaseDocument) -> list[FileRecord]:
    """A signed release's model.sig (release.json cannot list it), and the statement and card
    a later `reg sign-release` added beside the listed files, each kept only where model.sig
    names its digest (anyone who can write the store could put a file there): kept as files of
    the release, so a pull still carries them and a pinned key still verifies the folder.
    Which key signed is not recovered (keys live in the catalog): `reg verify --provenance`
    reports it unsigned."""
    prefix = release_prefix(doc.model, doc.version)
    listed = {f.path for f in doc.files}
    signature = _small_object(ctx, prefix + SIGNATURE_FILE)
    if signature is None:
        return []  # unsigned: what a killed signing left is no file of the release
    found = [_record(SIGNATURE_FILE, *signature)]
    try:
        claimed = claimed_digests(signature[0])
    except IntegrityError:
        return found
    for name in (PROVENANCE_FILE, CARD_FILE):
        got = _small_object(ctx, prefix + name) if name not in listed else None
        if got is not None and hashlib.sha256(got[0]).hexdigest() == claimed.get(name):
            found.append(_record(name, *got))
    return found


def _small_object(ctx: Context, key: str) -> tuple[bytes, str | None] | None:
    info = ctx.store.head(key)
    if info is None or info.size > MAX_SIGNATURE:
        return None
    return bytes(ctx.store.get_bytes(key, version=info.version_id)), info.version_id


def _record(name: str, data: bytes, version: str | None) -> FileRecord:
    return FileRecord(name, len(data), hashlib.sha256(data).hexdigest(), version=version)


def _source_row(session: Session, doc: ReleaseDocument) -> Checkpoint:
    """The release's source checkpoint; a tombstone keeps the lineage if it was collected."""
    source = doc.source.ref
    _, run_row = queries.get_or_create_run(session, source.project, source.run)
    ckpt = session.exec(
        select(Checkpoint).where(Checkpoint.run_id == run_row.id, Checkpoint.step == source.step)
    ).first()
    if ckpt is None:
        ckpt = Checkpoint(
            run_id=run_row.id or 0,
            step=source.step or 0,
            state=DELETED,
            created_at=now(),
            pushed_by="unknown",
            deleted_at=now(),
            delete_reason="not in the store at catalog rebuild",
            manifest_sha256=doc.source.manifest_sha256,
            world_size=doc.source.world_size,
        )
        session.add(ckpt)
        session.flush()
    return ckpt
