"""The grammar budget benchmark runs end to end (on the tiny model's tokenizer)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import grammar_budget


def test_the_benchmark_prints_both_sets(tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    grammar_budget.main(["--model", str(tiny_model_dir), "--budget", "30"])  # none refused: no probe restarts
    out = capsys.readouterr().out
    assert "16/16 pass at 30 s" in out and "6/6 pass at 30 s" in out and "engine CPU to compile each to its end" in out, out
