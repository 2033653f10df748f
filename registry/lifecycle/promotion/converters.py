"""Converters: a release's names when the checkpoint's own are not what a loader takes.

Megatron-core's `torch_dist` checkpoints store each transformer layer's parameters stacked along
a new first axis (`decoder.layers.mlp.linear_fc1.weight` of shape [layers, ...]), under
Transformer Engine's names, while `model.state_dict()` has one tensor per layer. A converter
maps the model's names (release name -> checkpoint key path) to release names and pieces: a
whole tensor (`str`) or one layer of a stacked one, or some of its rows (`Slice`).

  megatron        one tensor per layer, `decoder.layers.{i}.<name>`: what a GPTModel with the
                  Transformer Engine layer spec (Megatron-LM's default) loads
  megatron-local  the same with the local spec's layer-norm names (`input_layernorm.*`,
                  `pre_mlp_layernorm.*` instead of TE's fused `linear_qkv.layer_norm_*`,
                  `linear_fc1.layer_norm_*`): what `get_gpt_layer_local_spec` models load

  megatron-llama:heads=H,query_groups=G
                  Hugging Face's LlamaForCausalLM names for a Llama-shaped GPTModel (RMSNorm,
                  SwiGLU, RoPE, no biases): the fused QKV split per query group into q_proj,
                  k_proj, v_proj, SwiGLU's linear_fc1 into gate_proj (its first half, the one
                  through the activation) and up_proj. The checkpoint's args are not read, so
                  the model's shape is given, and recorded with the converter.

  peft            a LoRA adapter alone, as PEFT's save_pretrained writes it: the adapter's
                  tensors (the frozen base weights left out), named without the adapter's
                  name, in adapter_model.safetensors beside its adapter_config.json

The Megatron layout takes `megatron` unless `--convert` names another. The converter is part of
what makes two promotions the same, and the release records it.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from registry.errors import UsageError
from registry.formats.dcp import TensorInfo


@dataclass(frozen=True, slots=True)
class Slice:
    """One layer of a stacked tensor, or some of its rows (ranges concatenated in order)."""

    key: str
    layer: int
    rows: tuple[tuple[int, int], ...] = ()


Piece = str | Slice  # a checkpoint key path whole, or a slice of one

LAYERS = "decoder.layers."
# Transformer Engine's fused layer-norm names -> the local spec's
LOCAL_NAMES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias",
}
CONVERTERS = ("megatron", "megatron-local", "megatron-llama", "peft")
# each converter's arguments (whole numbers, all required)
ARGUMENTS: dict[str, tuple[str, ...]] = {"megatron-llama": ("heads", "query_groups")}
MEGATRON_CONVERTERS = ("megatron", "megatron-local", "megatron-llama")
# PEFT's tensors of one adapter: `<module>.lora_A.<adapter>.weight`, saved by save_pretrained
# (get_peft_model_state_dict) without the adapter's name
ADAPTER_PARTS = frozenset(
    {"lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector"}
)
ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
DEFAULTS = {"megatron": "megatron"}  # layout -> the converter it takes unless told


def check_converter(text: str | None) -> str | None:
    """A `--convert` value, written the one way it is recorded: NAME, or NAME:k=v,... with the
    converter's arguments sorted."""
    if text is None:
        return None
    name, args = parse_converter(text)
    if not args:
        return name
    return f"{name}:" + ",".join(f"{k}={v}" for k, v in sorted(args.items()))


