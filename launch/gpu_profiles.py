"""GPU stack profiles: SGLang, torch, CUDA and FlashInfer versions known to install and run together.

Everything that installs or pins the GPU stack reads this table: the wheel-pinned requirements of a
logged MLflow model, the GPU environment of ``scripts/bootstrap.sh``, docs/gpu.md, and the preflight
that compares a profile with the serving host's driver. A combination that is not in the table is
refused (:class:`UnknownGpuProfile`, listing the profiles) instead of being written down and failing
in a serving container after a long build.

Why there is no CUDA 12 profile: ``sglang`` 0.5.23 itself requires CUDA 13 packages
(``cuda-python>=13.0``, ``flashinfer_python[cu13]``, ``nvidia-cutlass-dsl[cu13]``) and torch 2.14 has
no CUDA 12.9 build; SGLang's last CUDA 12 lane (0.5.19) lives on SGLang's own wheel index, and the
package registry's 0.5.19 still pulls ``cuda-python>=13.0`` plus a ``cuda-tile`` pre-release the
registry does not serve. A CUDA 12 host therefore needs a driver upgrade, which the refusal says.

Stdlib only, and no import of the rest of ``launch``: ``python launch/gpu_profiles.py requirements``
runs before any environment exists (the bootstrap and the README's GPU install use it that way).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass

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
)
DEFAULT_PROFILE = PROFILES[0]


def known_profiles() -> str:
    return "; ".join(p.summary() for p in PROFILES)


def current_python() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def select_profile(name: str | None = None, *, cuda: str | None = None, python: str | None = None) -> GpuProfile:
    """The profile called ``name``, else the first one of CUDA ``cuda``, else :data:`DEFAULT_PROFILE`; checked for ``python``."""
    if cuda is not None and not any(p.cuda == cuda for p in PROFILES):
        raise UnknownGpuProfile(
            f"no GPU stack profile for CUDA {cuda}: SGLang {DEFAULT_PROFILE.sglang} needs CUDA "
            f"{DEFAULT_PROFILE.cuda_version[0]} (NVIDIA driver >= {DEFAULT_PROFILE.min_driver}). "
            f"Profiles: {known_profiles()}"
        )
    if name is not None and not any(p.name == name for p in PROFILES):
        raise UnknownGpuProfile(f"no GPU stack profile named {name!r}. Profiles: {known_profiles()}")
    matches = [p for p in PROFILES if name in (None, p.name) and cuda in (None, p.cuda)]
    if not matches:
        raise UnknownGpuProfile(f"profile {name} is not CUDA {cuda}. Profiles: {known_profiles()}")
    profile = matches[0] if name or cuda else DEFAULT_PROFILE
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


def runnable_profiles(driver_cuda: tuple[int, int]) -> list[GpuProfile]:
    """The profiles a driver that supports CUDA ``driver_cuda`` (major, minor) can run."""
    return [p for p in PROFILES if p.cuda_version <= driver_cuda]


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
