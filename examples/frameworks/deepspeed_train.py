"""DeepSpeed ZeRO on CPU (2 processes, gloo), checkpointed by DeepSpeed's own `save_checkpoint`.

The tiny model of common.py trains under `deepspeed.initialize` with ZeRO stage `--zero`
(1, 2 or 3, fp32, torch's AdamW as the client optimizer and a LambdaLR warmup as the client
scheduler, so nothing is JIT-built). `engine.save_checkpoint(<out>, tag="global_stepK")` writes
`<out>/latest` and `<out>/global_stepK/`: `mp_rank_00_model_states.pt` (ZeRO-3: per-rank
`zero_pp_rank_R_mp_rank_00_model_states.pt` holding placeholders), per-rank
`*_optim_states.pt` (the fp32 partitions, the optimizer's state) and DeepSpeed's
`zero_to_fp32.py` beside them. `--resume DIR` loads DIR (a pulled `global_stepK/` directory)
with `engine.load_checkpoint` and trains on from its step.

DeepSpeed's CPU accelerator would JIT-build its shared-memory allreduce (about 4 minutes on
first use); the example marks that op unavailable, so collectives go through torch's gloo.

Losses: each step's loss averaged over the ranks (float.hex). `--export-model`: rank 0's
torch.save, at --save-at, of the fp32 weights as DeepSpeed's own
`get_fp32_state_dict_from_zero_checkpoint` rebuilds them from the checkpoint just written
(zero_to_fp32's answer: what a release must equal).
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed
import deepspeed.ops
import torch
import torch.distributed as dist

from examples.frameworks.common import (
    SEED,
    Tiny,
    batch,
    deterministic,
    loss_of,
    mean_loss,
    parser,
    write_losses,
)

BATCH_PER_RANK = 8  # common.BATCH: one micro-batch a step, no accumulation


def config(stage: int) -> dict[str, object]:
    return {
        "train_micro_batch_size_per_gpu": BATCH_PER_RANK,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1_000_000,
        "wall_clock_breakdown": False,
    }


def without_shm_allreduce() -> None:
    """Mark DeepSpeed's shared-memory comm op unavailable (it would be compiled on first use)."""
    compatible = dict(deepspeed.ops.__compatible_ops__)
    compatible["deepspeed_shm_comm"] = False
    deepspeed.ops.__compatible_ops__ = compatible


def main() -> None:
    p = parser()
    p.description = __doc__
    p.add_argument("--zero", type=int, choices=(1, 2, 3), default=2)
    args = p.parse_args()

    deterministic()
    without_shm_allreduce()
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    torch.manual_seed(SEED)
    model = Tiny()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 4))
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config(args.zero)
    )
    start = 0
    if args.resume is not None:
        # load_checkpoint(dir, tag): DIR's parent is the save directory, its name the tag
        path, _ = engine.load_checkpoint(str(args.resume.parent), tag=args.resume.name)
        if path is None:
            sys.exit(f"DeepSpeed loaded nothing from {args.resume}")
        start = engine.global_steps
    losses: dict[str, str] = {}
    for step in range(start + 1, args.steps + 1):
        x, y = batch(step, rank)
        loss = loss_of(engine, x, y)
        engine.backward(loss)
        engine.step()
        losses[str(step)] = mean_loss(loss)
        if step == args.save_at:
            tag = f"global_step{step}"
            engine.save_checkpoint(str(args.out), tag=tag)
            dist.barrier()
            if args.export_model is not None and rank == 0:
                from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

                full = get_fp32_state_dict_from_zero_checkpoint(str(args.out), tag=tag)
                torch.save({k: v.detach().clone().contiguous() for k, v in full.items()},
                           args.export_model)  # fmt: skip
    if rank == 0:
        write_losses(
            args.losses, losses, zero=args.zero, deepspeed=deepspeed.__version__,
            torch=torch.__version__,
        )  # fmt: skip
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
