"""The GPU stack profile table: each profile whole and self-consistent, FlashInfer URLs in FlashInfer's
published naming, impossible combinations refused with the list of profiles, and the pins elsewhere
(pyproject's ``sglang`` extra, the CPU bootstrap) on the same SGLang. No network: the registry resolve
of every profile is ``tests/model_code/test_gpu_stack_resolves.py``."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.tags import Tag
from packaging.utils import parse_wheel_filename
from packaging.version import Version

from launch.gpu_profiles import (
    DEFAULT_PROFILE,
    PROFILES,
    GpuProfile,
    UnknownGpuProfile,
    installed_profile,
    runnable_profiles,
    select_profile,
)
from launch.sglang_versions import NEWEST, VERSIONS

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "launch" / "gpu_profiles.py"

# FlashInfer's release workflow uploads flashinfer_python (python -m build: py3-none-any) and one
# flashinfer_jit_cache wheel per CUDA (local version +cuXYZ, tagged cp39-abi3-manylinux_2_28_<arch>)
# to the GitHub release v<version>; its wheel index links https://github.com/flashinfer-ai/flashinfer/
# releases/download/<tag>/<wheel>.
RELEASE = r"https://github\.com/flashinfer-ai/flashinfer/releases/download/v(?P<tag>[0-9][0-9a-z.]*)/"
PUBLISHED_NAMING = {
    "flashinfer-python": re.compile(RELEASE + r"flashinfer_python-(?P<version>[0-9][0-9a-z.]*)-py3-none-any\.whl"),
    "flashinfer-jit-cache": re.compile(
        RELEASE
        + r"flashinfer_jit_cache-(?P<version>[0-9][0-9a-z.]*)\+(?P<cuda>cu\d+)-cp39-abi3-manylinux_2_28_x86_64\.whl"
    ),
}


def serving_tags(profile: GpuProfile, python: str) -> set[Tag]:
    """Wheel tags a linux x86_64 CPython ``python`` with the profile's glibc accepts (what a serving container sees)."""
    major, minor = (int(n) for n in python.split("."))
    glibc_minor = int(profile.glibc.split(".")[1])
    platforms = [f"manylinux_2_{m}_x86_64" for m in range(17, glibc_minor + 1)]
    interpreters = [f"cp{major}{minor}"] + [f"cp{major}{m}" for m in range(2, minor)]
    tags = {Tag(f"cp{major}{minor}", f"cp{major}{minor}", p) for p in platforms}
    tags |= {Tag(i, "abi3", p) for i in interpreters for p in platforms}
    return tags | {Tag("py3", "none", "any")}


@pytest.mark.parametrize("profile", PROFILES, ids=lambda p: p.name)
def test_flashinfer_wheel_urls_follow_the_published_naming(profile: GpuProfile) -> None:
    urls = profile.flashinfer_wheels()
    assert len(urls) == len(PUBLISHED_NAMING)
    for url, (project, pattern) in zip(urls, PUBLISHED_NAMING.items(), strict=True):
        match = pattern.fullmatch(url)
        assert match, f"{url} does not follow FlashInfer's release naming for {project}"
        assert match["tag"] == match["version"] == profile.flashinfer
        if "cuda" in pattern.groupindex:
            assert match["cuda"] == profile.cuda_tag
        name, version, _, tags = parse_wheel_filename(url.rsplit("/", 1)[1])
        assert name == project and version.public == profile.flashinfer
        for python in profile.pythons:
            assert tags & serving_tags(profile, python), f"{url}: no tag installs on python {python}"


@pytest.mark.parametrize("profile", PROFILES, ids=lambda p: p.name)
def test_profiles_are_whole(profile: GpuProfile) -> None:
    assert profile.name == f"sglang-{profile.sglang}-{profile.cuda_tag}"
    for version in (profile.sglang, profile.torch, profile.flashinfer, profile.sglang_kernel):
        assert str(Version(version)) == version and not Version(version).local  # exact public versions
    assert re.fullmatch(r"\d+\.\d+", profile.cuda) and re.fullmatch(r"\d{3}\.\d+(\.\d+)?", profile.min_driver)
    assert profile.pythons and all(re.fullmatch(r"3\.\d+", p) for p in profile.pythons)
    pins = [Requirement(line) for line in profile.pins()]
    assert {r.name: str(r.specifier) for r in pins} == {
        "torch": f"=={profile.torch}",
        "sglang-kernel": f"=={profile.sglang_kernel}",
        "sglang": f"=={profile.sglang}",
    }
    assert profile.requirements() == [*profile.pins(), *profile.flashinfer_wheels()]
    assert len({p.name for p in PROFILES}) == len(PROFILES)


