"""Adapter releases (`reg promote --convert peft`): what an adapter needs besides its tensors.

An adapter is loaded onto a base model: `PeftModel.from_pretrained(base, folder)` reads
`adapter_model.safetensors` and `adapter_config.json`. The config is the user's (an `--extra`,
checked here: a JSON object naming its `peft_type`), and the release records its base model:
a reg release named with `--base NAME@ALIAS` or `NAME:vK` (resolved now to one version and its
digest: verified), else the `base_model_name_or_path` the config names (recorded as
unverified: reg cannot tell what it is).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from registry.catalog.models import YANKED
from registry.errors import UsageError
from registry.formats.hf_folder import MAX_DOCUMENT, parse_object
from registry.lifecycle.promotion.converters import ADAPTER_CONFIG
from registry.refs import parse_release_ref

if TYPE_CHECKING:
    from collections.abc import Sequence

    from registry.context import Context
    from registry.lifecycle.promotion.plan import Extra


@dataclass(frozen=True)
class BaseModel:
    name: str | None  # a reg release (model:vK), or what adapter_config.json names
    sha256: str | None  # the release's digest, when it is one
    verified: bool

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "sha256": self.sha256, "verified": self.verified}


def adapter_base(ctx: Context, extras: Sequence[Extra], base: str | None) -> BaseModel:
    """The base model of an adapter release, after checking its adapter_config.json."""
    config = next((e for e in extras if e.name == ADAPTER_CONFIG), None)
    if config is None:
        raise UsageError(
            f"an adapter release needs its {ADAPTER_CONFIG}",
            f"add --extra {ADAPTER_CONFIG} (what the adapter's save_pretrained wrote)",
        )
    data = config.path.read_bytes()
    if len(data) > MAX_DOCUMENT:
        raise UsageError(f"--extra {ADAPTER_CONFIG} is over {MAX_DOCUMENT >> 20} MiB")
    doc = parse_object(data, f"--extra {ADAPTER_CONFIG}")
    if not isinstance(doc.get("peft_type"), str):
        raise UsageError(
            f"--extra {ADAPTER_CONFIG} names no peft_type",
            "give the adapter_config.json PEFT's save_pretrained wrote",
        )
    if base is None:
        named = doc.get("base_model_name_or_path")
        return BaseModel(named if isinstance(named, str) else None, None, False)
    return _release(ctx, base)


def _release(ctx: Context, text: str) -> BaseModel:
    """`--base`: a release the caller may read, resolved to one version now."""
    from registry.lifecycle.releases import resolve_release

    ref = parse_release_ref(text)
    ctx.authorize_read(model=ref.model)
    with ctx.catalog.session() as s:
        model, release = resolve_release(s, ref)
        if release.status == YANKED:
            raise UsageError(
                f"--base {text}: {model.name}:v{release.version} is yanked",
                "name a base release that is not yanked",
            )
        return BaseModel(f"{model.name}:v{release.version}", release.sha256, True)
