"""Checks run before launching an engine, each failing with a message that says what to do.

``preflight`` returns the engine config to launch (possibly adjusted: CUDA_HOME found, CUDA graphs
turned off, or NCCL's shared-memory transport turned off in a container with a tiny ``/dev/shm``,
each with a warning) and the findings; errors stop the launch. For ``device: cuda`` it also compares
the installed GPU stack profile (``launch.gpu_profiles``) with the CUDA version the NVIDIA driver
supports, so an old driver is named before the engine fails at its first kernel.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from loguru import logger

from launch.config import ConfigError, DeploymentConfig, EngineConfig, ModelEntry
from launch.gpu_profiles import driver_verdict, installed_profile, known_profiles
from launch.model_checks import GpuFacts, check_dtype, check_extra_flags, check_max_total_tokens, check_tokenizer
from launch.ports import port_is_free
from launch.replicas import replica_gpu_slices, visible_gpu_ids
from launch.sglang_versions import VERSIONS, facts, installed_sglang

_HF_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass(frozen=True)
class Finding:
    level: Literal["error", "warning", "info"]
    message: str


@dataclass
class PreflightResult:
    engine: EngineConfig
    findings: list[Finding] = field(default_factory=list)

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.level == "error"]

    @property
    def ok(self) -> bool:
        return not self.errors


class PreflightError(RuntimeError):
    """At least one preflight check failed; the message lists them, one per line."""


def check_model_path(engine: EngineConfig) -> list[Finding]:
    path = Path(engine.model_path).expanduser()
    if path.exists():
        if not path.is_dir():
            return [Finding("error", f"model_path {engine.model_path}: not a directory")]
        if not (path / "config.json").is_file() and not any(path.glob("*.gguf")):
            return [Finding("error", f"model_path {engine.model_path}: no config.json in this directory")]
        return []
    if engine.model_path.startswith(("/", "./", "../", "~")) or not _HF_ID.match(engine.model_path):
        return [Finding("error", f"model_path {engine.model_path}: no such directory, and not a Hugging Face id (org/name)")]
    return [Finding("info", f"model_path {engine.model_path}: not a local directory; SGLang will fetch it from the Hugging Face Hub")]


def check_port(engine: EngineConfig) -> list[Finding]:
    if engine.port and not port_is_free(engine.host, engine.port):
        return [Finding("error", f"port {engine.port} on {engine.host} is already in use (set port: 0 to pick a free one)")]
    return []


def _nvidia_smi(*args: str) -> str | None:
    """``nvidia-smi``'s standard output, or ``None`` when it is absent or fails."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        result = subprocess.run([smi, *args], capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return result.stdout if result.returncode == 0 else None


