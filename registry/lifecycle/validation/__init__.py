"""Restore validation: prove a checkpoint restores, on the device that matters (DESIGN §5).

Run the checks -> an Outcome -> record it (a Validation row, audit, an event). The checks, each
recorded with its detail:
  integrity     every stored file's size and sha256, hashed in the same single pass that loads
                it (storage/verified_stream.py); every metadata chunk inside its file
  restore       every tensor chunk and object loaded onto the device in batches within
                `--memory-budget` (modes.py, streamed.py), never unpickling unsafely
  shapes        loaded shapes and dtypes match the metadata; chunks cover each tensor exactly
  finite        every floating tensor is free of NaN and Inf (the offenders are named)
  resume_state  the resume-state classes the layout or policy requires are present (reported,
                not counted toward `passed`: the promotion gate decides it under its policy)
  model         with a model factory: a strict key, shape and dtype match of its model, built
                on the meta device, against the checkpoint's model tensors
  probe         with a factory module that defines probe_loss(model): the loss matches the
                `probe_loss` metric recorded at push within [promotion] probe_rtol (at world size
                1 when the model fits half the budget; sharded, on the sharded model)
  restore_sharded, sharding   at --world-size M: the model (and optimizer) restored as the
                factory's parallelize(model, mesh) shards it, every parameter a DTensor

Each validation records its mode (streamed or sharded), the device's name and driver. The pass's
wall time is the measured restore time (RTO input).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, TypeGuard

from policies.access import Action
from policies.layouts import check_layout, known_layout
from policies.resume import check_strip_prefix, names_path, suggest
from registry.catalog.leases import hold
from registry.catalog.models import Checkpoint, Validation
from registry.core.layout import checkpoint_prefix
from registry.core.refs import CheckpointRef
from registry.core.timeutil import iso, now
from registry.errors import IntegrityError, NotFound, RegistryError, UsageError
from registry.formats.dcp import check_ranges, inventory
from registry.formats.dcp_roots import stored_metadata
from registry.journal import outbox as events
from registry.journal.event import VALIDATION
from registry.journal.write import record as journal_record
from registry.lifecycle.checkpoints.read import resolve
from registry.lifecycle.checkpoints.resume_facts import facts_of, facts_of_checkpoint, verdict
from registry.lifecycle.validation.budget import choose as choose_budget
from registry.lifecycle.validation.checks import ModelCheck, Outcome, counted, load_factory
from registry.lifecycle.validation.deferred import DeferredReads
from registry.lifecycle.validation.modes import MODES, SHARDED, run_streamed
from registry.lifecycle.validation.restore import device_name, driver_version, resolve_device
from registry.lifecycle.validation.sharded import ShardedJob, require_hooks, run_sharded
from registry.text import inert
from registry.trust.signed_facts import validation_fact

if TYPE_CHECKING:
    from policies.loader import Policy
    from registry.core.progress import Progress
    from registry.formats.documents import FileRecord
    from registry.lifecycle.context import Context
    from registry.storage.base import BaseStore


@dataclass(frozen=True, slots=True)
class Request:
    """What a validation was asked to do (the CLI's options)."""

    device: str = "auto"
    world_size: int = 1
    model_factory: str | None = None
    layout: str | None = None
    strip_prefix: str | None = None
    memory_budget: str | None = None  # a size; None: the device's default
    with_optimizer: bool = False

    def checked(self) -> Request:
        """Every option checked before any work (usage errors, exit 2); the device resolved."""
        check_world_size(self.world_size)
        check_layout(self.layout)
        strip = check_strip_prefix(self.strip_prefix)
        device = resolve_device(self.device)
        if self.model_factory is not None:
            load_factory(self.model_factory)  # a bad spec is a usage error before any work
        if self.world_size > 1 or self.with_optimizer:
            if self.model_factory is None:
                raise UsageError(
                    f"--world-size {self.world_size}"
                    + (" --with-optimizer" if self.with_optimizer else "")
                    + " needs --model-factory: the factory's module says how training shards "
                    "the model (parallelize(model, mesh))",
                    "give --model-factory module:function, or validate at --world-size 1",
                )
            require_hooks(self.model_factory, self.world_size, self.with_optimizer)
        choose_budget(self.memory_budget, device)  # a bad size is refused here too
        return Request(
            device,
            self.world_size,
            self.model_factory,
            self.layout,
            strip,
            self.memory_budget,
            self.with_optimizer,
        )


def validate(
    ctx: Context,
    ref: CheckpointRef,
    request: Request,
    *,
    progress: Progress | None = None,
) -> dict[str, Any]:
    ctx.authorize(Action.VALIDATE, project=ref.project, target=str(ref))
    request = request.checked()
    if request.world_size > 1 and ctx.store.url.startswith("memory://"):
        raise UsageError(
            "a memory store cannot be shared with validation ranks in other processes",
            "validate at world size 1, or use a file:// or s3:// store",
        )
    _, ckpt, files = resolve(ctx, ref)
    full = CheckpointRef(ref.project, ref.run, ckpt.step)
    facts = facts_of_checkpoint(ctx, full, ckpt, files, record=True)
    recorded = known_layout(facts.layout)
    if request.strip_prefix:  # every model key has the prefix (else UsageError), before any work
        verdict(facts, ctx.policy.resume, request.layout).model_names(
            facts.keys, request.strip_prefix
        )
    if request.layout is None and recorded is not None:
        request = replace(request, layout=recorded)
    with hold(ctx.catalog, ctx.actor, ckpt.id or 0, f"validate {full}"):
        out = run_checks(
            ctx.store,
            ctx.workers,
            ctx.policy.rules,
            full,
            dict(ckpt.metrics),
            files,
            request,
            progress,
        )
    # Inside reg server the server itself ran it: as trustworthy as a validator's.
    result = record(ctx, full, ckpt, Attempt.of(out, request), attested=ctx.server)
    return {**result, **out.resume, **({"sharding": out.sharding} if out.sharding else {})}


def check_world_size(world_size: int) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise UsageError(f"--world-size must be a whole number >= 1, got {world_size!r}")


def run_checks(
    store: BaseStore,
    workers: int,
    rules: Policy,
    ref: CheckpointRef,
    metrics: dict[str, float],
    files: list[FileRecord],
    request: Request,
    progress: Progress | None,
) -> Outcome:
    """Every check of the module docstring on the stored checkpoint `ref` (its `files` as the
    catalog lists them), as `request` (checked) asks, its model where `request.layout` puts it
    (None: where its keys show); no catalog access, so a validator reading through `reg
    server` runs the same code."""
    out = Outcome()
    prefix = checkpoint_prefix(ref.project, ref.run, ref.step or 0)
    device = request.device
    budget = choose_budget(request.memory_budget, device)
    # .metadata and small sidecars read whole and proven; a model file's header and a large
    # sidecar's ends by range, proven in the one pass (deferred.py)
    reads = DeferredReads(store, prefix, files)
    started = time.perf_counter()
    try:
        metadata = stored_metadata(reads.read, [f.path for f in files])
        inv = inventory(metadata)
        check_ranges(inv, {f.path: f.size for f in files}, str(ref))
        sizes = {f.path: f.size for f in files}
        facts = facts_of(inv, sizes, reads.read, request.layout, reads.read_ends)
    except (IntegrityError, NotFound) as exc:
        out.add("integrity", False, str(exc))
        out.add("resume_state", False, "not decided: the integrity check failed")
        return out
    except RegistryError as exc:
        out.add("integrity", False, str(exc))
        out.add("resume_state", False, "not decided: the metadata is not consistent")
        return out
    out.phases["metadata_seconds"] = round(time.perf_counter() - started, 3)
    resume = verdict(facts, rules.resume)
    out.names_path = names_path(resume.model_path, request.strip_prefix or "")
    out.resume = {
        **resume.to_json(),
        "suggestions": suggest(facts.keys, facts.sidecars, rules.resume, resume),
    }
    model = None
    if request.model_factory is not None:
        model = ModelCheck(
            spec=request.model_factory,
            names=resume.model_names(inv.tensors, request.strip_prefix or ""),
            metrics=metrics,
            probe_rtol=rules.promotion.probe_rtol,
        )
    passed = run_streamed(
        store,
        prefix,
        files,
        inv,
        device,
        budget,
        model,
        out,
        label=str(ref),
        workers=workers,
        progress=progress,
        probe=request.world_size == 1,
        expected=reads.expected,
    )
    if passed and model is not None and request.world_size > 1:
        _run_sharded(store, prefix, files, device, request, model, resume, out)
    out.add("resume_state", resume.resumable, "; ".join([resume.summary(), *resume.warnings]))
    return out


def _run_sharded(
    store: BaseStore,
    prefix: str,
    files: list[FileRecord],
    device: str,
    request: Request,
    model: ModelCheck,
    resume: Any,
    out: Outcome,
) -> None:
    optimizer_path = None
    if request.with_optimizer:
        roots = resume.classes.get("optimizer", [])
        if len(roots) != 1:
            raise UsageError(
                f"--with-optimizer: the checkpoint has {len(roots)} optimizer key paths "
                f"({', '.join(roots) or 'none'}); exactly one can be restored",
                "validate without --with-optimizer",
            )
        optimizer_path = roots[0]
    out.mode = SHARDED
    job = ShardedJob(
        store.url,
        prefix,
        {f.path: f.version for f in files if f.version},
        [f.path for f in files],
        device,
        request.world_size,
        model,
        optimizer_path,
        {f.path: f.size for f in files},
    )
    run_sharded(job, out)


MAX_DETAIL = 4000  # characters of one check's detail in a validator's report


def _finite(value: object) -> TypeGuard[int | float]:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer too large for a float
        return False


def _clean_detail(detail: object) -> Any:
    """A check's detail as a report may carry it: text, nothing, or groups of names (tied
    weights); bounded and inert. False for anything else."""
    if detail is None:
        return None
    if isinstance(detail, str):
        return inert(detail)[:MAX_DETAIL]
    groups = detail if isinstance(detail, list) and len(detail) <= 1000 else None
    if groups is None or not all(
        isinstance(g, list) and len(g) <= 1000 and all(isinstance(n, str) for n in g)
        for g in groups
    ):
        return False
    return [[inert(n)[:256] for n in g] for g in groups]


@dataclass(frozen=True, slots=True)
class Attempt:
    """What one validation found, as recorded: made here from an Outcome, or sent to reg
    server by a validator (`from_json` checks every field)."""

    passed: bool
    device: str
    device_name: str
    torch_version: str
    world_size: int
    seconds: float
    phases: dict[str, float]
    checks: list[dict[str, Any]]
    tied: list[list[str]]  # groups of names sharing storage (recorded with the checks)
    model_path: str | None = None  # where the model was taken from (its names depend on it)
    mode: str | None = None  # streamed | sharded (modes.py); None from a validator before them
    driver: str | None = None  # the GPU driver's version (nvidia-smi), on CUDA

    @classmethod
    def of(cls, out: Outcome, request: Request) -> Attempt:
        import torch

        checks = [c.as_dict() for c in out.checks]
        return cls(
            passed=out.passed,
            device=request.device,
            device_name=device_name(request.device),
            torch_version=torch.__version__,
            world_size=request.world_size,
            seconds=out.phases.get("restore_seconds", 0.0),
            phases=dict(out.phases),
            checks=checks,
            tied=[list(g) for g in out.tied],
            model_path=out.names_path,
            mode=out.mode,
            driver=driver_version() if request.device == "cuda" else None,
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "device": self.device,
            "device_name": self.device_name,
            "torch_version": self.torch_version,
            "world_size": self.world_size,
            "seconds": self.seconds,
            "phases": self.phases,
            "checks": self.checks,
            "tied": self.tied,
            "model_path": self.model_path,
            "mode": self.mode,
            "driver": self.driver,
        }

    @classmethod
    def from_json(cls, doc: Any) -> Attempt:
        def bad(what: str) -> UsageError:
            return UsageError(f"validation report: {what}", "send what reg validate produces")

        if not isinstance(doc, dict):
            raise bad("not an object")
        passed, device, world = doc.get("passed"), doc.get("device"), doc.get("world_size")
        seconds, phases, checks = doc.get("seconds"), doc.get("phases"), doc.get("checks")
        if not isinstance(passed, bool):
            raise bad("passed is not true or false")
        if device not in ("cuda", "cpu"):
            raise bad("device is neither cuda nor cpu")
        if isinstance(world, bool) or not isinstance(world, int) or not 1 <= world < 2**31:
            raise bad("world_size is not a whole number >= 1")
        if not _finite(seconds) or seconds < 0:
            raise bad("seconds is not a finite number >= 0")
        if (
            not isinstance(phases, dict)
            or len(phases) > 64
            or not all(isinstance(k, str) and _finite(v) for k, v in phases.items())
        ):
            raise bad("phases is not an object of finite numbers")
        if not isinstance(checks, list) or not checks or len(checks) > 64:
            raise bad("checks is not a list of 1 to 64 checks")
        clean = []
        for c in checks:
            if not isinstance(c, dict) or not isinstance(c.get("passed"), bool):
                raise bad("a check has no passed")
            name = c.get("name")
            if not isinstance(name, str):
                raise bad("a check has no name")
            detail = _clean_detail(c.get("detail"))
            if detail is False:
                raise bad(f"check {inert(name)[:64]}: detail is neither text nor name groups")
            clean.append({"name": inert(name)[:64], "passed": c["passed"], "detail": detail})
        # `passed` counts every check but resume_state; a validator from before that rule
        # counted it too: either reading of its checks is taken, and the rule applied here.
        if passed not in (counted(clean), all(c["passed"] for c in clean)):
            raise bad("passed disagrees with the checks")
        passed = counted(clean)
        model_path = doc.get("model_path")
        if model_path is not None and (not isinstance(model_path, str) or len(model_path) > 1024):
            raise bad("model_path is not a key path")
        tied = _clean_detail(doc.get("tied") or [])
        if not isinstance(tied, list):
            raise bad("tied is not a list of name groups")
        text = {k: doc.get(k) for k in ("device_name", "torch_version")}
        if not all(isinstance(v, str) for v in text.values()):
            raise bad("device_name and torch_version are strings")
        mode, driver = doc.get("mode"), doc.get("driver")
        if mode is None:  # a validator from before modes: what it did at that world size
            mode = "whole" if world == 1 else "resharded"
        elif mode not in MODES[:2] or (mode == SHARDED) != (world > 1):
            raise bad("mode is streamed at world size 1 or sharded above it")
        if driver is not None and not isinstance(driver, str):
            raise bad("driver is a string")
        names = {c["name"] for c in clean}
        needed = {"integrity", "restore", "shapes", "finite"}
        needed |= {"restore_sharded", "sharding"} if mode == SHARDED else set()
        if passed and not needed <= names:
            raise bad(
                f"a passing validation has every check of its mode ({', '.join(sorted(needed))})"
            )
        return cls(
            passed=passed,
            device=device,
            device_name=inert(str(text["device_name"]))[:200],
            torch_version=inert(str(text["torch_version"]))[:64],
            world_size=world,
            seconds=float(seconds),
            phases={inert(k)[:64]: float(v) for k, v in phases.items()},
            checks=clean,
            tied=tied,
            model_path=None if model_path is None else inert(model_path)[:1024],
            mode=mode,
            driver=None if driver is None else inert(driver)[:64],
        )


def record(
    ctx: Context, ref: CheckpointRef, ckpt: Checkpoint, attempt: Attempt, *, attested: bool
) -> dict[str, Any]:
    """The Validation row, its audit event and its outbox event, in one transaction."""
    with ctx.catalog.session(write=True) as s:
        row = Validation(
            checkpoint_id=ckpt.id or 0,
            passed=attempt.passed,
            device=attempt.device,
            device_name=attempt.device_name,
            torch_version=attempt.torch_version,
            world_size=attempt.world_size,
            seconds=attempt.seconds,
            phases=attempt.phases,
            checks=attempt.checks
            + (
                [{"name": "tied_weights", "passed": True, "detail": attempt.tied}]
                if attempt.tied
                else []
            ),
            created_at=now(),
            created_by=ctx.actor,
            attested=attested,
            model_path=attempt.model_path,
            mode=attempt.mode,
            driver=attempt.driver,
        )
        s.add(row)
        s.flush()
        if ctx.audit_key is not None:  # the server's gate counts only signed validations
            from registry.trust import signed_facts

            content = signed_facts.validation_content(
                row, signed_facts.subject_of(s, row.checkpoint_id)
            )
            signed_facts.sign(
                s, ctx.audit_key, signed_facts.VALIDATION, row.id or 0, content, signed_by=ctx.actor
            )
        ctx.audit(
            s,
            "validate",
            str(ref),
            "allowed" if attempt.passed else "failed",
            device=attempt.device,
            validation_id=row.id,
            attested=attested or None,
        )
        ctx.events.emit(
            s,
            events.CHECKPOINT_VALIDATED,
            project=ref.project,
            run=ref.run,
            step=ref.step,
            ref=str(ref),
            passed=attempt.passed,
            device=attempt.device,
            device_name=row.device_name,
            mode=attempt.mode,
            validation_id=row.id,
            seconds=attempt.seconds,
        )
        journal_record(  # last: the commit follows it (registry.journal.write)
            ctx,
            s,
            VALIDATION,
            {"project": ref.project, "run": ref.run, "step": ckpt.step},
            validation_fact(row),
            ts=row.created_at,
        )
        validation_id = row.id
    return {
        "ref": str(ref),
        **attempt.to_json(),
        "validation_id": validation_id,
        "attested": attested,
        "created_at": iso(row.created_at),
    }
