"""The reload plan: what changes per model between two validated configs (pure, no engine)."""

from __future__ import annotations

from typing import Any

from gateway.config import gateway_settings
from gateway.control.adapters import adapter_change
from gateway.control.reload import Action, plan_reload
from launch.config import parse_config

ENGINE = {"model_path": "/models/tiny", "device": "cpu", "max_total_tokens": 4096}


def _plan(old_models: dict[str, Any], new_models: dict[str, Any], old_gw: dict | None = None, new_gw: dict | None = None):
    # a reload re-reads the same file (whose path also names the default gateway.state_dir)
    old = parse_config({"models": old_models, "gateway": old_gw or {}}, "deploy.yaml")
    new = parse_config({"models": new_models, "gateway": new_gw or {}}, "deploy.yaml")
    return plan_reload(old, gateway_settings(old), new, gateway_settings(new))


def _actions(plan) -> dict[str, Action]:
    return {change.name: change.action for change in plan.changes}


def test_identical_configs_are_a_noop() -> None:
    models = {"a": {"engine": ENGINE, "aliases": ["x"]}, "b": {"url": "http://h:1"}}
    plan = _plan(models, models)
    assert _actions(plan) == {"a": Action.UNCHANGED, "b": Action.UNCHANGED}
    assert plan.is_noop


def test_added_removed_and_order() -> None:
    plan = _plan({"a": {"url": "http://h:1"}, "b": {"url": "http://h:2"}}, {"b": {"url": "http://h:2"}, "c": {"engine": ENGINE}})
    assert [(c.name, c.action) for c in plan.changes] == [("a", Action.REMOVED), ("b", Action.UNCHANGED), ("c", Action.ADDED)]
    added = plan.changes[2]
    assert added.needs_engine_start and added.old is None and added.new is not None
    assert plan.summary() == {"removed": ["a"], "unchanged": ["b"], "added": ["c"]}


def test_engine_field_change_names_the_field() -> None:
    plan = _plan({"a": {"engine": ENGINE}}, {"a": {"engine": {**ENGINE, "max_total_tokens": 2048, "served_model_name": "a2"}}})
    (change,) = plan.changes
    assert change.action is Action.ENGINE_CHANGED and change.needs_engine_start
    assert set(change.details) == {"engine.max_total_tokens", "engine.served_model_name"}


def test_only_adapters_changed_keeps_engines_that_serve_lora() -> None:
    one = {"engine": ENGINE, "adapters": {"a1": "/adapters/a1"}}
    two = {"engine": ENGINE, "adapters": {"a1": "/adapters/a1", "a2": "/adapters/a2"}}
    plan = _plan({"a": one, "b": one, "c": {"engine": ENGINE}}, {"a": two, "b": {"engine": ENGINE}, "c": two})
    assert _actions(plan) == {"a": Action.ADAPTERS_CHANGED, "b": Action.ADAPTERS_CHANGED, "c": Action.ENGINE_CHANGED}
    assert plan.changes[0].details == ("engine.lora_paths",)  # b: its last adapter removed, LoRA stays on in the engine
    assert set(plan.changes[1].details) == {"engine.lora_paths", "engine.enable_lora"}
    aliased = _plan({"a": one}, {"a": {**one, "adapter_aliases": {"helpdesk": "a1"}}})
    assert _actions(aliased) == {"a": Action.ROUTE_CHANGED} and aliased.changes[0].details == ("adapter_aliases",)
    # c: its engines were started without LoRA: new ones must be; adapters with another engine key: a swap too
    changed = _plan({"a": one}, {"a": {**two, "engine": {**ENGINE, "max_total_tokens": 2048}}})
    assert _actions(changed) == {"a": Action.ENGINE_CHANGED}


def test_adapter_change_unloads_removed_and_moved_adapters_and_loads_new_and_moved_ones() -> None:
    running = {"keep": "/k", "gone": "/g", "moved": "/m1"}
    assert adapter_change(running, {"keep": "/k", "moved": "/m2", "new": "/n"}) == (["gone", "moved"], {"moved": "/m2", "new": "/n"})
    assert adapter_change(running, running) == ([], {})


def test_only_aliases_or_limits_change_the_route_not_the_engine() -> None:
    old = {"a": {"engine": ENGINE, "aliases": ["x"]}, "b": {"url": "http://h:1"}}
    new = {"a": {"engine": ENGINE, "aliases": ["y"]}, "b": {"url": "http://h:1"}}
    plan = _plan(old, new, {}, {"model_limits": {"b": {"max_concurrent": 2}}})
    assert _actions(plan) == {"a": Action.ROUTE_CHANGED, "b": Action.ROUTE_CHANGED}
    assert plan.changes[0].details == ("aliases",) and plan.changes[1].details == ("limits",)
    assert not any(change.needs_engine_start for change in plan.changes)
    assert plan.settings_changed == ("model_limits",) and plan.restart_required == ()


def test_default_limit_change_touches_every_model_without_override() -> None:
    models = {"a": {"url": "http://h:1"}, "b": {"url": "http://h:2"}}
    plan = _plan(models, models, {"model_limits": {"b": {"max_concurrent": 1}}},
                 {"limits": {"max_concurrent": 4}, "model_limits": {"b": {"max_concurrent": 1}}})
    assert _actions(plan) == {"a": Action.ROUTE_CHANGED, "b": Action.UNCHANGED}


