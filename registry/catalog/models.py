"""Catalog tables. Timestamps are UNIX seconds (float, UTC); JSON columns hold small documents.

The catalog is the source of truth for visibility: a checkpoint exists for readers when its row is
`committed`; a release when its row is `active` (or later deprecated/yanked; bytes never change).
"""

from __future__ import annotations

from enum import StrEnum
from typing import TYPE_CHECKING, Any

from sqlalchemy import JSON, BigInteger, Column, Index, Text, UniqueConstraint
from sqlmodel import Field, SQLModel, col

from registry.formats.documents import FileRecord

if TYPE_CHECKING:
    from registry.formats.documents import Manifest


class CheckpointState(StrEnum):
    PENDING = "pending"  # claimed, being written
    COMMITTED = "committed"  # visible to readers
    DELETING = "deleting"  # marked by GC, its objects going
    DELETED = "deleted"  # collected: a tombstone says when and why
    SWEEPING = "sweeping"  # an abandoned upload whose objects GC is deleting
    LOCAL = "local"  # committed at tier 0 only: on its nodes' local disks, not yet in the store
    LOST = "lost"  # was LOCAL, and every node's copy went before it reached the store


class ReleaseStatus(StrEnum):
    PENDING = "pending"  # a version reserved by a promotion in progress
    ACTIVE = "active"
    DEPRECATED = "deprecated"
    YANKED = "yanked"


# The states by their short names, as the code reads them (columns hold the strings).
PENDING, COMMITTED, DELETING, DELETED, SWEEPING, LOCAL, LOST = CheckpointState
RELEASE_PENDING, ACTIVE, DEPRECATED, YANKED = ReleaseStatus


def _json(default: Any = None) -> Any:
    factory = dict if default is None else default
    return Field(default_factory=factory, sa_column=Column(JSON, nullable=False))


class ClaimColumns(SQLModel):
    """Who holds a pending row (a push's step, a promotion's version) and until when; see
    `registry.catalog.claims`. Cleared when the row commits."""

    claim_token: str | None = Field(default=None, max_length=64)
    claim_host: str | None = None
    claim_pid: int | None = None
    lease_until: float | None = None


class Project(SQLModel, table=True):
    id: int | None = Field(default=None, primary_key=True)
    name: str = Field(index=True, unique=True, max_length=128)
    created_at: float


class Run(SQLModel, table=True):
    __table_args__ = (UniqueConstraint("project_id", "name"),)
    id: int | None = Field(default=None, primary_key=True)
    project_id: int = Field(foreign_key="project.id", index=True)
    name: str = Field(max_length=128)
    created_at: float
    # The checkpoint the run last pulled to resume from: protected from retention until the run
    # commits a newer step.
    resumed_from_step: int | None = Field(default=None, sa_type=BigInteger)
    resumed_at: float | None = None
    # What the training job reported as it went (`CheckpointManager` heartbeats; migration
    # 0014): the last step reached, the time at risk summed over attempts (wall seconds, and
    # x world size), the median step time; a planned restart announced; the last attempt closed.
    last_step: int | None = Field(default=None, sa_type=BigInteger)
    last_step_at: float | None = None
    train_seconds: float | None = None
    gpu_seconds: float | None = None
    step_seconds: float | None = None
    restart_planned_at: float | None = None
    attempt_ended_at: float | None = None


