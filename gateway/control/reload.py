"""What a config reload changes, per model: a pure function of the old and the new config.

Kept apart from the code that applies it so every case (unchanged, added, removed, engine changed,
only aliases or limits changed, only adapters changed) is unit-tested without starting anything. "Engine changed" covers
anything that needs a new backend: a different ``engine:`` section, a different ``url`` /
``served_model_name`` / ``api_key`` / ``vocab_size`` / ``enable_priority_scheduling``, or a switch between
``engine`` and ``url``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from gateway.config import GatewaySettings, SwapPolicy
from launch.config import GATEWAY_KEY_SETTINGS, GATEWAY_PER_MODEL_SETTINGS, DeploymentConfig, ModelEntry

# Gateway keys a running gateway applies on reload; any other changed key needs a restart.
LIVE_SETTINGS = frozenset(
    {
        *GATEWAY_KEY_SETTINGS, *GATEWAY_PER_MODEL_SETTINGS, "priority_classes",
        "open_paths", "limits", "drain_timeout_s", "swap_default", "swap_retry_after_s", "watchdog", "health_timeout_s", "balancing",
        "status_page", "residency_groups",
    }
)  # fmt: skip


class Action(StrEnum):
    UNCHANGED = "unchanged"
    ADDED = "added"
    REMOVED = "removed"
    ENGINE_CHANGED = "engine_changed"
    ADAPTERS_CHANGED = "adapters_changed"  # only LoRA adapters: loaded and unloaded in the running engines
    ROUTE_CHANGED = "route_changed"  # only aliases and/or limits: applied at once, engines untouched


@dataclass(frozen=True)
class ModelChange:
    name: str
    action: Action
    old: ModelEntry | None
    new: ModelEntry | None
    swap_policy: SwapPolicy = "blue-green"
    details: tuple[str, ...] = ()  # which parts changed, for the report ("aliases", "limits", "engine.max_total_tokens")

    @property
    def needs_engine_start(self) -> bool:
        """A new engine process must be launched (as opposed to pointing at another URL)."""
        return self.action in (Action.ADDED, Action.ENGINE_CHANGED) and self.new is not None and self.new.engine is not None


@dataclass(frozen=True)
class ReloadPlan:
    changes: tuple[ModelChange, ...]
    settings_changed: tuple[str, ...] = ()  # gateway keys applied live
    restart_required: tuple[str, ...] = field(default=())  # gateway keys ignored until a restart

    def by_action(self, *actions: Action) -> list[ModelChange]:
        return [change for change in self.changes if change.action in actions]

    @property
    def is_noop(self) -> bool:
        return not self.settings_changed and not self.restart_required and all(
            c.action is Action.UNCHANGED for c in self.changes
        )

    def summary(self) -> dict[str, list[str]]:
        """``{action: [model, ...]}`` for logs and the admin API."""
        out: dict[str, list[str]] = {}
        for change in self.changes:
            out.setdefault(change.action.value, []).append(change.name)
        return out


def plan_reload(
    old: DeploymentConfig, old_settings: GatewaySettings, new: DeploymentConfig, new_settings: GatewaySettings
) -> ReloadPlan:
    """Compare two validated configs model by model (old order first, then new models)."""
    changes = []
    for name in [*old.models, *(n for n in new.models if n not in old.models)]:
        before, after = old.models.get(name), new.models.get(name)
        policy = new_settings.swap_policy_for(name)
        if before is None:
            changes.append(ModelChange(name, Action.ADDED, None, after, policy))
        elif after is None:
            changes.append(ModelChange(name, Action.REMOVED, before, None, policy))
        else:
            backend = _backend_diff(before, after)
            route = _route_diff(name, before, after, old_settings, new_settings)
            if backend and _only_adapters(before, backend):
                action = Action.ADAPTERS_CHANGED
            elif backend:
                action = Action.ENGINE_CHANGED
            elif route:
                action = Action.ROUTE_CHANGED
            else:
                action = Action.UNCHANGED
            changes.append(ModelChange(name, action, before, after, policy, tuple(backend + route)))
    differing = [key for key in GatewaySettings.model_fields if getattr(old_settings, key) != getattr(new_settings, key)]
    return ReloadPlan(
        tuple(changes),
        tuple(key for key in differing if key in LIVE_SETTINGS),
        tuple(key for key in differing if key not in LIVE_SETTINGS),
    )


def _backend_diff(before: ModelEntry, after: ModelEntry) -> list[str]:
    if (before.engine is None) != (after.engine is None):
        return ["engine" if after.engine is not None else "url"]
    if before.engine is not None and after.engine is not None:
        old, new = before.engine.model_dump(), after.engine.model_dump()
        replicas = [key for key in ("replicas", "replica_gpus", "router") if getattr(before, key) != getattr(after, key)]
        return [f"engine.{key}" for key in new if old.get(key) != new[key]] + replicas
    url_keys = ("url", "served_model_name", "api_key", "vocab_size", "enable_priority_scheduling")
    return [key for key in url_keys if getattr(before, key) != getattr(after, key)]


def _only_adapters(before: ModelEntry, changed: list[str]) -> bool:
    """Only the adapters changed, and the running engines serve LoRA: SGLang's API loads and unloads them there
    (turning LoRA on for the first adapter needs new engines)."""
    return before.engine is not None and before.engine.enable_lora and set(changed) <= {"engine.lora_paths", "engine.enable_lora"}


def _route_diff(
    name: str, before: ModelEntry, after: ModelEntry, old_settings: GatewaySettings, new_settings: GatewaySettings
) -> list[str]:
    out = []
    if before.aliases != after.aliases:
        out.append("aliases")
    if before.adapter_aliases != after.adapter_aliases:
        out.append("adapter_aliases")
    if old_settings.limits_for(name) != new_settings.limits_for(name):
        out.append("limits")
    if before.residency != after.residency:
        out.append("residency")
    return out
