"""What a host is, read without starting anything: OS, Python, glibc, the GPU stack installed for the engine's
python, the NVIDIA driver and GPUs (``nvidia-smi``), the CUDA toolkit, ``/dev/shm``, limits, disk, container hints.

Every reading is a plain value (``None`` when the host cannot tell) so that the checks (:mod:`launch.doctor.checks`)
and the JSON report see the same facts. Nothing secret is read: of the environment, only variable names.
"""

from __future__ import annotations

import os
import platform
import re
import resource
import shutil
import signal
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from launch.procgroup import signal_group

STACK_PACKAGES = ("sglang", "torch", "sglang-kernel", "sgl-kernel", "flashinfer-python", "flashinfer-jit-cache")
_STACK_SCRIPT = (
    "import json\nfrom importlib.metadata import PackageNotFoundError, version\nfound = {}\n"
    f"for name in {list(STACK_PACKAGES)!r}:\n"
    "    try:\n        found[name] = version(name)\n    except PackageNotFoundError:\n        pass\n"
    "print(json.dumps(found))\n"
)
# Environment variable prefixes that say which platform runs the host (names only ever leave it).
CONTAINER_HINTS = ("IS_IN_DB_MODEL_SERVING_ENV", "DATABRICKS_", "DB_", "MLFLOW_", "KUBERNETES_SERVICE_HOST", "NVIDIA_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")
_GPU_QUERY = "index,name,compute_cap,memory.total,memory.free,driver_version"
_NVCC_RELEASE = re.compile(r"release (\d+)\.(\d+)")


@dataclass
class Gpu:
    index: int
    name: str
    compute_capability: str
    memory_total_mib: int | None
    memory_free_mib: int | None


@dataclass
class HostFacts:
    os: str
    python: str
    glibc: str | None
    engine_python: str
    stack: dict[str, str]  # installed versions of STACK_PACKAGES for the engine's python
    nvidia_smi: bool
    driver_version: str | None
    driver_cuda: str | None  # the newest CUDA the driver supports, as nvidia-smi says ("13.0")
    gpus: list[Gpu] = field(default_factory=list)
    gpu_processes: list[dict[str, Any]] = field(default_factory=list)
    cuda_home: str | None = None
    nvcc_cuda: str | None = None
    shm_bytes: int | None = None
    open_files: tuple[int, int] | None = None  # soft, hard (-1: unlimited)
    locked_memory: tuple[int, int] | None = None
    hf_cache: str | None = None
    hf_cache_bytes: int | None = None
    free_disk_bytes: int | None = None
    container_env: list[str] = field(default_factory=list)
    cgroup_memory_max: str | None = None
    cgroup_cpu_max: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def run(command: list[str], timeout_s: float = 20) -> str | None:
    """A command's standard output, or None when it is absent, fails or hangs. It runs in a process group of its
    own: one that hangs (``nvidia-smi`` on a wedged driver) is killed with everything it started, not left behind."""
    if shutil.which(command[0]) is None:
        return None
    try:
        child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    except OSError:
        return None
    with child:
        try:
            stdout, _ = child.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            signal_group(child.pid, signal.SIGKILL)
            child.wait()
            return None
    return stdout if child.returncode == 0 else None


