"""What is signed, byte for byte: events, seals and anchors, each under its own domain label so
that no MAC of one kind can stand in for another.

- event:  HMAC(key, "reg.audit.event/1\\n" + canonical JSON of uid, ts, actor, action, target,
          outcome, details). Written at insert by whoever records the event: no shared state,
          so replicas never wait on each other. The row id is not in it (it is assigned by the
          database); the seal binds ids to MACs.
- entry:  what a seal takes of an event: its MAC, or for an unsigned event of the history
          before the key (only in the genesis seal) the sha256 of its canonical content.
- seal:   HMAC(key, "reg.audit.seal/1\\n" + seq, prev_mac, key_id, sealed_at, count, total,
          then "id:entry\\n" for every event in id order).
- anchor: HMAC(key, "reg.audit.anchor/1\\n" + canonical JSON of the anchor without its MAC).
"""

from __future__ import annotations

import bisect
import hashlib
import hmac
import json
from collections.abc import Iterable, Sequence
from typing import Any

GENESIS_PREV = "0" * 64
TAG_HEX = 16  # each event's tag in a seal: enough to name an edited or moved event
EVENT_FIELDS = ("uid", "ts", "actor", "action", "target", "outcome", "details")


def canonical(doc: Any) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def normalized(details: dict[str, Any]) -> dict[str, Any]:
    """Details as the database gives them back (JSON round trip: tuples become lists, keys
    strings), so the MAC computed at insert is the one a verifier recomputes."""
    out: dict[str, Any] = json.loads(canonical(details))
    return out


def outbox_mac(key: bytes, uid: str, ts: float, kind: str, payload: dict[str, Any]) -> str:
    """An outbox event's MAC: what webhooks send is what the server emitted."""
    content = {"uid": uid, "ts": ts, "kind": kind, "payload": payload}
    return hmac.new(key, b"reg.outbox/1\n" + canonical(content), hashlib.sha256).hexdigest()


def delivery_mac(key: bytes, subscriber: str, event_id: str, body: str) -> str:
    """A webhook delivery's MAC: its body is sent, and signed for the receiver, only as made."""
    content = {"subscriber": subscriber, "event_id": event_id, "body": body}
    return hmac.new(key, b"reg.delivery/1\n" + canonical(content), hashlib.sha256).hexdigest()


def event_content(row: Any) -> dict[str, Any]:
    return {name: getattr(row, name) for name in EVENT_FIELDS}


def event_mac(key: bytes, content: dict[str, Any]) -> str:
    return hmac.new(key, b"reg.audit.event/1\n" + canonical(content), hashlib.sha256).hexdigest()


def event_signed(key: bytes, row: Any) -> bool:
    """Does the audit event row carry a MAC that verifies under `key`?"""
    return row.mac is not None and same(row.mac, event_mac(key, event_content(row)))


def unsigned_entry(content: dict[str, Any]) -> str:
    return hashlib.sha256(b"reg.audit.unsigned/1\n" + canonical(content)).hexdigest()


def seal_mac(
    key: bytes,
    *,
    seq: int,
    prev_mac: str,
    key_id: str,
    sealed_at: float,
    total: int,
    entries: Sequence[tuple[int, str]],
) -> str:
    head = canonical(
        {
            "seq": seq,
            "prev_mac": prev_mac,
            "key_id": key_id,
            "sealed_at": sealed_at,
            "count": len(entries),
            "total": total,
        }
    )
    mac = hmac.new(key, b"reg.audit.seal/1\n" + head + b"\n", hashlib.sha256)
    for event_id, entry in entries:
        mac.update(f"{event_id}:{entry}\n".encode())
    return mac.hexdigest()


def seal_row_mac(key: bytes, seal: Any, entries: Sequence[tuple[int, str]]) -> str:
    """`seal_mac` of a stored seal row (its seq, link, key id, time and total) over `entries`."""
    return seal_mac(
        key,
        seq=seal.seq,
        prev_mac=seal.prev_mac,
        key_id=seal.key_id,
        sealed_at=seal.sealed_at,
        total=seal.total,
        entries=entries,
    )


def anchor_mac(key: bytes, doc: dict[str, Any]) -> str:
    body = {k: v for k, v in doc.items() if k != "anchor_mac"}
    return hmac.new(key, b"reg.audit.anchor/1\n" + canonical(body), hashlib.sha256).hexdigest()


def same(a: str | None, b: str | None) -> bool:
    return a is not None and b is not None and hmac.compare_digest(a, b)


def tags_of(entries: Iterable[tuple[int, str]]) -> str:
    return "".join(entry[:TAG_HEX] for _, entry in entries)


def split_tags(tags: str) -> list[str]:
    return [tags[i : i + TAG_HEX] for i in range(0, len(tags), TAG_HEX)]


# -- compact id ranges ("1-50,52,54-60") ----------------------------------------------------------


def encode_ranges(ids: Sequence[int]) -> str:
    """Sorted, distinct ids as ranges."""
    parts: list[str] = []
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        parts.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(parts)


def decode_ranges(text: str) -> list[tuple[int, int]]:
    """The ranges of a seal, or ValueError: a seal whose ranges do not parse, or that are not
    ascending and disjoint, was not written by a sealer."""
    out: list[tuple[int, int]] = []
    for part in text.split(",") if text else []:
        lo, sep, hi = part.partition("-")
        low, high = int(lo), int(hi) if sep else int(lo)
        if low > high or (out and low <= out[-1][1]) or low < 0:
            raise ValueError(f"bad range {part!r}")
        out.append((low, high))
    return out


def expand(ranges: Sequence[tuple[int, int]]) -> list[int]:
    return [i for low, high in ranges for i in range(low, high + 1)]


class Covered:
    """Membership of ids in a set of ranges (merged, sorted): the sealed part of the log."""

    def __init__(self, ranges: Iterable[tuple[int, int]]) -> None:
        merged: list[list[int]] = []
        for low, high in sorted(ranges):
            if merged and low <= merged[-1][1] + 1:
                merged[-1][1] = max(merged[-1][1], high)
            else:
                merged.append([low, high])
        self._lows = [m[0] for m in merged]
        self._highs = [m[1] for m in merged]

    def __contains__(self, event_id: object) -> bool:
        if not isinstance(event_id, int):
            return False
        i = bisect.bisect_right(self._lows, event_id) - 1
        return i >= 0 and event_id <= self._highs[i]
