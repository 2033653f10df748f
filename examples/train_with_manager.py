"""TinyLM under torchrun with the registry's CheckpointManager: resume if the run has a
checkpoint, train, save through the registry from every rank.

    torchrun --standalone --nproc-per-node 2 -m examples.train_with_manager --run-name r --steps 3

Each rank draws its batches from its own generator (seeded by rank), so an exact resume needs
that generator's state and the rank's position in its data: both are saved per rank
(`per_rank=`), and restored where the world size allows. `--kill-after K` SIGKILLs every rank
once step K's save is committed (a crash with nothing left to flush); `--kill-at K` SIGKILLs
every rank right after step K, whatever is in flight (the work since the last committed save is
lost: `reg advise` counts it); `--losses FILE` (rank 0) records each step's loss, averaged over
ranks. Every step is reported to the manager (`step_done`), which sends a heartbeat every
`--heartbeat` seconds; `--planned` says this job's restore is a planned restart.

Tier 0 (issue 36): `--local-dir DIR` saves to DIR/<node> first and replicates to the store in
the background; `--nodes N` splits the ranks into N simulated nodes (node0, node1, ...; each
its own local directory), `--replicate-rate B` caps the copy at B bytes/s, and
`--kill-after-tier0 K` SIGKILLs every rank once step K is committed at tier 0 (its copy to the
store still running).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
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
    parser.add_argument("--project", default="default")
    parser.add_argument("--steps", type=int, default=3, help="steps to train in this job")
    parser.add_argument("--until", type=int, help="train until this step (instead of --steps)")
    parser.add_argument("--every", type=int, default=1, help="save every N steps")
    parser.add_argument("--async", dest="async_", action="store_true", help="async saves")
    parser.add_argument("--kill-after", type=int, help="SIGKILL every rank after this save")
    parser.add_argument("--kill-at", type=int, help="SIGKILL every rank after this step")
    parser.add_argument("--heartbeat", type=float, default=30.0, help="heartbeat every S seconds")
    parser.add_argument("--planned", action="store_true", help="this restart is planned")
    parser.add_argument("--losses", type=Path, help="rank 0 appends each step's loss here")
    parser.add_argument("--report", type=Path, help="rank 0 writes what it did here (JSON)")
    parser.add_argument(
        "--dump", type=Path, help="rank 0 saves the full model and optimizer state here at the end"
    )
    parser.add_argument(
        "--private-tmp", type=Path, help="each rank's temp directory is DIR/rank<r> (no sharing)"
    )
    parser.add_argument("--local-dir", type=Path, help="save at tier 0 under DIR/<node> first")
    parser.add_argument("--nodes", type=int, default=1, help="simulated nodes (with --local-dir)")
    parser.add_argument(
        "--local-dir-per-rank",
        action="store_true",
        help="the slip CheckpointManager refuses: DIR/rank<r> for each rank of one node",
    )
    parser.add_argument("--replicate-rate", type=float, help="replication bytes/s")
    parser.add_argument("--kill-after-tier0", type=int, help="SIGKILL once step K is at tier 0")
    parser.add_argument(
        "--close-timeout", type=float, default=60.0, help="close() waits at most S seconds"
    )
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if args.private_tmp is not None:
        private = args.private_tmp / f"rank{rank}"
        private.mkdir(parents=True, exist_ok=True)
        os.environ["TMPDIR"] = str(private)
        tempfile.tempdir = str(private)
    torch.manual_seed(0)
    model = build_model()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tier: dict[str, object] = {}
    if args.local_dir is not None and args.local_dir_per_rank:
        tier = {"local_dir": args.local_dir / f"rank{rank}"}  # node_id: the host, for every rank
    elif args.local_dir is not None:
        node = f"node{rank * args.nodes // dist.get_world_size()}"
        tier = {
            "local_dir": args.local_dir / node,
            "node_id": node,
            "replicate_bytes_per_s": args.replicate_rate,
        }
    manager = CheckpointManager(
        args.run_name,
        project=args.project,
        heartbeat_s=args.heartbeat,
        close_timeout_s=args.close_timeout,
        **tier,  # type: ignore[arg-type]
    )

    data = torch.Generator().manual_seed(1000 + rank)
    per_rank = {"rng": data.get_state(), "dataloader": {"position": 0}}
    model_sd, optim_sd = get_state_dict(model, optim)
    state = {"model": model_sd, "optimizer": optim_sd, "train_state": {"step": 0}}
    resumed = manager.restore(state, per_rank=per_rank, planned=args.planned)
    if resumed is not None:
        set_state_dict(
            model, optim, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
        )
        data.set_state(per_rank["rng"])
    position = int(per_rank["dataloader"]["position"])
    start = int(state["train_state"]["step"])
    last = args.until if args.until is not None else start + args.steps
    losses: dict[int, float] = {}
    for step in range(start + 1, last + 1):
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=data))
        position += 1
        inputs, targets = batch(seed=seed)
        loss = loss_on(model.train(), inputs, targets)
        loss.backward()
        optim.step()
        optim.zero_grad()
        if step == start + 1 and resumed is not None:
            manager.first_step_done()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses[step] = float(mean) / dist.get_world_size()
        manager.step_done(step)
        if step == args.kill_at:
            manager.flush()  # the step reached is known (heartbeats go out in the background)
            _record(args, rank, losses)
            dist.barrier()
            os.kill(os.getpid(), signal.SIGKILL)
        if step % args.every == 0 or step == last:
            model_sd, optim_sd = get_state_dict(model, optim)
            manager.save(
                {"model": model_sd, "optimizer": optim_sd, "train_state": {"step": step}},
                step,
                metrics={"loss": losses[step]},
                async_=args.async_,
                per_rank={"rng": data.get_state(), "dataloader": {"position": position}},
            )
        if step == args.kill_after_tier0:
            manager.wait()  # committed at tier 0; its copy to the store is still running
            _record(args, rank, losses)
            dist.barrier()
            os.kill(os.getpid(), signal.SIGKILL)
        if step == args.kill_after:
            manager.wait()
            _record(args, rank, losses)
            dist.barrier()
            os.kill(os.getpid(), signal.SIGKILL)
    manager.close()
    _record(args, rank, losses)
    full = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if args.dump is not None:
        everything = get_state_dict(
            model, optim, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        if rank == 0:
            torch.save({"model": everything[0], "optimizer": everything[1]}, args.dump)
    if rank == 0 and args.report:
        torch.save(full, args.report.with_suffix(".pt"))
        args.report.write_text(
            json.dumps(
                {"resumed": resumed, "start": start, "last": last, "notes": manager.resume_notes}
            )
        )
    dist.barrier()
    dist.destroy_process_group()


def _record(args: argparse.Namespace, rank: int, losses: dict[int, float]) -> None:
    if rank != 0 or args.losses is None:
        return
    before = json.loads(args.losses.read_text()) if args.losses.exists() else {}
    before.update({str(k): v for k, v in losses.items()})
    args.losses.write_text(json.dumps(before))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
