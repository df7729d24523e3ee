#!/usr/bin/env bash
# Create or refresh the project's virtual environment, idempotently.
#
# The dependencies live in a shared environment, cached under a hash of everything that decides its
# contents (pyproject.toml's dependency lists, requirements/*.txt, the interpreter (scripts/lib.sh: project_python), the GPU/CPU
# flavour), so a second run, or another clone of the repository on the same machine, reuses it in
# seconds. It holds dependencies only, never this project. `.venv` in the checkout is a small
# environment of the checkout's own, layered on the shared one (a .pth file puts the shared
# site-packages on its path): the checkout is installed there (editable), so no checkout ever runs
# another's code, and deleting one breaks no other. `scripts/bootstrap.sh --where` prints the shared
# environment's path and builds nothing.
#
#   GPU machine (nvidia-smi sees a GPU): one GPU stack profile of launch/gpu_profiles.py, pinned
#     (SGLang, torch, sglang-kernel, FlashInfer wheels); SGLANG_GATEWAY_GPU_PROFILE=name picks one.
#   Otherwise: SGLang without its CUDA-only kernels (requirements/engine-cpu.txt + sglang --no-deps).
# Override with SGLANG_GATEWAY_FLAVOR=cpu|gpu, the location with SGLANG_GATEWAY_VENV_CACHE.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)

# pip_quiet and project_python (the interpreter: $PYTHON, else the distribution's optimised CPython, else python3).
source "$root/scripts/lib.sh"
python=$(project_python)
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
  echo "$flavor $ENV_RECIPE"; python_identity "$python"; echo "$deps"; cat requirements/*.txt
  if [ "$flavor" = gpu ]; then echo "$gpu_stack"; fi
} | sha256sum | cut -c1-16)
cache=${SGLANG_GATEWAY_VENV_CACHE:-$HOME/.cache/sglang-gateway}
venv="$cache/venv-$flavor-$key"
if [ "${1:-}" = --where ]; then echo "$venv"; exit 0; fi

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

# An environment cached before checkouts had a .venv of their own has one checkout installed in it (editable,
# pointing at whichever ran `make` last): take it out, so that the shared environment holds dependencies only.
cache_site=$(echo "$venv"/lib/python3*/site-packages)
for dist in "$cache_site"/sglang_gateway-*.dist-info; do
  [ -d "$dist" ] || continue
  was=$(sed -n 's|.*"url": *"file://\([^"]*\)".*|\1|p' "$dist/direct_url.json" 2>/dev/null || true)
  echo "bootstrap: uninstalling sglang-gateway${was:+ (of $was)} from the shared environment $venv: each checkout now installs itself in its own .venv" >&2
  pip_quiet "$venv/bin/python" -m pip --disable-pip-version-check uninstall -q -y sglang-gateway
  break
done

# Mark it used, and drop environments of this cache that no run has used for a week.
touch "$venv/.complete"
find "$cache" -maxdepth 2 -name .complete -path "$cache/venv-*" -mtime +7 2>/dev/null | while read -r stale; do
  rm -rf "$(dirname "$stale")"
done

# .venv: this checkout's own environment on top of the shared one (seconds to build). Rebuilt when what it was
# built from changed (the shared environment, even one rebuilt under the same path; the checkout's path; the
# steps below: bump LAYER_RECIPE) or when it no longer finds this checkout's code.
LAYER_RECIPE=1
layer="recipe $LAYER_RECIPE, on $venv (created $(stat -c %y "$venv/pyvenv.cfg")), for $root"
# The .venv of before was a symlink to the shared environment: remove the link, never what it points to.
if [ -L .venv ]; then rm .venv; fi
layer_ok() {
  [ "$(cat .venv/.layer 2>/dev/null)" = "$layer" ] && [ -x .venv/bin/sglang-gateway ] || return 1
  # -I: what .venv itself finds; the current directory (the checkout, installed or not) or a PYTHONPATH would answer.
  # Every top-level package: an editable install maps the packages it was made with (a new one needs a rebuild).
  for package in gateway engine_guard; do
    [ "$(.venv/bin/python -I -c "import importlib.util as u; print(u.find_spec('$package').origin)" 2>/dev/null)" \
      = "$root/$package/__init__.py" ] || return 1
  done
}
if ! layer_ok; then
  rm -rf .venv
  # The shared environment's interpreter gives the same base python; no pip of its own: the shared one serves.
  "$venv/bin/python" -m venv --without-pip .venv
  # addsitedir, not a bare path line: the shared site-packages' own .pth files run too (setuptools' distutils
  # shim). site.PREFIXES: site.getsitepackages() names it as well, where tools look for files of installed
  # packages (cuda-python's library finder, launch/preflight.py's CUDA toolkit search, torch's profiler). The
  # name sorts after the checkout's own __editable__ .pth: its code comes first, even before a checkout's
  # install that an older bootstrap put back into the shared environment.
  .venv/bin/python - "$venv" "$cache_site" <<'EOF'
