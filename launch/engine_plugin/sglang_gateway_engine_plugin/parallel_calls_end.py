"""Forced parallel calls end where text that is no call begins: the engine finishes the turn right after the calls.

A forced choice that allows several calls (``required`` with ``parallel_tool_calls`` true; Anthropic's ``any``) keeps
SGLang 0.5.23's grammar: triggered tags, at least one call, then free text. After its calls the model writes on (text
the tool-call parser drops) up to ``max_tokens``, so complete calls came back cut short (``finish_reason: "length"``,
Responses ``incomplete``, Messages ``max_tokens``). A grammar that allows only "another call or the end" is no cure: a
small greedy model held to it writes call after call to the limit (:mod:`.forced_calls_end`'s note).

So the grammar stays, and the scheduler ends the turn where its text shows the calls are over: after a call's end
marker, once the text is neither whitespace nor the start of another call (a trigger such as ``<tool_call>``). The
answer is cut before that text and finishes as a stop (as if the model had ended its turn there), which each route reports
as a call (``tool_calls``, ``completed``, ``tool_use``). Two hooks share the work across SGLang's processes:

- in the server process, :func:`marked_parallel_tag` gives such a constraint one form the scheduler can recognise
  without guessing (a one-element ``sequence`` around SGLang's own ``triggered_tags``: the same grammar);
- in the scheduler, :func:`end_after_calls` (AROUND ``Req.update_finish_state``) looks, for those requests only, at
  the text of the last few tokens after each step (:func:`text_after_calls_start`).

A structural tag a client sends itself is never in that form unless it is made so by hand; other requests cost one
attribute read per step.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

TARGET = "sglang.srt.managers.schedule_batch.Req.update_finish_state"
WINDOW_TOKENS = 64
"""Tokens decoded after each step: enough for an end marker, the whitespace after it and a trigger's prefix. Text
after a call that runs longer than this in whitespace is not seen as the calls' end (the turn then runs as before)."""
_MARKERS = "_sglang_gateway_call_markers"


@dataclass(frozen=True)
class CallMarkers:
    """What a forced parallel call's grammar writes around each call: the texts that end one, and those that start one."""

    ends: tuple[str, ...]
    triggers: tuple[str, ...]


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, end_after_calls, HookType.AROUND)


def forced_triggered_tags(tag: dict[str, Any] | None) -> dict[str, Any] | None:
    """The ``triggered_tags`` format of SGLang's forced-call constraint ``tag`` (JSON form; its legacy ``structures``
    form converted as xgrammar converts it), or None where ``tag`` is no forced triggered-tags constraint."""
    if not isinstance(tag, dict):
        return None
    if isinstance(tag.get("structures"), list):  # SGLang's legacy form: begin / schema / end per tool, and triggers
        if not tag.get("at_least_one"):
            return None
        tags = [
            {
                "type": "tag",
                "begin": s["begin"],
                "content": {"type": "json_schema", "json_schema": s.get("schema") or {}},
                "end": s["end"],
            }
            for s in tag["structures"]
        ]
        return {
            "type": "triggered_tags",
            "triggers": list(tag.get("triggers") or ()),
            "tags": tags,
            "at_least_one": True,
            "stop_after_first": False,
        }
    form = tag.get("format")
    if not isinstance(form, dict) or form.get("type") != "triggered_tags" or not form.get("at_least_one"):
        return None
    return form


def marked_parallel_tag(tag: dict[str, Any] | None) -> dict[str, Any] | None:
    """SGLang's forced triggered-tags constraint as the same grammar in the form :func:`call_markers` recognises; None
    where ``tag`` is no forced triggered-tags constraint that allows several calls."""
    form = forced_triggered_tags(tag)
    if form is None or form.get("stop_after_first") or not form.get("triggers"):
        return None
    return {"type": "structural_tag", "format": {"type": "sequence", "elements": [form]}}


def call_markers(structural_tag: str | None) -> CallMarkers | None:
    """The markers of a constraint :func:`marked_parallel_tag` built (the ``structural_tag`` sampling parameter, a JSON
    text), or None for any other request."""
    if not structural_tag or '"sequence"' not in structural_tag:
        return None
    try:
        form = json.loads(structural_tag).get("format") or {}
        (inner,) = form["elements"] if form.get("type") == "sequence" else ()
    except (ValueError, TypeError, AttributeError, KeyError):
        return None
    if not isinstance(inner, dict) or inner.get("type") != "triggered_tags" or not inner.get("at_least_one"):
        return None
    ends = tuple(t["end"] for t in inner.get("tags") or () if isinstance(t, dict) and t.get("end"))
    triggers = tuple(t for t in inner.get("triggers") or () if isinstance(t, str) and t)
    return CallMarkers(ends, triggers) if ends and triggers else None


def text_after_calls_start(text: str, markers: CallMarkers) -> tuple[int, int] | None:
    """Where ``text`` shows the calls are over: (the end of the last call's end marker, where the text after it
    begins), or None while no call has ended or what follows may still be whitespace or another call."""
    ended = max((text.rfind(end) + len(end) for end in markers.ends if end in text), default=-1)
    if ended < 0:
        return None
    after = text[ended:]
    rest = after.lstrip()
    if not rest or any(rest.startswith(t) or t.startswith(rest) for t in markers.triggers):
        return None
    return ended, ended + len(after) - len(rest)


def cut_before_text(ids: Sequence[int], decode: Callable[[Sequence[int]], str], markers: CallMarkers) -> int | None:
    """The number of output tokens to keep when the last tokens of ``ids`` show the calls are over (the calls and the
    whitespace after them), or None. A token that holds both the marker's end and the text after it is kept."""
    start = max(0, len(ids) - WINDOW_TOKENS)
    found = text_after_calls_start(decode(list(ids[start:])), markers)
    if found is None:
        return None
    ended, text_starts = found
    for keep in range(len(ids) - 1, start, -1):
        kept = len(decode(list(ids[start:keep])))
        if kept <= text_starts:
            return keep if kept >= ended else len(ids)
    return len(ids)


def end_after_calls(original: Callable[..., Any], req: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``Req.update_finish_state``: SGLang's finish checks, then, for a forced parallel call's request, the
    end of the turn where its text shows the calls are over."""
    result = original(req, *args, **kwargs)
    if req.finished_reason is not None or req.tokenizer is None:
        return result
    markers = req.__dict__.get(_MARKERS, False)
    if markers is False:
        markers = call_markers(getattr(req.sampling_params, "structural_tag", None))
        setattr(req, _MARKERS, markers)
    if markers is None:
        return result
    keep = cut_before_text(req.output_ids, req.tokenizer.decode, markers)
    if keep is not None:
        from sglang.srt.managers.schedule_batch import FINISH_MATCHED_TOKEN

        # matched None: a stop, with nothing for the detokenizer to trim (a matched token id would cost the last kept
        # token, the end marker's, and the parser its call)
        req.finished_reason = FINISH_MATCHED_TOKEN(matched=None)
        req.finished_len = keep
    return result
