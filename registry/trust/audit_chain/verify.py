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

from datetime import datetime
from typing import TYPE_CHECKING, Any

from sqlmodel import col, select

from registry.catalog.models import AuditSeal
from registry.core.timeutil import iso, now
from registry.trust.audit_chain import anchors, macs
from registry.trust.audit_chain.keys import key_id
from registry.trust.audit_chain.schedule import bounds
from registry.trust.audit_chain.sealer import WrongKey
from registry.trust.audit_chain.walk import (
    Report,
    Walk,
    check_duplicates,
    check_links,
    event_rows,
    seal_ranges,
)

if TYPE_CHECKING:
    from registry.catalog.engine import Catalog
    from registry.storage.base import BaseStore


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
    default_unsealed, default_anchor = bounds()
    unsealed_bound = max_unsealed_age_s or default_unsealed
    anchor_bound = max_anchor_age_s or default_anchor
    report = Report()
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
        check_links(seals, kid, report)
        ranges = seal_ranges(seals, report)
        newest = _newest_anchor(anchor_list, key, seals[-1].seq if seals else 0)
        walk = Walk(key, seals, ranges, report)
        walk.anchored_seq = newest[0] if newest else 0
        walk.stale_before = at - unsealed_bound
        walk.late_after = unsealed_bound
        walk.chain_start = seals[0].sealed_at if seals else float("inf")
        walk.run(event_rows(s))
        check_duplicates(s, report)
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
    report: Report,
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


def _late(walk: Walk, bound: float, report: Report) -> None:
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


def _anchors(
    found: list[tuple[str, dict[str, Any] | str]],
    seals: list[AuditSeal],
    key: bytes,
    report: Report,
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
