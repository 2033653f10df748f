"""A checkpoint's and a release's catalog rows as the lifecycles read them; `to_json()` is the
shape DESIGN §7 documents for `--json` (the typed results of `registry.api.results` read it)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlmodel import Session, col, select

from registry.catalog.models import (
    DELETED,
    DELETING,
    Alias,
    Checkpoint,
    Model,
    Release,
    ReleaseFile,
    ReleaseSignature,
    Validation,
)
from registry.core.layout import RELEASE_DOCUMENT
from registry.core.refs import CheckpointRef
from registry.core.timeutil import iso
from registry.formats.documents import FileRecord
from registry.trust import signed_facts as facts
from registry.trust.release_signing.keys import all_keys


@dataclass(frozen=True, slots=True)
class CheckpointView:
    ref: CheckpointRef
    row: Checkpoint
    files: tuple[FileRecord, ...]

    @classmethod
    def of(
        cls, project: str, run: str, row: Checkpoint, files: Sequence[FileRecord]
    ) -> CheckpointView:
        return cls(CheckpointRef(project, run, row.step), row, tuple(files))

    def to_json(self) -> dict[str, Any]:
        row = self.row
        return {
            "ref": str(self.ref),
            "project": self.ref.project,
            "run": self.ref.run,
            "step": row.step,
            "world_size": row.world_size,
            "state": row.state,
            "bytes": row.bytes,
            "files": [f.to_json() for f in self.files],
            # Resume state is decided from the key paths under the policy in force: callers
            # add `resume_facts.resume_json` (these are the push-time values, its fallback).
            "layout": None,
            "resumable": row.resumable,
            "missing_state": list(row.missing_state),
            "pinned": row.pinned,
            "created_at": iso(row.committed_at or row.created_at),
            "upload_seconds": row.upload_seconds,
        }

    def detail_json(self, uri: str) -> dict[str, Any]:
        """`reg show`: everything the catalog knows about the checkpoint."""
        row = self.row
        out = self.to_json()
        for shown, f in zip(out["files"], self.files, strict=True):
            shown["rank"] = f.rank
        out.update(
            world_size_inferred=row.world_size_inferred,
            tensor_count=row.tensor_count,
            tensor_bytes=row.tensor_bytes,
            metrics=row.metrics,
            pushed_by=row.pushed_by,
            pin_reason=row.pin_reason,
            manifest_sha256=row.manifest_sha256,
            digests_reported_by=row.digests_reported_by,
            verified=verified_json(row.verified_at, row.verify_findings),
            uri=uri,
        )
        if row.state in (DELETING, DELETED):
            out.update(
                deleted_at=iso(row.deleted_at),
                deleted_by=row.deleted_by,
                delete_reason=row.delete_reason,
            )
        return out


UNVERIFIED = "unverified"  # a signature record without the server's MAC (`reg fsck` names it)


@dataclass(frozen=True, slots=True)
class ReleaseView:
    model: Model
    row: Release
    files: tuple[FileRecord, ...]
    aliases: tuple[str, ...]
    validation: Validation | None
    signature: ReleaseSignature | None = None
    # of the signing key: active, retired, revoked, unknown; unverified: the record lacks the
    # server's MAC (behind the server only; `reg verify --provenance` fails it)
    key_state: str | None = None

    @property
    def name(self) -> str:
        return f"{self.model.name}:v{self.row.version}"

    @classmethod
    def load(
        cls,
        session: Session,
        model: Model,
        release: Release,
        audit_key: bytes | None = None,
        key_states: dict[str, str] | None = None,
    ) -> ReleaseView:
        """The release as the catalog has it; `audit_key` (behind the server): the signing
        key's state from events the server signed only. `key_states` (key id -> state): the
        keys as a caller loading many releases read them once (`signing_key_states`)."""
        files = session.exec(
            select(ReleaseFile)
            .where(ReleaseFile.release_id == release.id)
            .order_by(col(ReleaseFile.path))
        ).all()
        aliases = session.exec(
            select(Alias.name).where(Alias.release_id == release.id).order_by(col(Alias.name))
        ).all()
        validation = (
            session.get(Validation, release.validation_id) if release.validation_id else None
        )
        signature = session.exec(
            select(ReleaseSignature).where(ReleaseSignature.release_id == release.id)
        ).first()
        key_state = None
        if signature is not None:
            states = key_states
            if states is None:
                states = signing_key_states(session, audit_key)
            key_state = states.get(signature.key_id, "unknown")
            content = {signature.id or 0: facts.release_signature_content(signature)}
            if audit_key is not None and not facts.signed_ids(
                session, audit_key, facts.RELEASE_SIGNATURE, content
            ):
                key_state = UNVERIFIED  # a record written around the server: no MAC
        return cls(
            model,
            release,
            tuple(f.record() for f in files),
            tuple(aliases),
            validation,
            signature,
            key_state,
        )

    def document_record(self) -> FileRecord | None:
        """release.json as a file of the release (`release_document`)."""
        added = self.signature.added_bytes if self.signature is not None else 0
        return release_document(self.row, self.files, added)

    def to_json(self, uri: str | None = None) -> dict[str, Any]:
        row, v = self.row, self.validation
        out: dict[str, Any] = {
            "release": self.name,
            "model": self.model.name,
            "version": row.version,
            "sha256": row.sha256,
            "files": [f.to_json() for f in self.files],
            "source": row.source_ref,
            "aliases": list(self.aliases),
            "status": row.status,
            "status_reason": row.status_reason,
            "bytes": row.bytes,
            "tensor_count": row.tensor_count,
            "dtype": row.dtype,
            "tied": row.tied,
            "created_at": iso(row.created_at),
            "created_by": row.created_by,
            "validation": {
                "id": v.id,
                "passed": v.passed,
                "device": v.device,
                "device_name": v.device_name,
                "mode": v.mode,
                "seconds": v.seconds,
            }
            if v
            else None,
        }
        out["verified"] = verified_json(row.verified_at, row.verify_findings)
        sig = self.signature
        out["signature"] = (
            None
            if sig is None
            else {
                "key_id": sig.key_id,
                "key_state": self.key_state,
                "sha256": sig.sha256,
                "provenance_sha256": sig.provenance_sha256,
                "signed_at": iso(sig.signed_at),
                "signed_by": sig.signed_by,
            }
        )
        options = row.options if isinstance(row.options, dict) else {}
        for key in ("convert", "base"):  # only where a promotion set them
            if options.get(key) is not None:
                out[key] = options[key]
        if uri is not None:
            out["uri"] = uri
        return out


def release_document(
    row: Release, files: Sequence[FileRecord], added_bytes: int
) -> FileRecord | None:
    """release.json as a file of the release whose recorded files are `files`: its size is
    what the catalog counted beyond the files the promotion committed (`added_bytes`, those
    `reg sign-release` added later, are counted apart: migration 0018). None for a release
    not committed."""
    if not row.sha256:
        return None
    size = row.bytes - (sum(f.size for f in files) - added_bytes)
    return FileRecord(RELEASE_DOCUMENT, size, row.sha256, version=row.document_version)


def signing_key_states(session: Session, audit_key: bytes | None) -> dict[str, str]:
    """Every signing key's state (behind the server: from the events it signed)."""
    return {k.key_id: k.state for k in all_keys(session, audit_key)}


def verified_json(at: float | None, findings: list[dict[str, str]] | None) -> dict[str, Any] | None:
    """The last re-hash of every stored byte (`reg verify`, a scrub); None: never since push."""
    if at is None:
        return None
    return {"at": iso(at), "ok": not findings, "problems": list(findings or [])}
