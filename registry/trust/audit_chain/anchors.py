"""Anchors: the chain head written to the object store, where the database owner cannot reach.

`audit/anchors/<seq, 12 digits>.json` holds {seq, mac, last_event_id, events, key_id, ts} and
an `anchor_mac` over them. Written once (put-if-absent: `If-None-Match: *` on S3, `link()`
locally) and, where the bucket has Object Lock, given a COMPLIANCE retention: not even the
bucket's owner can delete or overwrite it until the retention runs out. A catalog whose chain
is shorter than the newest anchor lost its tail.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from registry.core.timeutil import iso, now
from registry.errors import ObjectExists, RegistryError
from registry.trust.audit_chain import macs

if TYPE_CHECKING:
    from registry.storage.base import BaseStore

PREFIX = "audit/anchors/"
FORMAT = "reg.audit-anchor/1"


def key_for(seq: int) -> str:
    return f"{PREFIX}{seq:012d}.json"


@dataclass(frozen=True, slots=True)
class Head:
    """What an anchor records of the chain."""

    seq: int
    mac: str
    last_event_id: int
    events: int
    key_id: str


def write(store: BaseStore, key: bytes, head: Head) -> dict[str, Any]:
    """Anchor `head`: {key, seq, existing, locked}. An anchor of the same seq already there
    (another replica's, an earlier explicit seal's) is left as it is."""
    doc: dict[str, Any] = {
        "format": FORMAT,
        "seq": head.seq,
        "mac": head.mac,
        "last_event_id": head.last_event_id,
        "events": head.events,
        "key_id": head.key_id,
        "ts": iso(now()),
    }
    doc["anchor_mac"] = macs.anchor_mac(key, doc)
    name = key_for(head.seq)
    try:
        put = store.put_bytes(name, macs.canonical(doc) + b"\n")
    except ObjectExists:
        return {"key": name, "seq": head.seq, "existing": True, "locked": None}
    locked = store.lock_compliance(name, put.version)
    return {"key": name, "seq": head.seq, "existing": False, "locked": locked}


def read_all(store: BaseStore) -> list[tuple[str, dict[str, Any] | str]]:
    """Every anchor in key (= seq) order: (key, document), or (key, why it does not read)."""
    out: list[tuple[str, dict[str, Any] | str]] = []
    for info in store.list(PREFIX):
        try:
            doc = json.loads(store.get_bytes(info.key))
        except (RegistryError, ValueError, UnicodeDecodeError) as exc:
            out.append((info.key, f"does not read: {type(exc).__name__}"))
            continue
        out.append((info.key, doc if isinstance(doc, dict) else "not a JSON object"))
    return out
