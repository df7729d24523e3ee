"""Write the facts of the installed SGLang that launch/sglang_versions.py rests on, as JSON on stdout.

Run with the interpreter of the SGLang to describe (no GPU needed):
    .venv/bin/python scripts/sglang_facts.py > launch/sglang_facts/0.5.23.json
    <older env>/bin/python scripts/sglang_facts.py > launch/sglang_facts/0.5.10.post1.json

``flags``: every option of ``sglang.launch_server`` (``ServerArgs.add_cli_args``); ``request_fields``: the fields
of each OpenAI request model of ``sglang.srt.entrypoints.openai.protocol`` (and the rerank input of io_struct).
"""

from __future__ import annotations

import argparse
import json
import sys
from importlib.metadata import version


def main() -> int:
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
    json.dump({"sglang": version("sglang"), "flags": flags, "request_fields": models}, sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
