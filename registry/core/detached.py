"""Start a module of reg as a process of its own, detached from the command that asks for it:
the MLflow drain and the webhook deliverer run after a command without adding to its time."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from registry.core.config import Settings


def start(settings: Settings, module: str, *args: str, log: str) -> None:
    """`python -m module args...` in a new session, its output appended to REG_HOME/`log`. A
    failure to start is silent: what it would do waits for the next command (each caller
    says which command catches up)."""
    try:
        settings.home.mkdir(parents=True, exist_ok=True)
        with open(settings.home / log, "ab") as out:
            subprocess.Popen(
                [sys.executable, "-m", module, *args],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                start_new_session=True,
                close_fds=True,
                env={**os.environ, "REG_HOME": str(settings.home)},
            )
    except OSError:
        pass


DRAIN_BUDGET_S = 30
DELIVER_BUDGET_S = 60  # then the next command, or `reg webhook deliver`, retries what waits


def spawn_drain(settings: Settings) -> None:
    """The MLflow drain (`registry.integrations.mirror.drain`): importing mlflow alone takes
    seconds, and the command that caused the events must not wait for it (DESIGN §2). Unless the
    mirror is off; not started, the events wait for `reg mlflow sync` or the next command."""
    if settings.mlflow_drain:
        module = "registry.integrations.mirror.drain"
        start(settings, module, "--budget", str(DRAIN_BUDGET_S), log="mlflow-drain.log")


def spawn_deliverer(settings: Settings) -> None:
    """The embedded webhook deliverer (`python -m registry.integrations.webhooks`): the command
    that caused the events never waits for a receiver."""
    module = "registry.integrations.webhooks"
    start(settings, module, "--budget", str(DELIVER_BUDGET_S), log="webhooks.log")
