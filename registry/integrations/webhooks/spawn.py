"""Start the embedded deliverer after a command, detached (`python -m
registry.integrations.webhooks`): the command that caused the events never waits for a receiver
(as `mirror.spawn`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from registry.core import detached

if TYPE_CHECKING:
    from registry.core.config import Settings

BUDGET_S = 60  # then the next command, or `reg webhook deliver`, retries what waits


def spawn_deliverer(settings: Settings) -> None:
    detached.start(
        settings, "registry.integrations.webhooks", "--budget", str(BUDGET_S), log="webhooks.log"
    )
