"""Deprecated for one release: `reg recovery` is `reg advise` (`registry.lifecycle.economics`),
which measures C_eff, RTO and failures instead of asking for them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from registry.lifecycle.economics import advise

if TYPE_CHECKING:
    from registry.context import Context


def economics(
    ctx: Context, run: str, *, project: str = "default", mtbf_s: float | None = None
) -> dict[str, Any]:
    """`advise` under its old name."""
    return advise(ctx, run, project=project, mtbf_s=mtbf_s)
