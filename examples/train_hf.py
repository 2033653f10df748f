"""Train tiny Hugging Face causal LMs (examples/hf_models.py) with FSDP2 under torchrun and
write DCP checkpoints holding the full resume state, as train_tiny.py does:

    torchrun --standalone --nproc-per-node 2 -m examples.train_hf --out DIR --steps 2 \\
        --model llama_tied --model gpt2_untied

One process group trains each named model in turn: DIR/<model>/step-N/ (a DCP checkpoint),
DIR/<model>/step-N.full.pt (rank 0: the full state_dict a release must equal) and
DIR/<model>/config.json (the model's config as save_pretrained writes it).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from examples.hf_models import build, parallelize, tokens
from examples.train_tiny import _state, _writer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--model", action="append", required=True)
    args = parser.parse_args()
    saving = argparse.Namespace(layout="dcp", writer="default", weights_only=False, thread_count=1)

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    for name in args.model:
        torch.manual_seed(0)  # the same initial weights on every rank
        model = parallelize(build(name))
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(optim, step_size=1, gamma=0.9)
        for step in range(1, args.steps + 1):
            batch = tokens(seed=step * world + rank)
            model.train()(input_ids=batch, labels=batch).loss.backward()
            optim.step()
            optim.zero_grad()
            sched.step()
        out = args.out / name
        state = _state(saving, model, optim, sched, args.steps, rank, world)
        dcp.save(state, storage_writer=_writer(saving, out / f"step-{args.steps}"))
        full = get_model_state_dict(
            model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        if rank == 0:
            torch.save(full, out / f"step-{args.steps}.full.pt")
            model.config.save_pretrained(out)
            print(f"{name}: saved {out}/step-{args.steps}", flush=True)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
