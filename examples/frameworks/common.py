"""What the framework examples share: a tiny model, data that is a function of the step, and
the files a test compares (exact losses, the model's own full state_dict).

Each example trains on CPU with 2 processes (gloo), shards with FSDP2 and checkpoints with the
framework's own save code; the same command line resumes from a checkpoint directory:

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m examples.frameworks.X \\
        --out DIR --steps N --save-at K [--resume CKPT_DIR] --losses FILE.json \\
        [--export-model FILE.pt]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

VOCAB, DIM, BATCH, SEQ = 64, 32, 8, 4
SEED = 1234


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.fc1 = nn.Linear(DIM, DIM)
        self.out = nn.Linear(DIM, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.fc1(self.embed(x))))


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of `step` (1-based) on `rank`: the same wherever a run resumes."""
    g = torch.Generator().manual_seed(SEED * 1_000_003 + step * 1009 + rank)
    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return x, (x * 7 + 3) % VOCAB


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))


def deterministic() -> None:
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)


def arguments() -> argparse.Namespace:
    return parser().parse_args()


def parser() -> argparse.ArgumentParser:
    """The options every example takes; one with more adds its own."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--save-at", type=int, default=-1)
    p.add_argument("--resume", type=Path, default=None)
    p.add_argument("--losses", type=Path, required=True)
    p.add_argument("--export-model", type=Path, default=None)
    return p


def mean_loss(loss: torch.Tensor) -> str:
    """The loss averaged over ranks, exactly (float.hex)."""
    import torch.distributed as dist

    total = loss.detach().clone()
    dist.all_reduce(total)
    return float(total.item() / dist.get_world_size()).hex()


def write_losses(path: Path, losses: dict[str, str], **extra: Any) -> None:
    path.write_text(json.dumps({"losses": losses, **extra}, indent=1, sort_keys=True))


def export_full(module: nn.Module, path: Path | None) -> None:
    """Rank 0 writes `module`'s full (unsharded) state_dict: what a release must equal. Every
    rank must call it (gathering is collective)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if path is None:
        return
    full = get_model_state_dict(
        module, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if dist.get_rank() == 0:
        torch.save({k: v.detach().clone().contiguous() for k, v in full.items()}, path)
