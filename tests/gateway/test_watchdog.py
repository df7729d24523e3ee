"""The watchdog's backoff, its give-up rule and its rule that a busy engine is not a frozen one, without an SGLang engine.

The engine here mostly can never start: its model directory has no ``config.json``, so each restart attempt
fails at the start-up preflight in milliseconds, the way a broken engine fails in seconds (and were the
preflight passed, ``python: /bin/false`` exits 1 at once). The busy engine is the FAKE engine
(tests/fake_engine.py), whose ``/health`` waits behind its requests on demand. The restart of a real SGLang engine
after SIGKILL is tested in ``test_swap.py``; a real engine busy under load and then SIGSTOPped in
``test_watchdog_engine.py``.
"""

from __future__ import annotations

import asyncio
import re
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import orjson
import pytest
from loguru import logger

from engine_guard.shapes import fields_of, payload_shape, request_shape
from gateway.config import GatewaySettings, WatchdogSettings
from gateway.control.swap import SwapExecutor
from gateway.control.watchdog import Watchdog, backoff_delay
from gateway.core.backends import EngineBackend
from gateway.core.errors import GatewayError
from gateway.core.health import HealthProbes, progress_mark
from gateway.core.metrics import Metrics
from gateway.core.poison import Quarantine
from gateway.core.registry import ModelRoute, Registry
from gateway.core.state import GatewayState
from launch.config import EngineConfig
from launch.process import EngineProcess, crash_cause
from launch.procgroup import signal_group
from tests.fake_engine import fake_engine_python


def test_backoff_doubles_and_is_capped() -> None:
    settings = WatchdogSettings(backoff_initial_s=0.5, backoff_max_s=3)
    assert [backoff_delay(n, settings) for n in range(6)] == [0.5, 1, 2, 3, 3, 3]
    assert backoff_delay(0, WatchdogSettings(backoff_initial_s=0)) == 0


def test_dead_engine_is_restarted_with_backoff_then_given_up(tmp_path: Path) -> None:
    config = EngineConfig(model_path=str(tmp_path), device="cpu", python="/bin/false")
    engine = EngineProcess("m", config, log_dir=tmp_path)  # never started: not running, like a dead engine
    backend = EngineBackend("m", engine)
    registry = Registry([ModelRoute("m", backend)])
    metrics = Metrics(registry)
    settings = GatewaySettings(watchdog=WatchdogSettings(interval_s=0.01, backoff_initial_s=0.05, backoff_max_s=0.2, max_restarts=3))
    state = GatewayState(settings, registry, metrics)
    executor = SwapExecutor(state, owned=[engine], log_dir=tmp_path)
    watchdog = Watchdog(state, executor)

    async def scenario() -> list[str]:
        reasons = []
        for _ in range(2000):
            await watchdog.check_all(settings)
            if backend.failure and backend.failure not in reasons:
                reasons.append(backend.failure)
            if watchdog.model("m").gave_up:
                return reasons
            await asyncio.sleep(0.01)
        raise AssertionError(f"the watchdog did not give up: {watchdog.health}")

    reasons = asyncio.run(scenario())
    health = watchdog.model("m")
    assert health.restarts == 3 and health.attempts == 3
    assert "no config.json in this directory" in (health.last_error or "")  # why the restarts failed
    assert any("restarting (attempt 1 of 3)" in r for r in reasons) and any("attempt 3 of 3" in r for r in reasons)
    assert "an operator must swap or reload model 'm'" in (backend.failure or "")
    assert backend.unavailable_reason() == backend.failure  # requests get 503 with this reason
    assert registry.route("m").backend is backend  # no half-started engine was installed
    sample = metrics.registry.get_sample_value
    assert sample("gateway_engine_restarts_total", {"model": "m"}) == 3
    assert sample("gateway_engine_restart_failures_total", {"model": "m"}) == 3
    asyncio.run(executor.fleet.close())


