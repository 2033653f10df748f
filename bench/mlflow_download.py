"""A release downloaded by MLflow's own client through `reg ui`, against `reg pull-release` and
a raw copy of the release's files.

    python -m bench.mlflow_download [--gib 2.0] [--repeat 3]

The checkpoint (ws=2, model + AdamW) is promoted to a release (its model weights, about a
third of it); the drain publishes it (hard links on the local store: no byte copied), then each
run downloads it cold (its files evicted from the page cache first):
  mlflow   `mlflow.artifacts.download_artifacts("models:/bench/1")` against `reg ui`
  reg      `reg pull-release bench:v1` (every byte checked against the recorded sha256)
  cp       `cp -r` of the release folder (no checks), then `sync`
Ratios are baseline time / mlflow time: 1.0x is as fast as the baseline, higher is faster;
`import mlflow` (seconds of it) is measured alone too, and the transfer shown without it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

from bench.checkpoints import make_checkpoint, pushed_as_bench
from bench.common import PY, REG, ROOT, dir_bytes, evict, median_of, rm, run

_DOWNLOAD = (
    "import mlflow, sys; "
    "mlflow.artifacts.download_artifacts('models:/bench/1', dst_path=sys.argv[1])"
)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="reg-bench-mlflow-"))
    try:
        src = make_checkpoint(work / "src", args.gib)
        home = work / "home"
        environ, _ = pushed_as_bench(src, home)
        for cmd in (["promote", "bench@step0", "--model", "bench"], ["mlflow", "sync"]):
            subprocess.run([*REG, *cmd], env=environ, cwd=ROOT, check=True, capture_output=True)
        release = home / "store" / "release" / "bench" / "v1"
        served = next((home / "store" / "mlflow-artifacts").glob("*/releases/bench/v1"))
        linked = all((served / p.name).stat().st_ino == p.stat().st_ino for p in release.iterdir())
        print(f"release {dir_bytes(release) / 2**30:.2f} GiB; published by hard links: {linked}")
        port = 5391
        ui = subprocess.Popen(
            [*REG, "ui", "--port", str(port)],
            env=environ,
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            url = f"http://127.0.0.1:{port}"
            _wait(url)
            client = dict(environ, MLFLOW_TRACKING_URI=url)
            times = {}
            for name, cmd, env in (
                ("mlflow", lambda d: [PY, "-c", _DOWNLOAD, str(d)], client),
                ("import", lambda d: [PY, "-c", "import mlflow"], client),
                ("reg", lambda d: [*REG, "pull-release", "bench:v1", str(d)], environ),
                ("cp", lambda d: ["sh", "-c", f"cp -r {release} {d} && sync"], environ),
            ):

                def once(i: int, name: str = name, cmd=cmd, env=env) -> float:
                    dest = work / f"{name}-{i}"
                    rm(dest)
                    evict(release)
                    return run(cmd(dest), env)

                times[name] = median_of(args.repeat, once)
        finally:
            os.killpg(ui.pid, 15)
            ui.wait(timeout=30)
        gib = dir_bytes(release) / 2**30
        print(json.dumps({k: round(v, 2) for k, v in times.items()}))
        net = times["mlflow"] - times["import"]
        print(
            f"mlflow download {times['mlflow']:.2f} s, of which `import mlflow` "
            f"{times['import']:.2f} s: the transfer {net:.2f} s ({gib / net:.2f} GiB/s)"
        )
        for name in ("reg", "cp"):
            print(
                f"  vs {name} {times[name]:.2f} s: {times[name] / times['mlflow']:.2f}x "
                f"({times[name] / net:.2f}x of the transfer alone)"
            )
    finally:
        rm(work)


def _wait(url: str) -> None:
    import urllib.request

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError("reg ui did not come up in 120 s")


if __name__ == "__main__":
    main()
