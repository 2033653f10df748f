"""The two ways a validation restores a checkpoint, each recorded as its mode.

  streamed  world size 1: one verified pass, every chunk checked in bounded batches
            (streamed.py); with a model factory, a strict key, shape and dtype match against its
            model built on the meta device, and the probe when the model fits the budget
  sharded   world size M: the same pass, then M ranks restore the model (and optimizer) as
            training shards it, through the factory module's `parallelize(model, mesh)` and
            `build_optimizer(model)`, and run the probe on the sharded model (sharded.py)

Validations recorded before modes existed read as `whole` (every tensor at once) or
`resharded` (Shard(0) placements guessed); policies/default.toml says which modes a promotion
accepts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from policies.loader import VALIDATION_MODES
from registry.core.timeutil import human_bytes
from registry.formats.dcp import Inventory
from registry.lifecycle.validation.batches import OutOfDeviceMemory, Target
from registry.lifecycle.validation.budget import Budget, out_of_memory
from registry.lifecycle.validation.checks import (
    ModelCheck,
    Outcome,
    add_finite,
    add_shapes,
    build_on_meta,
    check_model_meta,
    coverage_problem,
    has_probe,
    load_factory,
    run_probe,
)
from registry.lifecycle.validation.streamed import StreamPass, model_bytes

if TYPE_CHECKING:
    from registry.core.progress import Progress
    from registry.formats.documents import FileRecord
    from registry.storage.base import BaseStore

STREAMED, SHARDED = "streamed", "sharded"
MODES = VALIDATION_MODES


def run_streamed(
    store: BaseStore,
    prefix: str,
    files: list[FileRecord],
    inv: Inventory,
    device: str,
    budget: Budget,
    model: ModelCheck | None,
    out: Outcome,
    *,
    label: str,
    workers: int,
    progress: Progress | None,
    probe: bool = True,
    expected: dict[str, list[tuple[int, bytes]]] | None = None,
) -> bool:
    """The one pass and its checks into `out`; whether the tensors passed (integrity, restore,
    shapes, finite). With `probe` False the model is matched on meta only. `expected`: bytes
    read before the pass (path -> offset, bytes) that it must find unchanged (deferred.py)."""

    out.mode = STREAMED
    out.phases["memory_budget_mib"] = round(budget.total / 2**20, 1)
    held = None
    if model is not None:
        meta = build_on_meta(model, out)
        if meta is not None and check_model_meta(meta, inv, model, out) and probe:
            held = _model_for_probe(model, inv, device, budget, out)
    targets = {}
    if held is not None:
        state = held.state_dict()
        targets = {fqn: Target(state[name]) for name, fqn in model.names.items()}  # type: ignore[union-attr]
    try:
        streamed = StreamPass(
            store,
            prefix,
            files,
            inv,
            device,
            budget,
            label=label,
            workers=workers,
            targets=targets,
            expected=expected,
        )
    except OutOfDeviceMemory as exc:
        out.add("integrity", False, "not checked: the device batches did not fit")
        out.add("restore", False, out_of_memory(device, budget, exc))
        return False
    result = streamed.run(progress)  # its clock is read after the device synchronized
    out.phases["restore_seconds"] = round(result.seconds, 3)
    if result.integrity:
        out.add("integrity", False, "; ".join(result.integrity[:3]))
        return False
    if result.files != len(files):  # the pass stopped early (out of memory)
        out.add("integrity", False, f"not finished: {result.files} of {len(files)} files read")
        out.add("restore", False, result.restore[0] if result.restore else "the pass stopped")
        return False
    chunks = sum(len(t.chunks) for t in inv.tensors.values()) + sum(
        len(c) for c in inv.byte_items.values()
    )
    out.add(
        "integrity",
        True,
        f"{len(files)} files, sha256 verified in the restore's one pass; {chunks} chunks in range",
    )
    if result.restore:
        more = f" and {len(result.restore) - 1} more" if len(result.restore) > 1 else ""
        out.add("restore", False, result.restore[0] + more)
        return False
    if result.chunks != chunks:
        out.add("restore", False, f"{chunks - result.chunks} of {chunks} chunks were not loaded")
        return False
    out.add(
        "restore",
        True,
        f"{len(inv.tensors)} tensors ({human_bytes(inv.tensor_bytes)}) and {len(inv.byte_items)} "
        f"objects loaded on {device} in batches within --memory-budget {budget.describe()} "
        f"in {result.seconds:.2f}s",
    )
    shapes = result.shapes + [p for t in inv.tensors.values() if (p := coverage_problem(t))]
    add_shapes(out, shapes, len(inv.tensors))
    bad = [
        f"{fqn} ({n} non-finite, {'NaN' if nan else 'Inf'})"
        for fqn, (n, nan) in sorted(result.nonfinite.items())
    ]
    add_finite(out, bad)
    if held is not None and model is not None and out.passed:
        run_probe(held, model, out)
    return out.passed


def _model_for_probe(
    job: ModelCheck, inv: Inventory, device: str, budget: Budget, out: Outcome
) -> Any | None:
    """The factory's model on the device, to be filled by the pass, when a probe is defined
    and the model fits half the budget; else the probe check says why it did not run."""
    import torch

    if not has_probe(job):
        _, module = load_factory(job.spec)
        out.add("probe", True, f"skipped: {module.__name__} defines no probe_loss(model)")
        return None
    need = model_bytes(inv, job.names)
    if need > budget.model:
        out.add(
            "probe",
            True,
            f"skipped: the model's {human_bytes(need)} do not fit half of --memory-budget "
            f"{human_bytes(budget.total)}: give --memory-budget {human_bytes(2 * need + 2**26)} or "
            "validate sharded (--world-size M)",
        )
        return None
    fn, _ = load_factory(job.spec)
    try:
        return fn().to(device)
    except torch.cuda.OutOfMemoryError as exc:
        out.add("probe", False, out_of_memory(device, budget, exc))
    except Exception as exc:
        out.add("probe", False, f"{job.spec}() failed: {type(exc).__name__}: {exc}")
    return None
