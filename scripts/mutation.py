#!/usr/bin/env python3
"""`make mutation`: mutmut over the modules that decide without I/O, then a score per module.

Slow (minutes, one mutant at a time), so not part of `make test`. Idempotent:

* mutmut runs in its own virtual environment, ``.cache/mutation-venv`` (``MUTATION_VENV`` moves it), built on
  first use from the project's runtime dependencies plus :data:`TOOLS` and rebuilt when either changes. The
  project's own environment (``.venv``, keyed by scripts/bootstrap.sh) is neither used nor touched.
* every run starts from a fresh ``mutants/`` directory (mutmut's copy of the sources), so no result of an
  earlier run of older code is reused.

What is mutated and which tests judge the mutants live in one place, ``pyproject.toml``: ``[tool.mutmut]``
(``only_mutate``: the modules; ``pytest_add_cli_args_test_selection``: the pure unit tests) and
``[tool.mutation.functions]`` (a module of which only some functions are mutated). A moved module: change its
path there.

    python3 scripts/mutation.py                  # everything; exit 1 when the score is under --fail-under
    python3 scripts/mutation.py gateway/core/poison.py  # one module (paths as in only_mutate)
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOOLS = ["mutmut==3.8.1", "pytest>=8", "pytest-timeout>=2.3", "hypothesis>=6.100"]
"""Installed next to the project's runtime dependencies (the project itself is not installed: mutmut's
mutated copy under mutants/ must be the only ``gateway`` and ``launch`` the tests can import)."""
EXTRA_RUNTIME = ["orjson"]  # the gateway imports it; the main environment gets it from requirements/engine-cpu.txt
MAX_CHILDREN = 1  # one mutant at a time: the machines this runs on are shared
FAIL_UNDER = 85.0
SEPARATOR = "\u01c1"  # mutmut's class separator in mutant names: gateway.data.relay.xǁClassǁmethod__mutmut_1
KILLED = {1, 3}
SURVIVED = {0}
TIMEOUT = {36, 24, -24, 152, 255}
NO_TESTS = {5, 33}


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def targets(data: dict) -> dict[str, list[str] | None]:
    """Module path -> the functions mutated in it (None: all of them)."""
    modules = data["tool"]["mutmut"]["only_mutate"]
    functions = data.get("tool", {}).get("mutation", {}).get("functions", {})
    stray = sorted(set(functions) - set(modules))
    if stray:
        sys.exit(f"mutation: [tool.mutation.functions] names {stray}, which [tool.mutmut] only_mutate does not list")
    missing = [path for path in modules if not (ROOT / path).is_file()]
    if missing:
        sys.exit(f"mutation: [tool.mutmut] only_mutate lists {missing}, which do not exist (moved? update pyproject.toml)")
    return {path: functions.get(path) for path in modules}


def mutant_globs(path: str, functions: list[str] | None) -> list[str]:
    """mutmut's mutant-name patterns for a module (``gateway/data/relay.py`` -> ``gateway.data.relay.*``), or its functions."""
    module = path.removesuffix(".py").replace("/", ".")
    if functions is None:
        return [f"{module}.*"]
    globs = []
    for function in functions:
        owner, _, name = function.rpartition(".")
        mangled = f"x{SEPARATOR}{owner}{SEPARATOR}{name}" if owner else f"x_{name}"
        globs.append(f"{module}.{mangled}__mutmut_*")
    return globs


def venv_path() -> Path:
    return Path(os.environ.get("MUTATION_VENV") or ROOT / ".cache" / "mutation-venv")


def environment(data: dict) -> Path:
    """The mutation venv, built (or rebuilt) when the project's dependencies or :data:`TOOLS` changed."""
    venv = venv_path()
    requirements = [*data["project"]["dependencies"], *EXTRA_RUNTIME, *TOOLS]
    key = hashlib.sha256(json.dumps([sys.version_info[:2], requirements]).encode()).hexdigest()[:16]
    stamp = venv / ".mutation-key"
    if stamp.is_file() and stamp.read_text().strip() == key:
        return venv
    print(f"mutation: building {venv} (first run: a minute or two)", file=sys.stderr)
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "--disable-pip-version-check", "install", "-q"]
    installed = subprocess.run([*pip, *requirements], capture_output=True, text=True, check=False)
    # pip warns once per package about this machine's absent local indexes (as in scripts/bootstrap.sh): dropped
    noise = "is ignored: it is neither a file nor a directory"
    sys.stderr.write("".join(line for line in (installed.stdout + installed.stderr).splitlines(True) if noise not in line))
    if installed.returncode != 0:
        sys.exit(f"mutation: installing {requirements} into {venv} failed")
    stamp.write_text(key + "\n")
    return venv


def statuses(path: str) -> dict[str, int | None]:
    meta = ROOT / "mutants" / f"{path}.meta"
    return json.loads(meta.read_text())["exit_code_by_key"] if meta.is_file() else {}


