"""Methods of the embedded registry derived from the contract, not written by hand.

`delegated(Registry.gc, "registry.operations.gc:run_gc", GcReport)` is `LocalRegistry.gc`: the
contract's own signature (mypy sees exactly the contract's method; `inspect.signature` too),
its arguments passed by name to the operation with the registry's Context first, and the
operation's JSON read as the contract's typed result. The operation's module is imported when
the method is first called, so a command loads only what it runs (`reg ls` stays light).
`tests/api/test_delegation.py` checks that every target takes the contract's parameters.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable, Mapping
from typing import Any, Concatenate, ParamSpec, TypeVar, cast

from registry.api.results.base import Result, results_of

P = ParamSpec("P")
R = TypeVar("R")


def delegated(
    contract: Callable[Concatenate[Any, P], R],
    target: str,
    result: type[Result] | None = None,
    *,
    many: bool = False,
    convert: Mapping[str, Callable[[Any], Any]] | None = None,
    **fixed: Any,
) -> Callable[Concatenate[Any, P], R]:
    """The method `contract` (a `Registry` method) as a call of `target` ("module:function",
    Context first); `result`: the typed result its JSON is read as (`many`: a list of them;
    None: answered as it is); `convert`: what an argument is turned into first (a ref's text
    parsed, a path made a Path); `fixed`: keyword arguments the target always gets."""
    converters = dict(convert or {})
    signature = inspect.signature(contract)
    module, _, function = target.partition(":")

    @functools.wraps(contract, updated=())
    def method(self: Any, *args: P.args, **kwargs: P.kwargs) -> R:
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        del arguments["self"]
        for parameter in signature.parameters.values():
            if parameter.kind is parameter.VAR_KEYWORD:  # **figures travel as they came
                arguments.update(arguments.pop(parameter.name))
        for argument, turn in converters.items():
            arguments[argument] = turn(arguments[argument])
        operation = getattr(importlib.import_module(module), function)
        out = operation(self.context, **arguments, **fixed)
        if result is None:
            return out  # type: ignore[no-any-return]
        return results_of(result, out) if many else result.from_json(out)  # type: ignore[return-value]

    method.delegates_to = target  # type: ignore[attr-defined]
    method.fixed = fixed  # type: ignore[attr-defined]
    method.converts = tuple(converters)  # type: ignore[attr-defined]
    return cast("Callable[Concatenate[Any, P], R]", method)
