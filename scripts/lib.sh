# Shell functions the environment scripts share (sourced by scripts/bootstrap.sh, scripts/bootstrap_engine.sh and
# scripts/bootstrap_frameworks.sh).

# pip prints a warning per package for this machine's absent local indexes: keep the log readable, keep pip's status.
# setuptools warns, once per build hook (three blocks on a first build), that pyproject.toml's
# [tool.setuptools.ext-modules] table is still experimental: a fact about setuptools, not news to whoever runs make.
# Filtered by its message's start in pip's environment (the build backend's process inherits it); every other
# warning and every error still shows (last in the list: it wins over a general filter of the caller's).
pip_quiet() {
  local rc
  set +e
  PYTHONWARNINGS="${PYTHONWARNINGS:+$PYTHONWARNINGS,}ignore:\`[tool.setuptools.ext-modules]\`" "$@" 2>&1 \
    | grep -v "is ignored: it is neither a file nor a directory"
  rc=${PIPESTATUS[0]}
  set -e
  return "$rc"
}

# requirements_venv NAME RECIPE REQUIREMENTS: the path of a side environment built from one requirements file, cached
# (SGLANG_GATEWAY_VENV_CACHE) under NAME and a hash of RECIPE (a line naming the recipe's version), the python
# version and the file. Used by the engine and framework environments (scripts/bootstrap_engine.sh,
# scripts/bootstrap_frameworks.sh).
requirements_venv() {
  local key
  key=$( { echo "$2"; "${PYTHON:-python3}" --version; cat "$3"; } | sha256sum | cut -c1-16)
  echo "${SGLANG_GATEWAY_VENV_CACHE:-$HOME/.cache/sglang-gateway}/$1-$key"
}

# build_requirements_venv VENV REQUIREMENTS: VENV made anew with a recent pip and REQUIREMENTS installed (quietly).
build_requirements_venv() {
  rm -rf "$1"
  mkdir -p "$(dirname "$1")"
  "${PYTHON:-python3}" -m venv "$1"
  pip_quiet "$1/bin/python" -m pip --disable-pip-version-check -q install --upgrade "pip>=24"
  pip_quiet "$1/bin/python" -m pip --disable-pip-version-check -q install -r "$2"
}