class Checkpoint(ClaimColumns, table=True):
    __table_args__ = (UniqueConstraint("run_id", "step"), Index("ix_checkpoint_state", "state"))
    id: int | None = Field(default=None, primary_key=True)
    run_id: int = Field(foreign_key="run.id", index=True)
    step: int = Field(sa_type=BigInteger)
    state: str = Field(default=PENDING, max_length=16)
    world_size: int = 0
    world_size_inferred: bool = False
    bytes: int = Field(default=0, sa_type=BigInteger)
    file_count: int = 0
    tensor_count: int = 0
    tensor_bytes: int = Field(default=0, sa_type=BigInteger)
    manifest_sha256: str | None = Field(default=None, max_length=64)
    manifest_version: str | None = Field(default=None, max_length=1024)
    resumable: bool = False
    missing_state: list[str] = _json(list)
    resume_classes: dict[str, Any] = _json()
    metrics: dict[str, float] = _json()
    pinned: bool = False
    pin_reason: str | None = None
    pinned_by: str | None = None
    created_at: float
    committed_at: float | None = None
    pushed_by: str
    upload_seconds: float | None = None
    deleted_at: float | None = None
    deleted_by: str | None = None
    delete_reason: str | None = None
    # The client whose word the file digests are (a presigned push); None: the registry hashed
    # every byte itself (a push it copied, or its re-hash since).
    digests_reported_by: str | None = Field(default=None, max_length=128)
    # How a save from the training loop went (registry.training): stall and persist seconds,
    # bytes, each rank's writes. None for a checkpoint pushed from a directory (migration 0011).
    save_costs: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON, nullable=True))
    # The last re-hash of every stored byte (`reg verify`, a scrub): when, and what it found
    # (a list of {path, problem}; empty when every file matched). Migration 0013.
    verified_at: float | None = None
    verify_findings: list[dict[str, str]] | None = Field(
        default=None, sa_column=Column(JSON, nullable=True)
    )

    @classmethod
    def pending_clause(cls) -> Any:
        # A tier-0 step (LOCAL) is claimed too: by the replicator copying it to the store.
        return col(cls.state).in_((PENDING, LOCAL))

    @staticmethod
    def facts_of(
        manifest: Manifest, manifest_sha256: str, manifest_version: str | None
    ) -> dict[str, Any]:
        """The columns a committed checkpoint's manifest decides (push and rebuild alike)."""
        return {
            "manifest_version": manifest_version,
            "state": COMMITTED,
            "world_size": manifest.world_size,
            "world_size_inferred": manifest.world_size_inferred,
            "bytes": manifest.bytes,
            "file_count": len(manifest.files),
            "tensor_count": manifest.tensors.tensors,
            "tensor_bytes": manifest.tensors.tensor_bytes,
            "manifest_sha256": manifest_sha256,
            "resumable": manifest.resume.resumable,
            "missing_state": manifest.resume.missing,
            "resume_classes": manifest.resume.classes,
            "metrics": manifest.metrics,
            "pushed_by": manifest.pushed_by,
        }


class CheckpointFile(SQLModel, table=True):
    __tablename__ = "checkpoint_file"
    __table_args__ = (UniqueConstraint("checkpoint_id", "path"),)
    id: int | None = Field(default=None, primary_key=True)
    checkpoint_id: int = Field(foreign_key="checkpoint.id", index=True)
    path: str = Field(max_length=1024)
    size: int = Field(sa_type=BigInteger)
    sha256: str = Field(max_length=64)
    rank: int | None = None
    version: str | None = Field(default=None, max_length=1024)  # on a versioned bucket

    @classmethod
    def of(cls, checkpoint_id: int, record: FileRecord) -> CheckpointFile:
        return cls(
            checkpoint_id=checkpoint_id,
            path=record.path,
            size=record.size,
            sha256=record.sha256,
            rank=record.rank,
            version=record.version,
        )

    def record(self) -> FileRecord:
        return FileRecord(self.path, self.size, self.sha256, self.rank, self.version)


class CheckpointTier(SQLModel, table=True):
    """Where a checkpoint's files are (migration 0016): tier 0 is one row per node
    whose local directory holds some of them (`files`: which), tier 1 the registry's store
    (node ""). A tier-0 row is written by the tier-0 commit and marked `evicted_at` when its
    node drops the copy; the tier-1 row by the replicator's commit."""

    __tablename__ = "checkpoint_tier"
    __table_args__ = (UniqueConstraint("checkpoint_id", "tier", "node"),)
    id: int | None = Field(default=None, primary_key=True)
    checkpoint_id: int = Field(foreign_key="checkpoint.id", index=True)
    tier: int
    node: str = Field(max_length=128)
    ranks: list[int] = _json(list)
    files: list[str] = _json(list)
    bytes: int = Field(default=0, sa_type=BigInteger)
    at: float  # when this copy was complete
    seconds: float | None = None  # how long making it took (the replicator's copy)
    evicted_at: float | None = None


