"""The gateway's checked `GenerationOptions` as the verifier's `GenerateRequest`: the one conversion
contract -> proto. The table's parameters (contract/request_params.PARAMS) go where their row's `to` says,
under the same name: SamplingParams, SpecOptions or the request itself; an `optional` field only when the
client set it. What has a shape of its own comes from the pipeline (pipeline.Pipeline._job): the prompt
ids, max_new_tokens (the request's or the default), the stop ids (with the eos ids), the grammar, and
bad_words as token ids (bad_words.py); logit_bias and allowed_token_ids are copied as they are.

The values were checked before (pipeline.validate_options): nothing is checked here.
"""

from __future__ import annotations

from collections.abc import Sequence

from ddtree.contract.request_params import REQUEST, SAMPLING, SPEC, has_presence, sent_to
from ddtree.protocol.ddtree.v1 import common_pb2, gateway_pb2, verifier_pb2


def verifier_request(
    o: gateway_pb2.GenerationOptions,
    *,
    request_id: str,
    input_ids: Sequence[int],
    max_new_tokens: int,
    stop_token_ids: Sequence[int],
    bad_words: Sequence[common_pb2.TokenIds],
    grammar: str,
) -> verifier_pb2.GenerateRequest:
    request = verifier_pb2.GenerateRequest(
        request_id=request_id,
        input_ids=input_ids,
        max_new_tokens=max_new_tokens,
        stop_token_ids=stop_token_ids,
        grammar=grammar,
    )
    request.sampling.SetInParent()  # present even when every field is 0 (the wire's defaults)
    request.spec.SetInParent()
    for where, target in ((SAMPLING, request.sampling), (SPEC, request.spec), (REQUEST, request)):
        for p in sent_to(where):
            if not has_presence(o, p.name) or o.HasField(p.name):
                setattr(target, p.name, getattr(o, p.name))
    request.sampling.logit_bias.update(o.logit_bias)
    request.sampling.allowed_token_ids.extend(o.allowed_token_ids)
    request.sampling.bad_words.extend(bad_words)
    return request
