"""prompt_logprobs (vLLM's), chat and completions, streaming and not.

- `prompt_logprobs` / `prompt_logprobs_messages` (services/verifier/sampling/logprobs.py) against a brute force.
- Against a FAKE verifier (tests/support/fakes.py) with the official `openai` client: vLLM's shape (null for the
  first prompt token, then a dict keyed by token id: the prompt token first, then the top k), where it
  goes (completions: each choice; chat: the response; a stream: one chunk, per choice for completions,
  ahead of the text, the verifier's pieces joined), what reaches the verifier (with n = 3: only choice
  0's request asks, and every choice shows its entries), the 400s, and a failure before the first
  token of a stream (a plain error status, though prompt entries came before it).
- On the real stack (oracle drafter, --prefill-chunk 64): every prompt position equals the in-process
  target's log_softmax over the prompt, within fp32 tolerance, for a prompt split over several prefill
  chunks that is also in the prefix cache (complete all the same: nothing taken from the cache), for
  k = 0 and k > 0, streamed and not; the generation is the one a plain request gets.
"""

from __future__ import annotations

import itertools
import json
import math
import urllib.request

import grpc
import openai
import pytest
import torch

from ddtree.protocol.ddtree.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, verifier_pb2
from ddtree.verifier.sampling.logprobs import prompt_logprobs, prompt_logprobs_messages
from tests.support.fakes import openai_client, script_for, serve_gateway

MODEL = "ddtree-demo"
USER = [{"role": "user", "content": "2+2?"}]
NO_THINK = {"chat_template_kwargs": {"thinking": False}}
PROMPT_TEXT = "Hello world, this is a prompt"
ANSWER = "fine"


# -- the verifier's computation ------------------------------------------------------------------------------
def _brute_rank(row: torch.Tensor, token: int) -> int:
    return sum(1 for v in row.tolist() if v >= row[token].item())


def test_prompt_logprobs_against_brute_force():
    g = torch.Generator().manual_seed(1)
    vocab, n = 40, 12
    prompt = torch.randint(0, vocab, (n,), generator=g).tolist()
    logits = torch.randn(n, vocab, generator=g) * 3  # row p: prompt position p
    logits[4, 3] = logits[4, 9] = logits[4].max() + 1.0  # a tie at the top of the row scoring position 5
    prompt[5] = 9
    ref = torch.log_softmax(logits.double(), dim=-1)
    for start, end, top in [(0, 5, 3), (5, n, 0), (3, 9, 20)]:
        rows = prompt_logprobs(logits[start:end], prompt, start, top)
        positions = range(start + 1, min(end + 1, n))
        assert rows.start == start + 1 and list(rows.token_ids) == [prompt[p] for p in positions]
        for k, p in enumerate(positions):
            row = ref[p - 1]
            assert math.isclose(rows.logprobs[k], row[prompt[p]].item(), abs_tol=1e-5)
            assert rows.ranks[k] == _brute_rank(row, prompt[p])
            ids, lps = rows.top[k]
            assert ids == sorted(range(vocab), key=lambda i: (-row[i].item(), i))[:top]
            assert all(math.isclose(a, row[i].item(), abs_tol=1e-5) for a, i in zip(lps, ids))
    assert prompt_logprobs(logits[4:5], prompt, 4, 2).ranks[0] == 2  # the tie: both count, vLLM's rank
    assert prompt_logprobs(logits[n - 1 :], prompt, n - 1, 2) is None  # the prompt's last row scores nothing

    rows = prompt_logprobs(logits, prompt, 0, 2)
    pieces = list(prompt_logprobs_messages(rows, per_message=4))
    assert [p.start for p in pieces] == [1, 5, 9] and [len(p.token_ids) for p in pieces] == [4, 4, 3]
    assert [t for p in pieces for t in p.token_ids] == prompt[1:]
    assert [lp.logprob for p in pieces for lp in p.logprobs] == pytest.approx(list(rows.logprobs))
    assert [r for p in pieces for r in p.ranks] == list(rows.ranks)


