"""`LocalRegistry`'s derived methods (`registry.api.delegation`): each has the contract's own
signature, and the operation it calls takes every one of the contract's parameters by name,
so a renamed parameter fails here, not in a user's command."""

from __future__ import annotations

import importlib
import inspect

import pytest

from registry import Registry
from registry.api.delegation import delegated
from registry.api.local import LocalRegistry
from registry.api.results import GcReport


def _derived() -> dict[str, object]:
    return {
        name: member
        for cls in LocalRegistry.__mro__
        for name, member in vars(cls).items()
        if hasattr(member, "delegates_to")
    }


def test_the_derived_methods_have_the_contract_signature_and_a_target_that_takes_it():
    derived = _derived()
    assert {"gc", "fsck", "list_checkpoints", "releases", "audit_log", "pull", "yank"} <= set(
        derived
    )
    for name, method in derived.items():
        contract = getattr(Registry, name)
        assert inspect.signature(method) == inspect.signature(contract), name
        assert method.__doc__ == contract.__doc__, name
        module, _, function = method.delegates_to.partition(":")  # type: ignore[attr-defined]
        target = inspect.signature(getattr(importlib.import_module(module), function))
        params = list(target.parameters.values())
        assert params[0].name in ("ctx", "context"), (name, params[0])
        takes = {p.name for p in params[1:] if p.kind is not p.VAR_POSITIONAL}
        wanted = [p for p in inspect.signature(contract).parameters if p != "self"]
        assert set(method.converts) <= set(wanted), name  # type: ignore[attr-defined]
        wanted += list(method.fixed)  # type: ignore[attr-defined]
        assert set(wanted) <= takes, (name, method.delegates_to, set(wanted) - takes)


def test_a_derived_method_passes_its_arguments_by_name_and_reads_the_result():
    seen = {}

    class Fake:
        context = "the context"

    def operation(ctx, *, dry_run):  # type: ignore[no-untyped-def]
        seen.update(ctx=ctx, dry_run=dry_run)
        return {
            "applied": not dry_run,
            "decisions": [],
            "freed_bytes": 0,
            "errors": [],
            "orphans": [],
        }

    import types

    module = types.ModuleType("reg_test_delegation_target")
    module.run = operation  # type: ignore[attr-defined]
    import sys

    sys.modules[module.__name__] = module
    try:
        gc = delegated(Registry.gc, f"{module.__name__}:run", GcReport)
        out = gc(Fake(), dry_run=True)
        assert isinstance(out, GcReport) and out.applied is False
        assert seen == {"ctx": "the context", "dry_run": True}
        with pytest.raises(TypeError):
            gc(Fake(), True)  # the contract's keyword-only stays keyword-only
    finally:
        del sys.modules[module.__name__]
