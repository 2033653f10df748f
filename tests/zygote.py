"""A warm `reg` for the tests: a process that has imported the CLI and the registry once and
forks a child per command.

A `reg` command pays 1-3 s of start-up before it does anything (the interpreter, SQLAlchemy,
pydantic, typer, torch, FastAPI), and the suite runs about a thousand of them. Each pytest
worker starts one zygote (`python -m tests.zygote`) on its first command, in the worker's
environment less every REG_*, AWS_* and MLFLOW_* setting, which imports what a command imports
and then waits; it stops, with what it started, when the session ends. For every
command it forks a child that takes the test's environment (the whole of it: `os.environ` is
replaced), working directory, standard streams (files the test reads back) and arguments, and
runs `cli.main.main()`, which ends the process with the command's exit code. The child is a
separate process as a subprocess is, with its own stdout, stderr, exit code and signals; what
it does not do again is import. No thread runs in the zygote when it forks (checked at start).

What must still run in a fresh interpreter (start-up itself: `python -X importtime`, an
environment read before `main()` runs) uses `subprocess` directly.

A request may name a module instead: the child runs it as `python -m module argv...` would
(tests/forkrun.py, the tests' torchrun, is one).

Protocol: the worker writes one JSON request per line to the zygote's stdin (`spawn`: argv,
env, cwd, stdin/stdout/stderr paths, new_session, module) and reads JSON lines back:
`{"ready": pid}` once, `{"id", "pid"}` per spawn, `{"exit": pid, "code"}` when a child ends
(the code as `subprocess` gives it: negative for a signal). On EOF the zygote terminates
what it started.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

ROOT = Path(__file__).resolve().parent.parent
_SETTINGS = ("REG_", "AWS_", "MLFLOW_")

# What a command imports (lazily, in the CLI): imported here once, before the first fork.
WARM = (
    "cli.main",
    "registry",
    "registry.api.contract",
    "registry.catalog.engine",
    "registry.catalog.models",
    "registry.storage.local",
    "registry.storage.s3",
    "registry.formats.dcp",
    "registry.lifecycle.checkpoints",
    "registry.lifecycle.promotion.run",
    "registry.lifecycle.validation",
    "registry.server.run",
    "registry.api.remote",
    "alembic.command",
    "sqlmodel",
    "psycopg",
    "boto3",
    "httpx",
    "fastapi",
    "uvicorn",
    "safetensors.torch",
    "torch",
    "torch.distributed.checkpoint",
)


# -- the zygote ---------------------------------------------------------------------------------
def _warm() -> None:
    import importlib

    for name in WARM:  # every one a dependency of reg: a missing one is an error here
        importlib.import_module(name)
    # And every module of the project (what a command imports lazily: a child would pay it,
    # 0.1-0.4 s, on every command): 3 s once. Not the migrations (alembic runs them as scripts).
    import pkgutil

    import cli
    import registry

    for package in (registry, cli):
        for found in pkgutil.walk_packages(package.__path__, f"{package.__name__}."):
            if ".migrations" not in found.name and not found.name.endswith("__main__"):
                importlib.import_module(found.name)
    from registry.storage.s3_client import new_client

    new_client()  # botocore's S3 model parsed once: a child's client is made in milliseconds
    threads = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    if threads:  # a fork would copy a lock some thread holds
        raise SystemExit(f"tests.zygote: threads running after the imports: {threads}")


def _as_started(env: dict[str, str]) -> None:
    """What a fresh interpreter takes from its environment at start-up and the zygote took
    from its own: torch's thread count (OMP_NUM_THREADS, read when torch loads) and the
    warning filters (PYTHONWARNINGS)."""
    import warnings

    import torch

    threads = env.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))
    for spec in filter(None, env.get("PYTHONWARNINGS", "").split(",")):
        action = spec.split(":", 1)[0].strip()
        if action in ("ignore", "error", "always", "default", "module", "once"):
            warnings.simplefilter(action)  # type: ignore[arg-type]


def exit_with(run: Callable[[], object]) -> NoReturn:
    """In a forked child: `run()`, then end the process as `python` would (SystemExit's code,
    0 for none; 1 and the traceback after any other exception), its streams flushed. Never
    returns: a forked child must not fall back into its parent's code."""
    code = 1
    try:
        run()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def run_as_main(module: str, argv: list[str]) -> None:
    """`python -m module argv...`, in this process."""
    import runpy

    sys.argv = [module, *argv]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def _child(req: dict[str, Any], channel: tuple[int, ...]) -> NoReturn:
    """In the forked child: become the command, run it, never return."""
    exit_with(lambda: _become(req, channel))


