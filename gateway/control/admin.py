"""The admin API (``/admin/...``, admin key only; see ``auth``): inspect, reload, swap and drain models.

Reload and swap answer when the work is done (an engine start can take minutes: use a long client
timeout). A reload whose file is invalid answers 400 naming file, key and reason; one in which a
model's new engine failed answers 502 with the engine's log tail, the old engine still serving.
"""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import APIRouter, Request
from starlette.responses import Response

from gateway.config import SwapPolicy
from gateway.control.controller import Controller, ReloadInvalid, ReloadOutcome
from gateway.control.residency import SLEEPING, STARTING
from gateway.control.swap import describe_backend
from gateway.control.workers import WorkerSupervisor
from gateway.core.backends import Backend, EngineBackend, RouterBackend, UrlBackend
from gateway.core.errors import GatewayError, error_body

LOG_TAIL_LINES = 20  # of an engine that is not ready, in GET /admin/models
admin_routes = APIRouter(prefix="/admin", include_in_schema=False)  # not listed in /openapi.json to client keys


def _controller(request: Request) -> Controller:
    return request.app.state.controller


def _json(data: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(data), status_code=status, media_type="application/json")


@admin_routes.get("/models")
async def models(request: Request) -> Response:
    return _json(describe(_controller(request)))


@admin_routes.get("/workers")
async def workers(request: Request) -> Response:
    """The data-plane worker processes (``gateway.workers`` > 1): pid, running, routing version, restarts."""
    peers = _controller(request).state.peers
    return _json({"workers": peers.report() if isinstance(peers, WorkerSupervisor) else []})


@admin_routes.post("/reload")
async def reload(request: Request) -> Response:
    try:
        outcome = await _controller(request).reload("admin")
    except ReloadInvalid as error:
        raise GatewayError(400, f"invalid config, nothing changed: {error}", code="invalid_config") from None
    report = reload_report(outcome)
    if report["ok"]:
        return _json(report)
    message = "; ".join(f"model {name}: {report['models'][name].get('error')}" for name in report["failed"])
    return _json({**error_body(f"reload applied partly: {message}", "upstream_error", "engine_start_failed"), "reload": report}, 502)


@admin_routes.post("/models/{name}/swap")
async def swap(name: str, request: Request, policy: SwapPolicy | None = None) -> Response:
    """Restart the model's engine with its current config (blue-green unless ``policy=stop-first``)."""
    result = await _controller(request).swap(name, policy)
    if result.ok:
        return _json({"ok": True, **result.as_dict()})
    body = error_body(f"swap of model {name!r} failed: {result.error}", "upstream_error", "engine_start_failed")
    return _json({**body, "swap": result.as_dict()}, 502)


@admin_routes.get("/quarantine")
async def quarantine(request: Request) -> Response:
    """The request shapes refused because they crashed or froze an engine (see ``gateway.core.poison``)."""
    return _json({"refused": _controller(request).state.quarantine.report()})


@admin_routes.delete("/quarantine")
async def clear_quarantine(request: Request, model: str | None = None) -> Response:
    """Let the quarantined request shapes (of ``model``, or of every model) through again."""
    return _json({"model": model, "cleared": _controller(request).state.quarantine.clear(model)})


@admin_routes.post("/models/{name}/drain")
async def drain(name: str, request: Request, wait: bool = False) -> Response:
    """Stop admitting requests for the model (503 + Retry-After); ``wait=true`` waits for in-flight ones."""
    controller = _controller(request)
    route = controller.set_drained(name, True)
    idle = await controller.wait_idle(route, controller.state.settings.drain_timeout_s) if wait else None
    return _json({"model": route.name, "drained": True, "in_flight": route.in_flight, **({"idle": idle} if wait else {})})


@admin_routes.post("/models/{name}/undrain")
async def undrain(name: str, request: Request) -> Response:
    route = _controller(request).set_drained(name, False)
    return _json({"model": route.name, "drained": False, "in_flight": route.in_flight})


def reload_report(outcome: ReloadOutcome | None) -> dict[str, Any] | None:
    """What a reload changed and what failed, per model (``POST /admin/reload`` and ``GET /admin/models``)."""
    if outcome is None:
        return None
    report: dict[str, Any] = {"ok": outcome.ok, "trigger": outcome.trigger, "file": outcome.file, "at": outcome.at}
    if outcome.error is not None:
        return {**report, "error": outcome.error}
    models: dict[str, Any] = {}
    for change in outcome.plan.changes if outcome.plan else ():
        item: dict[str, Any] = {"action": change.action.value}
        if change.details:
            item["changed"] = list(change.details)
        result = outcome.results.get(change.name)
        if result is not None:
            item.update(result.as_dict())
            item.pop("model", None)
        models[change.name] = item
    plan = outcome.plan
    return {
        **report,
        "duration_s": round(outcome.duration_s, 3),
        "models": models,
        "failed": outcome.failed,
        "settings_changed": list(plan.settings_changed) if plan else [],
        "restart_required": list(plan.restart_required) if plan else [],
    }


