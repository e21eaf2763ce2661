"""Structured outputs on trees (services/gateway/structured_outputs.py, services/verifier/constraints/grammar.py).

- The grammar follows each tree path: pruning keeps exactly the grammar-valid nodes, and the sequence's
  state is where it was after the depth-first walk; a parser limit met on a draft path (the target takes
  another token) leaves plain constrained AR's output, with the table build and with pruning.
- The real stack with the oracle drafter (official `openai` client): 20 JSON schemas at temperature 0
  through DDTree at budgets 8 and 32 parse, validate (`jsonschema`) and equal constrained AR
  (`no_spec`) token for token; regex, choice and vLLM's structured_outputs; tool_choice required / a
  named function always gives calls whose arguments validate; bad schemas are 400s naming the field.
- Temperature 1: the first three tokens through DDTree follow the grammar-masked target distribution
  (chi-square), on the tiny 8-token target of tests/support/tiny_target.py (trees built from the
  drafter's table, `grammar_tree table`, the default); greedy equals constrained AR with either tree.
- A grammar's dead end is the request's error (INVALID_ARGUMENT, HTTP 400), a fault in a grammar step the
  verifier's (INTERNAL, without the exception's text).
"""

from __future__ import annotations

import dataclasses
import json
import types

import grpc
import jsonschema
import llguidance
import openai
import pytest
import torch

from ddtree.config import VerifierConfig
from ddtree.contract.sampling_params import SamplingConfig
from ddtree.contract.token_tree import EMPTY_TREE, TokenTree
from ddtree.gateway.pipeline import Invalid
from ddtree.gateway.structured_outputs import after_reasoning, check_grammar
from ddtree.protocol.ddtree.v1 import verifier_pb2
from ddtree.tokenization.grammar_vocab import ll_tokenizer
from ddtree.verifier.constraints.grammar import SequenceGrammar
from ddtree.verifier.sequence import GenerateParams, Sequence
from tests.support.engines import engine_with_drafter
from tests.support.letter_vocab import letter_tokenizer
from tests.support.oracle_engine import OracleDraftEngine
from tests.support.tiny_target import ALLOWED, PROMPT, REGEX, VOCAB, chi2_pvalue, regex_masked

SAMPLES = 1000

_S = {"type": "string", "maxLength": 6}
SCHEMAS = [
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
    {"type": "object", "properties": {"name": _S, "age": {"type": "integer", "minimum": 0, "maximum": 120}}},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {"p": {"type": "object", "properties": {"x": {"type": "integer"}}}}},
    {
        "type": "object",
        "properties": {"user": {"type": "object", "properties": {"id": {"type": "integer"}, "tag": _S}}},
        "required": ["user"],
    },
    {"type": "object", "properties": {"xs": {"type": "array", "items": _S, "maxItems": 3}}, "required": ["xs"]},
    {"enum": ["yes", "no", "maybe"]},
    {"type": "integer", "minimum": 10, "maximum": 99},
    {"type": "object", "properties": {"n": {"type": "null"}}, "required": ["n"]},
    {"type": "object", "properties": {"k": {"const": "fixed"}, "v": {"type": "integer"}}, "required": ["k", "v"]},
    {"type": "object", "properties": {"a": {"anyOf": [{"type": "integer"}, {"type": "boolean"}]}}, "required": ["a"]},
    {"type": "object", "properties": {"s": {"type": "string", "pattern": "^[a-c]{2,4}$"}}, "required": ["s"]},
    {
        "type": "object",
        "properties": {"items": {"type": "array", "items": {"enum": [1, 2, 3]}, "maxItems": 5}},
        "required": ["items"],
        "additionalProperties": False,
    },
    {"type": "object", "properties": {"opt": {"type": "integer"}, "req": {"type": "boolean"}}, "required": ["req"]},
    {
        "type": "object",
        "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {"c": _S}}}}},
        "required": ["a"],
    },
    {"type": "boolean"},
    {
        "type": "object",
        "properties": {"level": {"enum": ["low", "high"]}, "score": {"type": "integer", "minimum": 1, "maximum": 5}},
        "required": ["level", "score"],
        "additionalProperties": False,
    },
    {"type": "array", "items": {"type": "object", "properties": {"id": {"type": "integer"}}}, "maxItems": 2},
]


