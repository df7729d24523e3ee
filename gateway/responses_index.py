"""Which engine holds which stored response, so that reading, cancelling or continuing it reaches that engine.

SGLang keeps Responses API state (``--enable-response-store``) in the memory of the engine that created the
response. With several models or engines behind the gateway, ``GET /v1/responses/{id}``,
``POST /v1/responses/{id}/cancel`` and a new request's ``previous_response_id`` must go back to that engine:
the gateway remembers ``id -> (model, backend)`` for every response it relayed. The index is bounded
(oldest forgotten first); an id it does not know, or whose engine is gone, is a 404.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from gateway.registry import Backend


@dataclass(frozen=True)
class StoredResponse:
    model: str  # the route's model name
    backend: Backend


class ResponseIndex:
    def __init__(self, max_entries: int = 100_000) -> None:
        self.max_entries = max_entries
        self._by_id: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._by_id)

    def record(self, response_id: str, model: str, backend: Backend) -> None:
        self._by_id[response_id] = StoredResponse(model, backend)
        self._by_id.move_to_end(response_id)
        while len(self._by_id) > self.max_entries:
            self._by_id.popitem(last=False)

    def find(self, response_id: str) -> StoredResponse | None:
        return self._by_id.get(response_id)
