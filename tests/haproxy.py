"""A real load balancer for tests: Debian's HAProxy in front of some gateways, health-checking their ``/ready``.

HAProxy runs in the foreground (``-db``) in a process group of its own (tests/servers.py: it dies with the test
process, and is stopped by signalling its group), from a configuration written into a temporary directory: a
round-robin backend whose servers are marked down at the first ``/ready`` that is not 200 and up again at the first
200, checked every :data:`CHECK_INTERVAL_MS`. It never retries a request elsewhere (``retries 0``, no redispatch):
like Kubernetes' Service (kube-proxy) and most layer-4 balancers, a request it sent to a gateway that refused it
fails, so a test sees what the gateway itself does.

Its runtime socket answers ``show stat``: each server's state (UP / DOWN) and how many requests it was sent.
Where ``haproxy`` is not installed, :func:`haproxy_missing` says why, for a skip (.ci/run installs it).
"""

from __future__ import annotations

import csv
import io
import shutil
import socket
import subprocess
from pathlib import Path

from launch.ports import pick_free_port
from tests.servers import ServerProcess

CHECK_INTERVAL_MS = 100
# A check's answer may take up to 2 s (``timeout check``): without it HAProxy allows only ``inter`` (100 ms), and on a
# loaded machine a replica slow to answer /ready was taken down while its peer restarted, leaving none. A 503 or a
# refused connection still fails a check at once.


def haproxy_missing() -> str | None:
    """Why HAProxy cannot run here (None: it can)."""
    if shutil.which("haproxy") is None:
        return "haproxy is not installed (Debian's package: apt-get install haproxy; .ci/run installs it)"
    return None


class HAProxy:
    """HAProxy on a free localhost port, balancing over ``backends`` (name -> port on 127.0.0.1)."""

    def __init__(self, backends: dict[str, int], directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.port = pick_free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.socket_path = directory / "haproxy.sock"
        servers = "\n".join(f"  server {name} 127.0.0.1:{port} check" for name, port in backends.items())
        config = directory / "haproxy.cfg"
        config.write_text(
            f"""global
  maxconn 512
  stats socket {self.socket_path} mode 600 level admin
defaults
  mode http
  timeout connect 2s
  timeout check 2s
  timeout client 120s
  timeout server 120s
  retries 0
frontend gateways
  bind 127.0.0.1:{self.port}
  default_backend gateways
backend gateways
  balance roundrobin
  option httpchk GET /ready
  http-check expect status 200
  default-server inter {CHECK_INTERVAL_MS}ms fastinter {CHECK_INTERVAL_MS}ms downinter {CHECK_INTERVAL_MS}ms fall 1 rise 1
{servers}
"""
        )
        check = subprocess.run(["haproxy", "-c", "-f", str(config)], capture_output=True, text=True, timeout=30, check=False)
        assert check.returncode == 0, check.stdout + check.stderr
        self.process = ServerProcess(["haproxy", "-db", "-f", str(config)], log_path=directory / "haproxy.log")
        self.process.wait_until(self.socket_path.exists, 30, "its runtime socket")

    def stats(self) -> dict[str, dict[str, str]]:
        """``show stat`` of the backend's servers: server name -> its row (``status``: UP / DOWN..., ``stot``: requests)."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(5)
            sock.connect(str(self.socket_path))
            sock.sendall(b"show stat\n")
            chunks = []
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        text = b"".join(chunks).decode().lstrip("# ")
        rows = csv.DictReader(io.StringIO(text))
        return {row["svname"]: row for row in rows if row["pxname"] == "gateways" and row["svname"] not in ("BACKEND", "FRONTEND")}

    def status(self, server: str) -> str:
        return self.stats()[server]["status"]

    def stop(self) -> None:
        self.process.stop(grace_s=10)