def describe(controller: Controller) -> dict[str, Any]:
    """State of every model and of each of its replicas, for ``GET /admin/models``."""
    executor = controller.executor
    models = []
    for route in controller.registry.routes():
        replicas = [_replica(controller, route.name, backend) for backend in route.replicas]
        ready = sum(1 for replica in replicas if replica["state"] == "ready")
        restarting = any(replica["state"] == "restarting" for replica in replicas)
        residency = controller.residency.status(route.name)
        if route.drained:
            state = "drained"
        elif residency in (STARTING, SLEEPING):
            state = residency
        elif restarting and not ready:
            state = "restarting"  # the watchdog holds the model's lock while it restarts: not a swap
        elif executor.lock(route.name).locked() and not restarting:
            state = "swapping"
        elif ready:
            state = "ready" if ready == len(replicas) else "degraded"
        elif all(replica["state"] == "failed" for replica in replicas):
            state = "failed"
        else:
            state = "unavailable"
        first, backend = replicas[0], route.backend
        item: dict[str, Any] = {
            "name": route.name,
            "aliases": list(route.aliases),
            "state": state,
            "reason": None if ready else first["reason"],
            "kind": backend.kind,
            "url": backend.url,
            "served_model_name": backend.served_name,
            "upstream_api_key": "set" if isinstance(backend, UrlBackend) and backend.api_key else None,
            "in_flight": sum(r["in_flight"] for r in replicas) + (_in_flight(controller, route.name, route.front) if route.front else 0),
            "drained": route.drained,
            "swap_policy": controller.swap_policy_for(route.name),
            "limits": route.limiter.settings.model_dump(),
            "restarts": controller.watchdog.restarts(route.name),
            "last_error": next((r["last_error"] for r in replicas if r.get("last_error")), None) or controller.last_errors.get(route.name),
            "retiring": [describe_backend(old) for old in executor.drainer.retiring.get(route.name, [])],
            "replicas": replicas,
            "ready_replicas": ready,
            "residency": residency,  # resident / sleeping / starting; None without a residency section
        }
        if "engine" in first:
            item["engine"] = first["engine"]
        if isinstance(route.front, RouterBackend):
            router = route.front.router
            item["router"] = {
                "url": router.url, "pid": router.pid, "running": router.running, "policy": router.config.policy,
                "metrics_port": router.metrics_port, "in_flight": route.front.in_flight,
                "log_file": str(router.log_file) if router.log_file else None,
            }  # fmt: skip
        models.append(item)
    config_file = str(controller.config_path) if controller.config_path else None
    return {
        "config_file": config_file, "models": models, "last_reload": reload_report(controller.last_reload),
        "events": controller.state.events.newest_first(),
    }  # fmt: skip


def _in_flight(controller: Controller, model: str, backend: Backend) -> int:
    return controller.state.in_flight(model, backend)


def _replica(controller: Controller, model: str, backend: Backend) -> dict[str, Any]:
    health = controller.watchdog.health.get((model, backend.replica))
    reason = backend.unavailable_reason()
    if reason is None:
        state = "ready"
    elif backend.asleep:  # residency: its engine stopped (a DormantBackend), or running with its memory released
        state = "sleeping"
    elif health is not None and health.gave_up:
        state = "failed"
    elif controller.watchdog.restarting(model, backend.replica):
        state = "restarting"
    else:
        state = "unavailable"
    item: dict[str, Any] = {
        "replica": backend.replica,
        "state": state,
        "reason": reason,
        "url": backend.url,
        "in_flight": _in_flight(controller, model, backend),
        "restarts": health.restarts if health else 0,
        "last_error": health.last_error if health else None,
    }
    if isinstance(backend, EngineBackend):
        engine = backend.engine
        item["engine"] = {
            "pid": engine.pid,
            "port": engine.port,
            "uptime_s": round(engine.uptime_s, 1),
            "phase": engine.phase,
            "running": engine.running,
            "owned": controller.executor.owns(backend),
            "log_file": str(engine.log_file) if engine.log_file else None,
            "gpus": engine.config.env.get("CUDA_VISIBLE_DEVICES"),
        }
        if state != "ready":  # what its log said last: why it is down, or how far its start got
            item["log_tail"] = engine.log_tail(LOG_TAIL_LINES)
    return item
