"""The README's notebook example of LoRA adapters, run as written: log a model with an adapter directory (packed
with it), load it, predict with the adapter and without, stream with it.

On the FAKE engine (tests/fake_engine.py, through the engine section's ``python:``): it answers an adapter's
requests with the adapter's name as its words, so the output shows which model answered. The same path on the
real engine (the packed adapter loaded by SGLang, its answer differing from the base model's):
tests/model_code/test_managed_engine.py.
"""

from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path

from model_code import stop_all
from tests.docs.readme_blocks import README, marked_blocks
from tests.fake_engine import fake_engine_python
from tests.leaks import leaves_nothing
from tests.lora import make_adapter
from tests.model_code.helpers import engine_children


def test_readme_adapters_notebook(mlflow_store: Path, tiny_model_dir: Path, tmp_path: Path) -> None:
    cwd = os.getcwd()
    (block,) = marked_blocks("adapters-mlflow")
    assert block.page == README
    (tmp_path / "fake").mkdir()
    python = fake_engine_python(tmp_path / "fake")
    code = block.code.replace('".cache/tiny-model"', repr(str(tiny_model_dir)))
    code = code.replace('"device": "cpu"}', f'"device": "cpu", "python": {str(python)!r}}}')
    assert code.count(str(python)) == 1 and str(tiny_model_dir) in code
    make_adapter(tiny_model_dir, tmp_path / "adapters" / "support", seed=1)  # the block's relative path, from its cwd
    os.chdir(tmp_path)  # the block's relative adapter path
    printed, before = io.StringIO(), set(engine_children())
    with leaves_nothing(shm=False) as check:
        try:
            with contextlib.redirect_stdout(printed):
                exec(compile(code, "README.md (adapters-mlflow)", "exec"), {})  # noqa: S102 (the README's own code)
            for pid in set(engine_children()) - before:
                check.watch(pid)
        finally:
            os.chdir(cwd)
            stop_all()  # the engine the loaded model started
    tuned, base, streamed = printed.getvalue().splitlines()[:3]
    assert "'content': '" + "support " * 16 in tuned, tuned  # the adapter answered
    assert "support" not in base and "'content': '" + "tok " * 16 in base, base  # the base model answered
    assert streamed == "support " * 16, streamed
