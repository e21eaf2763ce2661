"""n > 1 (services/gateway/choices.py): n sequences for one request, chat and completions, streaming
(each chunk with its choice index) and not.

- Against a FAKE verifier with the official `openai` client: n verifier requests with ids ID, ID-1, ...
  and seeds seed, seed + 1, ...; n choices in index order; usage with the prompt once and the
  completion tokens summed; a stream whose chunks carry every index, one usage chunk at the end; the
  limits (400); n takes n of the gateway's worker threads (429 when not free); a whole response is
  bounded (400) but a stream is not; Choices.close() returns at once and never raises.
- On the real stack: n = 3 with a seed at temperature 1 is reproducible per choice, different across
  choices, and choice i equals a single request with seed + i (each choice is its own seed stream);
  streaming gives the same choices; at temperature 0 the n choices are identical. n = 4 with a new
  prompt prefills it once: one choice computes it, the other three take all but its last token from
  the prefix cache (the verifier's prefix_hit events), and each equals its request run alone. With
  prompt_logprobs only choice 0 reads the whole prompt, the others still share a prefill, and every
  choice shows the entries the request alone gets.
"""

from __future__ import annotations

import json
import threading
import time

import openai
import pytest

from ddtree.config import GatewayConfig
from ddtree.gateway.api.server import serve
from ddtree.gateway.choices import MAX_N, Choices
from ddtree.protocol.ddtree.v1 import common_pb2, gateway_pb2
from tests.support.fakes import script_for

MODEL = "ddtree-demo"
USER = [{"role": "user", "content": "2+2?"}]
NO_THINK = {"chat_template_kwargs": {"thinking": False}}  # the answer is content, not reasoning


@pytest.fixture(scope="module")
def client(fake, tokenizer_dir):
    config = GatewayConfig(verifier=fake.address)
    config.validate()
    running = serve(config, tokenizer_dir=tokenizer_dir, announce=False)
    yield openai.OpenAI(base_url=f"http://{running.http_address}/v1", api_key="none", max_retries=0, timeout=20)
    running.stop(0)


def _script(tok, text="four, of course"):
    ids = tok.encode(text)
    usage = common_pb2.Usage(
        prompt_tokens=11, completion_tokens=len(ids), verify_steps=2, accept_histogram=[0, 0, 0, 1, 1], cached_tokens=4
    )
    return ids, script_for(ids, sizes=[3, len(ids) - 3], finish="length", usage=usage)


def test_n_chat_and_completions(client, fake, tok):
    ids, msgs = _script(tok)
    fake.reset(msgs)
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=USER,
        n=3,
        seed=41,
        temperature=1.0,
        extra_body=NO_THINK,
        extra_headers={"X-Request-Id": "many"},
    )
    r = raw.parse()
    assert raw.headers["x-request-id"] == "many" and r.id == "chatcmpl-many"
    assert sorted(q.request_id for q in fake.requests) == ["many", "many-1", "many-2"]
    seeds = {q.request_id: q.sampling.seed for q in fake.requests}
    assert seeds == {"many": 41, "many-1": 42, "many-2": 43}
    assert all(q.input_ids == fake.requests[0].input_ids for q in fake.requests)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert all(c.message.content == "four, of course" for c in r.choices)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (11, 3 * len(ids))
    assert r.usage.prompt_tokens_details.cached_tokens == 4
    assert r.model_extra["spec"]["verify_steps"] == 6 and r.model_extra["spec"]["accept_histogram"] == [0, 0, 0, 3, 3]

    fake.reset(msgs)
    c = client.completions.create(model=MODEL, prompt="a", n=2)  # no seed: none is sent
    assert [x.index for x in c.choices] == [0, 1] and all(x.text == "four, of course" for x in c.choices)
    assert not any(q.sampling.HasField("seed") for q in fake.requests)
    assert c.usage.completion_tokens == 2 * len(ids) and c.usage.total_tokens == 11 + 2 * len(ids)


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_n_streams_carry_each_index(client, fake, tok, route):
    ids, msgs = _script(tok)
    fake.reset(msgs)
    opts = dict(model=MODEL, n=3, stream=True, stream_options={"include_usage": True})
    if route == "chat":
        chunks = list(client.chat.completions.create(messages=USER, extra_body=NO_THINK, **opts))
        text = lambda ch: ch.delta.content or ""  # noqa: E731
    else:
        chunks = list(client.completions.create(prompt="a", **opts))
        text = lambda ch: ch.text  # noqa: E731
    per: dict[int, str] = {0: "", 1: "", 2: ""}
    finished = []
    for c in chunks[:-1]:
        (choice,) = c.choices
        per[choice.index] += text(choice)
        if choice.finish_reason:
            finished.append(choice.index)
    assert per == {i: "four, of course" for i in range(3)} and sorted(finished) == [0, 1, 2]
    if route == "chat":  # the role comes first, once per choice
        assert [c.choices[0].index for c in chunks[:3]] == [0, 1, 2]
        assert all(c.choices[0].delta.role == "assistant" for c in chunks[:3])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3 * len(ids)
    assert sum(1 for c in chunks if c.usage) == 1


