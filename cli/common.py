"""What every command module shares: opening the registry, parsing small values."""

from __future__ import annotations

from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:
    from registry.api import Registry

JSON_OPTION = typer.Option(False, "--json", help="Print one JSON document on stdout.")


def open_registry() -> Registry:
    from registry.api import Registry

    return Registry()


def parse_metrics(items: list[str]) -> dict[str, float]:
    from registry.errors import UsageError
    from registry.refs import check_name

    out: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition("=")
        try:
            if not sep:
                raise ValueError
            out[check_name(name.strip(), "metric name")] = float(value)
        except ValueError:
            raise UsageError(
                f"bad --metric {item!r}", "write NAME=NUMBER, e.g. val_loss=2.31"
            ) from None
    return out