def _become(req: dict[str, Any], channel: tuple[int, ...]) -> None:
    signal.set_wakeup_fd(-1)
    for fd in channel:
        os.close(fd)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if req.get("new_session"):
        os.setsid()
    for fd, path, flags in (
        (0, req.get("stdin") or os.devnull, os.O_RDONLY),
        (1, req["stdout"], os.O_WRONLY | os.O_CREAT | os.O_APPEND),
        (2, req["stderr"], os.O_WRONLY | os.O_CREAT | os.O_APPEND),
    ):
        opened = os.open(path, flags, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    tempfile.tempdir = None  # TMPDIR is the test's now
    _as_started(req["env"])
    if req.get("module"):
        run_as_main(req["module"], req["argv"])
        return
    sys.argv = ["reg", *req["argv"]]
    from cli.main import main

    main()  # exits the process itself (os._exit) with the command's code


def serve() -> None:
    # The requests and answers get fds of their own; 0 and 1 become /dev/null and stderr, so a
    # stray print here cannot corrupt the channel.
    inbox, outbox = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)
    _warm()
    out = os.fdopen(outbox, "w", buffering=1)

    def send(msg: dict[str, Any]) -> None:
        out.write(json.dumps(msg) + "\n")

    # A child's end wakes the loop: SIGCHLD writes a byte to `wake_r` (set_wakeup_fd).
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    channel = (inbox, outbox, wake_r, wake_w)
    children: set[int] = set()
    send({"ready": os.getpid()})
    pending = b""
    while True:
        try:
            ready, _, _ = select.select([inbox, wake_r], [], [], 5)
        except InterruptedError:
            continue
        if wake_r in ready:
            with contextlib.suppress(BlockingIOError):
                os.read(wake_r, 4096)
        while children:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
            if pid == 0:
                break
            children.discard(pid)
            cpu = usage.ru_utime + usage.ru_stime  # the test that ran it is charged (conftest)
            send({"exit": pid, "code": os.waitstatus_to_exitcode(status), "cpu": cpu})
        if inbox not in ready:
            continue
        data = os.read(inbox, 1 << 16)
        if not data:  # the worker is gone: so is everything it started
            for pid in children:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
            return
        pending += data
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            req = json.loads(line)
            pid = os.fork()
            if pid == 0:
                _child(req, channel)
            children.add(pid)
            send({"id": req["id"], "pid": pid})