@pytest.mark.parametrize("n", [0, MAX_N + 1])
def test_n_limits(client, fake, n):
    fake.reset(script_for([5]))
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=USER, n=n)
    assert f"n: must be in [1, {MAX_N}], got {n}" in err.value.body["message"] and err.value.body["param"] == "n"
    assert fake.requests == []


def test_one_failing_choice_fails_the_request(client, fake, tok):
    import grpc

    fake.reset(script_for(tok.encode("ok")), error=(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full"))
    fake.run.script[-1].finish_reason = ""  # every choice ends in the error
    with pytest.raises(openai.RateLimitError):
        client.completions.create(model=MODEL, prompt="a", n=2)


def _gateway(fake, tokenizer_dir, **kw):
    config = GatewayConfig(verifier=fake.address, **kw)
    config.validate()
    return serve(config, tokenizer_dir=tokenizer_dir, announce=False)


def _openai(running):
    return openai.OpenAI(base_url=f"http://{running.http_address}/v1", api_key="none", max_retries=0, timeout=20)


def test_n_takes_worker_threads_or_is_429(fake, tokenizer_dir, tok):
    running = _gateway(fake, tokenizer_dir, max_workers=1, max_streams=2)  # 3 worker threads
    try:
        client = _openai(running)
        fake.reset(script_for(tok.encode("ok")))
        with pytest.raises(openai.RateLimitError) as err:
            client.completions.create(model=MODEL, prompt="a", n=3, max_tokens=4)
        assert err.value.body["param"] == "n" and "3 choices need 4 of the gateway's 3 worker threads" in str(err.value)
        ids, msgs = _script(tok)
        fake.reset(msgs)
        r = client.completions.create(model=MODEL, prompt="a", n=2, max_tokens=8)  # 2 + 1 of 3: fits
        assert [c.index for c in r.choices] == [0, 1]
        fake.reset(msgs)
        r = client.completions.create(model=MODEL, prompt="a", n=2, max_tokens=8)  # the tokens came back
        assert len(r.choices) == 2
    finally:
        running.stop(0)


def test_a_whole_n_response_is_bounded(fake, tokenizer_dir, tok):
    fake.max_context = 300_000  # the bound on n, not the context, is what 100_001 tokens meet here
    fake.max_new_tokens_limit = 200_000  # the verifier's cap, which the gateway asks
    running = _gateway(fake, tokenizer_dir)
    try:
        client = _openai(running)
        fake.reset(script_for([5]))
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model=MODEL, prompt="a", n=2, max_tokens=100_001, logprobs=9)
        assert err.value.body["param"] == "n" and "n * max_tokens * (top_logprobs + 1)" in err.value.body["message"]
        assert fake.requests == []
        ids, msgs = _script(tok)
        fake.reset(msgs)
        chunks = list(
            client.completions.create(model=MODEL, prompt="a", n=2, max_tokens=100_001, logprobs=9, stream=True)
        )
        assert {c.choices[0].index for c in chunks if c.choices} == {0, 1}
    finally:
        running.stop(0)
        fake.max_context = 1234


class _Slow:
    """A Generation stand-in that ends 0.5 s after cancel(), and whose close() may raise."""

    def __init__(self, i: int, close_raises: bool = False):
        self.request_id, self.close_raises = f"r-{i}", close_raises
        self.cancelled, self.closed = threading.Event(), threading.Event()
        self._it = self._run()

    def _run(self):
        yield gateway_pb2.GenerateChunk(request_id=self.request_id)
        self.cancelled.wait(10)
        time.sleep(0.5)

    def __iter__(self):
        return self

    def __next__(self):
        return next(self._it)

    def cancel(self):
        self.cancelled.set()

    def close(self):
        self.closed.set()
        if self.close_raises:
            raise ValueError("generator already executing")
        self._it.close()


def test_choices_close_neither_blocks_nor_raises():
    gens = [_Slow(i) for i in range(4)]
    choices = Choices(gens)
    assert next(choices)[1].request_id.startswith("r-")  # the threads run
    started = time.monotonic()
    choices.close()
    assert time.monotonic() - started < 0.2
    assert all(g.cancelled.is_set() for g in gens)
    assert all(g.closed.wait(5) for g in gens)  # each thread closed its own generation
    idle = Choices([_Slow(i, close_raises=True) for i in range(3)])  # never started: closed here
    idle.close()
    assert all(g.closed.is_set() for g in idle.generations)
    with pytest.raises(StopIteration):
        next(idle)


# -- the real stack ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def stack_client(oracle_stack):
    return openai.OpenAI(base_url=f"http://{oracle_stack.gateway_http}/v1", api_key="none", max_retries=0, timeout=120)


def test_n_seed_streams_on_the_real_stack(stack_client):
    def run(n, seed, stream=False, temperature=1.0):
        kwargs = dict(
            model=MODEL,
            prompt="def parse(line):",
            max_tokens=16,
            temperature=temperature,
            seed=seed,
            n=n,
            extra_body={"ignore_eos": True, "budget": 8},
        )
        if not stream:
            r = stack_client.completions.create(**kwargs)
            assert r.usage.completion_tokens == 16 * n
            return [c.text for c in r.choices]
        texts = [""] * n
        for c in stack_client.completions.create(stream=True, **kwargs):
            for ch in c.choices:
                texts[ch.index] += ch.text
        return texts

    first = run(3, 5)
    assert run(3, 5) == first  # reproducible per choice
    assert len(set(first)) == 3  # different across choices
    assert [run(1, 5 + i)[0] for i in range(3)] == first  # choice i is the seed + i stream
    assert run(3, 5, stream=True) == first
    greedy = run(3, None, temperature=0.0)
    assert len(set(greedy)) == 1  # temperature 0: the same answer n times, as vLLM


def test_n_choices_and_the_prefix_cache(stack_client):
    """The response's cached_tokens is the least over its choices: for a new prompt, what the choice that
    prefilled it found (at most a start shared with earlier prompts); once it is cached, every choice
    of the next request takes all but its last token from there."""
    prompt = "def tokenize(source):\n    tokens = []\n    for line in source.splitlines():"
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=4, temperature=1.0, seed=1, n=3)
    first = stack_client.completions.create(**kwargs).usage
    again = stack_client.completions.create(**kwargs).usage
    assert first.prompt_tokens == again.prompt_tokens and first.completion_tokens == again.completion_tokens == 12
    assert first.prompt_tokens_details.cached_tokens < 4  # "def" and the like, from earlier tests' prompts
    assert again.prompt_tokens_details.cached_tokens == again.prompt_tokens - 1


