"""The relay-read benchmark runs this checkout and a baseline checkout in subprocesses and prints both and their
ratio; each measurement checks that every event went through the relay. No timing is asserted."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from benchmarks import relay_read


def test_this_checkout_against_a_baseline_prints_both_and_the_ratio(capsys: pytest.CaptureFixture[str]) -> None:
    assert relay_read.main(["--reads", "500", "--rounds", "1", "--baseline", str(relay_read.REPO)]) == 0
    out = capsys.readouterr().out
    for name in ("this", "baseline"):
        assert re.search(rf"^{name} +ns per one-event read: median +\d+", out, re.MULTILINE), out
    assert re.search(r"^baseline / this: \d+\.\d{3}$", out, re.MULTILINE), out


def test_a_checkout_without_a_gateway_of_its_own_is_refused(tmp_path: Path) -> None:
    """Not measured silently as another: the installed (editable) gateway would otherwise be found instead."""
    with pytest.raises(SystemExit, match=f"{tmp_path}") as refused:
        relay_read.main(["--reads", "10", "--rounds", "1", "--baseline", str(tmp_path)])
    assert "has no gateway of its own" in str(refused.value) or "failed" in str(refused.value)
