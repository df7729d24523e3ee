"""What a grammar costs an engine to compile, measured in a process of its own and stopped at a budget.

SGLang compiles each request's grammar (a JSON schema, a regex, an EBNF, a structural tag) with xgrammar against the
model's whole vocabulary, on the engine's own CPU, and goes on compiling after the client has gone. Some small
schemas cost minutes there (a string's ``maxLength`` of a few hundred is about a second with a 49k-token vocabulary,
and each distinct one costs it again), and nothing in the engine bounds it: a few such requests starve the
engine's other work until its health probes fail. :class:`CompileCostProbe` compiles the same grammar with the same
xgrammar and the same tokenizer in a child process (:mod:`launch.grammar_cost_worker`), one grammar at a time, and
measures the child's CPU: once a compile has used its budget the child is killed (and started again for the next
one), so no grammar costs more than its budget here, and only grammars that compiled within it need reach an engine.

The child leads its own process group and dies with its parent (:mod:`launch.procgroup`); :meth:`close` ends it.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from launch.model_info import tokenizer_dir
from launch.procgroup import popen_group, signal_group, wait_group

_TICKS = os.sysconf("SC_CLK_TCK")
_POLL_S = 0.02  # how often the child's CPU is read while it compiles (the budget is overshot by at most this)


class ProbeUnavailable(RuntimeError):
    """The probe could not measure (its process did not start, or died on its own): the message says why."""


@dataclass(frozen=True)
class CompileCost:
    """One measurement: ``cpu_s`` of compile CPU (when ``finished`` is False, what it had used when it was stopped at
    the budget, or at ``wall_limit_s`` on a machine too busy to give it the budget's CPU: ``stalled``); ``error``: the
    grammar backend refused the grammar (the engine would too)."""

    cpu_s: float
    finished: bool
    error: str | None = None
    stalled: bool = False


def measurable_tokenizer(grammar_backend: str | None, path: str | None) -> tuple[str | None, str]:
    """(the local tokenizer directory an engine's grammars are measured against, "") for an engine of
    ``grammar_backend`` (None: SGLang's default, xgrammar) whose tokenizer or model is ``path``; else (None, why not)."""
    if grammar_backend not in (None, "xgrammar"):
        return None, f"its grammar backend is {grammar_backend}, not xgrammar"
    found = tokenizer_dir(path) if path else None
    return (found, "") if found is not None else (None, f"its tokenizer ({path}) is not on this machine")


def tokenizer_info_file(tokenizer_dir: str, vocab_size: int) -> Path:
    """Where the child keeps the xgrammar ``TokenizerInfo`` of a tokenizer once read (a later child, of this process or
    another, loads it without importing transformers: half its start), under the user's cache directory, named by the
    tokenizer's files (path, sizes, times), the vocabulary size and xgrammar's version."""
    folder = Path(tokenizer_dir).resolve()
    stamp = [str(folder), str(vocab_size), _xgrammar_version()]
    for name in sorted(os.listdir(folder)) if folder.is_dir() else ():
        if name.startswith(("tokenizer", "vocab", "merges", "special_tokens", "added_tokens")):
            info = (folder / name).stat()
            stamp.append(f"{name}:{info.st_size}:{info.st_mtime_ns}")
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "sglang-gateway" / "grammar-cost"
    cache.mkdir(parents=True, exist_ok=True)
    return cache / (hashlib.sha256("\n".join(stamp).encode()).hexdigest()[:24] + ".json")


def _xgrammar_version() -> str:
    try:
        return importlib.metadata.version("xgrammar")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def process_cpu_s(pid: int) -> float:
    """User and system CPU seconds used so far by process ``pid`` (all its threads), from ``/proc``."""
    with open(f"/proc/{pid}/stat", "rb") as stat:
        fields = stat.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS  # utime, stime (fields 14 and 15 of stat(5))


class CompileCostProbe:
    """Measures grammars against one tokenizer (``tokenizer_dir``, with the model's ``vocab_size``), one at a time
    (thread-safe: callers queue on a lock). The child process starts at the first measurement (or :meth:`start`)."""

    def __init__(
        self, tokenizer_dir: str, vocab_size: int | None, *, python: str = sys.executable, start_timeout_s: float = 180.0
    ) -> None:
        self.tokenizer_dir = tokenizer_dir
        self.vocab_size = vocab_size or 0
        self.python = python
        self.start_timeout_s = start_timeout_s
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self._buffer = b""
        self.kills = 0  # children killed at a budget (a count for the metrics and the tests)
        self.closed = False

    @property
    def pid(self) -> int | None:
        """The child's pid while one runs."""
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    def start(self) -> None:
        """Start the child now (it loads the tokenizer: seconds), rather than at the first measurement."""
        with self._lock:
            self._ensure_started()

    def measure(self, kind: str, text: str, budget_s: float, *, any_whitespace: bool = True, wall_limit_s: float | None = None) -> CompileCost:
        """Compile ``text`` (a grammar of ``kind``: json_schema, regex, ebnf or structural_tag) and say what it cost,
        stopping it once it has used ``budget_s`` of CPU (or ``wall_limit_s`` seconds have passed: by default 20 times
        the budget plus 10 s). ProbeUnavailable when the child cannot be started or dies on its own."""
        wall_limit_s = wall_limit_s if wall_limit_s is not None else 20 * budget_s + 10
        with self._lock:
            proc = self._ensure_started()
            before = process_cpu_s(proc.pid)
            request = json.dumps({"kind": kind, "text": text, "any_whitespace": any_whitespace}) + "\n"
            try:
                assert proc.stdin is not None
                proc.stdin.write(request.encode())
                proc.stdin.flush()
            except (BrokenPipeError, OSError):
                self._stop()
                raise ProbeUnavailable(f"the grammar cost probe exited ({self._log_tail()})") from None
            deadline = time.monotonic() + wall_limit_s
            while True:
                line = self._read_line(proc, _POLL_S)
                if line is not None:
                    answer = json.loads(line)
                    used = max(0.0, process_cpu_s(proc.pid) - before)
                    return CompileCost(used, True, None if answer.get("ok") else str(answer.get("error")))
                if proc.poll() is not None:
                    self._stop()
                    raise ProbeUnavailable(f"the grammar cost probe exited with code {proc.returncode} ({self._log_tail()})")
                used = process_cpu_s(proc.pid) - before
                stalled = time.monotonic() >= deadline
                if used >= budget_s or stalled:
                    self.kills += 1
                    self._stop()
                    return CompileCost(used, False, stalled=stalled and used < budget_s)

    def close(self) -> None:
        """End the child (and refuse later measurements)."""
        self.closed = True
        with self._lock:
            self._stop()

    def _ensure_started(self) -> subprocess.Popen[bytes]:
        if self.closed:
            raise ProbeUnavailable("the grammar cost probe is closed")
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        self._stop()
        self._log = tempfile.TemporaryFile()
        info_file = str(tokenizer_info_file(self.tokenizer_dir, self.vocab_size))
        argv = [self.python, "-m", "launch.grammar_cost_worker", self.tokenizer_dir, str(self.vocab_size), info_file]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        proc = popen_group(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, env=env)
        self._proc, self._buffer = proc, b""
        line = self._read_line(proc, self.start_timeout_s, until_exit=True)
        if line is None or not json.loads(line).get("ready"):
            code = proc.poll()
            self._stop()
            what = f"exited with code {code}" if code is not None else f"did not start in {self.start_timeout_s:.0f}s"
            raise ProbeUnavailable(f"the grammar cost probe for {self.tokenizer_dir} {what} ({self._log_tail()})")
        return proc

    def _read_line(self, proc: subprocess.Popen[bytes], timeout_s: float, *, until_exit: bool = False) -> str | None:
        """The child's next stdout line, waiting up to ``timeout_s`` (None: none yet, or the child exited)."""
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            readable, _, _ = select.select([fd], [], [], min(left, 0.5) if until_exit else left)
            if not readable:
                if until_exit and proc.poll() is not None:
                    return None
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                return None
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode()

    def _stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        signal_group(proc.pid, signal.SIGKILL)  # a compile cannot be interrupted: nothing to flush, kill at once
        wait_group(proc, 10.0)
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                try:
                    stream.close()
                except OSError:
                    pass

    def _log_tail(self) -> str:
        """The last line the child wrote on stderr (why it failed), or a placeholder."""
        log = self._log
        if log is None:
            return "no output"
        try:
            log.seek(0)
            lines = [line for line in log.read().decode(errors="replace").splitlines() if line.strip()]
        except OSError:
            return "no output"
        return lines[-1][:300] if lines else "no output"

    def __enter__(self) -> CompileCostProbe:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
