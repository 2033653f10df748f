"""Durations as policies and settings write them: "30s", "15m", "24h", "7d", "2w" or "never".
Light on purpose (no pydantic): every command's settings parse some."""

from __future__ import annotations

import math
import re

NEVER = math.inf

_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*(s|m|h|d|w)")
_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(value: str | int | float) -> float:
    """Seconds (>= 0, finite); `math.inf` for "never" only."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        seconds = float(value)
        if not math.isfinite(seconds) or seconds < 0:
            raise ValueError(
                f"expected a duration >= 0 ('7d', '24h', '0s') or 'never', got {value!r}"
            )
        return seconds
    text = str(value).strip().lower()
    if text == "never":
        return NEVER
    match = _DURATION.fullmatch(text)
    if not match:
        raise ValueError(f"expected a duration like '7d', '24h', '0s' or 'never', got {value!r}")
    return float(match.group(1)) * _DURATION_UNITS[match.group(2)]
