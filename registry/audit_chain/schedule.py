"""The server's sealer: one replica at a time (the `audit-seal` lease, kept while it leads),
every `REG_AUDIT_SEAL_EVERY` (10s); the head is anchored when the chain moved and
`REG_AUDIT_ANCHOR_EVERY` (5m) has passed since this replica's last anchor."""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

from registry.audit_chain import anchors
from registry.audit_chain.sealer import anchor_head, seal_pending
from registry.catalog import leases

if TYPE_CHECKING:
    from registry.catalog.engine import Catalog
    from registry.storage.base import BaseStore

LEASE = "audit-seal"


def intervals(env: dict[str, str] | None = None) -> tuple[float, float]:
    """(seal every, anchor every) in seconds, from the environment; a bad value is one line."""
    from registry.timeutil import positive_duration

    env = dict(os.environ if env is None else env)
    seal = positive_duration(env.get("REG_AUDIT_SEAL_EVERY") or "10s", "REG_AUDIT_SEAL_EVERY")
    anchor = positive_duration(
        env.get("REG_AUDIT_ANCHOR_EVERY") or "5m", "REG_AUDIT_ANCHOR_EVERY", "5m"
    )
    return seal, anchor


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
    ) -> None:
        self.catalog, self.store, self.key = catalog, store, key
        self.anchor_every_s, self.holder = anchor_every_s, holder
        self.lease_s = max(60.0, 6 * every_s)
        self.token: str | None = None
        self.full = True  # the first cycle looks at the whole log (stragglers of a crash)
        self.anchored_seq = 0
        self.anchored_at = float("-inf")

    def cycle(self) -> dict[str, Any] | None:
        """One round if this replica leads: what it sealed and anchored; None otherwise."""
        if not self._lead():
            return None
        run = seal_pending(self.catalog, self.key, full=self.full)
        self.full = False
        out: dict[str, Any] = {"seals": run.seals, "sealed": run.sealed}
        if run.refused:
            out["refused"] = sorted(run.refused)
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

    def close(self) -> None:
        if self.token is not None:
            leases.release(self.catalog, LEASE, self.token)
            self.token = None
