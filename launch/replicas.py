"""Several engines of one engine section: which GPUs each replica gets.

A model with ``replicas: N`` runs N independent ``sglang.launch_server`` processes, each with its own port,
log, process group and GPUs. On a GPU machine each replica sees only its own GPUs through
``CUDA_VISIBLE_DEVICES``: the ones listed in ``replica_gpus``, or else consecutive slices of the visible
GPUs, ``tp_size x dp_size`` each. On CPU the replicas differ only by port.

When to use which: ``replicas`` gives independent engines (one can die, restart or be swapped while the
others serve; the gateway balances requests and keeps prompts that share a prefix on one replica);
SGLang's own ``dp_size`` gives data parallelism inside one engine (one process tree, one port, its own
scheduler balancing, one failure domain).
"""

from __future__ import annotations

import os

from launch.config import ConfigError, EngineConfig, ModelEntry

CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"


def visible_gpu_ids(count: int) -> list[str]:
    """The GPU ids this process may hand out: ``CUDA_VISIBLE_DEVICES`` if set, else ``0 .. count-1``."""
    visible = os.environ.get(CUDA_VISIBLE_DEVICES)
    if visible is not None:
        return [part.strip() for part in visible.split(",") if part.strip() and part.strip() != "-1"]
    return [str(index) for index in range(count)]


def replica_gpu_slices(entry: ModelEntry, visible: list[str]) -> list[list[str]]:
    """The GPU ids of each replica (empty lists on CPU); ConfigError when they do not fit ``visible``."""
    engine = entry.engine
    assert engine is not None
    if engine.device != "cuda":
        return [[] for _ in range(entry.replicas)]
    if entry.replica_gpus is not None:
        wanted = [[str(gpu) for gpu in ids] for ids in entry.replica_gpus]
        missing = sorted({gpu for ids in wanted for gpu in ids} - set(visible), key=int)
        if missing:
            raise ConfigError(f"replica_gpus names GPU(s) {', '.join(missing)}, but the visible GPUs are {', '.join(visible) or 'none'}")
        return wanted
    per_replica = engine.tp_size * engine.dp_size
    needed = per_replica * entry.replicas
    if needed > len(visible):
        raise ConfigError(
            f"{entry.replicas} replica(s) x tp_size x dp_size {per_replica} = {needed} GPUs needed, {len(visible)} visible"
        )
    return [visible[index * per_replica : (index + 1) * per_replica] for index in range(entry.replicas)]


def replica_engines(entry: ModelEntry, visible: list[str]) -> list[EngineConfig]:
    """One engine config per replica, its GPUs in ``env`` (``CUDA_VISIBLE_DEVICES``) on a GPU machine."""
    engine = entry.engine
    assert engine is not None
    if entry.replicas == 1 and entry.replica_gpus is None:
        return [engine]
    configs = []
    for gpus in replica_gpu_slices(entry, visible):
        env = {**engine.env, CUDA_VISIBLE_DEVICES: ",".join(gpus)} if gpus else dict(engine.env)
        configs.append(engine.model_copy(update={"env": env}))
    return configs
