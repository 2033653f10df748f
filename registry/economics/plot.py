"""`reg advise --plot FILE.svg`: expected waste against the checkpoint interval (Daly's full
model, log interval axis), with the run's current interval and the advised one marked. Plain
SVG written here: no plotting library needed."""

from __future__ import annotations

import math
from html import escape

from registry.economics import model

W, H = 720, 420
LEFT, RIGHT, TOP, BOTTOM = 70, 20, 40, 60


def svg(
    *,
    cost_s: float,
    rto_s: float,
    mtbf_s: float,
    gpus: int,
    advised_s: float,
    current_s: float | None,
    title: str,
) -> str:
    """The plot as an SVG document: waste in GPU-hours per day (and %) vs interval."""
    marks = [advised_s] + ([current_s] if current_s else [])
    x_lo = min(marks) / 8.0
    x_hi = max(marks) * 8.0
    xs = [x_lo * (x_hi / x_lo) ** (i / 200) for i in range(201)]
    ys = [model.waste(x, cost_s, rto_s, mtbf_s) for x in xs]
    y_best = model.waste(advised_s, cost_s, rto_s, mtbf_s)
    y_hi = min(1.0, max(3.0 * y_best, *(model.waste(m, cost_s, rto_s, mtbf_s) for m in marks)))
    y_hi = y_hi * 1.1 or 1.0

    def px(x: float) -> float:
        return LEFT + (math.log(x) - math.log(x_lo)) / (math.log(x_hi) - math.log(x_lo)) * (
            W - LEFT - RIGHT
        )

    def py(y: float) -> float:
        return TOP + (1.0 - min(y, y_hi) / y_hi) * (H - TOP - BOTTOM)

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
        f'viewBox="0 0 {W} {H}" font-family="sans-serif" font-size="12">',
        f'<rect width="{W}" height="{H}" fill="white"/>',
        f'<text x="{W / 2}" y="22" text-anchor="middle" font-size="14">{escape(title)}</text>',
        f'<line x1="{LEFT}" y1="{H - BOTTOM}" x2="{W - RIGHT}" y2="{H - BOTTOM}" stroke="black"/>',
        f'<line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{H - BOTTOM}" stroke="black"/>',
    ]
    for tick in _ticks(x_lo, x_hi):
        x = px(tick)
        out.append(
            f'<line x1="{x:.1f}" y1="{H - BOTTOM}" x2="{x:.1f}" y2="{H - BOTTOM + 5}" '
            'stroke="black"/>'
        )
        out.append(
            f'<text x="{x:.1f}" y="{H - BOTTOM + 18}" text-anchor="middle">{_human(tick)}</text>'
        )
    for i in range(6):
        y = y_hi * i / 5
        out.append(
            f'<text x="{LEFT - 6}" y="{py(y) + 4:.1f}" text-anchor="end">{y * gpus * 24:.3g}</text>'
        )
        out.append(
            f'<text x="{W - RIGHT - 2}" y="{py(y) - 3:.1f}" text-anchor="end" '
            f'fill="#888">{y:.1%}</text>'
        )
        out.append(
            f'<line x1="{LEFT}" y1="{py(y):.1f}" x2="{W - RIGHT}" y2="{py(y):.1f}" stroke="#eee"/>'
        )
    points = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in zip(xs, ys, strict=True))
    out.append(f'<polyline points="{points}" fill="none" stroke="#1f77b4" stroke-width="2"/>')
    for value, colour, label in (
        (advised_s, "#2ca02c", "advised"),
        (current_s, "#d62728", "current"),
    ):
        if not value:
            continue
        x = px(value)
        y = model.waste(value, cost_s, rto_s, mtbf_s)
        out.append(
            f'<line x1="{x:.1f}" y1="{TOP}" x2="{x:.1f}" y2="{H - BOTTOM}" '
            f'stroke="{colour}" stroke-dasharray="5,4"/>'
        )
        out.append(f'<circle cx="{x:.1f}" cy="{py(y):.1f}" r="4" fill="{colour}"/>')
        anchor = "start" if label == "advised" else "end"
        shift = 6 if label == "advised" else -6
        out.append(
            f'<text x="{x + shift:.1f}" y="{TOP + 14}" fill="{colour}" '
            f'text-anchor="{anchor}">{label} {_human(value)}: {y:.2%}</text>'
        )
    out.append(
        f'<text x="{(LEFT + W - RIGHT) / 2}" y="{H - 15}" text-anchor="middle">'
        "checkpoint interval (log scale)</text>"
    )
    out.append(
        f'<text x="16" y="{(TOP + H - BOTTOM) / 2}" text-anchor="middle" '
        f'transform="rotate(-90 16 {(TOP + H - BOTTOM) / 2})">'
        f"expected waste, GPU-hours/day on {gpus} GPU(s)</text>"
    )
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _ticks(lo: float, hi: float) -> list[float]:
    steps = [
        1,
        2,
        5,
        10,
        20,
        30,
        60,
        120,
        300,
        600,
        1200,
        1800,
        3600,
        7200,
        14400,
        28800,
        43200,
        86400,
        172800,
        604800,
    ]
    inside = [float(s) for s in steps if lo <= s <= hi]
    while len(inside) > 8:
        inside = inside[::2]
    return inside or [lo, hi]


def _human(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.3g}s"
    if seconds < 7200:
        return f"{seconds / 60:.3g}min"
    return f"{seconds / 3600:.3g}h"
