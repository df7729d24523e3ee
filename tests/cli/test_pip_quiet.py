"""The environment scripts' pip calls (``pip_quiet`` in scripts/lib.sh) show a newcomer pip's errors and warnings,
less setuptools' notice that ``[tool.setuptools.ext-modules]`` is experimental, which its build hooks repeat once
each (three blocks on the first ``make serve``). Built for real: a one-file C extension declared the way this
project's pyproject.toml declares its native relay, by the shared environment's pip and setuptools."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
NOTICE = "`[tool.setuptools.ext-modules]` in `pyproject.toml` is still *experimental*"
PYPROJECT = """\
[build-system]
requires = ["setuptools>=77"]
build-backend = "setuptools.build_meta"

[project]
name = "demo-ext"
version = "0.1"

[tool.setuptools]
packages = ["demo"]

[[tool.setuptools.ext-modules]]
name = "demo._c"
sources = ["demo/_c.c"]
optional = true
"""
C_SOURCE = '#include <Python.h>\nstatic struct PyModuleDef m = {PyModuleDef_HEAD_INIT, "_c"};\nPyMODINIT_FUNC PyInit__c(void) { return PyModule_Create(&m); }\n'


def _project(root: Path) -> Path:
    (root / "demo").mkdir(parents=True)
    (root / "demo" / "__init__.py").write_text("")
    (root / "demo" / "_c.c").write_text(C_SOURCE)
    (root / "pyproject.toml").write_text(PYPROJECT)
    return root


def _wheel(project: Path, out: Path, quiet: bool, warnings: str = "") -> subprocess.CompletedProcess[str]:
    pip = f"{sys.executable} -m pip --disable-pip-version-check wheel -q --no-deps --no-build-isolation {project} -w {out}"
    script = f"source {REPO}/scripts/lib.sh; {'pip_quiet ' if quiet else ''}{pip}"
    env = {"PATH": "/usr/bin:/bin", "HOME": str(Path.home()), **({"PYTHONWARNINGS": warnings} if warnings else {})}
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=300, env=env, check=False)


def test_pip_quiet_hides_the_experimental_ext_modules_notice(tmp_path: Path) -> None:
    project = _project(tmp_path / "project")
    plain = _wheel(project, tmp_path / "plain", quiet=False)
    assert plain.returncode == 0, plain.stderr
    assert NOTICE in plain.stdout + plain.stderr  # what a first build prints without the filter
    quiet = _wheel(project, tmp_path / "quiet", quiet=True, warnings="default")  # a caller's own filter stays before it
    assert quiet.returncode == 0, quiet.stdout + quiet.stderr
    assert NOTICE not in quiet.stdout + quiet.stderr
    assert list((tmp_path / "quiet").glob("demo_ext-0.1-*.whl"))  # the build itself happened


def test_pip_quiet_still_shows_errors(tmp_path: Path) -> None:
    project = _project(tmp_path / "project")
    (project / "pyproject.toml").write_text(PYPROJECT.replace('version = "0.1"', 'version = "not a version"'))
    failed = _wheel(project, tmp_path / "out", quiet=True)
    assert failed.returncode != 0
    assert "not a version" in failed.stdout + failed.stderr
