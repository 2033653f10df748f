"""`reg`: a registry for training checkpoints and release models.

from registry import Registry
with Registry() as reg:
    reg.push_checkpoint("ckpts/step-9000", run="run42", step=9000)
    reg.promote("run42@step9000", model="llama-tiny", alias="prod")
"""

from registry.api.contract import Registry
from registry.core.config import Settings
from registry.core.refs import (
    CheckpointRef,
    ReleaseRef,
    parse_checkpoint_ref,
    parse_ref,
    parse_release_ref,
)
from registry.errors import (
    CatalogLocked,
    Collected,
    Conflict,
    GateNotMet,
    IntegrityError,
    InvalidCheckpoint,
    MalformedRef,
    NotFound,
    PermissionDenied,
    PolicyError,
    RegistryError,
    UnsafeMetadata,
    UsageError,
    ValidationFailed,
)

__all__ = [
    "CatalogLocked",
    "CheckpointRef",
    "Collected",
    "Conflict",
    "GateNotMet",
    "IntegrityError",
    "InvalidCheckpoint",
    "MalformedRef",
    "NotFound",
    "PermissionDenied",
    "PolicyError",
    "Registry",
    "RegistryError",
    "ReleaseRef",
    "Settings",
    "UnsafeMetadata",
    "UsageError",
    "ValidationFailed",
    "parse_checkpoint_ref",
    "parse_ref",
    "parse_release_ref",
]
