"""Restore a checkpoint through DCP straight from the store: here (world size 1), or resharded
onto M spawned ranks (gloo, or NCCL on CUDA), each loading its Shard(0) slice. Either way every
tensor is checked (shapes and coverage, finite) and, with a model factory, the model is loaded
strictly and probed (on rank 0 from the full tensors, when resharded)."""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

from registry.errors import RegistryError, UsageError
from registry.formats.dcp import Inventory, inventory
from registry.formats.dcp_roots import stored_metadata
from registry.lifecycle.validation.checks import (
    ModelCheck,
    Outcome,
    add_finite,
    add_shapes,
    check_model,
    check_tensors,
    nonfinite,
    shape_problems,
)
from registry.storage.base import BaseStore


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError(
            f"--device cuda: no CUDA device here (torch {torch.__version__}, "
            f"built with CUDA {torch.version.cuda or 'none'})",
            "run this validation on a GPU node, or use --device cpu where the policy allows",
        )
    if device not in ("cuda", "cpu"):
        raise UsageError(f"unknown device {device!r}", "use cuda, cpu or auto")
    return device


def device_name(device: str) -> str:
    import platform

    import torch

    if device == "cuda":
        return str(torch.cuda.get_device_name(0))
    return platform.processor() or platform.machine() or "cpu"


def _template(inv: Inventory, device: str) -> dict[str, Any]:
    import torch

    state: dict[str, Any] = {}
    for fqn, t in inv.tensors.items():
        state[fqn] = torch.empty(t.shape, dtype=getattr(torch, t.dtype), device=device)
    for fqn in inv.byte_items:
        state[fqn] = None
    return state


def restore_here(
    store: BaseStore,
    prefix: str,
    versions: dict[str, str],
    metadata: Any,
    inv: Inventory,
    device: str,
    model: ModelCheck | None,
    out: Outcome,
) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    from registry.formats.dcp_load import SafeLoadPlanner, StoreReader

    state = _template(inv, device)
    started = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process"
            dcp.load(
                state,
                storage_reader=StoreReader(store, prefix, metadata, versions),
                planner=SafeLoadPlanner(),
            )
        if device == "cuda":
            torch.cuda.synchronize()
    except RegistryError as exc:
        out.add("restore", False, str(exc))
        return
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        if isinstance(exc, KeyboardInterrupt | SystemExit):
            raise
        out.add("restore", False, f"{type(exc).__name__}: {_first_line(exc)}")
        return
    out.phases["restore_seconds"] = round(time.perf_counter() - started, 3)
    out.add(
        "restore",
        True,
        f"{len(inv.tensors)} tensors and {len(inv.byte_items)} objects "
        f"loaded on {device} at world size 1 in {out.phases['restore_seconds']:.2f}s",
    )
    started = time.perf_counter()
    check_tensors(state, inv, out)
    if model is not None:
        check_model({name: state[fqn] for name, fqn in model.names.items()}, device, model, out)
    out.phases["checks_seconds"] = round(time.perf_counter() - started, 3)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


def restore_distributed(
    store: BaseStore,
    prefix: str,
    versions: dict[str, str],
    paths: list[str],
    inv: Inventory,
    device: str,
    world_size: int,
    model: ModelCheck | None,
    out: Outcome,
) -> None:
    """Reshard onto `world_size` spawned ranks; each reports what it checked. Ranks that fail
    to come up (before any byte is read) are started once more."""
    if store.url.startswith("memory://"):
        raise UsageError(
            "a memory store cannot be shared with validation ranks in other processes",
            "validate at world size 1, or use a file:// or s3:// store",
        )
    results: list[dict[str, Any]] | str = "not run"
    for _ in range(START_ATTEMPTS):
        results = _spawn_ranks(store.url, prefix, versions, paths, device, world_size, model)
        if not (isinstance(results, str) or any(r.get("stage") == "start" for r in results)):
            break  # the ranks came up; whatever they found stands
    if isinstance(results, str):
        out.add("restore", False, f"restore at world size {world_size} failed: {results}")
        return
    out.phases["restore_seconds"] = round(max(r["seconds"] for r in results), 3)
    errors = [r["error"] for r in results if r.get("error")]
    if errors:
        out.add("restore", False, errors[0])
        return
    out.add(
        "restore",
        True,
        f"{len(inv.tensors)} tensors resharded onto {world_size} ranks "
        f"({device}) in {out.phases['restore_seconds']:.2f}s",
    )
    add_shapes(out, sorted({w for r in results for w in r["shapes"]}), len(inv.tensors))
    add_finite(out, sorted({b for r in results for b in r["nonfinite"]}))
    for check in results[0].get("model", []):
        out.add(check["name"], check["passed"], check["detail"])
    out.tied = results[0].get("tied", [])


