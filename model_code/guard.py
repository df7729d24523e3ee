"""The request guard on the MLflow path: every call's engine request checked as the gateway checks it.

A wrapper call (``predict``, ``predict_stream``, ``batch_predict``, ``mlflow models serve``'s
``/invocations``) becomes one chat completions body: its messages, the generation parameters, and
``custom_inputs.extra_body`` merged in. Before anything is sent, that body goes through
:mod:`engine_guard` exactly like a gateway request to ``/v1/chat/completions``: the allowlist and its types,
the request bounds and grammar checks, the SGLang extension fields (``input_ids``, ``rid``, ``lora_path``...:
off unless ``gateway.extension_fields.<model>`` of the same ``model_config`` enables them, the gateway's own
switch), and token ids against the model's vocabulary. A refusal is a :class:`BadRequestError` naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from engine_guard.bounds import RequestBounds, check_bounds
from engine_guard.compile_budget import GrammarBudget, ProbeStalled, compiled_grammars
from engine_guard.fields import DROPPED, EXTENSIONS
from engine_guard.refusal import Refused
from engine_guard.schemas import ChatCompletionRequest, check_body, check_extensions
from engine_guard.token_ids import CHAT_TOKEN_ID_FIELDS, token_id_problem
from engine_guard.tool_calls import guard_tools
from launch.config import ConfigError, EngineConfig, format_validation_error
from launch.grammar_cost import CompileCostProbe, ProbeUnavailable, measurable_tokenizer
from launch.model_info import vocab_size as model_vocab_size
from model_code.errors import BadRequestError, OverloadedError
from model_code.target import Target

CHAT_PATH = "/v1/chat/completions"
HELD_FIELDS = ("tools", "stop", "no_stop_trim", "response_format")
"""What :func:`engine_guard.tool_calls.guard_tools` may rewrite in a request (a forced call held and ended, strings of
a compiled schema held to JSON content)."""
CLIENT_PARAMS = frozenset({"tools", "stop", "response_format"})
"""Of those, the ones ``chat.completions.create`` takes by name; the others go in ``extra_body``."""


@dataclass(frozen=True)
class RequestGuard:
    """What one model's calls may send its engine (``model``: the model's name in ``model_config``)."""

    model: str
    extensions: frozenset[str] = frozenset()
    bounds: RequestBounds = field(default_factory=RequestBounds)
    vocab_size: int | None = None  # None: only negative token ids are refused
    tool_call_parser: str | None = None  # the managed engine's --tool-call-parser (tools refused without one)
    knows_tool_parser: bool = False  # False for a URL: its engine's parser is not known here
    grammar_budget: GrammarBudget | None = None  # what grammars cost the engine to compile (None: not measured)

    @classmethod
    def from_target(cls, target: Target, *, measure_grammars: bool = True) -> RequestGuard:
        """The guard of the served model: its switch and bounds from the ``gateway:`` section (the gateway's own
        keys), its vocabulary from the weights the engine loads (the logged copy when there is one) or the
        entry's ``vocab_size`` (a URL)."""
        name, deployment = target.name, target.deployment
        section = deployment.gateway or {}
        enabled = (section.get("extension_fields") or {}).get(name) or []
        for extension in enabled:
            if extension not in EXTENSIONS:
                raise ConfigError(
                    f"model_config: gateway.extension_fields.{name}: {extension!r} is not an SGLang extension field the guard knows"
                )
        try:
            bounds = RequestBounds.model_validate(section.get("request_bounds") or {})
        except ValidationError as error:
            raise ConfigError(format_validation_error("model_config: gateway.request_bounds", error)) from None
        engine = target.engine
        vocab = model_vocab_size(engine.model_path) if engine is not None else deployment.models[name].vocab_size
        parser = engine.tool_call_parser if engine is not None else None
        budget = grammar_budget(engine, vocab) if measure_grammars and bounds.max_grammar_compile_s is not None else None
        return cls(name, frozenset(enabled), bounds, vocab, parser, engine is not None, budget)

    def check(self, messages: list[dict[str, Any]], kwargs: dict[str, Any], *, stream: bool = False) -> None:
        """Raise BadRequestError naming the field when the request ``kwargs`` (``chat.completions.create``'s,
        ``model`` included) with ``messages`` must not reach the engine; drop the service options the gateway drops."""
        body = engine_body(messages, kwargs, stream=stream)
        try:
            check_body(body, ChatCompletionRequest, CHAT_PATH)
            check_bounds(CHAT_PATH, body, self.bounds)
            check_extensions(
                body,
                CHAT_PATH,
                self.extensions,
                self.model,
                switch=f"gateway.extension_fields.{self.model} in model_config",
            )
            problem = token_id_problem(CHAT_TOKEN_ID_FIELDS, body, self.vocab_size)
            if problem is not None:
                raise Refused(problem, code="invalid_token_ids", param=problem.split(":", 1)[0])
            sent = {name: body.get(name) for name in HELD_FIELDS}
            guard_tools(CHAT_PATH, body, self.model, self.tool_call_parser, parser_known=self.knows_tool_parser)
            self._check_grammar_cost(body)
        except Refused as refusal:
            raise BadRequestError(refusal.message, param=refusal.param, code=refusal.code) from None
        extra = kwargs.get("extra_body") or {}
        for name, value in sent.items():  # a forced call held and ended as the gateway holds it: sent where it was
            if body.get(name) is not value:
                (extra if name in extra or name not in CLIENT_PARAMS else kwargs)[name] = body[name]
        if extra:
            kwargs["extra_body"] = extra
        for name in DROPPED[CHAT_PATH]:
            kwargs.pop(name, None)
            extra.pop(name, None)


    def _check_grammar_cost(self, body: dict[str, Any]) -> None:
        """Refused when the request's grammars cost the engine more than the budget to compile (after the tool
        rewrite: a forced call's tools are compiled); OverloadedError when they cannot be measured now."""
        budget_s = self.bounds.max_grammar_compile_s
        if self.grammar_budget is None or budget_s is None:
            return
        grammars = compiled_grammars(body)
        if not grammars:
            return
        try:
            self.grammar_budget.check(grammars, budget_s, "request_bounds in model_config")
        except (ProbeStalled, ProbeUnavailable) as error:
            raise OverloadedError(f"the request's grammar cost cannot be measured now: {error}") from None

    def close(self) -> None:
        """End the grammar cost probe's process, if one was started."""
        if self.grammar_budget is not None:
            self.grammar_budget.probe.close()  # type: ignore[attr-defined]


def grammar_budget(engine: EngineConfig | None, vocab_size: int | None) -> GrammarBudget | None:
    """The grammar compile budget of a managed engine (its tokenizer local, its grammar backend xgrammar); None for a
    URL, whose tokenizer is not known here (docs/security.md). Its probe process starts at the first measurement."""
    if engine is None:
        return None
    found, _ = measurable_tokenizer(engine.grammar_backend, engine.tokenizer_path or engine.model_path)
    if found is None:
        return None
    return GrammarBudget(CompileCostProbe(found, vocab_size), any_whitespace=not engine.json_disable_any_whitespace)


def engine_body(messages: list[dict[str, Any]], kwargs: Mapping[str, Any], *, stream: bool = False) -> dict[str, Any]:
    """The JSON body the openai client sends for ``kwargs``: its fields, the messages and ``stream``, with
    ``extra_body`` merged over them all (as the client merges it: an ``extra_body`` key wins)."""
    body = {name: value for name, value in kwargs.items() if name != "extra_body"}
    body["messages"] = messages
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    body.update(kwargs.get("extra_body") or {})
    return body