class CheckpointRestore(SQLModel, table=True):
    """One restore of a checkpoint by the training loop, with its phases in seconds (added,
    never changed; migration 0011)."""

    __tablename__ = "checkpoint_restore"
    id: int | None = Field(default=None, primary_key=True)
    checkpoint_id: int = Field(foreign_key="checkpoint.id", index=True)
    created_at: float
    actor: str = Field(max_length=256)
    world_size: int
    phases: dict[str, float] = _json()
    # How it came about (migration 0014): start | failure | planned | resume (None before it);
    # for a failure, the step the job had reached and the run's exposure then.
    kind: str | None = Field(default=None, max_length=16)
    reached_step: int | None = Field(default=None, sa_type=BigInteger)
    train_seconds: float | None = None
    gpu_seconds: float | None = None
    step_seconds: float | None = None


class KeySet(SQLModel, table=True):
    """A checkpoint's DCP key paths and sidecar files, shared by every checkpoint with the same
    ones (migration 0010; never changed)."""

    __tablename__ = "key_set"
    id: int | None = Field(default=None, primary_key=True)
    sha256: str = Field(max_length=64, unique=True)
    key_count: int
    keys: list[str] = _json(list)
    sidecars: list[str] = _json(list)
    heads: list[str] = _json(list)  # derived from keys: policies.resume.heads
    optimizer_roots: list[str] = _json(list)  # derived from keys: policies.resume.optimizer_roots


class CheckpointKeys(SQLModel, table=True):
    __tablename__ = "checkpoint_keys"
    checkpoint_id: int = Field(foreign_key="checkpoint.id", primary_key=True)
    key_set_id: int = Field(foreign_key="key_set.id", index=True)
    layout: str = Field(max_length=32)


class Validation(SQLModel, table=True):
    id: int | None = Field(default=None, primary_key=True)
    checkpoint_id: int = Field(foreign_key="checkpoint.id", index=True)
    passed: bool
    device: str = Field(max_length=16)  # cuda | cpu
    device_name: str
    torch_version: str
    world_size: int
    seconds: float  # measured restore time (tensor load)
    phases: dict[str, float] = _json()
    checks: list[dict[str, Any]] = _json(list)
    created_at: float
    created_by: str
    # Recorded through `reg server` by a validator (or run by the server itself): only these
    # pass the server's GPU gate. Embedded, every validation counts (identity is advisory).
    attested: bool = Field(default=False)
    # Where the model was loaded from (its layout's path, or [resume] model_key): the model and
    # probe checks and the tied weights name tensors as that path left them. None: unknown.
    model_path: str | None = Field(default=None, max_length=1024)
    # How it restored: streamed | sharded; whole | resharded before modes existed (0012).
    mode: str | None = Field(default=None, max_length=16)
    driver: str | None = Field(default=None, max_length=64)  # nvidia-smi's driver version


class Model(SQLModel, table=True):
    id: int | None = Field(default=None, primary_key=True)
    name: str = Field(index=True, unique=True, max_length=128)
    created_at: float
    # The project that owns it: the one it was first released from (migration 0015; NULL where
    # unknown). Behind the server it counts only with a valid signature (`signed_facts`).
    project: str | None = Field(default=None, max_length=128)


class Release(ClaimColumns, table=True):
    __table_args__ = (UniqueConstraint("model_id", "version"),)
    id: int | None = Field(default=None, primary_key=True)
    model_id: int = Field(foreign_key="model.id", index=True)
    version: int
    status: str = Field(default=RELEASE_PENDING, max_length=16)
    sha256: str | None = Field(default=None, max_length=64)  # digest of release.json
    document_version: str | None = Field(default=None, max_length=1024)  # of release.json
    bytes: int = Field(default=0, sa_type=BigInteger)
    source_checkpoint_id: int = Field(foreign_key="checkpoint.id", index=True)
    source_ref: str
    validation_id: int | None = Field(default=None, foreign_key="validation.id")
    options_key: str = Field(max_length=256)
    options: dict[str, Any] = _json()
    tensor_count: int = 0
    dtype: str | None = None
    tied: list[list[str]] = _json(list)
    created_at: float
    created_by: str
    status_reason: str | None = None
    status_changed_at: float | None = None
    status_changed_by: str | None = None
    stage: str = Field(default="reserved", max_length=32)
    verified_at: float | None = None  # as on Checkpoint (migration 0013)
    verify_findings: list[dict[str, str]] | None = Field(
        default=None, sa_column=Column(JSON, nullable=True)
    )

    @classmethod
    def pending_clause(cls) -> Any:
        return col(cls.status) == RELEASE_PENDING


