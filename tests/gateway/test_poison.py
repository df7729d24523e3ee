"""Requests that can crash an engine (gateway.core.poison): token id checks, request shapes, the quarantine (pure)."""

from __future__ import annotations

import pytest

from engine_guard.shapes import fields_of, payload_shape, request_shape
from engine_guard.token_ids import token_id_problem
from gateway.core.errors import GatewayError
from gateway.core.poison import Quarantine

PROMPT = ("prompt",)


def test_token_ids_inside_the_vocabulary_pass() -> None:
    assert token_id_problem(PROMPT, {"prompt": [0, 1, 99]}, 100) is None
    assert token_id_problem(PROMPT, {"prompt": [[0, 5], [99]]}, 100) is None
    assert token_id_problem(PROMPT, {"prompt": [10**9]}, None) is None  # vocabulary unknown: only negatives refused
    assert token_id_problem(PROMPT, {"prompt": []}, 100) is None


def test_an_id_at_or_above_the_vocabulary_is_refused() -> None:
    assert token_id_problem(PROMPT, {"prompt": [1, 100]}, 100) == "prompt: token id 100 is outside the model's vocabulary [0, 100)"
    problem = token_id_problem(PROMPT, {"prompt": [[1], [2, 150]]}, 100)
    assert problem is not None and "token id 150" in problem


def test_negative_ids_are_always_refused() -> None:
    assert token_id_problem(PROMPT, {"prompt": [3, -1]}, None) == "prompt: token id -1 is negative"
    assert token_id_problem(PROMPT, {"prompt": [[0], [-7]]}, 100) == "prompt: token id -7 is negative"


def test_only_ints_are_token_ids() -> None:
    # text prompts, floats, booleans (True is an int in Python) and nested junk are other checks' business
    assert token_id_problem(PROMPT, {"prompt": "text"}, 100) is None
    assert token_id_problem(PROMPT, {"prompt": ["text", 2.5e9, True, None]}, 1) is None
    assert token_id_problem(PROMPT, {"prompt": [[1], "text", 500]}, 100) is None  # a batch: rows that are not lists skipped
    assert token_id_problem(PROMPT, {"prompt": ["text", [500]]}, 100) is None  # a single row: its lists are not ids
    # what is skipped does not hide what follows it
    assert token_id_problem(PROMPT, {"prompt": [[1], "text", [500]]}, 100) == "prompt: token id 500 is outside the model's vocabulary [0, 100)"
    assert token_id_problem(PROMPT, {"prompt": ["text", True, 2.5, 500]}, 100) == "prompt: token id 500 is outside the model's vocabulary [0, 100)"


def test_every_field_is_checked_and_named() -> None:
    fields = ("input_ids", "stop_token_ids")
    assert token_id_problem(fields, {"input_ids": [1], "stop_token_ids": [200]}, 100) == (
        "stop_token_ids: token id 200 is outside the model's vocabulary [0, 100)"
    )
    assert token_id_problem(fields, {"other": [-1]}, 100) is None
    assert token_id_problem(fields, {"input_ids": None, "stop_token_ids": [-2]}, 100) == "stop_token_ids: token id -2 is negative"


def test_logit_bias_keys_are_token_ids() -> None:
    fields = ("logit_bias",)
    assert token_id_problem(fields, {"logit_bias": {"5": 1.0, "99": -100}}, 100) is None
    assert token_id_problem(fields, {"logit_bias": {"5": 1.0, "100": 1}}, 100) == (
        "logit_bias: token id 100 is outside the model's vocabulary [0, 100)"
    )
    assert token_id_problem(fields, {"logit_bias": {"-3": 1}}, 100) == "logit_bias: token id -3 is negative"
    assert token_id_problem(fields, {"logit_bias": {"5": 1, "a5": 1}}, 100) == (
        "logit_bias: keys must be token ids (integers as strings)"
    )
    assert token_id_problem(fields, {"logit_bias": {}}, 100) is None
    for key in ("X5", "5-", "", "-"):
        assert token_id_problem(fields, {"logit_bias": {key: 1}}, 100) == "logit_bias: keys must be token ids (integers as strings)"


