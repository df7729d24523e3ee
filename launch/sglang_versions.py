"""The SGLang versions the project runs, and what each lacks against the newest: one table, read at launch and
by the gateway.

``launch/argv.py`` spells every flag as SGLang 0.5.23 (the newest supported) does, and the gateway's request
schemas accept 0.5.23's fields. An older supported version (the CUDA 12 profile's) differs in a few flags and
fields; its entry here says how, so that an engine of that version is started with its own spellings, and a
setting or request field it lacks is refused with a message naming the version instead of being ignored by
the engine (SGLang ignores unknown body fields) or failing its argument parser.

The facts each entry rests on (every flag of the version's ``ServerArgs``, every field of its OpenAI request
models) are pinned in ``launch/sglang_facts/<version>.json``, made by ``scripts/sglang_facts.py`` from the installed
package; tests check the entries against them, and the installed version against its own file.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from launch.config import ConfigError

FACTS_DIR = Path(__file__).resolve().parent / "sglang_facts"
NEWEST = "0.5.23"

# The OpenAI request model of SGLang's protocol module that each proxied route's body is parsed into.
REQUEST_MODELS: Mapping[str, str] = {
    "/v1/chat/completions": "ChatCompletionRequest",
    "/v1/completions": "CompletionRequest",
    "/v1/embeddings": "EmbeddingRequest",
    "/v1/responses": "ResponsesRequest",
    "/v1/score": "ScoringRequest",
    "/v1/rerank": "V1RerankReqInput",
    "/v1/tokenize": "TokenizeRequest",
    "/v1/detokenize": "DetokenizeRequest",
}


class UnsupportedSglang(ConfigError):
    """An SGLang version the table has no entry for, or a setting / field the engine's version lacks."""


@dataclass(frozen=True)
class EngineVersion:
    """How one SGLang version differs from :data:`NEWEST`, as data."""

    sglang: str
    # flag (newest spelling) -> why it cannot be passed: a config that sets it is refused
    missing_flags: Mapping[str, str] = field(default_factory=dict)
    # switches whose behaviour this version always has: left out of its command line
    always_on: frozenset[str] = frozenset()
    # the newest's flag -> this version's spelling of the same setting
    renamed_flags: Mapping[str, str] = field(default_factory=dict)
    # the newest's "turn CUDA graphs off" flags -> this version's
    cuda_graph_off: tuple[str, ...] = ()
    # the grammar backend its CPU engine needs (None: any): another one fails at the first constrained request
    cpu_grammar_backend: str | None = None
    # on cpu, flags that backend reads in another form: the newest's flag -> this version's argv parts
    cpu_replaced_flags: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    note: str = ""  # what the version lacks that users of this project notice (docs/gpu.md)

    @property
    def is_newest(self) -> bool:
        return self.sglang == NEWEST

    def translate(self, flag: str, parts: list[str], setting: str, device: str = "cuda") -> list[str]:
        """The argv ``parts`` the newest version would get for ``flag`` (YAML key ``setting``), in this version's
        spelling on ``device``; a flag it lacks raises :class:`UnsupportedSglang` naming the key and the version."""
        if not parts or self.is_newest:
            return parts
        if device == "cpu" and flag in self.cpu_replaced_flags:
            return list(self.cpu_replaced_flags[flag])
        if flag in self.always_on:
            return []
        if flag in self.missing_flags:
            raise UnsupportedSglang(
                f"engine.{setting}: SGLang {self.sglang} has no {flag} ({self.missing_flags[flag]}); "
                f"remove the setting or use SGLang {NEWEST}"
            )
        if flag in self.renamed_flags:
            return [self.renamed_flags[flag], *parts[1:]]
        return parts

    def grammar_backend(self, device: str, configured: str | None) -> str | None:
        """The ``grammar_backend`` an engine of this version on ``device`` is started with: the configured one, or
        the one its CPU engine needs; a configured one that fails there is refused naming the version."""
        if device != "cpu" or self.cpu_grammar_backend is None or configured == self.cpu_grammar_backend:
            return configured
        if configured is None:
            return self.cpu_grammar_backend
        raise UnsupportedSglang(
            f"engine.grammar_backend: SGLang {self.sglang}'s {configured} backend constrains output on GPUs only "
            f"(on cpu its first JSON-schema request stops the engine); use {self.cpu_grammar_backend} or SGLang {NEWEST}"
        )

    @functools.cached_property
    def missing_fields(self) -> Mapping[str, frozenset[str]]:
        """Per proxied route, the request fields the newest version's model has and this version's lacks (from the
        pinned facts of both)."""
        if self.is_newest:
            return {}
        newest, this = facts(NEWEST)["request_fields"], facts(self.sglang)["request_fields"]
        return {
            route: frozenset(newest.get(model, ())) - frozenset(this.get(model, ()))
            for route, model in REQUEST_MODELS.items()
            if model in newest
        }

    @functools.cached_property
    def tokenize_fields(self) -> frozenset[str]:
        """The fields this version's ``/v1/tokenize`` takes (0.5.10: a plain prompt only; 0.5.23: chat messages too)."""
        fields = facts(self.sglang)["request_fields"]
        assert isinstance(fields, dict)
        return frozenset(fields.get(REQUEST_MODELS["/v1/tokenize"], ()))

    def field_problem(self, route: str, body: Mapping[str, object]) -> str | None:
        """A one-line refusal for a body field this version's engine would silently ignore, else None."""
        missing = self.missing_fields.get(route)
        if not missing:
            return None
        for name in body:
            if name in missing:
                return f"{name}: the engine runs SGLang {self.sglang}, which does not support this field on {route}"
        return None


