"""Output helpers: JSON for scripts, plain aligned text for people, progress bars on a TTY."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Sequence
from typing import Any

from registry.text import inert


def emit_json(obj: Any) -> None:
    sys.stdout.write(to_json(obj) + "\n")


def to_json(obj: Any) -> str:
    """Strict JSON (RFC 8259): a non-finite float (NaN, inf), which Python's json would write as
    a bare `NaN` no parser but Python's accepts, becomes null. Compact on purpose: with `indent`
    the json module falls back to its pure-Python encoder, 10x slower on a 10,000-checkpoint
    listing. Pipe through `jq` to read it."""
    from registry.api import results  # 30 ms of dataclasses `reg --help` does without

    obj = results.to_json(obj)  # a typed result (registry.api.results) prints as its JSON
    try:
        return json.dumps(obj, default=_default, allow_nan=False)
    except ValueError:
        return json.dumps(_finite(obj), default=_default, allow_nan=False)


def _default(obj: Any) -> Any:
    to_json = getattr(obj, "to_json", None)  # a typed result inside another document
    return to_json() if callable(to_json) else str(obj)


def _finite(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if callable(getattr(obj, "to_json", None)):  # a typed result inside another document
        return _finite(obj.to_json())
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj


def error_json(message: str, hint: str | None, exit_code: int) -> None:
    """The one document a `--json` command prints when it fails (the same fields a server error
    carries), so a script always reads JSON from stdout."""
    emit_json({"error": {"message": message, "hint": hint, "exit_code": exit_code}})


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    cells = [[str(h) for h in headers]] + [["" if c is None else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    for r in cells:
        sys.stdout.write(
            "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() + "\n"
        )


def note(message: str) -> None:
    sys.stderr.write(f"reg: {inert(message)}\n")


class TerminalProgress:
    """A rich progress bar on stderr; only made when stderr is a terminal."""

    def __init__(self) -> None:
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        self._bar = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            transient=True,
        )
        self._task: Any = None

    def start(self, description: str, total: int) -> None:
        self._bar.start()
        self._task = self._bar.add_task(description, total=total)

    def advance(self, n: int) -> None:
        self._bar.advance(self._task, n)

    def finish(self) -> None:
        self._bar.stop()


def progress_for(json_output: bool) -> Any:
    if json_output or not sys.stderr.isatty():
        return None
    return TerminalProgress()


def plural(n: int, noun: str) -> str:
    """`1 file`, `3 files`."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