@pytest.mark.parametrize("max_restarts", [0])
def test_no_restart_when_max_restarts_is_zero(tmp_path: Path, max_restarts: int) -> None:
    engine = EngineProcess("m", EngineConfig(model_path=str(tmp_path), device="cpu", python="/bin/false"), log_dir=tmp_path)
    backend = EngineBackend("m", engine)
    registry = Registry([ModelRoute("m", backend)])
    settings = GatewaySettings(watchdog=WatchdogSettings(max_restarts=max_restarts))
    state = GatewayState(settings, registry, Metrics(registry))
    watchdog = Watchdog(state, SwapExecutor(state, owned=[engine]))
    asyncio.run(watchdog.check_all(settings))
    assert watchdog.model("m").gave_up and watchdog.model("m").restarts == 0


def test_by_default_the_watchdog_never_gives_up(tmp_path: Path) -> None:
    """A model must never stay down for good: without max_restarts the attempts go on, at the capped backoff."""
    engine = EngineProcess("m", EngineConfig(model_path=str(tmp_path), device="cpu", python="/bin/false"), log_dir=tmp_path)
    backend = EngineBackend("m", engine)
    registry = Registry([ModelRoute("m", backend)])
    settings = GatewaySettings(watchdog=WatchdogSettings(interval_s=0.01, backoff_initial_s=0.01, backoff_max_s=0.02))
    assert settings.watchdog.max_restarts is None
    state = GatewayState(settings, registry, Metrics(registry))
    executor = SwapExecutor(state, owned=[engine], log_dir=tmp_path)
    watchdog = Watchdog(state, executor)

    async def scenario() -> None:
        for _ in range(3000):
            await watchdog.check_all(settings)
            if watchdog.model("m").restarts >= 8:
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"stopped restarting: {watchdog.health}")

    asyncio.run(scenario())
    # still at it: about to try again, or just failed a try (which of the two the loop ends on is the machine's timing)
    assert not watchdog.model("m").gave_up, backend.failure
    assert re.fullmatch(r".*; restarting \(attempt \d+\)|engine is down; restart \d+ failed, retrying", backend.failure or ""), backend.failure
    asyncio.run(executor.fleet.close())


def test_quarantine_refuses_the_sole_suspect_at_once_and_others_after_two_crashes() -> None:
    quarantine = Quarantine()
    hello = [{"role": "user", "content": "hello"}]
    poison, bystander, other = (
        request_shape("/v1/chat/completions", body)
        for body in ({"messages": hello, "input_ids": [-1]}, {"messages": hello}, {"messages": hello, "max_tokens": 4})
    )
    assert quarantine.engine_failed("m", [poison, bystander], "crashed") == []  # two suspects: nobody is blamed yet
    quarantine.check("m", poison)
    assert quarantine.engine_failed("m", [poison, other], "crashed") == [poison]  # the poison was there both times
    with pytest.raises(GatewayError) as refused:
        quarantine.check("m", poison)
    assert refused.value.status == 400 and refused.value.code == "request_quarantined"
    assert "input_ids" in refused.value.message
    quarantine.check("m", bystander)
    quarantine.check("m", other)
    quarantine.check("other-model", poison)  # per model
    assert quarantine.engine_failed("m", [other], "froze") == [other]  # alone in flight: refused at once
    with pytest.raises(GatewayError):
        quarantine.check("m", other)
    assert {entry["shape"] for entry in quarantine.report()} == {poison, other}
    assert quarantine  # something is refused: the proxy checks each request's shape
    assert quarantine.clear("other-model") == 0 and quarantine.clear("m") == 2
    quarantine.check("m", poison)  # cleared by the operator (or a swap)
    assert not quarantine  # nothing refused: the proxy skips the check


def test_quarantine_forgets_beyond_its_bound_and_knows_when_nothing_is_refused() -> None:
    quarantine = Quarantine(max_entries=2)
    shapes = [request_shape("/v1/completions", {"prompt": "p", field: 1}) for field in ("max_tokens", "n", "seed", "top_k", "top_p")]
    assert len(set(shapes)) == 5
    assert quarantine.engine_failed("m", shapes[:1], "crashed") == shapes[:1]
    assert quarantine
    quarantine.engine_failed("m", shapes[1:3], "crashed")  # two suspects, not refused: the bound evicts one of them
    assert len(quarantine.report()) == 1 and quarantine
    quarantine.engine_failed("m", shapes[3:4], "crashed")  # refused; the suspect that was not is forgotten
    assert [entry["shape"] for entry in quarantine.report()] == [shapes[0], shapes[3]]
    quarantine.engine_failed("m", shapes[4:], "crashed")  # only refused records left to evict: the oldest goes
    assert [entry["shape"] for entry in quarantine.report()] == shapes[3:]
    assert quarantine.clear() == 2 and not quarantine