@pytest.mark.parametrize("key", ["--5", "\u00b2"])
def test_logit_bias_keys_that_only_look_numeric(key: str) -> None:
    assert token_id_problem(("logit_bias",), {"logit_bias": {key: 1}}, 100) == "logit_bias: keys must be token ids (integers as strings)"


def test_a_shape_is_types_and_size_classes() -> None:
    base = request_shape("/v1/completions", {"model": "a", "prompt": "hello world", "max_tokens": 8})
    # another word of the same length class, another model, another max_tokens of the same class: the same shape
    assert request_shape("/v1/completions", {"model": "b", "prompt": "hello there", "max_tokens": 9}) == base
    assert request_shape("/v1/completions", {"max_tokens": 8, "prompt": "hello world"}) == base  # key order, model
    # another route, a field more, a retyped field, another size class: other shapes
    assert request_shape("/v1/chat/completions", {"prompt": "hello world", "max_tokens": 8}) != base
    assert request_shape("/v1/completions", {"prompt": "hello world", "max_tokens": 8, "n": 2}) != base
    assert request_shape("/v1/completions", {"prompt": ["hello world"], "max_tokens": 8}) != base
    assert request_shape("/v1/completions", {"prompt": "hello world" * 4, "max_tokens": 8}) != base
    assert base.startswith("/v1/completions {") and base.endswith("}") and "model" not in base


@pytest.mark.parametrize(
    ("same", "other"),
    [
        (("", ""), ("", "a")),  # empty: its own class
        (("a", "b"), ("a", "ab")),  # 1 | 2-3
        (("ab", "abc"), ("abc", "abcd")),  # 2-3 | 4-7
        (("abcd", "abcdefg"), ("abcdefg", "abcdefgh")),  # 4-7 | 8-15
    ],
)
def test_size_classes_are_powers_of_two(same: tuple[str, str], other: tuple[str, str]) -> None:
    def shape(text: str) -> str:
        return request_shape("/p", {"prompt": text})

    assert shape(same[0]) == shape(same[1])
    assert shape(other[0]) != shape(other[1])


@pytest.mark.parametrize(
    ("same", "other"),
    [
        ((True, True), (True, False)),
        ((3, 2), (3, 4)),  # ints: size classes of their value
        ((-1, -500), (-1, 0)),  # every negative int is alike
        ((0, 0), (0, 1)),
        ((0.5, 0.99), (0.5, 1.0)),  # floats: negative, zero, below one, then size classes
        ((-0.5, -3.0), (-0.5, 0.0)),
        ((0.0, 0.0), (0.0, 0.5)),
        ((2.0, 3.9), (3.9, 4.0)),
        ((None, None), (None, 0)),
        (([2, 3], [3, 2]), ([2, 3], [2, 3, 2, 3])),  # lists: length class and their elements' shapes
        (([2, 3], [3, 3]), ([1], ["a"])),
        (({"a": 1}, {"a": 1}), ({"a": 1}, {"b": 1})),  # objects: their keys and values
        (({"a": 1}, {"a": 1}), ({"a": 1}, {"a": "x"})),
        ((1, 1), (1, 1.0)),
        (("x", "y"), ("x", 1)),
        ((1, 1), (True, 1)),
        ((1, 1), (1, [1])),
    ],
)
def test_values_keep_or_change_the_shape(same: tuple, other: tuple) -> None:
    def shape(value: object) -> str:
        return request_shape("/p", {"v": value})

    assert shape(same[0]) == shape(same[1])
    assert shape(other[0]) != shape(other[1])


