"""Test helpers: training real checkpoints, PostgreSQL availability, file tampering."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

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
    real: bool = False,
) -> Trained:
    args = ["--out", str(out), "--steps", str(steps), "--every", str(every), "--full-weights"]
    torchrun(
        "examples.train_tiny", nproc, [*args, *extra], clean=out, env_extra=env_extra, real=real
    )
    saved = sorted({s for s in range(1, steps + 1) if s % every == 0 or s == steps})
    return Trained(out, nproc, saved)


def torchrun(
    module: str,
    nproc: int,
    args: list[str],
    *,
    clean: Path | None = None,
    keep: Path | None = None,
    env_extra: dict[str, str] | None = None,
    attempts: int = 3,
    timeout: float = 150,
    killed: bool = False,
    real: bool = False,
) -> subprocess.CompletedProcess[str]:
    """Run `python -m <module>` on nproc gloo processes, retried from scratch: forked from this
    worker's warm zygote by tests/forkrun.py (torch imported once, not once per rank), or under
    real `torchrun` when `real` or REG_TEST_TORCHRUN=1.

    gloo on a 2-core machine now and then aborts a rank during start-up, or (seen in CI) hangs
    a collective forever: each attempt has its own time limit (150 s: the longest job here
    takes about 30 s on a loaded machine), after which the whole process
    group (the launcher and its ranks) is killed, and the next attempt starts on a clean `clean`
    directory. `keep`: a directory (say REG_HOME, with a SQLite catalog) every attempt starts
    from as it was before the first, so a job that committed its work and then aborted in
    gloo's teardown is retried from the same state, not resumed from its own checkpoints.
    A persistent failure raises with the last attempt's stderr. `killed`: the job
    is meant to SIGKILL itself; that, and only that, ends it (every rank killed, none failed
    otherwise)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), **(env_extra or {}))
    real = real or os.environ.get("REG_TEST_TORCHRUN") == "1"
    launch = _torchrun if real else _forkrun
    why = ""
    kept = None
    if keep is not None:
        kept = Path(tempfile.mkdtemp(prefix="torchrun-keep-")) / "copy"
        if keep.exists():
            shutil.copytree(keep, kept, symlinks=True)
    try:
        for attempt in range(1, attempts + 1):
            if clean is not None:
                shutil.rmtree(clean, ignore_errors=True)
            if keep is not None and kept is not None and attempt > 1:
                shutil.rmtree(keep, ignore_errors=True)
                if kept.exists():
                    shutil.copytree(kept, keep, symlinks=True)
            done, why = _judge(*launch(module, nproc, args, env, timeout), attempt, killed, nproc)
            if done is not None:
                return done
            sys.stderr.write(f"{module}: {why}\n")
    finally:
        if kept is not None:
            shutil.rmtree(kept.parent, ignore_errors=True)
    raise RuntimeError(f"{module} on {nproc} ranks: {why}")


# One launch: (its command, exit code or None when it hung and was killed, stdout, stderr).
Launched = tuple[list[str], int | None, str, str]


def _forkrun(
    module: str, nproc: int, args: list[str], env: dict[str, str], timeout: float
) -> Launched:
    from tests.zygote import zygote

    argv = ["--nproc", str(nproc), "-m", module, *args]
    with tempfile.TemporaryDirectory(prefix="forkrun-") as tmp:
        out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
        child = zygote().spawn(
            argv, env=env, cwd=ROOT, stdout=out, stderr=err, new_session=True,
            module="tests.forkrun",
        )  # fmt: skip
        try:
            code: int | None = child.wait(timeout)
        except subprocess.TimeoutExpired:
            _kill_tree(child.pid)
            child.wait(30)
            code = None
        return child.args, code, out.read_text(errors="replace"), err.read_text(errors="replace")


def _torchrun(
    module: str, nproc: int, args: list[str], env: dict[str, str], timeout: float
) -> Launched:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", "-m", module, *args]  # fmt: skip
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # torchrun starts its workers in sessions of their own: kill them by ancestry, or
        # one would keep the output pipes open and the read below would wait forever.
        _kill_tree(proc.pid)
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = "", "(its output could not be read)"
        return cmd, None, out, err
    return cmd, proc.returncode, out, err


def _kill_tree(pid: int) -> None:
    """SIGKILL `pid`, everything below it and its process group."""
    for victim in [*_descendants(pid), pid]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def _judge(
    cmd: list[str], code: int | None, out: str, err: str, attempt: int, killed: bool, nproc: int
) -> tuple[subprocess.CompletedProcess[str] | None, str]:
    """The launch's result when it ended as meant, or None and why not."""
    if code is None:
        return None, f"attempt {attempt} hung and was killed:\n{err[-2000:]}"
    if killed and code != 0 and _all_killed(err, nproc):
        return subprocess.CompletedProcess(cmd, code, out, err), ""
    if code == 0 and not killed:
        return subprocess.CompletedProcess(cmd, 0, out, err), ""
    return None, f"attempt {attempt} failed ({code}):\n{err[-3000:]}"


