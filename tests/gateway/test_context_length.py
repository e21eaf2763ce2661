"""A request over the model's context, in the words the official clients (and the libraries built on them)
recognise (services/gateway/context_length.py), against a FAKE verifier whose max_context is 1234
(tests/support/fakes.py): OpenAI's / vLLM's message with `code: "context_length_exceeded"` on the
OpenAI routes, Anthropic's "prompt is too long" on /v1/messages, still naming the numbers; checked by the
gateway before sending (nothing reaches the verifier), and the verifier's own refusal translated."""

from __future__ import annotations

import anthropic
import grpc
import openai
import pytest

from tests.support.fakes import openai_client, script_for, serve_gateway

MODEL = "ddtree-demo"
MAX_CONTEXT = 1234  # the fake verifier's GetInfo
OPENAI_HEAD = f"This model's maximum context length is {MAX_CONTEXT} tokens. However, you requested "


@pytest.fixture(scope="module")
def gw(fake, tokenizer_dir):
    yield from serve_gateway(fake, tokenizer_dir)


@pytest.fixture(scope="module")
def client(gw):
    return openai_client(gw)


@pytest.fixture(scope="module")
def claude(gw):
    return anthropic.Anthropic(base_url=f"http://{gw.http_address}", api_key="none", max_retries=0, timeout=20)


def _long_prompt(tok) -> tuple[str, int]:
    text = " ".join(f"word{i}" for i in range(1500))
    return text, len(tok.encode(text))


def test_openai_routes_say_context_length_exceeded(client, fake, tok):
    fake.reset(script_for([5]))
    text, n = _long_prompt(tok)
    assert n > MAX_CONTEXT
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=text, max_tokens=10)
    body = err.value.body
    assert body["code"] == "context_length_exceeded" and body["type"] == "invalid_request_error"
    assert body["message"] == (
        f"{OPENAI_HEAD}{n + 10} tokens ({n} in the messages, 10 in the completion). "
        "Please reduce the length of the messages or completion."
    )
    assert body["param"] == "prompt"

    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError) as err:  # the prompt fits, prompt + max_tokens does not
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_CONTEXT)
    body = err.value.body
    assert body["code"] == "context_length_exceeded" and body["param"] == "messages"
    assert body["message"].startswith(OPENAI_HEAD) and f", {MAX_CONTEXT} in the completion)" in body["message"]
    assert fake.requests == []  # the gateway checked: nothing reached the verifier


def test_anthropic_route_says_prompt_is_too_long(claude, fake, tok):
    fake.reset(script_for([5]))
    text, _ = _long_prompt(tok)
    with pytest.raises(anthropic.BadRequestError) as err:
        claude.messages.create(model=MODEL, max_tokens=10, messages=[{"role": "user", "content": text}])
    error = err.value.body["error"]
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith("prompt is too long: ") and error["message"].endswith(
        f" > {MAX_CONTEXT} maximum"
    )
    with pytest.raises(anthropic.BadRequestError) as err:
        claude.messages.create(model=MODEL, max_tokens=MAX_CONTEXT, messages=[{"role": "user", "content": "hi"}])
    message = err.value.body["error"]["message"]
    assert (
        message.startswith("input length and `max_tokens` exceed context limit: ") and f"+ {MAX_CONTEXT} >" in message
    )
    assert fake.requests == []


@pytest.mark.parametrize(
    "verifier_message, prompt, completion",
    [
        ("prompt has 30024 tokens, the maximum context is 8192", 30024, 0),
        ("prompt (8000) + max_new_tokens (1000) exceeds the maximum context 8192", 8000, 1000),
    ],
)
def test_the_verifiers_refusal_is_translated(client, claude, fake, verifier_message, prompt, completion):
    """A verifier with a smaller context than the gateway was told (or a request the gateway could not
    check) refuses in its own words; the client reads OpenAI's / Anthropic's."""
    fake.reset([], error=(grpc.StatusCode.INVALID_ARGUMENT, verifier_message))
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=5)
    body = err.value.body
    assert body["code"] == "context_length_exceeded"
    assert body["message"].startswith(
        f"This model's maximum context length is 8192 tokens. However, you requested {prompt + completion} tokens "
        f"({prompt} in the messages, {completion} in the completion)."
    )
    fake.reset([], error=(grpc.StatusCode.INVALID_ARGUMENT, verifier_message))
    with pytest.raises(anthropic.BadRequestError) as err:
        claude.messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    message = err.value.body["error"]["message"]
    assert message.startswith("prompt is too long: 30024 tokens > 8192" if not completion else "input length and")