def _prefix_hits(stack, request_ids) -> dict[str, int]:
    """cached_tokens of the verifier's prefix_hit events, by request id (0: no hit)."""
    hits = dict.fromkeys(request_ids, 0)
    for line in stack.get("verifier").log_path.read_text().splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and event.get("event") == "prefix_hit" and event.get("request_id") in hits:
            hits[event["request_id"]] = event["cached_tokens"]
    return hits


def test_n_choices_share_one_prefill(stack_client, oracle_stack):
    """n = 4, a new prompt: the verifier prefills it once. The first choice admitted computes it and
    enters it into the prefix cache as its prefill completes; the others wait for that and take all but
    the last prompt token from the cache. Each choice equals the same request sent alone (seed + i)."""
    prompt = "class Interval:\n    def __init__(self, lo, hi):\n        self.lo, self.hi = lo, hi\n"
    kwargs = dict(
        model=MODEL, prompt=prompt, max_tokens=12, temperature=1.0, extra_body={"ignore_eos": True, "budget": 8}
    )
    r = stack_client.completions.create(n=4, seed=3, extra_headers={"X-Request-Id": "shared-prefill"}, **kwargs)
    ids = ["shared-prefill"] + [f"shared-prefill-{i}" for i in range(1, 4)]
    L = r.usage.prompt_tokens
    cached = sorted(_prefix_hits(oracle_stack, ids).values())
    assert cached[1:] == [L - 1] * 3, cached  # three choices prefilled only the last prompt token
    assert cached[0] < L - 1  # the one that prefilled it: at most a start shared with earlier prompts
    prefilled = sum(L - c for c in cached)
    assert prefilled == (L - cached[0]) + 3, f"{prefilled} prompt tokens prefilled for a {L}-token prompt"
    assert r.usage.prompt_tokens_details.cached_tokens == cached[0]  # the least over the choices
    alone = [stack_client.completions.create(seed=3 + i, **kwargs).choices[0].text for i in range(4)]
    assert [c.text for c in r.choices] == alone


