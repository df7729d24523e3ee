"""The child process of :mod:`launch.grammar_cost`: compiles grammars with a model's tokenizer, one at a time.

Run as ``python -m launch.grammar_cost_worker TOKENIZER_DIR VOCAB_SIZE INFO_FILE``. It loads the tokenizer's xgrammar
``TokenizerInfo`` (what the engine's grammar backend builds at its start) from ``INFO_FILE`` when an earlier child
wrote it there, else from the tokenizer (importing transformers: seconds) and writes it, says ``{"ready": ...}`` on stdout,
then reads one JSON request a line on stdin (``{"kind", "text", "any_whitespace"}``) and answers one JSON line:
``{"ok": true}`` once the grammar compiled, ``{"ok": false, "error": ...}`` when the grammar backend refused it.
It compiles on one thread with the compiler's cache off, so that the CPU its parent measures is one grammar's whole
cost; a grammar that costs too much is never finished here: the parent kills the process.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any


def _compiler(tokenizer_dir: str, vocab_size: int, info_file: str) -> Any:
    import xgrammar

    saved = Path(info_file)
    if saved.is_file() and saved.stat().st_size:
        info = xgrammar.TokenizerInfo.deserialize_json(saved.read_text())
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size or None)
        partial = saved.with_suffix(f".{os.getpid()}.partial")
        partial.write_text(info.serialize_json())
        partial.replace(saved)  # whole or absent: a child killed while writing leaves no half file
    return xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)


def _compile(compiler: Any, kind: str, text: str, any_whitespace: bool) -> None:
    """Compile as SGLang's xgrammar backend does for ``kind`` (its ``dispatch_*``)."""
    import xgrammar

    if kind == "json_schema":
        compiler.compile_json_schema(text, any_whitespace=any_whitespace)
    elif kind == "regex":
        compiler.compile_regex(text)
    elif kind == "ebnf":
        compiler.compile_grammar(text)
    elif kind == "structural_tag":
        spec = json.loads(text)
        if spec.get("structures") is not None:  # the legacy form, converted as SGLang converts it
            tags = [
                xgrammar.StructuralTagItem(begin=item["begin"], schema=json.dumps(item.get("schema") or {}), end=item["end"])
                for item in spec["structures"]
            ]
            tag = xgrammar.StructuralTag.from_legacy_structural_tag(tags, spec.get("triggers"))
            tag.format.at_least_one = spec.get("at_least_one", False)
            compiler.compile_structural_tag(tag)
        else:
            compiler.compile_structural_tag(text)
    else:
        raise ValueError(f"unknown grammar kind {kind!r}")


def main(argv: list[str]) -> int:
    compiler = _compiler(argv[0], int(argv[1]), argv[2])
    out = sys.stdout
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        request = json.loads(line)
        try:
            _compile(compiler, request["kind"], request["text"], bool(request.get("any_whitespace", True)))
            answer: dict[str, Any] = {"ok": True}
        except (RuntimeError, ValueError, TypeError, KeyError) as error:  # the grammar backend's refusals
            answer = {"ok": False, "error": " ".join(str(error).split())[:300]}
        out.write(json.dumps(answer) + "\n")
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
