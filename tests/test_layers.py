"""The folders show the architecture, and the imports keep to it: the layering in pyproject's
``[tool.importlinter]`` (composition root > control | data > edge > core > config > console; launch/ never
imports gateway/ or model_code/; engine_guard/ imports neither), checked by import-linter over the real import graph."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    """import-linter over the packages under ``root``, in a process of its own (this one has them imported)."""
    code = "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports(no_cache=True, no_logo=True))"
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=120)


def test_the_imports_keep_to_the_layers() -> None:
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


def test_an_upward_import_breaks_the_contract(tmp_path: Path) -> None:
    """The check can fail: a copy of the packages where core imports the data plane breaks it."""
    for package in ("engine_guard", "gateway", "launch", "model_code"):
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    registry = tmp_path / "gateway" / "core" / "registry.py"
    registry.write_text(registry.read_text() + "\nfrom gateway.data import balancer  # noqa: E402\n")
    result = lint_imports(tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "gateway.core is not allowed to import gateway.data" in result.stdout
