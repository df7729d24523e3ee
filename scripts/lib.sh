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

# project_python: the interpreter every environment is built on. $PYTHON when set; else the distribution's CPython
# (/usr/bin/python3) when it can carry the project: 3.11 or 3.12 (the versions the GPU profiles publish wheels for),
# with venv and its C headers (the native modules build); else python3 from the PATH. The distribution's first because
# Debian's and Ubuntu's are built with profile-guided and link-time optimisation and linked statically, where a
# default source build (pyenv's, without --enable-optimizations) has neither: the same gateway spends ~10% less CPU
# per short request on it, its Python ~25-30% less (docs/development.md#the-interpreter).
project_python() {
  if [ -n "${PYTHON:-}" ]; then echo "$PYTHON"; return; fi
  if [ -x /usr/bin/python3 ] && /usr/bin/python3 -c '
import ensurepip, os, sys, sysconfig, venv
fits = (3, 11) <= sys.version_info[:2] <= (3, 12)
sys.exit(0 if fits and os.path.isfile(os.path.join(sysconfig.get_paths()["include"], "Python.h")) else 1)' 2>/dev/null; then
    echo /usr/bin/python3
  else
    echo python3
  fi
}

# python_identity PYTHON: what tells interpreters apart in an environment's cache key: its version and build (two builds
# of one version differ in speed and in what they link) and where it lives.
python_identity() {
  "$1" -c 'import sys; print(sys.version, sys.base_prefix)'
}

# requirements_venv NAME RECIPE REQUIREMENTS: the path of a side environment built from one requirements file, cached
# (SGLANG_GATEWAY_VENV_CACHE) under NAME and a hash of RECIPE (a line naming the recipe's version), the interpreter
# (project_python, by python_identity) and the file. Used by the engine and framework environments (scripts/bootstrap_engine.sh,
# scripts/bootstrap_frameworks.sh).
requirements_venv() {
  local key
  key=$( { echo "$2"; python_identity "$(project_python)"; cat "$3"; } | sha256sum | cut -c1-16)
  echo "${SGLANG_GATEWAY_VENV_CACHE:-$HOME/.cache/sglang-gateway}/$1-$key"
}

# build_requirements_venv VENV REQUIREMENTS: VENV made anew with a recent pip and REQUIREMENTS installed (quietly).
build_requirements_venv() {
  rm -rf "$1"
  mkdir -p "$(dirname "$1")"
  "$(project_python)" -m venv "$1"
  pip_quiet "$1/bin/python" -m pip --disable-pip-version-check -q install --upgrade "pip>=24"
  pip_quiet "$1/bin/python" -m pip --disable-pip-version-check -q install -r "$2"
}
