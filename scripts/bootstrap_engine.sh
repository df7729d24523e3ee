#!/usr/bin/env bash
# Build (once) and print the path of an engine-only environment of another supported SGLang version, on CPU.
#
#   scripts/bootstrap_engine.sh 0.5.10.post1    ->  ~/.cache/sglang-gateway/engine-sglang-0.5.10.post1-<hash>/bin/python
#
# Only the engine runs there (`python -m sglang.launch_server`): the gateway, the tests and MLflow run in the main
# environment and point an engine at it with `engine.python:` or $SGLANG_GATEWAY_ENGINE_PYTHON. The recipe is the
# main CPU environment's: requirements/engines/sglang-<version>.txt (the version's Requires-Dist without its CUDA
# kernels, GPU tools and media extras), then sglang itself with --no-deps; launch/cpu_shim stands in for sgl_kernel.
# Cached under a hash of that file: a second run prints the path in well under a second.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh
version=${1:?usage: scripts/bootstrap_engine.sh SGLANG_VERSION}
requirements="requirements/engines/sglang-$version.txt"
if [ ! -f "$requirements" ]; then
  echo "bootstrap_engine: no $requirements: SGLang $version has no CPU engine recipe (see launch/sglang_versions.py)" >&2
  exit 2
fi
venv=$(requirements_venv "engine-sglang-$version" "engine 1 $version" "$requirements")
if [ ! -f "$venv/.complete" ]; then
  echo "bootstrap_engine: building the SGLang $version engine environment in $venv (first run: minutes)" >&2
  start=$(date +%s)
  build_requirements_venv "$venv" "$requirements"
  pip_quiet "$venv/bin/python" -m pip --disable-pip-version-check -q install --no-deps "sglang==$version"
  "$venv/bin/python" -c "from importlib.metadata import version; assert version('sglang') == '$version'" \
    || { echo "bootstrap_engine: sglang $version did not install" >&2; exit 1; }
  touch "$venv/.complete"
  echo "bootstrap_engine: ready in $(( $(date +%s) - start ))s, $(du -sh "$venv" | cut -f1)" >&2
fi
touch "$venv/.complete"
echo "$venv/bin/python"