def _descendants(root: int) -> list[int]:
    """Every process below `root` (from /proc), children before their parents' siblings."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _all_killed(stderr: str, nproc: int) -> bool:
    """The launcher's failure report (torchrun's, or forkrun's in its shape) lists every rank,
    each with exit code -9 (SIGKILL)."""
    codes = re.findall(r"exitcode\s+:\s*(-?\d+)", stderr)  # the per-rank table
    return len(codes) == nproc and set(codes) == {"-9"}


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


def split_as_nodes(ckpts: Ckpts, tmp_path: Path) -> tuple[Path, Path]:
    """The session's ws=2 step-2 checkpoint as two nodes without a shared disk hold it: node A
    wrote rank 0's shard and (as the coordinator) .metadata; node B rank 1's."""
    src = ckpts.ws2.step_dir(2)
    a, b = tmp_path / "node-a", tmp_path / "node-b"
    a.mkdir()
    b.mkdir()
    for name in (".metadata", "__0_0.distcp"):
        shutil.copy(src / name, a / name)
    shutil.copy(src / "__1_0.distcp", b / "__1_0.distcp")
    return a, b


def saved(value: object) -> bytes:
    """`value` as torch.save writes it to a file: the bytes of a sidecar or a chunk."""
    import io

    import torch

    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def _gpus() -> int:
    import torch

    return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0


# Skips decided at collection, before any fixture trains a checkpoint for a test that cannot run.
needs_cuda = pytest.mark.skipif(
    _gpus() < 1,
    reason="needs a CUDA device (CI has none; scripts/gpu-check runs these on a GPU machine)",
)
needs_two_gpus = pytest.mark.skipif(
    _gpus() < 2, reason="NCCL needs one GPU per rank: this machine has fewer than 2"
)


@dataclass
class Ui:
    """A running `reg ui`: its URL, its process, and the MLflow server's process group."""

    url: str
    proc: subprocess.Popen[str]
    group: int

    def leftovers(self, wait_s: float = 10.0) -> str:
        """What still runs of the MLflow server's group (its uvicorn and huey workers), after
        up to `wait_s` for the dying to go (zombies not yet reaped do not count)."""
        deadline = time.monotonic() + wait_s
        while True:
            out = subprocess.run(
                ["ps", "-o", "pid=,stat=,args=", "-g", str(self.group)],
                capture_output=True,
                text=True,
            ).stdout
            alive = [line for line in out.splitlines() if line.split()[1:2] != ["Z"]]
            if not alive or time.monotonic() > deadline:
                return "\n".join(alive)
            time.sleep(0.2)

    def kill(self) -> None:
        for group in (self.group, self.proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)


def start_ui(*args: str) -> Ui:
    """`reg ui` on a free port, up (its /health answers); its output goes to a log file (a pipe
    nobody reads would fill and stall the server)."""
    import tempfile

    port = _free_port()
    log = Path(tempfile.mkdtemp(prefix="reg-ui-")) / "ui.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "cli", "ui", "--port", str(port), *args],
            cwd=Path(__file__).resolve().parent.parent,
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
                if resp.status == 200:
                    break
        except OSError:
            pass
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, f"reg ui not up in 120 s: {log.read_text()[-3000:]}"
        time.sleep(0.5)
    found = subprocess.run(
        ["pgrep", "-f", f"mlflow server .*--port {port}"], capture_output=True, text=True
    ).stdout.split()
    assert found, "the MLflow server process was not found"
    return Ui(url, proc, os.getpgid(int(found[0])))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stock_verify(folder: Path, public_key: Path) -> subprocess.CompletedProcess[str]:
    """OpenSSF model-signing's own CLI on a release folder: no reg code involved."""
    tool = str(Path(sys.executable).with_name("model_signing"))
    signature, key = str(folder / "model.sig"), str(public_key)
    return subprocess.run(
        [tool, "verify", "key", str(folder), "--signature", signature, "--public_key", key],
        capture_output=True,
        text=True,
        timeout=120,
    )


def lose_catalog(home: Path) -> None:
    """The embedded SQLite catalog under `home` gone, WAL files included (the store stays):
    what `reg catalog rebuild` recovers from."""
    for name in ("catalog.db", "catalog.db-wal", "catalog.db-shm"):
        (home / name).unlink(missing_ok=True)


def docs_text() -> str:
    """Every page of the documentation site (docs/**/*.md), whitespace collapsed: what tests
    that hold the docs to the code's behaviour search, wherever a page puts the passage."""
    pages = sorted((ROOT / "docs").rglob("*.md"))
    return " ".join(" ".join(page.read_text().split()) for page in pages)