def test_values_are_described_three_levels_deep() -> None:
    def shape(value: object) -> str:
        return request_shape("/p", {"v": value})

    # the third level counts: an element there of another type or length changes the shape ...
    assert shape([[["a"]]]) != shape([[[1]]])
    assert shape([{"k": ["a"]}]) != shape([{"k": ["a", "b"]}])
    # ... but below it only the length class of a container does
    assert shape([[[["a"]]]]) == shape([[[[1]]]])
    assert shape([[[{"a": 1}]]]) == shape([[[{"b": "x"}]]])
    assert shape([[[{"a": 1}]]]) != shape([[[{"a": 1, "b": 2}]]])
    # duplicate elements are one: a list of many alike items is its length class and one item's shape
    assert shape(["a", "b", "c"]) == shape(["a", "b", "c", "a"][:3])
    assert shape([1, "a"]) == shape(["a", 1])


def test_an_unknown_type_is_named() -> None:
    assert request_shape("/p", {"v": b"raw"}) != request_shape("/p", {"v": "raw"})
    assert "bytes" in request_shape("/p", {"v": b"raw"})


def test_payload_shape_parses_what_was_sent() -> None:
    assert payload_shape("/p", b'{"model": "m", "prompt": "hi"}') == request_shape("/p", {"prompt": "hi"})
    assert payload_shape("/p", b"[1, 2]") == request_shape("/p", {"body": [1, 2]})
    assert payload_shape("/p", b"not json") == request_shape("/p", {"unparsed": "not json"})
    assert payload_shape("/p", b"\xff{") == request_shape("/p", {"unparsed": "\ufffd{"})


