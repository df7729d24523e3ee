"""The doctor's verdicts: each fact of a host judged ok / warning / error with the one-line fix.

One table (:data:`HOST_CHECKS`) lists the checks in report order; each takes the host's facts and the deployment's
engines (empty without a config) and returns its findings. Driver and profile verdicts are the GPU profiles' own
rule (:func:`launch.gpu_profiles.driver_verdict`), and the ``/dev/shm`` and CUDA toolkit limits the preflight's, so
the doctor and a launch never disagree.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from launch.config import EngineConfig
from launch.doctor.host import HostFacts
from launch.gpu_profiles import (
    PROFILES,
    driver_verdict,
    installed_profile,
    parse_cuda,
    profile_for_cuda,
)
from launch.preflight import SHM_RECOMMENDED_BYTES, SHM_TOO_SMALL_BYTES

Level = Literal["ok", "warning", "error", "info"]
MIN_COMPUTE_CAPABILITY = (7, 5)  # Turing: the oldest GPUs SGLang's kernels are built for
OPEN_FILES_WANTED = 65536  # a gateway in front holds two descriptors per stream; SGLang's own advice too
GIB = 1 << 30


@dataclass(frozen=True)
class Check:
    name: str
    level: Level
    detail: str
    fix: str = ""


def _wants_gpu(facts: HostFacts, engines: Sequence[EngineConfig]) -> bool:
    return any(engine.device == "cuda" for engine in engines) or facts.nvidia_smi


def check_python(facts: HostFacts, engines: Sequence[EngineConfig]) -> list[Check]:
    supported = sorted({python for profile in PROFILES for python in profile.pythons})
    if ".".join(facts.python.split(".")[:2]) in supported:
        return [Check("python", "ok", f"Python {facts.python}")]
    return [Check("python", "warning", f"Python {facts.python}: the GPU stack profiles publish wheels for {', '.join(supported)}",
                  f"use Python {supported[-1]}")]  # fmt: skip


def check_stack(facts: HostFacts, engines: Sequence[EngineConfig]) -> list[Check]:
    """The installed SGLang + torch against the profile table (a CPU-only host needs no GPU stack)."""
    sglang, torch = facts.stack.get("sglang"), facts.stack.get("torch", "")
    if not sglang:
        return [Check("gpu stack", "error", f"{facts.engine_python}: SGLang is not installed",
                      "install a profile: python launch/gpu_profiles.py requirements --profile NAME")]  # fmt: skip
    kernel = facts.stack.get("sglang-kernel") or facts.stack.get("sgl-kernel")
    flashinfer = facts.stack.get("flashinfer-python")
    versions = f"SGLang {sglang}, torch {torch or '(none)'}, sglang-kernel {kernel or '(none)'}, FlashInfer {flashinfer or '(none)'}"
    profile = installed_profile(sglang, torch)
    if not _wants_gpu(facts, engines):
        return [Check("gpu stack", "info", f"{versions}: no GPU here; device: cpu engines run (launch/cpu_shim stands in for sglang-kernel)")]
    if profile is not None and not (kernel and flashinfer):
        return [Check("gpu stack", "error", f"{versions}: profile {profile.name} without its kernels",
                      f"pip install -r <(python launch/gpu_profiles.py requirements --profile {profile.name})")]  # fmt: skip
    if profile is not None:
        return [Check("gpu stack", "ok", f"{versions}: profile {profile.name}")]
    return [Check("gpu stack", "warning", f"{versions} is no GPU stack profile: the driver rule cannot be applied",
                  "install a profile: python launch/gpu_profiles.py requirements --profile NAME")]  # fmt: skip


def check_driver(facts: HostFacts, engines: Sequence[EngineConfig]) -> list[Check]:
    if not facts.nvidia_smi:
        level: Level = "error" if any(e.device == "cuda" for e in engines) else "info"
        return [Check("driver", level, "no NVIDIA driver (nvidia-smi not found or failing): no GPU checks",
                      "install the NVIDIA driver, or use device: cpu" if level == "error" else "")]  # fmt: skip
    if facts.driver_cuda is None:
        return [Check("driver", "warning", f"driver {facts.driver_version}: nvidia-smi shows no CUDA version",
                      "check the driver install (nvidia-smi should show 'CUDA Version')")]  # fmt: skip
    cuda = parse_cuda(facts.driver_cuda)
    best = profile_for_cuda(cuda)
    installed = installed_profile(facts.stack.get("sglang", ""), facts.stack.get("torch", ""))
    where = f"driver {facts.driver_version or '?'} (CUDA {facts.driver_cuda})"
    if installed is None:
        if best is None:
            return [Check("driver", "error", f"{where}: no GPU stack profile runs on it", "upgrade the driver to >= 570.26 (CUDA 12.8)")]
        return [Check("driver", "ok", f"{where}: profile {best.name} runs on it ({driver_verdict(best, cuda).support})")]
    verdict = driver_verdict(installed, cuda)
    if verdict.support == "native":
        return [Check("driver", "ok", f"{where}: {verdict.message()}")]
    if verdict.support == "compat":
        return [Check("driver", "warning", f"{where}: {verdict.message()}", f"upgrade the driver to >= {installed.min_driver}")]
    return [Check("driver", "error", f"{where}: {verdict.message()}",
                  f"install profile {best.name}" if best else f"upgrade the driver to >= {installed.min_driver}")]  # fmt: skip


def check_gpus(facts: HostFacts, engines: Sequence[EngineConfig]) -> list[Check]:
    if not facts.nvidia_smi:
        return []
    if not facts.gpus:
        return [Check("gpus", "error", "nvidia-smi lists no GPU", "check NVIDIA_VISIBLE_DEVICES / the container's GPU request")]
    found = []
    for gpu in facts.gpus:
        memory = f"{(gpu.memory_free_mib or 0) / 1024:.0f} of {(gpu.memory_total_mib or 0) / 1024:.0f} GiB free"
        capability = tuple(int(part) for part in gpu.compute_capability.split(".")[:2] if part.isdigit())
        if capability and capability < MIN_COMPUTE_CAPABILITY:
            found.append(Check(f"gpu {gpu.index}", "error", f"{gpu.name}, compute capability {gpu.compute_capability}: older than Turing (7.5)",
                               "use a Turing or newer GPU (T4, A10G, L4, A100, H100...)"))  # fmt: skip
        else:
            found.append(Check(f"gpu {gpu.index}", "ok", f"{gpu.name}, compute capability {gpu.compute_capability}, {memory}"))
    needed = max((engine.tp_size * engine.dp_size for engine in engines if engine.device == "cuda"), default=0)
    if needed > len(facts.gpus):
        found.append(Check("gpus", "error", f"the deployment needs {needed} GPUs per engine, {len(facts.gpus)} visible",
                           "lower tp_size/dp_size or give the host more GPUs"))  # fmt: skip
    if facts.gpu_processes:
        held = ", ".join(f"pid {p['pid']} {p['name']} {p['used_mib']} MiB" for p in facts.gpu_processes)
        found.append(Check("gpu memory", "warning", f"other processes hold GPU memory: {held}",
                           "stop them, or lower mem_fraction_static: SGLang sizes its KV cache from free memory"))  # fmt: skip
    return found


def check_cuda_toolkit(facts: HostFacts, engines: Sequence[EngineConfig]) -> list[Check]:
    if not _wants_gpu(facts, engines):
        return []
    if facts.cuda_home is None:
        return [Check("cuda toolkit", "warning", "CUDA_HOME is unset and no nvcc was found: FlashInfer kernels missing "
                      "from its JIT cache cannot be built, and the launcher turns CUDA graphs off",
                      "install the CUDA toolkit and set CUDA_HOME (or pin the profile's flashinfer_jit_cache wheel)")]  # fmt: skip
    detail = f"CUDA_HOME {facts.cuda_home}, nvcc {facts.nvcc_cuda or '(version unreadable)'}"
    if facts.nvcc_cuda and facts.driver_cuda and parse_cuda(facts.nvcc_cuda) > parse_cuda(facts.driver_cuda):
        return [Check("cuda toolkit", "warning", f"{detail}: newer than the driver's CUDA {facts.driver_cuda}: PTX it "
                      "emits for JIT-built kernels cannot be loaded by this driver",
                      f"use a CUDA {facts.driver_cuda} toolkit, or upgrade the driver")]  # fmt: skip
    return [Check("cuda toolkit", "ok", detail)]


def check_shm(facts: HostFacts, engines: Sequence[EngineConfig]) -> list[Check]:
    if facts.shm_bytes is None:
        return [Check("/dev/shm", "warning", "no /dev/shm", "mount a tmpfs at /dev/shm (docker --shm-size=1g)")]
    size = f"/dev/shm {facts.shm_bytes / (1 << 20):.0f} MiB"
    if facts.shm_bytes >= SHM_RECOMMENDED_BYTES:
        return [Check("/dev/shm", "ok", size)]
    parallel = any(engine.device == "cuda" and engine.tp_size > 1 for engine in engines)
    level: Level = "error" if parallel and facts.shm_bytes < SHM_TOO_SMALL_BYTES else "warning"
    return [Check("/dev/shm", level, f"{size}: NCCL needs shared memory between tensor-parallel ranks (the launcher "
                  "turns NCCL's shared-memory transport off below 512 MiB)",
                  "give the container at least 1 GiB: docker --shm-size=1g, or an emptyDir with medium: Memory")]  # fmt: skip


def _limit_text(value: int) -> str:
    return "unlimited" if value < 0 else str(value)


def check_limits(facts: HostFacts, engines: Sequence[EngineConfig]) -> list[Check]:
    found = []
    if facts.open_files is not None:
        soft, hard = facts.open_files
        text = f"open files {_limit_text(soft)} (hard {_limit_text(hard)})"
        if 0 <= soft < OPEN_FILES_WANTED:
            fix = f"ulimit -n {OPEN_FILES_WANTED}" + ("" if hard < 0 or hard >= OPEN_FILES_WANTED else " (raise the hard limit first)")
            found.append(Check("open files", "warning", text + f": below {OPEN_FILES_WANTED} (two per proxied stream)", fix))
        else:
            found.append(Check("open files", "ok", text))
    if facts.locked_memory is not None:
        soft, _hard = facts.locked_memory
        if 0 <= soft < GIB and _wants_gpu(facts, engines):
            found.append(Check("locked memory", "warning", f"locked memory {soft >> 10} KiB: NCCL and pinned host buffers want more",
                               "docker --ulimit memlock=-1 (or ulimit -l unlimited)"))  # fmt: skip
        else:
            found.append(Check("locked memory", "ok", f"locked memory {_limit_text(soft) if soft < 0 else f'{soft >> 10} KiB'}"))
    return found


def check_disk(facts: HostFacts, engines: Sequence[EngineConfig]) -> list[Check]:
    if facts.free_disk_bytes is None:
        return []
    cache = f"Hugging Face cache {facts.hf_cache} ({(facts.hf_cache_bytes or 0) / GIB:.1f} GiB)"
    free = f"{facts.free_disk_bytes / GIB:.1f} GiB free"
    if facts.free_disk_bytes < 20 * GIB:
        return [Check("disk", "warning", f"{cache}, {free}: a 7B model's weights are ~15 GiB", "free disk, or set HF_HOME to a larger volume")]
    return [Check("disk", "ok", f"{cache}, {free}")]


def check_container(facts: HostFacts, engines: Sequence[EngineConfig]) -> list[Check]:
    hints = []
    if "IS_IN_DB_MODEL_SERVING_ENV" in facts.container_env:  # what MLflow itself reads to know it serves on Databricks
        hints.append("Databricks Model Serving")
    if any(name.startswith(("DATABRICKS_", "DB_")) for name in facts.container_env):
        hints.append("Databricks (environment variables " + ", ".join(n for n in facts.container_env if n.startswith(("DATABRICKS_", "DB_")))[:300] + ")")
    if "KUBERNETES_SERVICE_HOST" in facts.container_env:
        hints.append("Kubernetes")
    limits = [f"cgroup memory.max {facts.cgroup_memory_max}" if facts.cgroup_memory_max else "",
              f"cpu.max {facts.cgroup_cpu_max}" if facts.cgroup_cpu_max else ""]  # fmt: skip
    detail = "; ".join([*hints, *[x for x in limits if x]]) or "no container hints"
    return [Check("container", "info", detail)]


HOST_CHECKS: tuple[Callable[[HostFacts, Sequence[EngineConfig]], list[Check]], ...] = (
    check_python,
    check_stack,
    check_driver,
    check_gpus,
    check_cuda_toolkit,
    check_shm,
    check_limits,
    check_disk,
    check_container,
)


def host_checks(facts: HostFacts, engines: Sequence[EngineConfig] = ()) -> list[Check]:
    return [check for function in HOST_CHECKS for check in function(facts, engines)]


def overall(checks: Sequence[Check]) -> Level:
    levels = {check.level for check in checks}
    return "error" if "error" in levels else "warning" if "warning" in levels else "ok"
