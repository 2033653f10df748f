"""Tiny Hugging Face causal LMs built from a config (nothing downloaded), and their model
factories for `reg validate` / `reg promote --model-factory examples.hf_models:llama_tied`.

Each factory returns a transformers `PreTrainedModel`, so promotion knows the class for
config.json's `architectures`; `parallelize(model, mesh)` is how train_hf.py shards it (FSDP2,
each decoder layer then the whole model: tied embeddings stay in the root group).
"""

from __future__ import annotations

from typing import Any

VOCAB = 128


def llama_config(tie: bool) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
    )


def gpt2_config(tie: bool) -> Any:
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=VOCAB,
        n_positions=64,
        n_embd=32,
        n_layer=2,
        n_head=4,
        bos_token_id=0,
        eos_token_id=0,
        tie_word_embeddings=tie,
    )


CONFIGS = {
    "llama_tied": lambda: llama_config(True),
    "llama_untied": lambda: llama_config(False),
    "gpt2_tied": lambda: gpt2_config(True),
    "gpt2_untied": lambda: gpt2_config(False),
}


def build(name: str) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(CONFIGS[name]())


def llama_tied() -> Any:
    return build("llama_tied")


def llama_untied() -> Any:
    return build("llama_untied")


def gpt2_tied() -> Any:
    return build("gpt2_tied")


def gpt2_untied() -> Any:
    return build("gpt2_untied")


def layers(model: Any) -> Any:
    return model.model.layers if hasattr(model, "model") else model.transformer.h


def parallelize(model: Any, mesh: Any = None) -> Any:
    from torch.distributed.fsdp import fully_shard

    for layer in layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def tokens(seed: int, size: int = 4, length: int = 16) -> Any:
    """A fixed batch of token ids."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (size, length), generator=g)
