"""`reg fsck` and scrubs against `sha256sum` of the same bytes (issue 17).

    python -m bench.fsck [--gib 1.0] [--steps 2] [--repeat 3]

One checkpoint (2 torchrun ranks) pushed as `--steps` steps and promoted once; then, cold (the
store's pages dropped before each run), medians of: `sha256sum` over every stored file (the
baseline: what a shell scrub costs), `reg fsck --full`, `reg fsck` (sizes of all, documents and
32 sampled files hashed), `reg verify --all` (a scrub) and `reg verify --all --rate 200MB/s`
(whose achieved rate must stay at or under the limit, plus one second of burst).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

from bench.checkpoints import make_checkpoint, pushed_as_bench
from bench.common import REG, ROOT, dir_bytes, evict, measured, median_of, rm


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="reg-bench-fsck-"))
    try:
        src = make_checkpoint(work / "src", args.gib)
        home = work / "home"
        environ, _ = pushed_as_bench(src, home)
        for step in range(1, args.steps):
            push = ["push-ckpt", str(src), "--run", "bench", "--step", str(step)]
            subprocess.run([*REG, *push], env=environ, cwd=ROOT, check=True, capture_output=True)
        promote = ["promote", "bench@step0", "--model", "bench"]
        subprocess.run([*REG, *promote], env=environ, cwd=ROOT, check=True, capture_output=True)
        store = home / "store"
        size = dir_bytes(store)
        baseline = ["sh", "-c", f"find {store} -type f -print0 | xargs -0 sha256sum > /dev/null"]
        commands = {
            "sha256sum": baseline,
            "fsck --full": [*REG, "fsck", "--full", "--json"],
            "fsck": [*REG, "fsck", "--json"],
            "verify --all": [*REG, "verify", "--all", "--json"],
            "verify --all --rate 200MB/s": [*REG, "verify", "--all", "--rate", "200MB/s", "--json"],
        }
        times: dict[str, float] = {}
        last: dict[str, str] = {}
        for name, cmd in commands.items():

            def once(_: int, cmd: list[str] = cmd, name: str = name) -> float:
                evict(store)
                wall, _usage, out = measured(cmd, environ)
                last[name] = out
                return wall

            times[name] = median_of(args.repeat, once)
        base = times["sha256sum"]
        print(f"store: {size / 2**30:.2f} GiB ({args.steps} checkpoints + 1 release), cold")
        for name, seconds in times.items():
            rate = size / seconds / 2**20
            print(
                f"  {name:<28} {seconds:6.2f}s  {rate:7.0f} MiB/s  {seconds / base:4.2f}x sha256sum"
            )
        rated = json.loads(last["verify --all --rate 200MB/s"])
        print(
            f"  the rated scrub read {rated['bytes'] / 2**20:.0f} MiB at "
            f"{rated['bytes_per_second'] / 1e6:.0f} MB/s (limit 200 MB/s, 1 s burst)"
        )
    finally:
        rm(work)


if __name__ == "__main__":
    main()
