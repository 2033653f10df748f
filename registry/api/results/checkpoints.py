"""The results of the checkpoint methods: listing, push, pull, show, pin, validation, claims."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from registry.api.results.base import Result

RESULT = dataclass(frozen=True, eq=False, kw_only=True)  # every result: keyword fields


@RESULT
class CheckpointSummary(Result):
    """A committed checkpoint as `reg ls` lists it."""

    ref: str
    project: str
    run: str
    step: int
    world_size: int
    state: str
    bytes: int
    files: list[dict[str, Any]]
    layout: str
    resumable: bool
    missing_state: list[str]
    pinned: bool
    created_at: str
    upload_seconds: float | None


@RESULT
class CheckpointFacts(CheckpointSummary):
    """A checkpoint with what it holds for a resume (`reg pin`, `reg unpin`)."""

    model_path: str | None = None
    resume_state: dict[str, Any] | None = None
    unclassified: list[str] | None = None
    warnings: list[str] | None = None
    suggestions: list[str] | None = None


@RESULT
class CheckpointPushed(CheckpointFacts):
    """A push (or a claimed step's commit): `unchanged` when the same bytes were committed
    before, `reused_files` how many files were already in the store."""

    unchanged: bool = False
    reused_files: int | None = None


@RESULT
class CheckpointPulled(CheckpointFacts):
    """A pull: the checkpoint, where its files are now, and the manifest kept beside them."""

    dest: str
    manifest_sha256: str | None = None
    kept: str | None = None


@RESULT
class CheckpointDetails(CheckpointFacts):
    """Everything known about one checkpoint (`reg show`)."""

    uri: str
    tensor_count: int
    world_size_inferred: bool = False
    tensor_bytes: int | None = None
    metrics: dict[str, float] | None = None
    pushed_by: str | None = None
    pin_reason: str | None = None
    manifest_sha256: str | None = None
    digests_reported_by: str | None = None
    verified: dict[str, Any] | None = None
    protection: dict[str, Any] | None = None
    save_costs: dict[str, Any] | None = None
    restores: list[dict[str, Any]] | None = None
    deleted_at: str | None = None
    deleted_by: str | None = None
    delete_reason: str | None = None
    tiers: list[dict[str, Any]] | None = None  # where its copies are: tier 0 (nodes), 1 (store)


@RESULT
class VerifyReport(Result):
    """Stored files re-hashed against their records: a checkpoint's (`ref`) or a release's."""

    ok: bool
    files: int
    bytes: int
    problems: list[dict[str, Any]]
    ref: str | None = None
    release: str | None = None
    signature: dict[str, Any] | None = None  # with `provenance`: ok, key_id, key_state


@RESULT
class ValidationReport(Result):
    """A validation's outcome, as recorded: every check, the device, and the resume facts."""

    ref: str
    passed: bool
    device: str
    device_name: str | None = None
    torch_version: str | None = None
    world_size: int
    seconds: float
    phases: dict[str, Any]
    checks: list[dict[str, Any]]
    tied: list[Any] | None = None
    model_path: str | None = None
    mode: str | None = None
    driver: str | None = None
    validation_id: int | None = None
    attested: bool | None = None
    created_at: str | None = None
    layout: str | None = None
    resumable: bool | None = None
    missing_state: list[str] | None = None
    resume_state: dict[str, Any] | None = None
    unclassified: list[str] | None = None
    warnings: list[str] | None = None
    suggestions: list[str] | None = None
    sharding: dict[str, Any] | None = None


@RESULT
class ClaimTaken(Result):
    """A step claimed for writers on several nodes: `claim` is the token they share."""

    ref: str
    claim: str
    lease_seconds: float | None = None


@RESULT
class PartPushed(Result):
    """One node's files of a claimed step, stored."""

    ref: str
    files: list[dict[str, Any]]
    bytes: int
    reused_files: int
    upload_seconds: float


@RESULT
class RunFinished(Result):
    """A training run's end, recorded."""

    project: str
    run: str
    status: str
    ended_at: str


@RESULT
class RestartPlanned(Result):
    """The next restore of a run counts as a planned restart, not a failure."""

    project: str
    run: str
    planned_at: str


@RESULT
class HeartbeatRecorded(Result):
    """A training job's heartbeat: `recorded` false when the run is not one reg knows."""

    recorded: bool
    saves: int | None = None
    seconds: float | None = None
    world_size: int | None = None
