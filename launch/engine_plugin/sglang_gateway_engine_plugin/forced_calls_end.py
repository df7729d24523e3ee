"""A forced call that must come alone ends the answer: the engine's grammar allows nothing after it but the turn's end.

SGLang 0.5.23 forces a call (``required``, a named function; Anthropic's ``any`` and ``tool``) by a structural tag of
*triggered* tags: after the call's closing marker the grammar lets the model write on, text the tool-call parser
then drops, until ``max_tokens``. A complete call thus came back cut short (``finish_reason: "length"``, Responses
``status: "incomplete"``, Messages ``stop_reason: "max_tokens"``) after the useless tokens, on every route and with
every parser whose forced calls take that form (``qwen25``, ``hermes``, ``llama3``, ``mistral``, ... : those with a
``structure_info``, and xgrammar's built-in tags of the ``triggered_tags`` kind, such as ``qwen_3_coder``).

This AROUND hook on ``FunctionCallParser.get_structure_constraint`` rewrites the constraint of a call that must come
alone (a named function, or ``required`` with ``parallel_tool_calls`` false) into xgrammar's ``tags_with_separator``
with ``stop_after_first``: the same tags (begin, arguments' schema, end marker, all from SGLang's own detector), the
one call and no other text (one ``SEPARATOR`` may follow it), then the end of the grammar. So the engine can only
end the turn (its stop token) once the call is written; the grammar's end finishes the request as a stop, which each
route reports as a call (``tool_calls``, ``completed``, ``tool_use``). Constraints of other kinds (JSON schemas,
whole-turn EBNF, built-in tags already ending after the calls) are left as SGLang builds them.

Parallel calls (``required`` with ``parallel_tool_calls`` true, Anthropic ``any``) keep SGLang's grammar, marked for
the scheduler, which ends the turn where text that is no call begins (:mod:`.parallel_calls_end`). The same rewrite
without ``stop_after_first`` (calls, newline-separated, then the end) is what :func:`ended_tag` builds with
``single=False`` and holds, but measured on the real default model (SmolLM2-135M, greedy) the model then never
chooses the end: held to "another call or the end of the turn", it writes call after call to ``max_tokens`` on every
route.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from sglang_gateway_engine_plugin.parallel_calls_end import forced_triggered_tags, marked_parallel_tag

TARGET = "sglang.srt.function_call.function_call_parser.FunctionCallParser.get_structure_constraint"
SEPARATOR = "\n"
"""Between parallel calls: what the tool-call chat templates write between two calls' markers. One may also follow
the last call: a model that writes it after each call (SmolLM2 does) would otherwise be held to start another, or
(a single call) to end on the spot."""


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, end_forced_calls, HookType.AROUND)


def end_forced_calls(original: Callable[..., Any], parser: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``get_structure_constraint``: SGLang's constraint, with a lone forced call's grammar ended after it."""
    constraint = original(parser, *args, **kwargs)
    try:
        bound = inspect.signature(original).bind(parser, *args, **kwargs)
    except TypeError:
        return constraint
    bound.apply_defaults()
    tool_choice = bound.arguments.get("tool_choice")
    parallel = bound.arguments.get("parallel_tool_calls", True)
    named = tool_choice is not None and not isinstance(tool_choice, str)  # that one call is the answer
    alone = named or (tool_choice == "required" and parallel is False)
    if not (alone or tool_choice == "required"):
        return constraint
    if not isinstance(constraint, tuple) or len(constraint) != 2 or constraint[0] != "structural_tag":
        return constraint
    # several calls may come: SGLang's grammar, marked for the scheduler to end the turn after them (module note)
    rewritten = (
        ended_tag(_as_dict(constraint[1]), single=True) if alone else marked_parallel_tag(_as_dict(constraint[1]))
    )
    if rewritten is None:
        return constraint
    from xgrammar import StructuralTag  # the object SGLang's request conversion dumps (a model of the tag's JSON)

    return ("structural_tag", StructuralTag.model_validate(rewritten))


def ended_tag(tag: dict[str, Any] | None, *, single: bool) -> dict[str, Any] | None:
    """The structural tag ``tag`` (JSON form) as ``tags_with_separator``: its forced tags and nothing after them; None
    where ``tag`` is not a forced triggered-tags constraint (then SGLang's stands)."""
    form = forced_triggered_tags(tag)
    tags = form.get("tags") if form is not None else None
    if not tags:
        return None
    calls = {
        "type": "tags_with_separator",
        "tags": tags,
        "separator": SEPARATOR,
        "at_least_one": True,
        "stop_after_first": single,
    }
    trailing = {"type": "optional", "content": {"type": "const_string", "value": SEPARATOR}}
    return {"type": "structural_tag", "format": {"type": "sequence", "elements": [calls, trailing]}}


def _as_dict(tag: Any) -> dict[str, Any] | None:
    if isinstance(tag, dict):
        return tag
    dump = getattr(tag, "model_dump", None)
    return dump(by_alias=True) if callable(dump) else None
