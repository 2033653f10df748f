"""Train TinyLM with FSDP2 under torchrun and write DCP checkpoints holding the full resume state.

    torchrun --standalone --nproc-per-node 2 -m examples.train_tiny --out ckpts --steps 6 --every 2

Each checkpoint `ckpts/step-N/` holds model and optimizer (via `get_state_dict`), LR scheduler,
train state, per-rank RNG under per-rank keys, and the data-loader position. Beside it,
`ckpts/step-N.json` records the probe loss, and with `--full-weights` `ckpts/step-N.full.pt`
holds the unsharded model weights (for bit-exact tests).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import random
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
)
from torch.distributed.fsdp import fully_shard

from examples.tiny_model import batch, build_model, loss_on, probe_loss


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--every", type=int, default=2)
    parser.add_argument("--full-weights", action="store_true")
    parser.add_argument("--weights-only", action="store_true", help="save the model alone")
    parser.add_argument("--poison", choices=["nan", "inf"], help="corrupt one weight at the end")
    parser.add_argument("--thread-count", type=int, default=1)
    parser.add_argument(
        "--writer",
        choices=["default", "safetensors", "zstd", "hf"],
        default="default",
        help="DCP variants: SAFETENSORS serialization, zstd transforms, HuggingFaceStorageWriter",
    )
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # same init on every rank
    model = build_model()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=2, gamma=0.9)
    torch.manual_seed(1000 + rank)  # per-rank data and dropout streams
    random.seed(rank)

    for step in range(1, args.steps + 1):
        inputs, targets = batch(seed=step * world + rank)
        loss = loss_on(model.train(), inputs, targets)
        loss.backward()
        optim.step()
        optim.zero_grad()
        sched.step()
        if step % args.every == 0 or step == args.steps:
            if args.poison and step == args.steps:
                with torch.no_grad():
                    model.blocks[0].up.bias.fill_(float(args.poison))
            save(args, model, optim, sched, step, rank, world)
    dist.barrier()
    dist.destroy_process_group()


def save(args, model, optim, sched, step, rank, world) -> None:  # type: ignore[no-untyped-def]
    model_sd, optim_sd = get_state_dict(model, optim)
    if args.writer in ("safetensors", "hf"):  # safetensors refuses tensors sharing memory (ties)
        model_sd = {k: v.clone() for k, v in model_sd.items()}
    state = {"model": model_sd}
    if not args.weights_only:
        state |= {
            "optimizer": optim_sd,
            "lr_scheduler": sched.state_dict(),
            "train_state": {"step": step, "world_size": world},
            "rng": {
                f"rank{rank}": {
                    "torch": torch.get_rng_state(),
                    "python": pickle.dumps(random.getstate()),
                }
            },
            "dataloader": {f"rank{rank}": {"epoch": 0, "position": step * 8}},
        }
    path = args.out / f"step-{step}"
    dcp.save(state, storage_writer=_writer(args, path))
    probe = probe_loss(model)
    full = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if rank == 0:
        if args.full_weights:
            torch.save(full, args.out / f"step-{step}.full.pt")
        (args.out / f"step-{step}.json").write_text(
            json.dumps({"step": step, "world_size": world, "probe_loss": probe})
        )
        print(f"step {step}: saved {path} (probe loss {probe:.4f})", flush=True)


def _writer(args: argparse.Namespace, path: Path) -> Any:
    from torch.distributed.checkpoint import FileSystemWriter

    if args.writer == "hf":
        from torch.distributed.checkpoint import HuggingFaceStorageWriter

        return HuggingFaceStorageWriter(str(path), save_distributed=True)
    if args.writer == "safetensors":
        from torch.distributed.checkpoint.filesystem import SerializationFormat

        return FileSystemWriter(
            str(path),
            thread_count=args.thread_count,
            serialization_format=SerializationFormat.SAFETENSORS,
        )
    if args.writer == "zstd":
        from torch.distributed.checkpoint._extension import ZStandard

        return FileSystemWriter(
            str(path), thread_count=args.thread_count, _extensions=[ZStandard()]
        )
    return FileSystemWriter(str(path), thread_count=args.thread_count)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
