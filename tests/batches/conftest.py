"""Fixtures of the batch tests' modules."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.batches.helpers import answering_fake


@pytest.fixture(scope="module")
def fake(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """A FAKE engine that answers in milliseconds, one per module that asks (see ``answering_fake``)."""
    with answering_fake(tmp_path_factory.mktemp("fake")) as found:
        yield found
