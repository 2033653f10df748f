"""The `sharded` mode: M ranks restore the model (and optimizer) the way training shards it.

DCP records no placements, so they come from the model factory's module, never from guesses:
`parallelize(model, mesh)` applies the training's sharding (FSDP2's `fully_shard`, tensor
parallel plans) to the model built on the meta device; `build_optimizer(model)` builds its
optimizer for `--with-optimizer`. Each rank materializes its shards on the device, takes the
state dict through `get_state_dict`, loads it from the store through DCP (resharded from
whatever world size saved it), puts it back with `set_state_dict`, and runs the probe on the
sharded model (every rank takes part, rank 0 reports). Ranks run as spawned processes (gloo on
CPU, NCCL on CUDA, one GPU per rank).
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from registry.errors import UsageError
from registry.formats import file_roots
from registry.formats.dcp import inventory
from registry.formats.dcp_roots import stored_metadata
from registry.lifecycle.validation.checks import ModelCheck, Outcome, load_factory, run_probe
from registry.storage import open_store

START_ATTEMPTS = 2  # gloo now and then aborts a rank while the group forms on a busy machine
RANK_TIMEOUT_S = 600


@dataclass(frozen=True, slots=True)
class ShardedJob:
    store_url: str
    prefix: str
    versions: dict[str, str]
    paths: list[str]
    device: str
    world_size: int
    model: ModelCheck
    optimizer_path: str | None  # the optimizer's key path, with --with-optimizer
    sizes: dict[str, int]  # path -> bytes, as recorded


def require_hooks(spec: str, world_size: int, with_optimizer: bool) -> None:
    """Exit 2 unless the factory's module defines what the sharded mode calls."""
    _, module = load_factory(spec)
    wanted = ["parallelize"] + (["build_optimizer"] if with_optimizer else [])
    missing = [name for name in wanted if not callable(getattr(module, name, None))]
    if missing:
        raise UsageError(
            f"--world-size {world_size}: {module.__name__} defines no "
            + " and no ".join(
                f"{m}({'model, mesh' if m == 'parallelize' else 'model'})" for m in missing
            ),
            "DCP records no placements: the factory's module says how training shards the "
            "model (parallelize) and builds its optimizer (build_optimizer); or validate at "
            "--world-size 1",
        )


def run_sharded(job: ShardedJob, out: Outcome) -> None:
    """The ranks' restore and probe into `out` (checks restore_sharded, sharding, probe)."""
    if job.store_url.startswith("memory://"):
        raise UsageError(
            "a memory store cannot be shared with validation ranks in other processes",
            "validate at world size 1, or use a file:// or s3:// store",
        )
    results: list[dict[str, Any]] | str = "not run"
    for _ in range(START_ATTEMPTS):
        results = _spawn(job)
        if not (isinstance(results, str) or any(r.get("stage") == "start" for r in results)):
            break  # the ranks came up; whatever they found stands
    if isinstance(results, str):
        out.add(
            "restore_sharded", False, f"restore at world size {job.world_size} failed: {results}"
        )
        return
    out.phases["sharded_seconds"] = round(max(r["seconds"] for r in results), 3)
    errors = [r["error"] for r in results if r.get("error")]
    if errors:
        out.add("restore_sharded", False, errors[0])
        return
    what = "model and optimizer" if job.optimizer_path is not None else "model"
    out.add(
        "restore_sharded",
        True,
        f"{what} restored through {job.model.spec.partition(':')[0]}.parallelize onto "
        f"{job.world_size} ranks ({job.device}) in {out.phases['sharded_seconds']:.2f}s",
    )
    out.sharding = _sharding(results)
    plain = [n for n, s in out.sharding.items() if not s["dtensor"]]
    largest = max((s["largest_share"] for s in out.sharding.values()), default=0.0)
    placements = sorted({s["placements"] for s in out.sharding.values() if s["dtensor"]})
    out.add(
        "sharding",
        not plain,
        f"{len(plain)} parameters are not DTensors, first: {plain[0]}"
        if plain
        else f"{len(out.sharding)} parameters as DTensors {', '.join(placements)}; the largest "
        f"local shard holds {largest:.0%} of its parameter",
    )
    probe = results[0].get("probe")
    if probe is not None:
        out.add("probe", probe["passed"], probe["detail"])


