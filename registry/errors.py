"""The registry's errors: one tree; each carries what went wrong, what to do, and an exit code.

    RegistryError                  exit 1  an operation failed
    ├── UsageError                 exit 2  bad usage or input
    │   ├── MalformedRef                   a ref or name that does not parse
    │   ├── InvalidCheckpoint              a directory that is not a complete DCP checkpoint
    │   ├── UnsafeMetadata                 a `.metadata` pickle that references a forbidden global
    │   └── PolicyError                    a policy document that does not validate
    ├── NotFound                   exit 3  no such checkpoint, run, model, version or alias
    │   └── Collected                      deleted by retention (a tombstone explains when and why)
    ├── PermissionDenied           exit 4  the access policy refuses the action
    │   └── Unauthenticated                no valid token (reg server)
    ├── Conflict                   exit 5  exists with other content, immutable, or locked
    │   ├── ObjectExists                   put-if-absent found an object already there
    │   │   └── CompletedOver              our conditional write succeeded, another landed on it
    │   └── CatalogLocked                  another process holds the catalog
    ├── IntegrityError             exit 1  a stored file is missing, truncated or fails its digest
    │   ├── InvalidDocument                a stored MANIFEST.json or release.json that does not read
    │   └── UnprovenFact                   a catalog row the server decides from fails its signature
    ├── ValidationFailed           exit 1  restore validation did not pass
    └── GateNotMet                 exit 1  a promotion gate of the policy is not satisfied

The CLI prints ``str(error)`` (message, then the hint) as one line and exits with ``exit_code``.
Vendor exceptions (botocore, sqlalchemy, mlflow) are translated where they are caught, with
``raise ... from exc`` so ``REG_DEBUG=1`` still shows the cause.
"""

from __future__ import annotations

from registry.text import inert


class RegistryError(Exception):
    exit_code = 1

    def __init__(self, message: str, hint: str | None = None) -> None:
        # One printable line, whatever a file, a name or a stream put into it.
        message = inert(message)
        hint = None if hint is None else inert(hint)
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.message} ({self.hint})" if self.hint else self.message


class UsageError(RegistryError):
    exit_code = 2


class MalformedRef(UsageError):
    pass


class InvalidCheckpoint(UsageError):
    pass


class UnsafeMetadata(InvalidCheckpoint):
    pass


class PolicyError(UsageError):
    pass


class NotFound(RegistryError):
    exit_code = 3


class Collected(NotFound):
    pass


class PermissionDenied(RegistryError):
    exit_code = 4


class Unauthenticated(PermissionDenied):
    pass


class Conflict(RegistryError):
    exit_code = 5


class ObjectExists(Conflict):
    def __init__(self, key: str) -> None:
        super().__init__(f"object {key} already exists")
        self.key = key


class CompletedOver(ObjectExists):
    """A conditional complete that succeeded, with another writer's complete landed over it
    (a store where both can win): to the caller an ObjectExists, as a strict store's 412."""


class CatalogLocked(Conflict):
    pass


class IntegrityError(RegistryError):
    exit_code = 1


class InvalidDocument(IntegrityError):
    pass


class UnprovenFact(IntegrityError):
    """Behind the server: the policy in force (or another signed fact) cannot be proven, so the
    server refuses to decide rather than decide from a row anyone could have written."""


class ValidationFailed(RegistryError):
    exit_code = 1


class GateNotMet(RegistryError):
    exit_code = 1


class Unfinished(RegistryError):
    """A bounded wait ended with the work still running (a training job's `close()` or
    `wait(timeout=...)`): the message names what, and what it waits for."""

    exit_code = 1