def parse_converter(text: str) -> tuple[str, dict[str, int]]:
    name, _, given = text.partition(":")
    if name not in CONVERTERS:
        raise UsageError(
            f"unknown converter {name[:80]!r}", f"choose one of {', '.join(CONVERTERS)}"
        )
    wanted = ARGUMENTS.get(name, ())
    args: dict[str, int] = {}
    for item in given.split(",") if given else []:
        key, eq, value = item.partition("=")
        if not eq or key not in wanted or key in args:
            raise UsageError(
                f"--convert {name}: {item[:80]!r} is not one of its arguments, once each",
                f"it takes {', '.join(f'{w}=N' for w in wanted)}" if wanted else "it takes none",
            )
        if not (re.fullmatch(r"[0-9]{1,6}", value) and int(value) >= 1):
            raise UsageError(f"--convert {name}: {key} must be a whole number >= 1")
        args[key] = int(value)
    missing = [w for w in wanted if w not in args]
    if missing:
        raise UsageError(
            f"--convert {name} needs {', '.join(missing)}",
            f"e.g. --convert {name}:" + ",".join(f"{w}=N" for w in wanted),
        )
    if name == "megatron-llama" and args["heads"] % args["query_groups"]:
        raise UsageError(
            f"--convert {name}: {args['heads']} heads do not split into "
            f"{args['query_groups']} query groups"
        )
    return name, args


def converter_for(layout: str, given: str | None) -> str | None:
    """The converter a promotion of a checkpoint of `layout` uses: the Megatron ones read its
    stacked layers, so one of them given for another layout is refused."""
    given = check_converter(given)
    if given is None:
        return DEFAULTS.get(layout)
    if given.partition(":")[0] in MEGATRON_CONVERTERS and layout != "megatron":
        raise UsageError(
            f"--convert {given} reads Megatron's stacked layers; this checkpoint is {layout}",
            "leave --convert out, or force --layout megatron if Megatron-core saved it",
        )
    return given


def convert(
    converter: str | None,
    names: Mapping[str, str],
    tensors: Mapping[str, TensorInfo],
    config: Mapping[str, Any] | None = None,
) -> dict[str, Piece]:
    """Release name -> piece, for the model's `names` (release name -> key path). `config`:
    the release's config.json, which megatron-llama's shapes must agree with."""
    if converter is None:
        return dict(names)
    out: dict[str, Piece] = {}
    for name, piece in _converted(converter, names, tensors, config or {}):
        if name in out:  # two tensors under one name: the release would lose one
            raise UsageError(
                f"--convert {converter}: {piece_key(out[name])} and {piece_key(piece)} both "
                f"become {name}",
                "promote without --convert, or with the converter for this model's names",
            )
        out[name] = piece
    return out


def _converted(
    converter: str,
    names: Mapping[str, str],
    tensors: Mapping[str, TensorInfo],
    config: Mapping[str, Any],
) -> Iterator[tuple[str, Piece]]:
    name, args = parse_converter(converter)
    if name == "peft":
        yield from adapter_names(names)
        return
    if name == "megatron-llama":
        check_llama_shapes(names, tensors, config, args["heads"])
        yield from _llama(names, tensors, args["heads"], args["query_groups"])
        return
    local = name == "megatron-local"
    layers = _layer_count(names, tensors)
    for key, fqn in names.items():
        if not key.startswith(LAYERS):
            yield key, fqn
            continue
        rest = key[len(LAYERS) :]
        rest = LOCAL_NAMES.get(rest, rest) if local else rest
        for i in range(layers):
            yield f"{LAYERS}{i}.{rest}", Slice(fqn, i)


# Megatron's names (either layer spec) -> LlamaForCausalLM's
LLAMA_TOP = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}
LLAMA_LAYER = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}
QKV, FC1 = "self_attention.linear_qkv.weight", "mlp.linear_fc1.weight"


