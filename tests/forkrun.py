"""`torchrun --standalone --nproc-per-node N -m MODULE ARGS` for the tests, with torch imported
once instead of once per rank.

    python -m tests.forkrun --nproc 2 -m examples.train_tiny --out ckpts --steps 6

torchrun starts a fresh interpreter per rank, and each pays 2-3 CPU seconds (more with
DeepSpeed or transformers) importing what the job's first line needs before gloo connects; the
suite runs dozens of such jobs on CI's two cores. Here the launcher (forked from this worker's
warm zygote, tests/zygote.py, with torch, DCP and the registry already imported) imports the
job's module once, then forks one process per rank. Each rank is a process of its own with its
own gloo connection, TCPStore (rank 0 hosts it, as torchrun's ranks do without an agent store),
pid, signals and exit code, in the environment torchrun gives its workers (RANK, LOCAL_RANK,
WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, ROLE_*, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_*), and
runs the module as `__main__`. What differs is only that no rank imports again.

As torchrun does: ranks share the launcher's stdout and stderr; when one rank fails the others
are given a moment to end on their own (a job whose ranks SIGKILL themselves after a barrier
ends together) and then terminated; the exit code is 0 when every rank exited 0, else 1 with a
per-rank table (`exitcode : N`, as torchrun prints it, negative for a signal) on stderr.

The session's shared checkpoints (`ckpts` in tests/conftest.py) are still written by real
torchrun; `REG_TEST_TORCHRUN=1` sends every job there.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import runpy
import signal
import socket
import sys
import threading
import time
import traceback
import uuid

GRACE_S = 2.0  # how long the other ranks may take to end on their own after one failed


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank(module: str, args: list[str], rank: int) -> None:
    """In a forked rank: become the module, never return."""
    code = 1
    try:
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", ROLE_RANK=str(rank))
        sys.argv = [module, *args]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _wait(pids: dict[int, int]) -> dict[int, int]:
    """Every rank's exit code (as subprocess reports it); after the first failure the rest
    have GRACE_S to end, then SIGTERM, then SIGKILL."""
    codes: dict[int, int] = {}
    failed_at: float | None = None
    termed = False
    while len(codes) < len(pids):
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            if failed_at is not None:
                waited = time.monotonic() - failed_at
                if waited > GRACE_S and not termed:
                    _signal_left(pids, codes, signal.SIGTERM)
                    termed = True
                elif waited > GRACE_S + 30:
                    _signal_left(pids, codes, signal.SIGKILL)
            time.sleep(0.02)
            continue
        if pid not in pids:
            continue
        codes[pids[pid]] = os.waitstatus_to_exitcode(status)
        if codes[pids[pid]] != 0 and failed_at is None:
            failed_at = time.monotonic()
    return codes


def _signal_left(pids: dict[int, int], codes: dict[int, int], sig: int) -> None:
    for pid, rank in pids.items():
        if rank not in codes:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 4 or argv[0] != "--nproc" or not argv[1].isdigit() or argv[2] != "-m":
        sys.stderr.write("usage: python -m tests.forkrun --nproc N -m MODULE [ARGS...]\n")
        return 2
    nproc, module, args = int(argv[1]), argv[3], argv[4:]
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
        WORLD_SIZE=str(nproc),
        LOCAL_WORLD_SIZE=str(nproc),
        GROUP_WORLD_SIZE="1",
        ROLE_NAME="default",
        ROLE_WORLD_SIZE=str(nproc),
        TORCHELASTIC_RESTART_COUNT="0",
        TORCHELASTIC_MAX_RESTARTS="0",
        TORCHELASTIC_RUN_ID=uuid.uuid4().hex,
    )
    # The module's imports, once: its body runs again in each rank as __main__, where what it
    # imports is already loaded. A module that starts a thread at import is not forked from.
    before = threading.active_count()
    importlib.import_module(module)
    if threading.active_count() != before:
        sys.stderr.write(f"forkrun: {module} starts threads at import; not forking from it\n")
        return 2
    sys.stdout.flush()
    sys.stderr.flush()
    pids: dict[int, int] = {}
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            _rank(module, args, rank)
        pids[pid] = rank
    try:
        codes = _wait(pids)
    except BaseException:
        _signal_left(pids, {}, signal.SIGKILL)
        raise
    if all(code == 0 for code in codes.values()):
        return 0
    sys.stderr.write(f"forkrun: {module} failed on {nproc} ranks\n")
    for rank in sorted(codes):
        sys.stderr.write(f"  rank {rank}\n    exitcode  : {codes[rank]}\n")
    return 1


if __name__ == "__main__":
    sys.exit(main())
