"""All benchmarks, one command: `python -m bench [--gib 1.2] [--repeat 3]`.

Runs bench.checkpoints, bench.promotion, bench.validation, bench.s3, bench.presigned,
bench.server, bench.training, bench.gc, bench.mlflow_download and bench.fsck in turn on one
shared 1.2 GiB checkpoint (made once by 2 torchrun ranks; bench.training saves its own state of
that size from torchrun jobs); each prints ratios against baselines measured in the same run.
The validation figures of docs/development/benchmarks.md come from
`python -m bench.validation --gib 4` (the issue's 4 GiB checkpoint). Then bench.torture with 50
kills per operation and backend (`python -m bench.torture --n 500` is the large run).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import ROOT, rm


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, default=1.2)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="reg-bench-", dir=ROOT / "bench"))
    common = ["--work", str(work), "--gib", str(args.gib), "--repeat", str(args.repeat)]
    try:
        for module, extra in (
            ("bench.checkpoints", common),
            ("bench.promotion", common),
            ("bench.validation", common),
            ("bench.s3", common),
            ("bench.presigned", common),
            ("bench.server", common),
            ("bench.training", common),
            ("bench.gc", []),
            ("bench.mlflow_download", ["--gib", str(args.gib), "--repeat", str(args.repeat)]),
            ("bench.fsck", ["--gib", str(args.gib), "--repeat", str(args.repeat)]),
            ("bench.torture", ["--n", "50"]),
        ):
            print(f"== {module}", flush=True)
            subprocess.run([sys.executable, "-m", module, *extra], cwd=ROOT, check=True)
    finally:
        rm(work)


if __name__ == "__main__":
    main()
