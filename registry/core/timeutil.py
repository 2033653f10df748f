"""Timestamps are UNIX seconds in the catalog and ISO 8601 UTC in output."""

from __future__ import annotations

import math
import re
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


# -- rates (a scrub's --rate) ------------------------------------------------------------------

_RATE = re.compile(r"(\d+(?:\.\d+)?)\s*([kKMGT]?)(i?)B/s")
MIN_RATE, MAX_RATE = 1.0, 1e13  # 1 B/s .. 10 TB/s


def parse_rate(text: str) -> float:
    """`200MB/s` (decimal units; `MiB/s` binary; bytes, never bits) -> bytes per second."""
    match = _RATE.fullmatch(text.strip())
    hint = "write it like 200MB/s, 1GB/s or 50MiB/s (bytes per second, 1 B/s to 10 TB/s)"
    if match is None:
        raise UsageError(f"--rate {text!r} is not a bandwidth", hint)
    base = 1024 if match.group(3) else 1000
    power = " KMGT".index(match.group(2).upper() or " ")
    return check_rate(float(match.group(1)) * float(base**power), hint)


def check_rate(rate: float, hint: str = "give bytes per second, 1 to 1e13") -> float:
    if not math.isfinite(rate) or not MIN_RATE <= rate <= MAX_RATE:
        raise UsageError(f"a scrub rate of {rate:g} bytes/s is out of range", hint)
    return rate
