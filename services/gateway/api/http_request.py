"""Reading an HTTP request of the gateway's API (OpenAI and Anthropic routes alike): the JSON body under
the size limit, the request id, the model it names. Every problem is an `ApiError` with its status;
each route answers it in its protocol's error shape (http.py, anthropic_http.py).

- The body: sent as JSON (a form, multipart or text/plain body, which a web page may send cross-origin
  without a preflight, is a 415), at most `max_body_bytes` (413 above; an oversize body is still read, up to DRAIN_BYTES, so
  that the client reads the answer instead of a reset connection), strict UTF-8, JSON within
  json_limits (numbers, depth), one object, no unpaired surrogate escape; else 400 saying which.
- The request id: `X-Request-Id`, else the body's `request_id`, else "" (the pipeline makes one); at most
  MAX_REQUEST_ID_CHARS printable ASCII characters.
- The model: none, or the one this gateway serves (404 naming both).
"""

from __future__ import annotations

import json

from starlette.requests import Request

from ddtree.gateway.api.openai_models import json_type
from ddtree.gateway.choices import MAX_REQUEST_ID_CHARS
from ddtree.protocol.json_limits import JsonInputError, check_depth, parse_hooks

DRAIN_BYTES = 64 * 1024 * 1024  # an oversize body is read and dropped up to this much before the 413


class ApiError(Exception):
    """A request the API refuses: the HTTP status, the message, the field it names (OpenAI's param) and
    OpenAI's error code where it names one (context_length_exceeded)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


# The content types a web page may send cross-origin without a CORS preflight ("simple requests"): refused,
# so that a page cannot drive a gateway on the visitor's loopback with a form or a text/plain fetch.
SIMPLE_CONTENT_TYPES = ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data")


def check_content_type(request: Request) -> None:
    """415 for a body sent as one of SIMPLE_CONTENT_TYPES; any other type (or none) is read as JSON."""
    kind = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if kind in SIMPLE_CONTENT_TYPES:
        raise ApiError(415, f"Content-Type {kind} is not accepted: send the request body as application/json")


async def read_json_body(request: Request, limit: int) -> dict:
    """The JSON object of the body, of at most `limit` bytes. An oversize body is read and dropped (up to
    DRAIN_BYTES) before the 413, so that the client, still sending, reads the answer instead of a reset
    connection. A form or text/plain body is a 415 (check_content_type)."""
    check_content_type(request)
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max(limit, DRAIN_BYTES):
        raise ApiError(413, f"request body of {declared} bytes is over the limit of {limit} bytes")
    body, seen, more = bytearray(), 0, True
    while more and seen <= DRAIN_BYTES:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            raise ApiError(400, "client disconnected while sending the request")
        piece, more = message.get("body", b""), message.get("more_body", False)
        seen += len(piece)
        if seen <= limit:
            body += piece
    if seen > limit:
        raise ApiError(
            413, f"request body of {declared or 'more than ' + str(limit)} bytes is over the limit of {limit} bytes"
        )
    try:
        # Strict UTF-8 first: json.loads(bytes) would let encoded lone surrogates (ED A0 80) through.
        data = json.loads(bytes(body).decode("utf-8"), **parse_hooks())
    except JsonInputError as e:  # a number over the limit, or NaN / Infinity
        raise ApiError(400, f"request body: {e}") from None
    except UnicodeDecodeError:
        raise ApiError(400, "request body is not UTF-8 text") from None
    except json.JSONDecodeError as e:
        raise ApiError(400, f"request body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except RecursionError:
        raise ApiError(400, "request body is nested too deeply") from None
    try:
        check_depth(data, "request body")
    except JsonInputError as e:
        raise ApiError(400, str(e)) from None
    if not isinstance(data, dict):
        raise ApiError(400, f"request body must be a JSON object, got {json_type(data)}")
    if b"\\ud" in body.lower():  # an escaped surrogate: fine in pairs, invalid alone
        try:
            json.dumps(data, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise ApiError(400, "request body has an unpaired UTF-16 surrogate escape") from None
    return data


def request_id_of(request: Request, from_body: str | None) -> str:
    """X-Request-Id, else the body's request_id, else "" (the pipeline makes one)."""
    header = request.headers.get("x-request-id")
    rid, where = (header, "X-Request-Id") if header is not None else (from_body or "", "request_id")
    if len(rid) > MAX_REQUEST_ID_CHARS or not all("!" <= c <= "~" for c in rid):
        raise ApiError(400, f"{where}: must be 1-{MAX_REQUEST_ID_CHARS} printable ASCII characters", where)
    return rid


def served_model(model: str | None, model_id: str) -> str:
    """The model a request names: none, or this gateway's `model_id` (404 otherwise)."""
    if model is not None and model != model_id:
        raise ApiError(404, f"model {model!r} does not exist (this server serves {model_id!r})", "model")
    return model_id
