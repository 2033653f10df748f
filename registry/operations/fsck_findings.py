"""What `reg fsck` finds (its kinds), the rows and objects it compares (`Snapshot`): shared by
the check (fsck.py) and the repair (fsck_repair.py)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

from registry.catalog.models import COMMITTED, RELEASE_PENDING, Checkpoint, Release
from registry.formats.documents import FileRecord
from registry.storage.base import ObjectInfo


class FindingKind(StrEnum):
    """What `reg fsck` finds (the module doc of fsck.py says what each means)."""

    MISSING = "missing-object"
    SIZE = "size-mismatch"
    DIGEST = "sha256-mismatch"
    UNLISTED = "unlisted-object"
    INVALID_KEY = "invalid-key"
    UNCATALOGED = "uncataloged"
    STALE_CLAIM = "stale-claim"
    UNFINISHED_DELETION = "unfinished-deletion"
    TOMBSTONE_OBJECTS = "tombstone-objects"
    UNFINISHED_PROMOTION = "unfinished-promotion"


(
    MISSING,
    SIZE,
    DIGEST,
    UNLISTED,
    INVALID_KEY,
    UNCATALOGED,
    STALE_CLAIM,
    UNFINISHED_DELETION,
    TOMBSTONE_OBJECTS,
    UNFINISHED_PROMOTION,
) = FindingKind
DAMAGE = (MISSING, SIZE, DIGEST)


@dataclass(frozen=True, slots=True)
class Finding:
    kind: str
    target: str  # the checkpoint ref or release name it concerns (a place, for no row)
    key: str | None  # the object, where one is concerned
    detail: str
    sweepable: bool

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(slots=True, eq=False)  # one per row: compared and hashed by identity
class Artifact:
    """A catalog row with the files it lists (documents included), under `prefix`."""

    target: str
    prefix: str
    row: Checkpoint | Release
    files: list[FileRecord] = field(default_factory=list)

    @property
    def release(self) -> bool:
        return isinstance(self.row, Release)

    @property
    def state(self) -> str:
        return self.row.status if isinstance(self.row, Release) else self.row.state

    @property
    def committed(self) -> bool:
        """A committed checkpoint, or a release that left `pending` (active, deprecated,
        yanked): what readers rely on."""
        return self.state != RELEASE_PENDING if self.release else self.state == COMMITTED


@dataclass(slots=True)
class Snapshot:
    objects: dict[str, ObjectInfo]
    artifacts: dict[str, Artifact]  # by prefix
    places: set[str] = field(default_factory=set)  # prefixes that hold at least one object
    targets: dict[str, Artifact] = field(default_factory=dict)  # by ref or release name

    def by_target(self, target: str) -> Artifact | None:
        return self.targets.get(target)
