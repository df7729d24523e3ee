"""A logged model's pinned GPU stack (its ``requirements.txt``) against this host, before anything starts: the
profile it pins, whether the host's driver runs it, and which profile would."""

from __future__ import annotations

import re
from collections.abc import Iterable

from launch.doctor.checks import Check
from launch.doctor.host import HostFacts
from launch.gpu_profiles import driver_verdict, installed_profile, parse_cuda, profile_for_cuda

_PIN = re.compile(r"^\s*(sglang|torch)\s*==\s*([^\s;#]+)", re.IGNORECASE)


def pinned_versions(requirements: Iterable[str]) -> dict[str, str]:
    return {m[1].lower(): m[2] for line in requirements if (m := _PIN.match(line))}


def pinned_stack_checks(requirements: Iterable[str], facts: HostFacts, where: str = "the logged model") -> list[Check]:
    pins = pinned_versions(requirements)
    sglang, torch = pins.get("sglang"), pins.get("torch")
    if sglang is None:
        return [Check("pinned stack", "warning", f"{where} pins no sglang version", "log it with model_code.log_model")]
    if torch is None:
        return [Check("pinned stack", "ok", f"{where} pins SGLang {sglang} alone: a CPU engine")]
    profile = installed_profile(sglang, torch)
    if profile is None:
        return [Check("pinned stack", "warning", f"{where} pins SGLang {sglang} with torch {torch}: no GPU stack profile",
                      "log it again with profile= (launch/gpu_profiles.py)")]  # fmt: skip
    if not facts.nvidia_smi or facts.driver_cuda is None:
        return [Check("pinned stack", "error", f"{where} pins GPU stack {profile.name}, and this host has no NVIDIA driver",
                      "serve it on a GPU host")]  # fmt: skip
    cuda = parse_cuda(facts.driver_cuda)
    verdict = driver_verdict(profile, cuda)
    detail = f"{where} pins GPU stack {profile.name}: {verdict.message()}"
    if verdict.support == "native":
        return [Check("pinned stack", "ok", detail)]
    if verdict.support == "compat":
        return [Check("pinned stack", "warning", detail, f"a driver >= {profile.min_driver} runs it natively")]
    best = profile_for_cuda(cuda)
    fix = f"log it again with profile={best.name!r} (or driver={facts.driver_cuda!r})" if best else f"upgrade the driver to >= {profile.min_driver}"
    return [Check("pinned stack", "error", detail, fix)]