def _closed(schema):
    """Objects without extra keys, bounded integers (an open object lets the random demo model add keys until max_tokens)."""
    if isinstance(schema, dict):
        schema = {k: _closed(v) for k, v in schema.items()}
        if schema.get("type") == "object":
            schema.setdefault("additionalProperties", False)
        if schema.get("type") == "integer":  # and integers bounded (else: digits until max_tokens)
            schema.setdefault("minimum", -999)
            schema.setdefault("maximum", 999)
    elif isinstance(schema, list):
        schema = [_closed(v) for v in schema]
    return schema


SCHEMAS = [_closed(s) for s in SCHEMAS]
NO_THINK = {"chat_template_kwargs": {"thinking": False}}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Rome"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}, "additionalProperties": False}},
}


@pytest.fixture(scope="module")
def client(oracle_stack):
    return openai.OpenAI(base_url=f"http://{oracle_stack.gateway_http}/v1", api_key="none", max_retries=0, timeout=300)


def _chat(client, i: int, **extra):
    return client.chat.completions.create(
        model="ddtree-demo",
        messages=[{"role": "user", "content": f"Answer {i} in JSON."}],
        max_tokens=96,
        temperature=0,
        extra_body={**NO_THINK, **extra.pop("extra_body", {})},
        **extra,
    )


def test_prune_keeps_grammar_valid_nodes_and_leaves_the_state(tok):
    lt = ll_tokenizer(tok)
    matcher = llguidance.LLMatcher(lt, llguidance.LLMatcher.grammar_from_regex("ab(c|d)e"))
    a, b, c, d, x = (tok.encode(ch)[0] for ch in "abcdx")
    assert matcher.consume_token(a)  # the root "a" is emitted
    # root -> b -> {c, x}, root -> x -> c, b -> c -> d (invalid: after "abc" only "e")
    tree = TokenTree((b, x, c, x, c, d), (0, 0, 1, 1, 2, 3), (1, 1, 2, 2, 2, 3))
    g = SequenceGrammar(matcher, frozenset())
    step = g.prepare(tree)
    pruned, masks = step.tree, step.masks
    assert pruned == TokenTree((b, c), (0, 1), (1, 2))
    assert masks.shape[0] == 3 and masks[0, b] and not masks[0, x] and masks[1, c] and masks[1, d]
    e = tok.encode("e")[0]
    assert masks[2, e] and masks[2].sum() == 1
    g.advance([b, d, e], step)  # the walk left the sequence's state at "a": the emitted tokens take it on
    assert g.matcher.is_accepting() and not g.matcher.is_error()


def test_twenty_schemas_through_ddtree_equal_constrained_ar(client):
    for i, schema in enumerate(SCHEMAS):
        rf = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}}
        ar = _chat(client, i, response_format=rf, extra_body={"no_spec": True})
        text = ar.choices[0].message.content
        assert ar.choices[0].finish_reason == "stop", (i, text)
        jsonschema.validate(json.loads(text), schema)
        for budget in (8, 32):
            r = _chat(client, i, response_format=rf, extra_body={"budget": budget})
            assert r.choices[0].message.content == text, (i, budget)
            assert r.usage.completion_tokens == ar.usage.completion_tokens
            assert r.model_extra["spec"]["verify_steps"] <= ar.model_extra["spec"]["verify_steps"]


