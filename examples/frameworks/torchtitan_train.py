"""torchtitan's own CheckpointManager, driven directly (torchtitan's Trainer needs CUDA).

The model is sharded with FSDP2 on a CPU mesh; torchtitan's OptimizersContainer (AdamW, the
"for-loop" implementation: the default "fused" is for CUDA), LRSchedulersContainer (warmup,
then linear decay), ParallelAwareDataloader (a StatefulDataLoader) and a train state go to
`CheckpointManager`, which saves DIR/checkpoint/step-K as torchtitan's trainer does: the
model's own names at the top level beside "optimizer", "lr_scheduler", "dataloader",
"train_state". A resume loads a step directory from anywhere through `initial_load_path` with
`initial_load_model_only=False` (the default restores weights only).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import IterableDataset
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw

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


class StepData(IterableDataset[Any], Stateful):
    """Yields the batch of each step in turn; its state is the next step."""

    def __init__(self, rank: int) -> None:
        self.rank, self.next_step = rank, 1

    def __iter__(self) -> Iterator[Any]:
        while True:
            step = self.next_step
            self.next_step += 1
            yield step, *batch(step, self.rank)

    def state_dict(self) -> dict[str, int]:
        return {"next_step": self.next_step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.next_step = int(state["next_step"])


class TrainState(Stateful):
    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = int(state["step"])


def main() -> None:
    args = arguments()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    deterministic()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(SEED)
    model = Tiny()
    for layer in (model.embed, model.fc1, model.out):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer_config = default_adamw(lr=1e-2, weight_decay=0.1)
    optimizer_config.implementation = "for-loop"
    optimizers = optimizer_config.build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2, decay_type="linear").build(
        optimizers=optimizers, training_steps=args.steps
    )
    loader = ParallelAwareDataloader(
        StepData(rank), dp_rank=rank, dp_world_size=world, batch_size=None
    )
    state = TrainState()
    checkpointer = CheckpointManager(
        CheckpointManager.Config(
            enable=True,
            folder="checkpoint",
            interval=max(args.save_at, 1),
            last_save_model_only=False,
            keep_latest_k=0,
            async_mode="disabled",
            initial_load_path=str(args.resume.resolve()) if args.resume else None,
            initial_load_model_only=False,
        ),
        dataloader=loader,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=schedulers,
        states={"train_state": state},
        sd_adapter=None,
        base_folder=str(args.out),
    )
    checkpointer.load(step=-1)
    losses = {}
    data = iter(loader)
    while state.step < args.steps:
        state.step += 1
        step, x, y = next(data)
        assert int(step) == state.step, (int(step), state.step)
        optimizers.zero_grad()
        loss = loss_of(model, x, y)
        loss.backward()
        optimizers.step()
        schedulers.step()
        losses[str(state.step)] = mean_loss(loss)
        if state.step == args.save_at:
            assert checkpointer.save(state.step, last_step=False), "CheckpointManager did not save"
            export_full(model, args.export_model)
    if rank == 0:
        from importlib.metadata import version

        write_losses(args.losses, losses, torchtitan=version("torchtitan"))
    checkpointer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
