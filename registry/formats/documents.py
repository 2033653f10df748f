"""MANIFEST.json and release.json: the store's own record of what it holds (DESIGN §3).

Each is written last, put-if-absent, and lists every file with its size and sha256, so the
catalog can be rebuilt from the store. Both carry their format (`reg.manifest/1`,
`reg.release/1`); a reader knows every version it accepts, and within a version every key: an
unknown key, a missing one or a value of the wrong shape is an `InvalidDocument` naming the
document and the key. A later format adds a version here and keeps reading the older ones.
"""

from __future__ import annotations

import builtins
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, ClassVar

from registry.errors import InvalidDocument, RegistryError
from registry.refs import CheckpointRef, check_name, parse_checkpoint_ref

_SHA256 = re.compile(r"[0-9a-f]{64}")
_PATH_SEGMENT = re.compile(r"[A-Za-z0-9._=-][A-Za-z0-9._=+-]*")


@dataclass(frozen=True, slots=True)
class FileRecord:
    """One stored file: its path under the artifact's prefix, size and sha256."""

    path: str
    size: int
    sha256: str
    rank: int | None = None  # the DCP rank that wrote it (checkpoints only)

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "size": self.size, "sha256": self.sha256}


@dataclass(frozen=True, slots=True)
class TensorSummary:
    tensors: int
    tensor_bytes: int
    objects: int


@dataclass(frozen=True, slots=True)
class ResumeRecord:
    """The resume-state inventory as classified at push (kept for the record)."""

    classes: dict[str, list[str]]
    missing: list[str]
    resumable: bool
    unclassified: list[str]


@dataclass(frozen=True, slots=True)
class Manifest:
    FORMAT: ClassVar[str] = "reg.manifest/1"

    project: str
    run: str
    step: int
    world_size: int
    world_size_inferred: bool
    files: tuple[FileRecord, ...]
    tensors: TensorSummary
    resume: ResumeRecord
    metrics: dict[str, float]
    pushed_by: str
    created_at: str

    @property
    def ref(self) -> CheckpointRef:
        return CheckpointRef(self.project, self.run, self.step)

    @property
    def bytes(self) -> int:
        return sum(f.size for f in self.files)

    def to_bytes(self) -> builtins.bytes:
        document = {
            "format": self.FORMAT,
            "project": self.project,
            "run": self.run,
            "step": self.step,
            "world_size": self.world_size,
            "world_size_inferred": self.world_size_inferred,
            "files": [{**f.to_json(), "rank": f.rank} for f in self.files],
            "bytes": self.bytes,
            "tensors": {
                "tensors": self.tensors.tensors,
                "tensor_bytes": self.tensors.tensor_bytes,
                "objects": self.tensors.objects,
            },
            "resume": {
                "classes": self.resume.classes,
                "missing": self.resume.missing,
                "resumable": self.resume.resumable,
                "unclassified": self.resume.unclassified,
            },
            "metrics": self.metrics,
            "pushed_by": self.pushed_by,
            "created_at": self.created_at,
        }
        return json.dumps(document, indent=1, sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: builtins.bytes, where: str) -> Manifest:
        doc = _Reader(where).document(data, (cls.FORMAT,))
        r = _Reader(where)
        r.keys(
            doc,
            "format project run step world_size world_size_inferred files bytes tensors resume "
            "metrics pushed_by created_at",
        )
        files = r.files(doc["files"], with_rank=True)
        manifest = cls(
            project=r.name(doc["project"], "project"),
            run=r.name(doc["run"], "run"),
            step=r.integer(doc["step"], "step", minimum=0),
            world_size=r.integer(doc["world_size"], "world_size", minimum=1),
            world_size_inferred=r.boolean(doc["world_size_inferred"], "world_size_inferred"),
            files=files,
            tensors=r.tensor_summary(doc["tensors"]),
            resume=r.resume(doc["resume"]),
            metrics=r.metrics(doc["metrics"]),
            pushed_by=r.text(doc["pushed_by"], "pushed_by"),
            created_at=r.timestamp(doc["created_at"], "created_at"),
        )
        if r.integer(doc["bytes"], "bytes", minimum=0) != manifest.bytes:
            raise r.error("bytes", "is not the sum of the file sizes")
        return manifest


@dataclass(frozen=True, slots=True)
class SourceRecord:
    """The checkpoint a release came from."""

    ref: CheckpointRef
    manifest_sha256: str | None
    world_size: int


@dataclass(frozen=True, slots=True)
class ValidationRecord:
    """The validation that let the release through."""

    id: int | None
    passed: bool
    device: str
    device_name: str
    torch: str
    seconds: float


