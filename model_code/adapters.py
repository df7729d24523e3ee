"""LoRA adapters packed with a logged model: copies of the local adapter directories, one artifact each.

An adapter is small (megabytes), so it is copied into the model, where the base weights (gigabytes) are only
referenced by MLflow's own copy. Each copy is the artifact ``lora-<adapter name>``: unique folder names, whatever
the source directories are called. When the model loads, :func:`model_code.target.resolve_target` gives the
engine those copies instead of the paths of the logging machine. An adapter path that is not a directory here
(one under ``/Volumes`` of the serving workspace, say) is not packed: the engine loads it from that path.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path

from loguru import logger

from model_code.target import adapter_artifact


def stage_adapters(lora_paths: Mapping[str, str], into: Path) -> dict[str, str]:
    """Copy each adapter directory of ``lora_paths`` into ``into``: MLflow's artifacts mapping for them."""
    artifacts = {}
    for name, path in lora_paths.items():
        source = Path(path).expanduser()
        if not source.is_dir():
            logger.warning("adapter {}: {} is not a directory here: not packed, the engine loads it from that path", name, path)
            continue
        if not (source / "adapter_config.json").is_file():
            raise FileNotFoundError(f"adapter {name}: {source} has no adapter_config.json (a PEFT adapter directory)")
        target = into / adapter_artifact(name)
        shutil.copytree(source, target, ignore=shutil.ignore_patterns(".git", "__pycache__"))
        artifacts[adapter_artifact(name)] = str(target)
    return artifacts
