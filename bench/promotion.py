"""Consolidation and validation on a >= 1 GiB DCP checkpoint (ws=2, model + AdamW state).

    python -m bench.promotion [--gib 1.2] [--repeat 3]

Consolidation (DCP -> safetensors of the model weights), each in its own process, wall time and
peak RSS, against:
  (a) what users do today: dcp_to_torch_save + torch.load + safetensors save_file
  (b) dcp.load of the model keys alone at ws=1 into tensors allocated from the metadata + save_file
(Validation has its own benchmark: bench/validation.py.)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.checkpoints import make_checkpoint, pushed_as_bench
from bench.common import PY, ROOT, evict, measured, rm


def _measure(args: list[str], environ: dict[str, str]) -> tuple[float, float, dict]:
    """Wall seconds, peak RSS (MiB) and the JSON the worker printed."""
    wall, usage, out = measured([PY, "-m", "bench.promotion", "--worker", *args], environ)
    return wall, usage.ru_maxrss / 1024, json.loads(out.strip().splitlines()[-1] or "{}")


def worker(mode: str, src: str, out: str, home: str) -> None:
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    result: dict = {}
    if mode == "today":
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        dcp_to_torch_save(src, out + ".pt")
        state = torch.load(out + ".pt", weights_only=True)
        save_file({k: v.contiguous() for k, v in state["model"].items()}, out)
    elif mode == "dcp_load":
        reader = dcp.FileSystemReader(src)
        md = reader.read_metadata()  # trusted here: our own benchmark file
        model = {
            k: torch.empty(v.size, dtype=v.properties.dtype)
            for k, v in md.state_dict_metadata.items()
            if k.startswith("model.")
        }
        dcp.load(model, storage_reader=reader)
        save_file({k.removeprefix("model."): v for k, v in model.items()}, out)
    elif mode == "reg":
        os.environ["REG_HOME"] = home
        from registry import Registry
        from registry.core.refs import CheckpointRef
        from registry.formats.dcp import inventory
        from registry.formats.dcp_roots import merged_metadata
        from registry.lifecycle.checkpoints.read import resolve
        from registry.lifecycle.promotion.consolidate import consolidate
        from registry.lifecycle.promotion.proven import ProvenCheckpoint

        with Registry() as reg:
            prefix = "ckpt/default/bench/step-0/"
            _, _, files = resolve(reg.context, CheckpointRef("default", "bench", 0))
            # What promotion does: prove every shard holding model chunks, then consolidate.
            source = ProvenCheckpoint(reg.store, prefix, files, label="bench", workers=2)
            inv = inventory(merged_metadata(source.metadata, light=True))
            names = {f.removeprefix("model."): f for f in inv.tensors if f.startswith("model.")}
            source.prove(c for fqn in names.values() for c in inv.tensors[fqn].chunks)
            dest = f"release/bench/v{time.time_ns()}/"
            consolidate(
                source,
                inv,
                names,
                reg.store,
                dest,
                cast=None,
                max_shard_bytes=5 * 10**9,
                metadata={"format": "pt"},
                tie_groups=[],
            )
    print(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, default=1.2)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--worker", nargs=4, metavar=("MODE", "SRC", "OUT", "HOME"))
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker)
        return
    work = args.work or Path(tempfile.mkdtemp(prefix="reg-bench-", dir=ROOT / "bench"))
    src = make_checkpoint(work / "src", args.gib)
    home = work / "promo-home"
    e, stored = pushed_as_bench(src, home)
    print(
        f"checkpoint: {sum(f.stat().st_size for f in src.iterdir()) / 2**30:.2f} GiB "
        f"(ws=2, model + AdamW); files evicted from the page cache before each run; "
        f"median of {args.repeat}",
        flush=True,
    )

    results: dict[str, list[tuple[float, float]]] = {"today": [], "dcp_load": [], "reg": []}
    for i in range(args.repeat):
        for mode in results:
            out = work / f"{mode}-{i}.safetensors"
            evict(src, stored)
            wall, rss, _ = _measure([mode, str(src), str(out), str(home)], e)
            results[mode].append((wall, rss))
            rm(out)
            Path(str(out) + ".pt").unlink(missing_ok=True)
    med = {
        m: (statistics.median(w for w, _ in r), statistics.median(s for _, s in r))
        for m, r in results.items()
    }
    reg_wall, reg_rss = med["reg"]
    for mode, label in (
        ("today", "(a) dcp_to_torch_save+load+save_file"),
        ("dcp_load", "(b) dcp.load model keys+save_file"),
    ):
        wall, rss = med[mode]
        print(
            f"consolidate vs {label:<38} reg {reg_wall:6.2f}s {reg_rss:6.0f} MiB | "
            f"baseline {wall:6.2f}s {rss:6.0f} MiB | speed {wall / reg_wall:4.2f}x, "
            f"RSS {100 * reg_rss / rss:3.0f}%",
            flush=True,
        )

    if args.work is None:
        rm(work)


if __name__ == "__main__":
    sys.exit(main())