def test_every_profile_s_sglang_is_in_the_version_table() -> None:
    """launch/argv.py spells flags as the newest SGLang does; an older profile's SGLang needs its entry in
    launch/sglang_versions.py (its flags and fields checked against its pinned facts by test_sglang_versions.py)."""
    assert {p.sglang for p in PROFILES} <= set(VERSIONS)
    assert DEFAULT_PROFILE.sglang == NEWEST == metadata.version("sglang")


def test_selecting_a_profile() -> None:
    assert select_profile() == DEFAULT_PROFILE
    assert select_profile(DEFAULT_PROFILE.name, cuda=DEFAULT_PROFILE.cuda, python=DEFAULT_PROFILE.pythons[0]) == (
        DEFAULT_PROFILE
    )
    assert select_profile(cuda=DEFAULT_PROFILE.cuda) == DEFAULT_PROFILE
    assert installed_profile(DEFAULT_PROFILE.sglang, DEFAULT_PROFILE.torch) == DEFAULT_PROFILE
    assert installed_profile(DEFAULT_PROFILE.sglang, f"{DEFAULT_PROFILE.torch}+cu128") is None
    assert runnable_profiles((11, 8)) == [] and runnable_profiles((13, 3)) == list(PROFILES)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"cuda": "12.4"},
            "no GPU stack profile for CUDA 12.4 (the profiles are CUDA 13.0, 12.8; driver='12.4' picks the one a "
            "driver of CUDA 12.4 runs)",
        ),
        ({"driver": "470.256.02"}, "NVIDIA driver 470.256.02 is older than CUDA 12 (>= 525.60.13): no GPU stack profile"),
        ({"name": "sglang-0.5.19-cu129"}, "no GPU stack profile named 'sglang-0.5.19-cu129'"),
        ({"python": "3.13"}, "profile sglang-0.5.23-cu130 does not install from wheels on python 3.13"),
        ({"python": "3.10"}, "profile sglang-0.5.23-cu130 does not install from wheels on python 3.10"),
    ],
)
def test_impossible_combinations_are_refused_in_one_line_listing_the_profiles(kwargs, message) -> None:
    with pytest.raises(UnknownGpuProfile) as refused:
        select_profile(**kwargs)
    text = str(refused.value)
    assert text.startswith(message) and "\n" not in text
    assert text.endswith("Profiles: " + "; ".join(p.summary() for p in PROFILES))


def _script(*args: str) -> subprocess.CompletedProcess[str]:
    """The table's command line, run as the bootstrap and the README run it: a plain script, no environment."""
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60, check=False, cwd="/"
    )


def test_command_line_prints_a_profiles_requirements() -> None:
    python = DEFAULT_PROFILE.pythons[0]
    printed = _script("requirements", "--profile", DEFAULT_PROFILE.name, "--python", python)
    assert printed.returncode == 0 and printed.stdout.splitlines() == DEFAULT_PROFILE.requirements()
    assert _script("list").stdout.splitlines() == [p.summary() for p in PROFILES]
    refused = _script("requirements", "--profile", "cu128")
    assert refused.returncode == 2 and refused.stdout == ""
    assert refused.stderr.startswith("gpu profile: no GPU stack profile named 'cu128'. Profiles: ")
    assert len(refused.stderr.splitlines()) == 1


def test_bootstrap_refuses_an_unknown_gpu_profile_before_building(tmp_path: Path) -> None:
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(tmp_path),
        "PYTHON": sys.executable,
        "SGLANG_GATEWAY_FLAVOR": "gpu",
        "SGLANG_GATEWAY_GPU_PROFILE": "cu128",
        "SGLANG_GATEWAY_VENV_CACHE": str(tmp_path / "cache"),
    }
    result = subprocess.run(
        [str(REPO / "scripts" / "bootstrap.sh")], capture_output=True, text=True, timeout=60, env=env, check=False
    )
    assert result.returncode == 2
    assert "gpu profile: no GPU stack profile named 'cu128'" in result.stderr
    assert not (tmp_path / "cache").exists()


def test_other_pins_match_the_default_profile() -> None:
    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["sglang"]
    assert extra == [f"sglang=={DEFAULT_PROFILE.sglang}"]
    cpu_pins = re.findall(r"sglang==([0-9.]+)", (REPO / "scripts" / "bootstrap.sh").read_text())
    assert cpu_pins and set(cpu_pins) == {DEFAULT_PROFILE.sglang}
    cpu_engine = (REPO / "requirements" / "engine-cpu.txt").read_text()
    assert re.findall(r"^torch==([^\s#]+)", cpu_engine, re.MULTILINE) == [DEFAULT_PROFILE.torch]
