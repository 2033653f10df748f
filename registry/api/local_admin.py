"""The administration half of the embedded registry (`LocalRegistry`, local.py): GC, fsck,
catalog rebuilds, checkpoint economics, the audit log, policies, tokens, signing keys and the
MLflow mirror. A mixin over the same Context: each method delegates to one operation, as the
contract (`registry.api.contract.Registry`) documents it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from policies.access import Action
from registry.api.contract import Registry
from registry.api.delegation import delegated
from registry.api.results import (
    Advice,
    AuditEvent,
    AuditSealed,
    AuditVerification,
    FsckReport,
    GcReport,
    HeartbeatRecorded,
    MirrorSynced,
    PolicyApplied,
    PolicyInForce,
    RebuildReport,
    RecoveryReport,
    ReleaseSigned,
    RestartPlanned,
    SigningKeyInfo,
    StorageReport,
    TokenCreated,
    TokenInfo,
    TokenRevoked,
    results_of,
)
from registry.core.refs import as_release_ref
from registry.errors import UsageError
from registry.text import redact_url

if TYPE_CHECKING:
    from registry.catalog.engine import Catalog
    from registry.core.config import Settings
    from registry.lifecycle.context import Context


class Administration:
    """`LocalRegistry`'s administration methods (it provides what they read below)."""

    if TYPE_CHECKING:
        settings: Settings
        _context: Context | None

        @property
        def context(self) -> Context: ...
        @property
        def catalog(self) -> Catalog: ...
        def authorize(
            self,
            action: Action | str,
            *,
            project: str | None = None,
            model: str | None = None,
            target: str = "",
        ) -> None: ...

    # Derived from the contract: each is the operation named, with this registry's Context.
    gc = delegated(Registry.gc, "registry.operations.gc:run_gc", GcReport)
    fsck = delegated(Registry.fsck, "registry.operations.fsck:fsck", FsckReport)
    rebuild_catalog = delegated(
        Registry.rebuild_catalog, "registry.operations.rebuild:rebuild", RebuildReport
    )
    advise = delegated(Registry.advise, "registry.economics.advise:advise", Advice)
    recovery = delegated(
        Registry.recovery, "registry.economics.advise:advise", RecoveryReport, legacy=True
    )
    plan_restart = delegated(
        Registry.plan_restart, "registry.economics.records:plan_restart", RestartPlanned
    )
    storage_init = delegated(
        Registry.storage_init, "registry.operations.admin:storage_init", StorageReport
    )
    audit_log = delegated(
        Registry.audit_log, "registry.operations.admin:audit_log", AuditEvent, many=True
    )
    audit_verify = delegated(
        Registry.audit_verify, "registry.trust.audit_chain.service:verify", AuditVerification
    )
    audit_seal = delegated(
        Registry.audit_seal, "registry.trust.audit_chain.service:seal", AuditSealed
    )
    policy_show = delegated(
        Registry.policy_show, "registry.operations.policy_admin:show", PolicyInForce
    )
    export_policy = delegated(Registry.export_policy, "registry.operations.policy_admin:export")
    create_token = delegated(
        Registry.create_token, "registry.operations.token_admin:create", TokenCreated
    )
    list_tokens = delegated(
        Registry.list_tokens, "registry.operations.token_admin:listing", TokenInfo, many=True
    )
    revoke_token = delegated(
        Registry.revoke_token, "registry.operations.token_admin:revoke", TokenRevoked
    )

    def heartbeat(self, run: str, *, project: str = "default", **figures: Any) -> HeartbeatRecorded:
        # by hand: the figures are keywords of their own (mypy cannot derive **figures)
        from registry.economics.records import record_heartbeat

        return HeartbeatRecorded.from_json(record_heartbeat(self.context, project, run, **figures))

    def apply_policy(self, path: str | Path) -> PolicyApplied:
        from registry.operations.policy_admin import apply

        out = apply(self.context, Path(path))
        self._context = None  # the next call runs under the applied policy
        return PolicyApplied.from_json(out)

    def signing_keys(self) -> list[SigningKeyInfo]:
        from registry.trust.release_signing import keys

        with self.context.catalog.session() as s:
            found = keys.all_keys(s, self.context.audit_key)  # behind the server: signed only
            return results_of(SigningKeyInfo, [k.to_json() for k in found])

    # Operators' commands on the host that holds the private keys (not through the server).
    def create_signing_key(self, *, rotate: bool = False) -> SigningKeyInfo:
        from registry.trust.release_signing import keys

        return SigningKeyInfo.from_json(keys.create(self.context, retire_active=rotate).to_json())

    sign_release = delegated(
        Registry.sign_release,
        "registry.lifecycle.late_signing:sign_release",
        ReleaseSigned,
        convert={"ref": as_release_ref},
    )

    def change_signing_key(
        self, key_id: str, event: str, reason: str | None = None
    ) -> SigningKeyInfo:
        from registry.trust.release_signing import keys

        return SigningKeyInfo.from_json(keys.change(self.context, key_id, event, reason).to_json())

    def mlflow_sync(self, budget_s: float = 300.0, skip: int | None = None) -> MirrorSynced:
        from registry.integrations.mirror.drain import drain, skip_event

        if not 0 < budget_s <= 3600:
            raise UsageError("the budget must be a number of seconds in (0, 3600]")
        if skip is not None and skip < 1:
            raise UsageError("skip must be an event id (a positive integer)")
        # Behind reg server a denial names no address of the server's (the caller may not know it)
        where = self.settings.mlflow_tracking_uri
        target = "the MLflow mirror" if self.context.server else redact_url(where)
        self.authorize(Action.MLFLOW_SYNC, target=target)
        skipped = skip_event(self.context, skip) if skip is not None else None
        out = drain(self.catalog, self.settings, budget_s, wait=True, holder=self.context.actor)
        return MirrorSynced.from_json(out | ({"skipped": skipped} if skipped else {}))
