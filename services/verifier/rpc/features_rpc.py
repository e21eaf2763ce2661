"""Verifier.Features: the target's own generation and the tapped features of every token it read.

Training data for a drafter from a running verifier (`ddtree train drafter --verifier`), so a drafter
for a target served at TP 8 trains beside the deployment instead of loading the target again. A
request is a GenerateRequest (validated as Generate validates it) plus the layers to tap; it runs as
a `Sequence` through the scheduler like any request: admission, stream slots, batching with other
requests, speculation when the request's spec options and a drafter allow it, TP N through
ShardedTarget. What differs is what the forward taps and where it goes: the step taps the union of
the drafter's layers and the request's (feature_taps.py), and commit puts the request's rows of the
tokens it just committed on the sequence's event queue (commit._stream_features), ahead of the
tokens. No prefix-cache reuse: the cache keeps the drafter's taps only, and every prompt row is
streamed.

The stream (verifier.proto FeaturesResponse): rows in position order, cut into messages of at most
`chunk_bytes` of features (feature_chunks.split_commit) and sent once final, i.e. once a later token
was emitted after them; then one last message with finish_reason, next_token_id and usage. A row is
final when a later token follows it: the rows are the prompt and the generation but its last token,
or, when a stop token ended the generation, the whole generation. Rows a speculative step committed
past the end (a stop or the length limit cuts inside its accepted nodes) are dropped.
"""

from __future__ import annotations

import dataclasses

import grpc
import torch

from ddtree.protocol.ddtree.v1 import common_pb2, verifier_pb2
from ddtree.protocol.server import MAX_MESSAGE_BYTES
from ddtree.protocol.tensors import tensor_to_proto
from ddtree.verifier.drafting.feature_chunks import split_commit
from ddtree.verifier.sequence import GenerateParams, Sequence
from ddtree.verifier.step.scheduler import AdmissionError

MAX_CHUNK_BYTES = MAX_MESSAGE_BYTES // 2  # the features of one message; the token ids come beside them
MAX_TAP_LAYERS = 16  # layers one request taps: each adds a hidden-size row per token to the step and the stream
FEATURE_DTYPES = {
    common_pb2.FLOAT32: torch.float32,
    common_pb2.BFLOAT16: torch.bfloat16,
    common_pb2.FLOAT16: torch.float16,
}


@dataclasses.dataclass(frozen=True)
class FeaturesFormat:
    dtype: torch.dtype | None  # None = as computed (the verifier's --dtype)
    chunk_bytes: int


def features_params(servicer, req: verifier_pb2.FeaturesRequest) -> tuple[GenerateParams, FeaturesFormat]:
    """Validate a Features request; raises ValueError with the message the client will see."""
    try:
        params = servicer._params(req.generate)
    except ValueError as err:
        raise ValueError(f"generate: {err}") from None
    # Generate's fields that Features does not carry out: refused, not ignored.
    if req.generate.grammar:
        raise ValueError("generate.grammar is not supported by Features (it streams the unconstrained generation)")
    if req.generate.HasField("top_logprobs"):
        raise ValueError("generate.top_logprobs is not supported by Features (its stream carries no logprobs)")
    if req.generate.HasField("prompt_logprobs"):
        raise ValueError("generate.prompt_logprobs is not supported by Features (its stream carries no logprobs)")
    layers = servicer.scheduler.target.config.num_hidden_layers
    taps = tuple(req.tap_layer_ids)
    if not taps:
        raise ValueError("tap_layer_ids is empty: name the target layers whose features to return")
    if len(taps) > MAX_TAP_LAYERS:
        raise ValueError(f"tap_layer_ids names {len(taps)} layers, at most {MAX_TAP_LAYERS}")
    bad = [i for i in taps if not 0 <= i < layers]
    if bad:
        raise ValueError(f"tap_layer_ids: layer {bad[0]} is not a layer of the target (layers 0..{layers - 1})")
    repeated = sorted({i for i in taps if taps.count(i) > 1})
    if repeated:
        raise ValueError(f"tap_layer_ids repeats layer {repeated[0]}")
    if req.features_dtype != common_pb2.DTYPE_UNSPECIFIED and req.features_dtype not in FEATURE_DTYPES:
        name = common_pb2.DType.Name(req.features_dtype) if req.features_dtype in common_pb2.DType.values() else None
        raise ValueError(
            f"features_dtype {name or req.features_dtype} is not a float type: FLOAT32, BFLOAT16 or FLOAT16"
        )
    chunk = req.chunk_bytes or servicer.config.feature_chunk_bytes
    if not 1 <= chunk <= MAX_CHUNK_BYTES:
        raise ValueError(f"chunk_bytes must be in [1, {MAX_CHUNK_BYTES}] (0 = the server's default), got {chunk}")
    params = dataclasses.replace(params, feature_taps=taps)
    return params, FeaturesFormat(FEATURE_DTYPES.get(req.features_dtype), chunk)


