"""Hugging Face folders in promotion: the release's config.json (decided with the plan, before
anything is written) and whether a release is a complete HF model folder (read from the catalog's
file list and two small files, each verified against its recorded sha256).

transformers is never imported: a factory's model is recognised as a transformers model by its
classes' names and modules.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from registry.core.layout import RELEASE_DOCUMENT, release_prefix
from registry.errors import Conflict, IntegrityError, RegistryError, UsageError
from registry.formats.documents import FileRecord, HfConfigRecord, ReleaseDocument
from registry.formats.hf_folder import (
    CONFIG,
    MAX_DOCUMENT,
    TOKENIZER_CONFIG,
    ConfigRewrite,
    completeness,
    rewrite_config,
)
from registry.lifecycle.validation.checks import load_factory

if TYPE_CHECKING:
    from registry.lifecycle.context import Context
    from registry.lifecycle.promotion.records import Extra
    from registry.lifecycle.views import ReleaseView


def plan_config(
    extras: Sequence[Extra], dtype: str | None, model_factory: str | None
) -> ConfigRewrite | None:
    """The release's config.json when a `--extra config.json` is given: refused (UsageError)
    unless it is a strict JSON object (`parse_config`); `dtype` and `architectures` rewritten
    for the release."""
    given = next((e for e in extras if e.name == CONFIG), None)
    if given is None:
        return None
    label = given.label
    size = len(given.data) if given.data is not None else given.path.stat().st_size
    if size > MAX_DOCUMENT:  # not read: `reg show` would not read it either
        raise UsageError(
            f"{label} is {size} bytes, over {MAX_DOCUMENT}: not a config",
            "give the config.json that save_pretrained wrote",
        )
    data = given.data if given.data is not None else given.path.read_bytes()
    if hashlib.sha256(data).hexdigest() != given.sha256:
        raise Conflict(f"{label} changed while being promoted", "promote again")
    if dtype is None and model_factory is None:
        rewrite_config(data, dtype=None, architecture=None, label=label)  # checked, kept
        return ConfigRewrite(data, given.sha256)
    architecture = factory_architecture(model_factory) if model_factory else None
    return rewrite_config(data, dtype=dtype, architecture=architecture, label=label)


def factory_architecture(spec: str) -> str | None:
    """The transformers class the factory's model is (built on the meta device): the most
    derived class in its MRO that transformers defines (`transformers.models.*`), so a user's
    `class MyLlama(LlamaForCausalLM)` gives `LlamaForCausalLM`, the name transformers can
    load. None for a model that is no transformers `PreTrainedModel`, or whose classes above
    PreTrainedModel are all the user's (AutoModel could not build it from a name)."""
    import torch

    fn, _ = load_factory(spec)
    try:
        with torch.device("meta"):
            model = fn()
    except Exception as exc:
        raise UsageError(
            f"--model-factory {spec}: building the model failed: {type(exc).__name__}: {exc}",
            "reg validate REF --model-factory ... shows the same failure",
        ) from exc
    mro = type(model).__mro__
    is_hf = any(
        c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers.") for c in mro
    )
    if not is_hf:
        return None
    return next((c.__name__ for c in mro if c.__module__.startswith("transformers.models.")), None)


def hf_record(rewrite: ConfigRewrite | None) -> HfConfigRecord | None:
    """What release.json records: only a config.json that was rewritten."""
    if rewrite is None or not rewrite.changes:
        return None
    return HfConfigRecord(CONFIG, rewrite.original_sha256, rewrite.changes)


# -- completeness of a stored release --------------------------------------------------------


def release_hf(ctx: Context, view: ReleaseView) -> dict[str, Any]:
    """`hf` (complete, missing, notes), `hf_config` (what promotion rewrote, or None) and
    `code_extras` (the extras that are code, released under the policy's allow_code_extras) of
    a stored release: the file names come from the catalog; config.json, tokenizer_config.json
    and release.json are read and verified against their recorded sha256 (`code_extras` comes
    from release.json, the catalog's record when that cannot be read)."""
    prefix = release_prefix(view.model.name, view.row.version)
    records = {f.path: f for f in view.files}
    label = view.name
    damaged: list[str] = []  # `reg show` still shows a damaged release: each one is a note

    def small(record: FileRecord | None) -> bytes | None:
        if record is None:
            return None
        try:
            return _verified(ctx, prefix, record, label)
        except RegistryError as exc:
            damaged.append(exc.message)
            return None

    config, tokenizer = small(records.get(CONFIG)), small(records.get(TOKENIZER_CONFIG))
    found = completeness(records, config, tokenizer)
    recorded = view.row.options.get("code_extras") if isinstance(view.row.options, dict) else None
    options = view.row.options if isinstance(view.row.options, dict) else {}
    # A release in Megatron's names or a PEFT adapter is no Hugging Face model folder
    converter = str(options.get("convert") or "")
    hf_folder = not converter or converter.startswith("megatron-llama")
    out: dict[str, Any] = {
        "hf": found.to_json() if hf_folder else None,
        "hf_config": None,
        "code_extras": list(recorded or []),
    }
    document = view.document_record()  # None before its commit; its size: what the catalog counts
    if document is not None:
        data = small(document)
        if data is not None:
            try:  # a damaged or newer release.json is a note: `reg show` still shows the rest
                parsed = ReleaseDocument.from_bytes(data, f"{label} {RELEASE_DOCUMENT}")
            except RegistryError as exc:
                damaged.append(exc.message)
            else:
                record = parsed.hf_config
                out["hf_config"] = None if record is None else record.to_json()
                out["code_extras"] = list(parsed.code_extras)
    if damaged:  # a converted release: only the damage is news
        shown = found.to_json() if hf_folder else {"missing": [], "notes": []}
        out["hf"] = {**shown, "complete": False, "notes": [*shown["notes"], *damaged]}
    return out


def _verified(ctx: Context, prefix: str, record: FileRecord, label: str) -> bytes | None:
    """The file's bytes when they are what the catalog recorded (else IntegrityError); None for
    a file too large to be such a document."""
    if record.size > MAX_DOCUMENT:
        return None
    data = bytes(ctx.store.get_bytes(prefix + record.path, version=record.version))
    if len(data) != record.size or hashlib.sha256(data).hexdigest() != record.sha256:
        raise IntegrityError(
            f"{label}: {record.path} does not match its recorded sha256",
            f"reg verify {label} lists every damaged file",
        )
    return data
