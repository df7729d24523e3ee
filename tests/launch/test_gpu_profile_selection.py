"""GPU profile selection over a table of several profiles, and the command line run in-process (pure).

The shipped table has one profile, so which of several a name, a CUDA version or nothing picks is checked on a
stand-in table of two (``PROFILES`` patched: the functions read the table when called)."""

from __future__ import annotations

import sys
from dataclasses import replace

import pytest

from launch import gpu_profiles
from launch.gpu_profiles import (
    DEFAULT_PROFILE,
    PROFILES,
    UnknownGpuProfile,
    current_python,
    installed_profile,
    known_profiles,
    main,
    runnable_profiles,
    select_profile,
)

OLDER = replace(DEFAULT_PROFILE, name="older-cu130", cuda="13.0", pythons=("3.11", "3.12"))
NEWER = replace(DEFAULT_PROFILE, name="newer-cu131", cuda="13.1", torch="9.9.9", pythons=("3.12",))


@pytest.fixture
def two_profiles(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu_profiles, "PROFILES", (OLDER, NEWER))
    monkeypatch.setattr(gpu_profiles, "DEFAULT_PROFILE", OLDER)


@pytest.mark.usefixtures("two_profiles")
def test_a_name_a_cuda_version_or_the_default() -> None:
    assert select_profile() is OLDER
    assert select_profile("newer-cu131") is NEWER
    assert select_profile(cuda="13.1") is NEWER
    assert select_profile(cuda="13.0") is OLDER
    assert select_profile("newer-cu131", cuda="13.1", python="3.12") is NEWER


@pytest.mark.usefixtures("two_profiles")
def test_a_name_and_a_cuda_version_must_agree() -> None:
    with pytest.raises(UnknownGpuProfile) as refused:
        select_profile("older-cu130", cuda="13.1")
    assert str(refused.value) == f"profile older-cu130 is not CUDA 13.1. Profiles: {known_profiles()}"


@pytest.mark.usefixtures("two_profiles")
def test_the_python_is_checked_on_the_selected_profile() -> None:
    assert select_profile(python="3.11") is OLDER
    with pytest.raises(UnknownGpuProfile) as refused:
        select_profile("newer-cu131", python="3.11")
    assert str(refused.value).startswith("profile newer-cu131 does not install from wheels on python 3.11 (it does on 3.12). ")
    with pytest.raises(UnknownGpuProfile, match=r"\(it does on 3\.11, 3\.12\)"):
        select_profile(python="3.13")


@pytest.mark.usefixtures("two_profiles")
def test_the_profiles_a_driver_runs_and_the_one_installed() -> None:
    assert runnable_profiles((12, 9)) == []  # an older major version: no compatibility path
    assert runnable_profiles((13, 0)) == [OLDER, NEWER]  # NEWER (13.1) under minor-version compatibility
    assert runnable_profiles((13, 1)) == [OLDER, NEWER]
    assert runnable_profiles((14, 0)) == [OLDER, NEWER]
    assert installed_profile(NEWER.sglang, "9.9.9") is NEWER
    assert installed_profile(NEWER.sglang, "9.9.9+cu131") is NEWER
    assert installed_profile(NEWER.sglang, "9.9.9+cu130") is None
    assert installed_profile("0.0.1", NEWER.torch) is None
    assert known_profiles() == f"{OLDER.summary()}; {NEWER.summary()}"


def test_the_python_of_this_interpreter() -> None:
    assert current_python() == f"{sys.version_info[0]}.{sys.version_info[1]}"


def test_command_line_list_and_requirements(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["list"]) == 0
    assert capsys.readouterr().out.splitlines() == [profile.summary() for profile in PROFILES]
    assert main(["requirements", "--python", DEFAULT_PROFILE.pythons[0]]) == 0
    printed = capsys.readouterr()
    assert printed.out.splitlines() == DEFAULT_PROFILE.requirements() and printed.err == ""
    assert main(["requirements", "--profile", "", "--python", DEFAULT_PROFILE.pythons[-1]]) == 0  # empty: the default
    assert capsys.readouterr().out.splitlines() == DEFAULT_PROFILE.requirements()


@pytest.mark.usefixtures("two_profiles")
def test_command_line_picks_the_named_profile_for_this_python(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    assert main(["requirements", "--profile", "newer-cu131", "--python", "3.12"]) == 0
    assert capsys.readouterr().out.splitlines() == NEWER.requirements()
    monkeypatch.setattr(gpu_profiles, "current_python", lambda: "3.11")  # the default --python: this interpreter's
    assert main(["requirements", "--profile", "newer-cu131"]) == 2
    assert "on python 3.11" in capsys.readouterr().err


def test_command_line_refusals(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["requirements", "--profile", "nope"]) == 2
    printed = capsys.readouterr()
    assert printed.out == ""
    assert printed.err == f"gpu profile: no GPU stack profile named 'nope'. Profiles: {known_profiles()}\n"
    assert main(["requirements", "--python", "2.7"]) == 2
    assert capsys.readouterr().err.startswith(f"gpu profile: profile {DEFAULT_PROFILE.name} does not install from wheels on python 2.7")
    with pytest.raises(SystemExit) as usage:
        main([])  # a command is required
    assert usage.value.code == 2
    assert capsys.readouterr().err.startswith("usage: gpu_profiles.py ")


@pytest.mark.usefixtures("two_profiles")
def test_without_a_name_or_cuda_version_the_default_even_when_not_first(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(gpu_profiles, "DEFAULT_PROFILE", NEWER)
    assert select_profile() is NEWER
    assert select_profile(cuda="13.0") is OLDER
    assert main(["list"]) == 0
    assert capsys.readouterr().out == f"{OLDER.summary()}\n{NEWER.summary()}\n"  # one line per profile


def test_command_line_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert text.startswith("usage: gpu_profiles.py ") and "} ... GPU stack profiles of sglang-gateway positional arguments:" in text
    assert "list one line per profile" in text and "requirements a profile's requirement lines" in text
    with pytest.raises(SystemExit):
        main(["requirements", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert f"--profile PROFILE profile name (default: {DEFAULT_PROFILE.name})" in text
    assert "--python PYTHON target python X.Y (default: this one)" in text
