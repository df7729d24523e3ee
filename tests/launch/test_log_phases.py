"""The launcher's start-up phases read every supported SGLang version's own log messages.

Each version's messages are pinned, as written in its source, in launch/sglang_facts/<version>.json
(``log_templates``; the installed version's file is checked against its sources by test_sglang_versions.py). Here
each template is rendered with the values its fields take on a plain (non-speculative) engine, and every phase of
``launch.process.PHASES`` must be reached by that version's messages, in the order the engine logs them.
"""

from __future__ import annotations

import re

import pytest

from launch.process import PHASES
from launch.sglang_versions import VERSIONS, facts

# What an f-string field of a pinned message prints on a plain engine (a field not listed prints "0": a number).
FIELD_VALUES = {
    "capture_name": "target decode",  # 0.5.23: f"{role} decode" / f"{role} prefill" of the target model
    "graph_backend[model_runner.device]": "CUDA graph",  # 0.5.23, on cuda
    "graph_backend[self.device]": "cuda graph",  # 0.5.10.post1, on cuda
    "cache_name": "KV Cache",  # 0.5.23: the pool's label, none on a plain engine
    "'VA upper bound' if self.post_capture_active else 'is allocated'": "is allocated",
}
_FIELD = re.compile(r"\{([^{}]*(?:\{[^{}]*\}[^{}]*)*)\}")

# The phases a plain engine with CUDA graphs logs, in order (the rest, HTTP server and warm-up, are uvicorn's).
SGLANG_PHASES = ["loading weights", "weights loaded", "allocating KV cache", "capturing CUDA graphs",
                 "CUDA graphs captured", "ready"]


def render(template: str) -> str:
    return _FIELD.sub(lambda field: FIELD_VALUES.get(field.group(1), "0"), template)


def phase_of(line: str) -> str | None:
    """The phase the launcher reads from ``line`` (first match wins, as in EngineProcess)."""
    return next((phase for phase, pattern in PHASES if pattern.search(line)), None)


def test_rendering_fills_fields_and_leaves_text() -> None:
    assert render("Capture {capture_name} {graph_backend[model_runner.device]} begin. mem={f(a, {b})} GB") == (
        "Capture target decode CUDA graph begin. mem=0 GB"
    )


@pytest.mark.parametrize("version", sorted(VERSIONS))
def test_every_phase_is_reached_by_the_versions_own_messages(version: str) -> None:
    templates = facts(version)["log_templates"]
    assert templates, f"{version}: no log_templates pinned (scripts/sglang_facts.py)"
    reached = {phase_of(render(template)) for template in templates}
    missing = [phase for phase in SGLANG_PHASES if phase not in reached]
    assert not missing, f"SGLang {version} logs nothing launch/process.py reads as {missing}: {templates}"


@pytest.mark.parametrize("version", sorted(VERSIONS))
def test_capture_messages_are_read_as_capture_phases(version: str) -> None:
    """Every graph-capture begin/end message of the version (the main model's and a draft model's) moves the
    phase, and none is read as another phase."""
    for template in facts(version)["log_templates"]:
        line = render(template)
        if re.match(r"Capture .*(cuda|CUDA) graph (begin|end)\.", line):
            expected = "capturing CUDA graphs" if " begin." in line else "CUDA graphs captured"
            assert phase_of(line) == expected, (version, line)
