"""W3C trace context through message headers, where the OpenTelemetry API
is importable (the ``otel`` extra); without it, nothing happens."""

from __future__ import annotations

from typing import Any, Dict, Optional

try:  # pragma: no cover - depends on the environment
    from opentelemetry import propagate as _propagate

    AVAILABLE = True
except ImportError:  # pragma: no cover
    _propagate = None
    AVAILABLE = False


def inject(headers: Dict[str, str]) -> None:
    """Adds ``traceparent``/``tracestate`` of the current span to
    ``headers`` (a header the caller set is kept)."""
    if _propagate is None:
        return
    carrier: Dict[str, str] = {}
    _propagate.inject(carrier)
    for key, value in carrier.items():
        headers.setdefault(key, value)


def extract(headers: Dict[str, str]) -> Optional[Any]:
    """The OpenTelemetry ``Context`` carried by ``headers``, or None
    without the OpenTelemetry API."""
    if _propagate is None:
        return None
    return _propagate.extract(headers)
