"""Promotion: checkpoint -> validated, consolidated, immutable release (DESIGN §1, §5).

Stages, each recorded on the release row (`stage`):
  gates        resumable (policy), a passing validation the policy accepts (run here if the
               required device is here)
  reserved     the version is allocated atomically (unique per model) on a pending row with a
               claim; a killed promotion's rerun takes over the same row and version
  consolidated safetensors (+ index), extras, all put-if-absent and read-only
  committed    release.json written last; the row becomes active in one transaction with its
               files and the alias move

Nothing is visible until the commit. Promoting a checkpoint that already produced an active
release of the model with the same options returns that release (`existing: true`).
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import func, update
from sqlalchemy.exc import IntegrityError as DBIntegrityError
from sqlmodel import col, select

from policies.gates import (
    ValidationRecord,
    device_gate,
    resumable_gate,
    satisfies_device,
    usable_validation,
)
from policies.loader import parse_size
from registry import audit, outbox
from registry.catalog.models import (
    ACTIVE,
    RELEASE_PENDING,
    Model,
    Release,
    ReleaseFile,
    Validation,
)
from registry.checkpoints import checkpoint_prefix, resolve
from registry.errors import (
    Conflict,
    GateNotMet,
    ObjectExists,
    UsageError,
    ValidationFailed,
)
from registry.formats.dcp import METADATA, inventory, load_metadata
from registry.holds import hold
from registry.leases import Heartbeat, is_stale
from registry.refs import CheckpointRef, check_alias, check_name
from registry.releases import RELEASE_FORMAT, RELEASE_JSON, move_alias, release_prefix, view
from registry.timeutil import iso, now

if TYPE_CHECKING:
    from registry.api import Registry
    from registry.catalog.models import Checkpoint
    from registry.progress import Progress

LEASE_SECONDS = 60.0


def promote(
    reg: Registry,
    ref: CheckpointRef,
    *,
    model: str,
    alias: str | None = None,
    dtype: str | None = None,
    max_shard_size: str = "5GB",
    extras: list[Path] | None = None,
    model_factory: str | None = None,
    progress: Progress | None = None,
) -> dict[str, Any]:
    check_name(model, "model name")
    if alias is not None:
        check_alias(alias)
    if dtype is not None and dtype not in ("bf16", "fp16", "fp32"):
        raise UsageError(f"unknown --dtype {dtype!r}", "use bf16, fp16 or fp32")
    reg.authorize("promote", project=ref.project, model=model, target=f"{ref} -> {model}")
    max_bytes = _shard_bytes(max_shard_size)
    extra_files = _check_extras(extras or [])
    _, ckpt, _ = resolve(reg, ref)
    source = CheckpointRef(ref.project, ref.run, ckpt.step)
    options = {
        "dtype": dtype,
        "max_shard_bytes": max_bytes,
        "extras": {p.name: digest for p, digest in extra_files},
    }
    options_key = hashlib.sha256(json.dumps(options, sort_keys=True).encode()).hexdigest()[:32]

    existing = _existing(reg, ckpt.id or 0, model, options_key, alias)
    if existing is not None:
        return existing

    gate = resumable_gate(reg.policy.promotion, ckpt.resumable, list(ckpt.missing_state))
    if gate:
        raise GateNotMet(
            f"refusing to promote {source}: {gate}",
            "promote a full training checkpoint, or set require_resumable = false",
        )
    validation = _validation_for(reg, source, ckpt, model_factory)

    with hold(reg, ckpt.id or 0, f"promote {source}"):
        release_id, version, token, validation_id = _reserve(
            reg, model, ckpt, source, options_key, options, validation, dtype
        )
        if validation_id != validation.id:
            with reg.catalog.session() as s:
                validation = s.get(Validation, validation_id) or validation
        with Heartbeat(lambda: _renew(reg, release_id, token), LEASE_SECONDS / 4):
            return _build_and_commit(
                reg,
                source,
                ckpt,
                model,
                version,
                release_id,
                token,
                options,
                extra_files,
                validation,
                alias,
                progress,
            )


def _shard_bytes(text: str) -> int:
    try:
        size = parse_size(text)
    except ValueError as exc:
        raise UsageError(f"bad --max-shard-size: {exc}") from None
    if not size or size < 1024:
        raise UsageError(f"--max-shard-size {text} is too small", "e.g. 5GB")
    return size


def _check_extras(extras: list[Path]) -> list[tuple[Path, str]]:
    out = []
    names = set()
    reserved = {RELEASE_JSON, "model.safetensors.index.json"}
    for path in extras:
        p = Path(path)
        if not p.is_file() or p.is_symlink():
            raise UsageError(f"--extra {p}: not a regular file", "give files such as config.json")
        if p.name in names or p.name in reserved or p.name.endswith(".safetensors"):
            raise UsageError(f"--extra {p}: the name {p.name} is taken or reserved")
        check_name(p.name, "extra file name")
        names.add(p.name)
        h = hashlib.sha256(p.read_bytes()).hexdigest()
        out.append((p, h))
    return out


def _existing(
    reg: Registry, ckpt_id: int, model: str, options_key: str, alias: str | None
) -> dict[str, Any] | None:
    with reg.catalog.session(write=alias is not None) as s:
        row = s.exec(
            select(Model, Release)
            .join(Release, col(Release.model_id) == Model.id)
            .where(
                Model.name == model,
                Release.source_checkpoint_id == ckpt_id,
                Release.options_key == options_key,
                Release.status == ACTIVE,
            )
            .order_by(col(Release.version).desc())
        ).first()
        if row is None:
            return None
        m, release = row
        if alias is not None:
            move_alias(s, reg, m, alias, release)
        out = view(s, m, release, reg.store.describe(release_prefix(m.name, release.version)))
    out["existing"] = True
    return out


def _validation_for(
    reg: Registry, source: CheckpointRef, ckpt: Checkpoint, model_factory: str | None
) -> Validation:
    """A recorded validation the policy accepts, or a new one run here."""
    from registry.validation import resolve_device, validate

    policy = reg.policy.promotion
    with reg.catalog.session() as s:
        rows = list(s.exec(select(Validation).where(Validation.checkpoint_id == ckpt.id)).all())
    records = [ValidationRecord(v.id or 0, v.passed, v.device) for v in rows]
    usable = usable_validation(policy, records)
    if usable is not None and model_factory is None:
        return next(v for v in rows if v.id == usable.id)
    here = "cuda" if _cuda_available() else "cpu"
    gate = device_gate(policy, [] if model_factory else records, here)
    if gate:
        raise GateNotMet(f"refusing to promote {source}: {gate}")
    device = policy.require_device if policy.require_device == "cuda" else "auto"
    result = validate(reg, source, device=resolve_device(device), model_factory=model_factory)
    if not result["passed"] or not satisfies_device(policy, result["device"]):
        failed = [f"{c['name']}: {c['detail']}" for c in result["checks"] if not c["passed"]]
        raise ValidationFailed(
            f"refusing to promote {source}: validation "
            f"{result['validation_id']} failed: {'; '.join(failed)}",
            f"reg show {source} and reg validate {source} --json for details",
        )
    with reg.catalog.session() as s:
        found = s.get(Validation, result["validation_id"])
        assert found is not None
        return found


def _cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def _reserve(
    reg: Registry,
    model: str,
    ckpt: Checkpoint,
    source: CheckpointRef,
    options_key: str,
    options: dict[str, Any],
    validation: Validation,
    dtype: str | None,
) -> tuple[int, int, str, int | None]:
    """A pending release row for this promotion: new (next version) or taken over."""
    token = uuid.uuid4().hex
    claim = {
        "claim_token": token,
        "claim_host": socket.gethostname(),
        "claim_pid": os.getpid(),
        "lease_until": now() + LEASE_SECONDS,
    }
    for _ in range(10):
        with reg.catalog.session(write=True) as s:
            m = s.exec(select(Model).where(Model.name == model)).first()
            if m is None:
                m = Model(name=model, created_at=now())
                try:
                    with s.begin_nested():
                        s.add(m)
                except DBIntegrityError:
                    continue
            pending = s.exec(
                select(Release).where(
                    Release.model_id == m.id,
                    Release.source_checkpoint_id == ckpt.id,
                    Release.options_key == options_key,
                    Release.status == RELEASE_PENDING,
                )
            ).first()
            if pending is not None:
                if not is_stale(pending.lease_until, pending.claim_host, pending.claim_pid):
                    raise Conflict(
                        f"{source} is being promoted to {model}:v{pending.version} by "
                        f"{pending.created_by} on {pending.claim_host} (pid {pending.claim_pid})",
                        "wait for it; a dead promotion's claim expires within "
                        f"{LEASE_SECONDS:.0f}s and a rerun continues it",
                    )
                taken = s.exec(
                    update(Release)
                    .where(
                        col(Release.id) == pending.id,
                        col(Release.claim_token) == pending.claim_token,
                    )
                    .values(**claim)
                )
                if taken.rowcount == 1:
                    # The rerun continues with the attempt's validation, so the files it
                    # already wrote (whose metadata names it) stay valid.
                    return pending.id or 0, pending.version, token, pending.validation_id
                continue
            top = s.exec(select(func.max(Release.version)).where(Release.model_id == m.id)).one()
            row = Release(
                model_id=m.id or 0,
                version=(top or 0) + 1,
                status=RELEASE_PENDING,
                source_checkpoint_id=ckpt.id or 0,
                source_ref=str(source),
                validation_id=validation.id,
                options_key=options_key,
                options=options,
                dtype=dtype,
                created_at=now(),
                created_by=reg.user,
                stage="reserved",
                claim_token=token,
                claim_host=socket.gethostname(),
                claim_pid=os.getpid(),
                lease_until=now() + LEASE_SECONDS,
            )
            try:
                with s.begin_nested():
                    s.add(row)
            except DBIntegrityError:
                continue  # another promotion took that version: allocate again
            s.flush()
            return row.id or 0, row.version, token, validation.id
    raise Conflict(
        f"could not allocate a version of {model}: too many concurrent promotions", "retry"
    )


def _renew(reg: Registry, release_id: int, token: str) -> None:
    with reg.catalog.session(write=True) as s:
        s.exec(
            update(Release)
            .where(col(Release.id) == release_id, col(Release.claim_token) == token)
            .values(lease_until=now() + LEASE_SECONDS)
        )


def _stage(reg: Registry, release_id: int, token: str, stage: str) -> None:
    with reg.catalog.session(write=True) as s:
        s.exec(
            update(Release)
            .where(col(Release.id) == release_id, col(Release.claim_token) == token)
            .values(stage=stage)
        )


def _build_and_commit(
    reg: Registry,
    source: CheckpointRef,
    ckpt: Checkpoint,
    model: str,
    version: int,
    release_id: int,
    token: str,
    options: dict[str, Any],
    extras: list[tuple[Path, str]],
    validation: Validation,
    alias: str | None,
    progress: Progress | None,
) -> dict[str, Any]:
    from registry.consolidate import consolidate, model_tensor_names

    name = f"{model}:v{version}"
    src_prefix = checkpoint_prefix(source.project, source.run, ckpt.step)
    dest = release_prefix(model, version)
    inv = inventory(load_metadata(reg.store.get_bytes(src_prefix + METADATA), light=True))
    resume = reg.classify_resume(inv.top_level_keys())
    names = model_tensor_names(inv, resume.model_keys, reg.policy.resume.model_key)
    if not names:
        raise GateNotMet(
            f"{source} holds no model tensors under "
            f"[resume] model_key = {reg.policy.resume.model_key!r}",
            "set model_key to where the checkpoint keeps the model",
        )
    tie_groups: list[list[str]] = next(
        (c["detail"] for c in validation.checks if c["name"] == "tied_weights"), []
    )
    lineage = {
        "format": "pt",
        "reg.release": name,
        "reg.source": str(source),
        "reg.validation_id": str(validation.id),
        "reg.manifest_sha256": ckpt.manifest_sha256 or "",
    }
    built = consolidate(
        reg.store,
        src_prefix,
        inv,
        names,
        dest,
        cast=options["dtype"],
        max_shard_bytes=options["max_shard_bytes"],
        metadata=lineage,
        tie_groups=tie_groups,
        progress=progress,
    )
    files = list(built.files)
    _stage(reg, release_id, token, "consolidated")
    for path, digest in extras:
        try:
            put = reg.store.put_file(dest + path.name, path, immutable=True)
            files.append({"path": path.name, "size": put.size, "sha256": put.sha256})
        except ObjectExists:
            if reg.store.sha256(dest + path.name) != digest:
                raise Conflict(
                    f"{dest}{path.name} exists with other content",
                    "the release prefix holds files from another promotion",
                ) from None
            files.append({"path": path.name, "size": path.stat().st_size, "sha256": digest})
    files.sort(key=lambda f: f["path"])
    with reg.catalog.session() as s:
        row = s.get(Release, release_id)
        assert row is not None
        created_at, created_by = row.created_at, row.created_by
    tied = built.tied
    document = {
        "format": RELEASE_FORMAT,
        "release": name,
        "model": model,
        "version": version,
        "files": files,
        "source": {
            "ref": str(source),
            "manifest_sha256": ckpt.manifest_sha256,
            "world_size": ckpt.world_size,
        },
        "validation": {
            "id": validation.id,
            "passed": validation.passed,
            "device": validation.device,
            "device_name": validation.device_name,
            "torch": validation.torch_version,
            "seconds": validation.seconds,
        },
        "dtype": options["dtype"],
        "tied": tied,
        "created_at": iso(created_at),
        "created_by": created_by,
    }
    data = json.dumps(document, indent=2, sort_keys=True).encode()
    try:
        reg.store.put_bytes(dest + RELEASE_JSON, data, immutable=True)
    except ObjectExists:
        if reg.store.get_bytes(dest + RELEASE_JSON) != data:
            raise Conflict(
                f"{dest}{RELEASE_JSON} exists with other content",
                "the release prefix holds files from another promotion",
            ) from None
    digest = hashlib.sha256(data).hexdigest()
    tensor_count = built.tensor_count
    with reg.catalog.session(write=True) as s:
        done = s.exec(
            update(Release)
            .where(
                col(Release.id) == release_id,
                col(Release.claim_token) == token,
                col(Release.status) == RELEASE_PENDING,
            )
            .values(
                status=ACTIVE,
                sha256=digest,
                bytes=sum(f["size"] for f in files) + len(data),
                tensor_count=tensor_count,
                tied=[[a, k] for a, k in sorted(tied.items())],
                stage="committed",
                claim_token=None,
                lease_until=None,
            )
        )
        if done.rowcount != 1:
            raise Conflict(
                f"lost the claim on {name} while promoting",
                "another process took the promotion over; check reg releases",
            )
        for f in files:
            s.add(
                ReleaseFile(
                    release_id=release_id, path=f["path"], size=f["size"], sha256=f["sha256"]
                )
            )
        m = s.exec(select(Model).where(Model.name == model)).one()
        release = s.get(Release, release_id)
        assert release is not None
        outbox.emit(
            s,
            outbox.RELEASE_CREATED,
            model=model,
            version=version,
            release=name,
            sha256=digest,
            uri=reg.store.describe(dest),
            source=str(source),
            project=source.project,
            run=source.run,
            step=source.step,
            validation_id=validation.id,
            validation_device=validation.device,
            validation_passed=validation.passed,
            files=len(files),
        )
        if alias is not None:
            move_alias(s, reg, m, alias, release)
        audit.record(
            s,
            reg.user,
            "promote",
            name,
            source=str(source),
            validation_id=validation.id,
            sha256=digest,
        )
        s.flush()
        out = view(s, m, release, reg.store.describe(dest))
    out["existing"] = False
    reg.after_commit()
    return out
