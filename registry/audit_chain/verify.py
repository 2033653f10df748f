"""`reg audit verify`: walk the whole log against the key and the anchors, and name each problem.

One pass over the events in id order (memory bounded by the seals still open at that point):
every event's own MAC; every seal recomputed over its events as they are now, its link to the
one before and its place in the sequence; the events no seal holds; every anchor's MAC and that
the chain still holds the seal it anchored.

Problem kinds (each with the event id or seal seq it concerns):
    edited         an event's content no longer matches its MAC (or, unsigned, its seal's tag)
    reordered      an event holds the content sealed for another id
    replaced       a validly signed event sits where a seal recorded a different one
    deleted        ids a seal holds are gone from the log
    forged         an unsealed event whose MAC does not verify (written without the key)
    unsigned       an event without a MAC where only the history before the key may be
    duplicate      one event uid on several rows (a signed event copied)
    double-sealed  ids held by two seals
    seal-missing   a gap in the seal sequence
    chain-broken   a seal whose previous-MAC is not its predecessor's MAC
    seal-forged    a seal that does not verify over its own events (the seal row was altered)
    truncated      the chain is shorter than an anchor in the store: its tail was removed
    anchor-mismatch  the chain holds a different seal at an anchored seq (rewritten)
    anchor-forged  an anchor object that does not verify (or does not read)
    stalled        a signed event has waited unsealed longer than the bound (max(15 min, 10 x
                   REG_AUDIT_SEAL_EVERY), `--max-unsealed-age`), or the newest seal is older
                   than it (a healthy sealer writes an empty seal at least every
                   REG_AUDIT_ANCHOR_EVERY): the sealer is not sealing (the `audit-seal` lease
                   held by one that does not seal? no server running?), and unsealed events
                   could have been deleted without a trace, however young those left are
    sealed-late    a seal took a signed event longer than that bound after it was written: a
                   stall that ended, during which events could have been deleted unseen (the
                   genesis seal, unsigned history and events older than the chain excepted)
    anchor-stale   the newest anchor (or, with none, the chain) is older than the bound
                   (max(15 min, 3 x REG_AUDIT_ANCHOR_EVERY), `--max-anchor-age`), or a signed
                   event in no anchored seal is: a tail the store does not hold could be cut

Unsealed events younger than the bound are fine and counted: whoever can delete rows can
delete those without a trace, which is why the bound is checked.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

from sqlalchemy import func
from sqlalchemy import select as sa_select
from sqlmodel import Session, col, select

from registry.audit_chain import anchors, macs
from registry.audit_chain.keys import key_id
from registry.audit_chain.sealer import WrongKey
from registry.catalog.models import AuditEvent, AuditSeal
from registry.timeutil import iso, now

if TYPE_CHECKING:
    from registry.catalog.engine import Catalog
    from registry.storage.base import BaseStore

_STREAM = 2000


@dataclass
class _Report:
    problems: list[dict[str, Any]] = field(default_factory=list)
    events: int = 0
    sealed: int = 0
    unsealed: int = 0
    history: int = 0  # unsigned events before the key, waiting for the genesis seal
    oldest_unsealed: float | None = None  # on a server, minutes old means sealing stalled
    oldest_unsealed_id: int | None = None
    stale_unsealed: int = 0  # of them, older than the bound
    unanchored: int = 0  # signed events in no anchored seal
    oldest_unanchored: float | None = None
    oldest_unanchored_id: int | None = None

    def add(self, kind: str, message: str, **where: Any) -> None:
        self.problems.append({"kind": kind, "message": message, **where})


def verify_chain(
    catalog: Catalog,
    store: BaseStore,
    key: bytes,
    *,
    max_unsealed_age_s: float | None = None,
    max_anchor_age_s: float | None = None,
) -> dict[str, Any]:
    """The report of `reg audit verify`; the bounds default to `schedule.bounds()` (this
    process's REG_AUDIT_SEAL_EVERY / REG_AUDIT_ANCHOR_EVERY)."""
    from registry.audit_chain.schedule import bounds

    default_unsealed, default_anchor = bounds()
    unsealed_bound = max_unsealed_age_s or default_unsealed
    anchor_bound = max_anchor_age_s or default_anchor
    report = _Report()
    at = now()
    # Anchors first: the chain only grows, so every anchor read now must be held by the seals
    # read next (read the other way round, a seal and its anchor made in between would look
    # like a truncated tail).
    anchor_list = anchors.read_all(store)
    with catalog.session() as s:
        seals = list(s.exec(select(AuditSeal).order_by(col(AuditSeal.seq))))
        kid = key_id(key)
        if seals and all(x.key_id != kid for x in seals):
            raise WrongKey(
                f"the audit chain is sealed with key {seals[0].key_id}; this key is {kid}",
                "verify with the server's key: run it through the server (REG_URL) or on its "
                "host (REG_AUDIT_KEY_FILE)",
            )
        _links(seals, kid, report)
        ranges = _ranges(seals, report)
        newest = _newest_anchor(anchor_list, key, seals[-1].seq if seals else 0)
        walk = _Walk(key, seals, ranges, report)
        walk.anchored_seq = newest[0] if newest else 0
        walk.stale_before = at - unsealed_bound
        walk.late_after = unsealed_bound
        walk.chain_start = seals[0].sealed_at if seals else float("inf")
        walk.run(_events(s))
        _duplicates(s, report)
    _anchors(anchor_list, seals, key, report)
    _late(walk, unsealed_bound, report)
    _stalls(report, at, unsealed_bound, anchor_bound, newest, seals)
    head = seals[-1] if seals else None
    return {
        "ok": not report.problems,
        "events": report.events,
        "sealed": report.sealed,
        "unsealed": report.unsealed,
        "oldest_unsealed": iso(report.oldest_unsealed),
        "unsigned_history": report.history,
        "seals": len(seals),
        "anchors": len(anchor_list),
        "key_id": kid,
        "head": None if head is None else {"seq": head.seq, "mac": head.mac, "events": head.total},
        "problems": report.problems,
        "unanchored": report.unanchored,
        "oldest_unanchored": iso(report.oldest_unanchored),
        "newest_anchor": None if newest is None else {"seq": newest[0], "ts": iso(newest[1])},
        "max_unsealed_age_s": unsealed_bound,
        "max_anchor_age_s": anchor_bound,
    }


def _newest_anchor(
    found: list[tuple[str, dict[str, Any] | str]], key: bytes, chain_len: int
) -> tuple[int, float] | None:
    """(seq, ts) of the newest anchor that verifies and that the chain reaches (the others
    are named by `_anchors`)."""
    best: tuple[int, float] | None = None
    for name, doc in found:
        if isinstance(doc, str) or not _well_formed(doc) or doc["seq"] > chain_len:
            continue
        if name != anchors.key_for(doc["seq"]) or not macs.same(
            doc["anchor_mac"], macs.anchor_mac(key, doc)
        ):
            continue
        try:
            ts = datetime.fromisoformat(doc["ts"].replace("Z", "+00:00")).timestamp()
        except ValueError:
            continue
        if best is None or doc["seq"] > best[0]:
            best = (doc["seq"], ts)
    return best


def _stalls(
    report: _Report,
    at: float,
    unsealed_bound: float,
    anchor_bound: float,
    newest: tuple[int, float] | None,
    seals: list[AuditSeal],
) -> None:
    """Sealing or anchoring that stopped: what is unsealed (unanchored) can be deleted
    (cut) without a trace, so waiting longer than the bound is a failure, not a count. The
    head's age is checked too: the owner may delete each unsealed event before it ages, but
    cannot write the heartbeat seals a running sealer would have."""
    head = seals[-1] if seals else None
    head_old = head is not None and at - head.sealed_at > unsealed_bound
    if report.stale_unsealed:
        assert report.oldest_unsealed is not None
        report.add(
            "stalled",
            f"{report.stale_unsealed} signed event(s) have waited unsealed longer than "
            f"{_span(unsealed_bound)} (the oldest, event {report.oldest_unsealed_id}, since "
            f"{iso(report.oldest_unsealed)}): the sealer is not sealing (is the audit-seal "
            "lease held by a holder that does not seal?), and unsealed events may have been "
            "deleted without a trace",
            event=report.oldest_unsealed_id,
        )
    elif head_old:
        assert head is not None
        report.add(
            "stalled",
            f"the newest seal (seal {head.seq}, of {iso(head.sealed_at)}) is older than "
            f"{_span(unsealed_bound)}, and a running sealer writes one at least every "
            "REG_AUDIT_ANCHOR_EVERY: no sealer has sealed since (no server running, or the "
            "audit-seal lease held by a holder that does not seal), and events written since "
            f"may have been deleted without a trace ({report.unsealed} left unsealed)",
            seal=head.seq,
        )
    oldest = report.oldest_unanchored
    if newest is None:
        anchor_old = head is not None and at - seals[0].sealed_at > anchor_bound
    else:
        anchor_old = at - newest[1] > anchor_bound
    if anchor_old and not (oldest is not None and at - oldest > anchor_bound):
        what = "no anchor" if newest is None else f"the newest anchor (seal {newest[0]})"
        when = "" if newest is None else f", of {iso(newest[1])},"
        report.add(
            "anchor-stale",
            f"{what}{when} is older than {_span(anchor_bound)}, and a running sealer anchors "
            "at least every REG_AUDIT_ANCHOR_EVERY: anchoring stopped, and seals the store "
            f"does not hold could be cut unseen ({report.unanchored} signed event(s) unanchored)",
            **({} if newest is None else {"seal": newest[0]}),
        )
    elif (
        oldest is not None
        and at - oldest > anchor_bound
        and (newest is None or at - newest[1] > anchor_bound)
    ):
        since = "no anchor" if newest is None else f"the newest anchor (seal {newest[0]}) is of"
        when = "" if newest is None else f" {iso(newest[1])}"
        report.add(
            "anchor-stale",
            f"{report.unanchored} signed event(s) are in no anchored seal, the oldest (event "
            f"{report.oldest_unanchored_id}) since {iso(oldest)}, longer than "
            f"{_span(anchor_bound)}; {since}{when}: anchoring stopped, and a tail the store "
            "does not hold could be cut unseen",
            event=report.oldest_unanchored_id,
        )


def _late(walk: _Walk, bound: float, report: _Report) -> None:
    """Seals that took a signed event more than the bound after it was written: sealing had
    stalled, and what was written meanwhile could have been deleted before it was sealed."""
    for seq in sorted(walk.late):
        delay, event_id, ts = walk.late[seq]
        seal = walk.by_seq[seq]
        report.add(
            "sealed-late",
            f"seal {seq} (of {iso(seal.sealed_at)}) took event {event_id} {_span(delay)} after "
            f"it was written ({iso(ts)}), longer than {_span(bound)}: sealing had stalled, and "
            "events written meanwhile may have been deleted before it resumed",
            seal=seq,
            event=event_id,
            delay_s=round(delay, 3),
        )


def _span(seconds: float) -> str:
    return f"{seconds / 60:g} min" if seconds >= 60 else f"{seconds:g}s"


def _events(s: Session) -> Iterator[Any]:
    """Rows of (id, the signed fields, mac) in id order, streamed (a server-side cursor on
    PostgreSQL): plain SQLAlchemy rows, as ORM objects would cost several times more."""
    table = AuditEvent.__table__  # type: ignore[attr-defined]
    names = ("id", *macs.EVENT_FIELDS, "mac")
    stmt = (
        sa_select(*(table.c[n] for n in names))
        .order_by(table.c.id)
        .execution_options(yield_per=_STREAM)
    )
    yield from s.connection().execute(stmt)


def _links(seals: list[AuditSeal], kid: str, report: _Report) -> None:
    """Seals contiguous from 1, each linked to its predecessor, all under this key."""
    prev: AuditSeal | None = None
    for seal in seals:
        expected = prev.seq + 1 if prev else 1
        if seal.seq != expected:
            lost = seal.total - seal.count - (prev.total if prev else 0)
            span = f"{expected}" if seal.seq == expected + 1 else f"{expected}-{seal.seq - 1}"
            report.add(
                "seal-missing",
                f"seal(s) {span} are missing from the chain ({lost} sealed events with them)",
                seal=expected,
            )
        else:
            want = prev.mac if prev else macs.GENESIS_PREV
            if not macs.same(seal.prev_mac, want):
                report.add(
                    "chain-broken",
                    f"seal {seal.seq} does not follow seal {seal.seq - 1} (previous MAC differs)",
                    seal=seal.seq,
                )
        if seal.key_id != kid:
            report.add(
                "seal-forged", f"seal {seal.seq} names another key ({seal.key_id})", seal=seal.seq
            )
        prev = seal


def _ranges(seals: list[AuditSeal], report: _Report) -> dict[int, list[tuple[int, int]]]:
    """Each seal's id ranges; a seal whose ranges do not read or disagree with its own counts
    is reported and left out of the walk."""
    out: dict[int, list[tuple[int, int]]] = {}
    for seal in seals:
        try:
            ranges = macs.decode_ranges(seal.event_ids)
        except ValueError:
            ranges = []
        count = sum(high - low + 1 for low, high in ranges)
        if seal.event_ids == "" and (seal.count, seal.tags, seal.low, seal.high) == (0, "", 0, 0):
            out[seal.seq] = []  # an empty seal (a heartbeat): its MAC covers zero entries
            continue
        if (
            not ranges
            or count != seal.count
            or len(seal.tags) != count * macs.TAG_HEX
            or (ranges[0][0], ranges[-1][1]) != (seal.low, seal.high)
        ):
            report.add("seal-forged", f"seal {seal.seq}'s event list does not read", seal=seal.seq)
            continue
        out[seal.seq] = ranges
    pieces = sorted((low, high, seq) for seq, rs in out.items() for low, high in rs)
    reach, reach_seq = 0, 0
    for low, high, seq in pieces:
        if low <= reach:
            report.add(
                "double-sealed",
                f"events {low}-{min(high, reach)} are held by seals {reach_seq} and {seq}",
                event=low,
                seal=seq,
            )
        if high > reach:
            reach, reach_seq = high, seq
    return out


class _Walk:
    """The pass over the events: own MACs, seal by seal recomputation, the unsealed rest."""

    def __init__(
        self,
        key: bytes,
        seals: list[AuditSeal],
        ranges: dict[int, list[tuple[int, int]]],
        report: _Report,
    ) -> None:
        self.key, self.report = key, report
        self.any_seal = bool(seals)
        self.by_seq = {x.seq: x for x in seals}
        self.ranges = ranges
        pieces: list[tuple[int, int, int]] = []
        for low, high, seq in sorted((lo, hi, q) for q, rs in ranges.items() for lo, hi in rs):
            if pieces and low <= pieces[-1][1]:
                low = pieces[-1][1] + 1
            if low <= high:
                pieces.append((low, high, seq))
        self.lows = [p[0] for p in pieces]
        self.pieces = pieces
        # Seals are closed once the walk passes their highest id; entries below every open
        # seal's lowest id are dropped, so memory follows the open seals, not the log.
        self.closing = sorted((self.by_seq[q] for q in ranges), key=lambda x: x.high)
        self.floor = [0] * (len(self.closing) + 1)
        self.floor[-1] = 1 << 62
        for i in range(len(self.closing) - 1, -1, -1):
            self.floor[i] = min(self.closing[i].low, self.floor[i + 1])
        self.next = 0
        self.entries: dict[int, str] = {}
        self.flagged: set[int] = set()
        self.unsigned_sealed: list[tuple[int, int]] = []
        self.unsigned_ids: set[int] = set()
        self.genesis_first_signed: int | None = None
        self.first_signed: int | None = None
        self.mismatched: list[tuple[int, int, str, str, bool]] = []
        self.anchored_seq = 0  # seals up to this seq are held by an anchor
        self.stale_before = float("-inf")  # an unsealed event older than this: stalled
        self.late_after = float("inf")  # a seal taking an event this much later: sealed-late
        self.chain_start = float("inf")  # the genesis seal's time (older events: history)
        self.late: dict[int, tuple[float, int, float]] = {}  # seq -> (delay, event, its ts)

    def owner(self, event_id: int) -> int | None:
        i = bisect.bisect_right(self.lows, event_id) - 1
        if i >= 0 and event_id <= self.pieces[i][1]:
            return self.pieces[i][2]
        return None

    def run(self, rows: Iterator[Any]) -> None:
        for row in rows:
            self._close_below(row.id)
            self._event(row)
        self._close_below(1 << 62)
        self._after()

    def _event(self, row: Any) -> None:
        report = self.report
        report.events += 1
        content = macs.event_content(row)
        valid = row.mac is not None and macs.same(row.mac, macs.event_mac(self.key, content))
        entry = row.mac if row.mac is not None else macs.unsigned_entry(content)
        seq = self.owner(row.id)
        if valid and self.first_signed is None:
            self.first_signed = row.id
        if valid and (seq is None or seq > self.anchored_seq):
            report.unanchored += 1
            if report.oldest_unanchored is None or row.ts < report.oldest_unanchored:
                report.oldest_unanchored, report.oldest_unanchored_id = row.ts, row.id
        if seq is not None:
            report.sealed += 1
            self.entries[row.id] = entry
            if row.mac is None:
                self.unsigned_sealed.append((row.id, seq))
                self.unsigned_ids.add(row.id)
            elif not valid:
                self.flagged.add(row.id)
                report.add(
                    "edited",
                    f"event {row.id} (sealed in seal {seq}) no longer matches its MAC",
                    event=row.id,
                    seal=seq,
                )
            elif seq == 1 and self.genesis_first_signed is None:
                self.genesis_first_signed = row.id
            elif seq != 1 and row.ts >= self.chain_start:
                delay = self.by_seq[seq].sealed_at - row.ts
                if delay > self.late_after and delay > self.late.get(seq, (0.0,))[0]:
                    self.late[seq] = (delay, row.id, row.ts)
            return
        if row.mac is None:
            if not self.any_seal and self.first_signed is None:
                report.history += 1
                return
            report.add(
                "unsigned",
                f"event {row.id} has no MAC but was written after the chain began",
                event=row.id,
            )
        elif not valid:
            report.add("forged", f"event {row.id} does not verify with the key", event=row.id)
        else:
            report.unsealed += 1
            if report.oldest_unsealed is None or row.ts < report.oldest_unsealed:
                report.oldest_unsealed, report.oldest_unsealed_id = row.ts, row.id
            if row.ts < self.stale_before:
                report.stale_unsealed += 1

    def _close_below(self, event_id: int) -> None:
        while self.next < len(self.closing) and self.closing[self.next].high < event_id:
            self._close(self.closing[self.next])
            self.next += 1
            floor = self.floor[self.next]
            while self.entries:
                first = next(iter(self.entries))
                if first >= floor:
                    break
                del self.entries[first]

    def _close(self, seal: AuditSeal) -> None:
        ids = macs.expand(self.ranges[seal.seq])
        tags = macs.split_tags(seal.tags)
        missing = [i for i in ids if i not in self.entries]
        if missing:
            self.report.add(
                "deleted",
                f"events {macs.encode_ranges(missing)} sealed in seal {seal.seq} are gone",
                event=missing[0],
                seal=seal.seq,
                events=macs.encode_ranges(missing),
            )
        mismatched = 0
        for event_id, tag in zip(ids, tags, strict=True):
            entry = self.entries.get(event_id)
            if entry is None or entry.startswith(tag):
                continue
            mismatched += 1
            if event_id not in self.flagged:
                signed = event_id not in self.unsigned_ids
                self.mismatched.append((event_id, seal.seq, entry[: macs.TAG_HEX], tag, signed))
        if missing:
            return
        entries = [(i, self.entries[i]) for i in ids]
        mac = macs.seal_mac(
            self.key,
            seq=seal.seq,
            prev_mac=seal.prev_mac,
            key_id=seal.key_id,
            sealed_at=seal.sealed_at,
            total=seal.total,
            entries=entries,
        )
        if macs.same(mac, seal.mac) and mismatched:
            self.report.add("seal-forged", f"seal {seal.seq}'s tags were altered", seal=seal.seq)
        elif not macs.same(mac, seal.mac) and not mismatched:
            self.report.add(
                "seal-forged",
                f"seal {seal.seq} does not verify over its events (the seal row was altered)",
                seal=seal.seq,
            )

    def _after(self) -> None:
        report = self.report
        for event_id, seq in self.unsigned_sealed:
            first = self.genesis_first_signed
            if seq != 1 or (first is not None and event_id > first):
                report.add(
                    "unsigned",
                    f"event {event_id} has no MAC, yet seal {seq} holds it after signed events",
                    event=event_id,
                    seal=seq,
                )
        sealed_as = {tag: (event_id, seq) for event_id, seq, _, tag, _ in self.mismatched}
        for event_id, seq, found, _, signed in self.mismatched:
            other = sealed_as.get(found)
            if other is not None and other[0] != event_id:
                report.add(
                    "reordered",
                    f"event {event_id} holds what seal {other[1]} sealed as event {other[0]}",
                    event=event_id,
                    seal=seq,
                )
            elif signed:
                report.add(
                    "replaced",
                    f"event {event_id} is not the event seal {seq} holds there",
                    event=event_id,
                    seal=seq,
                )
            else:
                report.add(
                    "edited",
                    f"event {event_id} (unsigned, sealed in seal {seq}) changed since",
                    event=event_id,
                    seal=seq,
                )


def _duplicates(s: Session, report: _Report) -> None:
    uids = s.exec(
        select(AuditEvent.uid)
        .where(col(AuditEvent.uid).is_not(None))
        .group_by(col(AuditEvent.uid))
        .having(func.count() > 1)
    ).all()
    for uid in uids:
        ids = s.exec(
            select(AuditEvent.id).where(AuditEvent.uid == uid).order_by(col(AuditEvent.id))
        ).all()
        report.add(
            "duplicate",
            f"events {', '.join(map(str, ids))} are copies of one event (uid {uid})",
            event=ids[-1],
        )


def _anchors(
    found: list[tuple[str, dict[str, Any] | str]],
    seals: list[AuditSeal],
    key: bytes,
    report: _Report,
) -> None:
    by_seq = {x.seq: x for x in seals}
    high_through: dict[int, int] = {}
    high = 0
    for seal in seals:
        high = max(high, seal.high)
        high_through[seal.seq] = high
    chain_len = seals[-1].seq if seals else 0
    chain_total = seals[-1].total if seals else 0
    for name, doc in found:
        if isinstance(doc, str) or not _well_formed(doc):
            why = doc if isinstance(doc, str) else "is not an anchor"
            report.add("anchor-forged", f"anchor {name} {why}", anchor=name)
            continue
        if not macs.same(doc["anchor_mac"], macs.anchor_mac(key, doc)) or name != (
            anchors.key_for(doc["seq"])
        ):
            report.add("anchor-forged", f"anchor {name} does not verify", anchor=name)
            continue
        seq = doc["seq"]
        if seq > chain_len:
            report.add(
                "truncated",
                f"the chain ends at seal {chain_len} ({chain_total} events); the anchor of "
                f"{doc['ts']} records seal {seq} ({doc['events']} events, up to event "
                f"{doc['last_event_id']}): the tail was removed",
                seal=seq,
                anchor=name,
            )
            continue
        anchored = by_seq.get(seq)
        if anchored is None:
            continue  # reported as seal-missing
        if (
            not macs.same(anchored.mac, doc["mac"])
            or anchored.total != doc["events"]
            or high_through[seq] != doc["last_event_id"]
        ):
            report.add(
                "anchor-mismatch",
                f"seal {seq} is not the one anchored at {doc['ts']}: the chain was rewritten",
                seal=seq,
                anchor=name,
            )


def _well_formed(doc: dict[str, Any]) -> bool:
    ints = ("seq", "last_event_id", "events")
    strs = ("mac", "key_id", "ts", "anchor_mac", "format")
    return (
        all(isinstance(doc.get(k), int) and not isinstance(doc.get(k), bool) for k in ints)
        and all(isinstance(doc.get(k), str) for k in strs)
        and doc["format"] == anchors.FORMAT
    )
