"""The doctor's report for people: one table of checks (rich where installed, plain text otherwise) and the
engines' start-up phases; and the JSON file for bug reports."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, TextIO

MARKS = {"ok": "ok", "info": "info", "warning": "WARN", "error": "ERROR"}
STYLES = {"ok": "green", "info": "dim", "warning": "yellow", "error": "bold red"}


def write_json(report: dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps(report, indent=2, sort_keys=True, default=str) + "\n")


def _phase_rows(run: dict[str, Any]) -> list[str]:
    rows, before = [], 0.0
    for phase, at in run["phases"].items():
        rows.append(f"    {phase:<24} at {at:7.2f} s  (+{at - before:.2f} s)")
        before = at
    return rows


def render(report: dict[str, Any], stream: TextIO) -> None:
    """Print the verdict, each check with its fix, and each engine run's phases."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        Console = None  # noqa: N806 (the plain-text fallback below)
    checks, runs = report["checks"], report["engines"]
    if Console is not None:
        console = Console(file=stream)
        table = Table(title=f"sglang-gateway doctor: {report['verdict']}", show_lines=False)
        for column in ("check", "", "what was found", "fix"):
            table.add_column(column, overflow="fold")
        for check in checks:
            table.add_row(check["name"], f"[{STYLES[check['level']]}]{MARKS[check['level']]}[/]", check["detail"], check["fix"])
        console.print(table)
        for run in runs:
            console.print(f"[bold]engine {run['model']}[/] ({'CUDA graphs on' if run['cuda_graph'] else 'CUDA graphs off'}):")
            console.print("\n".join(_phase_rows(run)) or "    (no phase seen)", highlight=False, markup=False)
        return
    stream.write(f"sglang-gateway doctor: {report['verdict']}\n")
    for check in checks:
        fix = f"  -> {check['fix']}" if check["fix"] else ""
        stream.write(f"{MARKS[check['level']]:<6} {check['name']}: {check['detail']}{fix}\n")
    for run in runs:
        stream.write(f"engine {run['model']} ({'CUDA graphs on' if run['cuda_graph'] else 'CUDA graphs off'}):\n")
        stream.write("\n".join(_phase_rows(run)) + "\n")
