"""Validation within a memory budget on a large checkpoint, against what it replaces.

    python -m bench.validation [--gib 4] [--budget 512MiB] [--repeat 3] [--device cpu|cuda]

The checkpoint (ws=2, float32 model + AdamW state, from 2 torchrun ranks) is pushed once into a
fresh embedded registry. Page cache warm: every file is read once before each run. Each run is
its own process; wall time and peak RSS (wait4) per run, medians of --repeat:
  reg        `reg validate --memory-budget B`: one pass that hashes every file and checks every
             tensor (shapes, coverage, finite) in batches within B
  baseline   what a script does: a sha256 pass over every file, then a bare `dcp.load` of the
             whole checkpoint (every tensor allocated from the metadata on the device)
Targets (issue 21): wall time <= 1.1x the baseline's, peak RSS <= 25% of the checkpoint's size.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import tempfile
from pathlib import Path

from bench.checkpoints import make_checkpoint, pushed_as_bench
from bench.common import PY, REG, ROOT, dir_bytes, measured, rm


def warm(*roots: Path) -> None:
    for root in roots:
        for f in sorted(p for p in root.rglob("*") if p.is_file()):
            with open(f, "rb") as fh:
                while fh.read(16 << 20):
                    pass


def baseline(src: str, device: str) -> None:
    """sha256 of every file, then dcp.load of everything (the worker of one baseline run)."""
    import torch
    import torch.distributed.checkpoint as dcp

    digests = {}
    for f in sorted(Path(src).iterdir()):
        h = hashlib.sha256()
        with open(f, "rb") as fh:
            while piece := fh.read(8 << 20):
                h.update(piece)
        digests[f.name] = h.hexdigest()
    reader = dcp.FileSystemReader(src)
    md = reader.read_metadata()  # trusted here: the benchmark's own file
    state = {
        k: torch.empty(v.size, dtype=v.properties.dtype, device=device)
        for k, v in md.state_dict_metadata.items()
        if hasattr(v, "chunks")
    }
    state |= {k: None for k, v in md.state_dict_metadata.items() if not hasattr(v, "chunks")}
    dcp.load(state, storage_reader=reader)
    if device == "cuda":
        torch.cuda.synchronize()
    print(json.dumps({"files": len(digests)}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, default=4.0)
    parser.add_argument("--budget", default="512MiB")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--baseline-worker", nargs=2, metavar=("SRC", "DEVICE"))
    args = parser.parse_args()
    if args.baseline_worker:
        baseline(*args.baseline_worker)
        return
    work = args.work or Path(tempfile.mkdtemp(prefix="reg-bench-", dir=ROOT / "bench"))
    src = make_checkpoint(work / "src", args.gib)
    e, stored = pushed_as_bench(src, work / "validate-home", PYTHONWARNINGS="ignore")
    size = dir_bytes(src)
    print(
        f"checkpoint: {size / 2**30:.2f} GiB (ws=2, model + AdamW), --memory-budget "
        f"{args.budget}, device {args.device}; page cache warm; median of {args.repeat}",
        flush=True,
    )
    ours, base, detail = [], [], ""
    for _ in range(args.repeat):
        warm(stored)
        wall, usage, out = measured(
            [*REG, "validate", "bench@step0", "--device", args.device, "--memory-budget",
             args.budget, "--json"],
            e,
        )  # fmt: skip
        found = json.loads(out)
        assert found["passed"], found["checks"]
        detail = next(c["detail"] for c in found["checks"] if c["name"] == "restore")
        ours.append((wall, usage.ru_maxrss * 1024))
        warm(src)
        wall, usage, _ = measured(
            [PY, "-m", "bench.validation", "--baseline-worker", str(src), args.device], e
        )
        base.append((wall, usage.ru_maxrss * 1024))
    reg_wall = statistics.median(w for w, _ in ours)
    reg_rss = statistics.median(r for _, r in ours)
    base_wall = statistics.median(w for w, _ in base)
    base_rss = statistics.median(r for _, r in base)
    print(f"reg: {detail}")
    print(
        f"validate {size / 2**30:.1f} GiB within {args.budget}: reg {reg_wall:6.2f}s, "
        f"sha256 pass + dcp.load {base_wall:6.2f}s: {reg_wall / base_wall:4.2f}x of the "
        f"baseline's time (target <= 1.1x)"
    )
    print(
        f"peak RSS: reg {reg_rss / 2**20:6.0f} MiB = {100 * reg_rss / size:4.1f}% of the "
        f"checkpoint (target <= 25%); baseline {base_rss / 2**20:6.0f} MiB = "
        f"{100 * base_rss / size:4.0f}%",
        flush=True,
    )
    if args.work is None:
        rm(work)


if __name__ == "__main__":
    sys.exit(main())
