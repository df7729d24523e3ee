#!/usr/bin/env bash
# Build (once) and print the path of the agent frameworks' environment: the clients `make test-frameworks` points at
# a gateway (openai-agents, pydantic-ai, LangGraph, instructor, smolagents, LlamaIndex, AutoGen, DSPy...).
#
#   scripts/bootstrap_frameworks.sh    ->  ~/.cache/sglang-gateway/frameworks-<hash>/bin/python
#
# Apart from the main environment on purpose: the frameworks pin their own openai, anthropic, pydantic and httpx
# (openai-agents and llama-index disagree on openai 3; SGLang pins openai 2.x), and none of their pins may move the
# gateway's. Nothing of this checkout is installed there: the tests in tests_frameworks/ talk HTTP to a gateway that
# the main environment's `sglang-gateway serve` runs. Exact pins, the whole tree (requirements/frameworks/
# frameworks.txt); cached under a hash of that file and the interpreter: a second run prints the path in well
# under a second. Same cache as scripts/bootstrap.sh (SGLANG_GATEWAY_VENV_CACHE).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh
requirements=requirements/frameworks/frameworks.txt
# Bump FRAMEWORKS_RECIPE when a change to the install steps below must rebuild existing environments.
FRAMEWORKS_RECIPE=1
venv=$(requirements_venv frameworks "frameworks $FRAMEWORKS_RECIPE" "$requirements")
if [ ! -f "$venv/.complete" ]; then
  echo "bootstrap_frameworks: building the agent frameworks' environment in $venv (first run: about a minute)" >&2
  start=$(date +%s)
  build_requirements_venv "$venv" "$requirements"
  "$venv/bin/python" -m pip --disable-pip-version-check check >&2 \
    || { echo "bootstrap_frameworks: the environment has broken requirements (pip check above)" >&2; exit 1; }
  touch "$venv/.complete"
  echo "bootstrap_frameworks: ready in $(( $(date +%s) - start ))s, $(du -sh "$venv" | cut -f1)" >&2
fi
# Mark it used (scripts/bootstrap.sh drops only its own venv-* environments when stale).
touch "$venv/.complete"
echo "$venv/bin/python"
