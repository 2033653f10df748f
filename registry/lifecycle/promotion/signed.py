"""Signing at promotion: before release.json, the provenance statement and the model
card are stored as files of the release; after it, `model.sig` over every file (release.json
included), signed with the active key of this process (`registry.trust.release_signing.keys`).

Everything written is deterministic for one release (the times are the release row's), so a
killed promotion's rerun finds the same objects put-if-absent, with two exceptions, both kept
from the earlier attempt (store objects are never replaced): the statement, where only the reg
version it names differs (reg upgraded between the kill and the rerun), and the signature
(ECDSA signs with a fresh nonce), where a known key not revoked signed exactly the same files,
even one rotated out since.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from registry.catalog.models import ReleaseSignature
from registry.core.layout import RELEASE_DOCUMENT, release_prefix
from registry.core.timeutil import iso, now
from registry.errors import Conflict, GateNotMet, IntegrityError, ObjectExists
from registry.formats.documents import FileRecord
from registry.lifecycle.transfer import OnMismatch, put_reconciled
from registry.trust import signed_facts as facts
from registry.trust.release_signing import bundle, keys, provenance

if TYPE_CHECKING:
    from registry.lifecycle.context import Context
    from registry.lifecycle.promotion.plan import PromotionPlan
    from registry.lifecycle.promotion.records import Reservation


@dataclass(frozen=True)
class Signer:
    key: keys.SigningKey
    private_key: Path


def signer_for(ctx: Context, *, required: bool = False) -> Signer | None:
    """The key this promotion signs with, or None where the policy lets it go unsigned:
    `require_signature = "auto"` signs behind `reg server` always, embedded where a key is
    active. Checked before any validation work. `required`: a signing that is the whole point
    (`reg sign-release`), whatever the policy."""
    policy = ctx.policy.promotion.require_signature
    if policy is False and not required:
        return None
    with ctx.catalog.session() as s:
        key = keys.active(s, ctx.audit_key)
    if key is None:
        if required:
            raise GateNotMet(
                "no active signing key to sign with",
                "an operator runs `reg keys create` where reg server runs (embedded: here)",
            )
        if policy is True or ctx.server:
            raise GateNotMet(
                "refusing to promote: no active signing key, and this registry signs every "
                "release (policy [promotion] require_signature)",
                "an operator runs `reg keys create` where reg server runs",
            )
        return None
    path = keys.private_key_path(ctx, key.key_id)
    keys.check_pair(path, key)
    return Signer(key, path)


def add_provenance(
    ctx: Context,
    plan: PromotionPlan,
    reservation: Reservation,
    files: list[FileRecord],
    created: tuple[float, str],
) -> list[FileRecord]:
    """Store the provenance statement and the model card (unless an extra is named README.md):
    their records, to be listed in release.json with the rest."""
    name = f"{plan.model}:v{reservation.version}"
    at = iso(created[0]) or ""
    doc = provenance.statement(
        release=name,
        files=files,
        source=f"{plan.source.project}/{plan.source.run}@step{plan.source.step}",
        manifest_sha256=plan.checkpoint.manifest_sha256 or "",
        world_size=plan.checkpoint.world_size,
        options={
            "layout": plan.resume.layout,
            "model_path": plan.resume.model_path,
            "strip_prefix": plan.strip_prefix or None,
            "convert": plan.convert,
            "dtype": plan.dtype,
            "forced_layout": plan.layout,
        },
        validation=provenance.validation_record(reservation.validation),
        created_at=at,
        created_by=created[1],
    )
    return store_generated(ctx, release_prefix(plan.model, reservation.version), doc, files)


def store_generated(
    ctx: Context, prefix: str, doc: dict[str, Any], files: list[FileRecord]
) -> list[FileRecord]:
    """Store the statement `doc` and, unless an extra of that name is among `files`, the model
    card made from it, put-if-absent under `prefix`; their records. A killed attempt's
    statement that differs only in the reg version it names is kept (and the card made from
    it)."""
    data = provenance.to_bytes(doc)
    key = prefix + provenance.PROVENANCE_FILE
    info = ctx.store.head(key)
    if info is not None and info.size <= provenance.MAX_PROVENANCE:  # a killed attempt's
        earlier = bytes(ctx.store.get_bytes(key, version=info.version_id))
        if _only_version_differs(earlier, doc):  # (an upgrade between the kill and the rerun)
            doc, data = json.loads(earlier), earlier
    out = [_put(ctx, prefix, provenance.PROVENANCE_FILE, data)]
    if all(f.path != provenance.CARD_FILE for f in files):
        out.append(_put(ctx, prefix, provenance.CARD_FILE, provenance.card(doc)))
    return out


VERSION = re.compile(r"[0-9][0-9A-Za-z.+-]{0,63}")  # what reg_version() can say


def _only_version_differs(earlier: bytes, doc: dict[str, Any]) -> bool:
    """Is `earlier` (stored under the release's prefix before this attempt) the statement reg
    wrote for `doc`, naming another reg version only? Its bytes must be reg's own rendering
    of it (no duplicate keys, no other spelling: what a reader parses is what was compared),
    and the version, in both places, a version: whoever can write the store but not the
    catalog must not choose a single byte of what the key signs."""
    try:
        parsed = json.loads(earlier)
        build = parsed["predicate"]["buildDefinition"]
        version = build["internalParameters"]["reg_version"]
        wanted = (build["internalParameters"], parsed["predicate"]["runDetails"]["builder"])
    except (ValueError, KeyError, TypeError):
        return False
    if not isinstance(version, str) or not VERSION.fullmatch(version):
        return False
    if wanted != (
        {"reg_version": version},
        {"id": provenance.BUILDER, "version": {"reg": version}},
    ):
        return False
    if provenance.to_bytes(parsed) != earlier:
        return False
    ours = json.loads(json.dumps(doc))
    ours["predicate"]["buildDefinition"]["internalParameters"] = wanted[0]
    ours["predicate"]["runDetails"]["builder"] = wanted[1]
    return bool(ours == parsed)


def record(
    ctx: Context, session: Any, release_id: int, files: list[FileRecord], key_id: str
) -> None:
    """Add the release's signature record (which key signed `files`' model.sig, and the
    digests of it and of the statement), with the server's MAC where it holds the key."""
    by_path = {f.path: f for f in files}
    row = ReleaseSignature(
        release_id=release_id,
        key_id=key_id,
        sha256=by_path[bundle.SIGNATURE_FILE].sha256,
        provenance_sha256=by_path[provenance.PROVENANCE_FILE].sha256,
        signed_at=now(),
        signed_by=ctx.actor,
    )
    session.add(row)
    if ctx.audit_key is not None:
        session.flush()
        facts.sign(
            session,
            ctx.audit_key,
            facts.RELEASE_SIGNATURE,
            row.id or 0,
            facts.release_signature_content(row),
            signed_by=ctx.actor,
        )


