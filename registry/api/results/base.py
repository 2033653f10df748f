"""`Result`: what a `Registry` method returns, typed, and the JSON it stands for.

Each method's result is a frozen dataclass: its fields are the top-level keys of the JSON that
`--json` prints and `reg server` answers, typed (nested values stay JSON: objects and lists).
`to_json()` gives that JSON back exactly, keys in their order, including keys a newer server
sent that this version has no field for; `from_json()` reads it (the remote registry reads the
server's answers so). JSON lives only at the edges: the CLI's `--json` and HTTP.

For one release a result also reads as the read-only mapping it used to be (`out["ref"]`,
`dict(out)`), so code written against the dictionaries keeps working while it moves to
attributes (`out.ref`) or to `out.to_json()`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar, Self

from registry.errors import RegistryError


@dataclasses.dataclass(frozen=True, eq=False)
class Result(Mapping[str, Any]):
    """A typed result; equal to another result or a dict with the same JSON."""

    _keys: tuple[str, ...] = dataclasses.field(default=(), kw_only=True, repr=False)
    _extra: Mapping[str, Any] = dataclasses.field(default_factory=dict, kw_only=True, repr=False)
    _fields: ClassVar[frozenset[str]]  # set per class on first use (`_names`, `required`)
    _required: ClassVar[tuple[str, ...]]

    def __post_init__(self) -> None:
        if not self._keys:  # made directly, not read: every field set, in declaration order
            keys = [
                f.name
                for f in dataclasses.fields(self)
                if not f.name.startswith("_")
                and (f.name in self.required() or getattr(self, f.name) is not None)
            ]
            object.__setattr__(self, "_keys", (*keys, *self._extra))

    @classmethod
    def _names(cls) -> frozenset[str]:
        if "_fields" not in cls.__dict__:  # once per class: from_json runs per listed row
            cls._fields = frozenset(
                f.name for f in dataclasses.fields(cls) if not f.name.startswith("_")
            )
        return cls._fields

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> Self:
        """The result a JSON object stands for; a key this version has no field for is kept
        (and given back by `to_json`), a key it needs and the object lacks is an error."""
        if isinstance(doc, Result):
            doc = doc.to_json()
        if not isinstance(doc, Mapping):
            raise RegistryError(
                f"expected a JSON object for {cls.__name__}, got {type(doc).__name__}"
            )
        names = cls._names()
        given = {k: v for k, v in doc.items() if k in names}
        extra = {k: v for k, v in doc.items() if k not in names}
        missing = [name for name in cls.required() if name not in given]
        if missing:
            raise RegistryError(
                f"a {cls.__name__} without {', '.join(missing)}",
                "the registry answered in a shape this reg does not know: upgrade reg",
            )
        return cls(**given, _keys=tuple(doc), _extra=extra)

    @classmethod
    def required(cls) -> tuple[str, ...]:
        """The keys every JSON object of this result has."""
        if "_required" not in cls.__dict__:  # once per class, as `_names`
            cls._required = tuple(
                f.name
                for f in dataclasses.fields(cls)
                if not f.name.startswith("_")
                and f.default is dataclasses.MISSING
                and f.default_factory is dataclasses.MISSING
            )
        return cls._required

    def to_json(self) -> dict[str, Any]:
        """The JSON object `--json` prints for this result."""
        return {k: self._value(k) for k in self._keys}

    def _value(self, key: str) -> Any:
        return getattr(self, key) if key in self._names() else self._extra[key]

    # -- the read-only mapping of before (one release) -----------------------------------------
    def __getitem__(self, key: str) -> Any:
        if key not in self._keys:
            raise KeyError(key)
        return self._value(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


def results_of(kind: type[Result], docs: Any) -> list[Any]:
    """A list answer, each item read as `kind`."""
    if not isinstance(docs, list):
        raise RegistryError(f"expected a JSON list of {kind.__name__}, got {type(docs).__name__}")
    return [kind.from_json(d) for d in docs]


def to_json(value: Any) -> Any:
    """JSON of a result, a list or tuple of them, or JSON already (the edges call this)."""
    if isinstance(value, Result):
        return value.to_json()
    if isinstance(value, list | tuple):
        return [to_json(v) for v in value]
    return value
