"""``sglang-gateway doctor``: will this deployment work on this host, and how fast does it start.

:func:`diagnose` reads the host (:mod:`launch.doctor.host`), judges it (:mod:`launch.doctor.checks`), optionally
starts each selected model's engine (:mod:`launch.doctor.engine_probe`) and returns one report: a rich table on a
terminal (:mod:`launch.doctor.report`) and JSON with every figure, the versions and the exact engine commands
(secrets never: an engine's key travels in a private file, not on its command line).

``python -m launch.doctor`` runs it without the gateway's dependencies (a GPU host being checked before anything
else is installed needs only pydantic, PyYAML and loguru besides the standard library).
"""

from __future__ import annotations

import platform
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

from launch.config import DeploymentConfig, EngineConfig
from launch.doctor.checks import Check, host_checks, overall
from launch.doctor.host import read_host

REPORT_VERSION = 1


def diagnose(
    deployment: DeploymentConfig | None = None, *, models: list[str] | None = None, engine: bool = True,
    log_dir: Path | None = None,
) -> dict[str, Any]:  # fmt: skip
    """The whole report as a JSON-ready mapping (see docs/doctor.md for its fields)."""
    engines: dict[str, EngineConfig] = {}
    if deployment is not None:
        managed = deployment.managed()
        engines = {name: managed[name] for name in (models or list(managed))}
    pythons = {e.python_executable for e in engines.values()}
    facts = read_host(next(iter(pythons)) if len(pythons) == 1 else None, tuple(e.model_path for e in engines.values()))
    checks: list[Check] = host_checks(facts, list(engines.values()))
    runs: list[dict[str, Any]] = []
    if engine and engines:
        from launch.doctor.engine_probe import probe_model

        with tempfile.TemporaryDirectory(prefix="sglang-doctor-") as scratch:
            for name, config in engines.items():
                for run in probe_model(name, config, log_dir or Path(scratch)):
                    runs.append(asdict(run))
                    graphs = "CUDA graphs on" if run.cuda_graph else "CUDA graphs off" if config.device == "cuda" else config.device
                    if run.error:
                        checks.append(Check(f"engine {name} ({graphs})", "error", run.error, run.fix))
                    else:
                        checks.append(Check(f"engine {name} ({graphs})", "ok",
                                            f"ready in {run.ready_s:.1f} s; 1 token in {run.one_token_ms:.0f} ms; "
                                            f"{run.long_tokens} tokens at {run.tokens_per_s} tokens/s"))  # fmt: skip
    return {
        "report_version": REPORT_VERSION,
        "verdict": overall(checks),
        "host": facts.as_dict(),
        "checks": [asdict(check) for check in checks],
        "engines": runs,
        "machine": platform.machine(),
    }
