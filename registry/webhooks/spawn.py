"""Start the embedded deliverer after a command, detached (`python -m registry.webhooks`): the
command that caused the events never waits for a receiver (as `registry.mirror.spawn`)."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from registry.config import Settings

BUDGET_S = 60  # then the next command, or `reg webhook deliver`, retries what waits


def spawn_deliverer(settings: Settings) -> None:
    try:
        settings.home.mkdir(parents=True, exist_ok=True)
        with open(settings.home / "webhooks.log", "ab") as out:
            subprocess.Popen(
                [sys.executable, "-m", "registry.webhooks", "--budget", str(BUDGET_S)],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                start_new_session=True,
                close_fds=True,
                env={**os.environ, "REG_HOME": str(settings.home)},
            )
    except OSError:
        pass  # the deliveries wait for the next command, or `reg webhook deliver`
