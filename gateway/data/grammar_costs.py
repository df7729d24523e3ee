"""The grammar compile budget on the gateway's data path: a request's grammars measured before its engine sees them.

:class:`GrammarCosts` holds one :class:`~engine_guard.compile_budget.GrammarBudget` per tokenizer (one probe process
each, started at the first grammar it must measure), decides known grammars on the event loop (no I/O) and measures
the others in a thread. A key measures one unknown grammar set at a time: its other requests wait behind it, so one
key's flood of new schemas holds at most one measurement ahead of everyone else's. The budget is the gateway's
``request_bounds.max_grammar_compile_s`` (read per request: a reload applies at once).

Where no tokenizer is known for a model (an external engine whose tokenizer is not on this machine, or an engine
whose grammar backend is not xgrammar), its grammars are not measured: said once in the log, and in docs/security.md.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from loguru import logger

from engine_guard.compile_budget import GrammarBudget, ProbeStalled, compiled_grammars
from engine_guard.refusal import Refused
from gateway.config import GatewaySettings
from gateway.core.backends import Backend, GrammarTokenizer
from gateway.core.call import Call
from gateway.core.errors import GatewayError, refused
from launch.grammar_cost import CompileCostProbe, ProbeUnavailable

SETTING = "gateway.request_bounds"


@dataclass
class _KeyTurn:
    lock: asyncio.Lock
    users: int = 0


class GrammarCosts:
    """Per gateway process: what grammars cost to compile, per tokenizer; closed with the data plane."""

    def __init__(self, settings: Callable[[], GatewaySettings], learn: Callable[[Backend], Awaitable[None]] | None = None) -> None:
        self._settings = settings
        self._learn = learn  # asks an external engine its facts (HealthProbes.learn_version): its tokenizer among them
        self._budgets: dict[GrammarTokenizer, GrammarBudget] = {}
        self._turns: dict[str | None, _KeyTurn] = {}
        self._unmeasured: set[str] = set()  # models said (once) to have no tokenizer to measure with
        self.refusals: collections.Counter[str] = collections.Counter()  # by code, for the tests and the log

    async def check(self, call: Call) -> None:
        """Refuse ``call`` (GatewayError) when its grammars cost more than the budget to compile (400), or cannot be
        measured now (503). Nothing to do for a request without grammars, or a budget turned off."""
        budget_s = self._settings().request_bounds.max_grammar_compile_s
        if budget_s is None:
            return
        grammars = compiled_grammars(call.body)
        if not grammars:
            return
        backend = call.route.backend
        if backend.grammar_tokenizer is None and not backend.server_info_asked and self._learn is not None:
            await self._learn(backend)  # an external engine not asked yet (its first probe is still to come)
        budget = self._budget_for(call.route.name, backend)
        if budget is None:
            return
        if budget.decided(grammars, budget_s):
            self._decide(budget, grammars, budget_s)
            return
        # A task of its own holds the key's turn until the measurement ends, even when the client leaves meanwhile (its
        # request is cancelled, the probe's compile is not): a key that drops its requests still measures one at a time.
        measuring = asyncio.ensure_future(self._measure_in_turn(call.key, budget, grammars, budget_s))
        measuring.add_done_callback(_retrieved)  # its refusal, when nobody waits for it any more, is not an error to log
        await asyncio.shield(measuring)

    async def _measure_in_turn(self, key: str | None, budget: GrammarBudget, grammars: list, budget_s: float) -> None:
        turn = self._turns.get(key)
        if turn is None:
            turn = self._turns[key] = _KeyTurn(asyncio.Lock())
        turn.users += 1
        try:
            async with turn.lock:  # one measurement at a time per key
                await asyncio.to_thread(self._decide, budget, grammars, budget_s)
        finally:
            turn.users -= 1
            if not turn.users:
                self._turns.pop(key, None)

    def _decide(self, budget: GrammarBudget, grammars: list, budget_s: float) -> None:
        try:
            budget.check(grammars, budget_s, SETTING)
        except Refused as refusal:
            self.refusals[refusal.code or "refused"] += 1
            raise refused(refusal) from None
        except ProbeStalled as error:
            raise GatewayError(503, str(error), code="grammar_check_busy", headers={"Retry-After": "5"}) from None
        except ProbeUnavailable as error:
            logger.error("grammar compile budget: {}", error)
            raise GatewayError(
                503, "the gateway cannot measure this request's grammar cost now (see its log); retry later",
                code="grammar_check_unavailable", headers={"Retry-After": "5"},
            ) from None  # fmt: skip

    def _budget_for(self, model: str, backend: Backend) -> GrammarBudget | None:
        target = backend.grammar_tokenizer
        if target is None:
            if model not in self._unmeasured:
                self._unmeasured.add(model)
                logger.warning(
                    "model {}: its grammars' compile cost is not bounded by the gateway ({}); see docs/security.md",
                    model, backend.grammar_tokenizer_missing,
                )  # fmt: skip
            return None
        budget = self._budgets.get(target)
        if budget is None:
            probe = CompileCostProbe(target.path, target.vocab_size)
            budget = self._budgets[target] = GrammarBudget(probe, any_whitespace=target.any_whitespace)
        return budget

    def close(self) -> None:
        """End every probe process."""
        for budget in self._budgets.values():
            budget.probe.close()  # type: ignore[attr-defined]
        self._budgets.clear()


def _retrieved(task: asyncio.Task[None]) -> None:
    if not task.cancelled():
        task.exception()
