"""Run in a subprocess by test_argv.py: parse argvs with SGLang's own parser and read back the given fields.

Stdin: ``{"fields": [ServerArgs attribute, ...], "argvs": [[flag, ...], ...]}`` (the fields are the flags'
destinations from ``launch.argv.ENGINE_FLAGS``, so this script needs no list of its own). Prints one JSON
object per argv: {"ok": true, "args": {field: value}} or {"ok": false, "error": "..."}.
Kept out of the test process so SGLang's heavy imports and global state stay out of it.
"""

import contextlib
import io
import json
import sys

from sglang.srt.server_args import prepare_server_args

request = json.load(sys.stdin)
FIELDS = request["fields"]
results = []
for argv in request["argvs"]:
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            parsed = prepare_server_args(argv)
    except SystemExit:
        results.append({"ok": False, "error": stderr.getvalue().strip().splitlines()[-1:]})
        continue
    results.append({"ok": True, "args": {f: getattr(parsed, f, "<absent>") for f in FIELDS}})
print("RESULTS " + json.dumps(results, default=str))
