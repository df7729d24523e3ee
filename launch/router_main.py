"""Run SGLang's router with the workers' API key read from a private file, not from the command line.

``python -m launch.router_main FILE``: FILE (owner-only JSON, removed at once) holds ``argv`` (router flags)
and ``api_key`` (the key of the engines behind it). ``/proc/PID/cmdline`` is readable by every local user,
so the key must not be an argument of this process.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from launch.argv import ROUTER_API_KEY_FLAG


def main(path: str) -> None:
    file = Path(path)
    spec = json.loads(file.read_text())
    file.unlink(missing_ok=True)
    from sglang_router.launch_router import launch_router, parse_router_args

    argv = list(spec["argv"])
    if spec.get("api_key"):
        argv += [ROUTER_API_KEY_FLAG, spec["api_key"]]
    launch_router(parse_router_args(argv))


if __name__ == "__main__":
    main(sys.argv[1])
