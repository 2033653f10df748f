"""`LocalRegistry`: the embedded registry (DESIGN §9), what `Registry()` opens without `REG_URL`.

It builds a `Context` from local settings and delegates every call to the lifecycle functions;
access checks live there, in the library, not in the CLI. The catalog and the store are opened
lazily, so a command pays only for what it touches; the Context is built on first use and
rebuilt after `apply_policy`. The lifecycle functions answer in JSON, which each method hands
back as the contract's typed result (`registry.api.results`). Where an operation takes the
contract's own parameters the method is derived (`delegation.py`); the rest build their
arguments here. Each method means what the contract (`registry.api.contract.Registry`) documents.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from policies.access import Action
from registry.api.contract import Registry
from registry.api.delegation import delegated
from registry.api.local_admin import Administration
from registry.api.results import (
    AliasMoved,
    AliasRequest,
    CheckpointDetails,
    CheckpointFacts,
    CheckpointPulled,
    CheckpointPushed,
    CheckpointSummary,
    ClaimTaken,
    PartPushed,
    ReleaseDetails,
    ReleaseFetched,
    ReleasePromoted,
    ReleasePulled,
    ReleaseStatusChanged,
    ReleaseSummary,
    RunFinished,
    ScrubReport,
    ValidationReport,
    VerifyReport,
    WebhookDeliveryInfo,
    WebhookInfo,
    WebhooksDelivered,
    WebhookTested,
    results_of,
)
from registry.core.config import Settings
from registry.core.refs import (
    CheckpointRef,
    ReleaseRef,
    as_checkpoint_ref,
    as_ref,
    as_release_ref,
    split_run,
)
from registry.errors import UsageError

if TYPE_CHECKING:
    from registry.catalog.engine import Catalog
    from registry.core.progress import Progress
    from registry.journal.outbox import Outbox
    from registry.lifecycle.context import Context
    from registry.storage.base import BaseStore
    from registry.trust.policy_source import EffectivePolicy


class LocalRegistry(Administration, Registry):
    """The embedded registry: this process opens the catalog and the store itself (DESIGN §9,
    one person, or the server's own side of `reg server`)."""

    def __init__(self, settings: Settings | None = None, *, user: str | None = None) -> None:
        self.settings = settings or self.settings
        if user is not None:
            self._identity = (user, "caller")
        else:
            self._identity = (self.settings.user, self.settings.user_source)
        self._catalog: Catalog | None = None
        self._store: BaseStore | None = None
        self._context: Context | None = None
        self._events: Outbox | None = None

    @classmethod
    def serving(cls, settings: Settings, context: Context) -> LocalRegistry:
        """The registry of one `reg server` request: its methods run under `context` (the
        token's principal, the server's catalog, store and policy). Not to be closed: the
        catalog is the server's."""
        registry = cls(settings, user=context.actor)
        registry._catalog, registry._store = context.catalog, context.store
        registry._context = context
        return registry

    # -- parts ---------------------------------------------------------------------------------
    @property
    def user(self) -> str:
        return self._identity[0]

    @property
    def catalog(self) -> Catalog:
        if self._catalog is None:
            from registry.catalog.engine import Catalog

            self._catalog = Catalog.of(self.settings.catalog)
        return self._catalog

    @property
    def store(self) -> BaseStore:
        if self._store is None:
            from registry.storage import open_store

            def release_lock() -> tuple[str, int]:  # Object Lock for release objects
                rules = self.context.policy.release
                return rules.object_lock, rules.lock_days

            self._store = open_store(
                self.settings.store_url, release_lock=release_lock, s3=self.settings.s3
            )
        return self._store

    @property
    def context(self) -> Context:
        if self._context is None:
            from registry.journal.outbox import Outbox
            from registry.lifecycle.context import Context
            from registry.trust.audit_chain import keys
            from registry.trust.policy_source import EffectivePolicy
            from registry.trust.principal import Principal

            # Where this process can read the server's key (its host's operator) it signs
            # what it writes, so it decides under the proven policy, as the server does.
            key = keys.optional(self.settings.audit_key_path)
            policy = EffectivePolicy.in_force(self.catalog, self.settings, key, lambda: self.store)
            if self._events is None:
                self._events = Outbox(self.settings, webhooks=policy.has_webhooks, audit_key=key)
            self._context = Context(
                catalog=self.catalog,
                store=self.store,
                policy=policy,
                principal=Principal.under(*self._identity, policy),
                events=self._events,
                workers=self.settings.workers,
                audit_key=key,
                signing_dir=self.settings.signing_dir,
            )
        return self._context

    @property
    def policy(self) -> EffectivePolicy:
        return self.context.policy

    def close(self) -> None:
        if self._events is not None:
            self._events.flush()
        if self._catalog is not None:
            self._catalog.dispose()

    # -- access ----------------------------------------------------------------------------------
    def authorize(
        self,
        action: Action | str,
        *,
        project: str | None = None,
        model: str | None = None,
        target: str = "",
    ) -> None:
        """Raise PermissionDenied (and audit the denial) unless the policy allows it."""
        self.context.authorize(Action(action), project=project, model=model, target=target)

    def authorize_read(self, *, project: str | None = None, model: str | None = None) -> None:
        self.context.authorize_read(project=project, model=model)

    # -- checkpoints -----------------------------------------------------------------------------
    def push_checkpoint(
        self,
        src: str | Path,
        *,
        run: str,
        step: int | None = None,
        project: str = "default",
        world_size: int | None = None,
        metrics: dict[str, float] | None = None,
        progress: Progress | None = None,
        notes: list[str] | None = None,
        layout: str | None = None,
    ) -> CheckpointPushed:
        from registry.formats.recorded import recorded_step
        from registry.lifecycle.checkpoints.push import push

        if step is None:
            step = recorded_step(Path(src), None, world_size)
        return CheckpointPushed.from_json(
            push(
                self.context,
                Path(src),
                run=run,
                step=step,
                project=project,
                world_size=world_size,
                metrics=metrics,
                progress=progress,
                notes=notes,
                layout=layout,
            ).to_json()
        )

    def claim_checkpoint(
        self, run: str, step: int, *, project: str = "default", lease_s: float = 3600.0
    ) -> ClaimTaken:
        from registry.lifecycle.checkpoints import claimed

        return ClaimTaken.from_json(
            claimed.claim(self.context, CheckpointRef(project, run, step), lease_s)
        )

    def push_checkpoint_part(
        self,
        src: str | Path,
        *,
        claim: str,
        run: str,
        step: int,
        project: str = "default",
        progress: Progress | None = None,
    ) -> PartPushed:
        from registry.lifecycle.checkpoints import claimed

        ref = CheckpointRef(project, run, step)
        return PartPushed.from_json(
            claimed.push_part(self.context, Path(src), claim, ref, progress=progress)
        )

    def commit_claimed(
        self,
        claim: str,
        *,
        world_size: int | None = None,
        metrics: dict[str, float] | None = None,
        layout: str | None = None,
        save_costs: dict[str, Any] | None = None,
    ) -> CheckpointPushed:
        from registry.lifecycle.checkpoints import claimed

        return CheckpointPushed.from_json(
            claimed.commit(
                self.context,
                claim,
                world_size=world_size,
                metrics=metrics,
                layout=layout,
                save_costs=save_costs,
            )
        )

    list_checkpoints = delegated(
        Registry.list_checkpoints,
        "registry.lifecycle.checkpoints.listing:list_checkpoints",
        CheckpointSummary,
        many=True,
    )

    def show(self, ref: str | CheckpointRef | ReleaseRef) -> CheckpointDetails | ReleaseDetails:
        parsed = as_ref(ref)
        if isinstance(parsed, ReleaseRef):
            from registry.lifecycle import releases

            return ReleaseDetails.from_json(releases.show(self.context, parsed))
        from registry.lifecycle.checkpoints import read

        return CheckpointDetails.from_json(read.show(self.context, parsed))

    pull = delegated(
        Registry.pull,
        "registry.lifecycle.checkpoints.read:pull",
        CheckpointPulled,
        convert={"ref": as_checkpoint_ref, "dest": Path},
    )

    def verify(
        self,
        ref: str | CheckpointRef | ReleaseRef,
        *,
        repair: bool = False,
        provenance: bool = False,
        progress: Progress | None = None,
    ) -> VerifyReport:
        parsed = as_ref(ref)
        if isinstance(parsed, ReleaseRef):
            from registry.lifecycle import releases

            return VerifyReport.from_json(
                releases.verify(
                    self.context, parsed, repair=repair, provenance=provenance, progress=progress
                )
            )
        if provenance:
            raise UsageError(
                "--provenance checks a release's signature", "give a release ref (MODEL:vK)"
            )
        from registry.lifecycle.checkpoints import read

        return VerifyReport.from_json(
            read.verify(self.context, parsed, repair=repair, progress=progress)
        )

    scrub = delegated(Registry.scrub, "registry.operations.scrub:scrub", ScrubReport)

    pin = delegated(
        Registry.pin,
        "registry.lifecycle.checkpoints.read:set_pin",
        CheckpointFacts,
        convert={"ref": as_checkpoint_ref},
        pinned=True,
    )

    unpin = delegated(
        Registry.unpin,
        "registry.lifecycle.checkpoints.read:set_pin",
        CheckpointFacts,
        convert={"ref": as_checkpoint_ref},
        pinned=False,
    )

    def finish_run(
        self, run: str, *, project: str | None = None, status: str = "finished"
    ) -> RunFinished:
        from registry.lifecycle.runs import finish_run

        project_name, run_name = split_run(run, project)
        return RunFinished.from_json(finish_run(self.context, project_name, run_name, status))

    # -- validation, promotion, releases ---------------------------------------------------------
    def validate(
        self,
        ref: str | CheckpointRef,
        *,
        device: str = "auto",
        world_size: int = 1,
        model_factory: str | None = None,
        progress: Progress | None = None,
        layout: str | None = None,
        strip_prefix: str | None = None,
        memory_budget: str | None = None,
        with_optimizer: bool = False,
    ) -> ValidationReport:
        from registry.lifecycle.validation import Request, validate

        request = Request(
            device, world_size, model_factory, layout, strip_prefix, memory_budget, with_optimizer
        )
        return ValidationReport.from_json(
            validate(self.context, as_checkpoint_ref(ref), request, progress=progress)
        )

    def promote(
        self,
        ref: str | CheckpointRef,
        *,
        model: str,
        alias: str | None = None,
        dtype: str | None = None,
        max_shard_size: str = "5GB",
        extras: list[str | Path] | None = None,
        model_factory: str | None = None,
        progress: Progress | None = None,
        layout: str | None = None,
        allow_unclassified: bool = False,
        strip_prefix: str | None = None,
        convert: str | None = None,
        base: str | None = None,
    ) -> ReleasePromoted:
        from registry.lifecycle.promotion.run import promote

        return ReleasePromoted.from_json(
            promote(
                self.context,
                as_checkpoint_ref(ref),
                model=model,
                alias=alias,
                dtype=dtype,
                max_shard_size=max_shard_size,
                extras=[Path(p) for p in extras or []],
                model_factory=model_factory,
                progress=progress,
                layout=layout,
                allow_unclassified=allow_unclassified,
                strip_prefix=strip_prefix,
                convert=convert,
                base=base,
            )
        )

    releases = delegated(
        Registry.releases, "registry.lifecycle.releases:list_releases", ReleaseSummary, many=True
    )

    pull_release = delegated(
        Registry.pull_release,
        "registry.lifecycle.releases:pull",
        ReleasePulled,
        convert={"ref": as_release_ref, "dest": Path},
    )

    def fetch_release(
        self,
        ref: str | ReleaseRef,
        *,
        public_key: str | None = None,
        cache_dir: str | Path | None = None,
        hf_cache: str | Path | None = None,
        progress: Progress | None = None,
    ) -> ReleaseFetched:
        from registry.api.consumers.fetch import fetch_release

        return fetch_release(
            self,
            ref,
            public_key=public_key,
            cache_dir=cache_dir,
            hf_cache=hf_cache,
            progress=progress,
        )

    def set_alias(self, model: str, alias: str, version: str | int) -> AliasRequest | AliasMoved:
        from registry.lifecycle.alias_workflow import set_alias

        out = set_alias(self.context, model, alias, version)
        return AliasRequest.from_json(out) if "request" in out else AliasMoved.from_json(out)

    def approve(self, request: int, version: str | None = None) -> AliasRequest:
        from registry.lifecycle.alias_workflow import approve

        return AliasRequest.from_json(approve(self.context, request, version))

    def reject(self, request: int, reason: str) -> AliasRequest:
        from registry.lifecycle.alias_workflow import reject

        return AliasRequest.from_json(reject(self.context, request, reason))

    def alias_requests(
        self, model: str | None = None, state: str | None = None
    ) -> list[AliasRequest]:
        from registry.lifecycle.alias_workflow import list_requests

        return results_of(AliasRequest, list_requests(self.context, model, state=state))

    webhooks = delegated(
        Registry.webhooks,
        "registry.integrations.webhooks.admin:subscribers",
        WebhookInfo,
        many=True,
    )
    test_webhook = delegated(
        Registry.test_webhook, "registry.integrations.webhooks.admin:test", WebhookTested
    )
    webhook_deliveries = delegated(
        Registry.webhook_deliveries,
        "registry.integrations.webhooks.admin:deliveries",
        WebhookDeliveryInfo,
        many=True,
    )
    deliver_webhooks = delegated(
        Registry.deliver_webhooks,
        "registry.integrations.webhooks.admin:deliver_now",
        WebhooksDelivered,
    )

    deprecate = delegated(
        Registry.deprecate,
        "registry.lifecycle.releases:set_status",
        ReleaseStatusChanged,
        convert={"ref": as_release_ref},
        status="deprecated",
    )

    yank = delegated(
        Registry.yank,
        "registry.lifecycle.releases:set_status",
        ReleaseStatusChanged,
        convert={"ref": as_release_ref},
        status="yanked",
    )
