"""What every command module shares: opening the registry, parsing small values."""

from __future__ import annotations

from typing import TYPE_CHECKING

import typer

from registry.api.contract import Registry
from registry.core.refs import check_name
from registry.errors import UsageError

if TYPE_CHECKING:
    from registry.api.contract import Registry

JSON_OPTION = typer.Option(False, "--json", help="Print one JSON document on stdout.")
LAYOUT_OPTION = typer.Option(
    None,
    "--layout",
    help="The checkpoint's layout: megatron, deepspeed, lightning, transformers, peft, "
    "accelerate, dcp, stateful or torchtitan (default: the one its keys and files show).",
)

STRIP_PREFIX_OPTION = typer.Option(
    None,
    "--strip-prefix",
    help="Strip this prefix too from the release's tensor names, after the layout's own (e.g. "
    '"model." for a LightningModule whose network is self.model).',
)


def open_registry() -> Registry:
    reg = Registry()
    if not reg.settings.remote and reg.settings.store_url.startswith("memory://"):
        raise UsageError(
            f"REG_STORE_URL={reg.settings.store_url}: a memory store lives inside one process, "
            "and this command's would vanish when it exits while the catalog keeps its rows",
            "use file:///path or s3://bucket/prefix (memory:// is for the Python API in tests)",
        )
    return reg


def parse_metrics(items: list[str]) -> dict[str, float]:
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
