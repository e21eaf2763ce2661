"""The optional API key: `Authorization: Bearer KEY` on HTTP, metadata `authorization: Bearer KEY` on gRPC."""

from __future__ import annotations

import hmac


def check_authorization(value: str | None, api_key: str) -> str | None:
    """None when the request may pass, else the message to refuse it with (401 / UNAUTHENTICATED)."""
    if not api_key:
        return None
    if not value:
        return "missing API key: send the header 'Authorization: Bearer <key>'"
    scheme, _, token = value.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return "malformed Authorization header: expected 'Bearer <key>'"
    if not hmac.compare_digest(token.strip().encode(), api_key.encode()):
        return "invalid API key"
    return None
