"""Release names from a converter (registry/lifecycle/promotion/converters.py): Megatron's
stacked layers as one tensor per layer, a PEFT adapter alone. Pure: names and shapes in."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from registry.errors import UsageError
from registry.formats.dcp import TensorInfo
from registry.lifecycle.promotion.converters import (
    Slice,
    check_llama_config,
    convert,
    converter_for,
)


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
    assert got["decoder.layers.1.mlp.linear_fc1.weight"] == Slice(
        "decoder.layers.mlp.linear_fc1.weight", 1
    )
    assert got["embedding.word_embeddings.weight"] == "embedding.word_embeddings.weight"
    assert len(got) == 2 + 2 * 2
    local = convert("megatron-local", names, tensors(MEGATRON))
    assert local["decoder.layers.0.input_layernorm.weight"] == Slice(
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight", 0
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


LLAMA_CONFIG = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "tie_word_embeddings": False,
}
LLAMA = {
    "embedding.word_embeddings.weight": (64, 32),
    "decoder.layers.input_layernorm.weight": (2, 32),
    "decoder.layers.self_attention.linear_qkv.weight": (2, 64, 32),  # (4 + 2*2) heads x 8
    "decoder.layers.self_attention.linear_proj.weight": (2, 32, 32),
    "decoder.layers.pre_mlp_layernorm.weight": (2, 32),
    "decoder.layers.mlp.linear_fc1.weight": (2, 128, 32),
    "decoder.layers.mlp.linear_fc2.weight": (2, 32, 64),
    "decoder.final_layernorm.weight": (32,),
    "output_layer.weight": (64, 32),
}


def test_a_megatron_llama_becomes_hugging_face_names() -> None:
    """QKV is fused per query group (each group: its q heads, then k, then v; 8 rows a head);
    SwiGLU's first half is the gate."""
    spec = "megatron-llama:heads=4,query_groups=2"
    got = convert(spec, {k: k for k in LLAMA}, tensors(LLAMA), LLAMA_CONFIG)
    qkv = "decoder.layers.self_attention.linear_qkv.weight"
    assert got["model.layers.1.self_attn.q_proj.weight"] == Slice(qkv, 1, ((0, 16), (32, 48)))
    assert got["model.layers.1.self_attn.k_proj.weight"] == Slice(qkv, 1, ((16, 24), (48, 56)))
    assert got["model.layers.1.self_attn.v_proj.weight"] == Slice(qkv, 1, ((24, 32), (56, 64)))
    fc1 = "decoder.layers.mlp.linear_fc1.weight"
    assert got["model.layers.0.mlp.gate_proj.weight"] == Slice(fc1, 0, ((0, 64),))
    assert got["model.layers.0.mlp.up_proj.weight"] == Slice(fc1, 0, ((64, 128),))
    assert got["model.layers.0.post_attention_layernorm.weight"] == Slice(
        "decoder.layers.pre_mlp_layernorm.weight", 0
    )
    assert got["lm_head.weight"] == "output_layer.weight"
    assert len(got) == 3 + 2 * 9  # embed, norm, head; per layer 2 norms, q, k, v, o, 3 mlp


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("megatron-llama", "needs heads, query_groups"),
        ("megatron-llama:heads=4", "needs query_groups"),
        ("megatron-llama:heads=4,query_groups=3", "do not split into 3 query groups"),
        ("megatron-llama:heads=4,query_groups=2,heads=4", "once each"),
        ("megatron-llama:heads=0,query_groups=1", "whole number >= 1"),
        ("megatron-llama:heads=x,query_groups=1", "whole number >= 1"),
        ("megatron-llama:heads=\u00b2,query_groups=1", "whole number >= 1"),  # a digit, not ASCII
        ("megatron-llama:layers=2", "not one of its arguments"),
        ("megatron:heads=4", "it takes none"),
    ],
)
def test_converter_arguments_are_checked(spec: str, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        converter_for("megatron", spec)


def test_converter_arguments_are_recorded_one_way() -> None:
    spec = "megatron-llama:query_groups=2,heads=4"
    assert converter_for("megatron", spec) == "megatron-llama:heads=4,query_groups=2"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"decoder.layers.self_attention.linear_proj.bias": (2, 32)}, "has no Llama name"),
        ({"embedding.position_embeddings.weight": (4, 32)}, "has no Llama name"),
    ],
)
def test_what_a_llama_does_not_have_is_refused(
    extra: dict[str, tuple[int, ...]], message: str
) -> None:
    shapes = {**LLAMA, **extra}
    with pytest.raises(UsageError, match=message):
        convert(
            "megatron-llama:heads=4,query_groups=2",
            {k: k for k in shapes},
            tensors(shapes),
            LLAMA_CONFIG,
        )


