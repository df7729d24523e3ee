"""The seed of the engine fuzzes: a fresh one each run, printed, and replayable.

A fuzz with a fixed seed sends the same requests every run and finds nothing new after its first; the crash of
an earlier seed hid from it for that reason, and a new seed found it. Each run draws its seed from the OS (not from
``random``, which pytest-randomly reseeds), prints it, and names it in every failure: ``SGLANG_GATEWAY_FUZZ_SEED=<n>``
replays that run's requests (in the same order when run with the same counts).
"""

from __future__ import annotations

import os
import secrets

ENV = "SGLANG_GATEWAY_FUZZ_SEED"
SEED = int(os.environ.get(ENV) or secrets.randbits(32))


def replay(seed: int = SEED) -> str:
    """How to send the same requests again (for a failure's message and the fuzz's summary line)."""
    return f"seed {seed}: replay with {ENV}={seed}"
