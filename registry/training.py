"""`CheckpointManager`: the registry inside a training loop (torch.distributed, any world size).

    manager = CheckpointManager("run42", staging="/local/nvme/ckpt-staging")
    start = manager.restore(state) or 0          # every rank; None when the run has none yet
    for step in range(start + 1, steps + 1):
        ...
        if step % 1000 == 0:
            manager.save(state, step, metrics={"val_loss": loss})

`save` writes a DCP checkpoint to local staging on every rank, then rank 0 pushes it (the world
size is known here, so it is recorded, not inferred) and every rank learns the outcome; the
staging copy is removed once committed. `restore` loads the newest committed checkpoint straight
from the store on every rank (ranged reads, the safe metadata reader, resharding to the current
world size) and records that the run resumed from it, so retention keeps it.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from registry.api import Registry
from registry.errors import NotFound, RegistryError
from registry.refs import CheckpointRef


class CheckpointManager:
    def __init__(
        self,
        run: str,
        *,
        project: str = "default",
        staging: str | Path,
        registry: Registry | None = None,
    ) -> None:
        self.run, self.project = run, project
        self.staging = Path(staging)
        self._registry = registry

    @property
    def registry(self) -> Registry:
        if self._registry is None:
            self._registry = Registry()
        return self._registry

    def save(
        self, state: dict[str, Any], step: int, *, metrics: dict[str, float] | None = None
    ) -> dict[str, Any]:
        """Save `state` as run@step on every rank; returns the committed checkpoint's view."""
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        path = self.staging / f"{self.run}-step-{step}"
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path)))
        world = dist.get_world_size() if dist.is_initialized() else 1
        outcome: list[Any] = [None]
        if _rank() == 0:
            try:
                outcome[0] = self.registry.push_checkpoint(
                    path,
                    run=self.run,
                    step=step,
                    project=self.project,
                    world_size=world,
                    metrics=metrics,
                )
                shutil.rmtree(path, ignore_errors=True)
            except RegistryError as exc:
                outcome[0] = exc
        if dist.is_initialized():
            dist.broadcast_object_list(outcome, src=0)
            if _rank() != 0:
                shutil.rmtree(path, ignore_errors=True)
        if isinstance(outcome[0], BaseException):
            raise outcome[0]
        return dict(outcome[0])

    def restore(self, state: dict[str, Any]) -> int | None:
        """Load the newest committed checkpoint into `state` (in place); returns its step."""
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        from registry.formats.dcp_load import SafeLoadPlanner, StoreReader
        from registry.layout import checkpoint_prefix
        from registry.lifecycle.checkpoints.read import record_resume

        latest: list[Any] = [None, {}]  # the step, and its files' recorded versions
        if _rank() == 0:
            try:
                shown = self.registry.show(CheckpointRef(self.project, self.run, None))
                versions = {f["path"]: f["version"] for f in shown["files"] if f.get("version")}
                latest[:] = [shown["step"], versions]
            except NotFound:
                latest[0] = None
        if dist.is_initialized():
            dist.broadcast_object_list(latest, src=0)
        step, versions = latest
        if step is None:
            return None
        prefix = checkpoint_prefix(self.project, self.run, step)
        dcp.load(
            state,
            storage_reader=StoreReader(self.registry.store, prefix, versions=versions),
            planner=SafeLoadPlanner(),
        )
        context = self.registry.context
        if _rank() == 0 and context.principal.authorize("push", project=self.project).allowed:
            record_resume(context, CheckpointRef(self.project, self.run, step))
        return int(step)

    def close(self) -> None:
        if self._registry is not None:
            self._registry.close()


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0
