"""MANIFEST.json and release.json: the store's own record of what it holds (DESIGN §3).

Each is written last, put-if-absent, and lists every file with its size and sha256, so the
catalog can be rebuilt from the store. Both carry their format; a reader knows every version it
accepts, and within a version every key: an unknown key, a missing one or a value of the wrong
shape is an `InvalidDocument` naming the document and the key. A later format adds a version
here and keeps reading the older ones:

  reg.manifest/1, reg.release/1   files: path, size, sha256 (+ rank in a manifest)
  reg.manifest/2, reg.release/2   each file also has `version`: the object's version on a
                                  versioned bucket, null elsewhere (written from 2026-11)
  reg.manifest/3                  `resume` also has the checkpoint's `layout`, its `keys` (every
                                  DCP key path, sorted) and `sidecars` (files beside the shards),
                                  from which resume state is decided when used (from 2026-12)
  reg.release/3                   `hf_config`: the extra config.json as given (its sha256) and
                                  the keys promotion rewrote in the release's copy, each
                                  {from, to}; written only when it rewrote one (else /2)
  reg.release/4                   `code_extras`: the extras that are code (modeling_*.py, a
                                  config naming auto_map), released under the policy's
                                  `[release] allow_code_extras`; `hf_config` as in /3 or null;
                                  written only when there are some, so an older reg refuses
                                  the document rather than serve code unannounced
"""

from __future__ import annotations

import builtins
import dataclasses
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from policies.layouts import LAYOUTS
from registry.core.layout import MANIFEST, RELEASE_DOCUMENT
from registry.core.refs import CheckpointRef
from registry.formats.strict_json import StrictReader


@dataclass(frozen=True, slots=True)
class FileRecord:
    """One stored file: its path under the artifact's prefix, size and sha256."""

    path: str
    size: int
    sha256: str
    rank: int | None = None  # the DCP rank that wrote it (checkpoints only)
    version: str | None = None  # the object's version on a versioned bucket

    def to_json(self) -> dict[str, Any]:
        """As commands show it (`version` only where the bucket keeps versions)."""
        out: dict[str, Any] = {"path": self.path, "size": self.size, "sha256": self.sha256}
        if self.version is not None:
            out["version"] = self.version
        return out

    def document_json(self) -> dict[str, Any]:
        """As MANIFEST.json and release.json hold it (format /2: `version` always present)."""
        return {
            "path": self.path,
            "size": self.size,
            "sha256": self.sha256,
            "version": self.version,
        }


@dataclass(frozen=True, slots=True)
class TensorSummary:
    tensors: int
    tensor_bytes: int
    objects: int


@dataclass(frozen=True, slots=True)
class ResumeRecord:
    """The resume-state inventory as classified at push (kept for the record), and from format
    /3 what any later classification reads: the layout, the key paths and the sidecar files."""

    classes: dict[str, list[str]]
    missing: list[str]
    resumable: bool
    unclassified: list[str]
    layout: str | None = None  # None: a manifest before format /3
    keys: tuple[str, ...] | None = None
    sidecars: tuple[str, ...] | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "classes": self.classes,
            "missing": self.missing,
            "resumable": self.resumable,
            "unclassified": self.unclassified,
        }
        if self.layout is not None:
            out.update(layout=self.layout, keys=list(self.keys or ()))
            out["sidecars"] = list(self.sidecars or ())
        return out


@dataclass(frozen=True, slots=True)
class Manifest:
    FORMAT: ClassVar[str] = "reg.manifest/3"
    READS: ClassVar[tuple[str, ...]] = ("reg.manifest/1", "reg.manifest/2", "reg.manifest/3")

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
            "files": [{**f.document_json(), "rank": f.rank} for f in self.files],
            "bytes": self.bytes,
            "tensors": {
                "tensors": self.tensors.tensors,
                "tensor_bytes": self.tensors.tensor_bytes,
                "objects": self.tensors.objects,
            },
            "resume": self.resume.to_json(),
            "metrics": self.metrics,
            "pushed_by": self.pushed_by,
            "created_at": self.created_at,
        }
        return json.dumps(document, indent=1, sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: builtins.bytes, where: str) -> Manifest:
        r = StrictReader(where)
        doc = r.document(data, cls.READS)
        r.keys(
            doc,
            "format project run step world_size world_size_inferred files bytes tensors resume "
            "metrics pushed_by created_at",
        )
        versioned = doc["format"] != "reg.manifest/1"
        files = _files(r, doc["files"], with_rank=True, versioned=versioned, reserved=MANIFEST)
        manifest = cls(
            project=r.name(doc["project"], "project"),
            run=r.name(doc["run"], "run"),
            step=r.integer(doc["step"], "step", minimum=0, maximum=10**18),
            world_size=r.integer(doc["world_size"], "world_size", minimum=1, maximum=2**31),
            world_size_inferred=r.boolean(doc["world_size_inferred"], "world_size_inferred"),
            files=files,
            tensors=_tensor_summary(r, doc["tensors"]),
            resume=_resume(r, doc["resume"], with_keys=doc["format"] == "reg.manifest/3"),
            metrics=_metrics(r, doc["metrics"]),
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
class HfConfigRecord:
    """The release's config.json as promotion rewrote it: the given file's sha256 and each
    rewritten key's value before and after (the release's copy is listed in `files`)."""

    path: str
    original_sha256: str
    rewritten: dict[str, dict[str, Any]]

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "original_sha256": self.original_sha256,
            "rewritten": self.rewritten,
        }