def test_a_request_shape_survives_edits_of_its_text_and_ids_but_not_other_fields() -> None:
    """The quarantine keys on what a request is made of: an edited word, a retry or a nearby id keep the
    shape; another field, another type or another size class make another one."""
    base = {"model": "a", "messages": [{"role": "user", "content": "hello"}], "input_ids": [-1], "max_tokens": 5}
    shape = request_shape("/v1/chat/completions", base)
    same = [
        {**base, "model": "b"},  # the model's name is not part of it (an alias, another replica's served name)
        {**base, "messages": [{"role": "user", "content": "world"}]},
        {**base, "input_ids": [-7]},
        {**base, "max_tokens": 6},
    ]
    assert all(request_shape("/v1/chat/completions", body) == shape for body in same)
    different = [
        {key: value for key, value in base.items() if key != "input_ids"},
        {**base, "input_ids": [1]},  # not negative
        {**base, "input_ids": [-1, -2, -3, -4]},  # another size class
        {**base, "temperature": 0.5},
        {**base, "max_tokens": "5"},
    ]
    assert all(request_shape("/v1/chat/completions", body) != shape for body in different)
    assert request_shape("/v1/completions", base) != shape
    assert payload_shape("/v1/chat/completions", orjson.dumps(base)) == shape
    assert fields_of(shape) == ("input_ids", "max_tokens", "messages")


# An engine's log after a request crashed its scheduler: SGLang 0.5.23's traceback and take-down, as recorded
# (frames shortened), then a shutdown that fails in its turn (the error the gateway used to name as the cause).
SITE = "/venv/lib/python3.11/site-packages"
CRASH_LOG = f"""[2026-12-01 10:34:03] INFO:     127.0.0.1:37198 - "POST /v1/chat/completions HTTP/1.1" 200 OK
[2026-12-01 10:34:04] Scheduler hit an exception: Traceback (most recent call last):
  File "{SITE}/sglang/srt/managers/scheduler.py", line 6368, in run_scheduler_process
    scheduler.run_event_loop()
  File "{SITE}/sglang/srt/managers/scheduler.py", line 2109, in event_loop_overlap
    batch_result = self.run_batch(batch)
                   ^^^^^^^^^^^^^^^^^^^^^
  File "{SITE}/torch/nn/functional.py", line 2621, in embedding
    return torch.embedding(weight, input, padding_idx, scale_grad_by_freq, sparse)
           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
IndexError: index out of range in self

[2026-12-01 10:34:04] SIGQUIT received. signum=None, frame=None. It usually means one child failed.
[2026-12-01 10:34:04] Sleeping 5 seconds before crash diagnostics to let GPU activity settle.
[2026-12-01 10:34:09] No live scheduler processes found; skipping py-spy and CUDA coredump.
[2026-12-01 10:34:09] kill_process_tree called: parent_pid=5108, include_parent=True, pid=5108
Traceback (most recent call last):
  File "/usr/lib/python3.11/multiprocessing/resource_tracker.py", line 239, in main
    _CLEANUP_FUNCS[rtype](name)
  File "/usr/lib/python3.11/multiprocessing/shared_memory.py", line 241, in _posixshmem.shm_unlink
FileNotFoundError: [Errno 2] No such file or directory: '/psm_4a1f'
""".splitlines()


def test_crash_cause_is_the_first_traceback_not_the_shutdown_error() -> None:
    assert crash_cause(CRASH_LOG) == "IndexError: index out of range in self"
    assert crash_cause(CRASH_LOG[:1]) is None  # no crash logged: killed from outside
    named = ["[x] DetokenizerManager hit an exception", "RuntimeError: boom"]  # no traceback: the exception line
    assert crash_cause(named) == "RuntimeError: boom"


