"""GPU stack profiles: SGLang, torch, CUDA and FlashInfer versions known to install and run together.

Everything that installs or pins the GPU stack reads this table: the wheel-pinned requirements of a
logged MLflow model, the GPU environment of ``scripts/bootstrap.sh``, docs/gpu.md, and the preflight
that compares a profile with the serving host's driver. A combination that is not in the table is
refused (:class:`UnknownGpuProfile`, listing the profiles) instead of being written down and failing
in a serving container after a long build.

Two profiles: SGLang 0.5.23 on CUDA 13.0 (the default), and SGLang 0.5.10.post1 on CUDA 12.8, the newest SGLang
release that resolves whole from the package registry on a CUDA 12 runtime (0.5.11 to 0.5.17 resolve with torch
2.11's CUDA 13 build; 0.5.18 and 0.5.19 need a ``cuda-tile`` pre-release the registry does not serve). The
driver rule (:func:`driver_verdict`) follows NVIDIA's CUDA compatibility guide: a driver runs a stack natively when
it supports the stack's CUDA version, under minor-version compatibility when it is of the same CUDA major version
(older minor), and not at all when its major version is older. docs/gpu.md cites the rules and their limits.

Stdlib only, and no import of the rest of ``launch``: ``python launch/gpu_profiles.py requirements``
runs before any environment exists (the bootstrap and the README's GPU install use it that way).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

FLASHINFER_RELEASES = "https://github.com/flashinfer-ai/flashinfer/releases/download"


class UnknownGpuProfile(ValueError):
    """No GPU stack profile matches the requested name / CUDA version / python."""


@dataclass(frozen=True)
class GpuProfile:
    """One consistent GPU stack. Versions are exact pins; ``min_driver`` is the NVIDIA driver the CUDA runtime needs."""

    name: str
    sglang: str
    torch: str  # the package registry's default build of this version is the CUDA build below
    cuda: str  # CUDA runtime (nvidia-cuda-runtime) major.minor; the driver must support at least this
    flashinfer: str
    sglang_kernel: str
    min_driver: str
    pythons: tuple[str, ...]  # every python whose wheels the whole stack publishes
    glibc: str  # the newest manylinux tag among the stack's wheels (sglang's)

    @property
    def cuda_version(self) -> tuple[int, int]:
        major, minor = self.cuda.split(".")
        return int(major), int(minor)

    @property
    def cuda_tag(self) -> str:
        return "cu" + self.cuda.replace(".", "")

    def flashinfer_wheels(self) -> tuple[str, ...]:
        """FlashInfer as direct wheel URLs of its GitHub release (an index URL fails on Databricks Model Serving).

        ``flashinfer_jit_cache`` holds pre-built kernels for this CUDA; without it FlashInfer compiles
        kernels on first use, which needs ``nvcc`` on the serving host.
        """
        base = f"{FLASHINFER_RELEASES}/v{self.flashinfer}"
        return (
            f"{base}/flashinfer_python-{self.flashinfer}-py3-none-any.whl",
            f"{base}/flashinfer_jit_cache-{self.flashinfer}+{self.cuda_tag}-cp39-abi3-manylinux_2_28_x86_64.whl",
        )

    def pins(self) -> list[str]:
        """The registry pins of the stack (FlashInfer apart: see :meth:`flashinfer_wheels`)."""
        return [f"torch=={self.torch}", f"sglang-kernel=={self.sglang_kernel}", f"sglang=={self.sglang}"]

    def requirements(self) -> list[str]:
        """Every requirement line of the stack, as a ``requirements.txt`` would hold them."""
        return [*self.pins(), *self.flashinfer_wheels()]

    def summary(self) -> str:
        return (
            f"{self.name} (SGLang {self.sglang}, torch {self.torch}, CUDA {self.cuda}, FlashInfer {self.flashinfer}, "
            f"sglang-kernel {self.sglang_kernel}, NVIDIA driver >= {self.min_driver}, "
            f"python {'/'.join(self.pythons)}, glibc >= {self.glibc})"
        )


PROFILES: tuple[GpuProfile, ...] = (
    GpuProfile(
        name="sglang-0.5.23-cu130",
        sglang="0.5.23",
        torch="2.14.1",
        cuda="13.0",
        flashinfer="0.7.2",
        sglang_kernel="0.4.10",
        min_driver="580.65.06",  # CUDA 13.0's minimum Linux driver (R580)
        pythons=("3.11", "3.12"),  # 3.13: outlines_core 0.1.26 (via outlines==0.1.11) has no cp313 wheel
        glibc="2.34",  # sglang 0.5.23 wheels are manylinux_2_34
    ),
    GpuProfile(
        # The newest SGLang that resolves whole from the registry on a CUDA 12 runtime (torch 2.9.1's default
        # build is CUDA 12.8; sglang-kernel 0.4.1 links libcudart.so.12): for drivers of CUDA 12.x, e.g.
        # Databricks Model Serving's GPU containers.
        name="sglang-0.5.10.post1-cu128",
        sglang="0.5.10.post1",
        torch="2.9.1",
        cuda="12.8",
        flashinfer="0.6.7.post3",
        sglang_kernel="0.4.1",
        min_driver="570.26",  # CUDA 12.8's minimum Linux driver (R570)
        pythons=("3.11", "3.12"),  # 3.13: outlines_core 0.1.26 has no cp313 wheel
        glibc="2.28",  # torch 2.9.1 and the CUDA 12.8 libraries are manylinux_2_28 at most
    ),
)
DEFAULT_PROFILE = PROFILES[0]


def known_profiles() -> str:
    return "; ".join(p.summary() for p in PROFILES)


def current_python() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def select_profile(
    name: str | None = None, *, cuda: str | None = None, python: str | None = None, driver: str | None = None
) -> GpuProfile:
    """The profile called ``name``, else the first one of CUDA ``cuda``, else the one a target's ``driver`` runs
    (:func:`profile_for_cuda`; given as ``"12.4"`` or ``"550.54.15"``), else :data:`DEFAULT_PROFILE`; checked
    for ``python``, and a named profile against the ``driver``."""
    if cuda is not None and not any(p.cuda == cuda for p in PROFILES):
        raise UnknownGpuProfile(
            f"no GPU stack profile for CUDA {cuda} (the profiles are CUDA {', '.join(p.cuda for p in PROFILES)}; "
            f"driver={cuda!r} picks the one a driver of CUDA {cuda} runs). Profiles: {known_profiles()}"
        )
    if name is not None and not any(p.name == name for p in PROFILES):
        raise UnknownGpuProfile(f"no GPU stack profile named {name!r}. Profiles: {known_profiles()}")
    matches = [p for p in PROFILES if name in (None, p.name) and cuda in (None, p.cuda)]
    if not matches:
        raise UnknownGpuProfile(f"profile {name} is not CUDA {cuda}. Profiles: {known_profiles()}")
    profile = matches[0] if name or cuda else DEFAULT_PROFILE
    if driver is not None:
        on_driver = target_cuda(driver)
        if name or cuda:
            verdict = driver_verdict(profile, on_driver)
            if not verdict.runs:
                raise UnknownGpuProfile(f"driver {driver}: {verdict.message()}. Profiles: {known_profiles()}")
        else:
            best = profile_for_cuda(on_driver)
            if best is None:
                raise UnknownGpuProfile(
                    f"driver {driver} (CUDA {on_driver[0]}.{on_driver[1]}): no GPU stack profile runs on it. "
                    f"Profiles: {known_profiles()}"
                )
            profile = best
    if python is not None and python not in profile.pythons:
        raise UnknownGpuProfile(
            f"profile {profile.name} does not install from wheels on python {python} (it does on {', '.join(profile.pythons)}). "
            f"Profiles: {known_profiles()}"
        )
    return profile


def installed_profile(sglang: str, torch: str) -> GpuProfile | None:
    """The profile an environment with these installed versions is (a ``+cuXYZ`` torch of the profile's CUDA counts)."""
    for profile in PROFILES:
        if sglang == profile.sglang and torch in (profile.torch, f"{profile.torch}+{profile.cuda_tag}"):
            return profile
    return None


# NVIDIA's "CUDA Toolkit and Corresponding Driver Versions" (CUDA toolkit release notes, Linux x86_64, each
# release's GA): the oldest driver of each CUDA version. A driver supports the newest CUDA whose minimum it meets.
CUDA_MIN_DRIVERS: tuple[tuple[tuple[int, int], str], ...] = (
    ((12, 0), "525.60.13"),
    ((12, 1), "530.30.02"),
    ((12, 2), "535.54.03"),
    ((12, 3), "545.23.06"),
    ((12, 4), "550.54.14"),
    ((12, 5), "555.42.02"),
    ((12, 6), "560.28.03"),
    ((12, 8), "570.26"),
    ((12, 9), "575.51.03"),
    ((13, 0), "580.65.06"),
)
# NVIDIA's CUDA Compatibility guide, "Minor Version Compatibility" (table of driver ranges): a toolkit of a CUDA
# major version runs, with a limited feature set, on any driver of that major version from this one on.
MINOR_VERSION_COMPAT_MIN_DRIVER = {12: "525.60.13", 13: "580.65.06"}

# What minor-version compatibility does not cover (the guide's limits), said once in every such verdict.
COMPAT_LIMITS = (
    "code that reaches the driver as PTX from newer CUDA tools cannot be JIT-loaded (FlashInfer's pinned JIT "
    "cache and sglang-kernel ship compiled kernels; Triton compiles to cubins with its own ptxas); "
    "CUDA graphs are unaffected"
)

Support = Literal["native", "compat", "refused"]


def parse_driver_version(text: str) -> tuple[int, ...]:
    """``"550.54.15"`` -> ``(550, 54, 15)``; a :class:`ValueError` names anything else."""
    parts = text.strip().split(".")
    if not 1 <= len(parts) <= 3 or not all(part.isdigit() for part in parts):
        raise ValueError(f"not an NVIDIA driver version (like 550.54.15): {text!r}")
    return tuple(int(part) for part in parts)


def driver_cuda(driver_version: str) -> tuple[int, int] | None:
    """The newest CUDA version a driver supports, from NVIDIA's table; ``None`` for a driver older than CUDA 12."""
    installed = parse_driver_version(driver_version)
    supported = [cuda for cuda, minimum in CUDA_MIN_DRIVERS if installed >= parse_driver_version(minimum)]
    return supported[-1] if supported else None


def parse_cuda(text: str) -> tuple[int, int]:
    """``"12.4"`` -> ``(12, 4)``; a :class:`ValueError` names anything else."""
    major, _, minor = text.strip().partition(".")
    if not (major.isdigit() and minor.isdigit()):
        raise ValueError(f"not a CUDA version (like 12.4): {text!r}")
    return int(major), int(minor)


def target_cuda(driver: str) -> tuple[int, int]:
    """A target's driver given as the CUDA version ``nvidia-smi`` shows (``"12.4"``) or as the driver's own
    version (``"550.54.15"``), as the CUDA version it supports."""
    if driver.count(".") == 1 and len(driver.split(".")[0]) <= 2:
        return parse_cuda(driver)
    cuda = driver_cuda(driver)
    if cuda is None:
        raise UnknownGpuProfile(
            f"NVIDIA driver {driver} is older than CUDA 12 (>= {CUDA_MIN_DRIVERS[0][1]}): no GPU stack profile runs "
            f"on it. Profiles: {known_profiles()}"
        )
    return cuda


@dataclass(frozen=True)
class DriverVerdict:
    """Whether a driver that supports CUDA ``driver_cuda`` runs ``profile``, and the one line that says so."""

    profile: GpuProfile
    driver_cuda: tuple[int, int]
    support: Support

    @property
    def runs(self) -> bool:
        return self.support != "refused"

    def message(self) -> str:
        cuda = f"{self.driver_cuda[0]}.{self.driver_cuda[1]}"
        if self.support == "native":
            return f"GPU stack {self.profile.name} (CUDA {self.profile.cuda}) runs natively on a driver of CUDA {cuda}"
        if self.support == "compat":
            return (
                f"GPU stack {self.profile.name} (CUDA {self.profile.cuda}) runs on a driver of CUDA {cuda} under NVIDIA's "
                f"minor-version compatibility: {COMPAT_LIMITS}; a driver >= {self.profile.min_driver} runs it natively"
            )
        best = profile_for_cuda(self.driver_cuda)
        instead = f"profile {best.name} runs on it" if best else "no profile runs on it"
        return (
            f"GPU stack {self.profile.name} needs CUDA {self.profile.cuda_version[0]}.x (NVIDIA driver >= "
            f"{MINOR_VERSION_COMPAT_MIN_DRIVER.get(self.profile.cuda_version[0], self.profile.min_driver)}), "
            f"the driver supports CUDA {cuda}: {instead}, or upgrade the driver to >= {self.profile.min_driver}"
        )


def driver_verdict(profile: GpuProfile, driver_cuda: tuple[int, int]) -> DriverVerdict:
    """NVIDIA's rule: natively from the profile's CUDA version on (backward compatibility), under minor-version
    compatibility on an older minor of the same major version, never on an older major version."""
    if driver_cuda >= profile.cuda_version:
        return DriverVerdict(profile, driver_cuda, "native")
    if driver_cuda[0] == profile.cuda_version[0] and profile.cuda_version[0] in MINOR_VERSION_COMPAT_MIN_DRIVER:
        return DriverVerdict(profile, driver_cuda, "compat")
    return DriverVerdict(profile, driver_cuda, "refused")


def runnable_profiles(driver_cuda: tuple[int, int]) -> list[GpuProfile]:
    """The profiles a driver that supports CUDA ``driver_cuda`` (major, minor) runs, natively or under
    minor-version compatibility, in table order."""
    return [p for p in PROFILES if driver_verdict(p, driver_cuda).runs]


def profile_for_cuda(driver_cuda: tuple[int, int]) -> GpuProfile | None:
    """The profile to run on such a driver: the first of the table it runs natively, else the first it runs at all."""
    verdicts = [driver_verdict(p, driver_cuda) for p in PROFILES]
    for wanted in ("native", "compat"):
        for verdict in verdicts:
            if verdict.support == wanted:
                return verdict.profile
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """``list`` the profiles, or print a profile's ``requirements`` (one line each) for ``pip install -r``."""
    parser = argparse.ArgumentParser(prog="gpu_profiles.py", description="GPU stack profiles of sglang-gateway")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("list", help="one line per profile")
    requirements = commands.add_parser("requirements", help="a profile's requirement lines")
    requirements.add_argument("--profile", default=None, help=f"profile name (default: {DEFAULT_PROFILE.name})")
    requirements.add_argument("--python", default=current_python(), help="target python X.Y (default: this one)")
    args = parser.parse_args(argv)
    if args.command == "list":
        print("\n".join(p.summary() for p in PROFILES))
        return 0
    try:
        profile = select_profile(args.profile or None, python=args.python)
    except UnknownGpuProfile as error:
        print(f"gpu profile: {error}", file=sys.stderr)
        return 2
    print("\n".join(profile.requirements()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
