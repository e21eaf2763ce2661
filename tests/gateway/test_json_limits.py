"""The client-JSON loader: the same values as json.loads within the limits, one clear error past them."""

from __future__ import annotations

import asyncio
import json

import pytest

from ddtree.protocol.json_limits import MAX_DEPTH, JsonInputError, load_json

SAMPLES = ['{"a": [1, 2.5, -3e4, true, null, "x"]}', "[]", '"text"', "0", '{"n": 12345678901234567890}', "[[[[1]]]]"]


@pytest.mark.parametrize("text", SAMPLES)
def test_values_equal_json_loads_within_the_limits(text):
    assert load_json(text, "f") == json.loads(text)


@pytest.mark.parametrize(
    "text, message",
    [
        ("1" * 5000, "f: a number of 5000 characters"),  # int() itself refuses over 4300 digits
        ("[" + "2." + "5" * 200 + "]", "f: a number of 202 characters"),
        ("[NaN]", "f: NaN is not a JSON number"),
        ('{"a": Infinity}', "f: Infinity is not a JSON number"),
        ("[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1), f"f is nested too deeply (the limit is {MAX_DEPTH} levels)"),
        ("[" * 5000 + "]" * 5000, "f is nested too deeply"),  # past Python's recursion limit
        ('{"a": ', "f: not valid JSON"),
        (b"\xff", "f: not UTF-8 text"),
    ],
)
def test_malformed_or_oversize_json_is_one_clear_error(text, message):
    with pytest.raises(JsonInputError) as err:
        load_json(text, "f")
    assert message in str(err.value)


def test_depth_at_the_limit_is_accepted():
    text = "[" * MAX_DEPTH + "]" * MAX_DEPTH
    assert load_json(text, "f") == json.loads(text)


def test_an_unhandled_http_error_carries_no_exception_text():
    from ddtree.gateway.api.http import _server_error

    class _Request:
        class url:
            path = "/v1/chat/completions"

    response = asyncio.run(_server_error(_Request(), RuntimeError("secret internal detail /etc/passwd")))
    body = json.loads(response.body)
    assert response.status_code == 500
    assert "secret" not in response.body.decode() and "RuntimeError" not in response.body.decode()
    assert body["error"]["message"] == "gateway: internal error (logged)"
