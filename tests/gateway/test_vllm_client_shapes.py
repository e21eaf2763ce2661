"""The request shapes vLLM's own clients send, with the official `openai` client against the gateway in
front of a FAKE verifier (tests/support/fakes.py):

- guidellm's `stream_options: {include_usage, continuous_usage_stats}`: usage on every chunk (that
  choice's completion tokens so far), then the usage chunk, as vLLM;
- lm-evaluation-harness' log-likelihood request (`echo` + `logprobs` on /v1/completions, token-id prompt,
  max_tokens 1), and `max_tokens: 0` with echo (the prompt's entries alone), in vLLM's shapes, streamed
  and not; echo without logprobs; the 400s (chat echo, max_tokens 0 without echo).
"""

from __future__ import annotations

import math

import openai
import pytest

from ddtree.protocol.ddtree.v1 import common_pb2, verifier_pb2
from tests.support.fakes import openai_client, script_for, serve_gateway

MODEL = "ddtree-demo"
USER = [{"role": "user", "content": "2+2?"}]
PROMPT = "The capital of France is"
ANSWER = " Paris, of course"


@pytest.fixture(scope="module")
def gw(fake, tokenizer_dir):
    yield from serve_gateway(fake, tokenizer_dir)


@pytest.fixture(scope="module")
def client(gw):
    return openai_client(gw)


def _prompt_entries(prompt_ids: list[int]) -> list[tuple[int, float, list[int], list[float]]]:
    """What the fake verifier scores each prompt position p >= 1 with: (token, logprob, top ids, top
    logprobs); position 2 is -inf (shown as -9999.0)."""
    out = []
    for p in range(1, len(prompt_ids)):
        lp = -math.inf if p == 2 else -0.5 * p
        out.append((prompt_ids[p], lp, [200 + p, 300 + p], [-0.125, -0.25]))
    return out


def _script(prompt_ids: list[int], answer_ids: list[int], top: int = 2) -> list:
    """The prompt's entries in one message, then the answer with its tokens' logprobs."""
    piece = common_pb2.PromptLogprobs(start=1)
    for t, lp, ids, lps in _prompt_entries(prompt_ids):
        piece.token_ids.append(t)
        piece.logprobs.add(logprob=lp, top_ids=ids[:top], top_logprobs=lps[:top])
        piece.ranks.append(3)
    msgs = [verifier_pb2.GenerateResponse(request_id="r", prompt_logprobs=piece)]
    answer = script_for(answer_ids, finish="length")
    for k, m in enumerate(answer):
        for t in m.token_ids:
            m.logprobs.add(logprob=-0.0625 * (k + 1), top_ids=[t], top_logprobs=[-0.0625 * (k + 1)])
    return msgs + answer


# -- continuous_usage_stats ------------------------------------------------------------------------------
def test_continuous_usage_stats_on_every_chunk(client, fake, tok):
    answer = tok.encode(ANSWER)
    options = {"include_usage": True, "continuous_usage_stats": True}
    for api in ("chat", "completions"):
        fake.reset(script_for(answer, finish="length"))
        if api == "chat":
            stream = client.chat.completions.create(model=MODEL, messages=USER, stream=True, stream_options=options)
        else:
            stream = client.completions.create(model=MODEL, prompt=PROMPT, stream=True, stream_options=options)
        chunks = list(stream)
        prompt_tokens = len(fake.requests[-1].input_ids)
        *with_choices, last = chunks
        assert with_choices and all(c.usage is not None for c in with_choices), api
        done = [c.usage.completion_tokens for c in with_choices]
        assert done == sorted(done) and done[-1] == len(answer), (api, done)
        assert all(c.usage.prompt_tokens == prompt_tokens for c in with_choices)
        assert all(c.usage.total_tokens == prompt_tokens + c.usage.completion_tokens for c in with_choices)
        assert last.choices == [] and last.usage.completion_tokens == len(answer)


def test_continuous_usage_needs_include_usage(client, fake, tok):
    fake.reset(script_for(tok.encode(ANSWER), finish="length"))
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=PROMPT, stream=True, stream_options={"continuous_usage_stats": True}
        )
    )
    assert all(c.usage is None for c in chunks)  # vLLM's rule: continuous usage counts with include_usage only


