"""The engine python's SGLang still says what its pinned facts say (flags, request fields, phase messages, routes).

In the main suite the engine python is this environment's (SGLang 0.5.23): a new SGLang installed without new facts
fails here. ``make test-sglang-<version>`` runs it with $SGLANG_GATEWAY_ENGINE_PYTHON naming an older version's
environment, so that version's file in launch/sglang_facts/ is checked against its installed sources.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from launch.argv import build_env
from launch.config import EngineConfig
from launch.sglang_versions import FACTS_DIR, facts, installed_sglang

REPO = Path(__file__).resolve().parents[2]
PROBE = EngineConfig(model_path="org/m", device="cpu")  # its python: $SGLANG_GATEWAY_ENGINE_PYTHON, else this one


def test_the_engine_pythons_sglang_matches_its_pinned_facts() -> None:
    python = PROBE.python_executable
    version = installed_sglang(python)
    assert version, f"{python} has no SGLang installed"
    made = subprocess.run(
        [python, str(REPO / "scripts" / "sglang_facts.py")], capture_output=True, text=True, timeout=600,
        check=False, env=build_env(PROBE).variables,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr[-2000:]
    assert json.loads(made.stdout) == facts(version), (
        f"SGLang {version}'s installed sources differ from {FACTS_DIR}/{version}.json: "
        f"run {python} scripts/sglang_facts.py > {FACTS_DIR}/{version}.json and review launch/sglang_versions.py"
    )