def _sharding(results: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """name -> {dtensor, placements, numel, local (per rank), largest_share}."""
    out: dict[str, dict[str, Any]] = {}
    for name, (dtensor, placements, numel, _) in results[0]["params"].items():
        local = [r["params"][name][3] for r in results]
        out[name] = {
            "dtensor": dtensor,
            "placements": placements,
            "numel": numel,
            "local": local,
            "largest_share": max(local) / numel if numel else 0.0,
        }
    return out


def _spawn(job: ShardedJob) -> list[dict[str, Any]] | str:
    """Each rank's report, or why the ranks did not all report (a rank killed by a signal)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="reg-validate-") as tmp:
        try:
            mp.spawn(  # type: ignore[no-untyped-call]  # torch leaves spawn unannotated
                _rank_main,
                args=(job, _free_port(), tmp),
                nprocs=job.world_size,
                join=True,
            )
        except Exception as exc:
            return str(exc).strip().splitlines()[-1]
        return [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(job.world_size)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _nest(path: str, value: Any) -> dict[str, Any]:
    """`value` under the key path `path` ("" = merged at the top)."""
    out = value
    for part in reversed(path.split(".") if path else []):
        out = {part: out}
    return dict(out)


def stored_roots(store: Any, job: ShardedJob) -> Any:
    """The checkpoint's metadata, each root read from the store (the streamed pass before
    proved every file): a `.metadata` whole, a file root's ranges alone (file_roots.py)."""

    def read(path: str) -> bytes:
        version = job.versions.get(path)
        if not file_roots.is_root_name(path):
            return bytes(store.get_bytes(job.prefix + path, version=version))
        key = job.prefix + path
        root, _ = file_roots.read_root(
            path,
            lambda at, n: bytes(store.read_range(key, at, n, version=version)),
            job.sizes[path],
            path,
        )
        return root

    metadata = stored_metadata(read, job.paths)
    inventory(metadata)  # the same checks as everywhere: every tensor tiled exactly
    return metadata


def _rank_main(rank: int, job: ShardedJob, port: int, tmp: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from registry.formats.dcp_load import SafeLoadPlanner, StoreReader

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    result: dict[str, Any] = {"seconds": 0.0, "params": {}, "stage": "start"}
    try:
        if job.device == "cuda":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(
            "nccl" if job.device == "cuda" else "gloo",
            rank=rank,
            world_size=job.world_size,
            timeout=timedelta(seconds=RANK_TIMEOUT_S),  # a rank that failed alone ends the rest
        )
        mesh = init_device_mesh(job.device, (job.world_size,))
        result["stage"] = "load"
        fn, module = load_factory(job.model.spec)
        with torch.device("meta"):
            model = fn()
        module.parallelize(model, mesh)
        model.to_empty(device=job.device)
        _init_buffers(model, module)
        optim = module.build_optimizer(model) if job.optimizer_path is not None else None
        if optim is None:
            from torch.distributed.checkpoint.state_dict import get_model_state_dict

            msd, osd = get_model_state_dict(model), None
        else:
            msd, osd = get_state_dict(model, optim)
        state: dict[str, Any] = {job.model.names[name]: t for name, t in msd.items()}
        if osd is not None:
            state.update(_nest(job.optimizer_path or "", osd))
        store = open_store(job.store_url)
        dist.barrier()
        started = time.perf_counter()
        dcp.load(
            state,
            storage_reader=StoreReader(store, job.prefix, stored_roots(store, job), job.versions),
            planner=SafeLoadPlanner(),
        )
        if optim is None or osd is None:
            from torch.distributed.checkpoint.state_dict import set_model_state_dict

            set_model_state_dict(model, msd)
        else:
            set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=osd)
        if job.device == "cuda":
            torch.cuda.synchronize()  # before the clock is read
        result["seconds"] = time.perf_counter() - started
        for name, param in model.named_parameters():
            dtensor = isinstance(param, DTensor)
            local = param.to_local() if dtensor else param
            placements = str(tuple(param.placements)) if dtensor else ""
            result["params"][name] = [dtensor, placements, param.numel(), local.numel()]
        checked = Outcome()
        run_probe(model, job.model, checked)  # collective under FSDP: every rank runs it
        probe = next((c for c in checked.checks if c.name == "probe"), None)
        if rank == 0 and probe is not None:
            result["probe"] = probe.as_dict()
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        result["error"] = f"rank {rank}: {_one_line(exc)}"
    Path(tmp, f"rank{rank}.json").write_text(json.dumps(result))


def _init_buffers(model: Any, module: Any) -> None:
    """Buffers left out of the state dict (rotary frequencies, masks) are not in the checkpoint
    and `to_empty` leaves them uninitialized: the module's `init_buffers(model)` sets them;
    without it a model that has them is refused (its probe would run on garbage)."""
    names = {n for n, _ in model.named_buffers()} - set(model.state_dict())
    if not names:
        return
    init = getattr(module, "init_buffers", None)
    if not callable(init):
        raise UsageError(
            f"{module.__name__}'s model has buffers outside its state dict "
            f"({', '.join(sorted(names)[:3])}) that the sharded restore cannot fill",
            f"define init_buffers(model) in {module.__name__} to set them after to_empty",
        )
    init(model)


def _one_line(exc: BaseException) -> str:
    """DCP's CheckpointException carries each rank's error: the first one, on one line."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        first = failures[min(failures)]
        exc = first[0] if isinstance(first, tuple) else first
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {(text[0] if text else '')[:300]}"
