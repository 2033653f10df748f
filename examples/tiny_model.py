"""A tiny language model for the demo and the tests, and its model factory for `reg validate`.

Factory contract (`--model-factory examples.tiny_model:build_model`): the function returns an
`nn.Module` whose `state_dict()` names match the checkpoint's model tensors; the same module
defines `probe_loss(model) -> float`, the loss on a fixed probe batch. For `reg validate
--world-size M` it also says how training shards the model, `parallelize(model, mesh)`, and
builds its optimizer, `build_optimizer(model)` (train_tiny.py trains with exactly these).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

VOCAB = 256


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class TinyLM(nn.Module):
    def __init__(self, dim: int = 64, layers: int = 2, tie: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        nn.init.normal_(self.embed.weight, std=0.02)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, VOCAB, bias=False)
        if tie:
            self.lm_head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm(x))


def build_model() -> TinyLM:
    """Model factory: the shape comes from the environment the demo trains with."""
    return TinyLM(
        dim=int(os.environ.get("TINY_DIM", "64")),
        layers=int(os.environ.get("TINY_LAYERS", "2")),
        tie=os.environ.get("TINY_TIE", "1") == "1",
    )


def parallelize(model: TinyLM, mesh: Any = None) -> TinyLM:
    """FSDP2 as training applies it: each block, then the whole model (on `mesh`, or the
    default one over every rank)."""
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def build_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def batch(seed: int, size: int = 8, length: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (size, length + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def loss_on(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(inputs)
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


@torch.no_grad()
def probe_loss(model: nn.Module) -> float:
    device = next(model.parameters()).device
    inputs, targets = batch(seed=12345)
    return float(loss_on(model.eval(), inputs.to(device), targets.to(device)))
