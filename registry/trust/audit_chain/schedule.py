"""The server's sealer: one replica at a time (the `audit-seal` lease, kept while it leads),
every `REG_AUDIT_SEAL_EVERY` (10s); the head is anchored when the chain moved and
`REG_AUDIT_ANCHOR_EVERY` (5m) has passed since this replica's last anchor.

Whoever can write the `lease` table (the runtime role, the owner) can hold the lease for a
holder that never seals: a replica that has not led for a few intervals while signed events
wait unsealed logs an `{"audit": "stalled"}` warning, and `reg audit verify` fails (`stalled`,
`anchor-stale`) once events wait longer than `bounds()`. `reg audit seal` takes no lease.

The leader writes an empty seal (a heartbeat) when nothing was sealed for `REG_AUDIT_ANCHOR_EVERY`
(at most a third of the bound), so the head and the newest anchor of a healthy chain are never
older than the bound, even with nothing to seal: a head (an anchor) older than that is a stall
whatever events are left (the owner deleting each one before it ages), and events sealed later
than the bound after they were written are `sealed-late` (a stall that ended).

A routine cycle looks at ids above the chain's head and the last 15 minutes (`sealer.py`);
every `FULL_SCAN_S` the whole log is scanned, so an event with an old timestamp (a replica's
clock behind, a transaction held open) and a low id is sealed all the same."""

from __future__ import annotations

import json
import logging
import math
import time
from typing import TYPE_CHECKING, Any

from sqlalchemy import func
from sqlmodel import col, select

from registry.catalog import leases
from registry.catalog.models import AuditEvent, AuditSeal, Lease
from registry.core.config import Settings
from registry.core.timeutil import iso, now
from registry.trust.audit_chain import anchors
from registry.trust.audit_chain.sealer import anchor_head, heartbeat, seal_pending

if TYPE_CHECKING:
    from registry.catalog.engine import Catalog
    from registry.storage.base import BaseStore

log = logging.getLogger("reg.server")
LEASE = "audit-seal"
FULL_SCAN_S = 600.0  # a full scan for stragglers at least this often
MIN_BOUND_S = 900.0  # verify's bounds are never below 15 minutes


def bounds(env: dict[str, str] | None = None) -> tuple[float, float]:
    """(max unsealed age, max unanchored age) `reg audit verify` accepts by default: ten seal
    intervals and three anchor intervals, at least 15 minutes each. A signed event older than
    that, unsealed (unanchored), means sealing stalled, and events written since could have
    been deleted without a trace."""
    seal, anchor = intervals(env)
    return max(MIN_BOUND_S, 10 * seal), max(MIN_BOUND_S, 3 * anchor)


def intervals(env: dict[str, str] | None = None) -> tuple[float, float]:
    """(seal every, anchor every) in seconds: the settings' (REG_AUDIT_SEAL_EVERY,
    REG_AUDIT_ANCHOR_EVERY); a bad value is one line."""
    server = Settings.from_env(env).server
    return server.seal_every_s, server.anchor_every_s


class SealSchedule:
    def __init__(
        self,
        catalog: Catalog,
        store: BaseStore,
        key: bytes,
        *,
        every_s: float,
        anchor_every_s: float,
        holder: str,
        full_every: int | None = None,
    ) -> None:
        self.catalog, self.store, self.key = catalog, store, key
        self.every_s, self.anchor_every_s, self.holder = every_s, anchor_every_s, holder
        self.lease_s = max(60.0, 6 * every_s)
        self.token: str | None = None
        # The first cycle looks at the whole log (stragglers of a crash), then every
        # `full_every`-th cycle of this leader.
        self.full_every = full_every or max(1, math.ceil(FULL_SCAN_S / every_s))
        self.cycles = 0
        self.anchored_seq = 0
        self.anchored_at = float("-inf")
        self.led_at = time.monotonic()  # when this replica last led (or started)
        self.warned_at = float("-inf")
        self.patience_s = max(3 * every_s, 30.0)  # not leading this long, events waiting: warn
        # An empty seal when nothing new was sealed for this long: every anchor interval, and
        # well within verify's bound, so a healthy head is never older than the bound.
        self.heartbeat_s = min(anchor_every_s, max(MIN_BOUND_S, 10 * every_s) / 3)

    def cycle(self) -> dict[str, Any] | None:
        """One round if this replica leads: what it sealed and anchored; None otherwise."""
        if not self._lead():
            self._watch()
            return None
        self.led_at = time.monotonic()
        full = self.cycles % self.full_every == 0
        self.cycles += 1
        run = seal_pending(self.catalog, self.key, full=full)
        out: dict[str, Any] = {"seals": run.seals, "sealed": run.sealed}
        if run.refused:
            out["refused"] = sorted(run.refused)
        if not run.seals and not run.raced:
            beat = heartbeat(self.catalog, self.key, every_s=self.heartbeat_s)
            if beat is not None:
                out["heartbeat"] = beat
        if time.monotonic() - self.anchored_at >= self.anchor_every_s:
            with self.catalog.session() as s:
                head = anchor_head(s)
            if head is not None and head.seq > self.anchored_seq:
                out["anchor"] = anchors.write(self.store, self.key, head)
                self.anchored_seq, self.anchored_at = head.seq, time.monotonic()
        return out

    def _lead(self) -> bool:
        if self.token is not None and leases.renew(self.catalog, LEASE, self.token, self.lease_s):
            return True
        self.token, _ = leases.try_acquire(self.catalog, LEASE, self.holder, self.lease_s)
        return self.token is not None

    def _watch(self) -> None:
        """Not leading: if another holder keeps the lease while signed events wait unsealed
        for several intervals, say so (at most once a lease period)."""
        mono = time.monotonic()
        if mono - self.led_at < self.patience_s or mono - self.warned_at < self.lease_s:
            return
        stall = stalled_since(self.catalog, self.patience_s)
        if stall is None:
            return
        self.warned_at = mono
        log.warning(json.dumps({"audit": "stalled", **stall}))

    def close(self) -> None:
        if self.token is not None:
            leases.release(self.catalog, LEASE, self.token)
            self.token = None


def stalled_since(catalog: Catalog, patience_s: float) -> dict[str, Any] | None:
    """The lease's holder and the oldest signed event above the chain's head, when that event
    has waited longer than `patience_s`; None while sealing keeps up."""
    with catalog.session() as s:
        high = s.exec(select(func.max(AuditSeal.high))).one() or 0
        oldest = s.exec(
            select(func.min(AuditEvent.ts)).where(
                col(AuditEvent.id) > high, col(AuditEvent.mac).is_not(None)
            )
        ).one()
        if oldest is None or now() - oldest < patience_s:
            return None
        lease = s.get(Lease, LEASE)
        return {
            "oldest_unsealed": iso(oldest),
            "waiting_s": round(now() - oldest, 1),
            "lease_holder": None if lease is None else lease.holder,
            "lease_host": None if lease is None else lease.host,
            "lease_expires": None if lease is None else _when(lease.expires_at),
            "hint": "another holder keeps the audit-seal lease and does not seal: check it "
            "(the lease table), run `reg audit seal`; `reg audit verify` fails once events "
            "wait past its bound",
        }


def _when(ts: float) -> str | None:
    """ISO time of a lease's expiry, which whoever planted it chose (year 33658, NaN...)."""
    try:
        return iso(ts)
    except (ValueError, OverflowError, OSError):
        return f"{ts!r} (not a time)"
