"""The Python launcher example of docs/launching.md, run as written (it starts and stops its own engine)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.docs.readme_blocks import REPO, marked_blocks


@pytest.mark.usefixtures("starts_engine")
def test_readme_engine_example(tiny_model_dir: Path) -> None:
    (block,) = marked_blocks("engine")
    env = {**os.environ, "SGLANG_GATEWAY_TINY_MODEL": str(tiny_model_dir)}
    result = subprocess.run(
        [sys.executable, "-c", block.code], capture_output=True, text=True, timeout=600, cwd=REPO, env=env, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+", result.stdout.strip()), result.stdout
