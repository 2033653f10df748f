"""Progress reporting for long operations; the library reports, the CLI decides how to show it."""

from __future__ import annotations

import threading
from typing import Protocol


class Progress(Protocol):
    def start(self, description: str, total: int) -> None: ...

    def advance(self, n: int) -> None: ...

    def finish(self) -> None: ...


class NullProgress:
    def start(self, description: str, total: int) -> None:
        pass

    def advance(self, n: int) -> None:
        pass

    def finish(self) -> None:
        pass


class Counter:
    """Thread-safe byte counter in front of a Progress (workers advance it concurrently)."""

    def __init__(self, progress: Progress | None) -> None:
        self._progress = progress or NullProgress()
        self._lock = threading.Lock()
        self.total = 0

    def __call__(self, n: int) -> None:
        with self._lock:
            self.total += n
            self._progress.advance(n)
