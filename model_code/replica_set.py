"""Which engine takes each request of a model that runs several (``replicas: N``), and what happens to
one that cannot be reached.

The choice: the replica with the fewest requests this process has in flight on it, ties in turn. The
view is this process's own on purpose: shared engines also serve other processes (serving workers,
notebooks) whose requests this one could only see by asking the engines (a round trip per request, or
a polling thread). Each process balancing its own requests spreads their sum as well, and a replica that
slows down holds this process's requests longer, so it gets fewer new ones.

A replica that cannot take requests leaves the rotation:
- an engine of this process (``per_process``) that exited stays out: the wrapper has no watchdog; the
  other replicas serve, and once none is left requests fail with a clear error;
- a shared engine is restarted by its host (:mod:`launch.shared`): after a request could not reach it,
  a background thread waits for it to be back while the others serve, and it rejoins when it answers.

One replica (most models, and URL targets) goes through the same code: it is always the one chosen.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import openai
from loguru import logger

from launch.process import EngineError
from launch.shared import SharedEngine
from model_code.engine_owner import Engine, release_engine
from model_code.lean import LeanTransport
from model_code.target import ModelCodeSettings


def v1_url(url: str) -> str:
    """``url`` ending in ``/v1`` (the openai client's base URL)."""
    url = url.rstrip("/")
    return url if url.endswith("/v1") else f"{url}/v1"


class Replica:
    """One engine (or URL) of a model: its ``openai`` client, and its requests in flight from this process."""

    def __init__(
        self, index: int, base_url: str, api_key: str, settings: ModelCodeSettings, engine: Engine | None = None
    ) -> None:
        self.index = index
        self.base_url = v1_url(base_url)
        self.api_key = api_key
        self.engine = engine
        self.in_flight = 0
        self.recovering = False  # a background thread waits for its shared engine to be back
        self._settings = settings
        self._client: openai.OpenAI | None = None
        self._lean: LeanTransport | None = None
        self._lock = threading.Lock()

    @property
    def shared(self) -> bool:
        return isinstance(self.engine, SharedEngine)

    def openai(self) -> openai.OpenAI:
        with self._lock:
            if self._client is None:
                self._client = openai.OpenAI(
                    base_url=self.base_url,
                    api_key=self.api_key,
                    timeout=self._settings.request_timeout_s,
                    # the EngineClient retries answers (429, 5xx) itself: openai's own retries would also resend
                    # a request the engine crashed or froze under
                    max_retries=0,
                )
            return self._client

    def lean(self) -> LeanTransport:
        """The lean transport (:mod:`model_code.lean`) over :meth:`openai`'s pooled HTTP client."""
        client = self.openai()
        lean = self._lean
        if lean is None or lean.sdk is not client:  # first use, or a new client after a recovery
            lean = self._lean = LeanTransport(client, self._settings.request_timeout_s)
        return lean

    def down_reason(self) -> str | None:
        """Why this replica cannot take requests now, or None."""
        engine = self.engine
        if self.recovering:
            return "its engine is being restarted"
        if engine is not None and not self.shared and not engine.running:
            return f"the engine is not running (exit code {engine.returncode}; log: {engine.log_file})"
        return None

    def recover(self) -> bool:
        """Wait until this replica's shared engine answers again (its host restarts it), then use its current
        URL and key. False for an engine of this process or a URL, and when it does not come back."""
        engine = self.engine
        if not isinstance(engine, SharedEngine):
            return False
        try:
            back = engine.recover()
        except EngineError as error:
            logger.error("engine {}: {}", engine.name, str(error).splitlines()[0])
            return False
        if back:
            with self._lock:
                self.base_url, self.api_key = v1_url(engine.url), engine.api_key or self.api_key
                self._client = None  # the next request connects afresh
        return back

    def recover_in_background(self) -> None:
        """Keep a shared engine out of the rotation until it is back (a no-op for other replicas)."""
        if not self.shared:
            return
        with self._lock:
            if self.recovering:
                return
            self.recovering = True
        threading.Thread(target=self._rejoin, name=f"sglang-replica-{self.index}-recovery", daemon=True).start()

    def _rejoin(self) -> None:
        try:
            if self.recover():
                logger.info("replica {}: its engine answers again; back in the rotation", self.index)
        finally:
            self.recovering = False  # back, or given up: the next failed request starts another wait

    def close(self) -> None:
        """Close the HTTP client and stop (or stop using) the engine. Idempotent."""
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()
        if self.engine is not None:
            release_engine(self.engine)


class ReplicaSet:
    """The replicas of one model and the choice of one per request (see the module docstring)."""

    def __init__(self, replicas: Sequence[Replica]) -> None:
        if not replicas:
            raise ValueError("a model has at least one replica")
        self.replicas = tuple(replicas)
        self._lock = threading.Lock()
        self._last = -1  # index of the replica chosen last: ties go to the next one

    def take(self, exclude: Replica | None = None) -> Replica | None:
        """The replica for the next request, its in-flight count raised (give it back with :meth:`release`);
        None when no replica but ``exclude`` can take requests."""
        with self._lock:
            candidates = [r for r in self.replicas if r is not exclude and r.down_reason() is None]
            if not candidates:
                return None
            least = min(replica.in_flight for replica in candidates)
            count = len(self.replicas)
            chosen = min(
                (replica for replica in candidates if replica.in_flight == least),
                key=lambda replica: (replica.index - self._last - 1) % count,
            )
            self._last = chosen.index
            chosen.in_flight += 1
            return chosen

    def hold(self, replica: Replica) -> Replica:
        """Count one more request in flight on ``replica`` (a retry on the same one)."""
        with self._lock:
            replica.in_flight += 1
        return replica

    def release(self, replica: Replica) -> None:
        with self._lock:
            replica.in_flight -= 1

    def unavailable(self, model: str) -> str:
        """Why no replica of ``model`` can take requests (one line)."""
        if len(self.replicas) == 1:
            return f"model {model!r}: {self.replicas[0].down_reason() or 'its engine cannot be reached'}"
        reasons = "; ".join(f"replica {r.index}: {r.down_reason() or 'cannot be reached'}" for r in self.replicas)
        return f"model {model!r}: none of its {len(self.replicas)} engines can take requests ({reasons})"

    def close(self) -> None:
        for replica in self.replicas:
            replica.close()
