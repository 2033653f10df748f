"""Work the server does on its own: the MLflow drain, sweeping what dead requests left in its
upload directory, sealing the audit log, delivering webhooks, and, when asked, the GC schedule.

Replicas share the work through catalog leases: a scheduled GC takes the `gc-schedule` lease
for one interval (whichever replica gets it runs that cycle; the GC lease still keeps any two
GCs apart), the drain holds the drain lease while it runs (`mirror.drain`), and one
replica at a time seals the audit log (`audit-seal`, `registry.trust.audit_chain.schedule`).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import TYPE_CHECKING

from registry.catalog import leases
from registry.core.detached import spawn_drain
from registry.integrations.mirror.drain import pending_count
from registry.integrations.webhooks.deliver import drain
from registry.journal.outbox import Outbox
from registry.lifecycle.context import Context
from registry.operations.gc import run_gc
from registry.operations.token_admin import SERVER_PRINCIPAL
from registry.server.upload import sweep
from registry.trust.audit_chain import keys
from registry.trust.audit_chain.schedule import SealSchedule, intervals
from registry.trust.principal import Principal

if TYPE_CHECKING:
    from registry.server.state import ServerState

log = logging.getLogger("reg.server")
SCHEDULE_LEASE = "gc-schedule"
DRAIN_EVERY_S = 30.0
WEBHOOKS_EVERY_S = 1.0
POLICY_EVERY_S = 10.0  # the webhook loop's view of the policy is at most this old


class Background:
    def __init__(self, state: ServerState, gc_every_s: float | None) -> None:
        self.state, self.gc_every_s = state, gc_every_s
        self.stop = threading.Event()
        self.threads: list[threading.Thread] = []

    def start(self) -> None:
        self.sweep_uploads()
        self._spawn(self._housekeeping_loop, "reg-housekeeping")
        self._spawn(self._audit_loop, "reg-audit-seal")
        if self.gc_every_s:
            self._spawn(self._gc_loop, "reg-gc-schedule")
        self._spawn(self._webhook_loop, "reg-webhooks")

    def _spawn(self, target: object, name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)  # type: ignore[arg-type]
        thread.start()
        self.threads.append(thread)

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=5)

    def sweep_uploads(self) -> None:
        """Upload and promotion directories whose request died with its process (SIGKILL, a
        crash): nobody holds their lock any more."""
        removed = sweep(self.state.settings.home / "uploads")
        if removed:
            log.info(json.dumps({"swept_uploads": removed}))

    def _housekeeping_loop(self) -> None:
        """Events a request's own drain left behind (MLflow down, a crash) are retried; dead
        requests' upload directories are removed."""
        while not self.stop.wait(DRAIN_EVERY_S):
            try:
                self.sweep_uploads()
                if self.state.settings.mlflow_drain and pending_count(self.state.catalog):
                    spawn_drain(self.state.settings)
            except Exception:
                log.exception("housekeeping failed")

    def _audit_loop(self) -> None:
        """Seal the audit events every few seconds and anchor the chain head now and then;
        only the replica holding the lease does (requests only sign their own events)."""
        every, anchor_every = intervals()
        schedule = SealSchedule(
            self.state.catalog,
            self.state.store,
            keys.for_server(self.state.settings.audit_key_path),
            every_s=every,
            anchor_every_s=anchor_every,
            holder=SERVER_PRINCIPAL,
        )
        try:
            while not self.stop.wait(every):
                try:
                    out = schedule.cycle()
                    if out and (out["seals"] or "anchor" in out or "refused" in out):
                        log.info(json.dumps({"audit": "sealed", **out}))
                except Exception:
                    log.exception("audit sealing failed")
        finally:
            schedule.close()

    def _webhook_loop(self) -> None:
        """Deliver the policy's webhooks (`webhooks.deliver`): on a thread of its own,
        so a receiver that hangs delays only its own deliveries, never a request."""
        hooks, since, read_at = [], None, -POLICY_EVERY_S
        while not self.stop.wait(WEBHOOKS_EVERY_S):
            try:
                if time.monotonic() - read_at >= POLICY_EVERY_S:  # proving it reads the store
                    policy = self.state.policy()
                    hooks, since = list(policy.rules.webhooks), policy.since
                    read_at = time.monotonic()
                if hooks:
                    budget = WEBHOOKS_EVERY_S * 5
                    out = drain(
                        self.state.catalog,
                        hooks,
                        budget,
                        SERVER_PRINCIPAL,
                        since,
                        self.state.key,
                    )
                    if out.get("delivered") or out.get("failed"):
                        log.info(json.dumps({"webhooks": out}))
            except Exception:
                log.exception("webhook delivery failed")

    def _gc_loop(self) -> None:
        assert self.gc_every_s is not None
        while not self.stop.wait(self.gc_every_s):
            try:
                out = self.run_gc_cycle()
                if out is not None:
                    log.info(json.dumps({"gc": "scheduled", **out}))
            except Exception:
                log.exception("scheduled gc failed")

    def run_gc_cycle(self) -> dict[str, object] | None:
        """One scheduled GC, if this replica leads this interval; None if another does."""
        state = self.state
        assert self.gc_every_s is not None
        token, _ = leases.try_acquire(
            state.catalog, SCHEDULE_LEASE, SERVER_PRINCIPAL, self.gc_every_s * 0.9
        )
        if token is None:
            return None
        # Retention rules decide deletions: only the proven policy (a forged row could say
        # ttl = "0s").
        policy = state.policy()
        # The schedule acts for the server itself, registry-wide: an admin by construction.
        events = Outbox(state.settings, audit_key=state.key)
        ctx = Context(
            catalog=state.catalog,
            store=state.store,
            policy=policy,
            principal=Principal(SERVER_PRINCIPAL, "server", single_user=True),
            events=events,
            workers=state.settings.workers,
            server=True,
            audit_key=state.key,
        )
        try:
            result = run_gc(ctx)
        finally:
            events.flush()
        return {
            "deleted": sum(1 for d in result["decisions"] if d["action"] == "delete"),
            "freed_bytes": result["freed_bytes"],
        }