# -- the gateway over a fake verifier --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gw(fake, tokenizer_dir):
    yield from serve_gateway(fake, tokenizer_dir)


@pytest.fixture(scope="module")
def client(gw):
    return openai_client(gw)


def _scored(tok, prompt_ids: list[int], k: int) -> list[tuple[int, float, int, list[int], list[float]]]:
    """Per prompt position p >= 1 what the fake verifier reports: (token, logprob, rank, top ids, top
    logprobs), exact in fp32. Even positions have the prompt token among the top ids, position 3 a -inf."""
    out = []
    for p in range(1, len(prompt_ids)):
        t = prompt_ids[p]
        others = [i for i in range(100, 100 + k + 1) if i != t]
        top = ([t] + others)[:k] if p % 2 == 0 else others[:k]
        lp = -math.inf if p == 3 else -0.25 * p
        out.append((t, lp, 1 if t in top[:1] else p + 1, top, [-0.125 * (i + 1) for i in range(len(top))]))
    return out


def _pieces(tok, prompt_ids: list[int], k: int, per_message: int = 2) -> list:
    """The verifier's messages of the prompt's entries, in pieces of `per_message` positions."""
    scored = _scored(tok, prompt_ids, k)
    msgs = []
    for a in range(0, len(scored), per_message):
        piece = common_pb2.PromptLogprobs(start=a + 1)
        for t, lp, rank, top, top_lps in scored[a : a + per_message]:
            piece.token_ids.append(t)
            piece.logprobs.add(logprob=lp, top_ids=top, top_logprobs=top_lps)
            piece.ranks.append(rank)
        msgs.append(verifier_pb2.GenerateResponse(request_id="r", prompt_logprobs=piece))
    return msgs


def _script(tok, prompt_ids: list[int], k: int, per_message: int = 2) -> list:
    """The verifier's messages: the prompt's entries (to a request that asks), then ANSWER."""
    return _pieces(tok, prompt_ids, k, per_message) + script_for(tok.encode(ANSWER), finish="length")


def _check_shape(tok, prompt_ids: list[int], k: int, got: list) -> None:
    """vLLM's list: null, then per position {id: {logprob, rank, decoded_token}}, the prompt token first,
    then the top ids in order (the prompt token in its own place when it is one of them)."""
    assert len(got) == len(prompt_ids) and got[0] is None
    for entry, (t, lp, rank, top, top_lps) in zip(got[1:], _scored(tok, prompt_ids, k)):
        keys = list(entry)
        assert keys[0] == str(t) and keys[1 if t not in top else 0 :] == [str(i) for i in top]
        assert entry[str(t)]["logprob"] == (max(lp, -9999.0) if t not in top else top_lps[top.index(t)])
        assert entry[str(t)]["rank"] == (rank if t not in top else top.index(t) + 1)
        for r, (i, v) in enumerate(zip(top, top_lps)):
            assert entry[str(i)] == {"logprob": v, "rank": r + 1, "decoded_token": tok.decode([i])}
        assert entry[str(t)]["decoded_token"] == tok.decode([t])


