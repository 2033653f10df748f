"""The administration half of the embedded registry (`LocalRegistry`, local.py): GC, fsck,
catalog rebuilds, checkpoint economics, the audit log, policies, tokens, signing keys and the
MLflow mirror. A mixin over the same Context: each method delegates to one operation, as the
contract (`registry.api.contract.Registry`) documents it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from policies.access import Action
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
from registry.core.refs import ReleaseRef, as_release_ref
from registry.errors import UsageError
from registry.text import redact_url

if TYPE_CHECKING:
    from registry.catalog.engine import Catalog
    from registry.core.config import Settings
    from registry.core.progress import Progress
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

    def gc(self, *, dry_run: bool = False) -> GcReport:
        from registry.operations.gc import run_gc

        return GcReport.from_json(run_gc(self.context, dry_run=dry_run))

    def fsck(
        self,
        project: str | None = None,
        *,
        repair: bool = False,
        full: bool = False,
        sample: int = 32,
        progress: Progress | None = None,
    ) -> FsckReport:
        from registry.operations.fsck import fsck

        ctx = self.context
        return FsckReport.from_json(
            fsck(ctx, project=project, full=full, sample=sample, repair=repair, progress=progress)
        )

    def rebuild_catalog(self, *, dry_run: bool = False) -> RebuildReport:
        from registry.operations.rebuild import rebuild

        return RebuildReport.from_json(rebuild(self.context, dry_run=dry_run))

    def advise(
        self,
        run: str,
        *,
        project: str = "default",
        gpus: int | None = None,
        mtbf_s: float | None = None,
        fleet: bool = False,
        node_loss_share: float | None = None,
    ) -> Advice:
        from registry.economics import advise

        return Advice.from_json(
            advise(
                self.context,
                run,
                project=project,
                gpus=gpus,
                mtbf_s=mtbf_s,
                fleet=fleet,
                node_loss_share=node_loss_share,
            )
        )

    def recovery(
        self, run: str, *, project: str = "default", mtbf_s: float | None = None
    ) -> RecoveryReport:
        from registry.economics import advise

        return RecoveryReport.from_json(
            advise(self.context, run, project=project, mtbf_s=mtbf_s, legacy=True)
        )

    def plan_restart(self, run: str, *, project: str = "default") -> RestartPlanned:
        from registry.economics.records import plan_restart

        return RestartPlanned.from_json(plan_restart(self.context, project, run))

    def heartbeat(self, run: str, *, project: str = "default", **figures: Any) -> HeartbeatRecorded:
        from registry.economics.records import record_heartbeat

        return HeartbeatRecorded.from_json(record_heartbeat(self.context, project, run, **figures))

    def storage_init(self) -> StorageReport:
        from registry.operations.admin import storage_init

        return StorageReport.from_json(storage_init(self.context))

    def audit_log(
        self, *, since: float | None = None, actor: str | None = None, action: str | None = None
    ) -> list[AuditEvent]:
        from registry.operations.admin import audit_log

        return results_of(
            AuditEvent, audit_log(self.context, since=since, actor=actor, action=action)
        )

    def audit_verify(
        self, *, max_unsealed_age_s: float | None = None, max_anchor_age_s: float | None = None
    ) -> AuditVerification:
        from registry.trust.audit_chain.service import verify

        return AuditVerification.from_json(
            verify(
                self.context,
                max_unsealed_age_s=max_unsealed_age_s,
                max_anchor_age_s=max_anchor_age_s,
            )
        )

    def audit_seal(self) -> AuditSealed:
        from registry.trust.audit_chain.service import seal

        return AuditSealed.from_json(seal(self.context))

    def policy_show(self) -> PolicyInForce:
        from registry.operations.policy_admin import show

        return PolicyInForce.from_json(show(self.context))

    def apply_policy(self, path: str | Path) -> PolicyApplied:
        from registry.operations.policy_admin import apply

        out = apply(self.context, Path(path))
        self._context = None  # the next call runs under the applied policy
        return PolicyApplied.from_json(out)

    def export_policy(self, bucket: str | None = None) -> tuple[dict[str, Any], list[str]]:
        from registry.operations.policy_admin import export

        return export(self.context, bucket)

    def create_token(self, principal: str, *, expires_s: float | None = None) -> TokenCreated:
        from registry.operations import token_admin

        return TokenCreated.from_json(
            token_admin.create(self.context, principal, expires_s=expires_s)
        )

    def list_tokens(self) -> list[TokenInfo]:
        from registry.operations import token_admin

        return results_of(TokenInfo, token_admin.listing(self.context))

    def signing_keys(self) -> list[SigningKeyInfo]:
        from registry.trust.release_signing import keys

        with self.context.catalog.session() as s:
            found = keys.all_keys(s, self.context.audit_key)  # behind the server: signed only
            return results_of(SigningKeyInfo, [k.to_json() for k in found])

    # Operators' commands on the host that holds the private keys (not through the server).
    def create_signing_key(self, *, rotate: bool = False) -> SigningKeyInfo:
        from registry.trust.release_signing import keys

        return SigningKeyInfo.from_json(keys.create(self.context, retire_active=rotate).to_json())

    def sign_release(
        self, ref: str | ReleaseRef, *, progress: Progress | None = None
    ) -> ReleaseSigned:
        from registry.lifecycle.late_signing import sign_release

        return ReleaseSigned.from_json(sign_release(self.context, as_release_ref(ref), progress))

    def change_signing_key(
        self, key_id: str, event: str, reason: str | None = None
    ) -> SigningKeyInfo:
        from registry.trust.release_signing import keys

        return SigningKeyInfo.from_json(keys.change(self.context, key_id, event, reason).to_json())

    def revoke_token(self, token_id: str) -> TokenRevoked:
        from registry.operations import token_admin

        return TokenRevoked.from_json(token_admin.revoke(self.context, token_id))

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
