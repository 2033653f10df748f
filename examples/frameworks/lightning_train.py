"""Lightning's ModelParallelStrategy (FSDP2) on CPU, checkpointed by Lightning itself.

`trainer.save_checkpoint(DIR/step-K)` writes a DCP directory ({"state_dict": the
LightningModule's sharded state, "optimizer_0": ...}) and `meta.pt` (global step, epoch, loops,
LR schedulers); `trainer.fit(ckpt_path=...)` resumes from one. ModelParallelStrategy runs on CPU
as it is: accelerator="cpu" gives a CPU device mesh and gloo. The LightningModule keeps its
network in `self.model`, so its names are `model.embed.weight`, ...
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.utils.data import DataLoader, Dataset

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


class Steps(Dataset[int]):
    """Indices only: the batch comes from the global step (`training_step`)."""

    def __len__(self) -> int:
        return 1_000_000

    def __getitem__(self, i: int) -> int:
        return i


class TinyModule(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = Tiny()
        self.losses: dict[str, str] = {}

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in (self.model.embed, self.model.fc1, self.model.out):
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)

    def training_step(self, _batch: Any, _index: int) -> torch.Tensor:
        x, y = batch(self.trainer.global_step + 1, self.global_rank)
        loss = loss_of(self.model, x, y)
        self.losses[str(self.trainer.global_step + 1)] = mean_loss(loss)
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class SaveAt(pl.Callback):
    def __init__(self, args: Any) -> None:
        self.args = args

    def on_train_batch_end(self, trainer: pl.Trainer, module: Any, *_: Any) -> None:
        if trainer.global_step == self.args.save_at:
            trainer.save_checkpoint(self.args.out / f"step-{self.args.save_at}")
            export_full(module, self.args.export_model)


def main() -> None:
    args = arguments()
    deterministic()
    pl.seed_everything(SEED, verbose=False)
    module = TinyModule()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        deterministic=True,
        callbacks=[SaveAt(args)],
    )
    loader = DataLoader(Steps(), batch_size=1)
    trainer.fit(module, train_dataloaders=loader, ckpt_path=args.resume)
    if trainer.global_rank == 0:
        write_losses(args.losses, module.losses, lightning=pl.__version__)


if __name__ == "__main__":
    main()
