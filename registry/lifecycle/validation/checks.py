"""The checks of a restore validation, and their outcome (DESIGN §5): how shapes and finiteness
are reported, the model factory (its model matched on the meta device) and the probe.

No catalog, no store: the same functions run in the validating process and on the ranks of a
sharded restore.
"""

from __future__ import annotations

import importlib
import math
import os
import sys
from dataclasses import dataclass, field
from typing import Any

from policies.gates import ADVISORY_CHECKS
from registry.errors import UsageError
from registry.formats.dcp import Inventory, TensorInfo, cover_problem


@dataclass
class Check:
    name: str
    passed: bool
    detail: str

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "passed": self.passed, "detail": self.detail}


def counted(checks: list[dict[str, Any]]) -> bool:
    """A validation's `passed`: every check that counts passed."""
    return all(c["passed"] for c in checks if c["name"] not in ADVISORY_CHECKS)


@dataclass
class Outcome:
    checks: list[Check] = field(default_factory=list)
    phases: dict[str, float] = field(default_factory=dict)
    tied: list[list[str]] = field(default_factory=list)
    resume: dict[str, Any] = field(default_factory=dict)  # the resume verdict, as JSON
    names_path: str | None = None  # the key path the model's names are relative to
    mode: str | None = None  # streamed | sharded (modes.py)
    sharding: dict[str, Any] = field(default_factory=dict)  # parameter -> how it was sharded

    def add(self, name: str, passed: bool, detail: str) -> None:
        self.checks.append(Check(name, passed, detail))

    @property
    def passed(self) -> bool:
        return counted([c.as_dict() for c in self.checks])


@dataclass(frozen=True, slots=True)
class ModelCheck:
    """What the model and probe checks need besides the loaded tensors."""

    spec: str  # module:function
    names: dict[str, str]  # model state_dict name -> checkpoint FQN
    metrics: dict[str, float]  # recorded at push (probe_loss)
    probe_rtol: float


def coverage_problem(info: TensorInfo) -> str | None:
    """The chunks of a tensor must tile it exactly (see `cover_problem`)."""
    return cover_problem(info.fqn, info.shape, info.chunks)


def add_shapes(out: Outcome, wrong: list[str], count: int) -> None:
    out.add(
        "shapes",
        not wrong,
        f"{len(wrong)} mismatched, first: {wrong[0]}"
        if wrong
        else f"{count} tensors match the metadata and are exactly covered by their chunks",
    )


def add_finite(out: Outcome, bad: list[str]) -> None:
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
    """Names that share one storage (tied weights), in state_dict order. On the meta device
    (no storage) names that are one tensor object."""
    groups: dict[int, list[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if tensor.numel():
            key = id(tensor) if tensor.is_meta else tensor.data_ptr()
            groups.setdefault(key, []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def build_on_meta(job: ModelCheck, out: Outcome) -> Any | None:
    """The factory's model built on the meta device (no memory), or None with the model check
    failed."""
    import torch

    fn, _ = load_factory(job.spec)
    try:
        with torch.device("meta"):
            return fn()
    except Exception as exc:
        out.add(
            "model", False, f"{job.spec}() failed on the meta device: {type(exc).__name__}: {exc}"
        )
        return None


def check_model_meta(model: Any, inv: Inventory, job: ModelCheck, out: Outcome) -> bool:
    """Strict key, shape and dtype match of the factory's model (on meta) against the
    checkpoint's model tensors."""
    expected = model.state_dict()
    missing = [n for n in expected if n not in job.names]
    unexpected = [n for n in job.names if n not in expected]
    mismatch = _key_mismatch(missing, unexpected)
    if not mismatch:
        wrong = []
        for name, tensor in expected.items():
            info = inv.tensors.get(job.names[name])
            if info is None:
                wrong.append(f"{name} is not a tensor in the checkpoint")
            elif tuple(tensor.shape) != info.shape or str(tensor.dtype) != f"torch.{info.dtype}":
                wrong.append(
                    f"{name}: the model has {tuple(tensor.shape)} {str(tensor.dtype)[6:]}, the "
                    f"checkpoint {info.shape} {info.dtype}"
                )
        mismatch = "; ".join(wrong[:3]) + (f" and {len(wrong) - 3} more" if len(wrong) > 3 else "")
    if mismatch:
        out.add("model", False, f"{job.spec} does not match the checkpoint: {mismatch}")
        return False
    out.tied = tied_groups(model)
    out.add(
        "model",
        True,
        f"{len(expected)} tensors of {job.spec} match the checkpoint's names, shapes and dtypes"
        + (f"; tied: {', '.join('='.join(g) for g in out.tied)}" if out.tied else ""),
    )
    return True


def run_probe(model: Any, job: ModelCheck, out: Outcome) -> None:
    _, module = load_factory(job.spec)
    _check_probe(model, module, job, out)


def has_probe(job: ModelCheck) -> bool:
    _, module = load_factory(job.spec)
    return callable(getattr(module, "probe_loss", None))


def _key_mismatch(missing: list[str], unexpected: list[str]) -> str:
    def few(keys: list[str]) -> str:
        return ", ".join(keys[:5]) + (" ..." if len(keys) > 5 else "")

    parts = []
    if missing:
        parts.append(f"missing keys: {few(missing)}")
    if unexpected:
        parts.append(f"unexpected keys: {few(unexpected)}")
    return "; ".join(parts)


def _check_probe(model: Any, module: Any, job: ModelCheck, out: Outcome) -> None:
    probe = getattr(module, "probe_loss", None)
    if probe is None:
        out.add("probe", True, f"skipped: {module.__name__} defines no probe_loss(model)")
        return
    loss = float(probe(model))
    recorded = job.metrics.get("probe_loss")
    if recorded is None:
        out.add(
            "probe",
            False,
            f"probe loss {loss:.6g}, but no probe_loss metric was recorded "
            "at push (reg push-ckpt --metric probe_loss=...)",
        )
        return
    rtol = job.probe_rtol
    ok = math.isfinite(loss) and abs(loss - recorded) <= rtol * max(abs(recorded), 1e-12)
    out.add("probe", ok, f"probe loss {loss:.6g}, recorded {recorded:.6g} (rtol {rtol:g})")
