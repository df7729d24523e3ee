"""What the data plane and the control plane share: one object, stored on ``app.state.gateway``.

Routes read it per request; the controller (reloads, swaps, the watchdog) changes ``settings`` and the
registry's routes in place. No module globals: tests build many apps side by side.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.config import GatewaySettings
from gateway.health import HealthProbes
from gateway.metrics import Metrics
from gateway.poison import Quarantine
from gateway.proxy import Proxy
from gateway.registry import Registry
from gateway.responses_index import ResponseIndex


@dataclass
class GatewayState:
    settings: GatewaySettings
    registry: Registry
    metrics: Metrics
    proxy: Proxy | None = None  # set by the lifespan (it owns the upstream session)
    probes: HealthProbes | None = None  # set by the lifespan (it owns the probes' client)
    quarantine: Quarantine = field(default_factory=Quarantine)  # requests suspected of crashing an engine
    # stored responses -> the engine holding them and their owner; the lifespan opens the one in gateway.state_dir
    responses: ResponseIndex = field(default_factory=ResponseIndex)
