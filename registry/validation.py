"""Restore validation: prove a checkpoint restores, on the device that matters (DESIGN §5).

Checks, each recorded with its detail:
  integrity     every stored file's size and sha256; every metadata chunk inside its file
  restore       every tensor and object loaded through DCP onto the device, resharded to the
                validation world size (1 by default), with a reader that never unpickles unsafely
  shapes        loaded shapes and dtypes match the metadata
  finite        every floating tensor is free of NaN and Inf (the first offender is named)
  resume_state  the resume-state classes the policy requires are present
  model         with a model factory: strict load_state_dict of the model tensors
  probe         with a model factory that defines probe_loss(model): the loss matches the
                `probe_loss` metric recorded at push within [promotion] probe_rtol

The restore phase's wall time is the measured restore time (RTO input); integrity hashing and
the checks are timed separately.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import socket
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from registry import audit, outbox
from registry.catalog.models import Validation
from registry.checkpoints import check_stored_files, checkpoint_prefix, resolve
from registry.consolidate import model_tensor_names
from registry.errors import RegistryError, UsageError
from registry.formats.dcp import METADATA, Inventory, check_ranges, inventory, load_metadata
from registry.holds import hold
from registry.refs import CheckpointRef
from registry.timeutil import iso, now

if TYPE_CHECKING:
    from registry.api import Registry
    from registry.progress import Progress


@dataclass
class Check:
    name: str
    passed: bool
    detail: str

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "passed": self.passed, "detail": self.detail}


@dataclass
class Outcome:
    checks: list[Check] = field(default_factory=list)
    phases: dict[str, float] = field(default_factory=dict)
    tied: list[list[str]] = field(default_factory=list)

    def add(self, name: str, passed: bool, detail: str) -> None:
        self.checks.append(Check(name, passed, detail))

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError(
            f"--device cuda: no CUDA device here (torch {torch.__version__}, "
            f"built with CUDA {torch.version.cuda or 'none'})",
            "run this validation on a GPU node, or use --device cpu where the policy allows",
        )
    if device not in ("cuda", "cpu"):
        raise UsageError(f"unknown device {device!r}", "use cuda, cpu or auto")
    return device


def device_name(device: str) -> str:
    import platform

    import torch

    if device == "cuda":
        return str(torch.cuda.get_device_name(0))
    return platform.processor() or platform.machine() or "cpu"


def validate(
    reg: Registry,
    ref: CheckpointRef,
    *,
    device: str = "auto",
    world_size: int = 1,
    model_factory: str | None = None,
    progress: Progress | None = None,
) -> dict[str, Any]:
    reg.authorize("validate", project=ref.project, target=str(ref))
    if world_size < 1:
        raise UsageError(f"--world-size must be >= 1, got {world_size}")
    dev = resolve_device(device)
    _, ckpt, files = resolve(reg, ref)
    full = CheckpointRef(ref.project, ref.run, ckpt.step)
    prefix = checkpoint_prefix(ref.project, ref.run, ckpt.step)
    out = Outcome()
    import torch

    with hold(reg, ckpt.id or 0, f"validate {full}"):
        started = time.perf_counter()
        problems = check_stored_files(
            reg, prefix, [(f.path, f.size, f.sha256) for f in files], progress, f"verify {full}"
        )
        metadata = inv = None
        if problems:
            out.add("integrity", False, "; ".join(f"{p['path']}: {p['problem']}" for p in problems))
        else:
            metadata = load_metadata(reg.store.get_bytes(prefix + METADATA))
            inv = inventory(metadata)
            try:
                check_ranges(inv, {f.path: f.size for f in files}, str(full))
                out.add(
                    "integrity",
                    True,
                    f"{len(files)} files, sha256 verified; "
                    f"{sum(len(t.chunks) for t in inv.tensors.values())} chunks in range",
                )
            except RegistryError as exc:
                out.add("integrity", False, str(exc))
        out.phases["integrity_seconds"] = round(time.perf_counter() - started, 3)

        if out.passed and metadata is not None and inv is not None:
            if world_size == 1:
                _restore_here(reg, prefix, metadata, inv, dev, ckpt.metrics, model_factory, out)
            else:
                _restore_distributed(reg, prefix, inv, dev, world_size, out)
        resume = reg.classify_resume(inv.top_level_keys() if inv else set())
        out.add(
            "resume_state",
            resume.resumable,
            "complete: " + ", ".join(sorted(resume.classes))
            if resume.resumable
            else f"missing {', '.join(resume.missing)}",
        )

    seconds = out.phases.get("restore_seconds", 0.0)
    with reg.catalog.session(write=True) as s:
        row = Validation(
            checkpoint_id=ckpt.id or 0,
            passed=out.passed,
            device=dev,
            device_name=device_name(dev),
            torch_version=torch.__version__,
            world_size=world_size,
            seconds=seconds,
            phases=out.phases,
            checks=[c.as_dict() for c in out.checks]
            + ([{"name": "tied_weights", "passed": True, "detail": out.tied}] if out.tied else []),
            created_at=now(),
            created_by=reg.user,
        )
        s.add(row)
        s.flush()
        audit.record(
            s,
            reg.user,
            "validate",
            str(full),
            audit.ALLOWED if out.passed else audit.FAILED,
            device=dev,
            validation_id=row.id,
        )
        outbox.emit(
            s,
            outbox.CHECKPOINT_VALIDATED,
            project=full.project,
            run=full.run,
            step=full.step,
            ref=str(full),
            passed=out.passed,
            device=dev,
            device_name=device_name(dev),
            validation_id=row.id,
            seconds=seconds,
        )
        validation_id = row.id
    reg.after_commit()
    return {
        "ref": str(full),
        "passed": out.passed,
        "device": dev,
        "device_name": device_name(dev),
        "seconds": seconds,
        "world_size": world_size,
        "torch_version": torch.__version__,
        "phases": out.phases,
        "checks": [c.as_dict() for c in out.checks],
        "validation_id": validation_id,
        "created_at": iso(now()),
    }


def _template(inv: Inventory, device: str) -> dict[str, Any]:
    import torch

    state: dict[str, Any] = {}
    for fqn, t in inv.tensors.items():
        state[fqn] = torch.empty(t.shape, dtype=getattr(torch, t.dtype), device=device)
    for fqn in inv.byte_items:
        state[fqn] = None
    return state


def _restore_here(
    reg: Registry,
    prefix: str,
    metadata: Any,
    inv: Inventory,
    device: str,
    metrics: dict[str, float],
    model_factory: str | None,
    out: Outcome,
) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    from registry.formats.dcp_load import SafeLoadPlanner, StoreReader

    state = _template(inv, device)
    started = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process"
            dcp.load(
                state,
                storage_reader=StoreReader(reg.store, prefix, metadata),
                planner=SafeLoadPlanner(),
            )
        if device == "cuda":
            torch.cuda.synchronize()
    except RegistryError as exc:
        out.add("restore", False, str(exc))
        return
    except Exception as exc:  # DCP's own errors (planner, shapes) name what went wrong
        out.add("restore", False, f"{type(exc).__name__}: {str(exc).strip().splitlines()[0]}")
        return
    out.phases["restore_seconds"] = round(time.perf_counter() - started, 3)
    out.add(
        "restore",
        True,
        f"{len(inv.tensors)} tensors and {len(inv.byte_items)} objects "
        f"loaded on {device} at world size 1 in {out.phases['restore_seconds']:.2f}s",
    )
    started = time.perf_counter()
    _check_tensors(state, inv, out)
    _check_model(reg, state, inv, device, metrics, model_factory, out)
    out.phases["checks_seconds"] = round(time.perf_counter() - started, 3)


def _check_tensors(state: dict[str, Any], inv: Inventory, out: Outcome) -> None:
    import torch

    wrong = [
        f
        for f, t in inv.tensors.items()
        if tuple(state[f].shape) != t.shape or str(state[f].dtype) != f"torch.{t.dtype}"
    ]
    out.add(
        "shapes",
        not wrong,
        f"{len(wrong)} mismatched, first {wrong[0]}"
        if wrong
        else f"{len(inv.tensors)} tensors match the metadata",
    )
    bad: list[str] = []
    for fqn in sorted(inv.tensors):
        tensor = state[fqn]
        if tensor.is_floating_point() or tensor.is_complex():
            finite = torch.isfinite(tensor)
            if not bool(finite.all()):
                n = int((~finite).sum())
                kind = "NaN" if bool(torch.isnan(tensor).any()) else "Inf"
                bad.append(f"{fqn} ({n} non-finite, {kind})")
    out.add(
        "finite",
        not bad,
        f"first non-finite tensor: {bad[0]}" + (f" and {len(bad) - 1} more" if len(bad) > 1 else "")
        if bad
        else "every floating tensor is finite",
    )


def load_factory(spec: str) -> tuple[Any, Any]:
    """`module:function` -> (function, module). The working directory is importable, as with
    `python -m`."""
    module_name, sep, function = spec.partition(":")
    if not sep or not module_name or not function:
        raise UsageError(f"bad --model-factory {spec!r}", "write module:function")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise UsageError(
            f"--model-factory {spec}: cannot import {module_name}: {type(exc).__name__}: {exc}",
            "check the module path (run from the directory that contains it)",
        ) from exc
    fn = getattr(module, function, None)
    if not callable(fn):
        raise UsageError(f"--model-factory {spec}: {module_name} has no function {function}")
    return fn, module


def tied_groups(model: Any) -> list[list[str]]:
    """Names that share one storage (tied weights), in state_dict order."""
    groups: dict[int, list[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if tensor.numel():
            groups.setdefault(tensor.data_ptr(), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def _check_model(
    reg: Registry,
    state: dict[str, Any],
    inv: Inventory,
    device: str,
    metrics: dict[str, float],
    spec: str | None,
    out: Outcome,
) -> None:
    if spec is None:
        return
    resume = reg.classify_resume(inv.top_level_keys())
    names = model_tensor_names(inv, resume.model_keys, reg.policy.resume.model_key)
    fn, module = load_factory(spec)
    try:
        model = fn()
        model.to(device)
    except Exception as exc:
        out.add("model", False, f"{spec}() failed: {type(exc).__name__}: {exc}")
        return
    weights = {name: state[fqn] for name, fqn in names.items()}
    try:
        result = model.load_state_dict(weights, strict=False)
    except RuntimeError as exc:  # size mismatches are raised even when strict=False
        lines = [ln.strip() for ln in str(exc).splitlines() if "size mismatch" in ln]
        out.add(
            "model",
            False,
            f"{spec} does not match the checkpoint: "
            + ("; ".join(lines[:3]) or str(exc).splitlines()[0]),
        )
        return
    missing, unexpected = list(result.missing_keys), list(result.unexpected_keys)
    if missing or unexpected:
        detail = "; ".join(
            part
            for part in (
                f"missing keys: {', '.join(missing[:5])}" + (" ..." if len(missing) > 5 else "")
                if missing
                else "",
                f"unexpected keys: {', '.join(unexpected[:5])}"
                + (" ..." if len(unexpected) > 5 else "")
                if unexpected
                else "",
            )
            if part
        )
        out.add("model", False, f"{spec} does not match the checkpoint: {detail}")
        return
    out.tied = tied_groups(model)
    out.add(
        "model",
        True,
        f"strict load of {len(weights)} tensors into {spec}"
        + (f"; tied: {', '.join('='.join(g) for g in out.tied)}" if out.tied else ""),
    )
    probe = getattr(module, "probe_loss", None)
    if probe is None:
        out.add("probe", True, f"skipped: {module.__name__} defines no probe_loss(model)")
        return
    loss = float(probe(model))
    recorded = metrics.get("probe_loss")
    if recorded is None:
        out.add(
            "probe",
            False,
            f"probe loss {loss:.6g}, but no probe_loss metric was recorded "
            "at push (reg push-ckpt --metric probe_loss=...)",
        )
        return
    rtol = reg.policy.promotion.probe_rtol
    ok = math.isfinite(loss) and abs(loss - recorded) <= rtol * max(abs(recorded), 1e-12)
    out.add("probe", ok, f"probe loss {loss:.6g}, recorded {recorded:.6g} (rtol {rtol:g})")


# -- validation at world size M > 1 -------------------------------------------------------------


def _restore_distributed(
    reg: Registry, prefix: str, inv: Inventory, device: str, world_size: int, out: Outcome
) -> None:
    """Reshard onto M ranks (spawned processes, gloo or NCCL), each loading its Shard(0) slice."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="reg-validate-") as tmp:
        port = _free_port()
        try:
            mp.spawn(
                _rank_main,
                args=(world_size, port, device, reg.settings.store_url, prefix, tmp),
                nprocs=world_size,
                join=True,
            )
        except Exception as exc:
            out.add(
                "restore",
                False,
                f"restore at world size {world_size} failed: {str(exc).strip().splitlines()[-1]}",
            )
            return
        results = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world_size)]
    out.phases["restore_seconds"] = round(max(r["seconds"] for r in results), 3)
    errors = [r["error"] for r in results if r.get("error")]
    if errors:
        out.add("restore", False, errors[0])
        return
    out.add(
        "restore",
        True,
        f"{len(inv.tensors)} tensors resharded onto {world_size} ranks "
        f"({device}) in {out.phases['restore_seconds']:.2f}s",
    )
    bad = sorted({b for r in results for b in r["nonfinite"]})
    out.add("shapes", True, f"{len(inv.tensors)} tensors match the metadata")
    out.add(
        "finite",
        not bad,
        f"first non-finite tensor: {bad[0]}" if bad else "every floating tensor is finite",
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(
    rank: int, world: int, port: int, device: str, store_url: str, prefix: str, tmp: str
) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from registry.formats.dcp_load import SafeLoadPlanner, StoreReader
    from registry.storage import open_store

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    result: dict[str, Any] = {"seconds": 0.0, "nonfinite": []}
    try:
        if device == "cuda":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=rank, world_size=world)
        mesh = init_device_mesh(device, (world,))
        store = open_store(store_url)
        metadata = load_metadata(store.get_bytes(prefix + METADATA))
        inv = inventory(metadata)
        state: dict[str, Any] = {}
        for fqn, t in inv.tensors.items():
            placement = Shard(0) if t.shape and t.shape[0] >= world else Replicate()
            empty = torch.empty(t.shape, dtype=getattr(torch, t.dtype), device=device)
            state[fqn] = distribute_tensor(empty, mesh, [placement])
        for fqn in inv.byte_items:
            state[fqn] = None
        dist.barrier()
        started = time.perf_counter()
        dcp.load(
            state, storage_reader=StoreReader(store, prefix, metadata), planner=SafeLoadPlanner()
        )
        result["seconds"] = time.perf_counter() - started
        for fqn in sorted(inv.tensors):
            local = state[fqn].to_local()
            if local.is_floating_point() and not bool(torch.isfinite(local).all()):
                result["nonfinite"].append(fqn)
        dist.barrier()
        dist.destroy_process_group()
    except Exception as exc:
        result["error"] = f"rank {rank}: {type(exc).__name__}: {str(exc).strip()[:300]}"
    Path(tmp, f"rank{rank}.json").write_text(json.dumps(result))
