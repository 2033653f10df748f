"""Start the MLflow drain after a command, detached: importing mlflow alone takes seconds, and
the command that caused the events must not wait for it (DESIGN §2)."""

from __future__ import annotations

import os
import subprocess
import sys

from registry.config import Settings

DRAIN_BUDGET_S = 30


def spawn_drain(settings: Settings) -> None:
    if not settings.mlflow_drain:
        return
    log = settings.home / "mlflow-drain.log"
    try:
        settings.home.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            subprocess.Popen(
                [sys.executable, "-m", "registry.mirror.drain", "--budget", str(DRAIN_BUDGET_S)],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                start_new_session=True,
                close_fds=True,
                env={**os.environ, "REG_HOME": str(settings.home)},
            )
    except OSError:
        pass  # the events wait; `reg mlflow sync` or the next command drains them
