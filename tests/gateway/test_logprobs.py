"""logprobs / top_logprobs (chat) and logprobs N (completions), streaming and not.

- Against a FAKE verifier (tests/support/fakes.py) with the official `openai` client: the exact OpenAI shapes
  (token strings, bytes, top lists, the legacy completions dicts and text_offset), what reaches the
  verifier, the 400s.
- `token_logprobs` (services/verifier/sampling/logprobs.py) against a brute force.
- On the real stack (oracle drafter: real multi-token acceptance): the logprobs DDTree reports equal
  AR's (no_spec) for the same greedy tokens, and both equal the in-process target's log_softmax over
  the same token sequence, within fp32 tolerance; top_logprobs is sorted and starts with the chosen
  (greedy) token.
"""

from __future__ import annotations

import math

import openai
import pytest
import torch

from ddtree.verifier.sampling.logprobs import token_logprobs
from tests.support.fakes import openai_client, script_for, serve_gateway

MODEL = "ddtree-demo"
USER = [{"role": "user", "content": "2+2?"}]
NO_THINK = {"chat_template_kwargs": {"thinking": False}}  # the answer is content, not reasoning
TEXT = "Hello world, fine"


@pytest.fixture(scope="module")
def gw(fake, tokenizer_dir):
    yield from serve_gateway(fake, tokenizer_dir)


@pytest.fixture(scope="module")
def client(gw):
    return openai_client(gw)


def _scripted(tok, sizes=None):
    """A script of TEXT's ids whose logprobs are exact in fp32: token k has -0.25 * (k + 1), and its top
    list is [k's id at -0.125, the token itself]."""
    ids = tok.encode(TEXT)
    msgs = script_for(ids, sizes=sizes or [2] * (len(ids) // 2) + [1] * (len(ids) % 2), finish="length")
    k = 0
    for m in msgs:
        for t in m.token_ids:
            m.logprobs.add(logprob=-0.25 * (k + 1), top_ids=[k, t], top_logprobs=[-0.125, -0.25 * (k + 1)])
            k += 1
    return ids, msgs


def _entry(tok, token_id, logprob):
    raw = tok.token_bytes(token_id)
    return {"token": tok.decode([token_id]), "logprob": logprob, "bytes": list(raw)}


def test_chat_logprobs_shape(client, fake, tok):
    ids, msgs = _scripted(tok)
    fake.reset(msgs)
    r = client.chat.completions.create(model=MODEL, messages=USER, logprobs=True, top_logprobs=2, extra_body=NO_THINK)
    assert fake.requests[-1].HasField("top_logprobs") and fake.requests[-1].top_logprobs == 2
    content = r.choices[0].logprobs.content
    assert r.choices[0].message.content == TEXT and len(content) == len(ids)
    for k, (t, e) in enumerate(zip(ids, content)):
        want = _entry(tok, t, -0.25 * (k + 1))
        assert e.model_dump(exclude={"top_logprobs"}) == want
        assert [x.model_dump() for x in e.top_logprobs] == [_entry(tok, k, -0.125), want]
    assert "".join(e.token for e in content) == TEXT
    assert b"".join(bytes(e.bytes) for e in content).decode() == TEXT

    fake.reset(msgs)
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=USER, logprobs=True, top_logprobs=2, stream=True, extra_body=NO_THINK
        )
    )
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in content]
    # Each chunk carries the logprobs of its own tokens, beside their text.
    with_text = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert all(c.choices[0].logprobs is not None for c in with_text)

    fake.reset(msgs)
    plain = client.chat.completions.create(model=MODEL, messages=USER, extra_body=NO_THINK)
    assert plain.choices[0].logprobs is None and not fake.requests[-1].HasField("top_logprobs")
    fake.reset(msgs)
    r0 = client.chat.completions.create(
        model=MODEL, messages=USER, logprobs=True, extra_body=NO_THINK
    )  # top_logprobs unset = 0
    assert fake.requests[-1].top_logprobs == 0 and r0.choices[0].logprobs.content[0].logprob == -0.25


def test_completion_logprobs_shape(client, fake, tok):
    ids, msgs = _scripted(tok)
    fake.reset(msgs)
    r = client.completions.create(model=MODEL, prompt="a", logprobs=2)
    assert fake.requests[-1].top_logprobs == 2
    lp = r.choices[0].logprobs
    strings = [tok.decode([t]) for t in ids]
    assert lp.tokens == strings
    assert lp.token_logprobs == [-0.25 * (k + 1) for k in range(len(ids))]
    # The top dict holds the top tokens and the chosen one (here it is one of them).
    assert lp.top_logprobs == [{tok.decode([k]): -0.125, s: -0.25 * (k + 1)} for k, s in enumerate(strings)]
    assert lp.text_offset == [sum(len(s) for s in strings[:k]) for k in range(len(ids))]

    fake.reset(msgs)
    chunks = list(client.completions.create(model=MODEL, prompt="a", logprobs=2, stream=True))
    got = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [t for g in got for t in g.tokens] == lp.tokens
    assert [o for g in got for o in g.text_offset] == lp.text_offset  # offsets continue across chunks
    assert [d for g in got for d in g.top_logprobs] == lp.top_logprobs


