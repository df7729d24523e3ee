"""The MLflow notebook tour of docs/mlflow.md, run as written: log, load (starts an engine), predict,
predict_stream, structured output, batch with a schema, close.

Run in a temporary directory (the tour writes ``mlflow.db`` where it runs); only the two relative
paths in it are made absolute.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.docs.readme_blocks import REPO, marked_blocks


@pytest.mark.usefixtures("starts_engine")
def test_readme_notebook_tour(tiny_model_dir: Path, tmp_path: Path) -> None:
    (block,) = marked_blocks("mlflow")
    code = block.code.replace('"configs/tiny-cpu.yaml"', repr(str(REPO / "configs" / "tiny-cpu.yaml")))
    code = code.replace('".cache/tiny-model"', repr(str(tiny_model_dir)))
    assert code != block.code
    # the tour sets its own tracking store: no MLFLOW_* of an earlier test (experiment id...) may leak in
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env["SGLANG_GATEWAY_TINY_MODEL"] = str(tiny_model_dir)
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=900, cwd=tmp_path, env=env, check=False
    )
    assert result.returncode == 0, result.stderr[-4000:]
    out = result.stdout
    assert "'role': 'assistant'" in out  # predict's answer was printed
    assert re.search(r"""'content': '\{"grade": ?"(yes|no)"\}'""", out), out  # structured output: the schema's JSON
    rows = re.findall(r"^([01]) .*\{'grade': '(?:yes|no)'\}\s*$", out, re.M)  # the batch table: each row parsed
    assert rows == ["0", "1"], out
    assert (tmp_path / "mlflow.db").is_file()
    # quiet by default: the start-up phases and the URL, not the engine's own ~20 kB of log
    assert "ready at http://" in result.stderr and "server_args=" not in result.stderr
