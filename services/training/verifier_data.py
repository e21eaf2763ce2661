"""Drafter training data from a running verifier (`ddtree train drafter --verifier HOST:PORT`).

`VerifierRunner` stands in for drafter_data.TargetRunner: `generate(prompts, G)` returns the same
TargetBatch, with the generations and the tapped features computed by the verifier that serves the
target (Verifier.Features, services/verifier/rpc/features_rpc.py), so the trainer never loads the target:
of the target's checkpoint it reads config.json, tokenizer.json and the two tensors the drafter
shares with it, the embedding and the LM head (`load_head`).

One Features call per prompt, all of a batch at once (the verifier batches them like any requests),
each asking for G + 1 greedy tokens with EOS ignored: the stream then holds P + G rows (the prompt
and the first G generated tokens, with their features) and the target's choice after the last one,
which is what TargetRunner.generate computes for P + G positions. A verifier that is busy (its queue
full) is retried with backoff.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import time
from pathlib import Path

import grpc
import torch
from torch import Tensor

from ddtree.models.checkpoint.loader import load_tensors
from ddtree.protocol.ddtree.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc
from ddtree.protocol.security import ServiceSecurity
from ddtree.protocol.server import GRPC_OPTIONS
from ddtree.protocol.tensors import tensor_from_proto
from ddtree.training.drafter_data import TargetBatch

WIRE_DTYPES = {
    torch.float32: common_pb2.FLOAT32,
    torch.bfloat16: common_pb2.BFLOAT16,
    torch.float16: common_pb2.FLOAT16,
}
RETRY_CODES = (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE)
RETRIES = 8


def load_head(target_dir: str | Path, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, Tensor]:
    """The target's embedding and LM head (all the drafter needs of its weights), read alone."""
    t = load_tensors(target_dir, ["model.embed_tokens.weight", "lm_head.weight"])
    return t["model.embed_tokens.weight"].to(device, dtype), t["lm_head.weight"].to(device, dtype)


class VerifierRunner:
    """TargetRunner's `generate` through Verifier.Features. `token`: the verifier's service token."""

    def __init__(
        self,
        address: str,
        tap_layer_ids: tuple[int, ...],
        taps_dtype: torch.dtype,
        token: str = "",
        timeout_s: float = 3600.0,
    ):
        if taps_dtype not in WIRE_DTYPES:
            raise ValueError(f"taps dtype {taps_dtype} cannot travel: float32, bfloat16 or float16")
        self.address = address
        self.tap_layer_ids = tuple(tap_layer_ids)
        self.taps_dtype = taps_dtype
        self.timeout_s = timeout_s
        self.channel = ServiceSecurity(token=token).channel(address, GRPC_OPTIONS)
        self.stub = verifier_pb2_grpc.VerifierStub(self.channel)
        try:
            self.info = self.stub.GetInfo(verifier_pb2.VerifierInfoRequest(), timeout=30)
        except grpc.RpcError as err:
            raise ValueError(f"--verifier {address}: GetInfo failed: {err.code().name} {err.details()}") from None

    def check(self, target_config: dict, max_prompt: int, new_tokens: int) -> None:
        """ValueError unless the verifier serves this target and takes prompts of max_prompt + new_tokens."""
        served = json.loads(self.info.model_config_json)
        if served != target_config:
            keys = sorted(k for k in set(served) | set(target_config) if served.get(k) != target_config.get(k))
            raise ValueError(
                f"--verifier {self.address} serves another model than --target (config.json differs in {keys[:5]})"
            )
        if new_tokens + 1 > self.info.max_new_tokens_limit:
            raise ValueError(
                f"--gen-tokens {new_tokens} needs max_new_tokens {new_tokens + 1}, above the verifier's "
                f"limit {self.info.max_new_tokens_limit}"
            )
        if max_prompt + new_tokens + 1 > self.info.max_context:
            raise ValueError(
                f"--prompt-max {max_prompt} + --gen-tokens {new_tokens} + 1 exceeds the verifier's maximum "
                f"context {self.info.max_context}"
            )

    def features(self, prompt: list[int], max_new_tokens: int) -> tuple[list[int], Tensor, int, str]:
        """One Features call: (row token ids, features [rows, F], next token, finish reason)."""
        req = verifier_pb2.FeaturesRequest(
            generate=verifier_pb2.GenerateRequest(input_ids=prompt, max_new_tokens=max_new_tokens, ignore_eos=True),
            tap_layer_ids=list(self.tap_layer_ids),
            features_dtype=WIRE_DTYPES[self.taps_dtype],
        )
        for attempt in range(RETRIES + 1):
            tokens, parts = [], []
            try:
                for msg in self.stub.Features(req, timeout=self.timeout_s):
                    if msg.start != len(tokens):
                        raise ValueError(f"Features stream: rows from {msg.start}, expected {len(tokens)}")
                    if msg.finish_reason:
                        feats = torch.cat(parts) if parts else torch.empty(0, 0, dtype=self.taps_dtype)
                        return tokens, feats, msg.next_token_id, msg.finish_reason
                    tokens.extend(msg.token_ids)
                    parts.append(tensor_from_proto(msg.features, what="Features rows"))
                raise ValueError("Features stream ended without a finish message")
            except grpc.RpcError as err:
                if err.code() not in RETRY_CODES or attempt == RETRIES:
                    raise
                time.sleep(min(0.5 * 2**attempt, 30.0))
        raise AssertionError("unreachable")

    @torch.no_grad()
    def generate(self, prompts: Tensor, new_tokens: int) -> TargetBatch:
        """As TargetRunner.generate: S greedy continuations of new_tokens tokens, T = P + new_tokens rows."""
        s, p = prompts.shape
        t = p + new_tokens
        with cf.ThreadPoolExecutor(s) as pool:
            results = list(pool.map(lambda row: self.features(row.tolist(), new_tokens + 1), prompts))
        ids = torch.empty(s, t, dtype=torch.int64)
        greedy = torch.full((s, t), -1, dtype=torch.int64)
        taps = torch.empty(s, t, results[0][1].shape[-1], dtype=self.taps_dtype)
        for i, (tokens, feats, nxt, finish) in enumerate(results):
            if finish != "length" or len(tokens) != t or feats.shape[0] != t:
                raise ValueError(
                    f"Features: prompt {i} ended {finish!r} with {len(tokens)} rows, expected 'length' with {t}"
                )
            if tokens[:p] != prompts[i].tolist():
                raise ValueError(f"Features: prompt {i} came back with other prompt tokens")
            ids[i] = torch.tensor(tokens)
            taps[i] = feats.to(self.taps_dtype)
            greedy[i, p - 1 : t - 1] = ids[i, p:]  # every generated token is the target's choice
            greedy[i, t - 1] = nxt
        return TargetBatch(ids, taps, greedy, anchor_lo=p)

    def prefill_batch(self, ids: Tensor) -> TargetBatch:
        raise ValueError("--source corpus needs the target in this process: --verifier gives generations only")

    def close(self) -> None:
        self.channel.close()