def test_the_watchdog_log_names_the_crash_not_the_shutdown_error(tmp_path: Path) -> None:
    engine = EngineProcess("m", EngineConfig(model_path=str(tmp_path), device="cpu", python="/bin/false"), log_dir=tmp_path)
    engine._tail.extend(CRASH_LOG)  # what its log reader collected before the process ended
    backend = EngineBackend("m", engine)
    registry = Registry([ModelRoute("m", backend)])
    settings = GatewaySettings(watchdog=WatchdogSettings(max_restarts=0))
    state = GatewayState(settings, registry, Metrics(registry))
    lines: list[str] = []
    sink = logger.add(lambda message: lines.append(str(message)), level="ERROR", format="{message}")
    try:
        asyncio.run(Watchdog(state, SwapExecutor(state, owned=[engine])).check_all(settings))
    finally:
        logger.remove(sink)
    first = lines[0].splitlines()[0]
    assert first.startswith("model m: engine exited") and first.endswith("; it crashed: IndexError: index out of range in self; last lines of its log:"), first


def test_a_reload_during_the_watchdogs_sleep_applies_to_its_next_check(tmp_path: Path) -> None:
    """The watchdog sleeps ``interval_s`` between checks; settings reloaded meanwhile (``watchdog.enabled:
    false``, another ``max_restarts``) must govern the check that follows, not the one after it."""
    config = EngineConfig(model_path=str(tmp_path), device="cpu", python="/bin/false")
    engine = EngineProcess("m", config, log_dir=tmp_path)
    registry = Registry([ModelRoute("m", EngineBackend("m", engine))])
    state = GatewayState(GatewaySettings(watchdog=WatchdogSettings(interval_s=0.3)), registry, Metrics(registry))
    watchdog = Watchdog(state, SwapExecutor(state, owned=[engine], log_dir=tmp_path))
    seen: list[GatewaySettings] = []

    async def note(settings: GatewaySettings) -> None:
        seen.append(settings)

    watchdog.check_all = note  # type: ignore[method-assign]

    async def scenario() -> None:
        task = asyncio.ensure_future(watchdog.run())
        await asyncio.sleep(0.1)  # the watchdog is asleep
        state.settings = reloaded = GatewaySettings(watchdog=WatchdogSettings(interval_s=0.3, max_restarts=0))
        for _ in range(100):
            if seen:
                break
            await asyncio.sleep(0.02)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert seen and seen[0] is reloaded

    asyncio.run(scenario())


