"""The gateway's error types, below every other gateway module (each imports them at the top).

- `Invalid`: bad request input; a ValueError whose message starts with the field's path. HTTP answers
  it with 400 (context_length.ContextLengthExceeded, a subclass, with OpenAI's wording), gRPC with
  INVALID_ARGUMENT.
- `RequestError`: a request that failed after it was accepted, with the gRPC status it maps to (the
  HTTP layer maps that again): the verifier's own status and message, or the gateway's.
"""

from __future__ import annotations

import grpc


class Invalid(ValueError):
    """Bad request input; the message names the field."""


class RequestError(Exception):
    """A request that failed, with the gRPC status it maps to (the HTTP layer maps that again)."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message