VERSIONS: Mapping[str, EngineVersion] = {
    NEWEST: EngineVersion(NEWEST),
    "0.5.10.post1": EngineVersion(
        "0.5.10.post1",
        missing_flags={
            "--otlp-service-name": "its spans are always named sglang",
            "--cuda-graph-backend-decode": "per-phase CUDA graph backends came later; cuda_graph: false still works",
            "--cuda-graph-backend-prefill": "per-phase CUDA graph backends came later; cuda_graph: false still works",
        },
        always_on=frozenset({"--enable-response-store"}),  # its Responses API always stores responses
        renamed_flags={"--cuda-graph-max-bs-decode": "--cuda-graph-max-bs"},
        cuda_graph_off=("--disable-cuda-graph",),
        cpu_grammar_backend="outlines",  # its xgrammar backend applies token masks on GPUs only; llguidance allows
        # properties a schema does not forbid (the OpenAI shape is strict): outlines generates exactly the listed ones
        # outlines reads no --constrained-json-disable-any-whitespace: an empty whitespace pattern says the same
        cpu_replaced_flags={"--constrained-json-disable-any-whitespace": ("--constrained-json-whitespace-pattern", "")},
        note=(
            "no otlp_service_name, no per-phase CUDA graph backends (cuda_graph: false passes --disable-cuda-graph); "
            "the Responses API always stores responses; chat requests take no input_ids, session_id or "
            "return_*_token_ids extensions; transformers 5.3 (models newer than it need SGLang 0.5.23)"
        ),
    ),
}


def engine_version(sglang: str) -> EngineVersion:
    """The table's entry for an SGLang version; an unknown one is refused, naming the supported versions."""
    try:
        return VERSIONS[sglang]
    except KeyError:
        raise UnsupportedSglang(
            f"SGLang {sglang} is not a supported version (supported: {', '.join(VERSIONS)})"
        ) from None


@functools.cache
def facts(sglang: str) -> dict[str, dict[str, list[str]] | list[str]]:
    """The pinned facts of a version: ``flags`` (every ``launch_server`` flag) and ``request_fields`` (per model)."""
    return json.loads((FACTS_DIR / f"{sglang}.json").read_text())


def same_interpreter(python: str) -> bool:
    """Whether ``python`` is this process's interpreter. Not by the resolved binary: every venv's ``bin/python``
    links to the same base interpreter, and what tells environments apart is the path it is started by."""
    return os.path.abspath(python) == os.path.abspath(sys.executable)


_VERSION_SCRIPT = "from importlib.metadata import version; print(version('sglang'))"


@functools.cache
def installed_sglang(python: str) -> str | None:
    """The SGLang version installed for ``python`` (an engine's interpreter), or None when it has none."""
    if same_interpreter(python):
        try:
            return metadata.version("sglang")
        except metadata.PackageNotFoundError:
            return None
    try:
        probe = subprocess.run([python, "-c", _VERSION_SCRIPT], capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return probe.stdout.strip() or None if probe.returncode == 0 else None
