"""Train TinyLM with FSDP2 under torchrun and write DCP checkpoints holding the full resume state.

    torchrun --standalone --nproc-per-node 2 -m examples.train_tiny --out ckpts --steps 6 --every 2

Each checkpoint `ckpts/step-N/` holds model and optimizer (via `get_state_dict`), LR scheduler,
train state, per-rank RNG under per-rank keys, and the data-loader position. Beside it,
`ckpts/step-N.json` records the probe loss, and with `--full-weights` `ckpts/step-N.full.pt`
holds the unsharded model weights (for bit-exact tests).

`--layout` saves the same state in the shape another trainer writes (docs/reference/layouts.md):
  dcp         {"model", "optimizer", "lr_scheduler", "train_state", "rng", "dataloader"}
  torchtitan  the model's names at the top level, the optimizer flattened (as torchtitan does),
              no RNG state; with --weights-only the model alone (torchtitan's last step)
  lightning   {"state_dict", "optimizer_0"} through DCP, and rank 0's meta.pt sidecar with the
              epoch, global step, loops and schedulers (as ModelParallelStrategy writes)
  stateful    {"app": AppState} as in the DCP tutorial: a Stateful holding model, optim and the
              rest of the state
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

from examples.tiny_model import (
    batch,
    build_model,
    build_optimizer,
    loss_on,
    parallelize,
    probe_loss,
)


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
        "--layout", choices=["dcp", "torchtitan", "lightning", "stateful"], default="dcp"
    )
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
    model = parallelize(build_model())
    optim = build_optimizer(model)
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
    path = args.out / f"step-{step}"
    state = _state(args, model, optim, sched, step, rank, world)
    dcp.save(state, storage_writer=_writer(args, path))
    if args.layout == "lightning" and rank == 0:  # Lightning's sidecar: a plain torch.save
        meta = {
            "epoch": 0,
            "global_step": step,
            "loops": {"fit_loop": {"epoch_progress": {"current": {"completed": 0}}}},
            "lr_schedulers": [sched.state_dict()],
        }
        torch.save(meta, path / "meta.pt")
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


def _state(args, model, optim, sched, step, rank, world) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    titan = args.layout == "torchtitan"
    options = StateDictOptions(flatten_optimizer_state_dict=titan)
    model_sd, optim_sd = get_state_dict(model, optim, options=options)
    if args.writer in ("safetensors", "hf"):  # safetensors refuses tensors sharing memory (ties)
        model_sd = {k: v.clone() for k, v in model_sd.items()}
    rest = {
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
    if titan:
        rest.pop("rng")  # torchtitan keeps no RNG state in its checkpoints
        return dict(model_sd) if args.weights_only else {**model_sd, "optimizer": optim_sd, **rest}
    if args.layout == "lightning":
        return {"state_dict": model_sd} | ({} if args.weights_only else {"optimizer_0": optim_sd})
    if args.layout == "stateful":
        app = {"model": model_sd} | ({} if args.weights_only else {"optim": optim_sd, **rest})
        return {"app": _AppState(app)}
    return {"model": model_sd} | ({} if args.weights_only else {"optimizer": optim_sd, **rest})


class _AppState:
    """The DCP tutorial's wrapper: a Stateful whose state_dict DCP calls at save."""

    def __init__(self, state: dict[str, Any]) -> None:
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        return self.state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = state


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
