"""Validation, promotion and release commands."""

from __future__ import annotations

from pathlib import Path

import typer

from cli.common import JSON_OPTION, LAYOUT_OPTION, STRIP_PREFIX_OPTION, open_registry
from cli.render import emit_json, note, plural, progress_for, table
from cli.workflow import show_request
from registry.errors import UsageError

alias_app = typer.Typer(help="Move release aliases (prod, canary, ...).", no_args_is_help=True)


def register(app: typer.Typer) -> None:
    app.command("validate")(validate)
    app.command("promote")(promote)
    app.command("releases")(releases)
    app.command("pull-release")(pull_release)
    app.command("fetch-release")(fetch_release)
    app.add_typer(alias_app, name="alias")
    alias_app.command("set")(alias_set)
    app.command("deprecate")(deprecate)
    app.command("yank")(yank)


def validate(
    ref: str = typer.Argument(..., help="RUN@stepN or RUN@latest."),
    device: str = typer.Option("auto", "--device", help="cuda, cpu or auto."),
    world_size: int = typer.Option(
        1,
        "--world-size",
        help="Restore on this many ranks as the factory's parallelize(model, mesh) shards it.",
    ),
    model_factory: str | None = typer.Option(
        None,
        "--model-factory",
        help="module:function building the model (key, shape and dtype match; probe).",
    ),
    memory_budget: str | None = typer.Option(
        None,
        "--memory-budget",
        help="Memory to validate within, e.g. 8GiB (default: half the GPU's free memory, a "
        "quarter of free RAM on CPU).",
    ),
    with_optimizer: bool = typer.Option(
        False,
        "--with-optimizer",
        help="With --world-size: restore the optimizer too (the module's build_optimizer).",
    ),
    layout: str | None = LAYOUT_OPTION,
    strip_prefix: str | None = STRIP_PREFIX_OPTION,
    json_output: bool = JSON_OPTION,
) -> None:
    """Prove a checkpoint restores: integrity, load, reshard, finite, resume state, probe."""
    from policies.gates import ADVISORY_CHECKS

    with open_registry() as reg:
        out = reg.validate(
            ref,
            device=device,
            world_size=world_size,
            model_factory=model_factory,
            progress=progress_for(json_output),
            layout=layout,
            strip_prefix=strip_prefix,
            memory_budget=memory_budget,
            with_optimizer=with_optimizer,
        )
    if json_output:
        emit_json(out)
    else:
        for c in out.checks:
            mark = "ok  " if c["passed"] else "note" if c["name"] in ADVISORY_CHECKS else "FAIL"
            print(f"  {mark} {c['name']:<13} {c['detail']}")
        for s in out.get("suggestions", []):
            print(f"  hint {'':<13} {s}")
        verdict = "passed" if out.passed else "FAILED"
        driver = f", driver {out.driver}" if out.driver else ""
        print(
            f"{out.ref}: validation {out.validation_id} {verdict} on {out.device} "
            f"({out.device_name}{driver}), {out.mode}, restore {out.seconds:.2f}s at "
            f"world size {out.world_size}"
        )
    if not out.passed:
        from registry.errors import ValidationFailed

        failed = next(c for c in out.checks if not c["passed"] and c["name"] not in ADVISORY_CHECKS)
        raise ValidationFailed(f"{out.ref} failed validation: {failed['name']}: {failed['detail']}")


def promote(
    ref: str = typer.Argument(..., help="RUN@stepN or RUN@latest."),
    model: str = typer.Option(..., "--model", help="Model name of the release."),
    alias: str | None = typer.Option(None, "--alias", help="Point this alias at the release."),
    dtype: str | None = typer.Option(None, "--dtype", help="bf16, fp16 or fp32 (floats only)."),
    max_shard_size: str = typer.Option(
        "5GB", "--max-shard-size", help="Split into HF-style shards above this size."
    ),
    extra: list[Path] = typer.Option([], "--extra", help="Add a file (config.json, tokenizer)."),
    model_factory: str | None = typer.Option(
        None, "--model-factory", help="module:function for validation (tied weights, probe)."
    ),
    layout: str | None = LAYOUT_OPTION,
    strip_prefix: str | None = STRIP_PREFIX_OPTION,
    allow_unclassified: bool = typer.Option(
        False,
        "--allow-unclassified",
        help="Leave tensors no resume class claims out of the release (else refused).",
    ),
    convert: str | None = typer.Option(
        None,
        "--convert",
        help="Name converter: megatron (the default for Megatron checkpoints: one tensor per "
        "layer, Transformer Engine names), megatron-local (the local spec's names), "
        "megatron-llama:heads=H,query_groups=G (Hugging Face's LlamaForCausalLM names), or peft "
        "(a LoRA adapter alone, with --extra adapter_config.json).",
    ),
    base: str | None = typer.Option(
        None, "--base", help="An adapter's base model: a release, NAME@ALIAS or NAME:vK."
    ),
    json_output: bool = JSON_OPTION,
) -> None:
    """Turn a validated checkpoint into an immutable safetensors release."""
    with open_registry() as reg:
        out = reg.promote(
            ref,
            model=model,
            alias=alias,
            dtype=dtype,
            max_shard_size=max_shard_size,
            extras=list(extra),
            model_factory=model_factory,
            progress=progress_for(json_output),
            layout=layout,
            strip_prefix=strip_prefix,
            allow_unclassified=allow_unclassified,
            convert=convert,
            base=base,
        )
    warning = out.hf_warning()
    if warning:
        note(f"{out.release}: {warning}")
    if json_output:
        emit_json(out)
        return
    verb = "already released as" if out.existing else "promoted to"
    aliases = f" ({', '.join('@' + a for a in out.aliases)})" if out.aliases else ""
    print(
        f"{out.source} {verb} {out.release}{aliases}: {plural(len(out.files), 'file')}, "
        f"sha256 {out.sha256}"
    )
    print(f"  {out.get('uri', '')}")
    for key, change in ((out.hf_config or {}).get("rewritten") or {}).items():
        print(f"  config.json {key}: {change['from']!r} -> {change['to']!r}")
    if out.code_extras:
        print(f"  code (policy allow_code_extras): {', '.join(out.code_extras)}")


