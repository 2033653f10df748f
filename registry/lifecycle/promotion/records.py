"""What a promotion's stages hand each other: an extra file going into the release (`Extra`,
planned by plan.py, written by hf.py and adapters.py) and the pending release row a promotion
holds (`Reservation`, made by stages.py, named in the signed files by signed.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from registry.catalog.claims import Claim
from registry.catalog.models import Validation


@dataclass(frozen=True)
class Extra:
    path: Path
    sha256: str
    code: str | None = None  # what code it is, when the policy allowed code extras
    data: bytes | None = None  # a file of the checkpoint's, carried (proven bytes); else `path`

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def label(self) -> str:
        return f"{self.name} of the checkpoint" if self.data is not None else f"--extra {self.path}"


@dataclass(frozen=True)
class Reservation:
    claim: Claim
    version: int
    validation: Validation  # the attempt's: a rerun continues with the one its files name

    @property
    def release_id(self) -> int:
        return self.claim.row_id
