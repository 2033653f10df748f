"""Facts the catalog cannot forge (DESIGN §10): the rows `reg server` decides from carry a MAC
under its audit key, as tokens (`trust.tokens`) and audit events (`trust.audit_chain`) do.

    policy      a policy document: who may do what (its version, text digest, applier, time)
    validation  a recorded validation: the GPU gate (its checkpoint's ref and manifest digest,
                device, checks, model path, who and when)
    model       a model's owner: which project's grants cover it (`policies.access`)
    deletion    GC's mark on a checkpoint it is deleting: what lets the server finish a deletion
                an interrupted GC left (a mark written around it would delete any checkpoint)
    signing_key a release signing key's event (created with its public key, retired, revoked):
                behind the server a key whose creation is not signed is no key
    release_sig which key signed a release, and the digests of its model.sig and provenance
    alias_request   a protected alias's move asked for: by whom, to which version, until when
    alias_decision  an approval, rejection or cancellation of one: behind the server an
                unsigned approval never counts towards a move

Each signature is a row of the append-only `fact_mac` table: HMAC-SHA256(key, "reg.fact/1\\n" +
canonical JSON of {kind, id, content}). It names the signed row's id, so a signature cannot be
moved to another row, and covers everything the decision reads, so an edited row no longer
verifies. Whoever can write the catalog without the key (the runtime role, the owner) can add
rows but not signatures: behind the server an unsigned or forged row never grants; it is
logged, and `reg audit verify` and `reg fsck` name it. Embedded mode is unchanged (identity
there is advisory); an embedded process that holds the key (an operator on the server's host)
signs what it writes.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from sqlmodel import Session, col, select

from registry.catalog.models import (
    Checkpoint,
    FactMac,
    Model,
    PolicyDocument,
    Project,
    ReleaseSignature,
    Run,
    SigningKeyEvent,
)
from registry.core.timeutil import now
from registry.trust.audit_chain.macs import canonical, normalized, same

if TYPE_CHECKING:
    from registry.catalog.engine import Catalog
    from registry.catalog.models import Validation
    from registry.catalog.workflow_models import AliasDecision, AliasRequest

log = logging.getLogger("reg.policy")

POLICY, VALIDATION, MODEL, DELETION = "policy", "validation", "model", "deletion"
SIGNING_KEY, RELEASE_SIGNATURE = "signing_key", "release_sig"  # migration 0017
ALIAS_REQUEST, ALIAS_DECISION = "alias_request", "alias_decision"  # migration 0019
KINDS = (
    POLICY,
    VALIDATION,
    MODEL,
    DELETION,
    SIGNING_KEY,
    RELEASE_SIGNATURE,
    ALIAS_REQUEST,
    ALIAS_DECISION,
)
_IN = 500  # ids per IN (...) query


def policy_content(row: PolicyDocument) -> dict[str, Any]:
    """What a policy signature covers; the text is covered through its sha256, which a reader
    checks against the text itself (`policy_intact`)."""
    return {
        "version": row.version,
        "sha256": row.sha256,
        "applied_at": row.applied_at,
        "applied_by": row.applied_by,
    }


def policy_intact(row: PolicyDocument) -> bool:
    return hashlib.sha256(row.text.encode()).hexdigest() == row.sha256


def model_content(row: Model) -> dict[str, Any]:
    return {"name": row.name, "project": row.project, "created_at": row.created_at}


def validation_fact(row: Validation) -> dict[str, Any]:
    """A validation's fact: the row's columns (and its id, which release.json names), as the
    journal records them and its signature covers them."""
    return {
        "validation_id": row.id,
        "passed": row.passed,
        "device": row.device,
        "device_name": row.device_name,
        "torch_version": row.torch_version,
        "world_size": row.world_size,
        "seconds": row.seconds,
        "phases": row.phases,
        "checks": row.checks,
        "attested": row.attested,
        "model_path": row.model_path,
        "mode": row.mode,
        "driver": row.driver,
    }


def validation_content(row: Validation, subject: Mapping[str, Any]) -> dict[str, Any]:
    """What a validation signature covers: everything the gate and release.json read, and the
    checkpoint it validated by ref and manifest digest (`subject_of`), so the row cannot be
    pointed at another checkpoint, or at this one's row after a different push."""
    fact = validation_fact(row)  # its columns, as the journal records them
    del fact["validation_id"]  # the signature names the row by id already
    return normalized(
        {
            **fact,
            "checkpoint": dict(subject),
            "created_at": row.created_at,
            "created_by": row.created_by,
        }
    )


def signing_key_content(row: SigningKeyEvent) -> dict[str, Any]:
    return {
        "key_id": row.key_id,
        "event": row.event,
        "public_pem": row.public_pem,
        "reason": row.reason,
        "at": row.at,
        "by": row.by,
    }


def release_signature_content(row: ReleaseSignature) -> dict[str, Any]:
    return {
        "release_id": row.release_id,
        "key_id": row.key_id,
        "sha256": row.sha256,
        "provenance_sha256": row.provenance_sha256,
        "signed_at": row.signed_at,
        "signed_by": row.signed_by,
        # only where `reg sign-release` added the files: the MACs made before 0018 still hold
        **({"added_bytes": row.added_bytes} if row.added_bytes else {}),
    }


def alias_request_content(row: AliasRequest) -> dict[str, Any]:
    return {
        "model_id": row.model_id,
        "alias": row.alias,
        "version": row.version,
        "release_id": row.release_id,
        "requested_by": row.requested_by,
        "requested_at": row.requested_at,
        "expires_at": row.expires_at,
        "approvals_needed": row.approvals_needed,
        "rule": row.rule,
    }