@dataclass(frozen=True, slots=True)
class ReleaseDocument:
    FORMAT: ClassVar[str] = "reg.release/2"
    FORMAT_HF: ClassVar[str] = "reg.release/3"  # with `hf_config`
    FORMAT_CODE: ClassVar[str] = "reg.release/4"  # with `code_extras` (and `hf_config` or null)
    READS: ClassVar[tuple[str, ...]] = (
        "reg.release/1",
        "reg.release/2",
        "reg.release/3",
        "reg.release/4",
    )

    model: str
    version: int
    files: tuple[FileRecord, ...]
    source: SourceRecord
    validation: ValidationRecord
    dtype: str | None
    tied: dict[str, str]  # a name written once -> the name it was written under
    created_at: str
    created_by: str
    hf_config: HfConfigRecord | None = None
    code_extras: tuple[str, ...] = ()  # file names, sorted: code released on purpose

    @property
    def release(self) -> str:
        return f"{self.model}:v{self.version}"

    def to_bytes(self) -> bytes:
        if self.code_extras:
            form = self.FORMAT_CODE
        else:
            form = self.FORMAT if self.hf_config is None else self.FORMAT_HF
        document: dict[str, Any] = {
            "format": form,
            "release": self.release,
            "model": self.model,
            "version": self.version,
            "files": [f.document_json() for f in self.files],
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
        if self.hf_config is not None or self.code_extras:
            document["hf_config"] = None if self.hf_config is None else self.hf_config.to_json()
        if self.code_extras:
            document["code_extras"] = list(self.code_extras)
        return json.dumps(document, indent=2, sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> ReleaseDocument:
        r = StrictReader(where)
        doc = r.document(data, cls.READS)
        with_code = doc["format"] == cls.FORMAT_CODE
        with_hf = doc["format"] == cls.FORMAT_HF or with_code
        r.keys(
            doc,
            "format release model version files source validation dtype tied created_at created_by"
            + (" hf_config" if with_hf else "")
            + (" code_extras" if with_code else ""),
        )
        versioned = doc["format"] != "reg.release/1"
        source = r.mapping(doc["source"], "source", "ref manifest_sha256 world_size")
        validation = r.mapping(
            doc["validation"], "validation", "id passed device device_name torch seconds"
        )
        out = cls(
            model=r.name(doc["model"], "model"),
            version=r.integer(doc["version"], "version", minimum=1),
            files=_files(
                r, doc["files"], with_rank=False, versioned=versioned, reserved=RELEASE_DOCUMENT
            ),
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
            hf_config=(
                _hf_config(r, doc["hf_config"])
                if with_hf and (doc["hf_config"] is not None or not with_code)
                else None
            ),
        )
        if with_code:
            out = dataclasses.replace(out, code_extras=_code_extras(r, doc["code_extras"], out))
        if doc["release"] != out.release:
            raise r.error(
                "release", f"says {doc['release']!r}, model and version say {out.release}"
            )
        return out


def _code_extras(r: StrictReader, value: Any, document: ReleaseDocument) -> tuple[str, ...]:
    names = r.string_list(value, "code_extras")
    files = {f.path for f in document.files}
    if not names or names != sorted(set(names)):
        raise r.error("code_extras", "is not a sorted list of distinct names")
    for name in names:
        if name not in files:
            raise r.error("code_extras", f"names {name!r}, which is not one of the files")
    return tuple(names)


def _hf_config(r: StrictReader, value: Any) -> HfConfigRecord:
    doc = r.mapping(value, "hf_config", "path original_sha256 rewritten")
    rewritten = doc["rewritten"]
    if not isinstance(rewritten, dict) or not rewritten:
        raise r.error("hf_config.rewritten", "is not a non-empty object")
    for key, change in rewritten.items():
        r.mapping(change, f"hf_config.rewritten.{r.unicode(key, 'hf_config.rewritten')}", "from to")
    return HfConfigRecord(
        path=r.relative_path(doc["path"], "hf_config.path"),
        original_sha256=r.digest(doc["original_sha256"], "hf_config.original_sha256"),
        rewritten=rewritten,
    )


# -- the parts both documents share ---------------------------------------------------------


def _files(
    r: StrictReader, value: Any, *, with_rank: bool, versioned: bool, reserved: str
) -> tuple[FileRecord, ...]:
    """The file list; `reserved` (the document's own name) is never one of its files."""
    if not isinstance(value, list):
        raise r.error("files", "is not a list")
    out, seen = [], set()
    for i, item in enumerate(value):
        key = f"files[{i}]"
        entry = r.mapping(
            item,
            key,
            "path size sha256" + (" rank" if with_rank else "") + (" version" if versioned else ""),
        )
        path = r.relative_path(entry["path"], f"{key}.path")
        if path in seen:
            raise r.error(f"{key}.path", f"repeats {path}")
        if path == reserved:
            raise r.error(f"{key}.path", f"is {reserved}, the document itself")
        seen.add(path)
        rank = entry.get("rank")
        out.append(
            FileRecord(
                path,
                r.integer(entry["size"], f"{key}.size", minimum=0),
                r.digest(entry["sha256"], f"{key}.sha256"),
                None if rank is None else r.integer(rank, f"{key}.rank", minimum=0),
                r.optional(entry.get("version"), _object_version(r), f"{key}.version"),
            )
        )
    return tuple(out)


MAX_VERSION = 1024  # the catalog's column for an object version


def _object_version(r: StrictReader) -> Callable[[Any, str], str]:
    def read(value: Any, key: str) -> str:
        text = r.text(value, key)
        if len(text) > MAX_VERSION or not text.isprintable():
            raise r.error(key, f"is not an object version (printable, at most {MAX_VERSION})")
        return text

    return read


def _tensor_summary(r: StrictReader, value: Any) -> TensorSummary:
    doc = r.mapping(value, "tensors", "tensors tensor_bytes objects")
    return TensorSummary(
        *(
            r.integer(doc[k], f"tensors.{k}", minimum=0)
            for k in ("tensors", "tensor_bytes", "objects")
        )
    )


def _resume(r: StrictReader, value: Any, *, with_keys: bool) -> ResumeRecord:
    names = "classes missing resumable unclassified" + (
        " layout keys sidecars" if with_keys else ""
    )
    doc = r.mapping(value, "resume", names)
    classes = doc["classes"]
    if not isinstance(classes, dict):
        raise r.error("resume.classes", "is not an object")
    layout = keys = sidecars = None
    if with_keys:
        layout = r.text(doc["layout"], "resume.layout")
        if layout not in LAYOUTS:
            raise r.error("resume.layout", f"is {layout!r}, not one of {', '.join(LAYOUTS)}")
        keys = tuple(r.string_list(doc["keys"], "resume.keys"))
        if list(keys) != sorted(set(keys)):
            raise r.error("resume.keys", "is not sorted without repeats")
        sidecars = tuple(r.string_list(doc["sidecars"], "resume.sidecars"))
    return ResumeRecord(
        classes={
            r.unicode(k, "resume.classes"): r.string_list(v, f"resume.classes.{k}")
            for k, v in classes.items()
        },
        missing=r.string_list(doc["missing"], "resume.missing"),
        resumable=r.boolean(doc["resumable"], "resume.resumable"),
        unclassified=r.string_list(doc["unclassified"], "resume.unclassified"),
        layout=layout,
        keys=keys,
        sidecars=sidecars,
    )


def _metrics(r: StrictReader, value: Any) -> dict[str, float]:
    if not isinstance(value, dict):
        raise r.error("metrics", "is not an object")
    out = {}
    for k, v in value.items():
        number = r.number(v, f"metrics.{k}")
        if not math.isfinite(number):
            raise r.error(f"metrics.{k}", f"is {v!r}, not a finite number")
        out[r.name(k, "metric name")] = number
    return out
