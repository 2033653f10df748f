"""`reg server`: push through the server vs embedded push of the same checkpoint, and `ls` /
`show` latency through the server with 10,000 checkpoints in the catalog.

    python -m bench.server [--gib 1.2] [--repeat 3] [--requests 200]

Push: the CLI end to end, embedded (client writes the local store) and remote (the bytes stream
through a server on 127.0.0.1 onto the same kind of local store), interleaved, median of
`--repeat`; the ratio is embedded time / remote time (1.0x: as fast; the target is >= 0.7x).
Latency: p50/p99 of `GET /v1/checkpoints?run=...` (100 checkpoints), the full listing
(10,000) and `GET /v1/show`, measured by an HTTP client over one keep-alive connection, beside
the same library calls in-process (what the embedded CLI pays before printing).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from bench.checkpoints import make_checkpoint, populate
from bench.common import REG, ROOT, env, evict, report, rm, run


def _server(home: Path) -> tuple[object, str]:
    from tests.serverproc import RegServer, server_env

    server = RegServer(server_env(home, f"sqlite:///{home / 'catalog.db'}"), home)
    server.init().start()
    return server, server.admin_token


def bench_push(work: Path, src: Path, repeat: int) -> list[str]:
    embedded_home, server_home = work / "emb-home", work / "srv-home"
    rm(embedded_home)
    rm(server_home)
    e = env(embedded_home)
    run([*REG, "ls"], e)
    server, token = _server(server_home)
    remote = env(work / "client-home", REG_URL=server.url, REG_TOKEN=token)  # type: ignore[attr-defined]
    emb, rem = [], []
    try:
        for i in range(repeat):
            evict(src)
            emb.append(run([*REG, "push-ckpt", str(src), "--run", "b", "--step", str(i)], e))
            evict(src)
            rem.append(run([*REG, "push-ckpt", str(src), "--run", "b", "--step", str(i)], remote))
            for home in (embedded_home, server_home):
                rm(home / "store" / "ckpt" / "default" / "b" / f"step-{i}")
            subprocess.run(["sync"], check=True)
    finally:
        server.stop()  # type: ignore[attr-defined]
        rm(server_home)
        rm(embedded_home)
    e_t, r_t = statistics.median(emb), statistics.median(rem)
    return [report("push-ckpt through reg server (local store)", r_t, e_t, "embedded push")]


def _percentiles(samples: list[float]) -> str:
    ordered = sorted(samples)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    return f"p50 {1000 * statistics.median(ordered):.1f} ms, p99 {1000 * p99:.1f} ms"


def bench_latency(work: Path, requests: int) -> list[str]:
    home = work / "lat-home"
    rm(home)
    home.mkdir(parents=True)
    populate(home, 10_000)
    server, token = _server(home)
    lines = []
    try:
        with httpx.Client(
            base_url=server.url + "/v1",  # type: ignore[attr-defined]
            headers={"authorization": f"Bearer {token}"},
            timeout=120,
        ) as http:
            for label, path, params, n in (
                ("ls RUN (100 checkpoints)", "/checkpoints", {"run": "run050"}, requests),
                ("show REF", "/show", {"ref": "run050@step5000"}, requests),
                ("ls (all 10,000)", "/checkpoints", {}, max(10, requests // 10)),
            ):
                samples = []
                for _ in range(n):
                    started = time.perf_counter()
                    r = http.get(path, params=params)
                    samples.append(time.perf_counter() - started)
                    assert r.status_code == 200, r.text
                line = f"{'server ' + label:<44} {_percentiles(samples)} ({n} requests)"
                print(line, flush=True)
                lines.append(line)
    finally:
        server.stop()  # type: ignore[attr-defined]
    lines += _in_process(home, requests)
    rm(home)
    return lines


def _in_process(home: Path, requests: int) -> list[str]:
    """The same calls through the embedded library (one process, catalog already open)."""
    import os

    from registry import Registry
    from registry.core.config import Settings

    os.environ.pop("REG_URL", None)
    settings = Settings.from_env({"REG_HOME": str(home), "REG_USER": "admin"})
    lines = []
    with Registry(settings) as reg:
        reg.list_checkpoints("run050")
        for label, call, n in (
            ("ls RUN (100 checkpoints)", lambda: reg.list_checkpoints("run050"), requests),
            ("show REF", lambda: reg.show("run050@step5000"), requests),
            ("ls (all 10,000)", lambda: reg.list_checkpoints(), max(10, requests // 10)),
        ):
            samples = []
            for _ in range(n):
                started = time.perf_counter()
                call()
                samples.append(time.perf_counter() - started)
            line = f"{'embedded ' + label:<44} {_percentiles(samples)} ({n} calls)"
            print(line, flush=True)
            lines.append(line)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, default=1.2)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--work", type=Path, default=None)
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="reg-bench-", dir=ROOT / "bench"))
    try:
        src = make_checkpoint(work / "src", args.gib)
        bench_push(work, src, args.repeat)
        bench_latency(work, args.requests)
    finally:
        if args.work is None:
            rm(work)


if __name__ == "__main__":
    main()
