"""Which facts the server decides from do not prove themselves (`registry.trust.signed_facts`): what
`reg audit verify` and `reg fsck` report, where the audit key is at hand.

    policy-unsigned      a policy document without a signature
    policy-forged        ... whose signature does not verify, or whose text is not its digest
    policy-unproven      the policy in force cannot be established (its sealed apply event names
                         a row that is missing, unsigned or another document): the server decides
                         nothing until it is restored or re-applied
    validation-unsigned  an attested validation without a signature
    validation-forged    ... whose signature does not verify (the row, or its checkpoint, changed)
    model-unsigned       a model's owner without a signature
    model-forged         ... whose signature does not verify
    deletion-unsigned    a checkpoint marked `deleting` without GC's signature: the server does
                         not carry it out (embedded `reg gc` on the host does, or a person
                         sets it back)
    deletion-forged      ... whose signature does not verify
    signing_key-unsigned a signing key's event (created, retired, revoked) written around the
                         server: behind it, that event counts for nothing
    release_sig-unsigned a release's signature record written around the server
    alias_request-unsigned, alias_decision-unsigned  a protected alias's request, or a decision
                         on one, written around the server: behind it, it counts for nothing
    (each also -forged)
    signature-forged     a signature row that verifies for no row

Rows from before signed facts are `*-unsigned` until `reg catalog sign` (run on the server's
host, with the key) checks and signs them. Unattested validations (an embedded registry's) and
models without an owner decide nothing behind the server and are not reported.
"""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING, Any

from sqlmodel import Session, col, select

from registry.catalog.models import (
    DELETING,
    Checkpoint,
    FactMac,
    Model,
    PolicyDocument,
    Project,
    ReleaseSignature,
    Run,
    SigningKeyEvent,
    Validation,
)
from registry.catalog.workflow_models import AliasDecision, AliasRequest
from registry.trust import signed_facts as facts
from registry.trust.audit_chain.macs import same
from registry.trust.proven_policy import prove

if TYPE_CHECKING:
    from registry.storage.base import BaseStore


def fact_problems(session: Session, store: BaseStore, key: bytes) -> list[dict[str, Any]]:
    """[{kind, target, message}] for every fact that does not prove itself."""
    signatures: dict[tuple[str, int], list[str]] = defaultdict(list)
    for row in session.exec(select(FactMac)):
        signatures[(row.kind, row.row_id)].append(row.mac)
    out: list[dict[str, Any]] = []
    used: set[tuple[str, int]] = set()

    def judge(kind: str, row_id: int, content: dict[str, Any] | None, target: str) -> None:
        found = signatures.get((kind, row_id), [])
        used.add((kind, row_id))
        if content is not None and any(
            same(m, facts.mac(key, kind, row_id, content)) for m in found
        ):
            return
        why = (
            "has no signature: written around the server, or before signed facts (reg catalog "
            "sign checks and signs those)"
            if not found and content is not None
            else "has no valid signature: the row (or what it names) was changed, or the "
            "signature forged"
        )
        state = "unsigned" if not found and content is not None else "forged"
        out.append({"kind": f"{kind}-{state}", "target": target, "message": f"{target} {why}"})

    for p in session.exec(select(PolicyDocument)):
        content = facts.policy_content(p) if facts.policy_intact(p) else None
        judge(facts.POLICY, p.id or 0, content, f"policy v{p.version}")
    subjects = _subjects(session)
    for v in session.exec(select(Validation).where(col(Validation.attested))):
        subject = subjects.get(v.checkpoint_id, {"checkpoint_id": v.checkpoint_id})
        ref = f"{subject.get('project')}/{subject.get('run')}@step{subject.get('step')}"
        content = facts.validation_content(v, subject)
        judge(facts.VALIDATION, v.id or 0, content, f"validation {v.id} of {ref}")
    for c in session.exec(select(Checkpoint).where(Checkpoint.state == DELETING)):
        subject = facts.subject_of(session, c.id or 0)
        ref = f"{subject.get('project')}/{subject.get('run')}@step{subject.get('step')}"
        judge(facts.DELETION, c.id or 0, facts.deletion_content(c, subject), f"deletion of {ref}")
    for m in session.exec(select(Model).where(col(Model.project).is_not(None))):
        judge(facts.MODEL, m.id or 0, facts.model_content(m), f"model {m.name} (owner {m.project})")
    for e in session.exec(select(SigningKeyEvent)):  # a key, or its retirement, unsigned: void
        target = f"signing key {e.key_id[:16]} {e.event}"
        judge(facts.SIGNING_KEY, e.id or 0, facts.signing_key_content(e), target)
    for r in session.exec(select(ReleaseSignature)):
        target = f"the signature record of release {r.release_id}"
        judge(facts.RELEASE_SIGNATURE, r.id or 0, facts.release_signature_content(r), target)
    for q in session.exec(select(AliasRequest)):
        target = f"alias request {q.id}"
        judge(facts.ALIAS_REQUEST, q.id or 0, facts.alias_request_content(q), target)
    for d in session.exec(select(AliasDecision)):
        target = f"decision {d.id} ({d.decision} by {d.by}) on alias request {d.request_id}"
        judge(facts.ALIAS_DECISION, d.id or 0, facts.alias_decision_content(d), target)
    for (kind, row_id), macs_ in signatures.items():
        if (kind, row_id) not in used and not _unjudged(session, kind, row_id):
            out.append(
                {
                    "kind": "signature-forged",
                    "target": f"{kind} {row_id}",
                    "message": f"{len(macs_)} signature(s) of {kind} {row_id}, which is no "
                    "such row",
                }
            )
    in_force = prove(session, store, key)
    if in_force.error is not None:
        out.append(
            {"kind": "policy-unproven", "target": "policy", "message": in_force.error.message}
        )
    return out


def _subjects(session: Session) -> dict[int, dict[str, Any]]:
    """Checkpoint id -> what a validation signature names of it, for every attested one."""
    rows = session.exec(
        select(Checkpoint, Run.name, Project.name)
        .join(Run, col(Run.id) == Checkpoint.run_id)
        .join(Project, col(Project.id) == Run.project_id)
        .where(
            col(Checkpoint.id).in_(select(Validation.checkpoint_id).where(col(Validation.attested)))
        )
    )
    return {
        c.id: {"project": p, "run": r, "step": c.step, "manifest_sha256": c.manifest_sha256}
        for c, r, p in rows
        if c.id is not None
    }


def _unjudged(session: Session, kind: str, row_id: int) -> bool:
    """A signature of a row that exists but decides nothing (an unattested validation, a model
    without owner): not a forgery."""
    if kind == facts.VALIDATION:
        return session.get(Validation, row_id) is not None
    if kind == facts.MODEL:
        return session.get(Model, row_id) is not None
    if kind == facts.DELETION:  # a deletion GC finished (the row is `deleted` now)
        return session.get(Checkpoint, row_id) is not None
    return False
