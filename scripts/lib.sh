# Shell functions the environment scripts share (sourced by scripts/bootstrap.sh and scripts/bootstrap_engine.sh).

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
