"""`--every INTERVAL`: run a command's work once per interval until SIGTERM or Ctrl-C, one JSON
line per cycle on stdout (for cron-less deployments: a systemd service, a Kubernetes pod)."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from cli.render import to_json


def repeat(interval: str, cycle: Callable[[], dict[str, Any]]) -> None:
    from registry.core.timeutil import iso, now, positive_duration
    from registry.errors import RegistryError

    seconds = positive_duration(interval, "--every")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.is_set():
        started = time.monotonic()
        try:
            line = {"ts": iso(now()), "ok": True, **cycle()}
        except RegistryError as exc:  # this cycle failed; the next one tries again
            line = {"ts": iso(now()), "ok": False, "error": str(exc)}
        print(to_json(line), flush=True)
        stop.wait(max(0.0, seconds - (time.monotonic() - started)))
