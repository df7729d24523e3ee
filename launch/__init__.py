"""Start, health-check and stop SGLang engines from a validated YAML config.

Knows nothing of HTTP routes or MLflow: ``gateway`` and ``model_code`` build on it, never the reverse.
"""

from launch.config import ConfigError, DeploymentConfig, EngineConfig, ModelEntry, load_config, parse_config
from launch.preflight import PreflightError, preflight
from launch.process import EngineError, EngineExited, EngineProcess, EngineStartTimeout

__all__ = [
    "ConfigError",
    "DeploymentConfig",
    "EngineConfig",
    "EngineError",
    "EngineExited",
    "EngineProcess",
    "EngineStartTimeout",
    "ModelEntry",
    "PreflightError",
    "load_config",
    "parse_config",
    "preflight",
]
