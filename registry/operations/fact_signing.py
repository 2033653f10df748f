"""`reg catalog sign`: the upgrade of a registry whose rows predate signed facts.

Behind the server, a policy document, an attested validation or a model's owner counts only
with a signature under the audit key (`registry.trust.signed_facts`); rows written before this reg
have none, so the server decides nothing (policy) or ignores them (validations, owners) until
an admin, on the server's host with the key, runs this once. It signs only what the registry's
own history vouches for, and names the rest. An audit event vouches only when it is authentic:
signed with the key (its MAC verifies), or, from before the key, sealed in a seal that verifies
(the genesis seal); an event inserted into the table by hand is neither.

- a policy document whose authentic `policy-apply` event names its version and digest;
- an attested validation whose authentic `validate` event names it, attested, by its recorder;
- a model owner equal to the project of the checkpoint its first version was promoted from,
  as that version's authentic `promote` event names it.

It seals what is pending first (the history from before the key vouches once it is in the
genesis seal). Then, if no sealed apply event proves the newest signed policy yet (events
from before the audit key were refused by the sealer), a signed `policy-sign` event names it,
and the log is sealed and anchored at once, so the server proves it on its next request.
Audited (`catalog-sign`); running it again signs nothing twice.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sqlmodel import Session, col, select

from policies.access import Action
from registry.catalog.models import (
    AuditEvent,
    Model,
    PolicyDocument,
    Validation,
)
from registry.core.refs import parse_checkpoint_ref
from registry.errors import RegistryError, UsageError
from registry.trust import signed_facts as facts
from registry.trust.audit_chain import macs
from registry.trust.audit_chain.keys import AuditKeyMissing
from registry.trust.audit_chain.service import seal_now
from registry.trust.proven_policy import apply_events, prove, sealed

if TYPE_CHECKING:
    from registry.lifecycle.context import Context


def sign_catalog(ctx: Context, *, dry_run: bool = False) -> dict[str, Any]:
    """{signed: {policy, validation, model: [targets]}, refused: [{target, reason}],
    policy_event, dry_run}."""
    ctx.authorize(Action.CATALOG, target="catalog sign")
    if ctx.server:
        raise UsageError(
            "reg catalog sign runs on the server's host, not through the server",
            "unset REG_URL; run it with the server's settings and REG_AUDIT_KEY_FILE",
        )
    key = ctx.audit_key
    if key is None:
        raise AuditKeyMissing(
            "reg catalog sign needs the server's audit key, which this process cannot read",
            "run it on the server's host (REG_AUDIT_KEY_FILE names the key file)",
        )
    # The history from before the key vouches once it is sealed: seal what is pending first,
    # as the server's sealer would within seconds (no fact changes by it).
    seal_now(ctx.catalog, ctx.store, key)
    signed: dict[str, list[str]] = {facts.POLICY: [], facts.VALIDATION: [], facts.MODEL: []}
    refused: list[dict[str, str]] = []
    policy_event: str | None = None
    with ctx.catalog.session(write=not dry_run) as s:
        for kind, row_id, content, target, problem in _unsigned(s, key):
            if problem is not None:
                refused.append({"target": target, "reason": problem})
                continue
            signed[kind].append(target)
            if not dry_run:
                facts.sign(s, key, kind, row_id, content, signed_by=ctx.actor)
        if not dry_run:
            s.flush()
            newest = _newest_signed_policy(s, key)
            if newest is not None and prove(s, ctx.store, key).version != newest.version:
                policy_event = f"policy v{newest.version}"
                ctx.audit(
                    s,
                    "policy-sign",
                    policy_event,
                    sha256=newest.sha256,
                    version=newest.version,
                    applied_by=newest.applied_by,
                )
            counts = {kind: len(v) for kind, v in signed.items()}
            ctx.audit(s, "catalog-sign", "catalog", refused=len(refused) or None, **counts)
    if not dry_run:
        seal_now(ctx.catalog, ctx.store, key)
    return {"signed": signed, "refused": refused, "policy_event": policy_event, "dry_run": dry_run}


def _unsigned(s: Session, key: bytes) -> list[tuple[str, int, dict[str, Any], str, str | None]]:
    """(kind, id, content, target, why not: None to sign) of every unsigned fact."""
    out: list[tuple[str, int, dict[str, Any], str, str | None]] = []
    policies = {p.id: p for p in s.exec(select(PolicyDocument)) if p.id is not None}
    has = facts.signatures_of(s, facts.POLICY, policies)
    applied = {(v, digest) for e, v, digest in apply_events(s) if _authentic(s, key, e)}
    for pid, p in sorted(policies.items()):
        if pid in has:
            continue  # signed (or forged: fact_findings names it; never signed over)
        target = f"policy v{p.version}"
        problem = (
            "its text is not its recorded digest"
            if not facts.policy_intact(p)
            else None
            if (p.version, p.sha256) in applied
            else "no policy-apply event of the audit log names this version and digest"
        )
        out.append((facts.POLICY, pid, facts.policy_content(p), target, problem))
    validations = {
        v.id: v for v in s.exec(select(Validation).where(col(Validation.attested))) if v.id
    }
    has = facts.signatures_of(s, facts.VALIDATION, validations)
    recorded = _validate_events(s, key)
    for vid, v in sorted(validations.items()):
        if vid in has:
            continue
        subject = facts.subject_of(s, v.checkpoint_id)
        target = f"validation {vid}"
        problem = (
            None
            if recorded.get(vid) == v.created_by
            else "no attested validate event of the audit log names it and its recorder"
        )
        out.append((facts.VALIDATION, vid, facts.validation_content(v, subject), target, problem))
    models = {m.id: m for m in s.exec(select(Model)) if m.id and m.project is not None}
    has = facts.signatures_of(s, facts.MODEL, models)
    for mid, m in sorted(models.items()):
        if mid in has:
            continue
        first = _first_promoted_from(s, key, m.name)
        problem = (
            None
            if first == m.project
            else f"its owner {m.project} is not the project its v1 was promoted from, as an "
            f"authentic promote event says ({first or 'none found'})"
        )
        out.append((facts.MODEL, mid, facts.model_content(m), f"model {m.name}", problem))
    return out


def _authentic(s: Session, key: bytes, event: AuditEvent) -> bool:
    """Signed with the key, or sealed in a verified seal (history from before the key)."""
    if event.mac is not None:
        return macs.event_signed(key, event)
    return sealed(s, key, event).seq is not None


def _validate_events(s: Session, key: bytes) -> dict[int, str]:
    """Validation id -> the actor of the authentic attested `validate` event that recorded it."""
    out: dict[int, str] = {}
    for e in s.exec(select(AuditEvent).where(AuditEvent.action == "validate")):
        details = e.details if isinstance(e.details, dict) else {}
        vid = details.get("validation_id")
        if (
            isinstance(vid, int)
            and details.get("attested")
            and e.outcome in ("allowed", "failed")
            and vid not in out
            and _authentic(s, key, e)
        ):
            out[vid] = e.actor
    return out


def _first_promoted_from(s: Session, key: bytes, model: str) -> str | None:
    """The project of the checkpoint `model`:v1 came from, by its authentic promote event."""
    for e in s.exec(
        select(AuditEvent).where(AuditEvent.action == "promote", AuditEvent.target == f"{model}:v1")
    ):
        details = e.details if isinstance(e.details, dict) else {}
        source = details.get("source")
        if isinstance(source, str) and _authentic(s, key, e):
            try:
                return parse_checkpoint_ref(source).project
            except RegistryError:
                return None
    return None


def _newest_signed_policy(s: Session, key: bytes) -> PolicyDocument | None:
    rows = list(s.exec(select(PolicyDocument).order_by(col(PolicyDocument.version).desc())))
    good = facts.signed_ids(
        s, key, facts.POLICY, {p.id: facts.policy_content(p) for p in rows if p.id}
    )
    return next((p for p in rows if p.id in good and facts.policy_intact(p)), None)
