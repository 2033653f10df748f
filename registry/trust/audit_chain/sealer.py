"""The sealer: chains signed events into append-only seals, block by block.

Writers never wait on each other: each signs its own event at insert (`registry.trust.audit`). One
sealer at a time (the server's `audit-seal` lease; an explicit `reg audit seal` needs none) takes
the events no seal holds yet, in id order, checks each one's MAC and appends one seal over them.
The seal's sequence number is its primary key, so two sealers that race append one seal, never
two with the same predecessor; the loser's events go into the next block.

PostgreSQL may commit a transaction with a lower id after a higher one was sealed: that event is
simply taken by a later seal, so seals hold id *sets* (compact ranges), not one running range.
A routine cycle looks at events above the chain's highest id plus the last 15 minutes'; the
server's first cycle, one every 10 minutes after (`schedule.FULL_SCAN_S`: an event whose ts is
older, from a clock behind or a transaction held open, is not lost) and an explicit seal scan
the whole log for stragglers.

An event whose MAC does not verify, or an unsigned one once the chain exists, is never sealed:
it stays outside, and `reg audit verify` names it. Unsigned events of the history before the key
go into the genesis seal (seq 1) only, and only below its first signed event.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sqlalchemy import func
from sqlalchemy.exc import DBAPIError
from sqlalchemy.exc import IntegrityError as DBIntegrityError
from sqlmodel import Session, col, select

from registry.catalog.models import AuditEvent, AuditSeal
from registry.core.timeutil import now
from registry.errors import UsageError
from registry.trust.audit_chain import anchors, macs
from registry.trust.audit_chain.keys import key_id

if TYPE_CHECKING:
    from registry.catalog.engine import Catalog

log = logging.getLogger("reg.audit")
BATCH = 5000  # events per seal (the genesis seal takes the whole history before the key)
LOOKBACK_S = 900.0  # a routine cycle also rechecks the last 15 minutes for late commits
_IN = 500  # ids per IN (...) query
NOT_NEXT_LINK = "a seal is only ever the chain's next link"  # migration 0015's trigger


@dataclass
class SealRun:
    seals: list[int] = field(default_factory=list)
    sealed: int = 0
    refused: dict[int, str] = field(default_factory=dict)  # event id -> why
    raced: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "seals": self.seals,
            "sealed": self.sealed,
            "refused": [{"event": i, "reason": why} for i, why in sorted(self.refused.items())],
        }


class WrongKey(UsageError):
    pass


def head(session: Session) -> AuditSeal | None:
    return session.exec(select(AuditSeal).order_by(col(AuditSeal.seq).desc()).limit(1)).first()


def anchor_head(session: Session) -> anchors.Head | None:
    last = head(session)
    if last is None:
        return None
    high = session.exec(select(func.max(AuditSeal.high)).where(AuditSeal.seq <= last.seq)).one()
    return anchors.Head(last.seq, last.mac, int(high or 0), last.total, last.key_id)


def check_key(seal: AuditSeal | None, key: bytes) -> None:
    if seal is not None and seal.key_id != key_id(key):
        raise WrongKey(
            f"the audit chain is sealed with key {seal.key_id}; this key is {key_id(key)}",
            "use the server's key file (REG_AUDIT_KEY_FILE): keys are not rotated",
        )


def seal_pending(catalog: Catalog, key: bytes, *, full: bool = False) -> SealRun:
    """Seal every event that is signed and not sealed yet, in blocks of BATCH."""
    run = SealRun()
    while True:
        with catalog.session() as s:
            last = head(s)
            check_key(last, key)
            check_head(s, key, last)
            ids = _candidates(s, full=full)
            ids = [i for i in ids if i not in run.refused]
            if not ids:
                return run
            taken = _take(s, key, ids, genesis=last is None, refused=run.refused)
        if not taken:
            return run
        seq = (last.seq if last else 0) + 1
        if not _append(catalog, key, seq, last, taken):
            run.raced = True  # another sealer appended this seq: its events are sealed
            return run
        run.seals.append(seq)
        run.sealed += len(taken)
        full = False  # what the full scan found is now either sealed or refused


def heartbeat(catalog: Catalog, key: bytes, *, every_s: float) -> int | None:
    """Append an empty seal (no events) when the chain's head is `every_s` old: the seq, or
    None when the head is younger or another sealer appended first. A healthy sealer's head is
    so never older than the interval, and `reg audit verify` can tell a shut-out sealer (an
    old head) from a quiet registry (a fresh head, nothing new)."""
    with catalog.session() as s:
        last = head(s)
        check_key(last, key)
        check_head(s, key, last)
    if last is not None and now() - last.sealed_at < every_s:
        return None
    seq = (last.seq if last else 0) + 1
    return seq if _append(catalog, key, seq, last, []) else None


def _candidates(s: Session, *, full: bool) -> list[int]:
    """Ids of events no seal holds (in id order)."""
    high = s.exec(select(func.max(AuditSeal.high)).where(col(AuditSeal.seq) >= 1)).one() or 0
    newer = list(
        s.exec(select(AuditEvent.id).where(col(AuditEvent.id) > high).order_by(col(AuditEvent.id)))
    )
    if full:
        older_q = select(AuditEvent.id).where(col(AuditEvent.id) <= high)
    else:
        older_q = select(AuditEvent.id).where(
            col(AuditEvent.id) <= high, col(AuditEvent.ts) >= now() - LOOKBACK_S
        )
    older = [i for i in s.exec(older_q.order_by(col(AuditEvent.id))) if i is not None]
    if older:
        rows = s.exec(
            select(AuditSeal.event_ids).where(
                col(AuditSeal.seq) >= 1,
                col(AuditSeal.low) <= older[-1],
                col(AuditSeal.high) >= older[0],
            )
        )
        covered = macs.Covered(r for text in rows for r in macs.decode_ranges(text))
        older = [i for i in older if i not in covered]
    return [i for i in older + newer if i is not None]


def _take(
    s: Session, key: bytes, ids: list[int], *, genesis: bool, refused: dict[int, str]
) -> list[tuple[int, str]]:
    """The (id, entry) pairs of the next seal, in id order (at most BATCH signed events after
    any history); refused events are noted."""
    taken: list[tuple[int, str]] = []
    history = 0
    history_open = genesis  # unsigned history goes into the genesis seal, before any signed
    for row in events_by_id(s, ids):
        assert row.id is not None
        content = macs.event_content(row)
        if row.mac is None:
            if history_open:
                taken.append((row.id, macs.unsigned_entry(content)))
                history += 1
            else:
                _refuse(refused, row.id, "unsigned (written without the audit key)")
            continue
        if not macs.same(row.mac, macs.event_mac(key, content)):
            _refuse(refused, row.id, "its MAC does not verify")
            continue
        history_open = False
        taken.append((row.id, row.mac))
        if len(taken) - history >= BATCH:
            return taken
    return taken


def events_by_id(s: Session, ids: list[int]) -> Iterator[AuditEvent]:
    """The events of `ids` (ascending) in id order, read _IN at a time."""
    for start in range(0, len(ids), _IN):
        chunk = ids[start : start + _IN]
        yield from s.exec(
            select(AuditEvent).where(col(AuditEvent.id).in_(chunk)).order_by(col(AuditEvent.id))
        )


MAX_SEAL_EVENTS = 10_000_000  # a seal row claiming more was not written by a sealer


def seal_verifies(session: Session, key: bytes, seal: AuditSeal) -> bool:
    """Does the seal row's MAC verify over the events it holds as they are now (each signed
    event's own MAC checked too)? False for any row a sealer did not write: its ranges must
    parse, add up to its count and stay within MAX_SEAL_EVENTS before anything is read."""
    try:
        ranges = macs.decode_ranges(seal.event_ids) if seal.event_ids else []
    except ValueError:
        return False
    if sum(high - low + 1 for low, high in ranges) != seal.count or seal.count > MAX_SEAL_EVENTS:
        return False
    ids = macs.expand(ranges)
    entries: list[tuple[int, str]] = []
    for row in events_by_id(session, ids):
        assert row.id is not None
        content = macs.event_content(row)
        if row.mac is None:
            entries.append((row.id, macs.unsigned_entry(content)))
        elif macs.same(row.mac, macs.event_mac(key, content)):
            entries.append((row.id, row.mac))
        else:
            return False
    if [i for i, _ in entries] != ids:
        return False  # an event of the seal is gone
    return macs.same(macs.seal_row_mac(key, seal, entries), seal.mac)


class HeadNotVerified(UsageError):
    exit_code = 1


_VERIFIED_HEADS: set[tuple[int, str]] = set()  # (seq, mac) of heads this process proved


def check_head(session: Session, key: bytes, seal: AuditSeal | None) -> None:
    """Extend only a head that verifies: a seal row written around the sealer (the database is
    anyone's to insert into) would otherwise carry the chain on, and the events its ranges
    name would never be sealed. Each head is proven once per process."""
    if seal is None or (seal.seq, seal.mac) in _VERIFIED_HEADS:
        return
    if not seal_verifies(session, key, seal):
        raise HeadNotVerified(
            f"the audit chain's head, seal {seal.seq}, does not verify: not extended",
            "reg audit verify names what changed; sealing stays stopped until it is restored",
        )
    _VERIFIED_HEADS.add((seal.seq, seal.mac))


def _refuse(refused: dict[int, str], event_id: int, why: str) -> None:
    refused[event_id] = why
    log.warning("audit event %s not sealed: %s", event_id, why)


def _append(
    catalog: Catalog, key: bytes, seq: int, last: AuditSeal | None, taken: list[tuple[int, str]]
) -> bool:
    """Append seal `seq` after `last`; False if another sealer got there first."""
    kid = key_id(key)
    prev = last.mac if last else macs.GENESIS_PREV
    total = (last.total if last else 0) + len(taken)
    ids = [i for i, _ in taken]
    try:
        with catalog.session(write=True) as s:
            current = head(s)
            if (current.seq if current else 0) != seq - 1:
                return False
            seal = AuditSeal(
                seq=seq,
                key_id=kid,
                prev_mac=prev,
                mac="",
                event_ids=macs.encode_ranges(ids),
                tags=macs.tags_of(taken),
                count=len(taken),
                total=total,
                low=ids[0] if ids else 0,  # an empty seal (a heartbeat): 0, 0
                high=ids[-1] if ids else 0,
                sealed_at=now(),
            )
            seal.mac = mac = macs.seal_row_mac(key, seal, taken)
            s.add(seal)
    except DBAPIError as exc:
        # Another sealer appended `seq` first: the unique key, or (PostgreSQL, whose trigger
        # runs first and raises its own error) the next-link trigger, refused ours.
        if isinstance(exc, DBIntegrityError) or NOT_NEXT_LINK in str(exc.orig):
            return False
        raise
    _VERIFIED_HEADS.add((seq, mac))  # written here: the next cycle need not prove it
    return True