def installed_stack(python: str) -> dict[str, str]:
    """The GPU stack's installed versions for ``python`` (empty when it cannot tell)."""
    output = run([python, "-c", _STACK_SCRIPT], timeout_s=60)
    if not output:
        return {}
    import json

    try:
        found = json.loads(output.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {}
    return {str(k): str(v) for k, v in found.items()} if isinstance(found, dict) else {}


def _int(text: str) -> int | None:
    try:
        return int(float(text.strip()))
    except ValueError:
        return None


def parse_gpus(csv: str) -> list[Gpu]:
    """``nvidia-smi --query-gpu=<_GPU_QUERY> --format=csv,noheader,nounits`` -> one :class:`Gpu` per line."""
    gpus = []
    for line in csv.strip().splitlines():
        cells = [cell.strip() for cell in line.split(",")]
        if len(cells) >= 5 and cells[0].isdigit():
            gpus.append(Gpu(int(cells[0]), cells[1], cells[2], _int(cells[3]), _int(cells[4])))
    return gpus


def parse_driver(csv: str) -> str | None:
    lines = [line.split(",") for line in csv.strip().splitlines() if line.strip()]
    return lines[0][-1].strip() if lines and len(lines[0]) >= 6 else None


def parse_gpu_processes(csv: str) -> list[dict[str, Any]]:
    processes = []
    for line in csv.strip().splitlines():
        cells = [cell.strip() for cell in line.split(",")]
        if len(cells) == 3 and cells[0].isdigit():
            processes.append({"pid": int(cells[0]), "name": cells[1], "used_mib": _int(cells[2])})
    return processes


def nvcc_cuda(cuda_home: str | None) -> str | None:
    """The CUDA release of the toolkit's ``nvcc`` (``"12.4"``)."""
    nvcc = str(Path(cuda_home, "bin", "nvcc")) if cuda_home else "nvcc"
    output = run([nvcc, "--version"])
    match = _NVCC_RELEASE.search(output or "")
    return f"{match[1]}.{match[2]}" if match else None


def glibc() -> str | None:
    try:
        return os.confstr("CS_GNU_LIBC_VERSION").split()[-1]
    except (ValueError, OSError, AttributeError, IndexError):
        return None


def _limit(which: int) -> tuple[int, int] | None:
    try:
        return resource.getrlimit(which)
    except (ValueError, OSError):
        return None


def _directory_bytes(path: Path, cap_files: int = 200_000) -> int | None:
    """Bytes under ``path`` (stops counting after ``cap_files`` files: a huge cache is big enough to say so)."""
    if not path.exists():
        return None
    total = 0
    for count, (root, _dirs, files) in enumerate(os.walk(path)):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
        if count > cap_files:
            break
    return total


def hf_cache_dir() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return Path(home) / "hub"


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def read_host(engine_python: str | None = None, model_dirs: tuple[str, ...] = ()) -> HostFacts:
    """Read every fact of this host (seconds: a few ``nvidia-smi`` calls and one of the engine's python)."""
    from launch.preflight import find_cuda_home, parse_driver_cuda

    python = engine_python or sys.executable
    header = run(["nvidia-smi"])
    query = run(["nvidia-smi", f"--query-gpu={_GPU_QUERY}", "--format=csv,noheader,nounits"]) or ""
    apps = run(["nvidia-smi", "--query-compute-apps=pid,process_name,used_memory", "--format=csv,noheader,nounits"]) or ""
    cuda = parse_driver_cuda(header or "")
    cuda_home = find_cuda_home()
    cache = hf_cache_dir()
    disk_of = next((Path(d) for d in model_dirs if Path(d).exists()), cache if cache.exists() else Path.home())
    try:
        free = shutil.disk_usage(disk_of).free
    except OSError:
        free = None
    shm = None
    try:
        stats = os.statvfs("/dev/shm")
        shm = stats.f_blocks * stats.f_frsize
    except OSError:
        pass
    return HostFacts(
        os=f"{platform.system()} {platform.release()} ({_os_name()})",
        python=platform.python_version(),
        glibc=glibc(),
        engine_python=python,
        stack=installed_stack(python),
        nvidia_smi=header is not None,
        driver_version=parse_driver(query),
        driver_cuda=f"{cuda[0]}.{cuda[1]}" if cuda else None,
        gpus=parse_gpus(query),
        gpu_processes=parse_gpu_processes(apps),
        cuda_home=cuda_home,
        nvcc_cuda=nvcc_cuda(cuda_home) if cuda_home or shutil.which("nvcc") else None,
        shm_bytes=shm,
        open_files=_limit(resource.RLIMIT_NOFILE),
        locked_memory=_limit(resource.RLIMIT_MEMLOCK),
        hf_cache=str(cache),
        hf_cache_bytes=_directory_bytes(cache),
        free_disk_bytes=free,
        container_env=sorted(name for name in os.environ if name.startswith(CONTAINER_HINTS)),
        cgroup_memory_max=_read("/sys/fs/cgroup/memory.max"),
        cgroup_cpu_max=_read("/sys/fs/cgroup/cpu.max"),
    )


def _os_name() -> str:
    text = _read("/etc/os-release") or ""
    match = re.search(r'^PRETTY_NAME="?([^"\n]*)"?', text, re.MULTILINE)
    return match[1] if match else "unknown"
