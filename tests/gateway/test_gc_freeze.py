"""Once the gateway's server has started, start-up's heap is frozen out of the cyclic collector's passes
(gateway.gc_freeze), and the youngest pass runs less often. Checked in a child process: freezing the test
process's own heap would change how every later test collects."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from gateway import gc_freeze

_CHILD = textwrap.dedent(
    """
    import gc, json, sys
    import uvicorn
    from gateway.server import GatewayServer

    async def app(scope, receive, send):  # never called: the server stops once it has started
        raise AssertionError(scope)

    seen = {}
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off")
    server = GatewayServer(config)

    def started():
        seen.update(frozen=gc.get_freeze_count(), threshold=gc.get_threshold()[0])
        server.should_exit = True

    before = {"frozen": gc.get_freeze_count(), "threshold": gc.get_threshold()[0]}
    server.on_started = started
    server.run()
    print(json.dumps({"before": before, "started": seen}))
    """
)


def test_the_started_server_freezes_start_up_heap() -> None:
    done = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=60, check=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["before"]["frozen"] == 0 and result["before"]["threshold"] == 700  # Python's defaults
    assert result["started"]["frozen"] > 10_000  # the imports of the gateway and uvicorn, at least
    assert result["started"]["threshold"] == gc_freeze.YOUNG_THRESHOLD
