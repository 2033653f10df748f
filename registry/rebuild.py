"""Rebuild the catalog from the store: the store is self-describing (DESIGN §3).

Every committed checkpoint has a MANIFEST.json and every release a release.json, written last;
both list each file's size and sha256. A lost or damaged catalog is rebuilt from them: rows that
already exist are left alone, missing ones are added. What lives only in the catalog (aliases,
deprecations and yanks, pins, validations, the audit log) cannot come back from the store and is
reported as such.
"""

from __future__ import annotations

import hashlib
import json
from datetime import datetime
from typing import TYPE_CHECKING, Any

from sqlmodel import select

from registry import audit
from registry.catalog import queries
from registry.catalog.models import (
    ACTIVE,
    COMMITTED,
    DELETED,
    Checkpoint,
    CheckpointFile,
    Model,
    Release,
    ReleaseFile,
)
from registry.checkpoints import MANIFEST_FORMAT
from registry.formats.dcp import MANIFEST
from registry.refs import parse_checkpoint_ref
from registry.releases import RELEASE_FORMAT, RELEASE_JSON
from registry.timeutil import now

if TYPE_CHECKING:
    from registry.api import Registry


def _ts(text: str | None) -> float:
    if not text:
        return now()
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def rebuild(reg: Registry, *, dry_run: bool = False) -> dict[str, Any]:
    reg.authorize("catalog", target="catalog rebuild")
    out: dict[str, Any] = {
        "applied": not dry_run,
        "checkpoints_added": [],
        "releases_added": [],
        "skipped": [],
    }
    for obj in reg.store.list("ckpt/"):
        if obj.key.endswith("/" + MANIFEST):
            _checkpoint(reg, obj.key, out, dry_run)
    for obj in reg.store.list("release/"):
        if obj.key.endswith("/" + RELEASE_JSON):
            _release(reg, obj.key, out, dry_run)
    out["not_recoverable"] = (
        "aliases, deprecations and yanks, pins, validations and the audit "
        "log live only in the catalog"
    )
    if not dry_run and (out["checkpoints_added"] or out["releases_added"]):
        with reg.catalog.session(write=True) as s:
            audit.record(
                s,
                reg.user,
                "catalog-rebuild",
                "catalog",
                checkpoints=len(out["checkpoints_added"]),
                releases=len(out["releases_added"]),
            )
    return out


def _checkpoint(reg: Registry, key: str, out: dict[str, Any], dry_run: bool) -> None:
    data = reg.store.get_bytes(key)
    try:
        manifest = json.loads(data)
        assert manifest["format"] == MANIFEST_FORMAT
        project, run, step = manifest["project"], manifest["run"], int(manifest["step"])
    except (ValueError, KeyError, AssertionError, TypeError):
        out["skipped"].append(f"{key}: not a {MANIFEST_FORMAT} manifest")
        return
    ref = f"{'' if project == 'default' else project + '/'}{run}@step{step}"
    with reg.catalog.session(write=not dry_run) as s:
        _, run_row = queries.get_or_create_run(s, project, run)
        existing = s.exec(
            select(Checkpoint).where(Checkpoint.run_id == run_row.id, Checkpoint.step == step)
        ).first()
        if existing is not None and existing.state != "pending":
            s.rollback()
            return
        out["checkpoints_added"].append(ref)
        if dry_run:
            s.rollback()
            return
        if existing is not None:  # a pending claim: the manifest shows it was complete
            s.delete(existing)
            s.flush()
        resume = manifest.get("resume", {})
        tensors = manifest.get("tensors", {})
        ckpt = Checkpoint(
            run_id=run_row.id or 0,
            step=step,
            state=COMMITTED,
            world_size=int(manifest.get("world_size", 0)),
            world_size_inferred=bool(manifest.get("world_size_inferred", False)),
            bytes=int(manifest.get("bytes", 0)),
            file_count=len(manifest["files"]),
            tensor_count=int(tensors.get("tensors", 0)),
            tensor_bytes=int(tensors.get("tensor_bytes", 0)),
            manifest_sha256=hashlib.sha256(data).hexdigest(),
            resumable=bool(resume.get("resumable", False)),
            missing_state=list(resume.get("missing", [])),
            resume_classes=dict(resume.get("classes", {})),
            metrics=dict(manifest.get("metrics", {})),
            created_at=_ts(manifest.get("created_at")),
            committed_at=_ts(manifest.get("created_at")),
            pushed_by=str(manifest.get("pushed_by", "unknown")),
        )
        s.add(ckpt)
        s.flush()
        for f in manifest["files"]:
            s.add(
                CheckpointFile(
                    checkpoint_id=ckpt.id or 0,
                    path=f["path"],
                    size=int(f["size"]),
                    sha256=f["sha256"],
                    rank=f.get("rank"),
                )
            )


def _release(reg: Registry, key: str, out: dict[str, Any], dry_run: bool) -> None:
    data = reg.store.get_bytes(key)
    try:
        doc = json.loads(data)
        assert doc["format"] == RELEASE_FORMAT
        model_name, version = doc["model"], int(doc["version"])
        source = parse_checkpoint_ref(doc["source"]["ref"])
    except (ValueError, KeyError, AssertionError, TypeError):
        out["skipped"].append(f"{key}: not a {RELEASE_FORMAT} document")
        return
    with reg.catalog.session(write=not dry_run) as s:
        model = s.exec(select(Model).where(Model.name == model_name)).first()
        if model is None:
            model = Model(name=model_name, created_at=_ts(doc.get("created_at")))
            s.add(model)
            s.flush()
        existing = s.exec(
            select(Release).where(Release.model_id == model.id, Release.version == version)
        ).first()
        if existing is not None and existing.status != "pending":
            s.rollback()
            return
        out["releases_added"].append(doc["release"])
        if dry_run:
            s.rollback()
            return
        if existing is not None:
            s.delete(existing)
            s.flush()
        _, run_row = queries.get_or_create_run(s, source.project, source.run)
        ckpt = s.exec(
            select(Checkpoint).where(
                Checkpoint.run_id == run_row.id, Checkpoint.step == source.step
            )
        ).first()
        if ckpt is None:  # the source was collected: a tombstone keeps the lineage
            ckpt = Checkpoint(
                run_id=run_row.id or 0,
                step=source.step or 0,
                state=DELETED,
                created_at=now(),
                pushed_by="unknown",
                deleted_at=now(),
                delete_reason="not in the store at catalog rebuild",
                manifest_sha256=doc["source"].get("manifest_sha256"),
                world_size=int(doc["source"].get("world_size", 0)),
            )
            s.add(ckpt)
            s.flush()
        files = doc["files"]
        release = Release(
            model_id=model.id or 0,
            version=version,
            status=ACTIVE,
            sha256=hashlib.sha256(data).hexdigest(),
            bytes=sum(int(f["size"]) for f in files) + len(data),
            source_checkpoint_id=ckpt.id or 0,
            source_ref=str(source),
            options_key="rebuilt",
            options={"dtype": doc.get("dtype")},
            dtype=doc.get("dtype"),
            tied=[[a, k] for a, k in sorted((doc.get("tied") or {}).items())],
            created_at=_ts(doc.get("created_at")),
            created_by=str(doc.get("created_by", "unknown")),
            stage="committed",
            tensor_count=0,
        )
        s.add(release)
        s.flush()
        for f in files:
            s.add(
                ReleaseFile(
                    release_id=release.id or 0,
                    path=f["path"],
                    size=int(f["size"]),
                    sha256=f["sha256"],
                )
            )
