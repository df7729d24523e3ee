"""NVIDIA's driver rule applied to each GPU stack profile, read from recorded ``nvidia-smi`` outputs
(tests/launch/data/nvidia-smi: one recorded on an H200, the others its shape with another driver's header).

Each driver x profile pair goes through the preflight as an engine launch would: natively nothing is said,
under minor-version compatibility a warning names the limits and the driver that runs it natively, and a
refusal is an error that names the profile that does run on the host's driver (or says none does).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from launch.config import EngineConfig
from launch.gpu_profiles import (
    PROFILES,
    UnknownGpuProfile,
    driver_cuda,
    driver_verdict,
    profile_for_cuda,
    runnable_profiles,
    select_profile,
    target_cuda,
)
from launch.preflight import parse_driver_cuda, preflight

RECORDED = Path(__file__).parent / "data" / "nvidia-smi"
CU130 = select_profile("sglang-0.5.23-cu130")
CU128 = select_profile("sglang-0.5.10.post1-cu128")

# recorded output -> (the CUDA version it reports, {profile: what the preflight says})
EXPECTED = {
    "h200-r580-cuda13.0.txt": ((13, 0), {CU130: "native", CU128: "native"}),
    "l40s-r570-cuda12.8.txt": ((12, 8), {CU130: "refused", CU128: "native"}),
    "a10g-r550-cuda12.4.txt": ((12, 4), {CU130: "refused", CU128: "compat"}),
    "a100-r535-cuda12.2.txt": ((12, 2), {CU130: "refused", CU128: "compat"}),
    "v100-r470-cuda11.4.txt": ((11, 4), {CU130: "refused", CU128: "refused"}),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = tmp_path_factory.mktemp("model")
    (model / "config.json").write_text("{}")
    return model


def _launch_findings(model_dir: Path, recorded: str, profile, tmp_path: Path) -> list:
    """The preflight of a CUDA engine on a host with this driver, whose engine python has this profile installed
    (a stand-in python that answers the preflight's version question as that environment would)."""
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\nprintf '%s\\n%s\\n' {profile.sglang} {profile.torch}\n")
    python.chmod(0o755)
    engine = EngineConfig(model_path=str(model_dir), device="cuda", python=str(python))
    driver = parse_driver_cuda((RECORDED / recorded).read_text())
    return preflight(engine, gpu_count=1, cuda_home="/usr/local/cuda", driver_cuda=driver).findings


def test_every_profile_is_covered() -> None:
    assert {p for _, verdicts in EXPECTED.values() for p in verdicts} == set(PROFILES)


@pytest.mark.parametrize("recorded", sorted(EXPECTED))
@pytest.mark.parametrize("profile", PROFILES, ids=lambda p: p.name)
def test_the_preflight_applies_the_rule_to_a_recorded_driver(
    model_dir: Path, recorded: str, profile, tmp_path: Path
) -> None:
    cuda, verdicts = EXPECTED[recorded]
    assert parse_driver_cuda((RECORDED / recorded).read_text()) == cuda
    expected = verdicts[profile]
    assert driver_verdict(profile, cuda).support == expected
    findings = [f for f in _launch_findings(model_dir, recorded, profile, tmp_path) if "NVIDIA driver" in f.message]
    if expected == "native":
        assert findings == []
        return
    (finding,) = findings
    assert "\n" not in finding.message
    assert finding.message.startswith(f"the NVIDIA driver supports CUDA {cuda[0]}.{cuda[1]} (SGLang {profile.sglang}")
    if expected == "compat":
        assert finding.level == "warning"
        assert "minor-version compatibility" in finding.message and "PTX" in finding.message
        assert f"a driver >= {profile.min_driver} runs it natively" in finding.message
    else:
        assert finding.level == "error"
        other = profile_for_cuda(cuda)
        what_to_do = f"profile {other.name} runs on it" if other else "no profile runs on it"
        assert what_to_do in finding.message and f"upgrade the driver to >= {profile.min_driver}" in finding.message


def test_the_profile_for_each_recorded_driver() -> None:
    picked = {recorded: profile_for_cuda(cuda) for recorded, (cuda, _) in EXPECTED.items()}
    assert picked == {
        "h200-r580-cuda13.0.txt": CU130,  # native for both: the table's first
        "l40s-r570-cuda12.8.txt": CU128,
        "a10g-r550-cuda12.4.txt": CU128,
        "a100-r535-cuda12.2.txt": CU128,
        "v100-r470-cuda11.4.txt": None,
    }
    assert runnable_profiles((12, 4)) == [CU128] and runnable_profiles((13, 0)) == [CU130, CU128]


@pytest.mark.parametrize(
    "driver, cuda",
    [
        ("550.54.15", (12, 4)),  # CUDA 12.4 update 1's driver
        ("550.54.14", (12, 4)),
        ("550.54.13", (12, 3)),
        ("535.104.05", (12, 2)),
        ("525.60.13", (12, 0)),
        ("570.26", (12, 8)),
        ("580.159.04", (13, 0)),
        ("12.4", (12, 4)),  # the CUDA version nvidia-smi shows
        ("13.0", (13, 0)),
    ],
)
def test_a_target_driver_by_version_or_by_cuda(driver: str, cuda: tuple[int, int]) -> None:
    assert target_cuda(driver) == cuda


def test_drivers_older_than_cuda_12_and_bad_spellings_are_named() -> None:
    assert driver_cuda("470.256.02") is None
    with pytest.raises(UnknownGpuProfile, match=r"^NVIDIA driver 470\.256\.02 is older than CUDA 12 \(>= 525\.60\.13\)"):
        target_cuda("470.256.02")
    with pytest.raises(ValueError, match="not an NVIDIA driver version"):
        target_cuda("r550")


def test_select_by_driver_picks_the_profile_that_runs_there() -> None:
    assert select_profile(driver="12.4") is CU128
    assert select_profile(driver="550.54.15") is CU128
    assert select_profile(driver="580.65.06") is CU130
    assert select_profile(CU128.name, driver="12.2") is CU128  # under compatibility: allowed
    with pytest.raises(UnknownGpuProfile) as refused:
        select_profile(CU130.name, driver="12.4")
    assert str(refused.value).startswith(
        f"driver 12.4: GPU stack {CU130.name} needs CUDA 13.x (NVIDIA driver >= 580.65.06), the driver supports "
        f"CUDA 12.4: profile {CU128.name} runs on it, or upgrade the driver to >= {CU130.min_driver}"
    )
    with pytest.raises(UnknownGpuProfile, match=r"^driver 11\.8 \(CUDA 11\.8\): no GPU stack profile runs on it"):
        select_profile(driver="11.8")
