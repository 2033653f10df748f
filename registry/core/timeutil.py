"""Timestamps are UNIX seconds in the catalog and ISO 8601 UTC in output."""

from __future__ import annotations

import time
from datetime import UTC, datetime

from policies.durations import parse_duration
from registry.errors import UsageError


def now() -> float:
    return time.time()


def iso(ts: float | None) -> str | None:
    if ts is None:
        return None
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"


def positive_duration(text: str, flag: str, example: str = "1h") -> float:
    """A command-line duration ("90d", "1h", "30s") that must be positive and finite: seconds,
    or a UsageError naming the flag."""
    try:
        seconds = parse_duration(text)
    except ValueError as exc:
        raise UsageError(f"bad {flag}: {exc}", f"e.g. {example}") from None
    if not 0 < seconds < float("inf"):
        raise UsageError(f"{flag} {text} must be a positive, finite duration", f"e.g. {example}")
    return seconds
