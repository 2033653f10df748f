"""Adapter releases (`reg promote --convert peft`): what an adapter needs besides its tensors.

An adapter is loaded onto a base model: `PeftModel.from_pretrained(base, folder)` reads
`adapter_model.safetensors` and `adapter_config.json`. The config is the user's (an `--extra`,
checked here: a JSON object naming its `peft_type`), and the release records its base model:
a reg release named with `--base NAME@ALIAS` or `NAME:vK` (resolved now to one version and its
digest: `resolved`; that the adapter fits it is the user's word), else the
`base_model_name_or_path` the config names (not resolved: reg cannot tell what it is). Where
both are given and differ, the config's name is recorded too (`config_names`): PEFT's own
loaders follow it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from registry.catalog.models import YANKED
from registry.core.refs import parse_release_ref
from registry.errors import UsageError
from registry.formats.hf_folder import MAX_DOCUMENT, parse_object
from registry.lifecycle.promotion.converters import ADAPTER_CONFIG
from registry.lifecycle.releases import resolve_release

if TYPE_CHECKING:
    from collections.abc import Sequence

    from registry.lifecycle.context import Context
    from registry.lifecycle.promotion.records import Extra


@dataclass(frozen=True)
class BaseModel:
    name: str | None  # a reg release (model:vK), or what adapter_config.json names
    sha256: str | None  # the release's digest, when it is one
    resolved: bool  # a reg release, resolved to that version when the adapter was released
    config_names: str | None = None  # adapter_config.json's base, where it names another

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "sha256": self.sha256, "resolved": self.resolved}
        if self.config_names is not None:
            out["config_names"] = self.config_names
        return out


def adapter_base(ctx: Context, extras: Sequence[Extra], base: str | None) -> BaseModel:
    """The base model of an adapter release, after checking its adapter_config.json."""
    config = next((e for e in extras if e.name == ADAPTER_CONFIG), None)
    if config is None:
        raise UsageError(
            f"an adapter release needs its {ADAPTER_CONFIG}",
            f"add --extra {ADAPTER_CONFIG} (what the adapter's save_pretrained wrote)",
        )
    data = config.data if config.data is not None else config.path.read_bytes()
    if len(data) > MAX_DOCUMENT:
        raise UsageError(f"{config.label} is over {MAX_DOCUMENT >> 20} MiB")
    doc = parse_object(data, config.label)
    if not isinstance(doc.get("peft_type"), str):
        raise UsageError(
            f"{config.label} names no peft_type",
            "give the adapter_config.json PEFT's save_pretrained wrote",
        )
    _check_lora_only(doc, config.label)
    named = doc.get("base_model_name_or_path")
    named = named if isinstance(named, str) else None
    if base is None:
        return BaseModel(named, None, False)
    found = _release(ctx, base)
    return replace(found, config_names=named) if named and named != found.name else found


def _check_lora_only(doc: dict[str, Any], label: str) -> None:
    """What a release of the LoRA tensors alone holds all of: a LORA adapter training no
    biases, no whole modules and no token rows (those live outside lora_A / lora_B, and
    leaving them out would release a broken adapter)."""
    problems = []
    if doc.get("peft_type") != "LORA":
        problems.append(f"peft_type {str(doc.get('peft_type'))[:40]}")
    if doc.get("bias", "none") != "none":
        problems.append(f"bias {str(doc.get('bias'))[:40]}")
    for key in ("modules_to_save", "trainable_token_indices"):
        if doc.get(key):
            problems.append(key)
    if problems:
        raise UsageError(
            f"{label}: {', '.join(problems)}: the adapter trains more than "
            "its LoRA tensors, which is all reg releases as an adapter",
            "promote the whole model (without --convert peft)",
        )


def _release(ctx: Context, text: str) -> BaseModel:
    """`--base`: a release the caller may read, resolved to one version now."""
    ref = parse_release_ref(text)
    ctx.authorize_read(model=ref.model)
    with ctx.catalog.session() as s:
        model, release = resolve_release(s, ref)
        if release.status == YANKED:
            raise UsageError(
                f"--base {text}: {model.name}:v{release.version} is yanked",
                "name a base release that is not yanked",
            )
        return BaseModel(f"{model.name}:v{release.version}", release.sha256, resolved=True)