def test_json_object_regex_choice_and_vllm_fields(client):
    r = _chat(client, 0, response_format={"type": "json_object"})  # any object: may run to max_tokens here
    text = r.choices[0].message.content
    assert text.startswith("{") and (r.choices[0].finish_reason == "length" or isinstance(json.loads(text), dict))
    r = _chat(client, 1, extra_body={"guided_regex": "[a-d]{3}-[0-9]{2}"})
    assert r.choices[0].message.content[3] == "-" and len(r.choices[0].message.content) == 6
    r = _chat(client, 2, extra_body={"guided_choice": ["alpha", "beta gamma"]})
    assert r.choices[0].message.content in ("alpha", "beta gamma")
    schema = SCHEMAS[1]
    for body in ({"structured_outputs": {"json": schema}}, {"guided_json": schema}):
        r = _chat(client, 3, extra_body=body)
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    done = client.completions.create(
        model="ddtree-demo", prompt="n=", max_tokens=16, temperature=0, extra_body={"guided_regex": "[0-9]{2,3}"}
    )
    assert done.choices[0].text.isdigit() and 2 <= len(done.choices[0].text) <= 3


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_forces_valid_calls(client, stream):
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        for i in range(2):  # two prompts per choice: each request decodes up to 200 grammar-masked tokens
            kwargs = dict(
                model="ddtree-demo",
                messages=[{"role": "user", "content": f"What now {i}?"}],
                tools=[WEATHER, CLOCK],
                tool_choice=choice,
                max_tokens=200,
                temperature=0,
                extra_body=NO_THINK,
            )
            if stream:
                calls: dict[int, dict] = {}
                for chunk in client.chat.completions.create(stream=True, **kwargs):
                    for d in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
                        call = calls.setdefault(d.index, {"name": "", "arguments": ""})
                        call["name"] += d.function.name or ""
                        call["arguments"] += d.function.arguments or ""
                got = list(calls.values())
            else:
                r = client.chat.completions.create(**kwargs)
                assert r.choices[0].finish_reason == "tool_calls"
                got = [
                    {"name": c.function.name, "arguments": c.function.arguments}
                    for c in r.choices[0].message.tool_calls
                ]
            assert got
            for call in got:
                if isinstance(choice, dict):
                    assert call["name"] == "get_weather"
                tool = {"get_weather": WEATHER, "get_time": CLOCK}[call["name"]]
                jsonschema.validate(json.loads(call["arguments"]), tool["function"]["parameters"])


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}},
            "response_format.json_schema.schema",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"guided_regex": "[0-9"}, "guided_regex"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex"),
        ({"structured_outputs": {"json": {"$ref": "#/nope"}}}, "structured_outputs.json"),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice.function.name",
        ),
        ({"guided_whitespace_pattern": " *"}, "guided_whitespace_pattern"),
    ],
)
def test_bad_constraints_are_400_naming_the_field(client, extra, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="ddtree-demo", messages=[{"role": "user", "content": "x"}], max_tokens=4, extra_body=extra
        )
    assert err.value.body["param"] == param, err.value.body


@pytest.mark.parametrize(
    ("grammar", "message"),
    [
        ('{"grammars": []}', "grammar: grammars must be a non-empty array"),
        ('{"grammars": ["x"]}', "grammar: grammars must be a non-empty array"),
        ('{"grammars": 3}', "grammar: grammars must be a non-empty array"),
        ('{"grammars": [{"name": "a b", "lark_grammar": "start: \\"a\\""}]}', "grammar: grammars[0].name"),
    ],
)
def test_after_reasoning_refuses_a_malformed_grammar(tok, grammar, message):
    """Its callers check the grammar first (check_grammar); the wrapping itself never raises other than Invalid."""
    with pytest.raises(Invalid) as err:
        after_reasoning(grammar, tok)
    assert str(err.value).startswith(message)


def test_after_reasoning_names_the_answer_apart_from_the_others(tok):
    inner = {"grammars": [{"lark_grammar": 'start: "a" @answer'}, {"name": "answer", "lark_grammar": 'start: "b"'}]}
    grammars = json.loads(after_reasoning(json.dumps(inner), tok))["grammars"]
    assert grammars[0]["lark_grammar"].split("\n")[0].endswith("@answer1") and grammars[1]["name"] == "answer1"
    assert grammars[2]["name"] == "answer"
    check_grammar(json.dumps({"grammars": grammars}), "grammar")
    assert json.loads(after_reasoning('start: "a"', tok))["grammars"][1] == {
        "lark_grammar": 'start: "a"',
        "name": "answer",
    }


def _tiny_vocab():
    return letter_tokenizer(VOCAB)


def _serve(model, seqs: list[Sequence], grammar_tree: str = "table") -> list:
    """Run the sequences in one in-process verifier engine (the oracle drafter: real trees, or tables), submitted
    together so that they share steps; returns each one's last event."""
    oracle = OracleDraftEngine(model, depth=4, default_budget=12, max_budget=64, seed=11)
    vcfg = VerifierConfig(
        max_batch=64, max_queue=len(seqs), kv_tokens=64 * 40, prefill_chunk=64, grammar_tree=grammar_tree
    )
    last = []
    with engine_with_drafter(model, vcfg, oracle) as engine:
        for seq in seqs:
            engine.scheduler.submit(seq)
        engine.start()
        for seq in seqs:
            while not (event := seq.events.get(timeout=120)).finish_reason:
                pass
            last.append(event)
        engine.scheduler.check_accounting()
    return last


