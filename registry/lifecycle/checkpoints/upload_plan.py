"""The plan of a presigned push (`presigned.py`): which files, of which sizes and digests, go up
in one PUT or in which parts. The client computes the same part plan (`part_sizes`) to hash
each part before it asks for URLs; the server checks the client's list against it and keeps the
plan as an object beside the files."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from registry.core.refs import CheckpointRef
from registry.errors import UsageError
from registry.formats.dcp_scan import check_file_set, check_path
from registry.storage.parts import MIN_PART as STORE_MIN_PART
from registry.storage.parts import part_size_for

# Files up to this size go up in one PUT; larger ones in parts of this size or more (as many
# as S3's 10,000-part limit needs). 8 MiB, as boto3's transfers: on the test server 64 MiB parts
# made a 1 GiB push 30% slower, and S3 takes parts of any size from 5 MiB.
MIN_PART = STORE_MIN_PART
# The claim of a presigned push is held by no server process: the client's requests renew it
# (it sends one every LEASE_S / 4 while uploading), so a client killed mid-push frees the step
# within LEASE_S.
LEASE_S = 120.0
PLAN_VERSION = 1
_HEX = re.compile(r"[0-9a-f]{64}")


def part_sizes(size: int) -> list[int] | None:
    """The parts of a multipart upload of `size` bytes, or None for a single PUT."""
    if size <= MIN_PART:
        return None
    part = max(MIN_PART, part_size_for(size))
    full, rest = divmod(size, part)
    return [part] * full + ([rest] if rest else [])


@dataclass(frozen=True, slots=True)
class DeclaredFile:
    path: str
    size: int
    sha256: str
    parts: list[str] | None = None  # sha256 of each part, for a multipart file
    upload_id: str | None = None  # the server's multipart upload, once created

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "size": self.size,
            "sha256": self.sha256,
            "parts": self.parts,
            "upload_id": self.upload_id,
        }


def declared_files(entries: object, *, max_files: int = 100_000) -> list[DeclaredFile]:
    """The client's file list, checked: plain paths, sizes, sha256s, and part digests exactly
    where the part plan wants them."""
    if not isinstance(entries, list) or not entries or len(entries) > max_files:
        raise UsageError(f"files must be a list of 1 to {max_files} entries")
    out: list[DeclaredFile] = []
    seen: set[str] = set()
    for entry in entries:
        if not isinstance(entry, dict):
            raise UsageError("each file is an object with path, size, sha256 and parts")
        path, size, digest, parts = (entry.get(k) for k in ("path", "size", "sha256", "parts"))
        if not isinstance(path, str) or path in seen:
            raise UsageError(f"file path {str(path)[:80]!r} is not a string or repeats")
        check_path("the pushed directory", path)
        seen.add(path)
        if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size < 1 << 50:
            raise UsageError(f"{path}: bad size {size!r}")
        if not isinstance(digest, str) or not _HEX.fullmatch(digest):
            raise UsageError(f"{path}: sha256 must be 64 lowercase hex digits")
        plan = part_sizes(size)
        if plan is None and parts is not None:
            raise UsageError(f"{path}: {size} bytes go up in one PUT, not in parts")
        if plan is not None and (
            not isinstance(parts, list)
            or len(parts) != len(plan)
            or not all(isinstance(p, str) and _HEX.fullmatch(p) for p in parts)
        ):
            raise UsageError(f"{path}: {size} bytes go up as {len(plan)} parts; send their sha256")
        out.append(DeclaredFile(path, size, digest, parts))
    check_file_set("the pushed directory", {f.path: f.size for f in out})
    return out


@dataclass(frozen=True, slots=True)
class Plan:
    """What a presigned push may upload: written by the server at `begin`, read by the others."""

    token: str
    ref: CheckpointRef
    actor: str
    world_size: int | None
    metrics: dict[str, float]
    files: list[DeclaredFile]
    reused: list[str]
    started: float
    layout: str | None = None  # forced with --layout; None: detected at complete

    @property
    def items(self) -> list[tuple[int, int]]:
        """(file index, part number; 0 for a single PUT) of every URL the push needs."""
        out = []
        for i, f in enumerate(self.files):
            if f.path in self.reused:
                continue
            out.extend([(i, n) for n in range(1, len(f.parts) + 1)] if f.parts else [(i, 0)])
        return out

    def to_bytes(self) -> bytes:
        doc = {
            "version": PLAN_VERSION,
            "token": self.token,
            "ref": str(self.ref),
            "project": self.ref.project,
            "run": self.ref.run,
            "step": self.ref.step,
            "actor": self.actor,
            "world_size": self.world_size,
            "metrics": self.metrics,
            "files": [f.to_json() for f in self.files],
            "reused": self.reused,
            "started": self.started,
            "layout": self.layout,
        }
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Plan:
        doc = json.loads(data)
        return cls(
            token=doc["token"],
            ref=CheckpointRef(doc["project"], doc["run"], doc["step"]),
            actor=doc["actor"],
            world_size=doc["world_size"],
            metrics=doc["metrics"],
            files=[DeclaredFile(**f) for f in doc["files"]],
            reused=list(doc["reused"]),
            started=float(doc["started"]),
            layout=doc.get("layout"),
        )
