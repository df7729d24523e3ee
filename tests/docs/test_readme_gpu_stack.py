"""The documentation's GPU stack statements stay true: the profile table of docs/gpu.md lists the profiles of
``launch/gpu_profiles.py`` as they are, and the Databricks recipe of docs/databricks.md logs with a profile that
exists (and that tests/model_code/test_gpu_stack_resolves.py resolves against the registry), whose driver it
names. No engine, no network."""

from __future__ import annotations

import ast

import pytest

from launch.gpu_profiles import DEFAULT_PROFILE, PROFILES, GpuProfile, driver_verdict, select_profile
from tests.docs.readme_blocks import DOCS, marked_blocks

PROFILES_PAGE = DOCS / "gpu.md"  # holds the profile table
RECIPE_PAGE = DOCS / "databricks.md"  # holds the recipe and the driver it needs


def _row(profile: GpuProfile) -> str:
    default = " (default)" if profile == DEFAULT_PROFILE else ""
    cells = [
        f"`{profile.name}`{default}",
        profile.sglang,
        profile.torch,
        profile.cuda,
        profile.flashinfer,
        profile.sglang_kernel,
        f">= {profile.min_driver}",
        ", ".join(profile.pythons),
        f">= {profile.glibc}",
    ]
    return "| " + " | ".join(cells) + " |"


@pytest.mark.parametrize("profile", PROFILES, ids=lambda p: p.name)
def test_profile_table_row(profile: GpuProfile) -> None:
    rows = PROFILES_PAGE.read_text().splitlines()
    assert _row(profile) in rows, f"docs/gpu.md's profile table has no row for {profile.name}: paste {_row(profile)}"


def test_databricks_recipe_logs_with_a_known_profile() -> None:
    (block,) = marked_blocks("databricks-recipe")
    code = "\n".join(line for line in block.code.splitlines() if not line.startswith("%"))  # notebook magics
    calls = [
        node
        for node in ast.walk(ast.parse(code))
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "log_model"
    ]
    assert len(calls) == 1
    given = {k.arg: ast.literal_eval(k.value) for k in calls[0].keywords if k.arg in ("profile", "cuda", "python")}
    assert "profile" in given, "the recipe names its GPU stack profile"
    profile = select_profile(given["profile"], cuda=given.get("cuda"), python=given.get("python"))
    prose = " ".join(RECIPE_PAGE.read_text().split())
    assert (
        f"`{profile.name}` runs on an NVIDIA driver that supports CUDA {profile.cuda} (>= {profile.min_driver})"
        in prose
    )
    # the driver the page reports for the serving containers runs the profile it logs, and driver= picks the same one
    assert "run an NVIDIA driver for CUDA 12.4" in prose
    assert driver_verdict(profile, (12, 4)).runs and select_profile(driver="12.4") == profile
