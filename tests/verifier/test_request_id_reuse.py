"""A client may reuse a request id as soon as its stream ended: the old RPC's end must not touch the new one.

`VerifierServicer.Generate` registers an end-of-RPC callback; grpcio runs it on one of its threads some
time after the stream finished, and on a loaded machine that can be after the client already sent its
next request with the same id. The callback must abort only its own sequence: one that looked the id up
aborted the new request, whose stream then ended after one token with finish_reason "abort".

The test forces the worst timing every time: each request's end-of-RPC callbacks run only after the next
request with the same id is admitted, while other sequences keep the scheduler busy.
"""

from __future__ import annotations

from ddtree.config import VerifierConfig
from ddtree.contract.sampling_params import SamplingConfig
from ddtree.models.checkpoint.loader import load_target
from ddtree.protocol.ddtree.v1 import verifier_pb2
from ddtree.verifier.engine import build_engine
from ddtree.verifier.rpc.server import VerifierServicer
from ddtree.verifier.sequence import GenerateParams, Sequence

REUSES = 50
TOKENS = 48


class _LateContext:
    """A gRPC servicer context whose end-of-RPC callbacks run when the test says so."""

    def __init__(self):
        self.callbacks = []

    def add_callback(self, fn) -> bool:
        self.callbacks.append(fn)
        return True

    def is_active(self) -> bool:
        return True

    def abort(self, code, details):
        raise AssertionError(f"Generate aborted: {code} {details}")

    def end(self) -> None:
        for fn in self.callbacks:
            fn()


def test_a_reused_request_id_gets_its_whole_answer_every_time(default_ckpt):
    model = load_target(default_ckpt.target).eval()
    cfg = VerifierConfig(kv_tokens=8192, max_batch=8, prefix_cache=False)
    scheduler = build_engine(cfg, model=model).scheduler
    servicer = VerifierServicer(scheduler, cfg, "target", "{}", ())

    def load_sequence(k: int) -> Sequence:  # decoding beside the reused id; replaced when it finishes
        return Sequence(
            GenerateParams(
                f"load-{k}", (100 + k, 200, 300), SamplingConfig(temperature=0.0), 200, frozenset(), False, 0
            )
        )

    load = [load_sequence(k) for k in range(2)]
    request = verifier_pb2.GenerateRequest(
        request_id="reused-id", input_ids=[11, 12, 13, 14], max_new_tokens=TOKENS, ignore_eos=True
    )
    results = []
    scheduler.start()
    try:
        for seq in load:
            scheduler.submit(seq)
        previous = None
        for _ in range(REUSES):
            for k, seq in enumerate(load):
                if seq.finish_reason:
                    load[k] = load_sequence(k)
                    scheduler.submit(load[k])
            context = _LateContext()
            stream = servicer.Generate(request, context)
            first = next(stream)  # the request is admitted and has its first token
            if previous is not None:
                previous.end()  # the last RPC's callbacks, late
            msgs = [first, *stream]
            results.append(([t for m in msgs for t in m.token_ids], msgs[-1].finish_reason))
            previous = context
        previous.end()
    finally:
        for seq in load:
            scheduler.abort(seq.request_id)
        scheduler.stop()
    short = [
        (i, len(tokens), reason)
        for i, (tokens, reason) in enumerate(results)
        if len(tokens) != TOKENS or reason != "length"
    ]
    assert not short, f"requests that reused the id ended early (index, tokens, finish_reason): {short}"
    assert all(tokens == results[0][0] for tokens, _ in results), "the same greedy request changed its output"