def test_completions_prompt_logprobs(client, fake, tok):
    ids = tok.encode(PROMPT_TEXT)
    assert len(ids) >= 5
    for k in (0, 3):
        fake.reset(_script(tok, ids, k))
        r = client.completions.create(model=MODEL, prompt=ids, extra_body={"prompt_logprobs": k})
        req = fake.requests[-1]
        assert req.HasField("prompt_logprobs") and req.prompt_logprobs == k and not req.HasField("top_logprobs")
        assert r.choices[0].text == ANSWER and r.choices[0].logprobs is None  # no output logprobs asked
        _check_shape(tok, ids, k, r.choices[0].model_extra["prompt_logprobs"])

    fake.reset(_script(tok, ids, 2, per_message=3))  # n choices: each carries it (vLLM's completions)
    r = client.completions.create(model=MODEL, prompt=ids, n=2, logprobs=1, extra_body={"prompt_logprobs": 2})
    assert len(r.choices) == 2 and all(c.logprobs is not None for c in r.choices)
    for c in r.choices:
        _check_shape(tok, ids, 2, c.model_extra["prompt_logprobs"])

    fake.reset(script_for(tok.encode(ANSWER)))
    plain = client.completions.create(model=MODEL, prompt=ids)
    assert "prompt_logprobs" not in plain.choices[0].model_extra and not fake.requests[-1].HasField("prompt_logprobs")


def test_chat_prompt_logprobs_on_the_response(client, fake, tok):
    ids = tok.encode(PROMPT_TEXT)  # the fake scores these whatever the rendered prompt is
    fake.reset(_script(tok, ids, 2))
    r = client.chat.completions.create(model=MODEL, messages=USER, extra_body={"prompt_logprobs": 2, **NO_THINK})
    assert fake.requests[-1].prompt_logprobs == 2
    assert r.choices[0].message.content == ANSWER and r.choices[0].logprobs is None
    _check_shape(tok, ids, 2, r.model_extra["prompt_logprobs"])


def test_streams_send_them_whole_ahead_of_the_text(client, fake, tok):
    ids = tok.encode(PROMPT_TEXT)
    fake.reset(_script(tok, ids, 1, per_message=1))  # one piece per position: joined into one chunk
    chunks = list(client.completions.create(model=MODEL, prompt=ids, stream=True, extra_body={"prompt_logprobs": 1}))
    carrying = [i for i, c in enumerate(chunks) if c.choices and "prompt_logprobs" in c.choices[0].model_extra]
    assert carrying == [0] and chunks[0].choices[0].text == ""
    _check_shape(tok, ids, 1, chunks[0].choices[0].model_extra["prompt_logprobs"])
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ANSWER

    fake.reset(_script(tok, ids, 0))
    stream = client.chat.completions.create(
        model=MODEL, messages=USER, stream=True, extra_body={"prompt_logprobs": 0, **NO_THINK}
    )
    chunks = list(stream)
    carrying = [i for i, c in enumerate(chunks) if "prompt_logprobs" in (c.model_extra or {})]
    assert len(carrying) == 1 and chunks[0].choices[0].delta.role == "assistant"
    first_text = next(i for i, c in enumerate(chunks) if c.choices and c.choices[0].delta.content)
    assert 0 < carrying[0] < first_text and chunks[carrying[0]].choices[0].delta.content is None
    _check_shape(tok, ids, 0, chunks[carrying[0]].model_extra["prompt_logprobs"])


