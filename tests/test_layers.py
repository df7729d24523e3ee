"""The folders show the architecture, and the imports keep to it: the layering in pyproject's
``[tool.importlinter]`` (composition root > control | data > edge > core > config > console; launch/ never
imports gateway/ or model_code/; engine_guard/ imports neither), checked by import-linter over the real import graph;
and the map in gateway/__init__.py names every module under its folder."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GATEWAY_MAP = ast.get_docstring(ast.parse((ROOT / "gateway" / "__init__.py").read_text())) or ""


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


def map_sections(doc: str) -> dict[str, str]:
    """The map in a package docstring, by section: a line at the margin that opens with ````folder/```` starts that
    folder's section; one that opens with ``**`` a section of the package's own modules (key ``""``)."""
    sections: dict[str, str] = {}
    current = ""
    for line in doc.splitlines():
        folder = re.match(r"``([\w/]+)/``", line)
        if folder:
            current = folder.group(1)
        elif line.startswith("**"):
            current = ""
        sections[current] = sections.get(current, "") + line + "\n"
    return sections


def unmapped(package: Path, doc: str) -> list[str]:
    """The modules under ``package`` whose name (````name````) is not in the map's section of their folder."""
    sections = map_sections(doc)
    missing = []
    for path in sorted(package.rglob("*.py")):
        if path.name == "__init__.py":
            continue
        folder = path.parent.relative_to(package).as_posix().removeprefix(".")
        if f"``{path.stem}``" not in sections.get(folder, ""):
            missing.append(path.relative_to(package.parent).as_posix())
    return missing


def test_the_gateway_map_names_every_module() -> None:
    """The map in gateway/__init__.py names each module under its folder's section, so none is left off it."""
    assert unmapped(ROOT / "gateway", GATEWAY_MAP) == []


def test_a_module_left_off_the_map_is_named() -> None:
    """The check can fail: the map without ``stream_pool`` names that module (and only it)."""
    doc = GATEWAY_MAP.replace("``stream_pool``", "stream_pool")
    assert unmapped(ROOT / "gateway", doc) == ["gateway/data/stream_pool.py"]