def test_fields_of_a_shape() -> None:
    shape = request_shape("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{"a": 1}], "n": 1})
    assert fields_of(shape) == ("messages", "n", "tools")
    assert fields_of(request_shape("/p", {})) == ()
    assert fields_of("no-space") == ()
    assert fields_of("/p {a:{x:int1,y:str1},b:list1[int1,str2]}") == ("a", "b")


def test_the_only_suspect_of_a_crash_is_refused_at_once() -> None:
    quarantine = Quarantine()
    assert not quarantine
    shape = request_shape("/v1/completions", {"prompt": [1, 2]})
    assert quarantine.engine_failed("m", [shape, shape], "exit code -11") == [shape]  # the same shape twice is one
    assert quarantine
    with pytest.raises(GatewayError) as refused:
        quarantine.check("m", shape)
    assert refused.value.status == 400 and refused.value.code == "request_quarantined"
    assert "fields prompt" in refused.value.message and "'m'" in refused.value.message
    quarantine.check("other-model", shape)  # per model
    quarantine.check("m", request_shape("/v1/completions", {"prompt": "text"}))  # another shape passes
    assert quarantine.engine_failed("m", [shape], "again") == []  # already refused: not new


def test_a_shape_without_fields_is_named_so() -> None:
    quarantine = Quarantine()
    shape = request_shape("/v1/models", {})
    quarantine.engine_failed("m", [shape], "crash")
    with pytest.raises(GatewayError, match="fields none"):
        quarantine.check("m", shape)


def test_one_of_several_suspects_is_refused_at_its_second_failure() -> None:
    quarantine = Quarantine()
    a, b, c = (request_shape("/p", {name: 1}) for name in "abc")
    assert quarantine.engine_failed("m", [a, b], "first crash") == []
    assert not quarantine
    quarantine.check("m", a)
    assert quarantine.engine_failed("m", [a, c], "second crash") == [a]
    assert quarantine
    with pytest.raises(GatewayError):
        quarantine.check("m", a)
    quarantine.check("m", b)
    quarantine.check("m", c)
    (entry,) = quarantine.report()
    assert entry["model"] == "m" and entry["shape"] == a and entry["fields"] == ["a"]
    assert entry["strikes"] == 2 and entry["cause"] == "second crash" and entry["since"] > 0


def test_clear_per_model_or_all() -> None:
    quarantine = Quarantine()
    a, b = request_shape("/p", {"a": 1}), request_shape("/p", {"b": 1})
    quarantine.engine_failed("m", [a], "x")
    quarantine.engine_failed("n", [a], "x")
    quarantine.engine_failed("n", [b, a], "y")  # b: one strike, not refused
    assert quarantine.clear("m") == 1
    quarantine.check("m", a)
    with pytest.raises(GatewayError):
        quarantine.check("n", a)
    assert quarantine
    assert quarantine.clear() == 1  # counts the refused shapes, not the suspects
    assert not quarantine and quarantine.report() == []
    assert quarantine.engine_failed("n", [b], "z") == [b]  # b's earlier strike was forgotten too: refused as the only one
    assert quarantine.report()[0]["strikes"] == 1


def test_old_suspects_that_are_not_refused_are_forgotten_first() -> None:
    quarantine = Quarantine(max_entries=2)
    refused, *suspects = (request_shape("/p", {name: 1}) for name in "abcd")
    quarantine.engine_failed("m", [refused], "crash")
    quarantine.engine_failed("m", suspects[:2], "crash")  # three records: the oldest unrefused one goes
    quarantine.engine_failed("m", [suspects[0], suspects[2]], "crash")
    # b was forgotten (its second failure does not count as its second), c is kept; a stays refused throughout
    assert [entry["shape"] for entry in quarantine.report()] == [refused]
    with pytest.raises(GatewayError):
        quarantine.check("m", refused)


def test_when_every_record_is_refused_the_oldest_goes() -> None:
    quarantine = Quarantine(max_entries=1)
    a, b = request_shape("/p", {"a": 1}), request_shape("/p", {"b": 1})
    quarantine.engine_failed("m", [a], "crash")
    assert quarantine.engine_failed("m", [b], "crash") == [b]
    assert [entry["shape"] for entry in quarantine.report()] == [b]
    quarantine.check("m", a)
    assert quarantine.clear() == 1 and not quarantine  # the count followed the eviction


def test_what_an_operator_reads_in_a_shape() -> None:
    """The admin API lists refused shapes as they are: every kind of value spelled as the module documents it
    (type and size class: 0 for empty, then the bit length; containers with their elements, deduplicated and
    sorted, or only their size below the third level; objects with their sorted keys)."""
    body = {
        "model": "m",
        "echo": True,
        "logprobs": False,
        "seed": -3,
        "n": 5,
        "temperature": 0.0,
        "top_p": 0.5,
        "presence_penalty": -1.5,
        "max_tokens": 300.0,
        "user": None,
        "prompt": [[1, 2], [3]],
        "stop": "",
        "metadata": {"b": [[["x"]]], "a": {"k": {"deep": 1}}},  # containers three deep, then their size
        "raw": b"?",
    }
    assert request_shape("/v1/completions", body) == (
        "/v1/completions {"
        "echo:true,logprobs:false,max_tokens:float9,"
        "metadata:{a:{k:{deep:int1}},b:list1[list1[list1]]},"
        "n:int3,presence_penalty:float-,prompt:list2[list1[int2],list2[int1,int2]],"
        "raw:bytes,seed:int-,stop:str0,temperature:float0,top_p:float<1,user:null}"
    )


def test_a_shape_looks_at_the_first_256_items_and_64_keys() -> None:
    def shape(value: object) -> str:
        return request_shape("/p", {"v": value})

    # the work per request is bounded: what lies beyond is not described (only the size class counts)
    assert shape(["a"] * 256 + [1]) == shape(["a"] * 256 + ["b"])
    assert shape(["a"] * 255 + [1]) != shape(["a"] * 255 + ["b"])
    keys = {f"k{index:03d}": 1 for index in range(64)}
    assert shape({**keys, "z": 1}) == shape({**keys, "z": "text"})
    assert shape({**dict(list(keys.items())[:63]), "z": 1}) != shape({**dict(list(keys.items())[:63]), "z": "text"})


def test_objects_are_described_three_levels_deep() -> None:
    def shape(value: object) -> str:
        return request_shape("/p", {"v": value})

    assert shape({"a": {"b": {"x": 1}}}) != shape({"a": {"b": {"y": 1}}})  # the third level's keys count
    assert shape({"a": {"b": {"c": {"x": 1}}}}) == shape({"a": {"b": {"c": {"y": "s"}}}})  # the fourth's do not
    assert shape([[{"a": 1}]]) != shape([[{"b": 1}]])


def test_fields_of_names_with_spaces_and_brackets_in_values() -> None:
    shape = request_shape("/p", {"a b": 1, "X": [{"Y": "z"}], "c:d": {"e": [1]}})
    assert fields_of(shape) == ("X", "a b", "c")  # a name is cut at its first colon
    assert fields_of(request_shape("/p", {"only": {"nested": {"x": 1, "y": [1, 2]}}})) == ("only",)


def test_the_refusal_lists_the_shapes_fields() -> None:
    quarantine = Quarantine()
    shape = request_shape("/v1/completions", {"prompt": [1], "max_tokens": 1})
    quarantine.engine_failed("tiny", [shape], "crash")
    with pytest.raises(GatewayError) as refused:
        quarantine.check("tiny", shape)
    assert refused.value.message == (
        "requests of this shape (fields max_tokens, prompt) took the engine of model 'tiny' down and are refused "
        "until an operator clears them; change the request, or ask the operator"
    )


def test_a_failure_is_held_against_the_key_with_a_shape_only_it_sent() -> None:
    quarantine = Quarantine()
    ordinary = request_shape("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    crafted = request_shape("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 40}], "n": 2})
    suspects = [(ordinary, "a"), (crafted, "a"), (ordinary, "b")]
    assert quarantine.engine_failed("m", suspects, "froze") == []
    assert quarantine.engine_failed("m", suspects, "froze") == [ordinary, crafted]
    for shape in (ordinary, crafted):
        with pytest.raises(GatewayError):
            quarantine.check("m", shape, "a")
    quarantine.check("m", ordinary, "b")  # b only sent what a sent too: not implicated
    quarantine.check("m", crafted, "c")
    assert {entry["shape"]: (entry["refused_for"], entry["everyone"], entry["evidence"]) for entry in quarantine.report()} == {
        ordinary: (["a"], False, {"a": 2}), crafted: (["a"], False, {"a": 2}),
    }