@functools.cache
def _functions(module: str) -> dict[str, str]:
    """Every function of mutmut's copy of ``module`` (its original and mutated versions), by name."""
    import ast

    source = (ROOT / "mutants" / (module.replace(".", "/") + ".py")).read_text()
    lines = source.splitlines(True)
    return {
        node.name: "".join(lines[node.lineno - 1 : node.end_lineno])
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and "__mutmut_" in node.name
    }


def diff(mutant: str) -> str:
    """What ``mutant`` changed, as a unified diff of its function (what ``mutmut show`` prints, without a process each)."""
    import difflib

    module, _, name = mutant.rpartition(".")
    mangled = name.partition("__mutmut_")[0]
    functions = _functions(module)
    original = f"{mangled}__mutmut_orig"
    before = functions.get(original, "").replace(original, mangled, 1)
    after = functions.get(name, "").replace(name, mangled, 1)
    lines = difflib.unified_diff(before.splitlines(True), after.splitlines(True), f"{module} (original)", mutant, n=1)
    return "".join(lines) + "\n"


def report(chosen: dict[str, list[str] | None]) -> tuple[float, list[str]]:
    """Killed / survived / timeout per module and overall; returns the score and the survivors' names."""
    import fnmatch

    rows, survivors, total = [], [], {"killed": 0, "survived": 0, "timeout": 0, "no tests": 0, "other": 0}
    for path, functions in chosen.items():
        globs = mutant_globs(path, functions)
        counts = dict.fromkeys(total, 0)
        for name, code in sorted(statuses(path).items()):
            if not any(fnmatch.fnmatchcase(name, pattern) for pattern in globs):
                continue
            kind = ("killed" if code in KILLED else "survived" if code in SURVIVED else "timeout" if code in TIMEOUT
                    else "no tests" if code in NO_TESTS else "other")  # fmt: skip
            counts[kind] += 1
            if kind in ("survived", "no tests", "other"):
                survivors.append(f"{name} ({kind}, exit code {code})")
        for kind, count in counts.items():
            total[kind] += count
        rows.append((path + (" (SSE scanner only)" if functions else ""), counts))
    rows.append(("overall", total))
    print(f"\n{'module':44} {'mutants':>7} {'killed':>7} {'survived':>8} {'timeout':>7} {'no tests':>8} {'other':>5} {'score':>6}")
    score = 0.0
    for label, counts in rows:
        mutants = sum(counts.values())
        # a timeout is a mutant the tests caught (it made them hang), as mutmut itself counts it
        score = 100.0 * (counts["killed"] + counts["timeout"]) / mutants if mutants else 100.0
        print(f"{label:44} {mutants:7} {counts['killed']:7} {counts['survived']:8} {counts['timeout']:7} "
              f"{counts['no tests']:8} {counts['other']:5} {score:5.1f}%")  # fmt: skip
    return score, survivors


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("modules", nargs="*", help="only these modules (paths as in [tool.mutmut] only_mutate)")
    parser.add_argument("--fail-under", type=float, default=FAIL_UNDER, help="exit 1 under this score (%%)")
    parser.add_argument("--report-only", action="store_true", help="report the results of the last run")
    args = parser.parse_args()
    data = pyproject()
    everything = targets(data)
    unknown = [path for path in args.modules if path not in everything]
    if unknown:
        sys.exit(f"mutation: {unknown} not in [tool.mutmut] only_mutate: {list(everything)}")
    chosen = {path: everything[path] for path in args.modules} if args.modules else everything
    os.chdir(ROOT)
    if not args.report_only:
        venv = environment(data)
        shutil.rmtree(ROOT / "mutants", ignore_errors=True)
        globs = [pattern for path, functions in chosen.items() for pattern in mutant_globs(path, functions)]
        command = [str(venv / "bin" / "mutmut"), "run", "--max-children", str(MAX_CHILDREN), *globs]
        env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")}
        env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
        (ROOT / "mutants").mkdir()
        log = ROOT / "mutants" / "mutmut.log"
        print(f"mutation: {' '.join(command[:4])} <{len(globs)} patterns> (its output: {log.relative_to(ROOT)})", file=sys.stderr)
        with log.open("w") as out:
            run = subprocess.run(command, env=env, stdout=out, stderr=subprocess.STDOUT, check=False)
        if run.returncode != 0:
            print(log.read_text(errors="replace")[-4000:], file=sys.stderr)
            print(f"mutation: mutmut exited with {run.returncode}", file=sys.stderr)
            return run.returncode
    score, survivors = report(chosen)
    (ROOT / "mutants" / "survivors.txt").write_text("".join(f"{line}\n" for line in survivors))
    if survivors:
        print(f"\n{len(survivors)} not killed (in mutants/survivors.txt, their diffs in mutants/survivors.diff):")
        for line in survivors:
            print("  " + line)
        (ROOT / "mutants" / "survivors.diff").write_text("".join(diff(line.split()[0]) for line in survivors))
    if score < args.fail_under:
        print(f"\nmutation: score {score:.1f}% is under {args.fail_under:g}%", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
