"""`Registry`: the one object a Python user (and the CLI) works through, and its contract.

`Registry(settings)` opens the registry the settings name: the embedded one
(`registry.api.local.LocalRegistry`, which opens the catalog and the store itself, DESIGN §9),
or with `REG_URL` set the one behind `reg server`
(`registry.api.remote.registry.RemoteRegistry`, the same methods run by the server under the
identity of a token). Both subclass `Registry`, so mypy checks every method of each against
the signatures here; `tests/api/test_contract.py` checks that neither leaves one out. A method's
`@http` names its route (`registry.api.wire`): the remote registry's call and the server's
endpoint are derived from the signature here.

The implementations are named, not imported, here (as fsspec names its filesystems): the
contract depends on neither, and opening one imports only it.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Self

from registry.api.wire import http
from registry.core.config import Settings

if TYPE_CHECKING:
    from registry.api.results import (
        Advice,
        AliasMoved,
        AliasRequest,
        AuditEvent,
        AuditSealed,
        AuditVerification,
        CheckpointDetails,
        CheckpointFacts,
        CheckpointPulled,
        CheckpointPushed,
        CheckpointSummary,
        ClaimTaken,
        FsckReport,
        GcReport,
        HeartbeatRecorded,
        MirrorSynced,
        PartPushed,
        PolicyApplied,
        PolicyInForce,
        RebuildReport,
        RecoveryReport,
        ReleaseDetails,
        ReleaseFetched,
        ReleasePromoted,
        ReleasePulled,
        ReleaseSigned,
        ReleaseStatusChanged,
        ReleaseSummary,
        RestartPlanned,
        RunFinished,
        ScrubReport,
        SigningKeyInfo,
        StorageReport,
        TokenCreated,
        TokenInfo,
        TokenRevoked,
        ValidationReport,
        VerifyReport,
        WebhookDeliveryInfo,
        WebhookInfo,
        WebhooksDelivered,
        WebhookTested,
    )
    from registry.core.progress import Progress
    from registry.core.refs import CheckpointRef, ReleaseRef
    from registry.trust.policy_source import EffectivePolicy


class Registry:
    """What a registry does, embedded or remote; `Registry(...)` returns the one the settings
    name. Every method raises the errors of `registry.errors` (one line, an exit code)."""

    IMPLEMENTATIONS: ClassVar[dict[str, str]] = {
        "local": "registry.api.local:LocalRegistry",
        "remote": "registry.api.remote.registry:RemoteRegistry",
    }
    settings: Settings

    def __new__(cls, settings: Settings | None = None, *, user: str | None = None) -> Self:
        settings = settings or Settings.from_env()
        kind: type[Self] = cls
        if cls is Registry:
            module, _, name = cls.IMPLEMENTATIONS[
                "remote" if settings.remote else "local"
            ].partition(":")
            kind = getattr(importlib.import_module(module), name)
        registry = super().__new__(kind)
        registry.settings = settings  # read once: __init__ keeps it
        return registry

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- parts ---------------------------------------------------------------------------------
    @property
    def user(self) -> str:
        """Who this registry acts as: the caller's name embedded, the token's principal remote."""
        raise NotImplementedError

    @property
    def policy(self) -> EffectivePolicy:
        """The policy in force (retention, access, promotion, resume)."""
        raise NotImplementedError

    def close(self) -> None:
        """Flush what is pending and let go of connections (a `with` block calls it)."""
        raise NotImplementedError

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
        """Register the checkpoint directory `src` as project/run@step. `step` may be left out
        where the checkpoint's files record it (the transformers Trainer, DeepSpeed, Megatron),
        and `world_size` likewise; a value given that disagrees with the files is a UsageError.
        `layout` forces the checkpoint's layout (dcp, torchtitan, lightning, stateful, ...)
        instead of detecting it from its keys."""
        raise NotImplementedError

    @http("POST", "/claims", names={"lease_s": "lease_seconds"})
    def claim_checkpoint(
        self, run: str, step: int, *, project: str = "default", lease_s: float = 3600.0
    ) -> ClaimTaken:
        """Claim run@step for writers on several nodes (`push_checkpoint_part`); the token."""
        raise NotImplementedError

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
        """Copy one node's files of a claimed step (`claim` is its token)."""
        raise NotImplementedError

    def commit_claimed(
        self,
        claim: str,
        *,
        world_size: int | None = None,
        metrics: dict[str, float] | None = None,
        layout: str | None = None,
        save_costs: dict[str, Any] | None = None,
    ) -> CheckpointPushed:
        """Commit a claimed step once every file its .metadata names was pushed."""
        raise NotImplementedError

    @http("GET", "/checkpoints")
    def list_checkpoints(
        self, run: str | None = None, project: str | None = None, *, include_deleted: bool = False
    ) -> list[CheckpointSummary]:
        """Checkpoints, newest first, of one run or project or all (`reg ls`)."""
        raise NotImplementedError

    @http("GET", "/show")
    def show(self, ref: str | CheckpointRef | ReleaseRef) -> CheckpointDetails | ReleaseDetails:
        """One checkpoint or release, with its files and facts (`reg show`)."""
        raise NotImplementedError

    def pull(
        self, ref: str | CheckpointRef, dest: str | Path, *, progress: Progress | None = None
    ) -> CheckpointPulled:
        """Copy a checkpoint's files into `dest`, each checked against its sha256 (`reg pull`)."""
        raise NotImplementedError

    @http("POST", "/verify")
    def verify(
        self,
        ref: str | CheckpointRef | ReleaseRef,
        *,
        repair: bool = False,
        provenance: bool = False,
        progress: Progress | None = None,
    ) -> VerifyReport:
        """Re-hash an artifact's stored files against their records; `repair` restores damaged
        ones from their recorded versions (admin); `provenance` (a release) also checks its
        signature and provenance statement against the catalog."""
        raise NotImplementedError

    @http("POST", "/scrub")
    def scrub(
        self,
        *,
        rate: float | None = None,
        limit: int | None = None,
        progress: Progress | None = None,
    ) -> ScrubReport:
        """Re-hash every committed checkpoint and release (admin), the longest unverified first,
        at most `rate` bytes/s and `limit` artifacts; records and audits what it finds."""
        raise NotImplementedError

    @http("POST", "/pin", fixed={"pinned": True}, default=True)
    def pin(self, ref: str | CheckpointRef, reason: str | None = None) -> CheckpointFacts:
        """Keep a checkpoint from retention until unpinned."""
        raise NotImplementedError

    @http("POST", "/pin", fixed={"pinned": False})
    def unpin(self, ref: str | CheckpointRef) -> CheckpointFacts:
        """Let retention decide about a pinned checkpoint again."""
        raise NotImplementedError

    @http("POST", "/runs/finish")
    def finish_run(
        self, run: str, *, project: str | None = None, status: str = "finished"
    ) -> RunFinished:
        """The training job of `run` (`project/run` or `run`) ended with `status`."""
        raise NotImplementedError

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
        """`layout` forces the checkpoint's layout; `strip_prefix` is stripped from the model's
        names too (after the layout's prefix) for the model factory's check; `memory_budget` a
        size (default: a fraction of the device's free memory); `world_size` > 1 restores the
        model as the factory module's parallelize shards it (and the optimizer with
        `with_optimizer`)."""
        raise NotImplementedError

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
        """`layout` forces the checkpoint's layout for this promotion; `strip_prefix` is
        stripped from the release's names after the layout's own prefix; `allow_unclassified`
        leaves tensors no resume class claims out of the release (else it is refused);
        `convert` names the converter of the release's names (Megatron's stacked layers, a
        PEFT adapter alone); `base` an adapter's base model, a release (`NAME@ALIAS`)."""
        raise NotImplementedError

    @http("GET", "/releases")
    def releases(self, model: str | None = None) -> list[ReleaseSummary]:
        """Release versions, of one model or all (`reg releases`)."""
        raise NotImplementedError

    def pull_release(
        self,
        ref: str | ReleaseRef,
        dest: str | Path,
        *,
        public_key: str | None = None,
        progress: Progress | None = None,
    ) -> ReleasePulled:
        """Copy a release's files into `dest`, each checked against its sha256; with
        `public_key` (a PEM the consumer pinned) refuse it, leaving nothing, unless it is
        signed by that key over exactly its files."""
        raise NotImplementedError

    def fetch_release(
        self,
        ref: str | ReleaseRef,
        *,
        public_key: str | None = None,
        cache_dir: str | Path | None = None,
        hf_cache: str | Path | None = None,
        progress: Progress | None = None,
    ) -> ReleaseFetched:
        """A verified folder of the release `ref` names now, on this machine, kept by its
        release.json sha256 under `cache_dir` (default REG_CACHE_DIR): pulled the first time,
        reused after a check that reads no weights. With `hf_cache` (a hub cache directory,
        e.g. huggingface_hub's HF_HUB_CACHE) laid out as a Hugging Face download instead; the
        path is then the snapshot's. With `public_key` (a pinned PEM) refused unless that key
        signed exactly its files. Both registries run the same code (`registry.api.consumers`)."""
        raise NotImplementedError

    @http("POST", "/alias")
    def set_alias(self, model: str, alias: str, version: str | int) -> AliasRequest | AliasMoved:
        """Point `alias` (e.g. prod) at version `version` of `model`; where the policy
        protects the alias, open a request instead (`approve`) and move nothing."""
        raise NotImplementedError

    @http("POST", "/alias/approve")
    def approve(self, request: int, version: str | None = None) -> AliasRequest:
        """Approve a protected alias's request (never one's own); `version`: only if the
        request moves it to that version. The last approval needed moves the alias."""
        raise NotImplementedError

    @http("POST", "/alias/reject")
    def reject(self, request: int, reason: str) -> AliasRequest:
        """Turn a protected alias's request down (an approver, or the requester)."""
        raise NotImplementedError

    @http("GET", "/alias/requests")
    def alias_requests(
        self, model: str | None = None, state: str | None = None
    ) -> list[AliasRequest]:
        """Requests to move protected aliases, oldest first (`state`: open, approved,
        rejected, cancelled, expired)."""
        raise NotImplementedError

    @http("POST", "/status", fixed={"status": "deprecated"})
    def deprecate(self, ref: str | ReleaseRef, reason: str | None = None) -> ReleaseStatusChanged:
        """Mark a release deprecated: still pulled, no longer advised (`reason` is recorded)."""
        raise NotImplementedError

    @http("POST", "/status", fixed={"status": "yanked"})
    def yank(self, ref: str | ReleaseRef, reason: str) -> ReleaseStatusChanged:
        """Withdraw a release: it is no longer pulled by alias, and its bytes may go."""
        raise NotImplementedError

    # -- administration --------------------------------------------------------------------------
    @http("POST", "/gc")
    def gc(self, *, dry_run: bool = False) -> GcReport:
        """Apply the retention policy (admin): what is deleted and kept, each with a reason."""
        raise NotImplementedError

    @http("POST", "/fsck")
    def fsck(
        self,
        project: str | None = None,
        *,
        repair: bool = False,
        full: bool = False,
        sample: int = 32,
        progress: Progress | None = None,
    ) -> FsckReport:
        """Catalog against store, registry-wide (admin): damage, leftovers, what --repair did."""
        raise NotImplementedError

    @http("POST", "/catalog/rebuild")
    def rebuild_catalog(self, *, dry_run: bool = False) -> RebuildReport:
        """Re-create missing catalog rows from the store's documents (admin)."""
        raise NotImplementedError

    @http("GET", "/advise")
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
        """Checkpoint economics of a run from what the job paid: C_eff, RTO, failures,
        intervals (Young, Daly, the availability optimum), waste, regret, advice."""
        raise NotImplementedError

    @http("GET", "/recovery")
    def recovery(
        self, run: str, *, project: str = "default", mtbf_s: float | None = None
    ) -> RecoveryReport:
        """Deprecated (one release): `advise`, with the old keys of `reg recovery --json`."""
        raise NotImplementedError

    @http("POST", "/runs/restart")
    def plan_restart(self, run: str, *, project: str = "default") -> RestartPlanned:
        """The next restore of `run` is a planned restart, not a failure (trainer)."""
        raise NotImplementedError

    def heartbeat(self, run: str, *, project: str = "default", **figures: Any) -> HeartbeatRecorded:
        """A training job's heartbeat (`CheckpointManager` sends it; trainer)."""
        raise NotImplementedError

    @http("POST", "/storage/init")
    def storage_init(self) -> StorageReport:
        """Check the store and set lifecycle rules (S3); create the root (local)."""
        raise NotImplementedError

    @http("GET", "/audit")
    def audit_log(
        self, *, since: float | None = None, actor: str | None = None, action: str | None = None
    ) -> list[AuditEvent]:
        """Audit events, oldest first, filtered by time, actor and action."""
        raise NotImplementedError

    @http(
        "POST",
        "/audit/verify",
        query=True,
        names={"max_unsealed_age_s": "max_unsealed_age", "max_anchor_age_s": "max_anchor_age"},
    )
    def audit_verify(
        self, *, max_unsealed_age_s: float | None = None, max_anchor_age_s: float | None = None
    ) -> AuditVerification:
        """Check the audit chain (admin; needs the audit key): {ok, problems, ...}."""
        raise NotImplementedError

    @http("POST", "/audit/seal")
    def audit_seal(self) -> AuditSealed:
        """Seal the audit events not sealed yet and anchor the head in the store (admin)."""
        raise NotImplementedError

    @http("GET", "/policy")
    def policy_show(self) -> PolicyInForce:
        """The policy document in force and where it comes from."""
        raise NotImplementedError

    def apply_policy(self, path: str | Path) -> PolicyApplied:
        """Make the policy file at `path` the one in force (admin; signed and sealed)."""
        raise NotImplementedError

    @http("GET", "/policy/export", result_keys=("document", "missing"))
    def export_policy(self, bucket: str | None = None) -> tuple[dict[str, Any], list[str]]:
        """The policy as an S3 bucket policy (prefix-scoped writes), and its notes."""
        raise NotImplementedError

    @http("POST", "/tokens")
    def create_token(self, principal: str, *, expires_s: float | None = None) -> TokenCreated:
        """A `reg server` token for `principal` (admin), shown once: only its hash is kept."""
        raise NotImplementedError

    @http("GET", "/tokens")
    def list_tokens(self) -> list[TokenInfo]:
        """The API tokens issued (never their secrets)."""
        raise NotImplementedError

    @http("DELETE", "/tokens/{token_id}")
    def revoke_token(self, token_id: str) -> TokenRevoked:
        """Revoke API token `token_id`: it authenticates nothing from now on."""
        raise NotImplementedError

    @http("POST", "/sign")
    def sign_release(
        self, ref: str | ReleaseRef, *, progress: Progress | None = None
    ) -> ReleaseSigned:
        """Sign a release committed unsigned (admin, where the private key is): its stored
        bytes re-hashed against the catalog first, then its provenance statement, model card
        and model.sig added beside its files (never replacing one)."""
        raise NotImplementedError

    @http("GET", "/keys")
    def signing_keys(self) -> list[SigningKeyInfo]:
        """The release signing keys, their states and PEM public keys (what consumers pin)."""
        raise NotImplementedError

    # -- webhooks (admin) ------------------------------------------------------------------------
    @http("GET", "/webhooks")
    def webhooks(self) -> list[WebhookInfo]:
        """The policy's webhook subscribers, their secret files' state and deliveries."""
        raise NotImplementedError

    @http("POST", "/webhooks/test")
    def test_webhook(self, name: str) -> WebhookTested:
        """Send a signed `ping` to subscriber `name` now and report its reply."""
        raise NotImplementedError

    @http("GET", "/webhooks/deliveries")
    def webhook_deliveries(
        self, name: str | None = None, status: str | None = None, limit: int = 50
    ) -> list[WebhookDeliveryInfo]:
        """Deliveries, newest first (`status`: pending, delivered, given-up)."""
        raise NotImplementedError

    @http("POST", "/webhooks/deliver")
    def deliver_webhooks(self, budget_s: float = 60.0) -> WebhooksDelivered:
        """Deliver what is due now, retrying within `budget_s` (the server: at most 30 s)."""
        raise NotImplementedError

    @http("POST", "/mlflow/sync")
    def mlflow_sync(self, budget_s: float = 300.0, skip: int | None = None) -> MirrorSynced:
        """Drain pending catalog events into MLflow now (admin), waiting for a running drain;
        `skip`: first set that pending event aside (audited)."""
        raise NotImplementedError
