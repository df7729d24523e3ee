"""A batch yields its model's engine to interactive requests: while one runs, the batch keeps at most
``max_concurrency_beside_interactive`` lines on the engine, and goes back to ``max_concurrency`` once they stop.

End to end with a FAKE engine (a ``url:`` model that answers in its own time and says in ``/metrics`` how many requests
it runs, as SGLang's ``sglang:num_running_reqs`` does); the rule itself on an injected clock and load."""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator

import httpx
import openai
import pytest

from gateway.batches.yielding import HOLD_S, Yielding
from gateway.config import BatchSettings
from tests.batches.helpers import chat_lines, upload, wait_ended
from tests.fake_engine import running_fake_engine
from tests.gateway_server import GatewayServer, serve
from tests.waiting import wait_until

FULL, BESIDE = 4, 1


@pytest.fixture(scope="module")
def engine_and_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, GatewayServer]]:
    with running_fake_engine(tmp_path_factory.mktemp("fake"), env={"FAKE_ENGINE_TOKEN_S": "0.01"}) as url:
        settings = {
            "state_dir": str(tmp_path_factory.mktemp("state")),
            "batches": {"max_concurrency": FULL, "max_concurrency_beside_interactive": BESIDE, "poll_interval_s": 0.2},
        }
        with serve({"m": {"url": url}}, settings) as gateway:
            yield url, gateway


def _running(engine_url: str) -> int:
    """Requests the FAKE engine runs now (its ``sglang:num_running_reqs``)."""
    text = httpx.get(engine_url + "/metrics", timeout=5).text
    found = re.search(r"sglang:num_running_reqs\{[^}]*\} (\d+)", text)
    assert found, text
    return int(found.group(1))


def test_a_batch_keeps_one_line_beside_an_interactive_stream_and_takes_the_engine_back_after(
    engine_and_gateway: tuple[str, GatewayServer],
) -> None:
    engine, gateway = engine_and_gateway
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="none", max_retries=0, timeout=60)
    batch = client.batches.create(input_file_id=upload(client, chat_lines(200, max_tokens=30)), endpoint="/v1/chat/completions", completion_window="24h")
    wait_until(lambda: _running(engine) == FULL, lambda: f"the batch runs {FULL} lines (engine runs {_running(engine)})", 30, 0.02)

    streamed = threading.Event()
    interactive = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 500, "stream": True}

    def chat() -> None:  # 500 tokens at 10 ms: the engine runs it ~5 s
        with httpx.stream("POST", gateway.url + "/v1/chat/completions", json=interactive, timeout=60) as answer:
            for _ in answer.iter_lines():
                streamed.set()

    talker = threading.Thread(target=chat)
    talker.start()
    try:
        wait_until(streamed.is_set, "the interactive stream started", 10, 0.01)
        # the lines running when it came finish (30 tokens: 0.3 s); no more than BESIDE start beside it
        wait_until(lambda: _running(engine) <= BESIDE + 1, lambda: f"the batch yields (engine runs {_running(engine)})", 10, 0.02)
        seen = [_running(engine) for _ in range(20) if talker.is_alive()]
        assert seen and max(seen) <= BESIDE + 1, seen
    finally:
        talker.join(timeout=30)
    wait_until(lambda: _running(engine) == FULL, lambda: f"the batch takes the engine back (engine runs {_running(engine)})", 10, 0.02)
    done = wait_ended(client, batch.id)
    assert (done.status, done.request_counts.completed, done.request_counts.failed) == ("completed", 200, 0)


def test_the_rule_full_alone_beside_others_and_for_a_moment_after() -> None:
    now, load = [100.0], {"m": 0}
    yielding = Yielding(load.get, BatchSettings(max_concurrency=4, max_concurrency_beside_interactive=2), clock=lambda: now[0])

    def lines(count: int, others: int) -> bool:
        """Whether one more line may start with ``count`` lines running and ``others`` requests beside them."""
        yielding.running["m"] = yielding.sending["m"] = count
        load["m"] = count + others
        return yielding.room("m")

    assert lines(3, 0) and not lines(4, 0)  # alone: up to max_concurrency
    assert lines(1, 1) and not lines(2, 1)  # beside an interactive request: up to 2
    assert not lines(2, 0)  # it ended: held back a moment more
    now[0] += HOLD_S / 2
    assert not lines(2, 0)
    now[0] += HOLD_S
    assert lines(3, 0)  # the hold is over
    yielding.leave("m")
    assert yielding.running["m"] == 2
    assert Yielding(lambda model: None, BatchSettings()).room("gone")  # a model no longer served holds nothing back


def test_lines_that_have_their_answers_do_not_hide_an_interactive_request() -> None:
    """Lines answered but still being recorded are running and no longer in the load: the interactive request beside
    them is seen all the same (compared with the running lines, a load of 1 beside 4 of them looked like none)."""
    load = {"m": 0}
    yielding = Yielding(load.get, BatchSettings(max_concurrency=4, max_concurrency_beside_interactive=1))
    yielding.running["m"] = 4
    for _ in range(4):
        with yielding.sent("m"):
            load["m"] += 1
        load["m"] -= 1  # its answer came: its lease is given back before its result is written
    load["m"] = 1  # the interactive stream
    for _ in range(3):
        yielding.leave("m")  # three of the four are recorded
    assert yielding.running["m"] == 1 and not yielding.sending["m"]
    assert not yielding.room("m")  # one line beside the interactive stream, not four
    yielding.leave("m")
    assert yielding.room("m") and yielding.running["m"] == 0  # and one may start once it is recorded