def test_a_shape_the_heads_do_not_divide_is_refused() -> None:
    shapes = {**LLAMA, "decoder.layers.self_attention.linear_qkv.weight": (2, 60, 32)}
    with pytest.raises(UsageError, match="60 rows, which 4 heads in 2 query groups"):
        convert(
            "megatron-llama:heads=4,query_groups=2",
            {k: k for k in shapes},
            tensors(shapes),
            LLAMA_CONFIG,
        )


def test_heads_in_the_right_ratio_but_not_the_models_are_refused() -> None:
    """16 heads in 4 groups give a 32-head, 8-group model's shapes exactly, and a scrambled
    Q/K/V: the config.json the release carries must name the same heads."""
    config = {**LLAMA_CONFIG, "num_attention_heads": 32, "num_key_value_heads": 8}
    with pytest.raises(UsageError, match="disagrees with config.json: num_attention_heads 32"):
        check_llama_config("megatron-llama:heads=16,query_groups=4", config)
    with pytest.raises(UsageError, match="needs the model's config.json"):
        check_llama_config("megatron-llama:heads=4,query_groups=2", None)
    check_llama_config("megatron", None)  # the others need none


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"intermediate_size": 128}, "2 x intermediate_size (SwiGLU's gate and up) is 256"),
        ({"hidden_size": 64}, "hidden_size is 64, the checkpoint's 32"),
        ({"head_dim": 16}, "num_attention_heads x head_dim is 64"),
        ({"tie_word_embeddings": True}, "tie_word_embeddings true, and the checkpoint has"),
    ],
)
def test_shapes_that_disagree_with_config_json_are_refused(
    change: dict[str, object], message: str
) -> None:
    with pytest.raises(UsageError, match=re.escape(message)):
        convert(
            "megatron-llama:heads=4,query_groups=2",
            {k: k for k in LLAMA},
            tensors(LLAMA),
            {**LLAMA_CONFIG, **change},
        )


def test_doras_magnitude_is_named_as_peft_saves_it() -> None:
    shapes = {"base_model.model.q_proj.lora_magnitude_vector.default.weight": (32,)}
    got = convert("peft", {k: k for k in shapes}, tensors(shapes))
    assert list(got) == ["base_model.model.q_proj.lora_magnitude_vector"]


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"peft_type": "ADALORA"}, "peft_type ADALORA"),
        ({"peft_type": "LORA", "bias": "all"}, "bias all"),
        ({"peft_type": "LORA", "modules_to_save": ["score"]}, "modules_to_save"),
        ({"peft_type": "LORA", "trainable_token_indices": [1, 2]}, "trainable_token_indices"),
        ({"r": 4}, "names no peft_type"),
    ],
)
def test_an_adapter_training_more_than_its_lora_tensors_is_refused(
    tmp_path: Path, config: dict[str, object], message: str
) -> None:
    """Its other trained tensors (a classification head, biases, AdaLoRA's lora_E) are not
    LoRA tensors: released without them, the adapter would load broken."""
    from registry.lifecycle.promotion.adapters import adapter_base
    from registry.lifecycle.promotion.records import Extra

    path = tmp_path / "adapter_config.json"
    path.write_text(json.dumps(config))
    with pytest.raises(UsageError, match=re.escape(message)):
        adapter_base(None, [Extra(path, "0" * 64)], None)  # type: ignore[arg-type]
    ok = tmp_path / "ok" / "adapter_config.json"
    ok.parent.mkdir()
    ok.write_text(json.dumps({"peft_type": "LORA", "base_model_name_or_path": "b"}))
    base = adapter_base(None, [Extra(ok, "0" * 64)], None)  # type: ignore[arg-type]
    assert (base.name, base.resolved, base.config_names) == ("b", False, None)


def test_a_layer_of_a_big_stacked_chunk_is_read_by_range(tmp_path: Path) -> None:
    """Each layer of a stacked tensor (one 4 MiB chunk, as Megatron writes one stage's layers)
    is that layer's bytes, read by range: the whole chunk is not read once per layer."""
    import torch
    import torch.distributed.checkpoint as dcp

    from registry.formats.dcp_load import read_layer
    from registry.formats.dcp_scan import scan_directory

    stacked = torch.randn(4, 512, 512)
    dcp.save({"decoder": {"layers": {"w": stacked}}}, checkpoint_id=str(tmp_path / "ck"))
    info = scan_directory(tmp_path / "ck").inventory.tensors["decoder.layers.w"]
    assert len(info.chunks) == 1 and info.chunks[0].length > 4 * 512 * 512 * 4

    class Counted:
        read_bytes = 0

        def read(self, path: str, offset: int, length: int) -> bytearray:
            self.read_bytes += length
            with open(tmp_path / "ck" / path, "rb") as f:
                f.seek(offset)
                return bytearray(f.read(length))

    source = Counted()
    for layer in range(4):
        assert torch.equal(read_layer(source, info, layer), stacked[layer])
    # each layer's 1 MiB and each time the chunk's head and tail (1 MiB each): not 4 x 4 MiB
    assert source.read_bytes <= 4 * (3 << 20)
