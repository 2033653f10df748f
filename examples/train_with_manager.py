"""TinyLM under torchrun with the registry's CheckpointManager: resume if the run has a
checkpoint, train, save through the registry.

    torchrun --standalone --nproc-per-node 2 -m examples.train_with_manager --run-name r --steps 3
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import fully_shard

from examples.tiny_model import batch, build_model, loss_on
from registry.training import CheckpointManager


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--run-name", required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--report", type=Path, help="rank 0 writes what it did here (JSON)")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = build_model()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train_state = {"step": 0}
    manager = CheckpointManager(args.run_name, staging=Path(tempfile.gettempdir()) / "reg-staging")

    model_sd, optim_sd = get_state_dict(model, optim)
    state = {"model": model_sd, "optimizer": optim_sd, "train_state": train_state}
    resumed = manager.restore(state)
    if resumed is not None:
        set_state_dict(
            model, optim, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
        )
    start = state["train_state"]["step"]
    for step in range(start + 1, start + args.steps + 1):
        inputs, targets = batch(seed=step)
        loss_on(model.train(), inputs, targets).backward()
        optim.step()
        optim.zero_grad()
        model_sd, optim_sd = get_state_dict(model, optim)
        manager.save(
            {"model": model_sd, "optimizer": optim_sd, "train_state": {"step": step}},
            step,
            metrics={"step": float(step)},
        )
    full = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if dist.get_rank() == 0 and args.report:
        torch.save(full, args.report.with_suffix(".pt"))
        args.report.write_text(
            json.dumps({"resumed": resumed, "start": start, "last": start + args.steps})
        )
    manager.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
