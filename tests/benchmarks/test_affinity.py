"""``python -m benchmarks affinity`` runs end to end on a tiny workload: a gateway over ``replicas: 2`` of the tiny
CPU engine (two engine starts, in parallel), both balancing policies, cached tokens read from every answer.

No timing is asserted: only that both policies ran every request, that the engines reported cached tokens (the
answers' count and the engines' own counter agree), and that with prefix affinity each repeated system prompt was
served from the cache.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.engine


def test_affinity_benchmark_end_to_end(tmp_path: Path, tiny_model_dir: Path) -> None:
    out = tmp_path / "affinity"
    proc = subprocess.run(
        [
            sys.executable, "-m", "benchmarks", "affinity", "--prompts", "2", "--per-prompt", "3",
            "--system-words", "60", "--output-tokens", "2", "--concurrency", "1", "--rounds", "1", "--out", str(out),
        ],
        cwd=REPO, capture_output=True, text=True, timeout=900, env={**os.environ, "SGLANG_GATEWAY_TINY_MODEL": str(tiny_model_dir)},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "result.json").read_text())
    assert result["kind"] == "affinity" and set(result["policies"]) == {"least_in_flight", "prefix_affinity"}
    for policy, summary in result["policies"].items():
        assert summary["requests"] == 6 and summary["errors"] == 0, (policy, summary)
        assert summary["cache_reported"] and sum(summary["per_replica"].values()) == 6, (policy, summary)
        assert summary["cached_share"] == pytest.approx(summary["engine_cached_share"], abs=0.01), (policy, summary)
    affinity = result["policies"]["prefix_affinity"]
    (cached,) = affinity["cached_tokens_by_request"]  # prompt 0, prompt 1, prompt 0, prompt 1, ...
    system_tokens = affinity["prompt_tokens_per_request"] - 30  # the user message and the chat template: < 30
    assert all(tokens >= system_tokens for tokens in cached[2:]), cached  # repeats found their prefix cached
    assert set(result["ratios"]) >= {"cached_tokens_per_request", "ttft_p50_ms", "latency_p50_ms", "req_s"}
    assert "affinity / none" in proc.stdout