def visible_gpu_count() -> int:
    """GPUs this process may use: ``nvidia-smi -L`` narrowed by ``CUDA_VISIBLE_DEVICES``."""
    listing = _nvidia_smi("-L") or ""
    count = sum(1 for line in listing.splitlines() if line.startswith("GPU "))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        count = min(count, len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"]))
    return count


# "CUDA Version: 13.0" in the header (and "CUDA Version : 13.0" in -q) before R610; "CUDA UMD Version" since.
_DRIVER_CUDA = re.compile(r"CUDA (?:UMD )?Version\s*:\s*(\d+)\.(\d+)")


def parse_driver_cuda(nvidia_smi_output: str) -> tuple[int, int] | None:
    """The newest CUDA version the driver supports, read from ``nvidia-smi`` output (``None``: not shown, e.g. N/A)."""
    match = _DRIVER_CUDA.search(nvidia_smi_output)
    return (int(match[1]), int(match[2])) if match else None


def driver_cuda_version() -> tuple[int, int] | None:
    output = _nvidia_smi()
    return parse_driver_cuda(output) if output else None


_VERSIONS_SCRIPT = """
from importlib.metadata import PackageNotFoundError, version
for name in ("sglang", "torch"):
    try:
        print(version(name))
    except PackageNotFoundError:
        print("")
"""


def installed_stack(python: str) -> tuple[str, str] | None:
    """``(sglang, torch)`` versions installed for the engine's python (``""`` for one that is missing);
    ``None`` when that python cannot tell."""
    try:
        result = subprocess.run(
            [python, "-c", _VERSIONS_SCRIPT], capture_output=True, text=True, timeout=60, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = result.stdout.splitlines()
    return (lines[0], lines[1]) if result.returncode == 0 and len(lines) == 2 else None


def _cuda(version: tuple[int, int]) -> str:
    return f"{version[0]}.{version[1]}"


def check_gpu_stack(
    engine: EngineConfig, driver_cuda: tuple[int, int] | None, stack: tuple[str, str] | None
) -> list[Finding]:
    """Refuse a GPU stack profile the driver cannot run (naming the profile that runs on it and the driver the
    installed one needs); warn when it runs under minor-version compatibility, with that mode's limits."""
    if engine.device != "cuda":
        return []
    python = engine.python_executable
    if stack is None:
        return [
            Finding(
                "warning",
                f"python {python}: could not read its SGLang and torch versions, so the driver is not checked",
            )
        ]
    sglang, torch = stack
    if not sglang:
        return [
            Finding(
                "error",
                f"python {python}: SGLang is not installed (install a GPU stack: python launch/gpu_profiles.py requirements)",
            )
        ]
    profile = installed_profile(sglang, torch)
    if profile is None:
        return [
            Finding(
                "warning",
                f"python {python}: SGLang {sglang} with torch {torch or '(none)'} is no known GPU stack profile, so "
                f"the driver is not checked. Profiles: {known_profiles()}",
            )
        ]
    if driver_cuda is None:
        return [
            Finding(
                "warning",
                f"could not read the driver's CUDA version from nvidia-smi: GPU stack {profile.name} needs "
                f"CUDA {profile.cuda} (NVIDIA driver >= {profile.min_driver})",
            )
        ]
    verdict = driver_verdict(profile, driver_cuda)
    if verdict.support == "native":
        return []
    level = "warning" if verdict.runs else "error"
    return [
        Finding(level, f"the NVIDIA driver supports CUDA {_cuda(driver_cuda)} (SGLang {sglang}, torch {torch}): {verdict.message()}")
    ]


def check_gpus(engine: EngineConfig, gpu_count: int | None = None) -> list[Finding]:
    if engine.device != "cuda":
        return []
    gpus = visible_gpu_count() if gpu_count is None else gpu_count
    if gpus == 0:
        return [Finding("error", "device: cuda but no NVIDIA GPU is visible (use device: cpu for development)")]
    needed = -(-engine.tp_size * engine.dp_size // engine.nnodes)  # an engine spanning machines needs its share here
    if needed > gpus:
        spread = f" / nnodes {engine.nnodes}" if engine.nnodes > 1 else ""
        return [Finding("error", f"tp_size x dp_size{spread} = {needed} GPUs needed, {gpus} visible")]
    return []


def find_cuda_home(search_roots: list[str] | None = None) -> str | None:
    """A CUDA toolkit with ``bin/nvcc``: ``CUDA_HOME``, ``nvcc`` on PATH, pip ``nvidia-*`` packages, standard paths."""
    if os.environ.get("CUDA_HOME") and Path(os.environ["CUDA_HOME"], "bin", "nvcc").exists():
        return os.environ["CUDA_HOME"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        return str(Path(nvcc).resolve().parent.parent)
    roots = search_roots if search_roots is not None else _default_cuda_roots()
    for root in roots:
        for candidate in sorted(glob.glob(root), reverse=True):
            if Path(candidate, "bin", "nvcc").exists():
                return candidate
    return None


def _default_cuda_roots() -> list[str]:
    import site
    import sys

    site_dirs = [*site.getsitepackages(), str(Path(sys.executable).resolve().parent.parent / "lib")]
    pip_roots = [f"{d}/nvidia/cuda_nvcc" for d in site_dirs] + [f"{d}/nvidia/cu*" for d in site_dirs]
    return ["/usr/local/cuda", "/usr/local/cuda-*", "/opt/cuda", *pip_roots]


def check_cuda_home(engine: EngineConfig, cuda_home: str | None = None) -> tuple[EngineConfig, list[Finding]]:
    """CUDA graphs and FlashInfer's JIT need ``nvcc``; find the toolkit or turn graphs off, saying why."""
    if engine.device != "cuda" or "CUDA_HOME" in engine.env:
        return engine, []
    home = cuda_home if cuda_home is not None else find_cuda_home()
    if home:
        if os.environ.get("CUDA_HOME") == home:
            return engine, []
        env = {**engine.env, "CUDA_HOME": home}
        return engine.model_copy(update={"env": env}), [Finding("info", f"CUDA_HOME is unset; using the toolkit at {home}")]
    if engine.cuda_graph_enabled:
        return engine.model_copy(update={"cuda_graph": False, "cuda_graph_max_bs": None}), [
            Finding(
                "warning",
                "CUDA_HOME is unset and no CUDA toolkit (nvcc) was found: CUDA graphs are turned off "
                "(slower decoding). Install the toolkit or set CUDA_HOME / env.CUDA_HOME to keep them.",
            )
        ]
    return engine, [Finding("warning", "CUDA_HOME is unset and no nvcc was found: FlashInfer JIT kernels may fail to build")]


SHM_DIR = "/dev/shm"
SHM_RECOMMENDED_BYTES = 1 << 30  # NCCL's troubleshooting guide: docker run --shm-size=1g
SHM_TOO_SMALL_BYTES = 512 << 20  # below this, NCCL's shared-memory transport is turned off for the engine
NCCL_SHM_DISABLE = "NCCL_SHM_DISABLE"


def shm_size_bytes(path: str = SHM_DIR) -> int | None:
    """Size of the ``/dev/shm`` file system, or None when there is none."""
    try:
        stats = os.statvfs(path)
    except OSError:
        return None
    return stats.f_blocks * stats.f_frsize


def check_shm(engine: EngineConfig, shm_bytes: int | None = None) -> tuple[EngineConfig, list[Finding]]:
    """Tensor parallelism over NCCL needs ``/dev/shm``; containers often give it 64 MB.

    NCCL creates its shared-memory segments there and fails to initialise when they do not fit. Below
    512 MiB the engine gets ``NCCL_SHM_DISABLE=1`` (unless the variable is set already): NCCL then uses
    GPU peer-to-peer, or sockets where P2P is impossible, instead of host shared memory: slower there,
    but it starts. The remedy is a bigger ``/dev/shm``; the warning says how.
    """
    if engine.device != "cuda" or engine.tp_size < 2:
        return engine, []
    size = shm_size_bytes() if shm_bytes is None else shm_bytes
    if size is None or size >= SHM_RECOMMENDED_BYTES:
        return engine, []
    remedy = (
        f"/dev/shm is {size / (1 << 20):.0f} MiB and tp_size is {engine.tp_size}: NCCL needs shared memory "
        "between the tensor-parallel ranks. Give the container at least 1 GiB (docker run --shm-size=1g "
        "--ulimit memlock=-1, or --ipc=host; Kubernetes: an emptyDir with medium: Memory mounted at /dev/shm)"
    )
    user_set = NCCL_SHM_DISABLE in engine.env or NCCL_SHM_DISABLE in os.environ
    if size >= SHM_TOO_SMALL_BYTES or user_set:
        return engine, [Finding("warning", remedy + ".")]
    env = {**engine.env, NCCL_SHM_DISABLE: "1"}
    return engine.model_copy(update={"env": env}), [
        Finding(
            "warning",
            remedy + f"; until then the engine runs with {NCCL_SHM_DISABLE}=1 (slower where GPUs lack peer-to-peer).",
        )
    ]


def visible_gpus() -> list[GpuFacts]:
    """Compute capability and memory of each GPU this process may use (``CUDA_VISIBLE_DEVICES`` narrows them)."""
    listing = _nvidia_smi("--query-gpu=index,compute_cap,memory.total", "--format=csv,noheader,nounits") or ""
    return parse_gpu_facts(listing, os.environ.get("CUDA_VISIBLE_DEVICES"))


def parse_gpu_facts(listing: str, visible: str | None) -> list[GpuFacts]:
    """``nvidia-smi --query-gpu=index,compute_cap,memory.total --format=csv,noheader,nounits`` output, narrowed to
    the indexes of ``visible`` (``CUDA_VISIBLE_DEVICES``; None: all); unreadable lines are left out."""
    chosen = [d.strip() for d in visible.split(",") if d.strip()] if visible is not None else None
    found = []
    for line in listing.splitlines():
        parts = [part.strip() for part in line.split(",")]
        if len(parts) != 3 or (chosen is not None and parts[0] not in chosen):
            continue
        try:
            major, minor = (int(x) for x in parts[1].split(".")[:2])
            found.append(GpuFacts((major, minor), int(float(parts[2]))))
        except ValueError:
            continue
    return found


def check_engine_facts(engine: EngineConfig, gpus: list[GpuFacts] | None, python_ok: bool) -> list[Finding]:
    """What the engine would fail on (or quietly shrink) at start: its tokenizer, dtype, KV-cache size and
    extra flags (:mod:`launch.model_checks`)."""
    findings = [Finding("error", message) for message in check_tokenizer(engine)]
    if engine.device == "cuda" and gpus is None:
        gpus = visible_gpus()
    findings += [Finding("error", message) for message in check_dtype(engine, gpus)]
    findings += [Finding("warning", message) for message in check_max_total_tokens(engine, gpus)]
    if engine.extra_args and python_ok:
        sglang = installed_sglang(engine.python_executable)
        if sglang in VERSIONS:
            flags = facts(sglang)["flags"]
            findings += [Finding("error", message) for message in check_extra_flags(engine, flags if isinstance(flags, list) else None, sglang)]
    return findings


def check_python(engine: EngineConfig) -> list[Finding]:
    python = engine.python_executable
    if not (Path(python).is_file() or shutil.which(python)):
        return [Finding("error", f"python {python}: no such executable")]
    return []


def preflight(
    engine: EngineConfig,
    *,
    gpu_count: int | None = None,
    cuda_home: str | None = None,
    driver_cuda: tuple[int, int] | None = None,
    shm_bytes: int | None = None,
    gpus: list[GpuFacts] | None = None,
) -> PreflightResult:
    """Run every check; the returned engine is the one to launch.

    ``gpu_count``, ``cuda_home``, ``driver_cuda``, ``shm_bytes`` and ``gpus`` replace what would be detected
    (tests, or a caller that knows).
    """
    adjusted, cuda_findings = check_cuda_home(engine, cuda_home) if engine.device == "cuda" else (engine, [])
    adjusted, shm_findings = check_shm(adjusted, shm_bytes)
    python_findings = check_python(engine)
    stack_findings: list[Finding] = []
    if engine.device == "cuda" and not python_findings:
        driver = driver_cuda if driver_cuda is not None else driver_cuda_version()
        stack_findings = check_gpu_stack(engine, driver, installed_stack(engine.python_executable))
    findings = [
        *python_findings,
        *(model_findings := check_model_path(engine)),
        *(check_engine_facts(engine, gpus, not python_findings) if not any(f.level == "error" for f in model_findings) else []),
        *check_port(engine),
        *check_gpus(engine, gpu_count),
        *cuda_findings,
        *stack_findings,
        *shm_findings,
    ]
    return PreflightResult(adjusted, findings)


def require(result: PreflightResult, name: str) -> EngineConfig:
    """The engine to launch, or :class:`PreflightError` listing every failed check for model ``name``.

    Warnings and notes are logged (the launch goes on): they say what was adjusted and why.
    """
    if not result.ok:
        raise PreflightError("\n".join(f"model {name}: {f.message}" for f in result.errors))
    for finding in result.findings:
        logger.log("WARNING" if finding.level == "warning" else "INFO", "model {}: {}", name, finding.message)
    return result.engine


def check_replicas(name: str, entry: ModelEntry, gpu_count: int | None = None) -> list[Finding]:
    """A model's replicas must fit the visible GPUs (each ``tp_size x dp_size`` of its own)."""
    if entry.engine is None or entry.engine.device != "cuda" or (entry.replicas == 1 and entry.replica_gpus is None):
        return []
    count = visible_gpu_count() if gpu_count is None else gpu_count
    try:
        replica_gpu_slices(entry, visible_gpu_ids(count))
    except ConfigError as error:
        return [Finding("error", str(error))]
    return []


def preflight_all(deployment: DeploymentConfig) -> None:
    """Preflight every managed model (and that its replicas fit the GPUs); PreflightError naming each problem."""
    problems: list[str] = []
    for name, entry in deployment.models.items():
        if entry.engine is None:
            continue
        problems += [f"model {name}: {finding.message}" for finding in check_replicas(name, entry) if finding.level == "error"]
        try:
            require(preflight(entry.engine), name)
        except PreflightError as error:
            problems.append(str(error))
    if problems:
        raise PreflightError("\n".join(problems))
