"""Test helpers: training real checkpoints, PostgreSQL availability, file tampering."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PG_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


@dataclass(frozen=True)
class Trained:
    out: Path
    world_size: int
    steps: list[int]

    def step_dir(self, step: int) -> Path:
        return self.out / f"step-{step}"

    def probe_loss(self, step: int) -> float:
        return float(json.loads((self.out / f"step-{step}.json").read_text())["probe_loss"])

    def probe_metrics(self, step: int) -> dict[str, float]:
        """The probe loss as a push metric; none for a diverged (non-finite) checkpoint, whose
        metric push refuses."""
        import math

        loss = self.probe_loss(step)
        return {"probe_loss": loss} if math.isfinite(loss) else {}

    def full_weights(self, step: int) -> dict:  # type: ignore[type-arg]
        import torch

        return torch.load(self.out / f"step-{step}.full.pt", weights_only=True)

    def copy_step(self, step: int, dest: Path) -> Path:
        shutil.copytree(self.step_dir(step), dest)
        return dest


@dataclass(frozen=True)
class Ckpts:
    ws2: Trained
    ws3: Trained


def train(
    out: Path,
    *,
    nproc: int,
    steps: int,
    every: int,
    extra: tuple[str, ...] = (),
    env_extra: dict[str, str] | None = None,
) -> Trained:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "examples.train_tiny",
        "--out",
        str(out),
        "--steps",
        str(steps),
        "--every",
        str(every),
        "--full-weights",
        *extra,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), **(env_extra or {}))
    # gloo on a 2-core machine now and then aborts a rank during start-up (SIGABRT before the
    # first step); the run is retried from scratch, and a persistent failure fails the tests.
    for _attempt in range(3):
        shutil.rmtree(out, ignore_errors=True)
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        if proc.returncode == 0:
            break
        sys.stderr.write(f"torchrun attempt failed ({proc.returncode}):\n{proc.stderr[-2000:]}\n")
    else:
        raise RuntimeError(f"torchrun failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    saved = sorted({s for s in range(1, steps + 1) if s % every == 0 or s == steps})
    return Trained(out, nproc, saved)


def pg_available() -> bool:
    try:
        with socket.create_connection(("127.0.0.1", 5432), timeout=1):
            return True
    except OSError:
        return False


def flip_byte(path: Path, offset: int | None = None) -> None:
    """Flip one byte in place (chmod'ing read-only files writable first)."""
    os.chmod(path, 0o644)
    data = bytearray(path.read_bytes())
    i = len(data) // 2 if offset is None else offset
    data[i] ^= 0xFF
    path.write_bytes(bytes(data))