def sign(
    ctx: Context,
    plan: PromotionPlan,
    reservation: Reservation,
    files: list[FileRecord],
    document_sha256: str,
    signer: Signer,
) -> tuple[FileRecord, str]:
    """Store `model.sig` over `files` and release.json, with the key still active (a
    promotion can take hours: one retired or revoked meanwhile signs nothing): its record and
    the id of the key that signed it."""
    digests = {f.path: f.sha256 for f in files}
    digests[RELEASE_DOCUMENT] = document_sha256
    name = f"{plan.model}:v{reservation.version}"
    return sign_digests(ctx, signer, name, release_prefix(plan.model, reservation.version), digests)


def sign_digests(
    ctx: Context, signer: Signer, name: str, prefix: str, digests: dict[str, str]
) -> tuple[FileRecord, str]:
    """Store `prefix`/model.sig over `digests` (every other file of release `name`), with the
    key still active (work before it can take hours: a key retired or revoked meanwhile
    signs nothing): its record and the id of the key that signed it."""
    with ctx.catalog.session() as s:
        now_key = keys.find(s, signer.key.key_id, ctx.audit_key)
    if now_key is None or now_key.state != keys.ACTIVE:
        raise Conflict(
            f"signing key {signer.key.key_id[:16]} was retired or revoked while {name} was "
            "being signed",
            "run it again: it signs with the active key",
        )
    key = prefix + bundle.SIGNATURE_FILE
    data = bundle.sign(signer.private_key, name, digests)
    try:
        put = ctx.store.put_bytes(key, data, immutable=True)
        record = FileRecord(bundle.SIGNATURE_FILE, put.size, put.sha256, version=put.version)
        return record, signer.key.key_id
    except ObjectExists:  # an earlier attempt's: kept if a key not revoked signed these files
        return _earlier(ctx, key, digests)


def _earlier(ctx: Context, key: str, digests: dict[str, str]) -> tuple[FileRecord, str]:
    """A killed attempt's model.sig (immutable: never replaced), kept where a known key that
    is not revoked signed exactly these files; the key may have rotated since."""
    info = ctx.store.head(key)
    if info is None or info.size > bundle.MAX_SIGNATURE:
        raise Conflict(f"{key} is not a signature", "reg fsck shows the release")
    earlier = bytes(ctx.store.get_bytes(key, version=info.version_id))
    with ctx.catalog.session() as s:
        candidates = [k for k in keys.all_keys(s, ctx.audit_key) if k.state != keys.REVOKED]
    for candidate in candidates:
        try:
            if bundle.signed_digests(earlier, candidate.public_pem) == digests:
                record = FileRecord(
                    bundle.SIGNATURE_FILE,
                    len(earlier),
                    hashlib.sha256(earlier).hexdigest(),
                    version=info.version_id,
                )
                return record, candidate.key_id
        except IntegrityError:
            continue
    raise Conflict(
        f"{key} holds another signature than this promotion's",
        "an earlier attempt signed other files, or with a key revoked since; reg fsck shows it",
    )


def _put(ctx: Context, prefix: str, name: str, data: bytes) -> FileRecord:
    stored = put_reconciled(
        ctx.store, prefix + name, data=data, immutable=True, on_mismatch=OnMismatch.CONFLICT
    )
    return FileRecord(name, stored.size, stored.sha256, version=stored.version)
