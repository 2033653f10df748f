"""A load run against `reg server`: N concurrent clients for S seconds, a mix of reads and
writes, then a check that every acknowledged write is there (no lost updates).

    python -m bench.server_load [--clients 16] [--seconds 30]    (starts its own server)

Each client is a thread with its own token and HTTP connection, doing in turn: list its run,
show a checkpoint, push a new step of its own run (a real DCP checkpoint, streamed), and pin or
unpin a checkpoint. Expected conflicts (409) are counted apart from errors. The bounded version
runs in the test suite (tests/server/test_server_load.py).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from registry.api.remote.push_stream import frame_header


@dataclass
class Tally:
    ok: int = 0
    conflicts: int = 0
    errors: list[str] = field(default_factory=list)
    latencies: dict[str, list[float]] = field(default_factory=dict)
    pushed: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, op: str, seconds: float, response: httpx.Response) -> None:
        with self.lock:
            self.latencies.setdefault(op, []).append(seconds)
            if response.status_code < 400:
                self.ok += 1
            elif response.status_code == 409:
                self.conflicts += 1
            else:
                self.errors.append(f"{op}: {response.status_code} {response.text[:200]}")


def push_body(src: Path, project: str, run: str, step: int) -> bytes:
    files = sorted(p for p in src.rglob("*") if p.is_file())
    header = {
        "project": project,
        "run": run,
        "step": step,
        "world_size": 2,
        "metrics": {},
        "files": [{"path": str(p.relative_to(src)), "size": p.stat().st_size} for p in files],
    }
    parts = [frame_header(header)]
    for p in files:
        content = p.read_bytes()
        parts += [content, hashlib.sha256(content).digest()]
    return b"".join(parts)


def client_loop(url: str, token: str, run: str, src: Path, stop: float, tally: Tally) -> None:
    with httpx.Client(
        base_url=url + "/v1", headers={"authorization": f"Bearer {token}"}, timeout=120
    ) as http:
        step = 0
        while time.monotonic() < stop:
            step += 1
            ops: list[tuple[str, Any]] = [
                (
                    "push",
                    lambda s=step: http.post(
                        "/checkpoints/push", content=push_body(src, "load", run, s)
                    ),
                ),
                ("ls", lambda: http.get("/checkpoints", params={"run": run, "project": "load"})),
                ("show", lambda: http.get("/show", params={"ref": f"load/{run}@latest"})),
                (
                    "pin",
                    lambda s=step: http.post(
                        "/pin", json={"ref": f"load/{run}@step{s}", "pinned": s % 2 == 0}
                    ),
                ),
                (
                    "contend",
                    lambda s=step: http.post(  # every client pushes the same step
                        "/checkpoints/push", content=push_body(src, "load", "shared", s)
                    ),
                ),
            ]
            for op, call in ops:
                started = time.perf_counter()
                response = call()
                tally.add(op, time.perf_counter() - started, response)
                if op == "push" and response.status_code < 400:
                    with tally.lock:
                        tally.pushed.append(f"load/{run}@step{step}")


def load(
    url: str, tokens: list[str], src: Path, seconds: float, name: str = "load"
) -> dict[str, Any]:
    """Run len(tokens) clients for `seconds`, each pushing run `<name><i>` (and all of them
    the run `shared`); then check every acknowledged push is listed."""
    tally = Tally()
    stop = time.monotonic() + seconds
    threads = [
        threading.Thread(target=client_loop, args=(url, t, f"{name}{i}", src, stop, tally))
        for i, t in enumerate(tokens)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    with httpx.Client(
        base_url=url + "/v1", headers={"authorization": f"Bearer {tokens[0]}"}, timeout=120
    ) as http:
        listed = {c["ref"] for c in http.get("/checkpoints", params={"project": "load"}).json()}
    lost = sorted(set(tally.pushed) - listed)
    return {
        "clients": len(tokens),
        "seconds": seconds,
        "requests": tally.ok + tally.conflicts + len(tally.errors),
        "ok": tally.ok,
        "conflicts": tally.conflicts,
        "errors": tally.errors,
        "lost_updates": lost,
        "latency_ms": {
            op: {
                "p50": round(1000 * statistics.median(v), 1),
                "p99": round(1000 * sorted(v)[max(0, int(len(v) * 0.99) - 1)], 1),
                "n": len(v),
            }
            for op, v in sorted(tally.latencies.items())
        },
    }


def main() -> None:
    from tests.helpers import train
    from tests.serverproc import RegServer, server_env

    parser = argparse.ArgumentParser()
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=30)
    parser.add_argument("--catalog-url", default=None, help="default: SQLite in the work dir")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="reg-load-") as tmp:
        work = Path(tmp)
        src = train(work / "ckpt", nproc=2, steps=2, every=2).step_dir(2)
        url = args.catalog_url or f"sqlite:///{work / 'server' / 'catalog.db'}"
        server = RegServer(server_env(work / "server", url), work / "server").init().start()
        try:
            out = load(server.url, [server.admin_token] * args.clients, src, args.seconds)
        finally:
            server.stop()
    print(json.dumps({k: v for k, v in out.items() if k != "errors"}, indent=2))
    print(f"errors: {len(out['errors'])}", *out["errors"][:5], sep="\n")


if __name__ == "__main__":
    main()
