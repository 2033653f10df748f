"""Release names from a converter (registry/lifecycle/promotion/converters.py): Megatron's
stacked layers as one tensor per layer, a PEFT adapter alone. Pure: names and shapes in."""

from __future__ import annotations

import pytest

from registry.errors import UsageError
from registry.formats.dcp import TensorInfo
from registry.lifecycle.promotion.converters import convert, converter_for


def tensors(shapes: dict[str, tuple[int, ...]]) -> dict[str, TensorInfo]:
    return {k: TensorInfo(k, "float32", s, 0) for k, s in shapes.items()}


MEGATRON = {
    "embedding.word_embeddings.weight": (64, 32),
    "decoder.layers.mlp.linear_fc1.weight": (2, 128, 32),
    "decoder.layers.self_attention.linear_qkv.layer_norm_weight": (2, 32),
    "decoder.final_layernorm.weight": (32,),
}


def test_megatron_layers_become_one_tensor_each() -> None:
    names = {k: k for k in MEGATRON}
    got = convert("megatron", names, tensors(MEGATRON))
    assert got["decoder.layers.1.mlp.linear_fc1.weight"] == (
        "decoder.layers.mlp.linear_fc1.weight",
        1,
    )
    assert got["embedding.word_embeddings.weight"] == "embedding.word_embeddings.weight"
    assert len(got) == 2 + 2 * 2
    local = convert("megatron-local", names, tensors(MEGATRON))
    assert local["decoder.layers.0.input_layernorm.weight"] == (
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight",
        0,
    )


def test_layers_stacked_unalike_are_refused() -> None:
    shapes = {**MEGATRON, "decoder.layers.mlp.linear_fc2.weight": (3, 32, 128)}
    with pytest.raises(UsageError, match="not stacked alike"):
        convert("megatron", {k: k for k in shapes}, tensors(shapes))


def test_two_tensors_under_one_release_name_are_refused() -> None:
    """A checkpoint holding both Transformer Engine's and the local spec's layer-norm names:
    megatron-local would write two tensors under one name and lose one."""
    shapes = {**MEGATRON, "decoder.layers.input_layernorm.weight": (2, 32)}
    with pytest.raises(UsageError, match="both become decoder.layers.0.input_layernorm.weight"):
        convert("megatron-local", {k: k for k in shapes}, tensors(shapes))


PEFT = {
    "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight": (32, 32),
    "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight": (4, 32),
    "base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.weight": (32, 4),
    "base_model.model.model.embed_tokens.lora_embedding_A.default": (4, 64),
}


def test_an_adapter_is_its_lora_tensors_without_the_adapters_name() -> None:
    got = convert("peft", {k: k for k in PEFT}, tensors(PEFT))
    assert sorted(got) == [
        "base_model.model.model.embed_tokens.lora_embedding_A",
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight",
    ]
    # the Trainer's FSDP save names them as PEFT saves them already
    saved = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": (4, 32)}
    assert list(convert("peft", {k: k for k in saved}, tensors(saved))) == list(saved)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"base_model.model.x.lora_A.other.weight": (4, 32)}, "holds 2 adapters"),
        ({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": (4, 32)},
         "both become base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"),
    ],
)  # fmt: skip
def test_adapters_that_would_mix_or_collide_are_refused(
    extra: dict[str, tuple[int, ...]], message: str
) -> None:
    shapes = {**PEFT, **extra}
    with pytest.raises(UsageError, match=message):
        convert("peft", {k: k for k in shapes}, tensors(shapes))


def test_no_lora_tensor_is_no_adapter() -> None:
    with pytest.raises(UsageError, match="holds no LoRA tensors"):
        convert("peft", {"w": "w"}, tensors({"w": (2,)}))


def test_which_converter_a_layout_takes() -> None:
    assert converter_for("megatron", None) == "megatron"
    assert converter_for("megatron", "megatron-local") == "megatron-local"
    assert converter_for("transformers", None) is None
    assert converter_for("transformers", "peft") == "peft"
    with pytest.raises(UsageError, match="reads Megatron's stacked layers"):
        converter_for("dcp", "megatron")
    with pytest.raises(UsageError, match="unknown converter 'gguf'"):
        converter_for("dcp", "gguf")
