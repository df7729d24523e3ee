"""The gateway the frameworks talk to, and the matrix printed at the end.

The gateway runs from the main environment (``.venv/bin/sglang-gateway serve configs/smollm2-cpu.yaml``) as a
subprocess of its own process group, on a free port, with one SmolLM2 engine for the whole session; the frameworks run
here, in their own environment, and only talk HTTP to it. ``SGLANG_GATEWAY_URL`` points the tests at a gateway already
running instead (nothing is started or stopped then)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from common import CAPABILITIES, GATEWAY_PENDING, MODEL_LIMITED

# LiteLLM (DSPy's fallback) and DSPy fetch a model catalogue from GitHub at import, retrying for seconds when offline:
# their bundled copy serves.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

ROOT = Path(__file__).resolve().parent.parent
GATEWAY_BIN = Path(os.environ.get("SGLANG_GATEWAY_BIN", ROOT / ".venv/bin/sglang-gateway"))
CONFIG = Path(os.environ.get("SGLANG_GATEWAY_FRAMEWORKS_CONFIG", ROOT / "configs/smollm2-cpu.yaml"))
READY_TIMEOUT_S = 600.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the whole group (the gateway stops its engine), SIGKILL to whatever is left after a minute."""
    for sig, wait_s in ((signal.SIGTERM, 60), (signal.SIGKILL, 10)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(wait_s)
        except subprocess.TimeoutExpired:
            continue
        try:  # the gateway is gone; its engine's children may not be
            os.killpg(process.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(1)


@pytest.fixture(scope="session")
def gateway_url() -> Iterator[str]:
    if url := os.environ.get("SGLANG_GATEWAY_URL"):
        yield url.rstrip("/")
        return
    if not GATEWAY_BIN.exists():
        pytest.exit(f"no gateway at {GATEWAY_BIN}: run `make env` (the main environment) first", returncode=2)
    port = _free_port()
    with tempfile.TemporaryFile() as log:
        process = subprocess.Popen(
            [str(GATEWAY_BIN), "serve", str(CONFIG), "--port", str(port)],
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + READY_TIMEOUT_S
            while True:
                if process.poll() is not None:
                    log.seek(0)
                    pytest.exit(
                        f"the gateway exited ({process.returncode}):\n{log.read().decode()[-4000:]}", returncode=1
                    )
                try:
                    if httpx.get(url + "/ready", timeout=5).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    pytest.exit(f"the gateway was not ready in {READY_TIMEOUT_S:.0f}s", returncode=1)
                time.sleep(1)
            yield url
        finally:
            _stop(process)


# The matrix: one row per framework (and API), one column per capability; filled from each test's `matrix` mark.
_cells: dict[tuple[str, str], str] = {}
_rows: list[str] = []
_started = time.monotonic()


def _outcome(report: pytest.TestReport) -> str:
    reason = getattr(report, "wasxfail", "")
    if report.skipped and reason:  # an xfail that failed
        return (
            "model-limited"
            if reason.startswith(MODEL_LIMITED)
            else "gateway-pending"
            if reason.startswith(GATEWAY_PENDING)
            else "xfail"
        )
    if report.skipped:
        return "skipped"
    return "pass" if report.passed else "FAIL"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    mark = item.get_closest_marker("matrix")
    if mark is None:
        return
    row, column = mark.args
    if row not in _rows:
        _rows.append(row)
    key = (row, column)
    if report.when == "call" or (report.when == "setup" and not report.passed):
        _cells[key] = _outcome(report)
    elif report.when == "teardown" and report.failed:
        _cells[key] = "FAIL"


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _cells:
        return
    write = terminalreporter.write_line
    counts = {
        name: sum(1 for v in _cells.values() if v == name)
        for name in ("pass", "model-limited", "gateway-pending", "FAIL", "skipped")
    }
    width = max(len(row) for row in _rows)
    write("")
    write(
        "frameworks x capabilities (pass; model-limited: the 135M model's own failure; gateway-pending: a change under way)"
    )
    write(f"| {'framework':<{width}} | " + " | ".join(f"{c:<15}" for c in CAPABILITIES) + " |")
    write(f"|{'-' * (width + 2)}|" + "|".join("-" * 17 for _ in CAPABILITIES) + "|")
    for row in _rows:
        write(f"| {row:<{width}} | " + " | ".join(f"{_cells.get((row, c), '-'):<15}" for c in CAPABILITIES) + " |")
    write(
        f"frameworks matrix: {counts['pass']} pass, {counts['model-limited']} model-limited, "
        f"{counts['gateway-pending']} gateway-pending, {counts['FAIL']} failed, {counts['skipped']} skipped, "
        f"{len(_cells)} total; wall time {time.monotonic() - _started:.0f}s"
    )
