"""The sparse-stream benchmark runs end to end on a tiny workload (a gateway and its baseline, the same checkout, over
the paced fake) and writes its table and result.json. No timing is asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import sparse


def test_a_tiny_run_prints_the_table_and_writes_its_result(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--tokens", "4", "--step-ms", "20", "--idle-s", "0.2", "--rounds", "1", "--no-router", "--baseline", str(sparse.REPO), "--out", str(tmp_path)]
    assert sparse.main(argv) == 0
    out = capsys.readouterr().out
    assert "| gateway |" in out and "| gateway-baseline |" in out, out
    assert "gateway / gateway-baseline: idle CPU per second" in out, out
    result = json.loads((tmp_path / "result.json").read_text())
    for name in ("gateway", "gateway-baseline"):
        row = result["summary"][name]
        assert row["events"] >= 4 and row["errors"] == 0, row
        assert row["wakeups_per_event"] >= 0 and row["idle_ms_per_s"] >= 0, row
