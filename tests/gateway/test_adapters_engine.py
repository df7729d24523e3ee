"""LoRA adapters as models, end to end on the real SGLang CPU engine (one engine start).

A gateway from a YAML file owns an engine of the tiny model with two tiny adapters (``models.tiny.adapters``,
made offline by :mod:`tests.lora`). Each adapter is the model ``tiny:<adapter>``: listed by ``/v1/models`` with
its parent, answered at temperature 0 exactly as ``transformers`` answers with the adapter merged into the base
weights (and differently from the base model), also when both adapters and the base share one batch; an adapter
the YAML does not name is the gateway's 404, not the engine's. A reload that adds one adapter and removes another
loads and unloads them in the running engine through SGLang's API (the same engine process answers the new one as
``transformers`` does). (A restart loads the adapters again from the engine's command line, the same as its first
start: the watchdog's restart is tested in test_swap.py (h), and of adapters loaded at run time in test_adapters.py.)
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml

from tests.gateway.test_adapters import _reload
from tests.gateway.test_residency import Rig, gateway
from tests.lora import greedy_ids, make_adapter

PROMPT = "Hello! How can I help"
TOKENS = 12
ADAPTERS = {"a1": 1, "a2": 2}  # name -> seed: loaded at start
LATER = "a3"  # made with seed 3, loaded by a reload


@pytest.fixture(scope="module")
def served(starts_engine: None, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Rig, dict[str, str]]]:
    """The gateway (its own engine, with the adapters) and the reference answer of each model name."""
    from transformers import AutoTokenizer

    tmp = tmp_path_factory.mktemp("adapters")
    paths = {name: make_adapter(tiny_model_dir, tmp / name, seed) for name, seed in ADAPTERS.items()}
    later = make_adapter(tiny_model_dir, tmp / LATER, 3)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompt = tokenizer.encode(PROMPT)
    expected = {"tiny": tokenizer.decode(greedy_ids(tiny_model_dir, prompt, TOKENS))}
    for name, path in paths.items():
        expected[f"tiny:{name}"] = tokenizer.decode(greedy_ids(tiny_model_dir, prompt, TOKENS, path))
    assert len(set(expected.values())) == 3, expected  # the adapters change the answer: the test can tell them apart
    expected[f"tiny:{LATER}"] = tokenizer.decode(greedy_ids(tiny_model_dir, prompt, TOKENS, later))
    engine = {"model_path": str(tiny_model_dir), "device": "cpu", "dtype": "float32", "skip_server_warmup": True, "startup_timeout_s": 300}
    models = {"tiny": {"engine": engine, "adapters": {name: str(path) for name, path in paths.items()}}}
    # the gateway starts with its engine: on a loaded 2-core machine that takes minutes
    with gateway(tmp, models, timeout_s=120, start_timeout_s=400) as rig:
        yield rig, expected


def _completion(rig: Rig, model: str) -> Any:
    return rig.sdk.completions.create(model=model, prompt=PROMPT, max_tokens=TOKENS, temperature=0, extra_body={"ignore_eos": True, "skip_special_tokens": False})


def test_each_adapter_is_a_model_answering_as_transformers_with_it_merged(served: tuple[Rig, dict[str, str]]) -> None:
    rig, expected = served
    cards = rig.cards()
    assert {name: cards[name]["parent"] for name in expected if name != f"tiny:{LATER}"} == {"tiny": None, "tiny:a1": "tiny", "tiny:a2": "tiny"}
    for model, text in expected.items():
        if model == f"tiny:{LATER}":
            continue
        answer = _completion(rig, model)
        assert answer.model == model and answer.choices[0].text == text, (model, answer.choices[0].text, text)
    with pytest.raises(openai.NotFoundError) as missing:
        _completion(rig, "tiny:a3")  # not in the YAML: refused before the engine sees it
    assert missing.value.body["code"] == "model_not_found"
    # the same selection through chat completions (the adapter changes the answer there too)
    chats = {
        model: rig.sdk.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0)
        for model in ("tiny", "tiny:a1", "tiny:a2")
    }
    assert len({answer.choices[0].message.content for answer in chats.values()}) == 3, chats


def test_both_adapters_and_the_base_in_one_batch_each_get_their_own_answer(served: tuple[Rig, dict[str, str]]) -> None:
    rig, expected = served
    models = ["tiny", "tiny:a1", "tiny:a2"] * 3
    with ThreadPoolExecutor(len(models)) as pool:
        texts = list(pool.map(lambda model: _completion(rig, model).choices[0].text, models))
    assert texts == [expected[model] for model in models]


def test_a_reload_loads_and_unloads_adapters_in_the_running_engine(served: tuple[Rig, dict[str, str]]) -> None:
    rig, expected = served
    started = yaml.safe_load(rig.path.read_text())["models"]["tiny"]["adapters"]
    pid = rig.models()["tiny"]["engine"]["pid"]
    later = str(Path(started["a1"]).with_name(LATER))
    try:
        item = _reload(rig, {"a2": started["a2"], LATER: later})
        assert item["action"] == "adapters_changed" and item["adapters"] == {"a1": "unloaded", LATER: "loaded"}, item
        answer = _completion(rig, f"tiny:{LATER}")
        assert answer.choices[0].text == expected[f"tiny:{LATER}"], answer.choices[0].text
        assert _completion(rig, "tiny:a2").choices[0].text == expected["tiny:a2"]
        with pytest.raises(openai.NotFoundError):
            _completion(rig, "tiny:a1")
        assert rig.models()["tiny"]["engine"]["pid"] == pid  # the same engine process
    finally:  # the other tests of the module find the adapters of the start
        restored = _reload(rig, started)
    assert restored["adapters"] == {LATER: "unloaded", "a1": "loaded"}, restored
    assert _completion(rig, "tiny:a1").choices[0].text == expected["tiny:a1"]
