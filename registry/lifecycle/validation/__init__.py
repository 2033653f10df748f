"""Restore validation: prove a checkpoint restores, on the device that matters (DESIGN §5).

Run the checks -> an Outcome -> record it (a Validation row, audit, an event). The checks, each
recorded with its detail:
  integrity     every stored file's size and sha256; every metadata chunk inside its file
  restore       every tensor and object loaded through DCP onto the device, resharded to the
                validation world size (1 by default), with a reader that never unpickles unsafely
  shapes        loaded shapes and dtypes match the metadata; chunks cover each tensor exactly
  finite        every floating tensor is free of NaN and Inf (the first offender is named)
  resume_state  the resume-state classes the policy requires are present
  model         with a model factory: strict load_state_dict of the model tensors
  probe         with a model factory that defines probe_loss(model): the loss matches the
                `probe_loss` metric recorded at push within [promotion] probe_rtol

The restore phase's wall time is the measured restore time (RTO input); integrity hashing and
the checks are timed separately.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from policies.resume import classify
from registry import audit, events
from registry.catalog.leases import hold
from registry.catalog.models import Checkpoint, Validation
from registry.errors import RegistryError, UsageError
from registry.formats.dcp import METADATA, check_ranges, inventory
from registry.formats.dcp_metadata import load_metadata
from registry.layout import checkpoint_prefix
from registry.lifecycle.checkpoints.read import resolve
from registry.lifecycle.validation.checks import ModelCheck, Outcome, load_factory
from registry.lifecycle.validation.restore import (
    device_name,
    resolve_device,
    restore_distributed,
    restore_here,
)
from registry.refs import CheckpointRef
from registry.timeutil import iso, now
from registry.transfer import verify_stored

if TYPE_CHECKING:
    from registry.context import Context
    from registry.formats.documents import FileRecord
    from registry.progress import Progress


def validate(
    ctx: Context,
    ref: CheckpointRef,
    *,
    device: str = "auto",
    world_size: int = 1,
    model_factory: str | None = None,
    progress: Progress | None = None,
) -> dict[str, Any]:
    ctx.authorize("validate", project=ref.project, target=str(ref))
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise UsageError(f"--world-size must be a whole number >= 1, got {world_size!r}")
    dev = resolve_device(device)
    if model_factory is not None:
        load_factory(model_factory)  # a bad spec is a usage error before any work
    _, ckpt, files = resolve(ctx, ref)
    full = CheckpointRef(ref.project, ref.run, ckpt.step)
    with hold(ctx.catalog, ctx.actor, ckpt.id or 0, f"validate {full}"):
        out = _run_checks(ctx, full, ckpt, files, dev, world_size, model_factory, progress)
    return _record(ctx, full, ckpt, out, dev, world_size)


def _run_checks(
    ctx: Context,
    ref: CheckpointRef,
    ckpt: Checkpoint,
    files: list[FileRecord],
    device: str,
    world_size: int,
    model_factory: str | None,
    progress: Progress | None,
) -> Outcome:
    out = Outcome()
    prefix = checkpoint_prefix(ref.project, ref.run, ckpt.step)
    started = time.perf_counter()
    problems = verify_stored(
        ctx.store,
        prefix,
        files,
        label=f"verify {ref}",
        workers=ctx.workers,
        progress=progress,
        recorded_versions=True,
    )
    versions = {f.path: f.version for f in files if f.version}
    metadata = inv = None
    if problems:
        out.add("integrity", False, "; ".join(f"{p.path}: {p.problem}" for p in problems))
    else:
        metadata = load_metadata(
            ctx.store.get_bytes(prefix + METADATA, version=versions.get(METADATA))
        )
        inv = inventory(metadata)
        try:
            check_ranges(inv, {f.path: f.size for f in files}, str(ref))
            chunks = sum(len(t.chunks) for t in inv.tensors.values())
            out.add(
                "integrity", True, f"{len(files)} files, sha256 verified; {chunks} chunks in range"
            )
        except RegistryError as exc:
            out.add("integrity", False, str(exc))
    out.phases["integrity_seconds"] = round(time.perf_counter() - started, 3)

    resume = classify(inv.top_level_keys() if inv else set(), ctx.policy.resume)
    if out.passed and metadata is not None and inv is not None:
        model = None
        if model_factory is not None:
            model = ModelCheck(
                spec=model_factory,
                names=inv.model_names(resume.model_keys, ctx.policy.resume.model_key),
                metrics=dict(ckpt.metrics),
                probe_rtol=ctx.policy.promotion.probe_rtol,
            )
        if world_size == 1:
            restore_here(ctx.store, prefix, versions, metadata, inv, device, model, out)
        else:
            restore_distributed(ctx.store, prefix, versions, inv, device, world_size, model, out)
    out.add(
        "resume_state",
        resume.resumable,
        "complete: " + ", ".join(sorted(resume.classes))
        if resume.resumable
        else f"missing {', '.join(resume.missing)}",
    )
    return out


def _record(
    ctx: Context, ref: CheckpointRef, ckpt: Checkpoint, out: Outcome, device: str, world_size: int
) -> dict[str, Any]:
    import torch

    seconds = out.phases.get("restore_seconds", 0.0)
    checks = [c.as_dict() for c in out.checks]
    with ctx.catalog.session(write=True) as s:
        row = Validation(
            checkpoint_id=ckpt.id or 0,
            passed=out.passed,
            device=device,
            device_name=device_name(device),
            torch_version=torch.__version__,
            world_size=world_size,
            seconds=seconds,
            phases=out.phases,
            checks=checks
            + ([{"name": "tied_weights", "passed": True, "detail": out.tied}] if out.tied else []),
            created_at=now(),
            created_by=ctx.actor,
        )
        s.add(row)
        s.flush()
        outcome = audit.ALLOWED if out.passed else audit.FAILED
        audit.record(
            s, ctx.actor, "validate", str(ref), outcome, device=device, validation_id=row.id
        )
        ctx.events.emit(
            s,
            events.CHECKPOINT_VALIDATED,
            project=ref.project,
            run=ref.run,
            step=ref.step,
            ref=str(ref),
            passed=out.passed,
            device=device,
            device_name=row.device_name,
            validation_id=row.id,
            seconds=seconds,
        )
        validation_id = row.id
    return {
        "ref": str(ref),
        "passed": out.passed,
        "device": device,
        "device_name": row.device_name,
        "seconds": seconds,
        "world_size": world_size,
        "torch_version": torch.__version__,
        "phases": out.phases,
        "checks": checks,
        "validation_id": validation_id,
        "created_at": iso(row.created_at),
    }