class ReleaseFile(SQLModel, table=True):
    __tablename__ = "release_file"
    __table_args__ = (UniqueConstraint("release_id", "path"),)
    id: int | None = Field(default=None, primary_key=True)
    release_id: int = Field(foreign_key="release.id", index=True)
    path: str = Field(max_length=1024)
    size: int = Field(sa_type=BigInteger)
    sha256: str = Field(max_length=64)
    version: str | None = Field(default=None, max_length=1024)  # on a versioned bucket

    @classmethod
    def of(cls, release_id: int, record: FileRecord) -> ReleaseFile:
        return cls(
            release_id=release_id,
            path=record.path,
            size=record.size,
            sha256=record.sha256,
            version=record.version,
        )

    def record(self) -> FileRecord:
        return FileRecord(self.path, self.size, self.sha256, version=self.version)


class Alias(SQLModel, table=True):
    __table_args__ = (UniqueConstraint("model_id", "name"),)
    id: int | None = Field(default=None, primary_key=True)
    model_id: int = Field(foreign_key="model.id", index=True)
    name: str = Field(max_length=128)
    release_id: int = Field(foreign_key="release.id")
    updated_at: float
    updated_by: str


class AliasEvent(SQLModel, table=True):
    __tablename__ = "alias_event"
    id: int | None = Field(default=None, primary_key=True)
    model_id: int = Field(foreign_key="model.id", index=True)
    name: str = Field(max_length=128)
    from_version: int | None = None
    to_version: int
    ts: float
    actor: str
    # A protected alias's move (migration 0019): its request, who asked, who approved
    request_id: int | None = None
    requested_by: str | None = None
    approved_by: str | None = None  # names, comma-separated, in the order they approved


class AuditEvent(SQLModel, table=True):
    """Append-only: triggers make UPDATE and DELETE fail (see the migration)."""

    __tablename__ = "audit_event"
    id: int | None = Field(default=None, primary_key=True)
    ts: float = Field(index=True)
    actor: str = Field(index=True)
    action: str = Field(index=True)
    target: str
    outcome: str = Field(max_length=16)  # allowed | denied | failed
    details: dict[str, Any] = _json()
    # A random id and the HMAC of the event under the server's key (`registry.trust.audit_chain`);
    # both NULL for events recorded where no key was at hand.
    uid: str | None = Field(default=None, max_length=32, unique=True)
    mac: str | None = Field(default=None, max_length=64)


class AuditSeal(SQLModel, table=True):
    """One block of the audit chain: the events a sealer took (compact id ranges, in id order),
    a short tag of each, and an HMAC over seq, the previous seal's MAC and every id:event MAC.
    Append-only (triggers, migration 0006); see `registry.trust.audit_chain`."""

    __tablename__ = "audit_seal"
    seq: int = Field(primary_key=True, sa_column_kwargs={"autoincrement": False})
    key_id: str = Field(max_length=16)
    prev_mac: str = Field(max_length=64)
    mac: str = Field(max_length=64)
    event_ids: str = Field(sa_type=Text)
    tags: str = Field(sa_type=Text)
    count: int
    total: int = Field(sa_type=BigInteger)  # events sealed by the chain up to this seal
    low: int = Field(sa_type=BigInteger, index=True)
    high: int = Field(sa_type=BigInteger, index=True)
    sealed_at: float


class PolicyDocument(SQLModel, table=True):
    __tablename__ = "policy_document"
    id: int | None = Field(default=None, primary_key=True)
    version: int = Field(unique=True)
    text: str
    sha256: str = Field(max_length=64)
    applied_at: float
    applied_by: str


