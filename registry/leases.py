"""Leases shared by every claim in the catalog (a push's step, a promotion's version, the GC,
the MLflow drain, holds): who holds it, until when, and whether the holder is gone."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Callable

from registry.errors import RegistryError
from registry.timeutil import now


def holder_gone(host: str | None, pid: int | None) -> bool:
    """True when the holder ran on this host and its process no longer exists."""
    if host != socket.gethostname() or not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def is_stale(lease_until: float | None, host: str | None, pid: int | None) -> bool:
    """A lease may be taken over once it ran out or its holder died."""
    return lease_until is None or lease_until < now() or holder_gone(host, pid)


class Heartbeat:
    """Calls `renew` every `interval` seconds on a thread while the block runs. A failed renewal
    is retried on the next beat (every commit checks its claim token anyway)."""

    def __init__(self, renew: Callable[[], None], interval: float) -> None:
        self._renew, self._interval = renew, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="reg-lease", daemon=True)

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            with contextlib.suppress(RegistryError):
                self._renew()