def _same_prompt_logprobs(a: list, b: list, tol: float = 1e-4) -> bool:
    """Two answers' prompt_logprobs agree: the same ids in the same order at each position (the prompt
    token, then the top ones), each logprob within fp32 tolerance (batches of other shapes may round
    otherwise)."""
    return (
        len(a) == len(b)
        and a[0] is None is b[0]
        and all(
            list(x) == list(y) and all(abs(x[i]["logprob"] - y[i]["logprob"]) < tol for i in x)
            for x, y in zip(a[1:], b[1:])
        )
    )


def test_prompt_logprobs_choices_share_one_prefill(stack_client, oracle_stack):
    """n = 3 with prompt_logprobs, a new prompt: only choice 0 reads the whole prompt; the others share a
    prefill (when each asked, each read it whole and none took it from the cache). Every choice shows
    the prompt_logprobs of the same request sent alone, and each choice's text is its request's alone
    (seed + i)."""
    prompt = "class Deque:\n    def push_left(self, item):\n        self.items.insert(0, item)\n"
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=4, temperature=1.0)
    body = {"ignore_eos": True, "budget": 8, "prompt_logprobs": 2}
    r = stack_client.completions.create(
        n=3, seed=9, extra_headers={"X-Request-Id": "pl-shared"}, extra_body=body, **kwargs
    )
    L = r.usage.prompt_tokens
    hits = _prefix_hits(oracle_stack, ["pl-shared", "pl-shared-1", "pl-shared-2"])
    assert hits["pl-shared"] == 0  # choice 0 scores every prompt row: it takes nothing from the cache
    # Choice 0 admitted first: both others wait for its prefill and take all but the last token from the
    # cache; another one admitted first prefills for the last (beside choice 0). Never three prefills.
    assert max(hits["pl-shared-1"], hits["pl-shared-2"]) == L - 1, hits
    alone = stack_client.completions.create(seed=9, extra_body=body, **kwargs).choices[0]
    assert len(alone.model_extra["prompt_logprobs"]) == L
    assert all(
        _same_prompt_logprobs(c.model_extra["prompt_logprobs"], alone.model_extra["prompt_logprobs"]) for c in r.choices
    )
    plain = {k: v for k, v in body.items() if k != "prompt_logprobs"}
    others = [stack_client.completions.create(seed=9 + i, extra_body=plain, **kwargs).choices[0].text for i in (1, 2)]
    assert [c.text for c in r.choices] == [alone.text, *others]
