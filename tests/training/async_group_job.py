"""A training loop that all-reduces on the default process group every step (as DDP's gradient
sync does) while async checkpoint saves persist in the background (the test of why
reg's saves run their collectives on a group of their own).

    python -m torch.distributed.run --nproc-per-node=2 -m tests.training.async_group_job MODE OUT

MODE `bare`: `dcp.async_save(state, checkpoint_id=...)` on the default group; `reg`:
`CheckpointManager(local_dir=...).save(async_=True)`. Each rank writes OUT/rank-R.json:
{"done": true} when the loop and every save finished, or {"hung_at": step} from a watchdog
that ends the process after DEADLINE_S without progress.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

STEPS, EVERY = 40, 10
DEADLINE_S = 20.0


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mark = out / f"rank-{rank}.json"
    reached = [0]
    progress = [time.monotonic()]

    def watchdog() -> None:
        while time.monotonic() - progress[0] < DEADLINE_S:
            time.sleep(0.5)
        mark.write_text(json.dumps({"hung_at": reached[0]}))
        os._exit(3)

    threading.Thread(target=watchdog, daemon=True).start()
    state = {"model": {"w": torch.randn(256, 1024) + rank}, "train_state": {"step": 0}}
    manager = None
    if mode == "reg":
        from registry.training import CheckpointManager

        manager = CheckpointManager("loop", local_dir=out / "nodes", heartbeat_s=5)
    future = None
    for step in range(1, STEPS + 1):
        grads = torch.ones(4096)
        dist.all_reduce(grads)  # the loop's own collective, every step, on the default group
        reached[0] = step
        progress[0] = time.monotonic()
        if step % EVERY:
            continue
        state["train_state"]["step"] = step
        if manager is not None:
            manager.save(state, step, async_=True)
        else:
            if future is not None:
                future.result()
            future = dcp.async_save(state, checkpoint_id=str(out / f"step-{step}"))
    if manager is not None:
        manager.close()
    elif future is not None:
        future.result()
    mark.write_text(json.dumps({"done": True}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