def test_a_crash_counts_the_suspects_whose_broken_connections_are_noted_late(tmp_path: Path) -> None:
    """On a loaded machine the proxy may note a request's broken connection after the engine's death is seen: the
    watchdog waits for every request that was upstream to end (here one noted 0.6 s later, past the old fixed 0.2 s
    pause) before it counts the suspects, so the crash is not blamed on the one request noted in time."""
    engine = EngineProcess("m", EngineConfig(model_path=str(tmp_path), device="cpu", python="/bin/false"), log_dir=tmp_path)
    engine._tail.extend(CRASH_LOG)
    backend = EngineBackend("m", engine)
    registry = Registry([ModelRoute("m", backend)])
    settings = GatewaySettings(watchdog=WatchdogSettings(max_restarts=0))
    state = GatewayState(settings, registry, Metrics(registry))
    crasher = (request_shape("/v1/chat/completions", {"messages": [{"role": "user", "content": "boom"}]}), "attacker", False)
    bystander = (request_shape("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}), "victim", True)
    late = object()  # a request still upstream when the watchdog looks: its proxy notes it lost, then lets go

    async def scenario() -> bool:
        backend.lost.append(crasher)
        backend.active.add(late)

        async def noted_late() -> None:
            await asyncio.sleep(0.6)
            backend.lost.append(bystander)
            backend.active.discard(late)

        noting = asyncio.create_task(noted_late())
        crashed = await Watchdog(state, SwapExecutor(state, owned=[engine]))._note_crash_suspects("m", backend)
        await noting
        return crashed

    lines: list[str] = []
    sink = logger.add(lambda message: lines.append(str(message)), level="WARNING", format="{message}")
    try:
        assert asyncio.run(scenario())
    finally:
        logger.remove(sink)
    assert any("with 2 request(s) in flight" in line for line in lines), lines
    assert not backend.lost  # both counted, none left for the next crash


def test_progress_is_read_from_sglangs_work_counters() -> None:
    page = """# HELP sglang:realtime_tokens_total Total number of tokens processed
sglang:realtime_tokens_total{engine_type="unified",mode="decode",model_name="m"} 40.0
sglang:realtime_tokens_total{engine_type="unified",mode="prefill_compute",model_name="m"} 12.0
sglang:num_requests_total{is_streaming="true",model_name="m"} 3.0
sglang:num_requests_total_other 9.0
sglang:num_running_reqs{model_name="m"} 2.0
"""
    assert progress_mark(page) == (52.0, 3.0)
    assert progress_mark('sglang:num_running_reqs{model_name="m"} 2.0\n') is None  # none of the counters: cannot tell


def test_a_busy_engine_missing_its_health_probes_is_not_restarted_a_frozen_one_is(tmp_path: Path) -> None:
    """An engine whose ``/health`` waits behind the batch while it works (SGLang's on a loaded CPU) fails probe
    after probe; its work counters move between the checks, so those misses do not count and it is never
    restarted. The same engine SIGSTOPped with the request still in flight moves nothing: down after
    ``unhealthy_after`` checks, as before."""
    model = tmp_path / "fake-model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    env = {"FAKE_ENGINE_HEALTH_BEHIND": "1", "FAKE_ENGINE_TOKEN_S": "0.02"}  # /health never answers while a request runs
    config = EngineConfig(model_path=str(model), device="cpu", python=str(fake_engine_python(tmp_path)), env=env)
    # The probe's timeout is what a busy engine misses; the restart's backoff is long: a restart is only scheduled.
    settings = GatewaySettings(health_timeout_s=0.2, watchdog=WatchdogSettings(unhealthy_after=2, backoff_initial_s=600))
    checks = settings.watchdog.unhealthy_after + 3

    with EngineProcess("m", config, log_dir=tmp_path) as engine:
        backend = EngineBackend("m", engine)
        registry = Registry([ModelRoute("m", backend)])
        state = GatewayState(settings, registry, Metrics(registry))
        watchdog = Watchdog(state, SwapExecutor(state, owned=[engine], log_dir=tmp_path))

        async def moved_since_the_last_check(probes: HealthProbes) -> None:
            seen = watchdog.model("m").progress
            assert seen is not None, "the watchdog read no work counters"
            while (now := await probes.progress(backend)) is None or now <= seen:
                await asyncio.sleep(0.02)

        async def scenario() -> tuple[list[bool], str | None]:
            state.probes = probes = HealthProbes(5.0, 5.0)
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100_000, "stream": True}
            client = httpx.AsyncClient(timeout=60, trust_env=False)
            try:
                async with client.stream("POST", engine.url + "/v1/chat/completions", json=body, headers=backend.upstream_headers()) as stream:
                    lines = stream.aiter_lines()
                    reading = asyncio.ensure_future(_drain(lines))
                    while await probes.engine_requests(backend) != 1:  # until the stream runs
                        await asyncio.sleep(0.02)
                    missed = []
                    for _ in range(checks):
                        missed.append(not await probes.healthy(backend, settings.health_timeout_s))  # waits behind the stream
                        await watchdog.check_all(settings)
                        assert backend.failure is None, f"a busy engine was taken for a frozen one: {backend.failure}"
                        await moved_since_the_last_check(probes)  # tokens flowed after the check: the next one sees them
                    signal_group(engine.pid, signal.SIGSTOP)  # frozen with the request in flight
                    try:
                        for _ in range(settings.watchdog.unhealthy_after):
                            await watchdog.check_all(settings)
                    finally:
                        signal_group(engine.pid, signal.SIGCONT)
                    reading.cancel()
                    await asyncio.gather(reading, return_exceptions=True)
            finally:
                await client.aclose()
                await watchdog.close()  # the scheduled restart
                await probes.aclose()
            return missed, backend.failure

        missed, failure = asyncio.run(scenario())
    assert all(missed), missed  # every probe of the busy engine failed
    sample = state.metrics.registry.get_sample_value
    # Each check after the first saw tokens made since the one before (the first, only those made while its probe waited).
    assert sample("gateway_engine_busy_probes_total", {"model": "m"}) >= checks - 1
    assert failure is not None and "failed 2 /health probes in a row with no progress; restarting (attempt 1)" in failure, failure
    assert watchdog.model("m").restarts == 0  # scheduled, then cancelled by close(): the backoff is long


async def _drain(lines: AsyncIterator[str]) -> None:
    async for _ in lines:
        pass