START_ATTEMPTS = 2  # gloo now and then aborts a rank while the group forms on a busy machine


def _spawn_ranks(
    store_url: str,
    prefix: str,
    versions: dict[str, str],
    paths: list[str],
    device: str,
    world_size: int,
    model: ModelCheck | None,
) -> list[dict[str, Any]] | str:
    """Each rank's report, or why the ranks did not all report (a rank killed by a signal)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="reg-validate-") as tmp:
        try:
            mp.spawn(  # type: ignore[no-untyped-call]  # torch leaves spawn unannotated
                _rank_main,
                args=(
                    world_size,
                    _free_port(),
                    device,
                    store_url,
                    prefix,
                    versions,
                    paths,
                    tmp,
                    model,
                ),
                nprocs=world_size,
                join=True,
            )
        except Exception as exc:
            return str(exc).strip().splitlines()[-1]
        return [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world_size)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(
    rank: int,
    world: int,
    port: int,
    device: str,
    store_url: str,
    prefix: str,
    versions: dict[str, str],
    paths: list[str],
    tmp: str,
    model: ModelCheck | None,
) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from registry.formats.dcp_load import SafeLoadPlanner, StoreReader
    from registry.storage import open_store

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    result: dict[str, Any] = {"seconds": 0.0, "nonfinite": [], "shapes": [], "stage": "start"}
    try:
        if device == "cuda":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=rank, world_size=world)
        mesh = init_device_mesh(device, (world,))
        result["stage"] = "load"
        store = open_store(store_url)
        metadata = stored_metadata(
            lambda p: store.get_bytes(prefix + p, version=versions.get(p)), paths
        )
        inv = inventory(metadata)
        state: dict[str, Any] = {}
        for fqn, t in inv.tensors.items():
            placement = Shard(0) if t.shape and t.shape[0] >= world else Replicate()
            empty = torch.empty(t.shape, dtype=getattr(torch, t.dtype), device=device)
            state[fqn] = distribute_tensor(empty, mesh, [placement])
        for fqn in inv.byte_items:
            state[fqn] = None
        dist.barrier()
        started = time.perf_counter()
        dcp.load(
            state,
            storage_reader=StoreReader(store, prefix, metadata, versions),
            planner=SafeLoadPlanner(),
        )
        result["seconds"] = time.perf_counter() - started
        result["shapes"] = shape_problems(state, inv)  # DTensor shapes are global
        for fqn in sorted(inv.tensors):
            bad = nonfinite(fqn, state[fqn].to_local())
            if bad is not None:
                result["nonfinite"].append(bad)
        if model is not None:
            # Every rank takes part in gathering the full tensors; rank 0 checks the model.
            weights = {name: state[fqn].full_tensor() for name, fqn in model.names.items()}
            if rank == 0:
                checked = Outcome()
                check_model(weights, device, model, checked)
                result["model"] = [c.as_dict() for c in checked.checks]
                result["tied"] = checked.tied
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        result["error"] = f"rank {rank}: {type(exc).__name__}: {str(exc).strip()[:300]}"
    Path(tmp, f"rank{rank}.json").write_text(json.dumps(result))
