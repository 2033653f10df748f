"""Start the MLflow drain after a command, detached: importing mlflow alone takes seconds, and
the command that caused the events must not wait for it (DESIGN §2)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from registry.core import detached

if TYPE_CHECKING:
    from registry.core.config import Settings

DRAIN_BUDGET_S = 30


def spawn_drain(settings: Settings) -> None:
    """Unless the mirror is off; not started, the events wait for `reg mlflow sync` or the
    next command."""
    if settings.mlflow_drain:
        detached.start(
            settings,
            "registry.integrations.mirror.drain",
            "--budget",
            str(DRAIN_BUDGET_S),
            log="mlflow-drain.log",
        )
