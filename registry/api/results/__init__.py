"""Typed results of the `Registry` methods (`registry.api.results.base.Result`): frozen dataclasses,
each with `to_json()` (what `--json` prints and the server answers) and `from_json()`."""

from __future__ import annotations

from typing import Any

from registry.api.results.base import Result, results_of, to_json
from registry.api.results.checkpoints import (
    CheckpointDetails,
    CheckpointFacts,
    CheckpointPulled,
    CheckpointPushed,
    CheckpointSummary,
    ClaimTaken,
    HeartbeatRecorded,
    PartPushed,
    RestartPlanned,
    RunFinished,
    ValidationReport,
    VerifyReport,
)
from registry.api.results.operations import (
    Advice,
    AuditEvent,
    AuditSealed,
    AuditVerification,
    FsckReport,
    GcReport,
    MirrorSynced,
    PolicyApplied,
    PolicyInForce,
    RebuildReport,
    RecoveryReport,
    ScrubReport,
    SigningKeyInfo,
    StorageReport,
    TokenCreated,
    TokenInfo,
    TokenRevoked,
)
from registry.api.results.releases import (
    AliasMoved,
    AliasRequest,
    ReleaseDetails,
    ReleaseFetched,
    ReleasePromoted,
    ReleasePulled,
    ReleaseSigned,
    ReleaseStatusChanged,
    ReleaseSummary,
)
from registry.api.results.workflow import (
    WebhookDeliveryInfo,
    WebhookInfo,
    WebhooksDelivered,
    WebhookTested,
)
from registry.errors import RegistryError

__all__ = [
    "Advice",
    "AliasMoved",
    "AliasRequest",
    "AuditEvent",
    "AuditSealed",
    "AuditVerification",
    "CheckpointDetails",
    "CheckpointFacts",
    "CheckpointPulled",
    "CheckpointPushed",
    "CheckpointSummary",
    "ClaimTaken",
    "FsckReport",
    "GcReport",
    "HeartbeatRecorded",
    "MirrorSynced",
    "PartPushed",
    "PolicyApplied",
    "PolicyInForce",
    "RebuildReport",
    "RecoveryReport",
    "ReleaseDetails",
    "ReleaseFetched",
    "ReleasePromoted",
    "ReleasePulled",
    "ReleaseSigned",
    "ReleaseStatusChanged",
    "ReleaseSummary",
    "RestartPlanned",
    "Result",
    "RunFinished",
    "ScrubReport",
    "SigningKeyInfo",
    "StorageReport",
    "TokenCreated",
    "TokenInfo",
    "TokenRevoked",
    "ValidationReport",
    "VerifyReport",
    "WebhookDeliveryInfo",
    "WebhookInfo",
    "WebhookTested",
    "WebhooksDelivered",
    "read",
    "results_of",
    "to_json",
]

BY_NAME: dict[str, type[Result]] = {
    name: kind
    for name, kind in globals().items()
    if isinstance(kind, type) and issubclass(kind, Result) and kind is not Result
}


def read(annotation: str, answer: Any) -> Any:
    """The typed result a JSON answer stands for, by a contract method's return annotation
    (`GcReport`, `list[CheckpointSummary]`, `CheckpointDetails | ReleaseDetails`); an
    annotation naming no result (a tuple, a dict) leaves the answer as it is."""
    annotation = annotation.strip()
    if annotation.startswith("list[") and annotation.endswith("]"):
        item = BY_NAME.get(annotation[5:-1].strip())
        return results_of(item, answer) if item else answer
    kinds = [BY_NAME[a.strip()] for a in annotation.split("|") if a.strip() in BY_NAME]
    if len(kinds) == 1:
        return kinds[0].from_json(answer)
    for kind in kinds:
        if isinstance(answer, dict) and all(k in answer for k in kind.required()):
            return kind.from_json(answer)
    if kinds:
        raise RegistryError(
            f"the answer is none of {annotation}",
            "the registry answered in a shape this reg does not know",
        )
    return answer
