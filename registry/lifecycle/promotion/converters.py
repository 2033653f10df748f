"""Converters: a release's names when the checkpoint's own are not what a loader takes.

Megatron-core's `torch_dist` checkpoints store each transformer layer's parameters stacked along
a new first axis (`decoder.layers.mlp.linear_fc1.weight` of shape [layers, ...]), under
Transformer Engine's names, while `model.state_dict()` has one tensor per layer. A converter
maps the model's names (release name -> checkpoint key path) to release names and pieces: a
whole tensor (`str`) or one layer of a stacked one (`(key path, layer)`).

  megatron        one tensor per layer, `decoder.layers.{i}.<name>`: what a GPTModel with the
                  Transformer Engine layer spec (Megatron-LM's default) loads
  megatron-local  the same with the local spec's layer-norm names (`input_layernorm.*`,
                  `pre_mlp_layernorm.*` instead of TE's fused `linear_qkv.layer_norm_*`,
                  `linear_fc1.layer_norm_*`): what `get_gpt_layer_local_spec` models load

  peft            a LoRA adapter alone, as PEFT's save_pretrained writes it: the adapter's
                  tensors (the frozen base weights left out), named without the adapter's
                  name, in adapter_model.safetensors beside its adapter_config.json

The Megatron layout takes `megatron` unless `--convert` names another. The converter is part of
what makes two promotions the same, and the release records it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from registry.errors import UsageError
from registry.formats.dcp import TensorInfo

Piece = str | tuple[str, int]  # a checkpoint key path, or one layer of a stacked one

LAYERS = "decoder.layers."
# Transformer Engine's fused layer-norm names -> the local spec's
LOCAL_NAMES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias",
}
CONVERTERS = ("megatron", "megatron-local", "peft")
MEGATRON_CONVERTERS = ("megatron", "megatron-local")
# PEFT's tensors of one adapter: `<module>.lora_A.<adapter>.weight`, saved by save_pretrained
# (get_peft_model_state_dict) without the adapter's name
ADAPTER_PARTS = frozenset(
    {"lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector"}
)
ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
DEFAULTS = {"megatron": "megatron"}  # layout -> the converter it takes unless told


def check_converter(name: str | None) -> str | None:
    if name is None or name in CONVERTERS:
        return name
    raise UsageError(f"unknown converter {name!r}", f"choose one of {', '.join(CONVERTERS)}")


def converter_for(layout: str, given: str | None) -> str | None:
    """The converter a promotion of a checkpoint of `layout` uses: every converter reads
    Megatron's stacked layers, so one given for another layout is refused."""
    if check_converter(given) is None:
        return DEFAULTS.get(layout)
    if given in MEGATRON_CONVERTERS and layout != "megatron":
        raise UsageError(
            f"--convert {given} reads Megatron's stacked layers; this checkpoint is {layout}",
            "leave --convert out, or force --layout megatron if Megatron-core saved it",
        )
    return given


def convert(
    converter: str | None, names: Mapping[str, str], tensors: Mapping[str, TensorInfo]
) -> dict[str, Piece]:
    """Release name -> piece, for the model's `names` (release name -> key path)."""
    if converter is None:
        return dict(names)
    out: dict[str, Piece] = {}
    for name, piece in _converted(converter, names, tensors):
        if name in out:  # two tensors under one name: the release would lose one
            raise UsageError(
                f"--convert {converter}: {piece_key(out[name])} and {piece_key(piece)} both "
                f"become {name}",
                "promote without --convert, or with the converter for this model's names",
            )
        out[name] = piece
    return out


def _converted(
    converter: str, names: Mapping[str, str], tensors: Mapping[str, TensorInfo]
) -> Iterator[tuple[str, Piece]]:
    if converter == "peft":
        yield from adapter_names(names)
        return
    local = converter == "megatron-local"
    layers = _layer_count(names, tensors)
    for name, fqn in names.items():
        if not name.startswith(LAYERS):
            yield name, fqn
            continue
        rest = name[len(LAYERS) :]
        rest = LOCAL_NAMES.get(rest, rest) if local else rest
        for i in range(layers):
            yield f"{LAYERS}{i}.{rest}", (fqn, i)


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
    return tensors[piece[0]].shape[1:]


def piece_key(piece: Piece) -> str:
    return piece if isinstance(piece, str) else piece[0]