import sys, sysconfig
prefix, site_dir = sys.argv[1:]
with open(f"{sysconfig.get_path('purelib')}/_shared_environment.pth", "w") as pth:
    pth.write(f"import site; site.PREFIXES.append({prefix!r}); site.addsitedir({site_dir!r})\n")
EOF
  # The shared environment's commands (pytest, ruff, mlflow, ...) as .venv/bin/<name>, run by .venv's python so
  # that they see this checkout: a script started by the shared python is copied with .venv's python instead (in
  # pip's /bin/sh form past the kernel's 127-byte #! limit); anything else is linked.
  .venv/bin/python - "$venv/bin" "$root/.venv/bin" <<'EOF'
import os, sys
shared, own = sys.argv[1:]
old, new = f"{shared}/python", f"{own}/python"
for name in sorted(os.listdir(shared)):
    source, target = f"{shared}/{name}", f"{own}/{name}"
    if name.startswith(("activate", "Activate", "python")) or os.path.lexists(target) or not os.path.isfile(source):
        continue
    with open(source, "rb") as f:
        lines = (b"#!" + f.read() if f.read(2) == b"#!" else b"").split(b"\n")  # binaries (ruff) are not read
    sh_form = len(lines) > 3 and lines[0] == b"#!/bin/sh" and lines[2] == b"' '''"
    if lines[0].startswith(f"#!{old}".encode()):
        body = lines[1:]
    elif sh_form and lines[1].startswith(f"'''exec' \"{old}".encode()):
        body = lines[3:]
    else:
        os.symlink(source, target)
        continue
    launcher = [f"#!{new}"] if len(new) < 126 else ["#!/bin/sh", f"'''exec' \"{new}\" \"$0\" \"$@\"", "' '''"]
    with open(target, "wb") as f:
        f.write(b"\n".join([line.encode() for line in launcher] + body))
    os.chmod(target, 0o755)
EOF
  # -qq: setuptools' notice that an editable install is one is not news here; errors still show and fail.
  pip_quiet .venv/bin/python -m pip --disable-pip-version-check install -qq --no-deps --no-build-isolation -e "$root"
  echo "$layer" > .venv/.layer
  layer_ok || { echo "bootstrap: .venv was built but does not find this checkout's code ($root/gateway)" >&2; exit 1; }
fi

# The native modules (the stream relay, gateway/data/_relay_loop.c; the request guard's walks, engine_guard/_walk.c) are
# compiled in place by the editable install above: compile them again when a source is newer than its built module (a
# pull, a branch switch), or when one is missing and a C compiler is here (an install without one runs their Python
# definitions, and the gateway says so at startup for the relay).
native_stale() {  # $1: the module's source, without .c
  local built
  built=$(ls "$1".*.so 2>/dev/null | head -1 || true)
  { [ -n "$built" ] && [ "$1.c" -nt "$built" ]; } || { [ -z "$built" ] && command -v cc >/dev/null 2>&1; }
}
if native_stale gateway/data/_relay_loop || native_stale engine_guard/_walk; then
  .venv/bin/python -c 'from setuptools import setup; setup()' -q build_ext --inplace --force >/dev/null 2>&1 || true
  ls gateway/data/_relay_loop.*.so >/dev/null 2>&1 \
    || echo "bootstrap: the native stream relay (gateway/data/_relay_loop.c) did not build: streams will be relayed in Python" >&2
  ls engine_guard/_walk.*.so >/dev/null 2>&1 \
    || echo "bootstrap: the request guard's native walks (engine_guard/_walk.c) did not build: they run in Python" >&2
fi
