"""The one error every check of the guard raises: a request refused before it reaches an engine.

Each caller turns it into its own error (the gateway: a 400 in the route's dialect; the MLflow wrapper: a
``BadRequestError``), so the checks stay free of either.
"""

from __future__ import annotations


class Refused(ValueError):
    """A request that must not reach the engine: ``message`` names the field, ``param`` is that field,
    ``code`` the kind of refusal (``unknown_field``, ``request_too_large``, ``invalid_grammar``...)."""

    status = 400

    def __init__(self, message: str, *, code: str = "invalid_request", param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.param = param