def _llama(
    names: Mapping[str, str], tensors: Mapping[str, TensorInfo], heads: int, groups: int
) -> Iterator[tuple[str, Piece]]:
    layers = _layer_count(names, tensors)
    for key, fqn in names.items():
        if key in LLAMA_TOP:
            yield LLAMA_TOP[key], fqn
            continue
        rest = key[len(LAYERS) :] if key.startswith(LAYERS) else None
        if rest not in LLAMA_LAYER and rest not in (QKV, FC1):
            raise UsageError(
                f"--convert megatron-llama: {key} has no Llama name (a bias, a learned "
                "position embedding or another architecture's tensor)",
                "promote a Llama-shaped model (RMSNorm, SwiGLU, RoPE, no biases), or use "
                "--convert megatron",
            )
        rows = tensors[fqn].shape[1] if len(tensors[fqn].shape) > 1 else 0
        for i in range(layers):
            at = f"model.layers.{i}."
            if rest == QKV:
                for proj, ranges in _qkv_rows(key, rows, heads, groups).items():
                    yield f"{at}self_attn.{proj}.weight", Slice(fqn, i, ranges)
            elif rest == FC1:
                if rows % 2:
                    raise UsageError(f"{key} has {rows} rows: no SwiGLU halves")
                half = rows // 2
                yield f"{at}mlp.gate_proj.weight", Slice(fqn, i, ((0, half),))
                yield f"{at}mlp.up_proj.weight", Slice(fqn, i, ((half, rows),))
            else:
                yield f"{at}{LLAMA_LAYER[str(rest)]}", Slice(fqn, i)


def check_llama_config(converter: str, config: Mapping[str, Any] | None) -> None:
    """megatron-llama's release is a Hugging Face folder: its config.json is required, and its
    heads and key-value heads must be the converter's (a ratio alone would load, scrambled)."""
    name, args = parse_converter(converter)
    if name != "megatron-llama":
        return
    if config is None:
        raise UsageError(
            "--convert megatron-llama needs the model's config.json as an --extra",
            "its shape is checked against the checkpoint's, and from_pretrained reads it",
        )
    heads = config.get("num_attention_heads")
    kv = config.get("num_key_value_heads", heads)
    if (heads, kv) != (args["heads"], args["query_groups"]):
        raise UsageError(
            f"--convert {converter} disagrees with config.json: num_attention_heads {heads}, "
            f"num_key_value_heads {kv}",
            "give the model's heads and query groups, as its config.json has them",
        )