def test_a_shape_is_refused_for_everyone_on_two_keys_evidence() -> None:
    quarantine = Quarantine()
    shape = request_shape("/v1/completions", {"prompt": [1, 2]})
    assert quarantine.engine_failed("m", [(shape, "a")], "crashed") == [shape]  # alone: refused for a at once
    quarantine.check("m", shape, "b")
    assert quarantine.engine_failed("m", [(shape, "b")], "crashed") == [shape]  # now for everyone
    with pytest.raises(GatewayError):
        quarantine.check("m", shape, "c")
    restored = Quarantine()
    restored.restore(quarantine.records())  # what a worker process receives
    with pytest.raises(GatewayError):
        restored.check("m", shape, None)


def test_records_of_other_replicas_merge_and_clears_are_said() -> None:
    """Replicas sharing a store: another's refusals add up with this one's; a change here is said, a merge is not."""
    mine, theirs = Quarantine(), Quarantine()
    said = []
    mine.on_change = lambda: said.append(1)
    shape = request_shape("/v1/completions", {"prompt": [1, 2]})
    mine.engine_failed("m", [(shape, "k1"), (request_shape("/p", {"a": 1}), "k1")], "first")  # one strike for k1
    assert said == [] and not mine
    theirs.engine_failed("m", [(shape, "k2")], "crashed there")  # the only suspect there: refused for k2
    mine.merge(theirs.refusing())
    assert said == [] and mine
    mine.check("m", shape, "k1")  # k1 had one strike here: still passes
    with pytest.raises(GatewayError):
        mine.check("m", shape, "k2")
    mine.engine_failed("m", [(shape, "k1")], "second")  # k1's second strike: refused for two keys, for everyone
    assert said == [1] and mine.refusing()[("m", shape)].blocked
    theirs.merge(mine.refusing())
    with pytest.raises(GatewayError):
        theirs.check("m", shape, "k3")
    assert mine.refusing()[("m", shape)] == theirs.refusing()[("m", shape)]  # merged both ways: the same record
    theirs.merge({}, gone=[("m", shape)])  # cleared on another replica
    assert not theirs
    assert mine.clear("m") == 1 and said == [1, 1]


