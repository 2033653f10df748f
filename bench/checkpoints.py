"""Push and pull of a >= 1 GiB checkpoint against `cp -r` + `sync`; start-up against the floor.

    python -m bench.checkpoints [--gib 1.2] [--repeat 3] [--warm] [--ranks 2]

The source is evicted from the page cache before each run; `--warm` also measures the push of
a source still in the page cache, as right after a training job's save (issue 36).

Ratios are baseline time / reg time: 1.0x is as fast as the baseline, higher is faster.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from bench.common import PY, REG, ROOT, dir_bytes, env, evict, median_of, report, rm, run


def make_checkpoint(out: Path, gib: float, ranks: int = 2) -> Path:
    if not (out / ".metadata").exists():
        subprocess.run(
            [
                PY,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc-per-node={ranks}",
                "-m",
                "bench.make_checkpoint",
                "--out",
                str(out),
                "--gib",
                str(gib),
            ],
            cwd=ROOT,
            env=env(out.parent),
            check=True,
            capture_output=True,
        )
    return out


def pushed_as_bench(src: Path, home: Path, **extra: str) -> tuple[dict[str, str], Path]:
    """`src` pushed as bench@step0 into a fresh registry at `home` (CPU validation allowed):
    the environment to run reg in, and where the store keeps the checkpoint."""
    rm(home)
    e = env(home, REG_POLICY=str(ROOT / "examples" / "cpu-policy.toml"), **extra)
    subprocess.run(
        [*REG, "push-ckpt", str(src), "--run", "bench", "--step", "0", "--json"],
        env=e,
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    return e, home / "store" / "ckpt" / "default" / "bench" / "step-0"


def warm(src: Path) -> None:
    """The source's pages in the cache, as right after the save wrote them."""
    for f in sorted(p for p in src.rglob("*") if p.is_file()):
        with open(f, "rb") as fh:
            while fh.read(8 << 20):
                pass


def bench_warm_push(work: Path, src: Path, repeat: int) -> list[str]:
    home = work / "home-warm"
    rm(home)
    e = env(home)
    run([*REG, "ls"], e)
    cp_times, push_times, uploads = [], [], []
    for i in range(repeat):
        dst = work / f"cp-warm-{i}"
        warm(src)
        cp_times.append(run(["bash", "-c", f"cp -r {src} {dst} && sync"]))
        rm(dst)
        subprocess.run(["sync"], check=True)
        warm(src)
        start = time.perf_counter()
        out = subprocess.run(
            [*REG, "push-ckpt", str(src), "--run", "warm", "--step", str(i), "--json"],
            env=e,
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        )
        push_times.append(time.perf_counter() - start)
        uploads.append(json.loads(out.stdout)["upload_seconds"])
        rm(home / "store" / "ckpt" / "default" / "warm" / f"step-{i}")
        subprocess.run(["sync"], check=True)
    cp_t, push_t = statistics.median(cp_times), statistics.median(push_times)
    lines = [
        report("push-ckpt, warm source, CLI end to end", push_t, cp_t, "cp -r+sync"),
        report("push-ckpt, warm source, data path", statistics.median(uploads), cp_t, "cp -r+sync"),
    ]
    rm(home)
    return lines


def bench_push_pull(work: Path, src: Path, repeat: int) -> list[str]:
    size = dir_bytes(src)
    shards = len(list(src.glob("*.distcp")))
    home = work / "home"
    rm(home)
    e = env(home)
    run([*REG, "ls"], e)  # an initialized registry, as in real use
    lines = [
        f"checkpoint: {size / 2**30:.2f} GiB, {shards} shard files, random data; source "
        f"evicted from the page cache before each run (median of {repeat})"
    ]
    print(lines[0], flush=True)

    def cp(i: int) -> float:
        dst = work / f"cp-{i}"
        evict(src)
        t = run(["bash", "-c", f"cp -r {src} {dst} && sync"])
        rm(dst)
        subprocess.run(["sync"], check=True)
        return t

    uploads: list[float] = []

    def push(i: int) -> float:
        evict(src)
        start = time.perf_counter()
        out = subprocess.run(
            [*REG, "push-ckpt", str(src), "--run", "bench", "--step", str(i), "--json"],
            env=e,
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        )
        elapsed = time.perf_counter() - start
        uploads.append(json.loads(out.stdout)["upload_seconds"])
        return elapsed

    # Interleaved, and each copy deleted after its run: this VM's disk slows down as written
    # data piles up, and both sides must see the same conditions.
    cp_times, push_times = [], []
    for i in range(repeat):
        cp_times.append(cp(i))
        push_times.append(push(i))
        if i > 0:
            rm(home / "store" / "ckpt" / "default" / "bench" / f"step-{i}")
    cp_t, push_t = statistics.median(cp_times), statistics.median(push_times)
    upload_t = statistics.median(uploads)
    lines.append(report("push-ckpt, CLI end to end", push_t, cp_t, "cp -r+sync"))
    lines.append(report("push-ckpt, data path (upload_seconds)", upload_t, cp_t, "cp -r+sync"))
    stored = home / "store" / "ckpt" / "default" / "bench" / "step-0"

    def cp_back(i: int) -> float:
        dst = work / f"cpb-{i}"
        evict(stored)
        t = run(["bash", "-c", f"cp -r {stored} {dst} && sync"])
        rm(dst)
        subprocess.run(["sync"], check=True)
        return t

    def pull(i: int) -> float:
        dst = work / f"pull-{i}"
        evict(stored)
        t = run([*REG, "pull", "bench@step0", str(dst), "--json"], e)
        rm(dst)
        subprocess.run(["sync"], check=True)
        return t

    pairs = [(cp_back(i), pull(i)) for i in range(repeat)]
    cpb_t = statistics.median(p[0] for p in pairs)
    pull_t = statistics.median(p[1] for p in pairs)
    lines.append(report("pull (sha256 verified while writing)", pull_t, cpb_t, "cp -r+sync"))
    rm(home)
    return lines


