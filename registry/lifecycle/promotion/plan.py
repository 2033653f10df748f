"""What a promotion will do, decided before anything is written: the source checkpoint, the
release's options (and the key that makes two promotions "the same"), and the gates of the
policy: resumable, and a passing validation the policy accepts (run here if it can be)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlmodel import select

from policies.access import Action
from policies.gates import (
    ValidationRecord,
    device_gate,
    mode_gate,
    resumable_gate,
    satisfies_device,
    usable_validation,
)
from policies.layouts import check_layout
from policies.loader import parse_size
from policies.resume import check_strip_prefix, names_path
from registry.catalog.models import Checkpoint, Validation
from registry.core.layout import MANIFEST, RELEASE_DOCUMENT, checkpoint_prefix
from registry.core.refs import CheckpointRef, check_alias, check_name
from registry.errors import GateNotMet, UsageError, ValidationFailed
from registry.formats.dcp_roots import metadata_paths
from registry.formats.documents import FileRecord
from registry.formats.extras import CODE, judge
from registry.formats.hf_folder import MAX_DOCUMENT
from registry.lifecycle.alias_workflow import check_may_move
from registry.lifecycle.checkpoints.read import resolve
from registry.lifecycle.checkpoints.resume_facts import facts_of_checkpoint, proven_reader, verdict
from registry.lifecycle.promotion.adapters import BaseModel, adapter_base
from registry.lifecycle.promotion.consolidate import INDEX
from registry.lifecycle.promotion.converters import (
    ADAPTER_CONFIG,
    ADAPTER_FILE,
    check_adapter,
    check_converter,
    check_llama_config,
    converter_for,
)
from registry.lifecycle.promotion.hf import plan_config
from registry.lifecycle.promotion.records import Extra
from registry.lifecycle.validation import Request, validate
from registry.lifecycle.validation.restore import resolve_device
from registry.trust.release_signing.bundle import SIGNATURE_FILE
from registry.trust.release_signing.provenance import PROVENANCE_FILE

if TYPE_CHECKING:
    from policies.loader import PromotionPolicy
    from policies.resume import ResumeVerdict
    from registry.formats.hf_folder import ConfigRewrite
    from registry.lifecycle.checkpoints.resume_facts import KeyFacts
    from registry.lifecycle.context import Context

DTYPES = ("bf16", "fp16", "fp32")


# What a release takes from a checkpoint whose model is in safetensors unless an --extra of that
# name is given, by converter: the model's config, as the transformers Trainer's plain save
# writes it beside model.safetensors; an adapter's config, beside adapter_model.safetensors.
CARRIED = {None: ("config.json", "generation_config.json"), "peft": (ADAPTER_CONFIG,)}


@dataclass(frozen=True)
class PromotionPlan:
    source: CheckpointRef  # with its step resolved
    checkpoint: Checkpoint
    files: tuple[FileRecord, ...]  # as the catalog recorded them: what the release must hold
    model: str
    alias: str | None
    dtype: str | None
    max_shard_bytes: int
    extras: tuple[Extra, ...]
    model_factory: str | None
    facts: KeyFacts  # the checkpoint's key paths as the catalog recorded them
    resume: ResumeVerdict  # decided now, under the policy in force (and --layout)
    layout: str | None = None  # forced with --layout
    allow_unclassified: bool = False  # leave out tensors no class claims (else refused)
    strip_prefix: str = ""  # stripped from names after the layout's prefix (checked: "p.")
    convert: str | None = None  # the converter of the release's names (converters.py)
    base: BaseModel | None = None  # an adapter's base model (convert == "peft")
    # The release's config.json when one is an extra (dtype and architectures rewritten)
    hf_config: ConfigRewrite | None = None
    options: dict[str, Any] = field(init=False)
    options_key: str = field(init=False)

    @property
    def code_extras(self) -> tuple[str, ...]:
        """The extras that are code (registry/formats/extras.py), sorted by name."""
        return tuple(sorted(e.name for e in self.extras if e.code is not None))

    def __post_init__(self) -> None:
        options: dict[str, Any] = {
            "dtype": self.dtype,
            "max_shard_bytes": self.max_shard_bytes,
            "extras": {e.name: e.sha256 for e in self.extras},
        }
        if self.code_extras:  # released on purpose under [release] allow_code_extras
            options["code_extras"] = list(self.code_extras)
        # What else decides the release's tensors, written only when not the default so the
        # releases made before these options keep their key.
        if self.resume.model_path != "model":
            options["model_path"] = self.resume.model_path
        if self.layout is not None:
            options["layout"] = self.layout
        if self.allow_unclassified:
            options["allow_unclassified"] = True
        if self.strip_prefix:
            options["strip_prefix"] = self.strip_prefix
        if self.convert is not None:
            options["convert"] = self.convert
        if self.base is not None:
            options["base"] = self.base.to_json()
        # The factory decides the tied weights (written once) and config.json's architectures;
        # a rewritten config.json has other bytes than the extra's sha256 above says.
        if self.model_factory is not None:
            options["model_factory"] = self.model_factory
        if self.hf_config is not None and self.hf_config.changes:
            options["config_rewrite"] = {k: c["to"] for k, c in self.hf_config.changes.items()}
        key = hashlib.sha256(json.dumps(options, sort_keys=True).encode()).hexdigest()[:32]
        object.__setattr__(self, "options", options)
        object.__setattr__(self, "options_key", key)


def plan_promotion(
    ctx: Context,
    ref: CheckpointRef,
    *,
    model: str,
    alias: str | None,
    dtype: str | None,
    max_shard_size: str,
    extras: list[Path],
    model_factory: str | None,
    layout: str | None = None,
    allow_unclassified: bool = False,
    strip_prefix: str | None = None,
    convert: str | None = None,
    base: str | None = None,
) -> PromotionPlan:
    """Check the request and resolve the source; nothing is written (but the key paths of a
    checkpoint pushed before the catalog kept them, recorded once)."""
    check_name(model, "model name")
    check_layout(layout)
    check_converter(convert)
    strip = check_strip_prefix(strip_prefix)
    if alias is not None:
        check_alias(alias)
    if dtype is not None and dtype not in DTYPES:
        raise UsageError(f"unknown --dtype {dtype!r}", "use bf16, fp16 or fp32")
    ctx.authorize(Action.PROMOTE, project=ref.project, model=model, target=f"{ref} -> {model}")
    if alias is not None:  # a protected alias's requesters, refused before any work
        check_may_move(ctx, model, alias)
    max_bytes = _shard_bytes(max_shard_size)
    checked = _check_extras(extras, allow_code=ctx.policy.release.allow_code_extras)
    hf_config = plan_config(checked, dtype, model_factory)  # an invalid config.json: refused
    _, ckpt, files = resolve(ctx, ref)
    source = CheckpointRef(ref.project, ref.run, ckpt.step)
    facts = facts_of_checkpoint(ctx, source, ckpt, files, record=True)
    resume = verdict(facts, ctx.policy.resume, layout)
    names = resume.model_names(facts.keys, strip)  # every model key has the prefix (else exit 2)
    if "__metadata__" in names:  # safetensors keeps its header's metadata under that name
        raise UsageError(
            f"the release would name {names['__metadata__']} __metadata__, which safetensors "
            "reserves for the file's metadata",
            "promote with another --strip-prefix, or none",
        )
    roots = metadata_paths(f.path for f in files)
    if convert is None and ADAPTER_FILE in roots:
        convert = "peft"  # a PEFT adapter's weights, in the file PEFT names them
    converter = converter_for(resume.layout, convert)
    # a save whose model is in safetensors (the Trainer's plain save, a PEFT folder) keeps the
    # model's own config beside it; a DCP checkpoint's files are the trainer's, not a release's
    from_safetensors = bool(roots) and all(r.endswith(".safetensors") for r in roots)
    carry = CARRIED.get(converter, ()) if from_safetensors else ()
    if carried := _carried(ctx, source, files, checked, carry):
        checked += carried
        hf_config = plan_config(checked, dtype, model_factory)
    if converter is not None:
        check_llama_config(converter, json.loads(hf_config.data) if hf_config else None)
    base_model = None
    if converter == "peft":  # the adapter's names decided now, before any validation runs
        check_adapter(resume.model_names(facts.keys, strip))
        base_model = adapter_base(ctx, checked, base)
    elif base is not None:
        raise UsageError("--base names an adapter's base model", "use it with --convert peft")
    return PromotionPlan(
        source=source,
        checkpoint=ckpt,
        files=tuple(files),
        model=model,
        alias=alias,
        dtype=dtype,
        max_shard_bytes=max_bytes,
        extras=checked,
        model_factory=model_factory,
        facts=facts,
        resume=resume,
        layout=layout,
        allow_unclassified=allow_unclassified,
        strip_prefix=strip,
        convert=converter,
        base=base_model,
        hf_config=hf_config,
    )


def _shard_bytes(text: str) -> int:
    try:
        size = parse_size(text)
    except ValueError as exc:
        raise UsageError(f"bad --max-shard-size: {exc}") from None
    if not size or size < 1024:
        raise UsageError(f"--max-shard-size {text} is too small", "e.g. 5GB")
    return size


def _carried(
    ctx: Context,
    source: CheckpointRef,
    files: list[FileRecord],
    given: tuple[Extra, ...],
    carried: tuple[str, ...],
) -> tuple[Extra, ...]:
    """The checkpoint's own `carried` files no --extra replaces, read proven against the
    catalog and judged as extras are (a config that is not JSON is refused, naming it)."""
    names = {e.name for e in given}
    wanted = [f for f in files if f.path in carried and f.path not in names]
    if not wanted:
        return ()
    prefix = checkpoint_prefix(source.project, source.run, source.step or 0)
    read = proven_reader(ctx.store, prefix, files)
    out = []
    for record in wanted:
        label = f"{record.path} of the checkpoint"
        if record.size > MAX_DOCUMENT:
            raise UsageError(
                f"{label} is {record.size} bytes, over {MAX_DOCUMENT}: not a config",
                f"give the release its own: --extra {record.path}",
            )
        data = read(record.path)
        judged = judge(record.path, data, label)
        if judged.kind == CODE or not judged.accepted:
            raise UsageError(
                f"{label} is {judged.why}", f"give the release its own: --extra {record.path}"
            )
        out.append(Extra(Path(record.path), record.sha256, None, data))
    return tuple(out)


def _check_extras(extras: list[Path], *, allow_code: bool) -> tuple[Extra, ...]:
    """Each extra judged by its content (registry/formats/extras.py): pickles, weights and
    unknown binary data refused; code refused unless the policy allows it."""
    out: list[Extra] = []
    # MANIFEST.json: a pulled folder's document; model.sig and the provenance: the signature's
    reserved = {RELEASE_DOCUMENT, MANIFEST, INDEX, SIGNATURE_FILE, PROVENANCE_FILE}
    for given in extras:
        p = Path(given)
        if not p.is_file() or p.is_symlink():
            raise UsageError(f"--extra {p}: not a regular file", "give files such as config.json")
        if p.name in {e.name for e in out} or p.name in reserved or p.name.endswith(".safetensors"):
            raise UsageError(f"--extra {p}: the name {p.name} is taken or reserved")
        check_name(p.name, "extra file name")
        data = p.read_bytes()
        # Named by its file name alone: through reg server the path is the server's own.
        label = f"--extra {p.name}"
        judged = judge(p.name, data, label)
        if judged.kind == CODE and not allow_code:
            raise UsageError(
                f"{label} is code ({judged.why}): the policy refuses code in releases",
                "leave it out, or allow code on purpose: [release] allow_code_extras = true in "
                "the policy, recorded on the release",
            )
        if judged.kind != CODE and not judged.accepted:
            what = f"a pickle ({judged.why})" if judged.kind == "pickle" else judged.why
            raise UsageError(f"{label} is {what}", _REFUSED[judged.kind])
        code = judged.why if judged.kind == CODE else None
        out.append(Extra(p, hashlib.sha256(data).hexdigest(), code))
    return tuple(out)


_REFUSED = {  # the hint of each refused kind
    "pickle": "leave it out: loading a pickle can run any code, and no policy allows one in a "
    "release",
    "weights": "leave it out",
    "binary": "extras are JSON configs, tokenizer files (tokenizer.json, vocab, merges, "
    "sentencepiece tokenizer.model) and text",
}


# -- gates --------------------------------------------------------------------------------------


def check_resumable(ctx: Context, plan: PromotionPlan) -> None:
    """The resume state under the policy in force, decided from the recorded key paths."""
    resume = plan.resume
    if plan.convert == "peft":  # an adapter is released from its weights alone
        return
    gate = resumable_gate(ctx.policy.promotion, resume.resumable, resume.missing)
    if gate:
        raise GateNotMet(
            f"refusing to promote {plan.source}: {gate} ({resume.layout} layout)",
            "promote a full training checkpoint, force the right --layout, or set "
            "require_resumable = false",
        )


def validation_for(ctx: Context, plan: PromotionPlan) -> Validation:
    """A recorded validation the policy accepts, or a new one run here. With a model factory a
    new validation always runs (its tied weights and probe are part of the release)."""
    policy = ctx.policy.promotion
    with ctx.catalog.session() as s:
        rows = list(
            s.exec(select(Validation).where(Validation.checkpoint_id == plan.checkpoint.id)).all()
        )
    if ctx.server:  # identities are proven here: only what a validator attested counts
        from registry.trust.signed_facts import attested_validations

        rows = attested_validations(ctx.catalog, ctx.audit_key, str(plan.source), rows)
    rows = [v for v in rows if _same_names(v, plan)]
    records = [ValidationRecord(v.id or 0, v.passed, v.device, v.mode, _probed(v)) for v in rows]
    usable = usable_validation(policy, records)
    # With a model factory a validation runs here (its ties and probe are the release's), but
    # it runs streamed: where the policy does not accept that, the recorded one must do.
    runs_here = plan.model_factory is not None and "streamed" in policy.modes
    if plan.model_factory is not None and not runs_here:  # only one that checked a model
        records = [r for r, v in zip(records, rows, strict=True) if _checked_model(v)]
        usable = usable_validation(policy, records)
    if usable is not None and not runs_here:
        return next(v for v in rows if v.id == usable.id)
    here = "cuda" if _cuda_available() else "cpu"
    considered = [] if runs_here else records
    gate = mode_gate(policy, considered) or device_gate(policy, considered, here)
    if gate:
        raise GateNotMet(f"refusing to promote {plan.source}: {gate}", _gate_hint(policy, here))
    device = policy.require_device if policy.require_device == "cuda" else "auto"
    request = Request(
        resolve_device(device),
        model_factory=plan.model_factory,
        layout=plan.layout,
        strip_prefix=plan.strip_prefix,
    )
    result = validate(ctx, plan.source, request)
    probed = any(c["name"] == "probe" and _ran(c) for c in result["checks"])
    if policy.require_probe and result["passed"] and not probed:
        raise ValidationFailed(
            f"refusing to promote {plan.source}: policy [promotion] require_probe = true and "
            f"validation {result['validation_id']} ran no probe",
            "give --model-factory whose module defines probe_loss(model), and a memory budget "
            "the model fits (reg validate --memory-budget), or validate sharded",
        )
    if not result["passed"] or not satisfies_device(policy, result["device"]):
        failed = [f"{c['name']}: {c['detail']}" for c in result["checks"] if not c["passed"]]
        raise ValidationFailed(
            f"refusing to promote {plan.source}: validation "
            f"{result['validation_id']} failed: {'; '.join(failed)}",
            f"reg show {plan.source} and reg validate {plan.source} --json for details",
        )
    with ctx.catalog.session() as s:
        found = s.get(Validation, result["validation_id"])
        assert found is not None
        return found


def _ran(check: dict[str, Any]) -> bool:
    return bool(check.get("passed")) and not str(check.get("detail", "")).startswith("skipped")


def _checked_model(v: Validation) -> bool:
    return any(c.get("name") == "model" and c.get("passed") for c in v.checks)


def _probed(v: Validation) -> bool:
    return any(c.get("name") == "probe" and _ran(c) for c in v.checks)


def _same_names(v: Validation, plan: PromotionPlan) -> bool:
    """A validation whose model or probe check or tied weights named tensors counts only for a
    promotion taking the model from the same path (the names are that path's)."""
    named = any(c.get("name") in ("model", "probe", "tied_weights") for c in v.checks)
    return not named or v.model_path == names_path(plan.resume.model_path, plan.strip_prefix)


def _gate_hint(policy: PromotionPolicy, here: str) -> str | None:
    """The way out for a machine without the device the policy requires: the CPU policy."""
    if policy.require_device == "any" or here == policy.require_device:
        return None
    return (
        'or, to promote without a GPU, use a policy with [promotion] require_device = "any": on'
        " your machine `export REG_POLICY=.../examples/cpu-policy.toml` (reg's source), on a"
        " shared registry add the key to the policy you apply: docs/how-to/cpu-promotion.md"
    )


def _cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())
