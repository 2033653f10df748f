"""One rank of `bench.training` (under torchrun): times checkpoint saves from a training loop.

    torchrun --standalone --nproc-per-node 2 -m bench.training_worker --mode sync \
        --work DIR --out RESULT.json --gib 0.5 --repeat 3 [--cases a,b,c]

The state is what `bench.make_checkpoint` saves: `layers` float32 matrices sharded Shard(0)
across ranks (as FSDP2 does) plus AdamW state (twice the model), random data, so each rank
writes about gib/world. REG_HOME (a fresh registry) comes from the parent.

`--mode sync`, cases, interleaved (the order rotated each repeat), every output deleted and
synced before the next case:
  a  `CheckpointManager(run).save(state, step)` (every rank writes into the store, rank 0 commits)
  b  `dcp.save` to a local directory, then rank 0 runs `reg push-ckpt` (every rank waits for it)
  c  bare `dcp.save` to a local directory
  t  `CheckpointManager(run, local_dir=DIR).save(state, step)`: tier 0 (issue 36), to the same
     disk as c; its background hashing and tier-0 commit are timed apart (`t_commit`: from the
     call to `wait()`'s return); no copy to the store runs (`replicate=False`)
Each time is the slowest rank's, from a barrier to the call's return.

`--mode async`: `manager.save(..., async_=True)` against `dcp.async_save` (its own gloo group)
followed by `reg push-ckpt`: the stall (call until return), the time until committed / pushed,
and the time of a fixed compute step (matmuls plus an all_reduce, as a training step has) while
the save persists and before it.

`--mode restore`: one checkpoint saved at tier 0 and copied to the store, then interleaved,
its pages dropped from the cache before each (`evict`): `restore()` from tier 0 (`r0`, every
rank's node holds it), from the store (`r1`, a manager on a replaced node: `node_id` another),
and a bare `dcp.load` of the same state from a directory `dcp.save` wrote (`rd`).

Rank 0 writes every figure to `--out` (JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from bench.common import PY, ROOT, evict, rm, settle
from registry.core.layout import checkpoint_prefix
from registry.storage.local import LocalStore
from registry.training import CheckpointManager
from registry.training.local_tier import node_name

CLI = (
    [str(ROOT / ".venv" / "bin" / "reg")]
    if (ROOT / ".venv/bin/reg").exists()
    else [PY, "-m", "cli"]
)
STEPS_OUTSIDE = 30  # compute steps timed before each async save (no save in flight)
MATMULS, MATMUL_DIM = 8, 512  # one compute step: about 25 ms on one core of the dev VM


def build_state(gib: float, dim: int = 2048) -> dict[str, Any]:
    """Model + AdamW state, Shard(0) across ranks: about gib/world bytes per rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    layers = max(1, round(gib * 2**30 / 3 / (dim * dim * 4)))
    gen = torch.Generator().manual_seed(rank)

    def sharded() -> DTensor:
        local = torch.randn(dim // world, dim, generator=gen)
        return DTensor.from_local(local, mesh, [Shard(0)], run_check=False)

    model = {f"layers.{i}.weight": sharded() for i in range(layers)}
    optim = {
        "state": {
            k: {"exp_avg": sharded(), "exp_avg_sq": sharded(), "step": torch.tensor(100.0)}
            for k in model
        },
        "param_groups": [{"lr": 1e-4, "params": list(model)}],
    }
    return {
        "model": model,
        "optimizer": optim,
        "train_state": {"step": 100},
        "rng": {f"rank{rank}": torch.get_rng_state()},
    }


def tiny_state() -> dict[str, Any]:
    """For the warm-up saves (imports, process groups, the catalog, the CLI's files cached)."""
    return {f"warm.rank{dist.get_rank()}": torch.randn(1024)}


def slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def timed(call: Callable[[], Any]) -> float:
    """The slowest rank's seconds from a barrier to the call's return."""
    dist.barrier()
    start = time.perf_counter()
    call()
    return slowest(time.perf_counter() - start)


def clean(*paths: Path) -> None:
    """Rank 0 deletes what the case wrote and lets the host flush it; every rank waits."""
    if dist.get_rank() == 0:
        for p in paths:
            rm(p)
        settle()
    dist.barrier()


def push(directory: Path, run: str, step: int) -> dict[str, Any]:
    """Rank 0: `reg push-ckpt` as a user runs it; its --json output."""
    flags = ["--run", run, "--step", str(step), "--world-size", str(dist.get_world_size())]
    out = subprocess.run(
        [*CLI, "push-ckpt", str(directory), *flags, "--json"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    if out.returncode != 0:
        raise RuntimeError(f"reg push-ckpt failed: {out.stderr[-2000:]}")
    return dict(json.loads(out.stdout))


def push_on_rank0(directory: Path, run: str, step: int) -> None:
    """Rank 0 pushes; every rank waits for it and raises its error (no rank left waiting)."""
    got: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            push(directory, run, step)
        except Exception as exc:
            got[0] = str(exc)
    dist.broadcast_object_list(got, src=0)
    if got[0] is not None:
        raise RuntimeError(got[0])


def stored(manager: CheckpointManager, run: str, step: int) -> Path:
    store = manager.registry.store
    assert isinstance(store, LocalStore), "the benchmark writes to a local store"
    return store.root / checkpoint_prefix("default", run, step)


def save_costs(manager: CheckpointManager, run: str, step: int) -> dict[str, Any]:
    if dist.get_rank() != 0:
        return {}
    return dict(manager.registry.show(f"{run}@step{step}")["save_costs"] or {})


# -- sync -------------------------------------------------------------------------------------
def bench_sync(args: argparse.Namespace, state: dict[str, Any]) -> dict[str, Any]:
    manager = CheckpointManager("mgr")
    manager.restore(state)  # the registry opened, as at a training job's start
    out: dict[str, Any] = {name: [] for name in args.cases}
    out["a_costs"], out["t_commit"] = [], []
    work: Path = args.work
    tier_dir = work / "tier0"
    tier = CheckpointManager("tier", local_dir=tier_dir, replicate=False, keep_local=1)

    def case(name: str, step: int) -> float:
        d = work / f"dcp-{name}-{step}"
        if name == "a":
            t = timed(lambda: manager.save(state, step))
            out["a_costs"].append(save_costs(manager, "mgr", step))
            clean(stored(manager, "mgr", step))
        elif name == "b":

            def save_then_push() -> None:
                dcp.save(state, storage_writer=FileSystemWriter(str(d)))
                dist.barrier()
                push_on_rank0(d, "push", step)

            t = timed(save_then_push)
            clean(d, stored(manager, "push", step))
        elif name == "t":
            t = timed(lambda: tier.save(state, step))
            out["t_commit"].append(t + timed(tier.wait))  # hashed and committed at tier 0
            clean(tier_dir / "default" / "tier" / f"step-{step}")
        else:
            t = timed(lambda: dcp.save(state, storage_writer=FileSystemWriter(str(d))))
            clean(d)
        return t

    warm = tiny_state()
    manager.save(warm, 0)
    if "t" in args.cases:
        tier.save(warm, 0)
        tier.wait()
    if "b" in args.cases or "c" in args.cases:
        dcp.save(warm, storage_writer=FileSystemWriter(str(work / "dcp-warm")))
        dist.barrier()
        if "b" in args.cases:
            push_on_rank0(work / "dcp-warm", "push", 0)
    clean(work / "dcp-warm")
    names = list(args.cases)
    for i in range(1, args.repeat + 1):
        k = (i - 1) % len(names)
        for name in names[k:] + names[:k]:
            out[name].append(case(name, i))
    manager.close()
    tier.close()
    return out


# -- async ------------------------------------------------------------------------------------
def compute_step(a: torch.Tensor, b: torch.Tensor, persisting: Callable[[], bool]) -> bool:
    """One training step: fixed matmuls, then an all_reduce (the gradients' sync) that also
    tells every rank whether any rank's save is still persisting."""
    for _ in range(MATMULS):
        torch.mm(a, b)
    flag = torch.tensor([1.0 if persisting() else 0.0])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item() > 0)


def steps_outside(a: torch.Tensor, b: torch.Tensor) -> list[float]:
    times = []
    for _ in range(STEPS_OUTSIDE):
        start = time.perf_counter()
        compute_step(a, b, lambda: False)
        times.append(time.perf_counter() - start)
    return times


def steps_while(a: torch.Tensor, b: torch.Tensor, done: threading.Event) -> list[float]:
    """Train until every rank's save has persisted; the steps this rank ended before its own
    save was done (each of them began after the save call returned)."""
    during: list[float] = []
    while True:
        start = time.perf_counter()
        going = compute_step(a, b, lambda: not done.is_set())
        if not done.is_set():
            during.append(time.perf_counter() - start)
        if not going:
            return during


def in_background(work: Callable[[], object]) -> tuple[threading.Event, list[Any]]:
    """Run `work` on a thread; the event is set when it ends, the list gets its end time or
    error."""
    done, box = threading.Event(), list[Any]([None])

    def target() -> None:
        try:
            work()
            box[0] = time.perf_counter()
        except BaseException as exc:
            box[0] = exc
        finally:
            done.set()

    threading.Thread(target=target, name="bench-persist", daemon=True).start()
    return done, box


def ended(box: list[Any]) -> float:
    if isinstance(box[0], BaseException):
        raise box[0]
    return float(box[0])


def bench_async(args: argparse.Namespace, state: dict[str, Any]) -> dict[str, Any]:
    manager = CheckpointManager("mgr-async")
    manager.restore(state)
    group = dist.new_group(backend="gloo")  # the baseline's own group, as the manager has
    gen = torch.Generator().manual_seed(7)
    a = torch.randn(MATMUL_DIM, MATMUL_DIM, generator=gen)
    b = torch.randn(MATMUL_DIM, MATMUL_DIM, generator=gen)
    keys = ("stall", "persist", "recorded_persist", "recorded_stall", "outside", "during")
    out: dict[str, Any] = {f"{who}_{k}": [] for who in ("reg", "dcp", "tier") for k in keys}
    work: Path = args.work
    tier_dir = work / "tier0"
    tier = CheckpointManager("tier-async", local_dir=tier_dir, replicate=False, keep_local=1)

    def reg_case(step: int) -> None:
        out["reg_outside"] += steps_outside(a, b)
        dist.barrier()
        start = time.perf_counter()
        manager.save(state, step, async_=True)
        stall = time.perf_counter() - start
        done, box = in_background(lambda: manager.wait())
        out["reg_during"] += steps_while(a, b, done)
        out["reg_stall"].append(slowest(stall))
        out["reg_persist"].append(slowest(ended(box) - start))
        costs = save_costs(manager, "mgr-async", step)
        out["reg_recorded_persist"].append(costs.get("persist_seconds"))
        out["reg_recorded_stall"].append(costs.get("stall_seconds"))
        clean(stored(manager, "mgr-async", step))

    def tier_case(step: int) -> None:
        """Tier 0 (issue 36), async: staged, then written to the node's disk, hashed and
        committed at tier 0 in the background (no copy to the store)."""
        out["tier_outside"] += steps_outside(a, b)
        dist.barrier()
        start = time.perf_counter()
        tier.save(state, step, async_=True)
        stall = time.perf_counter() - start
        done, box = in_background(lambda: tier.wait())
        out["tier_during"] += steps_while(a, b, done)
        out["tier_stall"].append(slowest(stall))
        out["tier_persist"].append(slowest(ended(box) - start))
        costs = save_costs(tier, "tier-async", step)
        out["tier_recorded_persist"].append(costs.get("persist_seconds"))
        out["tier_recorded_stall"].append(costs.get("stall_seconds"))
        clean(tier_dir / "default" / "tier-async" / f"step-{step}")

    def dcp_case(step: int) -> None:
        d = work / f"dcp-async-{step}"
        out["dcp_outside"] += steps_outside(a, b)
        dist.barrier()
        start = time.perf_counter()
        future = async_save(state, d, group)
        stall = time.perf_counter() - start

        def persist_then_push() -> None:
            future.result()
            if dist.get_rank() == 0:  # its future ends after every rank's files and .metadata
                push(d, "push-async", step)

        done, box = in_background(persist_then_push)
        out["dcp_during"] += steps_while(a, b, done)
        out["dcp_stall"].append(slowest(stall))
        out["dcp_persist"].append(slowest(ended(box) - start))
        clean(d, stored(manager, "push-async", step))

    warm = tiny_state()
    manager.save(warm, 0, async_=True)
    manager.wait()
    async_save(warm, work / "dcp-warm", group).result()
    dist.barrier()
    if dist.get_rank() == 0:
        push(work / "dcp-warm", "push-async", 0)
    clean(work / "dcp-warm")
    tier.save(warm, 0, async_=True)
    tier.wait()
    cases = [reg_case, dcp_case, tier_case]
    for i in range(1, args.repeat + 1):
        k = (i - 1) % len(cases)
        for run_case in cases[k:] + cases[:k]:
            run_case(i)
    manager.close()
    tier.close()
    return out


def async_save(state: dict[str, Any], d: Path, group: Any) -> Any:
    """`dcp.async_save` to a local directory on `group`: its future."""
    got = dcp.async_save(state, storage_writer=FileSystemWriter(str(d)), process_group=group)
    return getattr(got, "upload_completion", got)


# -- restore ----------------------------------------------------------------------------------
def bench_restore(args: argparse.Namespace, state: dict[str, Any]) -> dict[str, Any]:
    work: Path = args.work
    nodes, bare = work / "nodes", work / "bare"
    saver = CheckpointManager("rst", local_dir=nodes, keep_local=4)
    saver.save(state, 1)
    saver.wait(replicated=True)
    saver.close()
    dcp.save(state, storage_writer=FileSystemWriter(str(bare)))
    store_root = stored(saver, "rst", 1)
    out: dict[str, Any] = {"r0": [], "r1": [], "rd": [], "r0_local_bytes": []}

    def restore(node: str) -> CheckpointManager:
        m = CheckpointManager("rst", local_dir=nodes, node_id=node, replicate=False)
        assert m.restore(state) == 1
        return m

    def case(name: str) -> float:
        if dist.get_rank() == 0:
            evict(nodes, bare, store_root)  # cold: as after a restart on another process
        dist.barrier()
        if name == "rd":
            return timed(lambda: dcp.load(state, storage_reader=FileSystemReader(str(bare))))
        box: list[CheckpointManager] = []
        t = timed(lambda: box.append(restore(node_name(None) if name == "r0" else "replaced")))
        if name == "r0" and box[0]._restore is not None:
            out["r0_local_bytes"].append(box[0]._restore.phases.get("local_bytes", 0.0))
        box[0].close()
        return t

    restore(node_name(None)).close()  # warm: imports, the catalog, the process group
    names = ["r0", "r1", "rd"]
    for i in range(1, args.repeat + 1):
        k = (i - 1) % len(names)
        for name in names[k:] + names[:k]:
            out[name].append(case(name))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("sync", "async", "restore"), required=True)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--gib", type=float, default=0.5)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--cases", default="a,b,c,t", help="sync mode: which of a, b, c, t")
    args = parser.parse_args()
    args.cases = [c for c in args.cases.split(",") if c]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    state = build_state(args.gib)
    local = sum(
        t.to_local().nbytes if isinstance(t, DTensor) else t.nbytes
        for t in _tensors(state)
        if isinstance(t, torch.Tensor)
    )
    every = [0] * dist.get_world_size()
    dist.all_gather_object(every, local)
    bench = {"sync": bench_sync, "async": bench_async, "restore": bench_restore}[args.mode]
    result = bench(args, state)
    result.update(world=dist.get_world_size(), bytes_per_rank=every, gib=args.gib)
    if dist.get_rank() == 0:
        args.out.write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def _tensors(tree: Any) -> list[Any]:
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in _tensors(v)]
    if isinstance(tree, list):
        return [t for v in tree for t in _tensors(v)]
    return [tree]


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