class FactMac(SQLModel, table=True):
    """A signature of a row the server decides from (a policy document, a validation, a
    model's owner): an HMAC under the audit key over the row's id and content
    (`registry.trust.signed_facts`). Append-only (triggers, migration 0015); a row may have several,
    and one that verifies is enough."""

    __tablename__ = "fact_mac"
    __table_args__ = (Index("ix_fact_mac_kind_row", "kind", "row_id"),)
    id: int | None = Field(default=None, primary_key=True)
    kind: str = Field(max_length=16)  # policy | validation | model
    row_id: int = Field(sa_type=BigInteger)
    mac: str = Field(max_length=64)
    signed_at: float
    signed_by: str


class Lease(SQLModel, table=True):
    """Named leases: one GC at a time, one MLflow drain at a time, holds on checkpoints in use
    (see `registry.catalog.leases`)."""

    name: str = Field(primary_key=True, max_length=64)
    holder: str
    host: str
    pid: int
    token: str = Field(max_length=64)
    acquired_at: float
    expires_at: float


class OutboxEvent(SQLModel, table=True):
    """Catalog changes waiting to be mirrored into MLflow; written in the same transaction as
    the change, drained after it (never adding latency to the command)."""

    __tablename__ = "outbox_event"
    id: int | None = Field(default=None, primary_key=True)
    ts: float
    kind: str = Field(max_length=64)
    payload: dict[str, Any] = _json()
    done_at: float | None = Field(default=None, index=True)
    attempts: int = 0
    last_error: str | None = None
    # (migration 0019) a random id, the webhook event's; behind the server a MAC over the
    # event (`macs.outbox_mac`): a row written around it is never delivered to a subscriber
    uid: str | None = Field(default=None, max_length=32)
    mac: str | None = Field(default=None, max_length=64)


class ApiToken(SQLModel, table=True):
    """A bearer token of `reg server` (`reg token create`): only the sha256 of its secret is
    kept. The id is public (audit events name it); the secret is shown once, at creation."""

    __tablename__ = "api_token"
    id: str = Field(primary_key=True, max_length=32)
    principal: str = Field(index=True, max_length=256)
    secret_sha256: str = Field(max_length=64)
    created_at: float
    created_by: str
    expires_at: float | None = None
    revoked_at: float | None = None
    revoked_by: str | None = None
    last_used_at: float | None = None
    # HMAC under the server's audit key over the content (`registry.trust.tokens.token_mac`): a row
    # written around the server opens nothing (migration 0009).
    mac: str | None = Field(default=None, max_length=64)


class SigningKeyEvent(SQLModel, table=True):
    """A signing key's life (migration 0017): `created` (with its PEM public key),
    `retired` (signs nothing more; its releases still verify) or `revoked` (its signatures are
    reported, not trusted). Append-only; a key's state is its latest event. The private key is
    a file beside the catalog's holder (`registry.trust.release_signing.keys`), never a row."""

    __tablename__ = "signing_key_event"
    id: int | None = Field(default=None, primary_key=True)
    key_id: str = Field(max_length=64, index=True)  # sha256 of the PEM public key
    event: str = Field(max_length=16)  # created | retired | revoked
    public_pem: str | None = Field(default=None, sa_type=Text)
    reason: str | None = None
    at: float
    by: str


class ReleaseSignature(SQLModel, table=True):
    """A release's signature (`model.sig`, the OpenSSF model-signing format): which key signed
    it and the sha256 of the signature file and of the provenance statement. Append-only, one
    per release."""

    __tablename__ = "release_signature"
    __table_args__ = (UniqueConstraint("release_id"),)
    id: int | None = Field(default=None, primary_key=True)
    release_id: int = Field(foreign_key="release.id", index=True)
    key_id: str = Field(max_length=64)
    sha256: str = Field(max_length=64)  # of model.sig
    provenance_sha256: str = Field(max_length=64)
    signed_at: float
    signed_by: str
    # The bytes of the files `reg sign-release` added to a release committed unsigned (0018);
    # 0 where the promotion signed it. Release.bytes never counts them.
    added_bytes: int = Field(default=0, sa_type=BigInteger)


# The release workflow's tables share this metadata (the migrations' and the grants' check).
from registry.catalog import workflow_models as _workflow_models  # noqa: E402, F401