def alias_decision_content(row: AliasDecision) -> dict[str, Any]:
    return {
        "request_id": row.request_id,
        "decision": row.decision,
        "by": row.by,
        "at": row.at,
        "reason": row.reason,
    }


def deletion_content(row: Checkpoint, subject: Mapping[str, Any]) -> dict[str, Any]:
    """What a deletion mark's signature covers: the checkpoint (`subject_of`) and the mark."""
    return {
        "checkpoint": dict(subject),
        "deleted_at": row.deleted_at,
        "deleted_by": row.deleted_by,
        "delete_reason": row.delete_reason,
    }


def deletion_is_signed(session: Session, key: bytes, row: Checkpoint) -> bool:
    assert row.id is not None
    content = deletion_content(row, subject_of(session, row.id))
    return row.id in signed_ids(session, key, DELETION, {row.id: content})


def subject_of(session: Session, checkpoint_id: int) -> dict[str, Any]:
    """The checkpoint a validation names: project, run, step and manifest digest."""
    found = session.exec(
        select(Project.name, Run.name, Checkpoint.step, Checkpoint.manifest_sha256)
        .join(Run, col(Run.project_id) == col(Project.id))
        .join(Checkpoint, col(Checkpoint.run_id) == col(Run.id))
        .where(col(Checkpoint.id) == checkpoint_id)
    ).first()
    if found is None:
        return {"checkpoint_id": checkpoint_id}
    project, run, step, manifest = found
    return {"project": project, "run": run, "step": step, "manifest_sha256": manifest}


def mac(key: bytes, kind: str, row_id: int, content: Mapping[str, Any]) -> str:
    body = canonical({"kind": kind, "id": row_id, "content": content})
    return hmac.new(key, b"reg.fact/1\n" + body, hashlib.sha256).hexdigest()


def sign(
    session: Session,
    key: bytes,
    kind: str,
    row_id: int,
    content: Mapping[str, Any],
    *,
    signed_by: str,
) -> None:
    """Add the signature of row `row_id` (flushed, so it has its id) to the caller's
    transaction: the row and its signature commit together."""
    session.add(
        FactMac(
            kind=kind,
            row_id=row_id,
            mac=mac(key, kind, row_id, content),
            signed_at=now(),
            signed_by=signed_by,
        )
    )


def signed_ids(
    session: Session, key: bytes, kind: str, contents: Mapping[int, Mapping[str, Any]]
) -> set[int]:
    """The ids among `contents` (row id -> content) with a signature that verifies."""
    out: set[int] = set()
    ids = sorted(contents)
    for start in range(0, len(ids), _IN):
        chunk = ids[start : start + _IN]
        rows = session.exec(
            select(FactMac.row_id, FactMac.mac).where(
                FactMac.kind == kind, col(FactMac.row_id).in_(chunk)
            )
        )
        for row_id, signature in rows:
            if row_id not in out and same(signature, mac(key, kind, row_id, contents[row_id])):
                out.add(row_id)
    return out


def signatures_of(session: Session, kind: str, ids: Iterable[int]) -> set[int]:
    """The ids among `ids` that have any signature row at all (valid or not)."""
    wanted = sorted(set(ids))
    out: set[int] = set()
    for start in range(0, len(wanted), _IN):
        chunk = wanted[start : start + _IN]
        out.update(
            session.exec(
                select(FactMac.row_id).where(FactMac.kind == kind, col(FactMac.row_id).in_(chunk))
            )
        )
    return out


def model_is_signed(session: Session, key: bytes, model: Model) -> bool:
    assert model.id is not None
    return model.id in signed_ids(session, key, MODEL, {model.id: model_content(model)})


def validations_signed(session: Session, key: bytes, rows: Iterable[Validation]) -> set[int]:
    """The ids of `rows` whose signature verifies against their checkpoint as it is now."""
    contents = {
        v.id: validation_content(v, subject_of(session, v.checkpoint_id))
        for v in rows
        if v.id is not None
    }
    return signed_ids(session, key, VALIDATION, contents)


def model_owners(session: Session, key: bytes | None) -> dict[str, str | None]:
    """Every model's owning project; with `key` (behind the server) only signed owners, the
    others None (unknown)."""
    rows = [m for m in session.exec(select(Model)) if m.id is not None]
    if key is None:
        return {m.name: m.project for m in rows}
    good = signed_ids(session, key, MODEL, {m.id: model_content(m) for m in rows if m.id})
    return {m.name: m.project if m.id in good else None for m in rows}


def attested_validations(
    catalog: Catalog, key: bytes | None, source: str, rows: list[Validation]
) -> list[Validation]:
    """Behind the server, the validations of checkpoint `source` the gate may count: attested
    by a validator and proven by a signature over what they say and the checkpoint (ref,
    manifest digest) they validated. A row written around the server, or altered, is logged
    and ignored."""
    attested = [v for v in rows if v.attested]
    if not attested:
        return []
    good: set[int] = set()
    if key is not None:
        with catalog.session() as s:
            good = validations_signed(s, key, attested)
    for v in attested:
        if v.id not in good:
            log.warning(
                json.dumps(
                    {
                        "validation": v.id,
                        "checkpoint": source,
                        "ignored": "attested, but unsigned or its signature does not verify "
                        "(written around the server, or altered)",
                    }
                )
            )
    return [v for v in attested if v.id in good]