@pytest.mark.parametrize("stream", [False, True])
def test_n_choices_ask_once_and_show_choice_0s(client, fake, tok, stream):
    """n = 3: only choice 0's verifier request asks for prompt_logprobs (the others share its prefill);
    completions show its entries on every choice (a stream: once per choice, ahead of its text, though
    the other choices' text comes first: the fake sends them no entries, and each of choice 0's pieces
    0.02 s apart), chat once on the response."""
    ids = tok.encode(PROMPT_TEXT)
    fake.reset(_script(tok, ids, 2), delay_s=0.02)
    kwargs = dict(model=MODEL, n=3, extra_headers={"X-Request-Id": "pl"}, extra_body={"prompt_logprobs": 2})
    got: dict[int, list] = {}
    texts = dict.fromkeys(range(3), "")
    if stream:
        for chunk in client.completions.create(prompt=ids, stream=True, **kwargs):
            for c in chunk.choices:
                if "prompt_logprobs" in c.model_extra:
                    assert c.index not in got and texts[c.index] == "", c.index  # once, ahead of the text
                    got[c.index] = c.model_extra["prompt_logprobs"]
                texts[c.index] += c.text
    else:
        r = client.completions.create(prompt=ids, **kwargs)
        got = {c.index: c.model_extra["prompt_logprobs"] for c in r.choices}
        texts = {c.index: c.text for c in r.choices}
    assert {q.request_id: q.HasField("prompt_logprobs") for q in fake.requests} == {
        "pl": True,
        "pl-1": False,
        "pl-2": False,
    }
    assert texts == dict.fromkeys(range(3), ANSWER) and sorted(got) == [0, 1, 2]
    for entries in got.values():
        _check_shape(tok, ids, 2, entries)

    fake.reset(_script(tok, ids, 2), delay_s=0.02)
    chat = dict(kwargs, extra_body={"prompt_logprobs": 2, **NO_THINK})
    if stream:
        chunks = list(client.chat.completions.create(messages=USER, stream=True, **chat))
        carrying = [c for c in chunks if "prompt_logprobs" in (c.model_extra or {})]
        assert len(carrying) == 1 and [ch.index for ch in carrying[0].choices] == [0]
        entries = carrying[0].model_extra["prompt_logprobs"]
    else:
        r = client.chat.completions.create(messages=USER, **chat)
        assert [c.message.content for c in r.choices] == [ANSWER] * 3
        entries = r.model_extra["prompt_logprobs"]
    assert sorted(q.request_id for q in fake.requests if q.HasField("prompt_logprobs")) == ["pl"]
    _check_shape(tok, ids, 2, entries)


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_a_failure_before_the_first_token_is_an_error_status(client, fake, tok, route):
    """The verifier sends the prompt's entries, then fails before any token (a grammar's dead end at the
    first token is INVALID_ARGUMENT): the stream has not started, the answer is a plain 400."""
    ids = tok.encode(PROMPT_TEXT)
    message = "response_format: the grammar allows no token at output position 0"
    fake.reset(_pieces(tok, ids, 1), error=(grpc.StatusCode.INVALID_ARGUMENT, message))
    with pytest.raises(openai.BadRequestError) as err:
        if route == "chat":
            client.chat.completions.create(
                model=MODEL, messages=USER, stream=True, extra_body={"prompt_logprobs": 1, **NO_THINK}
            )
        else:
            client.completions.create(model=MODEL, prompt=ids, stream=True, extra_body={"prompt_logprobs": 1})
    assert err.value.status_code == 400 and err.value.body["message"] == message
    assert fake.sent == len(_pieces(tok, ids, 1))  # every entry reached the gateway before the failure


def test_grpc_chunks_carry_the_pieces(gw, fake, tok):
    ids = tok.encode(PROMPT_TEXT)
    fake.reset(_script(tok, ids, 2))
    with grpc.insecure_channel(gw.address) as channel:
        options = gateway_pb2.GenerationOptions(prompt_logprobs=2)
        request = gateway_pb2.CompleteRequest(prompt=PROMPT_TEXT, options=options)
        chunks = list(gateway_pb2_grpc.GatewayStub(channel).Complete(request))
        assert fake.requests[-1].prompt_logprobs == 2
        pieces = [c.prompt_logprobs for c in chunks if c.HasField("prompt_logprobs")]
        assert all(not c.token_ids for c in chunks if c.HasField("prompt_logprobs"))
        assert [p.start for p in pieces] == list(range(1, len(ids), 2))
        assert [t for p in pieces for t in p.token_ids] == ids[1:]
        assert [r for p in pieces for r in p.ranks] == [s[2] for s in _scored(tok, ids, 2)]
        with pytest.raises(grpc.RpcError) as err:
            options = gateway_pb2.GenerationOptions(prompt_logprobs=21)
            list(
                gateway_pb2_grpc.GatewayStub(channel).Complete(gateway_pb2.CompleteRequest(prompt="a", options=options))
            )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt_logprobs" in err.value.details()


