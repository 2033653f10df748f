"""The results of the administration methods: GC, fsck, scrubs, rebuild, economics, audit,
policy, tokens, storage, the MLflow mirror."""

from __future__ import annotations

from typing import Any

from registry.api.results.base import Result
from registry.api.results.checkpoints import RESULT


@RESULT
class GcReport(Result):
    """What retention decided for each checkpoint (`decisions`, each with its reason), and
    what was deleted when `applied` (not a dry run)."""

    applied: bool
    decisions: list[dict[str, Any]]
    freed_bytes: int
    errors: list[Any]
    orphans: list[Any]


@RESULT
class FsckReport(Result):
    """The catalog checked against the store: problems found, and with `--repair` what was
    repaired and what was left."""

    project: str | None
    full: bool
    checked: dict[str, Any]
    problems: list[dict[str, Any]]
    clean: bool
    damaged: bool
    repaired: list[Any] | None = None
    left: list[Any] | None = None


@RESULT
class ScrubReport(Result):
    """Every committed artifact re-hashed, the longest unverified first."""

    ok: bool
    artifacts: int
    skipped: int
    bytes: int
    seconds: float
    bytes_per_second: int
    rate_limit: float | None
    damaged: list[Any]


@RESULT
class RebuildReport(Result):
    """Catalog rows re-created from the store's documents, and the journal's decisions
    replayed onto them."""

    applied: bool
    checkpoints_added: list[str]
    releases_added: list[str]
    skipped: list[Any]
    events_replayed: dict[str, Any]
    events_current: dict[str, Any]
    events_superseded: dict[str, Any]
    events_unsigned: int
    events_aborted: int
    events_skipped: list[Any]
    not_recoverable: str


@RESULT
class Advice(Result):
    """Checkpoint economics of a run: what a save costs (`c_eff`), what a restore costs
    (`rto`), the failures seen, the intervals (Young, Daly, optimum), the waste, and advice."""

    run: str
    gpus: int | None
    gpus_source: str | None = None
    checkpoints: int
    bytes: int
    step_seconds: float | None
    last_step: int | None
    c_eff: dict[str, Any]
    rto: dict[str, Any]
    failures: dict[str, Any]
    interval: dict[str, Any]
    waste: dict[str, Any]
    simulation: dict[str, Any] | None = None
    levels: dict[str, Any] | None = None  # a run that saves at tier 0: the two-level advice
    advice: Any


@RESULT
class RecoveryReport(Advice):
    """Deprecated with `reg recovery`: `Advice` with the old flat keys beside it."""

    save_cost_seconds: float | None = None
    transfer_rate_bytes_per_second: float | None = None
    restore_seconds: float | None = None
    rto_seconds: float | None = None
    observed_interval_seconds: float | None = None
    mtbf_seconds: float | None = None
    optimal_interval_seconds: float | None = None
    overhead_at_optimal: float | None = None
    expected_loss_at_optimal_seconds: float | None = None
    overhead_now: float | None = None
    expected_loss_now_seconds: float | None = None
    advice_sentence: str | None = None


@RESULT
class AuditEvent(Result):
    """One audit event: who did what to which target, when, and how it ended."""

    ts: str
    actor: str
    action: str
    target: str
    outcome: str
    details: dict[str, Any] | None


@RESULT
class AuditVerification(Result):
    """The audit chain checked: `ok` with no `problems`, how much is sealed and anchored."""

    ok: bool
    events: int
    sealed: int
    unsealed: int
    problems: list[Any]
    oldest_unsealed: str | None = None
    unsigned_history: int | None = None
    seals: int | None = None
    anchors: int | None = None
    key_id: str | None = None
    head: dict[str, Any] | None = None
    unanchored: int | None = None
    oldest_unanchored: str | None = None
    newest_anchor: dict[str, Any] | None = None
    max_unsealed_age_s: float | None = None
    max_anchor_age_s: float | None = None
    facts: dict[str, Any] | None = None


@RESULT
class AuditSealed(Result):
    """The audit events sealed now, and the chain's head as anchored in the store."""

    seals: list[Any]
    sealed: int
    refused: list[Any]
    head: dict[str, Any] | None
    anchor: dict[str, Any] | None


@RESULT
class PolicyInForce(Result):
    """The policy document in force, where it comes from, and its effective rules."""

    source: str
    document: str
    effective: dict[str, Any]


@RESULT
class PolicyApplied(Result):
    """A policy applied: its version and digest, and what changed for resumes and expiry."""

    version: int
    sha256: str
    grants: int
    resume_changed: int
    expiry_changed: int
    resume_undecided: int
    warnings: list[str]


@RESULT
class TokenCreated(Result):
    """A token minted: `token` is its secret, shown this once."""

    id: str
    principal: str
    token: str


@RESULT
class TokenInfo(Result):
    """An API token as listed (never its secret)."""

    id: str
    principal: str
    created_at: str
    created_by: str | None
    expires_at: str | None
    last_used_at: str | None
    revoked_at: str | None
    revoked_by: str | None
    state: str


@RESULT
class SigningKeyInfo(Result):
    """A release signing key: its id (model-signing's public-key hint), state (active,
    retired, revoked), its PEM public key to pin, and its history. Never the private key."""

    key_id: str
    state: str
    public_pem: str
    created_at: str | None
    created_by: str
    changed_at: str | None = None
    changed_by: str | None = None
    reason: str | None = None


@RESULT
class TokenRevoked(Result):
    """A token revoked: it authenticates nothing from now on."""

    id: str
    principal: str
    revoked_at: str


@RESULT
class StorageReport(Result):
    """The store checked and set up (`reg storage init`); its keys depend on the backend."""


@RESULT
class MirrorSynced(Result):
    """Catalog events drained into MLflow: how many, how many wait, and why it stopped."""

    applied: int
    pending: int
    error: str | None = None
    skipped: Any = None
