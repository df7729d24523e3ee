"""Write the facts of the installed SGLang that launch/sglang_versions.py rests on, as JSON on stdout.

Run with the interpreter of the SGLang to describe (no GPU needed):
    .venv/bin/python scripts/sglang_facts.py > launch/sglang_facts/0.5.23.json
    <older env>/bin/python scripts/sglang_facts.py > launch/sglang_facts/0.5.10.post1.json

``flags``: every option of ``sglang.launch_server`` (``ServerArgs.add_cli_args``); ``request_fields``: the fields
of each OpenAI request model of ``sglang.srt.entrypoints.openai.protocol`` (and the rerank input of io_struct);
``log_templates``: the start-up log messages that launch/process.py's PHASES read (weights, KV cache, graph capture,
ready), as written in the source: an f-string's fields kept as ``{expression}``; ``routes``: the paths
``sglang/srt/entrypoints/http_server.py`` declares on its ``app`` (not those a router or mount adds: /metrics).
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
from importlib.metadata import version
from pathlib import Path

# The start-up messages whose wording launch/process.py's phase patterns depend on.
_PHASE_MESSAGE = re.compile(
    r"^Load weight (begin|end)|KV Cache is allocated|^\{cache_name\} |^Capture .*\b(begin|end)\."
    r"|fired up and ready to roll"
)


def _template(node: ast.AST) -> str | None:
    """A string literal's text, an f-string's with its fields as ``{expression}``; None for anything else."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(
            part.value if isinstance(part, ast.Constant) else "{" + ast.unparse(part.value) + "}"
            for part in node.values
            if isinstance(part, (ast.Constant, ast.FormattedValue))
        )
    return None


def log_templates(package: Path) -> list[str]:
    """Every string in the package's ``srt`` sources that reads as one of the start-up phase messages."""
    found = set()
    for source in sorted((package / "srt").rglob("*.py")):
        text = source.read_text(encoding="utf-8")
        if not any(word in text for word in ("Load weight", "is allocated", "Capture ", "fired up")):
            continue  # most files log none of them: not parsed
        tree = ast.parse(text)
        parts = {id(part) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for part in node.values}
        for node in ast.walk(tree):
            message = _template(node) if id(node) not in parts else None
            if message and _PHASE_MESSAGE.search(message):
                found.add(message)
    return sorted(found)


_ROUTE_METHODS = frozenset({"get", "post", "put", "delete", "patch", "head", "api_route", "add_api_route"})


def routes(http_server: Path) -> list[str]:
    """The paths of ``@app.get("/path")``-style routes (and ``app.add_api_route``) of the engine's HTTP server."""
    found = set()
    for node in ast.walk(ast.parse(http_server.read_text(encoding="utf-8"))):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "app"
            and node.func.attr in _ROUTE_METHODS
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.add(node.args[0].value)
    return sorted(found)


def main() -> int:
    import sglang
    from sglang.srt.entrypoints.openai import protocol
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    flags = sorted({option for action in parser._actions for option in action.option_strings if option.startswith("--")})
    models = {}
    for name in sorted(dir(protocol)):
        model = getattr(protocol, name)
        fields = getattr(model, "model_fields", None)
        if isinstance(model, type) and isinstance(fields, dict) and (name.endswith("Request") or name.endswith("ReqInput")):
            models[name] = sorted(fields)
    package = Path(sglang.__file__).parent
    made = {
        "sglang": version("sglang"),
        "flags": flags,
        "request_fields": models,
        "log_templates": log_templates(package),
        "routes": routes(package / "srt" / "entrypoints" / "http_server.py"),
    }
    json.dump(made, sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