@pytest.fixture
def long_context_client(fake, tokenizer_dir):
    """A gateway of its own over the fake with a context for 16k tokens: the entries bound, not the
    context, is what the prompts below meet."""
    fake.max_context = 16_384
    running = serve_gateway(fake, tokenizer_dir)
    try:
        yield openai_client(next(running))
    finally:
        next(running, None)
        fake.max_context = 1234


def test_a_response_too_large_is_400(long_context_client, fake, tok):
    client = long_context_client
    fake.reset(script_for([5]))
    ids = [7] * 6000  # 16 choices * 6000 positions * 21 entries: over the 2M entries one response may hold
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=ids, n=16, stream=True, extra_body={"prompt_logprobs": 20})
    assert err.value.body["param"] == "prompt_logprobs" and "is over 2000000" in err.value.body["message"]
    assert fake.requests == []

    # A stream of n choices may hold the other n - 1 choices' output until choice 0's entries are in:
    # 16 * 2200 * 21 prompt entries fit, with 15 * 4096 * 21 held output entries they do not.
    options = {"prompt_logprobs": 20}
    with pytest.raises(openai.BadRequestError) as err:
        kwargs = dict(model=MODEL, prompt=[7] * 2200, n=16, max_tokens=4096, logprobs=20, stream=True)
        client.completions.create(extra_body=options, **kwargs)
    message = err.value.body["message"]
    assert err.value.body["param"] == "prompt_logprobs" and f"16 * 2200 * 21 + {15 * 4096 * 21} output" in message
    assert fake.requests == []


# -- the real stack ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def target(default_ckpt):
    from ddtree.models.checkpoint.loader import load_target

    return load_target(str(default_ckpt.target), dtype=torch.float32, device="cpu").eval()


@pytest.fixture(scope="module")
def stack_tok(default_ckpt):
    from ddtree.tokenization.tokenizer import Tokenizer

    return Tokenizer(default_ckpt.target)


@pytest.fixture(scope="module")
def stack_client(oracle_stack):
    return openai.OpenAI(base_url=f"http://{oracle_stack.gateway_http}/v1", api_key="none", max_retries=0, timeout=120)


def _check_against_target(target, ids: list[int], k: int, got: list) -> None:
    """Each position p >= 1 against log_softmax of the target's logits over the whole prompt (row p - 1),
    within fp32 tolerance: the prompt token's logprob and rank, and the k most likely tokens."""
    from tests.support.quantized_checkpoints import logits as full_logits

    with torch.inference_mode():
        ref = torch.log_softmax(full_logits(target, ids).double(), dim=-1)  # [len(ids), V]
    assert len(got) == len(ids) and got[0] is None
    tol = 1e-4
    for p in range(1, len(ids)):
        row, entry, t = ref[p - 1], got[p], ids[p]
        own = entry[str(t)]
        want = row[t].item()
        assert abs(own["logprob"] - want) < tol, (p, own, want)
        assert (row > want + tol).sum().item() + 1 <= own["rank"] <= (row >= want - tol).sum().item()
        assert list(entry)[0] == str(t) and len(entry) in (k, k + 1)  # k + 1: the prompt token is not a top one
        top = sorted(list(entry.items())[len(entry) - k :], key=lambda x: x[1]["rank"])
        assert [e["rank"] for _, e in top] == list(range(1, k + 1))
        top = [(int(i), e["logprob"]) for i, e in top]
        best = row.topk(k).values.tolist() if k else []
        assert all(abs(v - b) < tol and abs(row[i].item() - v) < tol for (i, v), b in zip(top, best))