def test_grpc_chunks_carry_the_logprobs(gw, fake, tok):
    import grpc

    from ddtree.protocol.ddtree.v1 import gateway_pb2, gateway_pb2_grpc

    ids, msgs = _scripted(tok)
    fake.reset(msgs)
    with grpc.insecure_channel(gw.address) as channel:
        options = gateway_pb2.GenerationOptions(top_logprobs=2)
        chunks = list(
            gateway_pb2_grpc.GatewayStub(channel).Complete(gateway_pb2.CompleteRequest(prompt="a", options=options))
        )
    assert fake.requests[-1].top_logprobs == 2
    assert all(len(c.logprobs) == len(c.token_ids) for c in chunks)
    assert [lp.logprob for c in chunks for lp in c.logprobs] == [-0.25 * (k + 1) for k in range(len(ids))]
    fake.reset(msgs)
    with grpc.insecure_channel(gw.address) as channel, pytest.raises(grpc.RpcError) as err:
        options = gateway_pb2.GenerationOptions(top_logprobs=21)
        list(gateway_pb2_grpc.GatewayStub(channel).Complete(gateway_pb2.CompleteRequest(prompt="a", options=options)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "top_logprobs" in err.value.details()


def _padded(tok):
    """TEXT's script whose top lists hold an id past the tokenizer's vocabulary (a padded-vocab row)."""
    ids = tok.encode(TEXT)
    msgs = script_for(ids, sizes=[len(ids)], finish="length")
    for t in msgs[0].token_ids:
        msgs[0].logprobs.add(logprob=-0.5, top_ids=[t, tok.vocab_size + 3], top_logprobs=[-0.5, -1.0])
    return ids, msgs


def test_top_ids_past_the_vocabulary_render_safely(client, fake, tok):
    pad = f"<|{tok.vocab_size + 3}|>"
    ids, msgs = _padded(tok)
    fake.reset(msgs)
    r = client.chat.completions.create(model=MODEL, messages=USER, logprobs=True, top_logprobs=2, extra_body=NO_THINK)
    tops = [e.top_logprobs[1] for e in r.choices[0].logprobs.content]
    assert len(tops) == len(ids) and all((t.token, t.bytes, t.logprob) == (pad, [], -1.0) for t in tops)
    fake.reset(msgs)
    stream = client.completions.create(model=MODEL, prompt="a", logprobs=2, stream=True)
    dicts = [d for c in stream if c.choices and c.choices[0].logprobs for d in c.choices[0].logprobs.top_logprobs]
    assert len(dicts) == len(ids) and all(d[pad] == -1.0 for d in dicts)


def test_chosen_token_joins_the_completion_top_dict(client, fake, tok):
    ids = tok.encode("ab")
    msgs = script_for(ids, finish="length")
    for m in msgs:
        m.logprobs.add(logprob=-3.0, top_ids=[7], top_logprobs=[-0.5])
    fake.reset(msgs)
    lp = client.completions.create(model=MODEL, prompt="a", logprobs=1).choices[0].logprobs
    assert lp.top_logprobs == [{tok.decode([7]): -0.5, tok.decode([t]): -3.0} for t in ids]


@pytest.mark.parametrize(
    "route, extra, message",
    [
        ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs: must be in [0, 20], got 21"),
        ("chat", {"logprobs": True, "top_logprobs": -1}, "top_logprobs: must be in [0, 20], got -1"),
        ("chat", {"top_logprobs": 3}, "top_logprobs: needs logprobs: true"),
        ("chat", {"logprobs": 2}, "logprobs: must be boolean, got integer"),
        ("completions", {"logprobs": 21}, "logprobs: must be in [0, 20], got 21"),
        ("completions", {"logprobs": True}, "logprobs: must be integer, got boolean"),
        ("completions", {"prompt_logprobs": 21}, "prompt_logprobs: must be in [0, 20], got 21"),
        ("completions", {"prompt_logprobs": -1}, "prompt_logprobs: must be in [0, 20], got -1"),
        ("completions", {"prompt_logprobs": "x"}, "prompt_logprobs: must be integer, got string"),
        ("chat", {"prompt_logprobs": 21}, "prompt_logprobs: must be in [0, 20], got 21"),
        ("chat", {"prompt_logprobs": -1}, "prompt_logprobs: must be in [0, 20], got -1"),
        ("chat", {"prompt_logprobs": "x"}, "prompt_logprobs: must be integer, got string"),
        ("chat", {"prompt_logprobs": 1.5}, "prompt_logprobs: must be integer, got number"),
    ],
)
def test_logprobs_limits_are_400(client, fake, route, extra, message):
    fake.reset(script_for([5]))
    with pytest.raises(openai.BadRequestError) as err:
        if route == "chat":
            client.chat.completions.create(model=MODEL, messages=USER, extra_body=extra)
        else:
            client.completions.create(model=MODEL, prompt="a", extra_body=extra)
    assert message in err.value.body["message"] and err.value.body["param"] == message.split(":")[0]
    assert fake.requests == []


def test_token_logprobs_against_brute_force():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 50, generator=g) * 3
    logits[3, 10] = logits[3, 20] = logits[3].max() + 1.0  # a tie at the top: lower id first
    rows, tokens = [0, 3, 4, 3], [7, 20, 49, 10]
    out = token_logprobs(logits, rows, tokens, 4)
    ref = torch.log_softmax(logits.double(), dim=-1)
    for (lp, top_ids, top_lps), r, t in zip(out, rows, tokens):
        assert math.isclose(lp, ref[r, t].item(), abs_tol=1e-5)
        order = sorted(range(50), key=lambda i: (-ref[r, i].item(), i))[:4]
        assert top_ids == order
        assert all(math.isclose(a, ref[r, i].item(), abs_tol=1e-5) for a, i in zip(top_lps, order))
    assert out[1][1][:2] == [10, 20]
    assert [x[1:] for x in token_logprobs(logits, [1], [2], 0)] == [([], [])]
    with pytest.raises(ValueError):
        token_logprobs(logits, [0], [1, 2], 1)


# -- the real stack -------------------------------------------------------------------------------------------
PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n"


@pytest.fixture(scope="module")
def stack_client(oracle_stack):
    return openai.OpenAI(base_url=f"http://{oracle_stack.gateway_http}/v1", api_key="none", max_retries=0, timeout=120)


def _greedy(client, prompt_ids, **extra):
    r = client.completions.create(
        model=MODEL,
        prompt=prompt_ids,
        max_tokens=24,
        temperature=0,
        logprobs=5,
        extra_body={"ignore_eos": True, **extra},
    )
    return r


def test_ddtree_logprobs_equal_ar_and_the_target(oracle_stack, stack_client, default_ckpt):
    from ddtree.models.checkpoint.loader import load_target
    from ddtree.tokenization.tokenizer import Tokenizer
    from tests.support.quantized_checkpoints import logits as full_logits

    tok = Tokenizer(default_ckpt.target)
    prompt_ids = tok.encode(PROMPT)
    ar = _greedy(stack_client, prompt_ids, no_spec=True)
    spec = _greedy(stack_client, prompt_ids, budget=8)
    assert spec.model_extra["spec"]["avg_accept_length"] > 1.5  # tree rows, not AR steps, gave them
    assert ar.model_extra["spec"]["avg_accept_length"] == 1.0
    a, s = ar.choices[0].logprobs, spec.choices[0].logprobs
    assert s.tokens == a.tokens and len(s.tokens) == 24  # lossless: the same greedy tokens
    assert max(abs(x - y) for x, y in zip(s.token_logprobs, a.token_logprobs)) < 1e-4
    for ds, da in zip(s.top_logprobs, a.top_logprobs):
        assert ds.keys() == da.keys() and all(abs(ds[k] - da[k]) < 1e-4 for k in ds)

    # The in-process target over prompt + output: the log_softmax row before each output token.
    model = load_target(str(default_ckpt.target), dtype=torch.float32, device="cpu").eval()
    gen_ids = [t for t in tok.encode(spec.choices[0].text)]
    assert tok.decode(gen_ids) == spec.choices[0].text
    ids = prompt_ids + gen_ids
    with torch.inference_mode():
        ref = torch.log_softmax(full_logits(model, ids).float(), dim=-1)  # [len(ids), V]
    n = len(prompt_ids)
    # Re-encoding the text may split it differently from the generated ids: compare while they agree.
    agree = next((k for k, (t, g) in enumerate(zip(s.tokens, gen_ids)) if tok.decode([g]) != t), len(gen_ids))
    assert agree >= 8
    want = [ref[n - 1 + k, gen_ids[k]].item() for k in range(agree)]
    assert max(abs(x - y) for x, y in zip(s.token_logprobs[:agree], want)) < 1e-4


def test_chat_top_logprobs_sorted_and_hold_the_greedy_token(stack_client):
    for stream in (False, True):
        kwargs = dict(
            model=MODEL,
            messages=[{"role": "user", "content": "Write a loop."}],
            max_tokens=16,
            temperature=0,
            logprobs=True,
            top_logprobs=5,
            extra_body={"ignore_eos": True, "budget": 8},
        )
        if stream:
            content = [
                e
                for c in stack_client.chat.completions.create(stream=True, **kwargs)
                if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content
            ]
        else:
            content = stack_client.chat.completions.create(**kwargs).choices[0].logprobs.content
        assert len(content) == 16
        for e in content:
            tops = [x.logprob for x in e.top_logprobs]
            assert len(tops) == 5 and tops == sorted(tops, reverse=True)
            assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == e.logprob  # greedy = argmax
            assert e.logprob <= 0 and math.fsum(math.exp(x) for x in tops) <= 1 + 1e-5
