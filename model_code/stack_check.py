"""``doctor(model_uri)``: a logged model's pinned GPU stack against this host, before ``load_model`` starts anything.

Reads the model's ``requirements.txt`` (``mlflow.pyfunc.get_model_dependencies`` downloads that one file) and judges its SGLang + torch pins with the
GPU profiles' driver rule against this host's driver (:mod:`launch.doctor.pinned`): the profile it pins, whether
the driver runs it, and which profile would.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from launch.doctor.host import read_host
from launch.doctor.pinned import pinned_stack_checks


def model_requirements(model_uri: str) -> list[str]:
    """The lines of a logged model's ``requirements.txt``."""
    import mlflow.pyfunc

    path = mlflow.pyfunc.get_model_dependencies(model_uri, format="pip")  # that file alone, not the weights
    with open(path) as lines:
        return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def doctor(model_uri: str) -> list[dict[str, Any]]:
    """The checks of ``model_uri``'s pinned stack on this host: each ``{"name", "level", "detail", "fix"}``."""
    facts = read_host()
    return [asdict(check) for check in pinned_stack_checks(model_requirements(model_uri), facts, f"model {model_uri}")]
