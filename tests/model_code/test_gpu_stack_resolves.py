"""Every GPU stack profile's full requirement set, as ``log_model`` writes it for a GPU target, resolves on
the package registry for the platform serving containers use: linux x86_64 with the profile's glibc,
CPython at each of the profile's pythons, wheels only. It resolves with one torch build and the CUDA
runtime (``nvidia-cuda-runtime``, ``-cu12`` for CUDA 12) of the profile's CUDA version.

pip runs with the registry as its only index, no configuration file, no cache and ``--ignore-installed``,
so neither this machine's pip settings (a local index, a torch cap) nor the local environment can make a
stale or local answer pass. Direct wheel URLs are not downloaded: the FlashInfer wheel the registry also
publishes is resolved there under the same file name; the FlashInfer JIT cache (no dependencies,
published on FlashInfer's release page only) is checked by its naming in tests/launch/test_gpu_profiles.py.
Needs network to the registry; deselect with ``-m "not network"``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from packaging.utils import parse_wheel_filename

from launch.gpu_profiles import PROFILES, GpuProfile
from model_code.requirements import pip_requirements

pytestmark = pytest.mark.network

REGISTRY = "https://pypi.org/simple"
# Wheels pinned by URL that the registry publishes too, under the same file name (checked after the resolve).
ON_THE_REGISTRY = {"flashinfer-python"}
TARGETS = [(profile, python) for profile in PROFILES for python in profile.pythons]
_CUDA_RUNTIME = re.compile(r"nvidia-cuda-runtime(?:-cu(?P<major>\d+))?")


@dataclass(frozen=True)
class Resolution:
    lines: list[str]  # what pip was given
    returncode: int
    stderr: str
    seconds: float
    report: dict[str, Any] | None

    def installed(self) -> dict[str, list[dict[str, Any]]]:
        by_name: dict[str, list[dict[str, Any]]] = {}
        for item in (self.report or {}).get("install", []):
            by_name.setdefault(item["metadata"]["name"].lower().replace("_", "-"), []).append(item)
        return by_name


def registry_lines(lines: list[str]) -> list[str]:
    """The requirement lines with each direct wheel URL replaced by its registry pin, or left out when the
    registry does not publish that wheel."""
    kept = []
    for line in lines:
        if not line.startswith("https://"):
            kept.append(line)
            continue
        name, version, _, _ = parse_wheel_filename(line.rsplit("/", 1)[1])
        if name in ON_THE_REGISTRY:
            kept.append(f"{name}=={version}")
    return kept


def serving_platforms(profile: GpuProfile) -> list[str]:
    """pip's --platform takes no ranges: every manylinux tag up to the profile's glibc."""
    newest = int(profile.glibc.split(".")[1])
    return [f"manylinux_2_{minor}_x86_64" for minor in range(newest, 16, -1)] + ["manylinux2014_x86_64"]


def resolve(profile: GpuProfile, python: str, workdir: Path) -> Resolution:
    lines = registry_lines(pip_requirements("auto", profile=profile.name, python=python))
    workdir.mkdir(parents=True)
    (workdir / "requirements.txt").write_text("\n".join(lines) + "\n")
    report = workdir / "report.json"
    command = [
        sys.executable, "-m", "pip", "install", "--isolated", "--dry-run", "--ignore-installed", "--no-cache-dir",
        "--disable-pip-version-check", "--quiet", "--report", str(report), "--index-url", REGISTRY,
        "--only-binary=:all:", "--implementation", "cp", "--python-version", python,
        *(f"--platform={platform}" for platform in serving_platforms(profile)),
        "-r", str(workdir / "requirements.txt"),
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")} | {"PIP_CONFIG_FILE": os.devnull}
    start = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env, cwd=workdir, check=False)
    seconds = time.monotonic() - start
    parsed = json.loads(report.read_text()) if done.returncode == 0 and report.is_file() else None
    return Resolution(lines, done.returncode, done.stderr, seconds, parsed)


@pytest.fixture(scope="module")
def resolutions(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Resolution]:
    """All targets resolved at once (the time goes to the network, so they overlap)."""
    root = tmp_path_factory.mktemp("resolve")
    with ThreadPoolExecutor(max_workers=len(TARGETS)) as pool:
        futures = {
            (p.name, python): pool.submit(resolve, p, python, root / f"{p.name}-py{python}") for p, python in TARGETS
        }
        return {target: future.result() for target, future in futures.items()}


def _one(installed: dict[str, list[dict[str, Any]]], name: str) -> dict[str, Any]:
    items = installed.get(name, [])
    assert len(items) == 1, f"{name}: expected exactly one, resolved {[i['metadata']['version'] for i in items]}"
    return items[0]


@pytest.mark.parametrize(("profile", "python"), TARGETS, ids=[f"{p.name}-py{python}" for p, python in TARGETS])
def test_profile_resolves_with_one_torch_and_its_cuda_runtime(resolutions, profile: GpuProfile, python: str) -> None:
    resolution = resolutions[(profile.name, python)]
    assert resolution.returncode == 0, resolution.stderr[-3000:]
    installed = resolution.installed()

    def version(name: str) -> str:
        return _one(installed, name)["metadata"]["version"]

    assert version("sglang") == profile.sglang
    assert version("torch") == profile.torch  # one torch: the registry's build of it, no +cuXYZ variant
    assert version("sglang-kernel") == profile.sglang_kernel
    assert version("flashinfer-python") == profile.flashinfer
    runtimes = {name: items for name, items in installed.items() if _CUDA_RUNTIME.fullmatch(name)}
    # CUDA 13's runtime package has no suffix; CUDA 12's is nvidia-cuda-runtime-cu12
    expected = "nvidia-cuda-runtime" if profile.cuda_version[0] >= 13 else f"nvidia-cuda-runtime-cu{profile.cuda_version[0]}"
    assert list(runtimes) == [expected], f"CUDA runtimes resolved: {sorted(runtimes)}"
    runtime = version(expected)
    assert runtime.startswith(profile.cuda + "."), f"nvidia-cuda-runtime {runtime} is not CUDA {profile.cuda}"

    # The wheel pinned by URL is the very file the registry publishes under that name and version.
    for url in profile.flashinfer_wheels():
        filename = url.rsplit("/", 1)[1]
        name = str(parse_wheel_filename(filename)[0])
        if name in ON_THE_REGISTRY:
            assert _one(installed, name)["download_info"]["url"].rsplit("/", 1)[1] == filename
    # Everything came from the registry over https, nothing from a local index or directory.
    assert all(item["download_info"]["url"].startswith("https://") for items in installed.values() for item in items)

    print(
        f"\n{profile.name} python {python}: {sum(map(len, installed.values()))} packages resolved in "
        f"{resolution.seconds:.0f} s: torch {version('torch')}, nvidia-cuda-runtime {runtime}, "
        f"flashinfer-python {version('flashinfer-python')}, sglang-kernel {version('sglang-kernel')}, "
        f"sglang {version('sglang')}, openai {version('openai')}"
    )