def test_long_prompt_in_the_prefix_cache_is_scored_whole(oracle_stack, stack_client, stack_tok, target):
    text = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"
    ids = stack_tok.encode(text * 4)
    assert len(ids) > 2 * 64  # several prefill chunks of the stack's --prefill-chunk 64
    kwargs = dict(model=MODEL, prompt=ids, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    plain = stack_client.completions.create(**kwargs)  # its prompt enters the prefix cache when it ends
    again = stack_client.completions.create(**kwargs)
    assert again.usage.prompt_tokens_details.cached_tokens > 0  # a plain request now takes it from the cache
    kwargs["extra_body"] = {"ignore_eos": True, "prompt_logprobs": 5}
    r = stack_client.completions.create(**kwargs)
    assert r.usage.prompt_tokens_details.cached_tokens == 0  # every prompt row was computed
    assert r.choices[0].text == plain.choices[0].text  # the generation does not change
    _check_against_target(target, ids, 5, r.choices[0].model_extra["prompt_logprobs"])


def test_k0_streamed_and_chat_on_the_stack(oracle_stack, stack_client, stack_tok, target):
    ids = stack_tok.encode("Write a loop that counts to ten.")
    chunks = list(
        stack_client.completions.create(
            model=MODEL, prompt=ids, max_tokens=4, temperature=0, stream=True, extra_body={"prompt_logprobs": 0}
        )
    )
    got = [c.choices[0].model_extra.get("prompt_logprobs") for c in chunks if c.choices]
    got = [g for g in got if g is not None]
    assert len(got) == 1 and all(len(e) == 1 for e in got[0][1:])  # k = 0: the prompt token alone
    _check_against_target(target, ids, 0, got[0])

    messages = [{"role": "user", "content": "Write a loop."}]
    tokenize = urllib.request.Request(
        f"http://{oracle_stack.gateway_http}/tokenize",
        json.dumps({"messages": messages}).encode(),
        headers={"Content-Type": "application/json"},  # a form body is 415
        method="POST",
    )
    with urllib.request.urlopen(tokenize, timeout=60) as answer:  # the ids the chat request sends
        chat_ids = json.loads(answer.read())["tokens"]
    r = stack_client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=4, temperature=0, extra_body={"prompt_logprobs": 3, "budget": 8}
    )
    assert r.usage.prompt_tokens == len(chat_ids)
    _check_against_target(target, chat_ids, 3, r.model_extra["prompt_logprobs"])


def test_verifier_stream_and_its_400s(oracle_stack, stack_tok):
    from ddtree.protocol.ddtree.v1 import verifier_pb2_grpc

    ids = stack_tok.encode("for i in range(10):\n    print(i * i)\n" * 10)
    assert len(ids) > 2 * 64
    greedy = common_pb2.SamplingParams(temperature=0.0)
    with grpc.insecure_channel(oracle_stack.verifier) as ch:
        stub = verifier_pb2_grpc.VerifierStub(ch)
        req = verifier_pb2.GenerateRequest(input_ids=ids, max_new_tokens=3, sampling=greedy, prompt_logprobs=2)
        msgs = list(stub.Generate(req, timeout=120))
        first_token = next(i for i, m in enumerate(msgs) if m.token_ids)
        pieces = [m.prompt_logprobs for m in msgs if m.HasField("prompt_logprobs")]
        assert all(m.HasField("prompt_logprobs") and not m.token_ids for m in msgs[:first_token])
        assert len(pieces) == first_token >= 3 and all(len(p.token_ids) <= 64 for p in pieces)  # one per chunk
        assert [p.start for p in pieces] == list(itertools.accumulate([1] + [len(p.token_ids) for p in pieces[:-1]]))
        assert [t for p in pieces for t in p.token_ids] == ids[1:]
        for bad in (-1, 21):
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Generate(verifier_pb2.GenerateRequest(input_ids=ids, max_new_tokens=3, prompt_logprobs=bad)))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details() == f"prompt_logprobs must be in [0, 20], got {bad}"
        features = verifier_pb2.FeaturesRequest(generate=req, tap_layer_ids=[1])
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Features(features))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt_logprobs" in err.value.details()