def check_llama_shapes(
    names: Mapping[str, str],
    tensors: Mapping[str, TensorInfo],
    config: Mapping[str, Any],
    heads: int,
) -> None:
    """The checkpoint's shapes against config.json: hidden size, head size, the SwiGLU width,
    and an lm_head exactly when the embeddings are not tied."""

    def dims(rest: str) -> tuple[int, ...]:
        fqn = names.get(LAYERS + rest)
        return tensors[fqn].shape[1:] if fqn is not None else ()

    hidden, ffn = config.get("hidden_size"), config.get("intermediate_size")
    head_dim = config.get("head_dim") or (hidden // heads if isinstance(hidden, int) else None)
    qkv, proj = dims(QKV), dims("self_attention.linear_proj.weight")
    fc1, fc2 = dims(FC1), dims("mlp.linear_fc2.weight")
    checks = {
        "hidden_size": (hidden, qkv[1:] and qkv[1]),
        "num_attention_heads x head_dim": (
            heads * head_dim if isinstance(head_dim, int) else None,
            proj[1:] and proj[1],
        ),
        "2 x intermediate_size (SwiGLU's gate and up)": (
            2 * ffn if isinstance(ffn, int) else None,
            fc1[:1] and fc1[0],
        ),
        "intermediate_size": (ffn, fc2[1:] and fc2[1]),
    }
    for what, (want, got) in checks.items():
        if want != got:
            raise UsageError(
                f"--convert megatron-llama: config.json's {what} is {want}, the checkpoint's "
                f"{got or 'missing'}",
                "give the config.json of this model (a non-gated MLP is no Llama)",
            )
    tied = bool(config.get("tie_word_embeddings", False))
    if tied == ("output_layer.weight" in names):
        raise UsageError(
            "--convert megatron-llama: config.json says tie_word_embeddings "
            f"{str(tied).lower()}, and the checkpoint {'has' if tied else 'has no'} "
            "output_layer.weight",
            "give the config.json of this model",
        )


def _qkv_rows(
    key: str, rows: int, heads: int, groups: int
) -> dict[str, tuple[tuple[int, int], ...]]:
    """Megatron fuses QKV per query group: for each group, its heads' q rows, then its k, then
    its v (head_dim rows each). Which rows are q_proj's, k_proj's and v_proj's."""
    per_group = heads // groups + 2
    if rows % (groups * per_group):
        raise UsageError(
            f"--convert megatron-llama: {key} has {rows} rows, which {heads} heads in {groups} "
            "query groups do not divide",
            "give the model's heads and query groups (num_attention_heads, num_query_groups)",
        )
    dim = rows // (groups * per_group)
    block, q = per_group * dim, (per_group - 2) * dim
    return {
        "q_proj": tuple((g * block, g * block + q) for g in range(groups)),
        "k_proj": tuple((g * block + q, g * block + q + dim) for g in range(groups)),
        "v_proj": tuple((g * block + q + dim, (g + 1) * block) for g in range(groups)),
    }


def check_adapter(names: Mapping[str, str]) -> None:
    """UsageError unless `names` (release name -> key path) hold one adapter that converts
    without two tensors under one name: decided from names alone, before any validation."""
    convert("peft", names, {})


def adapter_names(names: Mapping[str, str]) -> list[tuple[str, str]]:
    """The adapter's tensors among the model's, named as PEFT's save_pretrained names them (the
    adapter's name left out): `...q_proj.lora_A.default.weight` -> `...q_proj.lora_A.weight`
    (the Trainer's FSDP save has them so already). The frozen base weights stay out: the
    release is the adapter alone."""
    out: list[tuple[str, str]] = []
    adapters: set[str] = set()
    for name, fqn in names.items():
        parts = name.split(".")
        for i, part in enumerate(parts):
            if part not in ADAPTER_PARTS:
                continue
            rest = parts[i + 1 :]
            if rest and rest not in (["weight"], ["bias"]):  # the adapter's name, then weight
                adapters.add(rest[0])
                rest = rest[1:]
            if part == "lora_magnitude_vector":  # DoRA's: PEFT saves it without ".weight"
                rest = [r for r in rest if r != "weight"]
            out.append((".".join([*parts[: i + 1], *rest]), fqn))
            break
    if not out:
        raise UsageError(
            "the model holds no LoRA tensors (lora_A, lora_B): nothing to release as an adapter",
            "promote without --convert peft",
        )
    if len(adapters) > 1:
        raise UsageError(
            f"the model holds {len(adapters)} adapters ({', '.join(sorted(adapters))}); an "
            "adapter release holds one",
            "train (or save) one adapter per checkpoint",
        )
    return out


def _layer_count(names: Mapping[str, str], tensors: Mapping[str, TensorInfo]) -> int:
    """The stacked axis every `decoder.layers.*` tensor shares."""
    counts = {
        name: tensors[fqn].shape[0] if tensors[fqn].shape else 0
        for name, fqn in names.items()
        if name.startswith(LAYERS)
    }
    found = set(counts.values())
    if len(found) > 1 or 0 in found:
        odd = min(counts, key=lambda n: (counts[n], n))
        raise UsageError(
            f"the layer tensors are not stacked alike ({odd} has {counts[odd]} on its first "
            f"axis, others {max(found)})",
            "promote without --convert, or check the checkpoint was saved by Megatron-core",
        )
    return found.pop() if found else 0


def piece_shape(piece: Piece, tensors: Mapping[str, TensorInfo]) -> tuple[int, ...]:
    if isinstance(piece, str):
        return tensors[piece].shape
    shape = tensors[piece.key].shape[1:]
    if not piece.rows:
        return shape
    return (sum(b - a for a, b in piece.rows), *shape[1:])


def piece_key(piece: Piece) -> str:
    return piece if isinstance(piece, str) else piece.key
