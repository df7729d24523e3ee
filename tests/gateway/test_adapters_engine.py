"""LoRA adapters as models, end to end on the real SGLang CPU engine (one engine start).

A gateway from a YAML file owns an engine of the tiny model with two tiny adapters (``models.tiny.adapters``,
made offline by :mod:`tests.lora`). Each adapter is the model ``tiny:<adapter>``: listed by ``/v1/models`` with
its parent, answered at temperature 0 exactly as ``transformers`` answers with the adapter merged into the base
weights (and differently from the base model), also when both adapters and the base share one batch; an adapter
the YAML does not name is the gateway's 404, not the engine's. (A restart loads the adapters again from the
engine's command line, the same as its first start: the watchdog's restart is tested in test_swap.py (h).)
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.gateway.test_residency import Rig, gateway
from tests.lora import greedy_ids, make_adapter

PROMPT = "Hello! How can I help"
TOKENS = 12
ADAPTERS = {"a1": 1, "a2": 2}  # name -> seed


@pytest.fixture(scope="module")
def served(starts_engine: None, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Rig, dict[str, str]]]:
    """The gateway (its own engine, with the adapters) and the reference answer of each model name."""
    from transformers import AutoTokenizer

    tmp = tmp_path_factory.mktemp("adapters")
    paths = {name: make_adapter(tiny_model_dir, tmp / name, seed) for name, seed in ADAPTERS.items()}
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompt = tokenizer.encode(PROMPT)
    expected = {"tiny": tokenizer.decode(greedy_ids(tiny_model_dir, prompt, TOKENS))}
    for name, path in paths.items():
        expected[f"tiny:{name}"] = tokenizer.decode(greedy_ids(tiny_model_dir, prompt, TOKENS, path))
    assert len(set(expected.values())) == 3, expected  # the adapters change the answer: the test can tell them apart
    engine = {"model_path": str(tiny_model_dir), "device": "cpu", "dtype": "float32", "skip_server_warmup": True, "startup_timeout_s": 300}
    models = {"tiny": {"engine": engine, "adapters": {name: str(path) for name, path in paths.items()}}}
    # the gateway starts with its engine: on a loaded 2-core machine that takes minutes
    with gateway(tmp, models, timeout_s=120, start_timeout_s=400) as rig:
        yield rig, expected


def _completion(rig: Rig, model: str) -> Any:
    return rig.sdk.completions.create(model=model, prompt=PROMPT, max_tokens=TOKENS, temperature=0, extra_body={"ignore_eos": True})


def test_each_adapter_is_a_model_answering_as_transformers_with_it_merged(served: tuple[Rig, dict[str, str]]) -> None:
    rig, expected = served
    cards = rig.cards()
    assert {name: cards[name]["parent"] for name in expected} == {"tiny": None, "tiny:a1": "tiny", "tiny:a2": "tiny"}
    for model, text in expected.items():
        answer = _completion(rig, model)
        assert answer.model == model and answer.choices[0].text == text, (model, answer.choices[0].text, text)
    with pytest.raises(openai.NotFoundError) as missing:
        _completion(rig, "tiny:a3")  # not in the YAML: refused before the engine sees it
    assert missing.value.body["code"] == "model_not_found"
    # the same selection through chat completions (the adapter changes the answer there too)
    chats = {
        model: rig.sdk.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0)
        for model in expected
    }
    assert len({answer.choices[0].message.content for answer in chats.values()}) == 3, chats


def test_both_adapters_and_the_base_in_one_batch_each_get_their_own_answer(served: tuple[Rig, dict[str, str]]) -> None:
    rig, expected = served
    models = [*expected] * 3
    with ThreadPoolExecutor(len(models)) as pool:
        texts = list(pool.map(lambda model: _completion(rig, model).choices[0].text, models))
    assert texts == [expected[model] for model in models]
