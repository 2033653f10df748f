"""Prometheus metrics of `reg server`: requests, latencies, bytes, outcomes (`/metrics`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)

if TYPE_CHECKING:
    from fastapi import Request

REGISTRY = CollectorRegistry()
REQUESTS = Counter(
    "reg_requests_total",
    "Requests by route and status",
    ["method", "route", "status"],
    registry=REGISTRY,
)
OUTCOMES = Counter(
    "reg_request_outcomes_total",
    "Requests by route and outcome (ok or the error type)",
    ["route", "outcome"],
    registry=REGISTRY,
)
LATENCY = Histogram(
    "reg_request_seconds",
    "Request latency by route",
    ["method", "route"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
    registry=REGISTRY,
)
BYTES_IN = Counter("reg_bytes_received_total", "Checkpoint bytes received", registry=REGISTRY)
BYTES_OUT = Counter("reg_bytes_sent_total", "Object bytes sent", registry=REGISTRY)


def observe(method: str, route: str, status: int, seconds: float, request: Request) -> None:
    REQUESTS.labels(method, route, str(status)).inc()
    OUTCOMES.labels(route, getattr(request.state, "outcome", "ok")).inc()
    LATENCY.labels(method, route).observe(seconds)


def render() -> tuple[bytes, str]:
    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST
