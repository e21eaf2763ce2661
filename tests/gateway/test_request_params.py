"""The parameter table (contract/request_params.PARAMS) drives both conversions: the gateway's
GenerationOptions -> the verifier's GenerateRequest (gateway/job_request.py) and GenerateRequest ->
GenerateParams (verifier/rpc/request_params.py). Every row names real fields, and a request with every
parameter set arrives at the verifier with the values the client sent (the expectations are written out
here, not read from the table)."""

from __future__ import annotations

import dataclasses
import types

import pytest

from ddtree.config import VerifierConfig
from ddtree.contract.request_params import GATEWAY, PARAMS, REQUEST, SAMPLING, SPEC
from ddtree.contract.sampling_params import SamplingConfig
from ddtree.gateway.job_request import verifier_request
from ddtree.protocol.ddtree.v1 import common_pb2, gateway_pb2, verifier_pb2
from ddtree.verifier.rpc.request_params import generate_params
from ddtree.verifier.sequence import GenerateParams

VOCAB = 32
MESSAGES = {SAMPLING: common_pb2.SamplingParams, SPEC: common_pb2.SpecOptions, REQUEST: verifier_pb2.GenerateRequest}


def test_every_row_names_the_fields_that_carry_it():
    config_fields = {f.name for f in dataclasses.fields(SamplingConfig)}
    params_fields = {f.name for f in dataclasses.fields(GenerateParams)}
    for p in PARAMS.values():
        assert p.name in gateway_pb2.GenerationOptions.DESCRIPTOR.fields_by_name, p.name
        if p.to == GATEWAY:
            assert all(p.name not in m.DESCRIPTOR.fields_by_name for m in MESSAGES.values()), p.name
            continue
        assert p.name in MESSAGES[p.to].DESCRIPTOR.fields_by_name, (p.name, p.to)
        if p.to == SAMPLING:
            assert p.name in config_fields, p.name
        if p.to == REQUEST and p.kind is not bool:
            assert p.name in params_fields, p.name
    assert {p.name for p in PARAMS.values() if p.to == SAMPLING} == config_fields - {
        "logit_bias",
        "allowed_token_ids",
        "bad_words",
    }


def _through(options: gateway_pb2.GenerationOptions, **kw) -> tuple[verifier_pb2.GenerateRequest, GenerateParams]:
    request = verifier_request(
        options,
        request_id="r",
        input_ids=[1, 2, 3],
        max_new_tokens=8,
        stop_token_ids=[5],
        bad_words=[common_pb2.TokenIds(ids=[7, 8])],
        grammar="",
    )
    return request, generate_params(request, VerifierConfig(), VOCAB, (1,), kw.get("max_budget", 64))


def test_every_parameter_arrives_at_the_verifier_as_sent():
    options = gateway_pb2.GenerationOptions(
        temperature=0.5, top_p=0.75, top_k=7, min_p=0.125, seed=99, min_tokens=2,
        presence_penalty=0.5, frequency_penalty=-0.25, repetition_penalty=1.5,
        top_logprobs=3, prompt_logprobs=4, budget=16, no_spec=False, ignore_eos=True,
        logit_bias={4: 2.5}, allowed_token_ids=[9, 4],
        truncate_prompt_tokens=2, include_stop_str_in_output=True, skip_special_tokens=False,
    )  # fmt: skip
    request, params = _through(options)
    assert request.ignore_eos and request.spec.budget == 16 and request.top_logprobs == 3
    s = params.sampling
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.seed, s.min_tokens) == (0.5, 0.75, 7, 0.125, 99, 2)
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (0.5, -0.25, 1.5)
    assert s.logit_bias == ((4, 2.5),) and s.allowed_token_ids == (4, 9) and s.bad_words == ((7, 8),)
    assert (params.top_logprobs, params.prompt_logprobs, params.budget, params.use_spec) == (3, 4, 16, True)
    assert params.stop_token_ids == {5}  # ignore_eos: the eos id 1 is not a stop
    assert params.input_ids == (1, 2, 3) and params.max_new_tokens == 8