# -- echo ---------------------------------------------------------------------------------------------------
def _check_echo_logprobs(tok, lps: dict, prompt_ids: list[int], answer_ids: list[int]) -> None:
    n = len(prompt_ids)
    assert lps["tokens"] == [tok.decode([i]) for i in prompt_ids + answer_ids]
    assert lps["token_logprobs"][0] is None and lps["top_logprobs"][0] is None
    for k, (t, lp, ids, top_lps) in enumerate(_prompt_entries(prompt_ids), start=1):
        assert lps["token_logprobs"][k] == max(lp, -9999.0)
        want = {tok.decode([ids[0]]): top_lps[0], tok.decode([t]): max(lp, -9999.0)}
        assert lps["top_logprobs"][k] == want  # logprobs 1: the most likely token, plus the prompt's own
    assert len(lps["token_logprobs"]) == n + len(answer_ids)
    offsets = [0]
    for t in lps["tokens"][:-1]:
        offsets.append(offsets[-1] + len(t))
    assert lps["text_offset"] == offsets


def test_echo_with_logprobs_as_lm_eval_sends_it(client, fake, tok):
    """lm-eval local-completions' log-likelihood body: a token-id prompt, echo, logprobs 1, max_tokens 1,
    temperature 0; it reads token_logprobs[ctxlen:-1] (the continuation's prompt tokens)."""
    ids, answer = tok.encode(PROMPT), tok.encode(ANSWER)[:1]
    fake.reset(_script(ids, answer, top=1))
    r = client.completions.create(model=MODEL, prompt=[ids], echo=True, logprobs=1, max_tokens=1, temperature=0)
    req = fake.requests[-1]
    assert (req.prompt_logprobs, req.top_logprobs, req.max_new_tokens) == (1, 1, 1)
    c = r.choices[0]
    assert c.text == tok.decode(ids) + tok.decode(answer)
    assert "prompt_logprobs" not in c.model_extra  # not asked for: echo's entries only
    _check_echo_logprobs(tok, c.logprobs.model_dump(), ids, answer)


def test_echo_max_tokens_0_is_the_prompt_alone(client, fake, tok):
    ids = tok.encode(PROMPT)
    for stream in (False, True):
        fake.reset(_script(ids, tok.encode(ANSWER)[:1], top=1))
        kwargs = dict(model=MODEL, prompt=PROMPT, echo=True, logprobs=1, max_tokens=0)
        if stream:
            chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            lps: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
            for c in chunks:
                if c.choices and c.choices[0].logprobs:
                    for key, v in c.choices[0].logprobs.model_dump().items():
                        lps[key] += v
            finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
            usage = chunks[-1].usage
        else:
            r = client.completions.create(**kwargs)
            text, lps, finish, usage = (
                r.choices[0].text,
                r.choices[0].logprobs.model_dump(),
                [r.choices[0].finish_reason],
                r.usage,
            )
        assert fake.requests[-1].max_new_tokens == 1  # one token, generated for the prompt's entries, dropped
        assert text == PROMPT and finish == ["length"], stream
        _check_echo_logprobs(tok, lps, ids, [])
        assert usage.completion_tokens == 0


def test_echo_without_logprobs_streamed_and_not(client, fake, tok):
    answer = tok.encode(ANSWER)
    fake.reset(script_for(answer, finish="length"))
    r = client.completions.create(model=MODEL, prompt=PROMPT, echo=True, max_tokens=5)
    assert r.choices[0].text == PROMPT + ANSWER and r.choices[0].logprobs is None
    assert not fake.requests[-1].HasField("prompt_logprobs")
    fake.reset(script_for(answer, finish="length"))
    chunks = [
        c for c in client.completions.create(model=MODEL, prompt=PROMPT, echo=True, n=2, stream=True) if c.choices
    ]
    for i in range(2):
        texts = [c.choices[0].text for c in chunks if c.choices[0].index == i]
        assert texts[0] == PROMPT and "".join(texts) == PROMPT + ANSWER


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda c: c.chat.completions.create(model=MODEL, messages=USER, extra_body={"echo": True}), "echo: "),
        (lambda c: c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0), "max_tokens: 0 needs echo"),
        (
            lambda c: c.completions.create(
                model=MODEL, prompt=PROMPT, echo=True, logprobs=2, extra_body={"prompt_logprobs": 1}
            ),
            "prompt_logprobs: must equal logprobs (2) with echo",
        ),
    ],
)
def test_echo_refusals(client, fake, call, message):
    fake.reset(script_for([5]))
    with pytest.raises(openai.BadRequestError) as err:
        call(client)
    assert err.value.body["message"].startswith(message) and fake.requests == []
