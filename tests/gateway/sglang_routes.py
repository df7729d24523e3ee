"""Run in a subprocess by test_api_surface.py: print every (method, path) SGLang's HTTP server registers.

Kept out of the test process so SGLang's heavy imports stay out of it.
"""

import json

from sglang.srt.entrypoints.http_server import app


def walk(routes, prefix=""):
    for route in routes:
        included = getattr(route, "include_context", None)
        if included is not None:  # a router included into the app (FastAPI keeps it whole)
            yield from walk(route.original_router.routes, prefix + included.prefix)
        elif hasattr(route, "path"):
            for method in sorted(getattr(route, "methods", None) or ["GET"]):
                yield [method, prefix + route.path]


print("ROUTES " + json.dumps(list(walk(app.routes))))
