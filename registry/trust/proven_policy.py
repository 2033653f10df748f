"""The policy in force behind `reg server` (DESIGN §6, §10): not the newest row, the newest one
the server can prove an admin applied.

A row of `policy_document` decides who is an admin, so a row inserted by whoever can write the
catalog (the runtime role, the owner) must grant nothing. The policy in force is the one named
by the newest `policy-apply` (or `policy-sign`) event that is sealed in the audit chain under
the server's key and anchored in the store, and its row must carry a valid signature
(`registry.trust.signed_facts`) over the same document. So:

- a forged row (no signature, or one that does not verify) is ignored and logged;
- a forged apply event is not sealed (the sealer refuses a bad MAC) and is ignored;
- deleting the newest signed row to roll back to an older one leaves its sealed event without
  a row: the server fails closed (every request that needs a decision is refused) rather than
  decide under the older policy; deleting the event too breaks the sealed, anchored chain,
  which `reg audit verify` names.

`reg policy apply` seals and anchors at once where it holds the key, so the new policy is in
force when the command returns. A replica that proves the policy before that sees the previous
one until the next seal. The proof reads one seal's events and at most a few anchors; it is made
once per process for each new policy (or seal, while a newer apply waits for one) and cached:
each request then costs one query of three aggregates.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sqlalchemy import text
from sqlmodel import Session, col, select

from registry.catalog.models import AuditEvent, AuditSeal, PolicyDocument
from registry.errors import RegistryError, UnprovenFact
from registry.trust.audit_chain import anchors, macs
from registry.trust.audit_chain.keys import key_id
from registry.trust.audit_chain.sealer import seal_verifies
from registry.trust.signed_facts import POLICY, policy_content, policy_intact, signed_ids

if TYPE_CHECKING:
    from registry.catalog.engine import Catalog
    from registry.storage.base import BaseStore

log = logging.getLogger("reg.policy")
APPLY_ACTIONS = ("policy-apply", "policy-sign")
_TARGET = re.compile(r"policy v([0-9]{1,18})")


@dataclass(frozen=True)
class InForce:
    """The proven policy (None: none was ever applied), or why none can be established."""

    version: int | None = None
    text: str = ""
    applied_by: str = ""
    applied_at: float | None = None
    seal: int | None = None
    error: UnprovenFact | None = None
    ignored: tuple[str, ...] = ()
    pending: bool = False  # a newer apply event waits for its seal or anchor

    @property
    def source(self) -> str:
        return (
            f"catalog policy v{self.version} (applied by {self.applied_by}; signed, "
            f"sealed in audit seal {self.seal}, anchored)"
        )


@dataclass
class _Cache:
    lock: threading.Lock = field(default_factory=threading.Lock)
    # catalog -> (stamp, seal head, answer, when it was proven)
    entries: dict[str, tuple[tuple[Any, ...], int, InForce, float]] = field(default_factory=dict)


# While an apply waits for its seal or anchor, the answer is proven again at most this often:
# an anchor is written to the store, where the catalog's stamp cannot see it.
PENDING_RECHECK_S = 0.5


_CACHE = _Cache()
_LOGGED: set[str] = set()

_STAMP = (
    "SELECT (SELECT max(id) FROM audit_event WHERE action IN ('policy-apply', 'policy-sign')),"
    " (SELECT max(version) FROM policy_document), (SELECT count(*) FROM policy_document),"
    " (SELECT max(id) FROM fact_mac WHERE kind = 'policy'), (SELECT max(seq) FROM audit_seal)"
)


def in_force(catalog: Catalog, store: BaseStore, key: bytes) -> InForce:
    """The policy in force, proven; cached per process until a policy event, row or signature
    changes. While a newer apply waits to be sealed and anchored, until a seal or for
    PENDING_RECHECK_S: its anchor lands in the store, which the stamp does not cover."""
    with catalog.session() as s:
        row = s.connection().execute(text(_STAMP)).one()
    stamp, head = tuple(row[:4]), int(row[4] or 0)
    name = catalog.describe()
    with _CACHE.lock:
        cached = _CACHE.entries.get(name)
    if cached is not None and cached[0] == stamp:
        waiting = cached[2].pending
        if not waiting or (cached[1] == head and time.monotonic() - cached[3] < PENDING_RECHECK_S):
            return cached[2]
    with catalog.session() as s:
        found = prove(s, store, key)
    for line in found.ignored:
        _log_once(line)
    if found.error is not None:
        _log_once(found.error.message)
    with _CACHE.lock:
        _CACHE.entries[name] = (stamp, head, found, time.monotonic())
    return found


def prove(session: Session, store: BaseStore, key: bytes) -> InForce:
    """The newest policy whose apply event is sealed and anchored and whose row is signed."""
    rows = list(session.exec(select(PolicyDocument).order_by(col(PolicyDocument.version).desc())))
    events = apply_events(session)
    if not rows and not events:
        return InForce()
    intact = {r.id: policy_content(r) for r in rows if r.id is not None and policy_intact(r)}
    signed = signed_ids(session, key, POLICY, intact)
    by_version = {r.version: r for r in rows}
    ignored: list[str] = []
    pending = False
    for event, version, digest in events:
        proof = sealed_and_anchored(session, store, key, event)
        if proof.tampered:  # an apply event the chain cannot vouch for: decide nothing
            return InForce(
                error=UnprovenFact(
                    f"the policy in force cannot be established: policy v{version}'s "
                    f"{event.action} event {event.id} is {proof.why}",
                    "the audit chain was altered: reg audit verify names what changed",
                ),
                ignored=tuple(ignored),
            )
        if proof.seq is None:
            pending |= proof.waiting
            ignored.append(f"policy v{version}: its {event.action} event {event.id} is {proof.why}")
            continue
        row = by_version.get(version)
        problem = (
            "missing from the catalog"
            if row is None
            else "unsigned, or its signature does not verify"
            if row.id not in signed
            else "another document than the one its event names"
            if row.sha256 != digest
            else None
        )
        if problem is not None:
            return InForce(
                error=UnprovenFact(
                    f"the policy in force cannot be established: policy v{version}, applied "
                    f"in audit event {event.id} (sealed in seal {proof.seq}), is {problem}",
                    "restore the catalog's policy_document row, or re-apply the policy on the "
                    "server's host with its key (reg policy apply FILE); reg audit verify "
                    "names what changed",
                ),
                ignored=tuple(ignored),
            )
        assert row is not None
        ignored += [
            f"policy v{r.version} is not in force: "
            + ("no sealed apply event names it" if r.id in signed else "unsigned or forged")
            for r in rows
            if r.version > version
        ]
        return InForce(
            version=row.version,
            text=row.text,
            applied_by=row.applied_by,
            applied_at=row.applied_at,
            seal=proof.seq,
            ignored=tuple(ignored),
            pending=pending,
        )
    return InForce(
        error=UnprovenFact(
            f"the policy in force cannot be established: the catalog has {len(rows)} policy "
            "document(s) and no apply event sealed in the audit chain and anchored names one",
            "on the server's host, with its key: reg catalog sign (a registry from before "
            "signed policies), or wait for the sealer (REG_AUDIT_SEAL_EVERY) after an apply",
        ),
        ignored=tuple(ignored),
        pending=pending,
    )


def apply_events(session: Session) -> list[tuple[AuditEvent, int, str]]:
    """(event, version, sha256) of every allowed apply event, newest version first."""
    found = session.exec(
        select(AuditEvent)
        .where(col(AuditEvent.action).in_(APPLY_ACTIONS), AuditEvent.outcome == "allowed")
        .order_by(col(AuditEvent.id).desc())
    )
    out = []
    for event in found:
        details = event.details if isinstance(event.details, dict) else {}
        version = details.get("version")
        if not isinstance(version, int):
            match = _TARGET.fullmatch(event.target or "")
            version = int(match.group(1)) if match else None
        digest = details.get("sha256")
        if isinstance(version, int) and isinstance(digest, str):
            out.append((event, version, digest))
    out.sort(key=lambda e: (e[1], e[0].id or 0), reverse=True)
    return out


@dataclass(frozen=True)
class SealProof:
    """Where an event stands in the audit chain: `seq` of the verified seal holding it (and
    anchored at or after it), else why not; `waiting` when time will tell (not sealed or not
    anchored yet), `tampered` when only a seal that does not verify covers it."""

    seq: int | None = None
    why: str = ""
    waiting: bool = False
    tampered: bool = False


def sealed(session: Session, key: bytes, event: AuditEvent) -> SealProof:
    """The verified seal (seq >= 1, this key) that holds `event`. A seal row that covers it and
    does not verify makes it `tampered` unless a verified one holds it too."""
    assert event.id is not None
    covering = [
        s
        for s in session.exec(
            select(AuditSeal)
            .where(
                col(AuditSeal.seq) >= 1,
                col(AuditSeal.low) <= event.id,
                col(AuditSeal.high) >= event.id,
            )
            .order_by(col(AuditSeal.seq))
        )
        if _covers(s, event.id)
    ]
    for seal in covering:
        if seal.key_id == key_id(key) and seal_verifies(session, key, seal):
            return SealProof(seal.seq)
    if covering:
        return SealProof(
            why=f"in seal {covering[0].seq}, which does not verify (reg audit verify names why)",
            tampered=True,
        )
    signed = macs.event_signed(key, event)
    # Only a signed event will ever be sealed: a forged or unsigned one keeps nothing waiting.
    return SealProof(why="not sealed yet" if signed else "unsigned or forged", waiting=signed)


def sealed_and_anchored(
    session: Session, store: BaseStore, key: bytes, event: AuditEvent
) -> SealProof:
    """`sealed`, and anchored at or after its seal."""
    proof = sealed(session, key, event)
    if proof.seq is None:
        return proof
    anchored = _anchored_at_or_after(session, store, key, proof.seq)
    if anchored is not None:
        return SealProof(
            why=f"sealed in seal {proof.seq} but {anchored}",
            waiting=anchored == "not anchored yet",
        )
    return proof


def _covers(seal: AuditSeal, event_id: int) -> bool:
    try:
        ranges = macs.decode_ranges(seal.event_ids) if seal.event_ids else []
    except ValueError:
        return False
    return event_id in macs.Covered(ranges)


def _anchored_at_or_after(session: Session, store: BaseStore, key: bytes, seq: int) -> str | None:
    """None when an anchor of seq >= `seq` verifies and matches the catalog's seal there; else
    why not. Anchors are keyed by their 12-digit seq: the prefixes widen digit by digit, so the
    first anchors after `seq` are found without listing them all, and never wider than the
    prefix `seq` shares with the chain's head (no anchor lies beyond it)."""
    digits = f"{seq:012d}"
    head = session.exec(select(AuditSeal.seq).order_by(col(AuditSeal.seq).desc())).first()
    top = f"{head or seq:012d}"
    shared = next((i for i, (a, b) in enumerate(zip(digits, top, strict=True)) if a != b), 12)
    tried: set[str] = set()
    for width in range(11, min(shared, 11) - 1, -1):
        found = []
        for info in store.list(anchors.PREFIX + digits[:width]):
            if info.key in tried:
                continue
            tried.add(info.key)
            name = info.key[len(anchors.PREFIX) :].removesuffix(".json")
            if name.isdigit() and int(name) >= seq:
                found.append((int(name), info.key))
        for at, name in sorted(found)[:8]:
            if _anchor_matches(session, store, key, at, name):
                return None
        if found:
            return f"no anchor at or after seal {seq} verifies against the catalog's seals"
    return "not anchored yet"


def _anchor_matches(session: Session, store: BaseStore, key: bytes, at: int, name: str) -> bool:
    try:
        doc = json.loads(store.get_bytes(name))
    except (RegistryError, ValueError, UnicodeDecodeError):
        return False
    if not isinstance(doc, dict) or doc.get("seq") != at or doc.get("key_id") != key_id(key):
        return False
    if not macs.same(doc.get("anchor_mac"), macs.anchor_mac(key, doc)):
        return False
    seal = session.get(AuditSeal, at)
    return seal is not None and macs.same(seal.mac, doc.get("mac"))


def _log_once(line: str) -> None:
    if line not in _LOGGED and len(_LOGGED) < 10_000:  # bounded: rows are anyone's to add
        _LOGGED.add(line)
        log.warning(json.dumps({"policy": "ignored", "message": line}))
