"""The request guard's walks in C (engine_guard/_walk.c) give the answers of their Python definitions: a request's
shape (what the quarantine refuses) and whether its body nests too deep, for any JSON value and a few that are not."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_guard import _walk, schemas, shapes
from engine_guard.schemas import MAX_NESTING, nested_deeper_than
from engine_guard.shapes import _describe

_SCALARS = (
    st.none() | st.booleans() | st.integers() | st.integers(min_value=2**62, max_value=2**80)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=40) | st.text(min_size=60, max_size=300)
)  # fmt: skip
_JSON = st.recursive(
    _SCALARS,
    lambda inner: st.lists(inner, max_size=12) | st.dictionaries(st.text(max_size=6), inner, max_size=10),
    max_leaves=80,
)


@settings(max_examples=400, deadline=None)
@given(value=_JSON, depth=st.integers(min_value=-1, max_value=5))
def test_the_native_shape_is_the_definitions(value: Any, depth: int) -> None:
    assert _walk.describe(value, depth) == _describe(value, depth)


@settings(max_examples=400, deadline=None)
@given(value=_JSON, limit=st.integers(min_value=0, max_value=8))
def test_the_native_depth_check_is_the_definitions(value: Any, limit: int) -> None:
    assert _walk.deeper_than(value, limit) is nested_deeper_than(value, limit)


def _chain(levels: int, leaf: Any = 1) -> Any:
    value = leaf
    for level in range(levels):
        value = [value] if level % 2 else {"k": value, "other": "x"}
    return value


@pytest.mark.parametrize("levels", [MAX_NESTING - 1, MAX_NESTING, MAX_NESTING + 1, 5000])
def test_deep_bodies_are_judged_alike_at_the_limit_and_far_past_it(levels: int) -> None:
    body = {"messages": [{"role": "user", "content": "x"}], "metadata": _chain(levels)}
    expected = levels + 1 > MAX_NESTING  # (the body itself is a level)
    assert nested_deeper_than(body, MAX_NESTING) is expected
    assert _walk.deeper_than(body, MAX_NESTING) is expected  # 5,000 levels: no recursion past the limit


# Values a parsed JSON body never holds, which the MLflow wrapper's Python callers might: the same answer or error
ODD = [(1, 2), {1: "a", 2: "b"}, [2**200, -(2**200), 1e300, -0.0, 0.5, 1.0]]


@pytest.mark.parametrize("value", ODD, ids=["tuple", "int-keys", "big-numbers"])
def test_values_json_never_holds_are_described_alike(value: Any) -> None:
    assert _walk.describe(value, 3) == _describe(value, 3)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), {"a": 1, 2: "b"}], ids=["nan", "inf", "mixed-keys"])
def test_what_the_definition_cannot_describe_fails_the_same_way(value: Any) -> None:
    with pytest.raises(Exception) as python_error:
        _describe(value, 3)
    with pytest.raises(Exception) as native_error:
        _walk.describe(value, 3)
    assert type(native_error.value) is type(python_error.value)
    assert str(native_error.value) == str(python_error.value)


def test_the_guard_uses_the_native_walks_where_they_are_built() -> None:
    assert shapes.describe is _walk.describe
    assert schemas.deeper_than is _walk.deeper_than


@settings(max_examples=300, deadline=None)
@given(body=st.dictionaries(st.sampled_from(["model", "messages", "stream", "a", "b", "tools"]) | st.text(max_size=4), _JSON, max_size=80))
def test_a_request_shape_is_its_route_and_each_field_but_the_models_described(body: dict[str, Any]) -> None:
    """The shape is described in one walk of the body less its model where it has at most 64 fields (the walk's cap),
    field by field otherwise: the same text either way."""
    fields = ",".join(f"{key}:{_describe(body[key], 3)}" for key in sorted(body) if key != "model")
    assert shapes.request_shape("/v1/chat/completions", body) == f"/v1/chat/completions {{{fields}}}"
    many = {f"f{index:03d}": index for index in range(70)} | body
    fields = ",".join(f"{key}:{_describe(many[key], 3)}" for key in sorted(many) if key != "model")
    assert shapes.request_shape("/v1/chat/completions", many) == f"/v1/chat/completions {{{fields}}}"
