"""The costs benchmark runs end to end on a tiny workload (the gateway and SGLang's router, over the paced fake and the
fast one) and prints every figure with its ratio to the router's. No timing is asserted. (A baseline is one more
gateway target, run by the same code: tests/benchmarks/test_sparse.py runs the sparse part's.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from benchmarks.cli import app

pytest.importorskip("sglang_router")


def test_a_tiny_run_prints_every_figure_as_a_ratio_to_the_router(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "costs", "-s", "2,4", "--tokens", "4", "--step-ms", "20", "--idle-s", "0.2", "--rounds", "1", "-c", "1,2", "-n", "8",
        "--short-rounds", "1", "--sdk-headers", "--agent", "--out", str(tmp_path),
    ]  # fmt: skip
    outcome = CliRunner().invoke(app, argv)
    assert outcome.exit_code == 0, outcome.output
    printed = outcome.output + capsys.readouterr().out
    assert "| figure | gateway | router | gateway / router |" in printed, printed
    for title in (
        "one sparse stream: CPU µs per event", "2 streams: CPU µs per event", "4 streams: CPU µs per event",
        "short request, c=1: CPU ms per request", "short request, c=2: CPU ms per request", "idle: CPU ms per second",
        "one sparse stream: main-loop wake-ups per event", "4 streams: TTFT p50 ms",
    ):  # fmt: skip
        assert f"| {title} |" in printed, title
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["sdk_headers"] is True and result["agent"] is True and result["plain"] is False
    summary = result["summary"]
    for name in ("gateway", "router"):
        assert summary[name]["errors"] == 0 and summary[name]["sparse_us_per_event"] > 0, summary[name]
        assert summary[name]["short_ms@1"] is not None, summary[name]
    assert summary["router"]["sparse_wakeups_per_event"] is None  # no Python loop to count
    assert summary["gateway"]["sparse_wakeups_per_event"] >= 0


def test_short_only_measures_the_plain_requests_alone_and_the_floor_beside_them(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["costs", "--short-only", "--plain", "--floor", "-c", "1", "-n", "8", "--short-rounds", "1", "--out", str(tmp_path)]
    outcome = CliRunner().invoke(app, argv)
    assert outcome.exit_code == 0, outcome.output
    printed = outcome.output + capsys.readouterr().out
    assert "| short request, c=1: CPU ms per request |" in printed and "sparse" not in printed, printed
    assert "| figure | gateway | router | python-floor | gateway / router | python-floor / router |" in printed, printed
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["plain"] is True and result["floor"] is True and result["paced"] == {}
    for name in ("gateway", "router", "python-floor"):  # (8 plain requests can take less than the CPU clock's tick: 0 is a figure)
        assert result["summary"][name]["short_ms@1"] is not None, result["summary"]
        assert result["short"][name]["1"] is not None
