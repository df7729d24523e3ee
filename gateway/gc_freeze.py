"""The gateway's heap once it serves: what start-up built is frozen out of the cyclic collector's passes.

Every pass over the oldest generation walks every tracked object, and most of them are what start-up imported
and built (FastAPI, pydantic, SQLAlchemy, OpenTelemetry, the route table...: ~116k objects). With 1,000
streams open and new requests arriving, those passes came every second or so and took 70-115 ms each, a pause
of every stream; the collector took ~1.8 µs of CPU per relayed event (benchmarks/README.md). Frozen
(:func:`gc.freeze`), start-up's objects are never walked again; what requests allocate is collected as
before, in passes that walk only it.

Freezing is done once: an object frozen here that later becomes garbage is still freed when its last reference
goes; only one caught in a reference cycle stays (the collector never looks at it). What a reload replaces was
built after start-up, so it is not frozen: the cost is bounded by start-up's own heap and does not grow.
"""

from __future__ import annotations

import gc

# Young objects allocated (net of those freed) before a pass over the youngest generation. Python's default,
# 700, runs one every few requests; each request allocates a few hundred tracked objects that live as long as it.
YOUNG_THRESHOLD = 7000


def settle() -> None:
    """Collect what start-up left behind, freeze the rest, and run the youngest pass less often."""
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, middle, old)