def key_paths(run: int) -> tuple[str, ...]:
    """A 32-layer transformer's DCP key paths with AdamW state (about 1,200), distinct per run
    (the worst case for `reg ls`: every run's key set classified)."""
    params = ["tok_embeddings.weight", "norm.weight", "output.weight", f"extra{run}.weight"]
    for i in range(32):
        for name in ("wq", "wk", "wv", "wo", "w1", "w2", "w3", "attention_norm", "ffn_norm"):
            params.append(f"layers.{i}.{name}.weight")
    keys = [f"model.{p}" for p in params]
    keys += [f"optimizer.state.{p}.{s}" for p in params for s in ("exp_avg", "exp_avg_sq", "step")]
    keys += ["optimizer.param_groups.0.lr", "optimizer.param_groups.0.params"]
    keys += ["lr_scheduler.last_epoch", "train_state.step", "rng.rank0", "dataloader.rank0"]
    return tuple(sorted(keys))


def populate(home: Path, n: int) -> None:
    """n committed checkpoints (3 files each) straight into the catalog, with key paths."""
    from registry.catalog.engine import Catalog
    from registry.catalog.models import Checkpoint, CheckpointFile
    from registry.catalog.queries import get_or_create_run
    from registry.lifecycle.checkpoints.resume_facts import KeyFacts, save

    cat = Catalog(f"sqlite:///{home / 'catalog.db'}")
    now = time.time()
    with cat.session(write=True) as s:
        for r in range(n // 100):
            facts = KeyFacts(key_paths(r), (), "dcp")
            _, run_row = get_or_create_run(s, "default", f"run{r:03d}")
            for k in range(100):
                ck = Checkpoint(
                    run_id=run_row.id,
                    step=k * 100,
                    state="committed",
                    world_size=8,
                    bytes=3 * 10**9,
                    file_count=3,
                    resumable=True,
                    created_at=now,
                    committed_at=now,
                    pushed_by="bench",
                )
                s.add(ck)
                s.flush()
                for f in (".metadata", "__0_0.distcp", "__1_0.distcp"):
                    s.add(CheckpointFile(checkpoint_id=ck.id, path=f, size=10**9, sha256="ab" * 32))
                save(s, ck.id or 0, facts)
    cat.dispose()


def bench_startup(work: Path, repeat: int) -> list[str]:
    home = work / "startup-home"
    rm(home)
    home.mkdir(parents=True)
    populate(home, 10_000)
    e = env(home)
    floor = median_of(repeat, lambda _: run([PY, "-c", "import sqlmodel, typer"], e))
    ls = median_of(repeat, lambda _: run([*REG, "ls", "--json"], e))
    out = subprocess.run([*REG, "ls", "--json"], env=e, capture_output=True, text=True, cwd=ROOT)
    listed = json.loads(out.stdout)
    assert len(listed) == 10_000 and all(c["layout"] == "dcp" for c in listed)
    bare = median_of(repeat, lambda _: run([PY, "-c", "pass"], e))
    help_t = median_of(repeat, lambda _: run([*REG, "--help"], e))
    lines = [
        report("reg ls --json, 10,000 checkpoints", ls, floor, "import sqlmodel,typer"),
        f"{'reg --help':<44} {help_t:.3f}s (python -c pass: {bare:.3f}s; target < 0.3s)",
    ]
    print(lines[-1])
    rm(home)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, default=1.2)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--warm", action="store_true", help="also push a cached source")
    parser.add_argument("--ranks", type=int, default=2, help="ranks (one shard file each)")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="reg-bench-", dir=ROOT / "bench"))
    src = make_checkpoint(work / "src", args.gib, args.ranks)
    bench_push_pull(work, src, args.repeat)
    if args.warm:
        bench_warm_push(work, src, args.repeat)
    bench_startup(work, max(5, args.repeat))
    if args.work is None:
        rm(work)


if __name__ == "__main__":
    main()