def releases(
    name: str | None = typer.Argument(None, help="Only this model."),
    json_output: bool = JSON_OPTION,
) -> None:
    """List releases with their status, aliases and source."""
    with open_registry() as reg:
        rows = reg.releases(name)
    if json_output:
        emit_json(rows)
        return
    table(
        ["RELEASE", "STATUS", "ALIASES", "SOURCE", "VALIDATED ON", "SHA256"],
        [
            [
                r.release,
                r.status,
                ",".join(r.aliases),
                r.source,
                (r.validation or {}).get("device", ""),
                (r.sha256 or "")[:16],
            ]
            for r in rows
        ],
    )


def pull_release(
    ref: str = typer.Argument(..., help="MODEL:vK or MODEL@ALIAS."),
    dest: Path = typer.Argument(..., help="A new or empty directory."),
    verify_signature: bool = typer.Option(
        False,
        "--verify-signature",
        help="Refuse the release unless it is signed by --public-key over exactly its files.",
    ),
    public_key: Path | None = typer.Option(
        None, "--public-key", help="The PEM public key you pinned (reg keys public)."
    ),
    json_output: bool = JSON_OPTION,
) -> None:
    """Copy a release out, verifying every file (and with --verify-signature its signature)."""
    from registry.api.offline import read_public_key

    if verify_signature != (public_key is not None):
        raise UsageError(
            "--verify-signature and --public-key go together",
            "pin the registry's key once (reg keys public > reg.pub), then pass both",
        )
    pem = read_public_key(public_key) if public_key is not None else None
    with open_registry() as reg:
        out = reg.pull_release(ref, dest, public_key=pem, progress=progress_for(json_output))
    signed = ", signature verified" if pem else ""
    emit_json(out) if json_output else print(
        f"pulled {out.release} into {out.dest} "
        f"({plural(len(out.files) + 1, 'file')} verified{signed})"
    )


def fetch_release(
    ref: str = typer.Argument(..., help="MODEL@ALIAS or MODEL:vK."),
    public_key: Path | None = typer.Option(
        None,
        "--public-key",
        help="Refuse the release unless this pinned PEM key signed exactly its files.",
    ),
    cache_dir: Path | None = typer.Option(
        None, "--cache-dir", help="The cache to keep it in (default REG_CACHE_DIR)."
    ),
    hf: bool = typer.Option(
        False,
        "--hf",
        help="Lay it out in the Hugging Face hub cache (HF_HUB_CACHE, else HF_HOME/hub, else "
        "~/.cache/huggingface/hub) for from_pretrained(MODEL, local_files_only=True).",
    ),
    hf_cache: Path | None = typer.Option(
        None, "--hf-cache", help="As --hf, in this hub cache directory."
    ),
    json_output: bool = JSON_OPTION,
) -> None:
    """Print the path of a verified local copy of a release, pulled once per release.json
    digest and reused after (`$(reg fetch-release NAME@prod)`)."""
    from registry.api.consumers.hf_cache import default_hub_cache
    from registry.api.offline import read_public_key

    if cache_dir is not None and (hf or hf_cache is not None):
        raise UsageError(
            "--cache-dir names reg's cache, --hf and --hf-cache the Hugging Face one",
            "give one of them",
        )
    hub = hf_cache if hf_cache is not None else default_hub_cache() if hf else None
    pem = read_public_key(public_key) if public_key is not None else None
    with open_registry() as reg:
        out = reg.fetch_release(
            ref,
            public_key=pem,
            cache_dir=cache_dir,
            hf_cache=hub,
            progress=progress_for(json_output),
        )
    emit_json(out) if json_output else print(out.path)


def alias_set(
    name: str = typer.Argument(..., help="Model name."),
    alias: str = typer.Argument(..., help="Alias, e.g. prod."),
    version: str = typer.Argument(..., help="Version, e.g. v3."),
    json_output: bool = JSON_OPTION,
) -> None:
    """Point ALIAS of model NAME at version vK (recorded in the alias history). Where the
    policy protects the alias, open a request for approval instead (reg approve)."""
    from registry.api.results import AliasRequest

    with open_registry() as reg:
        out = reg.set_alias(name, alias, version)
    if json_output:
        emit_json(out)
    elif isinstance(out, AliasRequest):
        show_request(out)
    else:
        print(
            f"{name}@{alias} -> {out.release}" + (f" (was {out.previous})" if out.previous else "")
        )


def deprecate(
    ref: str = typer.Argument(..., help="MODEL:vK or MODEL@ALIAS."),
    reason: str | None = typer.Option(None, "--reason", help="Why (recorded and shown)."),
    json_output: bool = JSON_OPTION,
) -> None:
    """Mark a release deprecated (still pullable; bytes never change)."""
    with open_registry() as reg:
        out = reg.deprecate(ref, reason)
    emit_json(out) if json_output else print(f"{out.release} is deprecated")


def yank(
    ref: str = typer.Argument(..., help="MODEL:vK."),
    reason: str = typer.Option(..., "--reason", help="Why (recorded and shown)."),
    json_output: bool = JSON_OPTION,
) -> None:
    """Yank a release (admin): it can no longer be pulled or aliased; bytes stay."""
    with open_registry() as reg:
        out = reg.yank(ref, reason)
    emit_json(out) if json_output else print(f"{out.release} is yanked: {reason}")