def _run(model, configs: list[SamplingConfig], max_new: int, grammar_tree: str = "table") -> list[Sequence]:
    """Each sequence with the regex grammar over the tiny vocabulary, served together."""
    lt = _tiny_vocab()
    grammar = llguidance.LLMatcher.grammar_from_regex(REGEX)
    seqs = []
    for i, cfg in enumerate(configs):
        seq = Sequence(GenerateParams(f"s{i}", PROMPT, cfg, max_new, frozenset(), True, 12, grammar=grammar))
        seq.grammar = SequenceGrammar(llguidance.LLMatcher(lt, grammar), frozenset(), tuple(lt.eos_tokens))
        seqs.append(seq)
    _serve(model, seqs, grammar_tree)
    return seqs


@pytest.mark.parametrize("grammar_tree", ["table", "prune"])
def test_greedy_tiny_target_equals_constrained_ar(tiny_target, grammar_tree):
    ids = list(PROMPT)
    for position in range(3):
        ids.append(int(regex_masked(tiny_target, ids, SamplingConfig(), position).argmax()))
    (seq,) = _run(tiny_target, [SamplingConfig()], 3, grammar_tree)
    assert seq.generated == ids[len(PROMPT) :]
    assert seq.grammar.drafted_nodes > 0
    if grammar_tree == "table":  # every node was built grammar-valid: the walk pruned none
        assert seq.grammar.kept_nodes == seq.grammar.drafted_nodes


def test_sampled_first_tokens_follow_the_masked_distribution(tiny_target):
    model = tiny_target
    cfg = SamplingConfig(temperature=1.0)
    joint = torch.zeros(VOCAB, VOCAB, VOCAB, dtype=torch.float64)
    p1 = regex_masked(model, PROMPT, cfg, 0)
    for a in ALLOWED[0]:
        p2 = regex_masked(model, PROMPT + (a,), cfg, 1)
        for b in ALLOWED[1]:
            joint[a, b] = p1[a] * p2[b] * regex_masked(model, PROMPT + (a, b), cfg, 2)
    seqs = _run(model, [dataclasses.replace(cfg, seed=s) for s in range(SAMPLES)], 3)
    counts = torch.zeros(VOCAB, VOCAB, VOCAB, dtype=torch.float64)
    for seq in seqs:
        assert len(seq.generated) == 3
        assert all(t in allowed for t, allowed in zip(seq.generated, ALLOWED))
        counts[tuple(seq.generated)] += 1
    assert sum(s.accept_lengths[0] >= 2 for s in seqs) > SAMPLES * 0.1  # the walk is exercised
    p_a = chi2_pvalue(counts.sum((1, 2)), joint.sum((1, 2)))
    p_bc = chi2_pvalue(counts.sum(0).flatten(), joint.sum(0).flatten())
    assert min(p_a, p_bc) > 1e-3, f"p-values {p_a:.2e} {p_bc:.2e}"