def test_unset_parameters_are_the_neutral_ones():
    request, params = _through(gateway_pb2.GenerationOptions(no_spec=True))
    assert not request.HasField("top_logprobs") and not request.sampling.HasField("seed")
    s = params.sampling
    assert (s.temperature, s.top_p, s.repetition_penalty, s.seed, s.top_k) == (0.0, 1.0, 1.0, None, 0)
    assert (params.top_logprobs, params.prompt_logprobs, params.use_spec) == (None, None, False)
    assert params.stop_token_ids == {1, 5}
    _, no_drafter = _through(gateway_pb2.GenerationOptions(), max_budget=None)
    assert not no_drafter.use_spec and no_drafter.budget == 0


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("top_logprobs", 21, "top_logprobs must be in [0, 20], got 21"),
        ("prompt_logprobs", -1, "prompt_logprobs must be in [0, 20], got -1"),
        ("temperature", float("nan"), "must be numbers, got NaN"),
        ("repetition_penalty", -1.0, "repetition_penalty must be a finite number > 0"),
        ("budget", -2, "spec.budget must be >= 0, got -2"),
    ],
)
def test_the_verifier_checks_each_row(field, value, message):
    request, _ = _through(gateway_pb2.GenerationOptions())
    target = {"budget": request.spec, "top_logprobs": request, "prompt_logprobs": request}.get(field, request.sampling)
    setattr(target, field, value)
    with pytest.raises(ValueError) as err:
        generate_params(request, VerifierConfig(), VOCAB, (1,), 64)
    assert message in str(err.value)


def test_the_servicer_validates_through_the_module():
    from ddtree.verifier.rpc.server import VerifierServicer

    servicer = VerifierServicer.__new__(VerifierServicer)
    servicer.config, servicer.vocab_size, servicer.eos_token_ids = VerifierConfig(), VOCAB, (1,)
    servicer.scheduler = types.SimpleNamespace(drafter=None)
    request, _ = _through(gateway_pb2.GenerationOptions(budget=8))
    assert servicer._params(request).use_spec is False


def _parse(api: str, extra: dict) -> gateway_pb2.GenerationOptions:
    from ddtree.gateway.api.anthropic_protocol import parse_messages
    from ddtree.gateway.api.openai_protocol import parse_chat
    from ddtree.gateway.api.responses_api import parse_responses

    user = [{"role": "user", "content": "hi"}]
    if api == "openai":
        return parse_chat({"messages": user, **extra}, None).options
    if api == "anthropic":
        return parse_messages({"messages": user, "max_tokens": 4, **extra}, None).options
    return parse_responses({"input": "hi", **extra}, None)["options"]


@pytest.mark.parametrize("api", ["openai", "anthropic", "responses"])
def test_every_http_api_reads_its_rows_alike(api):
    """One range, one wording, one default and vLLM's top_k -1 on each public HTTP API."""
    from ddtree.gateway.errors import Invalid

    o = _parse(api, {"temperature": 0.25, "top_p": 0.5, "top_k": -1})
    assert (o.temperature, o.top_p, o.top_k) == (0.25, 0.5, 0)
    plain = _parse(api, {})
    assert (plain.temperature, plain.top_p, plain.top_k) == (1.0, 1.0, 0)  # OpenAI's defaults
    for extra, message in [
        ({"temperature": -1}, "temperature: must be a finite number >= 0, got -1.0"),
        ({"top_p": 0}, "top_p: must be in (0, 1], got 0.0"),
        ({"top_k": -2}, "top_k: must be in [0, 2147483647] (-1 or 0 = disabled), got -2"),
    ]:
        with pytest.raises(Invalid) as err:
            _parse(api, extra)
        assert str(err.value) == message
    if api == "anthropic":
        with pytest.raises(Invalid, match="seed: not supported in a Messages request"):
            _parse(api, {"seed": 3})
    else:
        assert _parse(api, {"seed": 3, "ignore_eos": True}).seed == 3
        with pytest.raises(Invalid, match=r"seed: must be in \[0, 18446744073709551615\], got -3"):
            _parse(api, {"seed": -3})
