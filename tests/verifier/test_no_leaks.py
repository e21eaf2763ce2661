"""After 200 requests of mixed lengths, with client disconnects and Abort calls in the middle, the KV
pool is back to empty and the drafter holds no context (accounting checked after every step)."""

from __future__ import annotations

import concurrent.futures as cf
import random
import time

import grpc
import pytest

from ddtree.config import DrafterConfig, VerifierConfig
from ddtree.drafter.factory import make_engine
from ddtree.drafter.server import serve_engine
from ddtree.models.checkpoint.loader import load_target
from ddtree.protocol.ddtree.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc
from ddtree.protocol.server import start_server
from ddtree.verifier.drafting.drafter_pool import DrafterPool
from ddtree.verifier.engine import build_engine
from ddtree.verifier.rpc.server import VerifierServicer

pytestmark = pytest.mark.slow


def test_pool_returns_to_empty_after_mixed_traffic(default_ckpt):
    dcfg = DrafterConfig(port=0, grace_s=0.0)
    engine = make_engine(dcfg, str(default_ckpt.drafter), str(default_ckpt.target))
    drafter = serve_engine(engine, dcfg)
    model = load_target(default_ckpt.target).eval()
    vcfg = VerifierConfig(
        kv_tokens=6000, max_batch=12, max_queue=400, prefill_chunk=64, debug_checks=True, max_context=1024
    )
    verifier = build_engine(vcfg, model=model, drafter=DrafterPool(f"127.0.0.1:{drafter.port}", 10))
    sched, pool = verifier.scheduler, verifier.pool
    verifier.start()
    servicer = VerifierServicer(sched, vcfg, "test", "{}", tuple(model.config.eos_token_ids))

    def register(server):
        verifier_pb2_grpc.add_VerifierServicer_to_server(servicer, server)
        return ["ddtree.v1.Verifier"]

    server = start_server("verifier", register, "127.0.0.1", 0, 32, 0.0, announce=False)
    errors = []
    rng = random.Random(0)
    plans = [
        (i, rng.randint(1, 300), rng.randint(1, 40), rng.choice(["finish"] * 5 + ["disconnect", "abort"] * 2))
        for i in range(200)
    ]

    def one(plan):
        i, prompt_len, max_new, mode = plan
        req = verifier_pb2.GenerateRequest(
            request_id=f"req-{i}",
            input_ids=[(7 * i + j) % 4000 + 20 for j in range(prompt_len)],
            max_new_tokens=max_new,
            ignore_eos=bool(i % 2),
            spec=common_pb2.SpecOptions(no_spec=i % 5 == 0, budget=8),
        )
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
            stub = verifier_pb2_grpc.VerifierStub(ch)
            stream = stub.Generate(req, timeout=300)
            try:
                for n, msg in enumerate(stream):
                    if mode == "disconnect" and n == 1:
                        stream.cancel()
                    if mode == "abort" and n == 1:
                        try:
                            stub.Abort(verifier_pb2.AbortRequest(request_id=f"req-{i}"), timeout=10)
                        except grpc.RpcError as err:  # it may have finished in between
                            assert err.code() == grpc.StatusCode.NOT_FOUND
                    if msg.finish_reason:
                        assert mode != "finish" or msg.finish_reason in ("length", "stop"), msg.finish_reason
            except grpc.RpcError as err:
                if not (mode == "disconnect" and err.code() == grpc.StatusCode.CANCELLED):
                    errors.append((i, mode, err.code(), err.details()))

    try:
        with cf.ThreadPoolExecutor(16) as ex:
            list(ex.map(one, plans))
        deadline = time.monotonic() + 30
        while sched.running_count and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not errors, errors[:5]
        assert sched.running_count == 0
        sched.check_accounting()  # free + held + cached == total, nothing held twice
        assert sched.cache.cached_slots > 0, "finished sequences should have left prefixes in the cache"
        sched.cache.evict(pool.num_slots)  # nothing is pinned any more: everything can go
        assert sched.cache.cached_slots == 0
        assert pool.num_free == pool.num_slots, f"{pool.num_slots - pool.num_free} KV slots leaked"
        deadline = time.monotonic() + 10
        while engine.active_sequences and time.monotonic() < deadline:
            time.sleep(0.1)
        assert engine.active_sequences == 0 and engine.context_bytes == 0, (
            f"draft contexts leaked: {[(k, [p for p in plans if f'req-{p[0]}' == k]) for k in engine._contexts]}"
        )
    finally:
        server.stop(0)
        sched.stop()
        drafter.stop(0)