# -- the worker's side --------------------------------------------------------------------------
class Child:
    """A command the zygote forked: the part of `subprocess.Popen` the tests use."""

    def __init__(self, zygote: Zygote, pid: int, args: list[str]) -> None:
        self._zygote = zygote
        self.pid = pid
        self.args = args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._zygote.exit_code(self.pid, 0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self._zygote.exit_code(self.pid, timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    def __init__(self) -> None:
        started = time.monotonic()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tests.zygote"],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            # Imported under no registry settings: what a module reads at import must not be
            # a test's (each child gets its own environment whole).
            env={
                **{k: v for k, v in os.environ.items() if not k.startswith(_SETTINGS)},
                "PYTHONPATH": str(ROOT),
            },
        )
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._in, self._out = self._proc.stdin, self._proc.stdout
        first = self._out.readline()
        if not first:
            raise RuntimeError(f"tests.zygote did not start ({self._proc.wait()})")
        self.startup_s = time.monotonic() - started
        self._lock = threading.Lock()
        self._changed = threading.Condition()
        self._spawned: dict[int, int] = {}
        self._exits: dict[int, int] = {}
        self.children_cpu = 0.0  # CPU seconds of the children that ended, for the CPU report
        self._next = 0
        self._reader = threading.Thread(target=self._read, name="zygote-reader", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self._out:
            msg = json.loads(line)
            with self._changed:
                if "exit" in msg:
                    self._exits[msg["exit"]] = msg["code"]
                    self.children_cpu += msg.get("cpu", 0.0)
                else:
                    # The zygote reports a child's end before it can fork another with the
                    # same pid: an end recorded for this pid belongs to an earlier child.
                    self._exits.pop(msg["pid"], None)
                    self._spawned[msg["id"]] = msg["pid"]
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    def alive(self) -> bool:
        return self._proc.poll() is None

    def spawn(
        self,
        argv: list[str],
        *,
        env: dict[str, str],
        cwd: Path,
        stdout: Path,
        stderr: Path,
        stdin: Path | None = None,
        new_session: bool = False,
        module: str | None = None,
    ) -> Child:
        """Fork `reg argv...` (or `python -m module argv...`) in the test's environment."""
        with self._lock:
            self._next += 1
            rid = self._next
            req = {
                "id": rid,
                "argv": argv,
                "env": env,
                "cwd": str(cwd),
                "stdin": str(stdin) if stdin else None,
                "stdout": str(stdout),
                "stderr": str(stderr),
                "new_session": new_session,
                "module": module,
            }
            self._in.write((json.dumps(req) + "\n").encode())
            self._in.flush()
        with self._changed:
            if not self._changed.wait_for(lambda: rid in self._spawned or not self.alive(), 30):
                raise RuntimeError("tests.zygote did not answer a spawn in 30 s")
            if rid not in self._spawned:
                raise RuntimeError("tests.zygote ended")
            pid = self._spawned.pop(rid)
        return Child(self, pid, [module or "reg", *argv])

    def exit_code(self, pid: int, timeout: float | None) -> int | None:
        """The child's exit code once it ended (taken: a later child may reuse the pid)."""
        with self._changed:
            self._changed.wait_for(lambda: pid in self._exits or not self.alive(), timeout)
            if pid not in self._exits and not self.alive():
                raise RuntimeError("tests.zygote ended while its child ran")
            return self._exits.pop(pid, None)

    def run(
        self, argv: list[str], *, env: dict[str, str], cwd: Path, timeout: float
    ) -> subprocess.CompletedProcess[str]:
        """`subprocess.run(["reg", *argv], capture_output=True, text=True, timeout=...)`."""
        cmd = Running(argv, env, cwd=cwd, via=self)
        try:
            code = cmd.wait(timeout)
        except subprocess.TimeoutExpired:
            cmd.child.kill()
            cmd.child.wait(30)
            raise subprocess.TimeoutExpired(cmd.child.args, timeout, cmd.out(), cmd.err()) from None
        try:
            return subprocess.CompletedProcess(cmd.child.args, code, cmd.out(), cmd.err())
        finally:
            cmd.close()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._in.close()
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()


def _text(data: bytes) -> str:
    """As `subprocess.run(text=True)` decodes (universal newlines)."""
    return data.decode().replace("\r\n", "\n").replace("\r", "\n")


_ZYGOTE: Zygote | None = None


def zygote() -> Zygote:
    """This worker's zygote, started on first use (and again if it died)."""
    global _ZYGOTE, _CLOSED_CPU
    if _ZYGOTE is None or not _ZYGOTE.alive():
        from tests.sharing import timed

        if _ZYGOTE is not None:  # died: what its children cost still counts
            _CLOSED_CPU += _ZYGOTE.children_cpu

        with timed("reg zygote (per worker)"):
            _ZYGOTE = Zygote()
    return _ZYGOTE


def run_reg(
    *args: str, env: dict[str, str] | None = None, fault: str | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """`subprocess.run([python, "-m", "cli", *args], capture_output=True, text=True)`, forked
    from this worker's zygote; `env` and `fault` as for `Running`."""
    return zygote().run(list(args), env=_command_env(env, fault), cwd=ROOT, timeout=timeout)


def _command_env(env: dict[str, str] | None, fault: str | None) -> dict[str, str]:
    full = dict(os.environ if env is None else env)
    if fault:
        full["REG_FAULT"] = fault  # registry/core/faults.py: the command dies at that point
    return full


class Running:
    """A `reg` command started from the zygote, as `subprocess.Popen(..., stdout=PIPE,
    stderr=PIPE, text=True)` is used where the output is read once it ended: `wait`, `poll`,
    signals, then `out()` and `err()`. `env`: the whole environment (default: the test's);
    `fault`: a crash point (REG_FAULT) armed in it."""

    def __init__(
        self,
        args: Sequence[str],
        env: dict[str, str] | None = None,
        *,
        fault: str | None = None,
        cwd: Path = ROOT,
        via: Zygote | None = None,
    ) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="reg-cmd-")
        self._out, self._err = Path(self._dir.name, "stdout"), Path(self._dir.name, "stderr")
        self.child = (via or zygote()).spawn(
            list(args), env=_command_env(env, fault), cwd=cwd, stdout=self._out, stderr=self._err
        )

    def wait(self, timeout: float | None = None) -> int:
        return self.child.wait(timeout)

    def poll(self) -> int | None:
        return self.child.poll()

    def send_signal(self, sig: int) -> None:
        self.child.send_signal(sig)

    def out(self) -> str:
        return _text(self._out.read_bytes())

    def err(self) -> str:
        return _text(self._err.read_bytes())

    def close(self) -> None:
        self._dir.cleanup()


def children_cpu() -> float:
    """CPU seconds of every child this worker's zygotes ran that has ended (a closed zygote's
    included)."""
    return _CLOSED_CPU + (_ZYGOTE.children_cpu if _ZYGOTE is not None else 0.0)


_CLOSED_CPU = 0.0


def close() -> None:
    global _ZYGOTE, _CLOSED_CPU
    if _ZYGOTE is not None:
        _ZYGOTE.close()
        _CLOSED_CPU += _ZYGOTE.children_cpu
        _ZYGOTE = None


if __name__ == "__main__":
    serve()
