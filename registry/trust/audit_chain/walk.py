"""One pass of `reg audit verify` over the log: every event in id order against its MAC and
the seals that hold it (memory bounded by the seals still open), each seal recomputed, linked
and placed, copied events found; what it finds goes into a `Report`."""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sqlalchemy import func
from sqlalchemy import select as sa_select
from sqlmodel import Session, col, select

from registry.catalog.models import AuditEvent, AuditSeal
from registry.trust.audit_chain import macs

if TYPE_CHECKING:
    pass

_STREAM = 2000


@dataclass
class Report:
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


def event_rows(s: Session) -> Iterator[Any]:
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


def check_links(seals: list[AuditSeal], kid: str, report: Report) -> None:
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


def seal_ranges(seals: list[AuditSeal], report: Report) -> dict[int, list[tuple[int, int]]]:
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


class Walk:
    """The pass over the events: own MACs, seal by seal recomputation, the unsealed rest."""

    def __init__(
        self,
        key: bytes,
        seals: list[AuditSeal],
        ranges: dict[int, list[tuple[int, int]]],
        report: Report,
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
        mac = macs.seal_row_mac(self.key, seal, entries)
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


def check_duplicates(s: Session, report: Report) -> None:
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
