"""accelerate with FSDP2 on CPU, checkpointed by `accelerator.save_state` itself.

With `state_dict_type="SHARDED_STATE_DICT"` save_state writes two DCP roots,
`pytorch_model_fsdp_0/` ({"model": ...}) and `optimizer_0/` ({"optimizer": ...}), beside
`scheduler.bin`, `random_states_N.pkl` and `custom_checkpoint_0.pkl` (the step counter this
script registers: accelerate keeps no training step of its own).

accelerate turns FSDP on only for accelerator devices: under torchrun on CPU its state is
MULTI_CPU and the FSDP plugin is silently ignored (plain DDP). The one change made here: after
`PartialState(cpu=True)` has set up gloo on the CPU, its distributed type is set to MULTI_GPU
before `Accelerator(...)` reads it, so accelerate takes its FSDP path (`fully_shard` on the CPU
mesh); device, backend and process group stay what PartialState made. The script checks that
every parameter is a DTensor. `--no-fsdp` runs plain save_state (what push-ckpt refuses).
"""

from __future__ import annotations

import sys

import accelerate
import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin, set_seed

from examples.frameworks.common import (
    SEED,
    Tiny,
    arguments,
    batch,
    deterministic,
    export_full,
    loss_of,
    mean_loss,
    write_losses,
)


class StepCounter:
    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = int(state["step"])


def make_accelerator(fsdp: bool) -> Accelerator:
    if not fsdp:
        return Accelerator(cpu=True)
    PartialState(cpu=True)
    PartialState._shared_state["distributed_type"] = DistributedType.MULTI_GPU
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
    assert accelerator.is_fsdp2, accelerator.distributed_type
    return accelerator


def main() -> None:
    fsdp = "--no-fsdp" not in sys.argv
    if not fsdp:
        sys.argv.remove("--no-fsdp")
    args = arguments()
    deterministic()
    set_seed(SEED)
    accelerator = make_accelerator(fsdp)
    torch.manual_seed(SEED)
    model = Tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    model, opt, sched = accelerator.prepare(model, opt, sched)
    if fsdp:
        from torch.distributed.tensor import DTensor

        assert all(isinstance(p, DTensor) for p in model.parameters()), "not sharded"
    counter = StepCounter()
    accelerator.register_for_checkpointing(counter)
    if args.resume is not None:
        accelerator.load_state(str(args.resume))
    losses = {}
    for step in range(counter.step + 1, args.steps + 1):
        x, y = batch(step, accelerator.process_index)
        loss = loss_of(model, x, y)
        accelerator.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        counter.step = step
        losses[str(step)] = mean_loss(loss)
        if step == args.save_at:
            accelerator.save_state(str(args.out / f"step-{step}"))
            export_full(model, args.export_model)
            accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        write_losses(args.losses, losses, accelerate=accelerate.__version__)
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