def test_url_model_upstream_changes_are_backend_changes() -> None:
    old = {name: {"url": "http://h:1"} for name in "abcde"}
    new = {
        "a": {"url": "http://h:2"},
        "b": {"url": "http://h:1", "served_model_name": "upstream-b"},
        "c": {"url": "http://h:1", "api_key": "k"},
        "d": {"engine": ENGINE},
        "e": {"url": "http://h:1", "enable_priority_scheduling": True},  # its backend sends priorities, or not
    }
    plan = _plan(old, new)
    assert all(change.action is Action.ENGINE_CHANGED for change in plan.changes)
    assert [c.details for c in plan.changes] == [("url",), ("served_model_name",), ("api_key",), ("engine",), ("enable_priority_scheduling",)]
    assert [c.needs_engine_start for c in plan.changes] == [False, False, False, True, False]


def test_swap_policy_per_model_and_default() -> None:
    models = {"a": {"engine": ENGINE}, "b": {"engine": ENGINE}}
    changed = {name: {"engine": {**ENGINE, "max_total_tokens": 1024}} for name in models}
    plan = _plan(models, changed, {}, {"swap_policy": {"b": "stop-first"}})
    assert [c.swap_policy for c in plan.changes] == ["auto", "stop-first"]  # auto: blue-green, or rolling for replicas
    plan = _plan(models, changed, {}, {"swap_default": "stop-first", "swap_policy": {"a": "blue-green"}})
    assert [c.swap_policy for c in plan.changes] == ["blue-green", "stop-first"]


def test_a_change_of_replicas_is_an_engine_change() -> None:
    plan = _plan({"a": {"engine": ENGINE}}, {"a": {"engine": ENGINE, "replicas": 3}}, {}, {})
    (change,) = plan.changes
    assert change.action is Action.ENGINE_CHANGED and change.details == ("replicas",)


def test_gateway_keys_live_or_restart_required() -> None:
    models = {"a": {"url": "http://h:1"}}
    plan = _plan(models, models, {"port": 8000, "api_keys": ["k1"]}, {"port": 9000, "api_keys": ["k2"], "drain_timeout_s": 5, "status_page": False})
    assert set(plan.settings_changed) == {"api_keys", "drain_timeout_s", "status_page"}
    assert plan.restart_required == ("port",)
    assert not plan.is_noop


def test_switching_between_engine_and_url_names_the_new_source() -> None:
    plan = _plan({"a": {"engine": ENGINE}, "b": {"url": "http://h:1"}}, {"a": {"url": "http://h:1"}, "b": {"engine": ENGINE}})
    assert [(c.action, c.details) for c in plan.changes] == [(Action.ENGINE_CHANGED, ("url",)), (Action.ENGINE_CHANGED, ("engine",))]
    assert [c.needs_engine_start for c in plan.changes] == [False, True]


def test_each_change_carries_both_entries_and_the_models_swap_policy() -> None:
    old_models = {"kept": {"url": "http://h:1"}, "changed": {"engine": ENGINE}, "gone": {"engine": ENGINE}}
    new_models = {"kept": {"url": "http://h:1"}, "changed": {"engine": {**ENGINE, "max_total_tokens": 1024}}, "new": {"engine": ENGINE}}
    policies = {"swap_default": "stop-first", "swap_policy": {"new": "rolling", "changed": "blue-green"}}
    old = parse_config({"models": old_models}, "deploy.yaml")
    new = parse_config({"models": new_models, "gateway": policies}, "deploy.yaml")
    plan = plan_reload(old, gateway_settings(old), new, gateway_settings(new))
    by_name = {change.name: change for change in plan.changes}
    # the entries: what a failed swap falls back to (old) and what is applied (new)
    assert by_name["kept"].old is old.models["kept"] and by_name["kept"].new is new.models["kept"]
    assert by_name["changed"].old is old.models["changed"] and by_name["changed"].new is new.models["changed"]
    assert by_name["gone"].old is old.models["gone"] and by_name["gone"].new is None
    assert by_name["new"].old is None and by_name["new"].new is new.models["new"]
    # the policy of the new settings, per model (the swap result of an added model reports it too)
    assert {name: change.swap_policy for name, change in by_name.items()} == {
        "kept": "stop-first", "changed": "blue-green", "gone": "stop-first", "new": "rolling",
    }  # fmt: skip


def test_changes_by_action() -> None:
    plan = _plan(
        {"a": {"url": "http://h:1"}, "b": {"url": "http://h:2"}, "c": {"url": "http://h:3"}},
        {"a": {"url": "http://h:1"}, "b": {"url": "http://h:9"}, "d": {"url": "http://h:4"}},
    )
    assert [c.name for c in plan.by_action(Action.ENGINE_CHANGED)] == ["b"]
    assert [c.name for c in plan.by_action(Action.ADDED, Action.REMOVED)] == ["c", "d"]
    assert plan.by_action(Action.ROUTE_CHANGED) == []
    assert [c.name for c in plan.by_action(*Action)] == ["a", "b", "c", "d"]
