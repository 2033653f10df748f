"""`torchrun --standalone --nproc-per-node N -m MODULE ARGS` for the tests, with torch imported
once instead of once per rank.

    python -m tests.forkrun --nproc 2 -m examples.train_tiny --out ckpts --steps 6

torchrun starts a fresh interpreter per rank, and each pays 2-3 CPU seconds (more with
DeepSpeed or transformers) importing what the job's first line needs before gloo connects; the
suite runs dozens of such jobs on CI's two cores. Here the launcher (forked from this worker's
warm zygote, tests/zygote.py, with torch, DCP and the registry already imported) imports the
job's module once, then forks one process per rank. Each rank is a process of its own, with
its own gloo connection to the launcher's TCPStore (hosted as torchrun's agent hosts it), pid,
signals and exit code, in the environment torchrun gives its workers (RANK, LOCAL_RANK,
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
import functools
import importlib
import os
import select
import signal
import sys
import threading
import time
import uuid
from datetime import timedelta

from tests.zygote import exit_with, run_as_main

GRACE_S = 2.0  # how long the other ranks may take to end on their own after one failed
PORT_WAIT_S = 60.0  # how long a rank waits for the launcher's store to be up


def _rank(module: str, args: list[str], rank: int, port_in: int) -> None:
    """In a forked rank: learn the store's port, become the module."""
    ready, _, _ = select.select([port_in], [], [], PORT_WAIT_S)
    port = os.read(port_in, 16).decode().strip() if ready else ""
    if not port.isdigit():
        raise RuntimeError(f"forkrun: no store port from the launcher in {PORT_WAIT_S:.0f} s")
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", ROLE_RANK=str(rank), MASTER_PORT=port
    )
    run_as_main(module, args)


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
        TORCHELASTIC_USE_AGENT_STORE="True",  # the ranks are clients of the launcher's store
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
    ports: list[int] = []
    for rank in range(nproc):
        port_in, port_out = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(port_out)
            exit_with(functools.partial(_rank, module, args, rank, port_in))
        os.close(port_in)
        pids[pid] = rank
        ports.append(port_out)
    try:
        # The store, as torchrun's agent hosts it: bound to a port of its own choosing (a port
        # picked free and handed on could be taken meanwhile, or by another job's rank 0), and
        # started after the forks (its server thread is not copied into a rank).
        from torch.distributed import TCPStore

        timeout = timedelta(seconds=300)
        store = TCPStore("127.0.0.1", 0, nproc, True, timeout, wait_for_workers=False)
        for out in ports:
            os.write(out, f"{store.port}\n".encode())
            os.close(out)
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
