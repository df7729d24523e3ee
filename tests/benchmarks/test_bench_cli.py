"""Smoke test: the bench CLI runs end to end on a tiny workload against the fake upstream and writes JSON.

No timing is asserted (speed is measured by the benchmarks themselves, never by tests): only that the
run completes, counts its requests, sees no errors and leaves a well-formed result behind.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmarks import processes
from benchmarks.loadgen import Workload, new_event_loop, run_batch

REPO = Path(__file__).resolve().parents[2]


def test_load_generator_against_fake_upstream(tmp_path: Path) -> None:
    with processes.fake_upstream("raw", tmp_path) as (url, _):
        loop = new_event_loop()
        try:
            for stream in (True, False):
                batch = loop.run_until_complete(run_batch(url, Workload(stream=stream, output_tokens=5), 3, 9))
                assert len(batch.samples) == 9 and all(s.ok for s in batch.samples), batch.samples
                assert all(s.tokens == 5 for s in batch.samples)
                if stream:
                    assert all(s.ttft is not None and s.ttft <= s.latency for s in batch.samples)
        finally:
            loop.close()


def test_compare_cli_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "result"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks",
            "compare",
            "--upstream",
            "stub",
            "-c",
            "1,2",
            "-n",
            "6",
            "--rounds",
            "2",
            "--warmup",
            "2",
            "--output-tokens",
            "4",
            "--max-seconds",
            "30",
            "--out",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((out / "result.json").read_text())
    assert result["kind"] == "compare" and result["upstream"] == "stub-starlette"
    assert set(result["levels"]) == {"1", "2"}
    for entry in result["levels"].values():
        for target in ("direct", "gateway"):
            assert entry[target]["requests"] == 6 and entry[target]["errors"] == 0, entry[target]
            assert entry[target]["mean_out_tokens"] == 4
        assert entry["vs"]["req_s"]["ratio"] > 0
        assert "gateway" in entry["gateway"]["cpu_ms_per_req"]
    assert {check["target"] for check in result["targets"]} >= {"stub c=1: added p50 latency"}
    assert "gw/direct" in proc.stdout
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (out / "plot.png").stat().st_size > 0
