"""The first stage of a proxied request: checked against its model's engine, then admitted (its model's slot, in
its priority's place in the queue, and a grammar slot when its grammars are heavy). What it then holds is its
:class:`~gateway.data.lease.Lease`; the next stage is :mod:`gateway.data.exchange`."""

from __future__ import annotations

import time

import orjson

from engine_guard.bounds import grammar_bytes
from engine_guard.refusal import Refused
from engine_guard.token_ids import token_id_problem
from engine_guard.tool_calls import guard_tools
from gateway.core.call import Call
from gateway.core.errors import GatewayError, StreamKind, refused, unknown_model
from gateway.core.registry import Registry
from gateway.data.grammar_costs import GrammarCosts
from gateway.data.lease import Lease
from gateway.data.usage_request import ask_for_usage, cost_bound


async def admit(call: Call, registry: Registry | None, grammar_costs: GrammarCosts | None = None) -> Lease:
    """Check ``call`` (:func:`check`, then what its grammars cost to compile: ``grammar_costs``), wait for its model's
    slot, and hold it in a lease; GatewayError when it may not run.

    ``registry``: the routes now, for an adapter unloaded while the request waited (None: not checked)."""
    check(call)
    if grammar_costs is not None:  # after check: a forced call's tools are compiled too
        await grammar_costs.check(call)
    limiter = call.route.limiter
    since = time.perf_counter()
    await limiter.acquire(call.route.name, call.priority or 0)
    call.notes.queued(since)
    lease = Lease(limiter)
    lease.adapter, lease.key = call.adapter, call.key
    lease.lingers = bool(call.grammar_size if call.grammar_size is not None else grammar_bytes(call.body))
    try:
        if call.adapter is not None and not _still_served(registry, call.route.name, call.adapter):
            raise unknown_model(call.body["model"])  # unloaded while the request waited for its slot
        if limiter.settings.max_concurrent_grammars:
            size = grammar_bytes(call.body) if call.grammar_size is None else call.grammar_size
            if size >= limiter.settings.heavy_grammar_bytes:
                lease.grammar = await limiter.acquire_grammar(call.route.name)
        if call.route.drained:
            raise GatewayError(
                503, f"model {call.route.name!r} is drained by an operator; retry later", code="model_drained",
                headers={"Retry-After": str(limiter.settings.retry_after_s)},
            )  # fmt: skip
    except BaseException:
        lease.close()
        raise
    return lease


def check(call: Call) -> None:
    """What the engine serving ``call`` would refuse or ignore, refused here (400); its adapter, whether it streams,
    and, for a limited key, what it may cost held (settled at its end)."""
    route, endpoint, body, info = call.route, call.endpoint, call.body, call.info
    call.adapter = route.adapter_for(body.get("model"))  # "<model>:<adapter>": SGLang's own spelling, on the served name
    if call.adapter is not None:  # metrics, the request log, the ledger and the trace name it as the client did
        info.model = body["model"]
    problem = token_id_problem(endpoint.token_ids, body, route.backend.vocab_size)
    if problem is not None:
        raise GatewayError(400, problem, code="invalid_token_ids", param=problem.split(":", 1)[0])
    problem = route.backend.engine_version.field_problem(endpoint.path, body)  # an older SGLang would ignore it
    if problem is not None:
        raise GatewayError(400, problem, code="unsupported_parameter", param=problem.split(":", 1)[0])
    try:  # tools an engine would answer as text refused; a forced call held to its name and schema by its grammar
        guard_tools(endpoint.path, body, route.name, route.backend.tool_call_parser, parser_known=route.backend.knows_tool_parser)
    except Refused as refusal:
        raise refused(refusal) from None
    if info.reserve is not None:  # a limited key: hold what the request may cost (settled at its end)
        info.prompt_estimate, bound = cost_bound(body, len(orjson.dumps(body)), route.backend.context_length)
        info.reserve(bound if endpoint.stream is not None else info.prompt_estimate)
    call.streamed = info.stream = endpoint.stream is not None and body.get("stream") is True
    call.hide_usage = call.streamed and endpoint.stream is StreamKind.DATA and ask_for_usage(body)
    call.notes.request(body)


def _still_served(registry: Registry | None, model: str, adapter: str) -> bool:
    current = registry.route(model) if registry is not None else None
    return current is None or adapter in current.adapters