@pytest.mark.parametrize("grammar_tree", ["table", "prune"])
def test_a_grammar_dead_end_ends_only_its_own_sequence(tiny_target, grammar_tree):
    """A row whose grammar allows nothing ends that sequence alone: "stop" where the grammar accepts (a
    finished one-token grammar whose only allowed token, the stop id, min_tokens holds back), an error
    naming llguidance's reason where its matcher is in an error state (from the start, or a parser limit
    hit mid-generation); a normal request batched with them gives the tokens it gives alone."""
    lt, stop = _tiny_vocab(), frozenset({7})

    def plain():
        return Sequence(GenerateParams("plain", PROMPT, SamplingConfig(), 10, stop, True, 12))

    def constrained(name, grammar, matcher, min_tokens):
        cfg = SamplingConfig(min_tokens=min_tokens)
        seq = Sequence(GenerateParams(name, PROMPT, cfg, 10, stop, True, 12, grammar=grammar))
        seq.grammar = SequenceGrammar(matcher, stop, tuple(lt.eos_tokens))
        return seq

    alone = plain()
    _serve(tiny_target, [alone], grammar_tree)
    one = llguidance.LLMatcher.grammar_from_regex("[a-e]")
    broken = llguidance.LLMatcher(lt, llguidance.LLMatcher.grammar_from_regex("ab"), log_level=0)
    assert not broken.consume_token(5) and broken.is_error()  # "f": the matcher is in an error state
    # Every "a" opens more ways to parse the rest: past two Earley items per mask, a parser limit error.
    ambiguous = llguidance.LLMatcher.grammar_from_lark('start: x*\nx: "a" | "a" "b" | y\ny: "a"+')
    limited = llguidance.LLMatcher(
        lt, ambiguous, log_level=0, limits=llguidance.LLParserLimits(step_max_items=2, verbose_errors=False)
    )
    seqs = [
        constrained("finished", one, llguidance.LLMatcher(lt, one), min_tokens=3),
        plain(),
        constrained("broken", "x", broken, min_tokens=0),
        constrained("limited", ambiguous, limited, min_tokens=5),
    ]
    finished, normal, error, limit = _serve(tiny_target, seqs, grammar_tree)
    assert normal.finish_reason == "length" and seqs[1].generated == alone.generated
    assert finished.finish_reason == "stop" and finished.error is None
    assert len(seqs[0].generated) == 1 and seqs[0].generated[0] in range(5)
    assert error.finish_reason == "error" and seqs[2].generated == []
    assert error.error.startswith("grammar: no token is allowed (llguidance: Parser Error: token")
    assert limit.finish_reason == "error" and "Too many items" in limit.error, limit.error
    assert set(seqs[3].generated) <= {0}  # only "a"s (stop ids held back), then the limit
    # The request's grammar and its limits, not the verifier: INVALID_ARGUMENT (HTTP 400 at the gateway).
    assert error.error_status == limit.error_status == grpc.StatusCode.INVALID_ARGUMENT


class _Counting(SequenceGrammar):
    """A grammar state that counts the tree rows its steps gave no allowed token (the root's aside)."""

    dead_rows = 0

    def prepare(self, tree=EMPTY_TREE):
        step = super().prepare(tree)
        self.dead_rows += int((~step.masks[1:].any(dim=1)).sum())
        return step


@pytest.mark.parametrize("grammar_tree", ["table", "prune"])
def test_a_parser_limit_on_a_draft_path_leaves_plain_decodings_output(tiny_target, grammar_tree):
    """The target takes "b" at every step, which keeps the parse small; the tree explores "a"s, every one of
    which opens more ways to parse the rest, and a few in a row pass the parser limit. Those draft rows allow
    nothing, and the request gives plain constrained AR decoding's tokens and finish (not an error)."""
    lt, stop = _tiny_vocab(), frozenset({7})
    grammar = llguidance.LLMatcher.grammar_from_lark('start: x*\nx: "b" | "a" | "a" "b" | y\ny: "a"+')
    limits = llguidance.LLParserLimits(step_max_items=25, verbose_errors=False)

    def limited(name, spec):
        seq = Sequence(GenerateParams(name, PROMPT, SamplingConfig(min_tokens=12), 12, stop, spec, 12, grammar=grammar))
        seq.grammar = _Counting(llguidance.LLMatcher(lt, grammar, log_level=0, limits=limits), stop, (7,))
        return seq

    ar, tree = limited("ar", False), limited("tree", True)
    last_ar, last_tree = _serve(tiny_target, [ar, tree], grammar_tree)
    assert last_ar.finish_reason == "length" and ar.grammar.drafted_nodes == 0
    assert tree.generated == ar.generated and (last_tree.finish_reason, last_tree.error) == ("length", None)
    assert tree.grammar.dead_rows > 0, "no draft path met the limit: the case tests nothing"


class _FaultyGrammar(SequenceGrammar):
    """A grammar state whose step fails (a bug, say): the verifier's fault, not the request's."""

    def prepare(self, tree=None):
        raise RuntimeError("secret internals")


def test_a_fault_in_a_grammar_step_is_internal(tiny_target):
    lt, grammar = _tiny_vocab(), llguidance.LLMatcher.grammar_from_regex(REGEX)
    seq = Sequence(GenerateParams("faulty", PROMPT, SamplingConfig(), 3, frozenset(), True, 12, grammar=grammar))
    seq.grammar = _FaultyGrammar(llguidance.LLMatcher(lt, grammar), frozenset(), tuple(lt.eos_tokens))
    (last,) = _serve(tiny_target, [seq])
    assert last.finish_reason == "error" and last.error_status == grpc.StatusCode.INTERNAL
    assert "secret" not in last.error and last.error.startswith("verifier: internal error")


