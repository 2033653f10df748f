"""`reg sign-release MODEL:vK`: sign a release committed before signing existed.

An admin's call, run where the private key is (the server, or embedded `REG_HOME`):

1. every stored byte of the release (release.json included) is re-hashed against the catalog;
   one that differs refuses the signing, which would otherwise vouch for altered bytes;
2. the provenance statement (from the catalog: the source checkpoint and its manifest digest,
   the validation, the promotion's options, the release's own time and author) and the model
   card are stored put-if-absent beside the release's files (`release.json` is immutable and
   cannot list them; a pull carries them as files of the release all the same);
3. `model.sig` is stored over every file but itself, with the active key;
4. one transaction records the added files, the signature (with the bytes it added, migration
   0018, under the server's MAC), the audit event and the mirror's event.

Everything stored is deterministic for one release, so a killed signing's rerun finds the same
objects (`promotion.signed` reconciles a statement that differs only in the reg version, and a
signature by another key not revoked). Nothing stored is ever replaced.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

from sqlalchemy.exc import IntegrityError as DuplicateRow

from policies.access import Action
from registry.catalog.models import (
    YANKED,
    Checkpoint,
    CheckpointKeys,
    Project,
    Release,
    ReleaseFile,
    ReleaseSignature,
    Run,
)
from registry.core import faults
from registry.core.layout import RELEASE_DOCUMENT, release_prefix
from registry.core.timeutil import iso, now
from registry.errors import Conflict, GateNotMet, IntegrityError
from registry.formats.documents import ReleaseDocument
from registry.journal import outbox as events
from registry.lifecycle.promotion import signed
from registry.lifecycle.releases import resolve_release, stored_files, uri_of
from registry.lifecycle.verify import verify_files
from registry.lifecycle.views import UNVERIFIED, ReleaseView
from registry.trust import signed_facts as facts
from registry.trust.release_signing import bundle, provenance

if TYPE_CHECKING:
    from registry.core.progress import Progress
    from registry.core.refs import ReleaseRef
    from registry.formats.documents import FileRecord
    from registry.lifecycle.context import Context


def sign_release(ctx: Context, ref: ReleaseRef, progress: Progress | None = None) -> dict[str, Any]:
    """Sign release `ref` (see the module): the release as `reg show` gives it, with `added`,
    the files the signing stored, and `rehashed`, the bytes re-hashed first."""
    ctx.authorize(Action.CATALOG, target=str(ref))  # a registry-wide admin: the key is too
    view, lineage = _release(ctx, ref)
    signer = signed.signer_for(ctx, required=True)
    assert signer is not None
    prefix = release_prefix(view.model.name, view.row.version)
    files = stored_files(view)
    checked = verify_files(
        ctx,
        prefix,
        files,
        name=view.name,
        scope={"model": view.model.name},
        repair=False,
        immutable=True,
        progress=progress,
    )
    if not checked["ok"]:
        first = checked["problems"][0]
        raise IntegrityError(
            f"{view.name} was not signed: {len(checked['problems'])} stored file(s) differ from "
            f"the catalog ({first['path']}: {first['problem']})",
            f"reg verify {view.name} --repair restores them from their recorded versions",
        )
    _agrees(ctx, view, lineage)
    doc = provenance.statement(
        release=view.name,
        files=list(view.files),
        created_at=iso(view.row.created_at) or "",
        created_by=view.row.created_by,
        signed_later=True,
        **lineage,
    )
    added = signed.store_generated(ctx, prefix, doc, list(view.files))
    digests = {f.path: f.sha256 for f in [*files, *added]}
    signature, key_id = signed.sign_digests(ctx, signer, view.name, prefix, digests)
    added.append(signature)
    faults.point("sign-release-signed")
    return {**_commit(ctx, view, added, key_id), "rehashed": checked["bytes"]}


def _release(ctx: Context, ref: ReleaseRef) -> tuple[ReleaseView, dict[str, Any]]:
    """The release, unsigned and not yanked, and what its statement says of its lineage."""
    with ctx.catalog.session() as s:
        model, release = resolve_release(s, ref)
        view = ReleaseView.load(s, model, release, ctx.audit_key)
        source = s.get(Checkpoint, release.source_checkpoint_id)
        run = s.get(Run, source.run_id) if source is not None else None
        owner = s.get(Project, run.project_id) if run is not None else None
        keys_row = s.get(CheckpointKeys, release.source_checkpoint_id)
    if view.key_state == UNVERIFIED:
        raise Conflict(
            f"{view.name} has a signature record without the server's MAC (written around the "
            "server): it cannot be signed while that record stands",
            "reg fsck names the record; an operator removes it at the database",
        )
    if view.signature is not None:
        raise Conflict(
            f"{view.name} is signed already (key {view.signature.key_id[:16]}, "
            f"{iso(view.signature.signed_at)})",
            f"reg verify {view.name} --provenance checks that signature",
        )
    if release.status == YANKED:
        raise Conflict(
            f"{view.name} was yanked ({release.status_reason}): a signature would vouch for it",
            "sign the releases still served",
        )
    if any(f.path == bundle.SIGNATURE_FILE for f in view.files):
        raise GateNotMet(
            f"{view.name} holds a model.sig the catalog has no record of (a rebuilt catalog): "
            "who signed it is not known here, and it cannot be signed again",
            "check the folder against the key you pinned: reg pull-release --verify-signature",
        )
    if release.options_key == "rebuilt":
        raise GateNotMet(
            f"{view.name} was recovered by `reg catalog rebuild`, which does not keep a "
            "promotion's options: its provenance would be incomplete",
            "promote its source again to make a signed release",
        )
    if source is None or run is None or owner is None:
        raise GateNotMet(
            f"{view.name}'s source checkpoint is not in the catalog: its provenance is unknown",
            "a release whose lineage is lost cannot be signed",
        )
    options = release.options if isinstance(release.options, dict) else {}
    lineage = {
        "source": f"{owner.name}/{run.name}@step{source.step}",
        "manifest_sha256": source.manifest_sha256 or "",
        "world_size": source.world_size,
        "options": {
            "layout": keys_row.layout if keys_row is not None else None,
            "model_path": options.get("model_path", "model"),
            "strip_prefix": options.get("strip_prefix") or None,
            "convert": options.get("convert"),
            "dtype": release.dtype,
            "forced_layout": options.get("layout"),
        },
        "validation": provenance.validation_record(view.validation) if view.validation else {},
    }
    return view, lineage


def _agrees(ctx: Context, view: ReleaseView, lineage: dict[str, Any]) -> None:
    """The release.json just re-hashed (immutable, what consumers hold) says what the catalog
    says: the same files, source and validation. A row added around the registry (a file, a
    lineage edited) is not signed."""
    data = ctx.store.get_bytes(
        release_prefix(view.model.name, view.row.version) + RELEASE_DOCUMENT,
        version=view.row.document_version,
    )
    if hashlib.sha256(data).hexdigest() != view.row.sha256:  # changed since the re-hash
        raise IntegrityError(f"{view.name}'s {RELEASE_DOCUMENT} changed while being signed")
    document = ReleaseDocument.from_bytes(bytes(data), f"{view.name} {RELEASE_DOCUMENT}")
    listed = sorted((f.path, f.size, f.sha256) for f in document.files)
    recorded = sorted((f.path, f.size, f.sha256) for f in view.files)
    validation = view.validation.id if view.validation is not None else None
    said = document.source.ref
    if (
        listed != recorded
        or f"{said.project}/{said.run}@step{said.step}" != lineage["source"]
        or (document.source.manifest_sha256 or "") != lineage["manifest_sha256"]
        or document.validation.id != validation
    ):
        raise IntegrityError(
            f"{view.name}: the catalog's record (files, source or validation) is not what its "
            f"{RELEASE_DOCUMENT} says: not signed",
            "reg fsck shows what differs",
        )


def _commit(
    ctx: Context, view: ReleaseView, added: list[FileRecord], key_id: str
) -> dict[str, Any]:
    by_path = {f.path: f for f in added}
    try:
        with ctx.catalog.session(write=True) as s:
            release = s.get(Release, view.row.id, with_for_update=True)  # a yank meanwhile?
            if release is None or release.status == YANKED:
                why = release.status_reason if release is not None else "gone"
                raise Conflict(
                    f"{view.name} was yanked while it was being signed ({why}): not signed",
                    "sign the releases still served",
                )
            s.add_all(ReleaseFile.of(view.row.id or 0, f) for f in added)
            row = ReleaseSignature(
                release_id=view.row.id or 0,
                key_id=key_id,
                sha256=by_path[bundle.SIGNATURE_FILE].sha256,
                provenance_sha256=by_path[provenance.PROVENANCE_FILE].sha256,
                signed_at=now(),
                signed_by=ctx.actor,
                added_bytes=sum(f.size for f in added),
            )
            s.add(row)
            s.flush()
            if ctx.audit_key is not None:
                facts.sign(
                    s,
                    ctx.audit_key,
                    facts.RELEASE_SIGNATURE,
                    row.id or 0,
                    facts.release_signature_content(row),
                    signed_by=ctx.actor,
                )
            ctx.audit(
                s, "sign-release", view.name, key_id=key_id, sha256=row.sha256, added=len(added)
            )
            ctx.events.emit(
                s, events.RELEASE_SIGNED, model=view.model.name, version=view.row.version
            )
            s.flush()
            out = ReleaseView.load(s, view.model, release, ctx.audit_key).to_json(
                uri_of(ctx, view.model.name, view.row.version)
            )
    except DuplicateRow:  # another admin signed it meanwhile (one signature per release)
        raise Conflict(
            f"{view.name} was signed by another call meanwhile",
            f"reg show {view.name} names the key",
        ) from None
    out["added"] = sorted(f.path for f in added)
    return out
