"""How a `Registry` method travels over HTTP, declared on the contract's own method.

`@http("POST", "/gc")` on a method of `registry.api.contract.Registry` is its whole wire
description.
The remote registry sends the method's arguments under their own names (a JSON body, or the
query string of a GET); `reg server` registers the route, reads and checks each argument by its
annotation, and runs the embedded implementation under the request's identity. So a new method
is written once, in the contract, plus its embedded implementation: both HTTP sides follow.

Methods whose client does work of its own (the data path: pushes, pulls, a validation run on
the caller's device, a promotion's extras, a policy file read locally, a claimed commit's body
read only after the claim is checked, a heartbeat's free-form figures) carry no `@http` and
are written by hand on both sides.

Arguments that never leave the caller (`progress`, a callback; `notes`, an out-list) are not
sent. A value is checked by the kind its annotation names; an annotation with no kind here is
refused when the routes are derived (`routes()`), so a new argument type cannot slip through
unchecked.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import quote

from registry.errors import UsageError

F = TypeVar("F", bound=Callable[..., Any])  # a decorated method keeps its signature for mypy
LOCAL_ONLY = frozenset({"self", "progress", "notes"})


class Kind:
    """How one argument is checked when it arrives (JSON or a query string) and sent."""

    what = "a value"

    def __init__(self, optional: bool = False) -> None:
        self.optional = optional

    def from_json(self, name: str, value: object) -> Any:
        if value is None and self.optional:
            return None
        return self.check(name, value)

    def from_query(self, name: str, text: str) -> Any:
        return self.from_json(name, text)

    def check(self, name: str, value: object) -> Any:
        raise NotImplementedError

    def send(self, value: Any) -> Any:
        return value

    def refuse(self, name: str) -> UsageError:
        return UsageError(f"{name} must be {self.what}")


class Text(Kind):
    what = "a string"

    def check(self, name: str, value: object) -> str:
        if not isinstance(value, str):
            raise self.refuse(name)
        return value


class Ref(Text):
    """A ref, given as a string or a parsed `CheckpointRef`/`ReleaseRef`: sent as its string,
    parsed by the implementation (one parser, one error)."""

    def send(self, value: Any) -> Any:
        return None if value is None else str(value)


class Flag(Kind):
    what = "true or false"

    def check(self, name: str, value: object) -> bool:
        if not isinstance(value, bool):
            raise self.refuse(name)
        return value

    def from_query(self, name: str, text: str) -> bool:
        words = dict.fromkeys(("true", "1", "yes", "on", "t", "y"), True) | dict.fromkeys(
            ("false", "0", "no", "off", "f", "n"), False
        )
        if text.lower() not in words:
            raise self.refuse(name)
        return words[text.lower()]


class Whole(Kind):
    what = "a whole number"

    def check(self, name: str, value: object) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.refuse(name)
        if not -(2**63) <= value < 2**63:  # what the catalog's columns hold
            raise UsageError(f"{name} is out of range")
        return value

    def from_query(self, name: str, text: str) -> int:
        try:
            return self.check(name, int(text.strip()))
        except ValueError:
            raise self.refuse(name) from None


class Number(Kind):
    """A number of JSON or of a query string; its range is the implementation's to check
    (where `nan` or `inf` gets the same line as any other value out of range)."""

    what = "a number"

    def check(self, name: str, value: object) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.refuse(name)
        try:
            return float(value)
        except OverflowError:  # a JSON integer of hundreds of digits
            raise UsageError(f"{name} is out of range") from None

    def from_query(self, name: str, text: str) -> float:
        try:
            return float(text.strip())
        except ValueError:
            raise self.refuse(name) from None


class Version(Kind):
    what = "vK or a number"

    def check(self, name: str, value: object) -> str | int:
        if isinstance(value, bool) or not isinstance(value, str | int):
            raise self.refuse(name)
        return value

    def from_query(self, name: str, text: str) -> str | int:
        return int(text) if text.isascii() and text.isdigit() else text


# The contract's annotations (as written: `from __future__ import annotations` keeps them text).
KINDS: Mapping[str, Callable[[], Kind]] = {
    "str": Text,
    "str | None": functools.partial(Text, optional=True),
    "bool": Flag,
    "int": Whole,
    "int | None": functools.partial(Whole, optional=True),
    "float": Number,
    "float | None": functools.partial(Number, optional=True),
    "str | int": Version,
    "str | CheckpointRef": Ref,
    "str | ReleaseRef": Ref,
    "str | CheckpointRef | ReleaseRef": Ref,
}


@dataclass(frozen=True)
class Field:
    arg: str  # the contract's argument
    wire: str  # its name on the wire
    kind: Kind
    required: bool


@dataclass(frozen=True)
class Route:
    """One contract method's HTTP form."""

    method: str
    verb: str
    path: str  # relative to /v1; `{arg}` parts carry that argument
    fields: tuple[Field, ...]
    query: bool  # arguments in the query string, else a JSON body
    fixed: Mapping[str, object] = field(default_factory=dict)  # sent with every call
    default: bool = False  # taken when a request of the path leaves the fixed fields out
    result_keys: tuple[str, ...] = ()  # a tuple result travels as an object of these keys
    returns: str = ""  # the contract's return annotation: the typed result of the answer

    @property
    def in_path(self) -> tuple[str, ...]:
        return tuple(f.wire for f in self.fields if "{" + f.wire + "}" in self.path)

    # -- the client's side -------------------------------------------------------------------
    def request(self, arguments: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
        """The path and the wire fields of a call with these (bound) arguments."""

        sent = {f.wire: f.kind.send(arguments[f.arg]) for f in self.fields if f.arg in arguments}
        path = self.path
        for name in self.in_path:
            path = path.replace("{" + name + "}", quote(str(sent.pop(name)), safe=""))
        return path, sent | dict(self.fixed)

    def result(self, answer: Any) -> Any:
        """The contract's result of the server's JSON answer (`registry.api.results`)."""
        from registry.api import results  # 30 ms of dataclasses `reg --help` does without

        if self.result_keys:
            return tuple(answer[k] for k in self.result_keys)
        return results.read(self.returns, answer)

    # -- the server's side -------------------------------------------------------------------
    def matches(self, doc: Mapping[str, Any]) -> bool:
        """Whether a request of this route's path is a call of this method (two methods may
        share a path, told apart by a fixed field: `/pin` pins or unpins)."""
        return all(
            k in doc and type(doc[k]) is type(v) and doc[k] == v for k, v in self.fixed.items()
        )

    def arguments(self, doc: Mapping[str, Any], *, from_query: bool) -> dict[str, Any]:
        """The contract's arguments out of a request's fields, each checked by its kind; an
        argument not given takes the contract's default."""
        if not from_query:  # a misspelt field would be ignored and its default taken: refused
            known = {f.wire for f in self.fields} | set(self.fixed)
            unknown = sorted(set(doc) - known)
            if unknown:
                raise UsageError(
                    f"{', '.join(unknown)}: no such field", f"{self.method} takes {sorted(known)}"
                )
        out: dict[str, Any] = {}
        for f in self.fields:
            if f.wire not in doc:
                if f.required:
                    raise UsageError(f"{f.wire} is required")
                continue
            value = doc[f.wire]
            if (from_query or f.wire in self.in_path) and isinstance(value, str):
                out[f.arg] = f.kind.from_query(f.wire, value)
            else:
                out[f.arg] = f.kind.from_json(f.wire, value)
        return out

    def answer(self, result: Any) -> Any:
        """The JSON answer of the implementation's result."""
        from registry.api import results  # 30 ms of dataclasses `reg --help` does without

        if self.result_keys:
            return dict(zip(self.result_keys, result, strict=True))
        return results.to_json(result)


def http(
    verb: str,
    path: str,
    *,
    query: bool | None = None,
    names: Mapping[str, str] | None = None,
    fixed: Mapping[str, object] | None = None,
    default: bool = False,
    result_keys: tuple[str, ...] = (),
) -> Callable[[F], F]:
    """Declare a contract method's route. `query`: its arguments go in the query string
    (default: for a GET); `names`: wire names of arguments named otherwise; `fixed`: fields
    sent with every call (telling apart two methods of one path); `default`: this method is the
    one a request of the path without those fields calls; `result_keys`: a tuple result travels
    as an object of these keys."""

    def mark(method: F) -> F:
        method.__wire__ = (  # type: ignore[attr-defined]
            (verb, path, query, dict(names or {}), dict(fixed or {}), default, result_keys)
        )
        return method

    return mark


def route_of(method: Callable[..., Any]) -> Route | None:
    """The Route a contract method declares, or None (written by hand on both sides)."""
    declared = getattr(method, "__wire__", None)
    if declared is None:
        return None
    verb, path, query, names, fixed, default, result_keys = declared
    fields = []
    for name, param in inspect.signature(method).parameters.items():
        if name in LOCAL_ONLY:
            continue
        if param.kind in (param.VAR_KEYWORD, param.VAR_POSITIONAL):
            raise TypeError(f"{method.__qualname__}: **{name} has no wire form; write it by hand")
        make = KINDS.get(str(param.annotation))
        if make is None:
            raise TypeError(
                f"{method.__qualname__}({name}: {param.annotation}): no wire kind for that type"
            )
        fields.append(Field(name, names.get(name, name), make(), param.default is param.empty))
    return Route(
        method.__name__,
        verb,
        path,
        tuple(fields),
        verb == "GET" if query is None else query,
        fixed,
        default,
        result_keys,
        str(inspect.signature(method).return_annotation),
    )


@functools.cache
def routes(contract: type) -> tuple[Route, ...]:
    """Every route the contract's methods declare, in declaration order."""
    found = (route_of(member) for member in vars(contract).values() if inspect.isfunction(member))
    return tuple(r for r in found if r is not None)