@pytest.mark.parametrize("status", [grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.INTERNAL])
def test_the_stream_ends_with_the_error_events_status(status):
    """Verifier.Generate aborts with the status the scheduler gave the error event."""
    from ddtree.verifier.rpc import server
    from ddtree.verifier.sequence import StreamEvent

    def submit(seq):
        seq.events.put(StreamEvent((), None, "error", error="grammar: no token is allowed (x)", error_status=status))

    scheduler = types.SimpleNamespace(vocab_size=4096, drafter=None, submit=submit, abort_sequence=lambda seq: None)
    servicer = server.VerifierServicer(scheduler, VerifierConfig(), "t", "{}", (7,))
    req = verifier_pb2.GenerateRequest(input_ids=[5, 6], max_new_tokens=4)
    with pytest.raises(_Aborted) as err:
        list(servicer.Generate(req, _AbortContext()))
    assert err.value.code == status and err.value.details == "grammar: no token is allowed (x)"


@pytest.fixture(scope="module")
def fake_gateway(fake, tokenizer_dir):
    from tests.support.fakes import serve_gateway

    yield from serve_gateway(fake, tokenizer_dir)


@pytest.mark.parametrize("stream", [False, True])
def test_a_grammar_dead_end_is_a_400_at_the_gateway(fake, fake_gateway, stream):
    fake.reset([], error=(grpc.StatusCode.INVALID_ARGUMENT, "grammar: no token is allowed (llguidance: x)"))
    client = openai.OpenAI(base_url=f"http://{fake_gateway.http_address}/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError) as err:
        r = client.completions.create(model="ddtree-demo", prompt="a", max_tokens=4, stream=stream)
        list(r) if stream else None
    assert err.value.status_code == 400 and "grammar: no token is allowed" in err.value.message
    assert err.value.param is None, "param names the verifier's field, not one of this request"


class _AbortContext:
    """A servicer context whose abort raises what it was given (as grpcio's does)."""

    def add_callback(self, fn) -> bool:
        return True

    def is_active(self) -> bool:
        return True

    def abort(self, code, details):
        raise _Aborted(code, details)


class _Aborted(Exception):
    def __init__(self, code, details):
        super().__init__(code, details)
        self.code, self.details = code, details


def _grammar_call(servicer, grammar: str) -> _Aborted:
    req = verifier_pb2.GenerateRequest(input_ids=[5, 6], max_new_tokens=4, grammar=grammar)
    with pytest.raises(_Aborted) as err:
        next(servicer.Generate(req, _AbortContext()))
    return err.value


def test_grammar_setup_failures_are_statuses_without_exception_text(tmp_path, tokenizer_dir, monkeypatch):
    """No tokenizer in the model dir: FAILED_PRECONDITION naming the cause, not the exception's text,
    and tried once (not on every request); a grammar llguidance rejects: INVALID_ARGUMENT, its message."""
    from ddtree.verifier.rpc import server

    built = []

    def counted(path):
        built.append(path)
        return server.Tokenizer.__wrapped__(path)

    counted.__wrapped__ = server.Tokenizer
    monkeypatch.setattr(server, "Tokenizer", counted)
    scheduler = types.SimpleNamespace(vocab_size=4096, drafter=None)
    cfg = VerifierConfig()
    empty = server.VerifierServicer(scheduler, cfg, "t", "{}", (7,), tokenizer_dir=str(tmp_path))
    for _ in range(3):
        err = _grammar_call(empty, 'start: "a"')
        assert err.code == grpc.StatusCode.FAILED_PRECONDITION
        assert err.details.startswith("grammar: the verifier has no tokenizer for constrained decoding ("), err.details
        assert str(tmp_path) not in err.details
    assert len(built) == 1
    none = server.VerifierServicer(scheduler, cfg, "t", "{}", (7,))
    assert _grammar_call(none, 'start: "a"').code == grpc.StatusCode.FAILED_PRECONDITION
    ok = server.VerifierServicer(scheduler, cfg, "t", "{}", (7,), tokenizer_dir=str(tokenizer_dir))
    err = _grammar_call(ok, "start: ( ")
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details.startswith("grammar: ") and "Expected token" in err.details, err.details
