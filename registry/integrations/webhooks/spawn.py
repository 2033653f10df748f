"""Start the embedded deliverer after a command, detached (`python -m registry.webhooks`): the
command that caused the events never waits for a receiver (as `registry.mirror.spawn`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from registry import detached

if TYPE_CHECKING:
    from registry.config import Settings

BUDGET_S = 60  # then the next command, or `reg webhook deliver`, retries what waits


def spawn_deliverer(settings: Settings) -> None:
    detached.start(settings, "registry.webhooks", "--budget", str(BUDGET_S), log="webhooks.log")
