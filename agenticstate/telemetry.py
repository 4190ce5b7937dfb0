"""OpenTelemetry spans and metrics for every StateManager and manager operation.

Install the extra (`pip install 'agenticstate[otel]'`, which brings `opentelemetry-api` only) and
configure a tracer or meter provider as usual (the SDK, or your vendor's distribution). A
`StateManager` created after that records spans and metrics by itself; `instrument()` does it
explicitly, with providers of your own if you like. Without the extra or a provider, nothing is
installed and operations cost what they always did. See docs/observability.md.
"""

from __future__ import annotations

from agenticstate._otel import SCOPE, instrument, is_instrumented, uninstrument

__all__ = ["SCOPE", "instrument", "is_instrumented", "uninstrument"]
