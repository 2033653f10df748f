"""Write a large DCP checkpoint of random data from a real multi-rank job, for the benchmarks.

    torchrun --standalone --nproc-per-node 2 -m bench.make_checkpoint --out DIR --gib 1.2

The model is `layers` float32 matrices sharded Shard(0) across ranks (as FSDP2 does), plus AdamW
state (exp_avg, exp_avg_sq: twice the model) and the small resume state. Random data, never
zeros: zeros write about twice as fast under fsync.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--gib", type=float, default=1.2, help="total size (model + optimizer)")
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument(
        "--poison-last", action="store_true", help="a NaN in the last rank's last weight"
    )
    parser.add_argument(
        "--transposed",
        type=int,
        default=0,
        metavar="N",
        help="an N x N float32 weight saved as a transposed view (a chunk that cannot stream)",
    )
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    matrix_bytes = args.dim * args.dim * 4
    layers = max(1, round(args.gib * 2**30 / 3 / matrix_bytes))
    gen = torch.Generator().manual_seed(rank)

    def sharded() -> DTensor:
        local = torch.randn(args.dim // world, args.dim, generator=gen)
        return DTensor.from_local(local, mesh, [Shard(0)], run_check=False)

    model = {f"layers.{i}.weight": sharded() for i in range(layers)}
    if args.poison_last and rank == world - 1:
        model[f"layers.{layers - 1}.weight"].to_local()[-1, -1] = float("nan")
    if args.transposed:  # each rank saves a replica, as a non-contiguous view
        n = args.transposed
        square = torch.randn(n, n, generator=torch.Generator().manual_seed(7))
        model["transposed.weight"] = square.T
    optim = {
        "state": {
            f"layers.{i}.weight": {
                "exp_avg": sharded(),
                "exp_avg_sq": sharded(),
                "step": torch.tensor(100.0),
            }
            for i in range(layers)
        },
        "param_groups": [{"lr": 1e-4, "params": [f"layers.{i}.weight" for i in range(layers)]}],
    }
    state = {
        "model": model,
        "optimizer": optim,
        "lr_scheduler": {"last_epoch": 100},
        "train_state": {"step": 100},
        "rng": {f"rank{rank}": torch.get_rng_state()},
        "dataloader": {f"rank{rank}": {"position": 800}},
    }
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(args.out)))
    dist.barrier()
    if rank == 0:
        total = sum(f.stat().st_size for f in args.out.iterdir())
        print(
            f"wrote {args.out}: {layers} layers of {args.dim}x{args.dim}, {total / 2**30:.2f} GiB"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
