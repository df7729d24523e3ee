"""Run in a subprocess by test_argv.py: parse argvs (JSON list on stdin) with SGLang's own parser.

Prints one JSON object per argv: {"ok": true, "args": {...selected fields}} or {"ok": false, "error": "..."}.
Kept out of the test process so SGLang's heavy imports and global state stay out of it.
"""

import contextlib
import io
import json
import sys

from sglang.srt.server_args import prepare_server_args

FIELDS = [
    "model_path", "tokenizer_path", "served_model_name", "host", "port", "tp_size", "dp_size",
    "mem_fraction_static", "max_total_tokens", "context_length", "max_running_requests", "dtype",
    "quantization", "chunked_prefill_size", "grammar_backend", "tool_call_parser", "reasoning_parser",
    "chat_template", "attention_backend", "device", "random_seed", "trust_remote_code",
    "constrained_json_disable_any_whitespace", "skip_server_warmup", "enable_metrics", "sleep_on_idle",
    "cuda_graph_backend_decode", "cuda_graph_backend_prefill", "cuda_graph_max_bs_decode", "api_key", "log_level", "enable_response_store",
]

results = []
for argv in json.load(sys.stdin):
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            parsed = prepare_server_args(argv)
    except SystemExit:
        results.append({"ok": False, "error": stderr.getvalue().strip().splitlines()[-1:]})
        continue
    results.append({"ok": True, "args": {f: getattr(parsed, f, "<absent>") for f in FIELDS}})
print("RESULTS " + json.dumps(results, default=str))
