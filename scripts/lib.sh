# Shell functions the environment scripts share (sourced by scripts/bootstrap.sh and scripts/bootstrap_engine.sh).

# pip prints a warning per package for this machine's absent local indexes: keep the log readable, keep pip's status.
pip_quiet() {
  local rc
  set +e
  "$@" 2>&1 | grep -v "is ignored: it is neither a file nor a directory"
  rc=${PIPESTATUS[0]}
  set -e
  return "$rc"
}