class FeatureRows:
    """The rows a stream has received and not sent yet, cut into messages once final."""

    def __init__(self, request_id: str, fmt: FeaturesFormat):
        self.request_id = request_id
        self.fmt = fmt
        self.pending: list[torch.Tensor] = []
        self.received = 0  # rows received (sent + pending)
        self.sent = 0

    def add(self, rows: torch.Tensor) -> None:
        self.pending.append(rows if self.fmt.dtype is None else rows.to(self.fmt.dtype))
        self.received += rows.shape[0]

    def take(self, final: int, tokens: list[int], flush: bool) -> list[verifier_pb2.FeaturesResponse]:
        """Messages of the rows [sent, final): whole chunks only, or everything with flush."""
        n = min(final, self.received) - self.sent
        if n <= 0:
            return []
        row_bytes = self.pending[0].element_size() * self.pending[0].shape[1]
        per = max(1, self.fmt.chunk_bytes // row_bytes) if row_bytes else n
        n = n if flush else n // per * per
        if n == 0:  # less than a message: wait for more (concatenated once, when it is sent)
            return []
        rows = torch.cat(self.pending) if len(self.pending) > 1 else self.pending[0]
        pieces = split_commit(tokens[self.sent : self.sent + n], self.sent, rows[:n], self.fmt.chunk_bytes)
        self.pending = [rows[n:].clone()] if rows.shape[0] > n else []  # not a view of the sent rows
        self.sent += n
        return [
            verifier_pb2.FeaturesResponse(
                request_id=self.request_id,
                start=p.start,
                token_ids=p.token_ids,
                features=tensor_to_proto(p.features),
            )
            for p in pieces
        ]


def final_rows(tokens: int, finish_reason: str | None) -> int:
    """Rows that belong to the answer, of `tokens` streamed so far (prompt + generated): every token a
    later one follows, and the last one too when a stop token (chosen after it) ended the generation."""
    return tokens if finish_reason == "stop" else tokens - 1


def next_token(seq: Sequence, tokens: list[int], finish_reason: str) -> int:
    """The target's choice after the last row: the stop token, the last generated token, or -1 (abort)."""
    if finish_reason == "stop":
        return seq.stop_token_id if seq.stop_token_id is not None else -1
    return tokens[-1] if finish_reason == "length" and len(tokens) > seq.prompt_len else -1


def stream_features(servicer, request, context, usage_of):
    """The Features handler (VerifierServicer.Features): admission as Generate's, then the rows."""
    servicer.stream_slots.take(context)  # or RESOURCE_EXHAUSTED
    try:
        params, fmt = features_params(servicer, request)
    except ValueError as err:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
    seq = Sequence(params, page_size=servicer.config.page_size)
    try:
        servicer.scheduler.submit(seq)
    except AdmissionError as err:
        context.abort(err.code, str(err))
    context.add_callback(lambda: servicer.scheduler.abort_sequence(seq))
    rows = FeatureRows(seq.request_id, fmt)
    tokens = list(params.input_ids)
    for event in seq.iter_events(context):  # ends when the client goes away; an error event aborts
        if event.features is not None:
            rows.add(event.features)
            continue
        tokens.extend(event.token_ids)
        if event.finish_reason:
            yield from rows.take(final_rows(len(tokens), event.finish_reason), tokens, flush=True)
            yield verifier_pb2.FeaturesResponse(
                request_id=seq.request_id,
                start=rows.sent,
                finish_reason=event.finish_reason,
                next_token_id=next_token(seq, tokens, event.finish_reason),
                usage=usage_of(seq),
            )
            return
        yield from rows.take(final_rows(len(tokens), None), tokens, flush=False)
