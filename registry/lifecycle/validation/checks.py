"""The checks of a restore validation over loaded tensors, and their outcome (DESIGN §5).

Pure over what was loaded: no catalog, no store. The same functions run in the validating
process (world size 1) and on rank 0 of a resharded restore.
"""

from __future__ import annotations

import importlib
import math
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from registry.errors import UsageError
from registry.formats.dcp import Inventory, TensorInfo, cover_problem


@dataclass
class Check:
    name: str
    passed: bool
    detail: str

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "passed": self.passed, "detail": self.detail}


# Checks reported but not counted toward `passed`: whether resume state is complete is the
# promotion gate's to decide, under the policy in force when it promotes.
ADVISORY = frozenset({"resume_state"})


def counted(checks: list[dict[str, Any]]) -> bool:
    """A validation's `passed`: every check that counts passed."""
    return all(c["passed"] for c in checks if c["name"] not in ADVISORY)


@dataclass
class Outcome:
    checks: list[Check] = field(default_factory=list)
    phases: dict[str, float] = field(default_factory=dict)
    tied: list[list[str]] = field(default_factory=list)
    resume: dict[str, Any] = field(default_factory=dict)  # the resume verdict, as JSON
    names_path: str | None = None  # the key path the model's names are relative to

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


def shape_problems(state: Mapping[str, Any], inv: Inventory) -> list[str]:
    """Loaded (global) shapes and dtypes against the metadata, and chunk coverage."""
    wrong = []
    for fqn, t in inv.tensors.items():
        tensor = state.get(fqn)
        problem = coverage_problem(t)
        if problem is not None:
            wrong.append(problem)
        elif tensor is None or not hasattr(tensor, "shape"):
            wrong.append(f"{fqn} was not loaded")
        elif tuple(tensor.shape) != t.shape or str(tensor.dtype) != f"torch.{t.dtype}":
            wrong.append(
                f"{fqn} loaded as {tuple(tensor.shape)} {tensor.dtype}, metadata says "
                f"{t.shape} {t.dtype}"
            )
    return wrong


def nonfinite(fqn: str, tensor: Any) -> str | None:
    import torch

    if not (tensor.is_floating_point() or tensor.is_complex()):
        return None
    finite = torch.isfinite(tensor)
    if bool(finite.all()):
        return None
    n = int((~finite).sum())
    kind = "NaN" if bool(torch.isnan(tensor).any()) else "Inf"
    return f"{fqn} ({n} non-finite, {kind})"


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


def check_tensors(state: Mapping[str, Any], inv: Inventory, out: Outcome) -> None:
    add_shapes(out, shape_problems(state, inv), len(inv.tensors))
    bad = [b for fqn in sorted(inv.tensors) if (b := nonfinite(fqn, state[fqn])) is not None]
    add_finite(out, bad)


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


def check_model(weights: Mapping[str, Any], device: str, job: ModelCheck, out: Outcome) -> None:
    """Strict load of `weights` (model names -> tensors) into the factory's model, then the
    probe: its loss must match the `probe_loss` recorded at push within `probe_rtol`."""
    fn, module = load_factory(job.spec)
    try:
        model = fn()
        model.to(device)
    except Exception as exc:
        out.add("model", False, f"{job.spec}() failed: {type(exc).__name__}: {exc}")
        return
    try:
        result = model.load_state_dict(dict(weights), strict=False)
    except RuntimeError as exc:  # size mismatches are raised even when strict=False
        lines = [ln.strip() for ln in str(exc).splitlines() if "size mismatch" in ln]
        out.add(
            "model",
            False,
            f"{job.spec} does not match the checkpoint: "
            + ("; ".join(lines[:3]) or str(exc).splitlines()[0]),
        )
        return
    mismatch = _key_mismatch(list(result.missing_keys), list(result.unexpected_keys))
    if mismatch:
        out.add("model", False, f"{job.spec} does not match the checkpoint: {mismatch}")
        return
    out.tied = tied_groups(model)
    out.add(
        "model",
        True,
        f"strict load of {len(weights)} tensors into {job.spec}"
        + (f"; tied: {', '.join('='.join(g) for g in out.tied)}" if out.tied else ""),
    )
    _check_probe(model, module, job, out)


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
