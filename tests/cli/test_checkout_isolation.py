"""Two checkouts on one machine share the cached dependencies but never each other's code.

scripts/bootstrap.sh gives every checkout a ``.venv`` of its own, layered on the shared environment cached under
the dependency hash, with the checkout installed there: two fresh clones of this repository (one with a change
that shows when its code runs) each run their own code, and deleting one leaves the other working.

The clones reuse the shared environment that `make env` built for this checkout (same dependency lists, same
cache): seconds, never a new multi-GB build. Where it is missing the test fails, saying so, rather than build one.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent.parent
MARKER = "this is checkout B's code"
# Another checkout's PYTHONPATH or activated environment must not decide what the clones import.
ENV = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}


def run(*argv: str | Path, cwd: Path | str = "/", timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """A command run as a user runs it: from / (from a checkout, `import gateway` finds the checkout itself)."""
    return subprocess.run(
        [str(a) for a in argv], capture_output=True, text=True, timeout=timeout, cwd=cwd, env=ENV, check=False
    )


def bootstrap(checkout: Path, *args: str) -> subprocess.CompletedProcess[str]:
    result = run(checkout / "scripts" / "bootstrap.sh", *args, timeout=300)
    assert result.returncode == 0, f"scripts/bootstrap.sh {' '.join(args)} in {checkout} failed:\n{result.stderr}"
    return result


def gateway_file(checkout: Path) -> str:
    result = run(checkout / ".venv" / "bin" / "python", "-c", "import gateway; print(gateway.__file__)")
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def cli_help(checkout: Path) -> subprocess.CompletedProcess[str]:
    result = run(checkout / ".venv" / "bin" / "sglang-gateway", "--help")
    assert result.returncode == 0, f"{checkout}/.venv/bin/sglang-gateway --help failed:\n{result.stderr}"
    assert "Usage: sglang-gateway" in result.stdout
    return result


@pytest.fixture(scope="module")
def shared_environment() -> Path:
    """The shared environment this checkout's dependency lists name, which must exist already."""
    where = Path(bootstrap(REPO, "--where").stdout.strip())
    if not (where / ".complete").exists():
        pytest.fail(
            f"no shared environment at {where}: run `make env` first (this test reuses it and must not build one)"
        )
    return where


def test_two_clones_run_their_own_code_and_deleting_one_breaks_none(shared_environment: Path, tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    for clone in (a, b):
        result = subprocess.run(
            ["git", "clone", "-q", str(REPO), str(clone)], capture_output=True, text=True, timeout=120
        )
        assert result.returncode == 0, result.stderr
    with (b / "gateway" / "__init__.py").open("a") as init:
        init.write(f"\nimport sys as _sys\n\n_sys.stderr.write({MARKER!r} + '\\n')\n")

    for clone in (a, b):
        started = time.monotonic()
        built = bootstrap(clone)
        assert "building the" not in built.stderr, f"the clone built a new shared environment:\n{built.stderr}"
        assert time.monotonic() - started < 60, f"bootstrap of a clone took {time.monotonic() - started:.0f}s"

    # Each clone's python and command run that clone's code, each from its own .venv.
    assert gateway_file(a) == str(a / "gateway" / "__init__.py")
    assert gateway_file(b) == str(b / "gateway" / "__init__.py")
    assert MARKER not in cli_help(a).stderr
    assert MARKER in cli_help(b).stderr
    # The shared environment holds the dependencies, not the project.
    assert not list(shared_environment.glob("lib/python3*/site-packages/sglang_gateway-*.dist-info"))
    found = run(a / ".venv" / "bin" / "python", "-c", "import importlib.util as u; print(u.find_spec('sglang').origin)")
    assert found.stdout.startswith(str(shared_environment)), found.stdout + found.stderr

    # A second run with nothing changed rebuilds nothing.
    layer = (a / ".venv" / ".layer").stat()
    bootstrap(a)
    assert (a / ".venv" / ".layer").stat().st_mtime_ns == layer.st_mtime_ns

    # Clone B gone, clone A still runs, and runs A's code.
    shutil.rmtree(b)
    assert MARKER not in cli_help(a).stderr
    assert gateway_file(a) == str(a / "gateway" / "__init__.py")
