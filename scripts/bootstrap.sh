#!/usr/bin/env bash
# Create or refresh the project's virtual environment, idempotently.
#
# The environment lives in a cache keyed by a hash of everything that decides its contents
# (pyproject.toml, requirements/*.txt, this script, the GPU/CPU flavour), so a second run, or
# another clone of the repository on the same machine, reuses it in seconds. `.venv` in the
# repository is a symlink to it.
#
#   GPU machine (nvidia-smi sees a GPU): one GPU stack profile of launch/gpu_profiles.py, pinned
#     (SGLang, torch, sglang-kernel, FlashInfer wheels); SGLANG_GATEWAY_GPU_PROFILE=name picks one.
#   Otherwise: SGLang without its CUDA-only kernels (requirements/engine-cpu.txt + sglang --no-deps).
# Override with SGLANG_GATEWAY_FLAVOR=cpu|gpu, the location with SGLANG_GATEWAY_VENV_CACHE.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)

python=${PYTHON:-python3}
flavor=${SGLANG_GATEWAY_FLAVOR:-}
if [ -z "$flavor" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then flavor=gpu; else flavor=cpu; fi
fi
case "$flavor" in cpu|gpu) ;; *) echo "bootstrap: SGLANG_GATEWAY_FLAVOR must be cpu or gpu, got '$flavor'" >&2; exit 2;; esac

# The GPU stack's requirement lines; an unknown profile or a python it has no wheels for stops here.
gpu_stack=""
if [ "$flavor" = gpu ]; then
  gpu_stack=$("$python" launch/gpu_profiles.py requirements --profile "${SGLANG_GATEWAY_GPU_PROFILE:-}") || {
    echo "bootstrap: no GPU environment built (see the line above)" >&2
    exit 2
  }
fi

# Only what decides the environment's contents goes into the key (not pytest or ruff settings).
deps=$("$python" -c 'import tomllib, json; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; print(json.dumps([p["dependencies"], p["optional-dependencies"]], sort_keys=True))')
# Bump ENV_RECIPE when a change to the install steps below must rebuild existing environments.
ENV_RECIPE=1
key=$( {
  echo "$flavor $ENV_RECIPE"; "$python" --version; echo "$deps"; cat requirements/*.txt
  if [ "$flavor" = gpu ]; then echo "$gpu_stack"; fi
} | sha256sum | cut -c1-16)
cache=${SGLANG_GATEWAY_VENV_CACHE:-$HOME/.cache/sglang-gateway}
venv="$cache/venv-$flavor-$key"

# sglang's requirements that the CPU environment leaves out on purpose: PyPI has only CUDA builds of its
# kernels and GPU tools (they fail to import without a GPU driver; launch/cpu_shim stands in for the two ops
# a CPU engine calls), and a text server never imports its media, dataset and training extras.
cpu_left_out_gpu="cuda-python flash-attn-4 flashinfer-python humming-kernels kernels nvidia-cutlass-dsl nvidia-mathdx
  nvshmem4py-cu13 quack-kernels sgl-deep-ep sgl-deep-gemm sgl-flash-mla sglang-kernel tilelang torch-memory-saver"
cpu_left_out_extras="build datasets deepseek-recipe modelscope smg-grpc-servicer timm tml-renderers torchaudio torchcodec"

# Say once what the CPU environment leaves out and why; fail on any other broken requirement `pip check` finds.
check_cpu_environment() {
  local names problems
  names=$(echo $cpu_left_out_gpu $cpu_left_out_extras | tr ' ' '|')
  problems=$("$venv/bin/python" -m pip check 2>&1 \
    | grep -vE "^No broken requirements found|^sglang [^ ]+ requires ($names), which is not installed\.$" || true)
  if [ -n "$problems" ]; then
    echo "bootstrap: the new environment has broken requirements (pip check):" >&2
    echo "$problems" >&2
    return 1
  fi
  echo "bootstrap: CPU environment: left out of sglang's requirements on purpose, its CUDA-only kernels and GPU tools" >&2
  echo "  ($(echo $cpu_left_out_gpu | sed 's/ /, /g')): no CPU builds exist;" >&2
  echo "  and its media, dataset and training extras ($(echo $cpu_left_out_extras | sed 's/ /, /g')): a text server does not use them." >&2
}

# pip prints a warning per package for this machine's absent local indexes: keep the log readable.
pip_quiet() {
  local rc
  set +e
  "$@" 2>&1 | grep -v "is ignored: it is neither a file nor a directory"
  rc=${PIPESTATUS[0]}
  set -e
  return "$rc"
}

if [ ! -f "$venv/.complete" ]; then
  echo "bootstrap: building the $flavor environment in $venv (first run: several minutes)" >&2
  start=$(date +%s)
  rm -rf "$venv"
  mkdir -p "$cache"
  "$python" -m venv "$venv"
  pip=(pip_quiet "$venv/bin/python" -m pip --disable-pip-version-check)
  "${pip[@]}" install -q --upgrade "pip>=24" "setuptools>=77" wheel
  if [ "$flavor" = gpu ]; then
    echo "$gpu_stack" > "$venv/gpu-stack.txt"  # kept: what this environment was built from
    "${pip[@]}" install -q -r "$venv/gpu-stack.txt" "$root[mlflow,dev]"
  else
    "${pip[@]}" install -q -r requirements/engine-cpu.txt
    "${pip[@]}" install -q --no-deps "sglang==0.5.23"
    # pip would list sglang's deliberately absent requirements as "dependency conflicts": checked below instead
    "${pip[@]}" install -q --no-warn-conflicts "$root[mlflow,dev]"
  fi
  "${pip[@]}" uninstall -q -y sglang-gateway
  if [ "$flavor" = cpu ]; then check_cpu_environment; fi
  touch "$venv/.complete"
  echo "bootstrap: environment ready in $(( $(date +%s) - start ))s, $(du -sh "$venv" | cut -f1)" >&2
fi

# Mark it used, and drop environments of this cache that no run has used for a week.
touch "$venv/.complete"
find "$cache" -maxdepth 2 -name .complete -path "$cache/venv-*" -mtime +7 2>/dev/null | while read -r stale; do
  rm -rf "$(dirname "$stale")"
done

# Point .venv at it, and install this checkout (editable, no dependencies: seconds) if it is not the one installed.
# -qq: setuptools' notice that an editable install is one is not news here; errors still show and fail.
if [ "$(readlink .venv 2>/dev/null)" != "$venv" ]; then
  rm -rf .venv
  ln -s "$venv" .venv
fi
# Asked from / : run from the checkout, `import launch` would find the checkout itself, installed or not.
installed=$(cd / && "$venv/bin/python" -c 'import launch, os; print(os.path.dirname(os.path.dirname(os.path.abspath(launch.__file__))))' 2>/dev/null || true)
if [ "$installed" != "$root" ] || [ ! -x "$venv/bin/sglang-gateway" ]; then
  pip_quiet "$venv/bin/python" -m pip --disable-pip-version-check install -qq --no-deps --no-build-isolation -e "$root"
fi
