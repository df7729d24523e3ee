"""Process groups: start a child that leads its own group and dies with its parent; signal, stop and
inspect the whole group.

A server subprocess (an SGLang engine forks a scheduler and a detokenizer; the gateway forks an
engine) is stopped by signalling its group, never by name, so nothing it forked is left behind and
nobody else's process is touched. The engine launcher, the benchmarks and the test helpers all start
and stop their children through here.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from loguru import logger

_PR_SET_PDEATHSIG = 1


def set_parent_death_signal() -> None:
    """Ask the kernel to SIGTERM this process when its parent dies (call between fork and exec).

    Linux sends it when the *thread* that forked the child exits: fork from a long-lived thread.
    """
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def popen_group(argv: Sequence[str], **popen_kwargs: Any) -> subprocess.Popen[Any]:
    """``subprocess.Popen`` of a child that leads a new process group and dies with this process."""
    return subprocess.Popen(argv, start_new_session=True, preexec_fn=set_parent_death_signal, **popen_kwargs)


def signal_group(pgid: int, sig: signal.Signals) -> None:
    """Send ``sig`` to every process of group ``pgid`` (nothing if the group is gone)."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def pid_alive(pid: int) -> bool:
    """Process ``pid`` still exists (zombies included until reaped; another user's too)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def group_alive(pgid: int) -> bool:
    """Some process of group ``pgid`` still exists (zombies included until reaped)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def wait_group(proc: subprocess.Popen[Any], timeout_s: float) -> bool:
    """Wait until the group leader ``proc`` is reaped and no process is left in its group."""
    deadline = time.monotonic() + timeout_s
    while True:
        proc.poll()
        if proc.returncode is not None and not group_alive(proc.pid):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)


def stop_group(
    proc: subprocess.Popen[Any], grace_s: float, *, first: signal.Signals = signal.SIGTERM, label: str = "process",
    leader_first: bool = False,
) -> int | None:  # fmt: skip
    """Stop the group led by ``proc``: ``first`` (SIGTERM), SIGKILL after ``grace_s``; returns the exit code.

    SIGCONT follows the first signal, so a group that was stopped (SIGSTOP, a debugger) handles it
    now instead of at the SIGKILL. ``leader_first``: ``first`` goes to the leader alone, which stops its own
    children (SGLang's server shuts its schedulers down cleanly; a scheduler signalled directly dies, its server
    takes that for a crash and waits 5 s for diagnostics); whatever of the group outlives the leader gets ``first``
    next, all within ``grace_s``.
    """
    deadline = time.monotonic() + grace_s
    if leader_first and proc.poll() is None:
        try:
            os.kill(proc.pid, first)
        except ProcessLookupError:
            pass
        signal_group(proc.pid, signal.SIGCONT)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
    if proc.poll() is None or group_alive(proc.pid):
        signal_group(proc.pid, first)
        signal_group(proc.pid, signal.SIGCONT)
        if not wait_group(proc, max(0.0, deadline - time.monotonic())):
            logger.warning("{}: still running {:.0f}s after {}; sending SIGKILL", label, grace_s, first.name)
            signal_group(proc.pid, signal.SIGKILL)
            wait_group(proc, 10.0)
    return proc.wait()


def live_pids() -> Iterator[int]:
    """Pids of every live process on this machine (from ``/proc``)."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            yield int(entry.name)


def stat_fields(pid: int) -> list[str] | None:
    """Fields of ``/proc/PID/stat`` after the command name (0 = state, 1 = ppid, 2 = pgrp, 11/12 = utime/stime)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name is in parentheses and may contain spaces: split after the last ')'.
    return stat[stat.rfind(")") + 2 :].split()


def group_pids(pgid: int) -> set[int]:
    """Pids of the live processes in process group ``pgid``."""
    return _pids_whose_stat(_PGRP, pgid)


def child_pids(ppid: int) -> set[int]:
    """Pids of the live processes whose parent is ``ppid``."""
    return _pids_whose_stat(_PPID, ppid)


_PPID, _PGRP = 1, 2  # indexes in stat_fields()


def _pids_whose_stat(field: int, value: int) -> set[int]:
    pids: set[int] = set()
    for pid in live_pids():
        fields = stat_fields(pid)
        if fields is not None and len(fields) > field and int(fields[field]) == value:
            pids.add(pid)
    return pids


def fd_targets(pid: int) -> list[str]:
    """What the open file descriptors of ``pid`` point at (``/dev/shm/...``, ``socket:[<inode>]``); [] when unreadable."""
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return []
    targets = []
    for fd in fds:
        try:
            targets.append(os.readlink(fd))
        except OSError:  # closed meanwhile
            continue
    return targets


def cmdline(pid: int) -> str:
    """The command line of ``pid`` (arguments joined by spaces; empty if it is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""