def test_a_shape_the_engine_answered_before_is_not_evidence() -> None:
    """The bystander case: a steady client's ordinary shape, answered many times, in flight at each of
    an attacker's crashes with crafted shapes. The crafted one is the only evidence: refused at once for its key."""
    quarantine = Quarantine()
    ordinary = request_shape("/v1/chat/completions", {"messages": [{"role": "user", "content": "line"}], "max_tokens": 4})
    first, second = (request_shape("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 17}], "max_tokens": n}) for n in (2, 50))
    for crafted in (first, second):
        suspects = [(ordinary, "victim", True), (crafted, "attacker", False), (ordinary, "victim", True)]
        assert quarantine.engine_failed("m", suspects, "crashed") == [crafted]
        quarantine.check("m", ordinary, "victim")
        with pytest.raises(GatewayError):
            quarantine.check("m", crafted, "attacker")
        quarantine.check("m", crafted, "victim")  # one key's evidence: refused for that key only
    assert [(entry["shape"], entry["refused_for"]) for entry in quarantine.report()] == [(first, ["attacker"]), (second, ["attacker"])]


def test_when_every_suspect_was_answered_before_all_are_evidence() -> None:
    """A crash that depends on the bytes, not the shape: nothing tells the suspects apart, so they count as before."""
    quarantine = Quarantine()
    a, b = request_shape("/p", {"a": 1}), request_shape("/p", {"b": 1})
    assert quarantine.engine_failed("m", [(a, "k1", True), (b, "k2", True)], "crashed") == []
    assert quarantine.engine_failed("m", [(a, "k1", True), (b, "k2", True)], "crashed") == [a, b]
    assert {(entry["shape"], tuple(entry["refused_for"])) for entry in quarantine.report()} == {(a, ("k1",)), (b, ("k2",))}


def test_one_freeze_never_condemns_a_shape_the_engine_had_answered() -> None:
    """A bystander's plain chat, answered in full many times, the only request in flight when the engine froze under
    work another key had left behind: not refused for it on that one failure; and a plain shape sent by two keys at a
    freeze is never refused for everyone on one failure (an attacker keeping one in flight beside a bystander's)."""
    plain = request_shape("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 16})
    alone = Quarantine()
    assert alone.engine_failed("m", [(plain, "bystander", True)], "froze") == []
    alone.check("m", plain, "bystander")
    assert alone.engine_failed("m", [(plain, "bystander", True)], "froze") == [plain]  # its second failure: for its key
    with pytest.raises(GatewayError):
        alone.check("m", plain, "bystander")
    alone.check("m", plain, "someone")
    shared = Quarantine()
    assert shared.engine_failed("m", [(plain, "attacker", True), (plain, "bystander", True)], "froze") == []
    for key in ("attacker", "bystander", "someone"):
        shared.check("m", plain, key)


def test_work_left_behind_is_the_evidence_not_the_plain_requests_beside_it() -> None:
    """The attacker's aborted request (a grammar the engine went on compiling) lingers as a suspect: it is the only
    shape never answered, so it alone is held against the attacker, whatever plain requests were in flight."""
    quarantine = Quarantine()
    plain = request_shape("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 16})
    costly = request_shape("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}})
    suspects = [(plain, "attacker", True), (plain, "bystander", True), (costly, "attacker", False)]
    assert quarantine.engine_failed("m", suspects, "froze") == [costly]
    with pytest.raises(GatewayError):
        quarantine.check("m", costly, "attacker")
    quarantine.check("m", plain, "bystander")
    quarantine.check("m", plain, "attacker")
