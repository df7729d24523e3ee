"""The two blocks of docs/scaling.md's "Past one machine" stay true: the router command passes sglang-router's own
parser with both of its ports on loopback and no hub access, and the gateway YAML in front of it passes
``sglang-gateway check`` and points at that router. No engine, no router process, no network."""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import subprocess
import sys

import pytest
import yaml

from tests.docs.readme_blocks import REPO, marked_blocks


def _router_argv() -> tuple[dict[str, str], list[str]]:
    """The router block's environment assignments and its argv (continuation lines joined)."""
    (block,) = marked_blocks("router-command")
    words = shlex.split(" ".join(line.rstrip("\\").strip() for line in block.code.splitlines()))
    env = {}
    while words and re.fullmatch(r"\w+=\S*", words[0]):
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    return env, words


def test_the_router_command_passes_its_own_parser_on_loopback() -> None:
    from sglang_router.launch_router import parse_router_args

    env, argv = _router_argv()
    assert env == {"HF_HUB_OFFLINE": "1"}  # the prose's "no hub access"
    assert argv[:3] == ["python", "-m", "sglang_router.launch_router"]
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            args = parse_router_args(argv[3:])
    except SystemExit:
        pytest.fail(f"sglang-router refused the documented arguments: {stderr.getvalue().strip().splitlines()[-1:]}")
    args._validate_router_args()
    assert (args.host, args.prometheus_host) == ("127.0.0.1", "127.0.0.1")  # "Bind it to loopback"
    assert args.policy == "cache_aware" and len(args.worker_urls) == 2


def test_the_gateway_yaml_passes_check_and_points_at_the_router(tmp_path) -> None:
    from sglang_router.launch_router import parse_router_args

    (block,) = marked_blocks("router-config")
    config = tmp_path / "gateway.yaml"
    config.write_text(block.code)
    keys_env = yaml.safe_load(block.code)["gateway"]["api_keys_env"]
    check = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "check", str(config)],
        cwd=REPO,
        env={**os.environ, keys_env: "test-key"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert check.returncode == 0, check.stderr
    (url,) = re.findall(r"external engine at (\S+)", check.stdout)
    with contextlib.redirect_stderr(io.StringIO()):
        router = parse_router_args(_router_argv()[1][3:])
    assert url == f"http://{router.host}:{router.port}"