@dataclass(frozen=True, slots=True)
class ReleaseDocument:
    FORMAT: ClassVar[str] = "reg.release/1"

    model: str
    version: int
    files: tuple[FileRecord, ...]
    source: SourceRecord
    validation: ValidationRecord
    dtype: str | None
    tied: dict[str, str]  # a name written once -> the name it was written under
    created_at: str
    created_by: str

    @property
    def release(self) -> str:
        return f"{self.model}:v{self.version}"

    def to_bytes(self) -> bytes:
        document = {
            "format": self.FORMAT,
            "release": self.release,
            "model": self.model,
            "version": self.version,
            "files": [f.to_json() for f in self.files],
            "source": {
                "ref": str(self.source.ref),
                "manifest_sha256": self.source.manifest_sha256,
                "world_size": self.source.world_size,
            },
            "validation": {
                "id": self.validation.id,
                "passed": self.validation.passed,
                "device": self.validation.device,
                "device_name": self.validation.device_name,
                "torch": self.validation.torch,
                "seconds": self.validation.seconds,
            },
            "dtype": self.dtype,
            "tied": self.tied,
            "created_at": self.created_at,
            "created_by": self.created_by,
        }
        return json.dumps(document, indent=2, sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> ReleaseDocument:
        r = _Reader(where)
        doc = r.document(data, (cls.FORMAT,))
        r.keys(
            doc,
            "format release model version files source validation dtype tied created_at created_by",
        )
        source = r.mapping(doc["source"], "source", "ref manifest_sha256 world_size")
        validation = r.mapping(
            doc["validation"], "validation", "id passed device device_name torch seconds"
        )
        out = cls(
            model=r.name(doc["model"], "model"),
            version=r.integer(doc["version"], "version", minimum=1),
            files=r.files(doc["files"], with_rank=False),
            source=SourceRecord(
                ref=r.checkpoint_ref(source["ref"], "source.ref"),
                manifest_sha256=r.optional(source["manifest_sha256"], r.digest, "source.sha"),
                world_size=r.integer(source["world_size"], "source.world_size", minimum=0),
            ),
            validation=ValidationRecord(
                id=r.optional(validation["id"], r.integer, "validation.id"),
                passed=r.boolean(validation["passed"], "validation.passed"),
                device=r.text(validation["device"], "validation.device"),
                device_name=r.text(validation["device_name"], "validation.device_name"),
                torch=r.text(validation["torch"], "validation.torch"),
                seconds=r.number(validation["seconds"], "validation.seconds"),
            ),
            dtype=r.optional(doc["dtype"], r.text, "dtype"),
            tied=r.string_map(doc["tied"], "tied"),
            created_at=r.timestamp(doc["created_at"], "created_at"),
            created_by=r.text(doc["created_by"], "created_by"),
        )
        if doc["release"] != out.release:
            raise r.error(
                "release", f"says {doc['release']!r}, model and version say {out.release}"
            )
        return out


class _Reader:
    """Strict readers of JSON values; every failure names the document and the key."""

    def __init__(self, where: str) -> None:
        self.where = where

    def error(self, key: str, problem: str) -> InvalidDocument:
        return InvalidDocument(
            f"{self.where}: {key} {problem}",
            "the stored document is damaged or was not written by reg",
        )

    def document(self, data: bytes, formats: tuple[str, ...]) -> dict[str, Any]:
        try:
            doc = json.loads(data)
        except (ValueError, UnicodeDecodeError) as exc:
            raise InvalidDocument(
                f"{self.where}: not JSON ({exc})", "the stored document is damaged"
            ) from None
        if not isinstance(doc, dict):
            raise self.error("document", "is not a JSON object")
        if doc.get("format") not in formats:
            raise self.error(
                "format", f"is {doc.get('format')!r}; this reg reads {', '.join(formats)}"
            )
        return doc

    def keys(self, doc: dict[str, Any], names: str, where: str = "") -> None:
        wanted = set(names.split())
        unknown, missing = sorted(set(doc) - wanted), sorted(wanted - set(doc))
        label = f"{where}." if where else ""
        if unknown:
            raise self.error(f"{label}{unknown[0]}", "is not a known key")
        if missing:
            raise self.error(f"{label}{missing[0]}", "is missing")

    def mapping(self, value: Any, key: str, names: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self.error(key, "is not an object")
        self.keys(value, names, key)
        return value

    def integer(self, value: Any, key: str, *, minimum: int | None = None) -> int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise self.error(key, f"is {value!r}, not a whole number")
        if minimum is not None and value < minimum:
            raise self.error(key, f"is {value}, below {minimum}")
        return value

    def number(self, value: Any, key: str) -> float:
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise self.error(key, f"is {value!r}, not a number")
        return float(value)

    def boolean(self, value: Any, key: str) -> bool:
        if not isinstance(value, bool):
            raise self.error(key, f"is {value!r}, not true or false")
        return value

    def text(self, value: Any, key: str) -> str:
        if not isinstance(value, str) or not value:
            raise self.error(key, f"is {value!r}, not a non-empty string")
        return value

    def digest(self, value: Any, key: str) -> str:
        if not isinstance(value, str) or not _SHA256.fullmatch(value):
            raise self.error(key, f"is {value!r}, not a lowercase hex sha256")
        return value

    def name(self, value: Any, key: str) -> str:
        try:
            return check_name(self.text(value, key), key)
        except RegistryError as exc:
            raise self.error(key, f"is not a valid name ({exc.message})") from None

    def timestamp(self, value: Any, key: str) -> str:
        try:
            datetime.fromisoformat(self.text(value, key).replace("Z", "+00:00"))
        except ValueError:
            raise self.error(key, f"is {value!r}, not an ISO 8601 time") from None
        return str(value)

    def checkpoint_ref(self, value: Any, key: str) -> CheckpointRef:
        try:
            ref = parse_checkpoint_ref(self.text(value, key))
        except RegistryError as exc:
            raise self.error(key, f"is not a checkpoint ref ({exc.message})") from None
        if ref.step is None:
            raise self.error(key, f"is {value!r}, which names no step")
        return ref

    def optional(self, value: Any, read: Callable[[Any, str], Any], key: str) -> Any:
        return None if value is None else read(value, key)

    def string_list(self, value: Any, key: str) -> list[str]:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise self.error(key, "is not a list of strings")
        return list(value)

    def string_map(self, value: Any, key: str) -> dict[str, str]:
        if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
            raise self.error(key, "is not an object of strings")
        return dict(value)

    def files(self, value: Any, *, with_rank: bool) -> tuple[FileRecord, ...]:
        if not isinstance(value, list):
            raise self.error("files", "is not a list")
        out, seen = [], set()
        for i, item in enumerate(value):
            key = f"files[{i}]"
            entry = self.mapping(item, key, "path size sha256" + (" rank" if with_rank else ""))
            path = self.relative_path(entry["path"], f"{key}.path")
            if path in seen:
                raise self.error(f"{key}.path", f"repeats {path}")
            seen.add(path)
            rank = entry.get("rank")
            out.append(
                FileRecord(
                    path,
                    self.integer(entry["size"], f"{key}.size", minimum=0),
                    self.digest(entry["sha256"], f"{key}.sha256"),
                    None if rank is None else self.integer(rank, f"{key}.rank", minimum=0),
                )
            )
        return tuple(out)

    def relative_path(self, value: Any, key: str) -> str:
        path = self.text(value, key)
        parts = path.split("/")
        if any(not _PATH_SEGMENT.fullmatch(p) or p.startswith("..") for p in parts):
            raise self.error(key, f"is {path!r}, not a safe relative path")
        return path

    def tensor_summary(self, value: Any) -> TensorSummary:
        doc = self.mapping(value, "tensors", "tensors tensor_bytes objects")
        return TensorSummary(
            *(
                self.integer(doc[k], f"tensors.{k}", minimum=0)
                for k in ("tensors", "tensor_bytes", "objects")
            )
        )

    def resume(self, value: Any) -> ResumeRecord:
        doc = self.mapping(value, "resume", "classes missing resumable unclassified")
        classes = doc["classes"]
        if not isinstance(classes, dict):
            raise self.error("resume.classes", "is not an object")
        return ResumeRecord(
            classes={
                str(k): self.string_list(v, f"resume.classes.{k}") for k, v in classes.items()
            },
            missing=self.string_list(doc["missing"], "resume.missing"),
            resumable=self.boolean(doc["resumable"], "resume.resumable"),
            unclassified=self.string_list(doc["unclassified"], "resume.unclassified"),
        )

    def metrics(self, value: Any) -> dict[str, float]:
        if not isinstance(value, dict):
            raise self.error("metrics", "is not an object")
        out = {}
        for k, v in value.items():
            number = self.number(v, f"metrics.{k}")
            if not math.isfinite(number):
                raise self.error(f"metrics.{k}", f"is {v!r}, not a finite number")
            out[self.name(k, "metric name")] = number
        return out
