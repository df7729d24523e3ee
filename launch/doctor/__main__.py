"""``python -m launch.doctor [CONFIG] [--model NAME] [--json FILE] [--no-engine]``: the doctor without the gateway's
dependencies (``sglang-gateway doctor`` is the same, plus ``--model-uri``). Exit code 1 when a check is an error."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from launch.config import ConfigError, load_config
from launch.doctor import diagnose
from launch.doctor.report import render, write_json


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.doctor", description="Will this deployment work on this host?")
    parser.add_argument("config", nargs="?", type=Path, help="deployment YAML (none: the host checks alone)")
    parser.add_argument("--model", action="append", help="only this model's engine (repeatable)")
    parser.add_argument("--json", type=Path, help="also write the whole report as JSON to this file")
    parser.add_argument("--no-engine", action="store_true", help="do not start engines: host checks only")
    args = parser.parse_args(argv)
    try:
        deployment = load_config(args.config) if args.config else None
        if deployment is not None and args.model:
            unknown = [name for name in args.model if name not in deployment.managed()]
            if unknown:
                raise ConfigError(f"{args.config}: --model {unknown[0]}: no engine of that name (engines: {', '.join(deployment.managed())})")
    except ConfigError as error:
        print(f"doctor: {error}", file=sys.stderr)
        return 2
    report = diagnose(deployment, models=args.model, engine=not args.no_engine)
    render(report, sys.stdout)
    if args.json:
        write_json(report, args.json)
    return 1 if report["verdict"] == "error" else 0


if __name__ == "__main__":
    sys.exit(main())
