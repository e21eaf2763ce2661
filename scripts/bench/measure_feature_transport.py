"""Feature transport at full width, through the services: a wide random target (hidden 7168, 6 tapped
layers, small vocab, dense layers, few heads) and a DFlash drafter of the same width (6 x 7168 = 43008
features per token, 86 KB per token in bf16), a 2048-token prompt.

    python -m scripts.bench.measure_feature_transport [--prompt 2048] [--tokens 32] [--out result.json]

Starts a drafter and a verifier (bf16) on loopback, generates the same prompt with AR and with DDTree,
and prints: whether the outputs are identical, whether the first step speculated (a tree verified, not
an AR fallback), and per step the feature bytes sent, the transport time (RPC wall time minus drafter
compute, as the verifier measures it) and the draft and verify times. The first step carries the
2048-token first commit (176 MB in 4 MiB chunks); later steps an accept-length commit (a few tokens).
Needs about 6 GB of memory; the first Draft takes the drafter tens of seconds on a small CPU (its K/V
of 2048 full-width rows), so the draft deadline is raised.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import tempfile

import grpc
import torch

from ddtree.launcher import start_service
from ddtree.models.checkpoint.random import DEFAULT_TARGET_CONFIG, write_random_target
from ddtree.models.dflash.checkpoint import write_random_drafter
from ddtree.protocol.ddtree.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc
from ddtree.protocol.server import GRPC_OPTIONS

HIDDEN = 7168
TAPS = (0, 1, 2, 3, 4, 5)
WIDE_TARGET = {
    **DEFAULT_TARGET_CONFIG,
    "vocab_size": 1024,
    "hidden_size": HIDDEN,
    "intermediate_size": 256,
    "num_hidden_layers": 6,
    "first_k_dense_replace": 6,  # dense layers only: the width, not the experts, is what is measured
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 256,
    "kv_lora_rank": 128,
    "max_position_embeddings": 8192,
}


def build(root: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    target = write_random_target(root / "target", WIDE_TARGET, seed=1, dtype=torch.bfloat16)
    drafter = write_random_drafter(
        root / "drafter",
        json.loads((target / "config.json").read_text()),
        seed=2,
        block_size=8,
        num_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=256,
        target_layer_ids=TAPS,
        dtype=torch.bfloat16,
    )
    return target, drafter


def run(stub, ids: list[int], tokens: int, no_spec: bool) -> tuple[list[int], list]:
    request = verifier_pb2.GenerateRequest(
        input_ids=ids, max_new_tokens=tokens, ignore_eos=True, spec=common_pb2.SpecOptions(no_spec=no_spec, budget=16)
    )
    out, steps = [], []
    for r in stub.Generate(request, timeout=1800):
        out += r.token_ids
        steps += r.steps
    return out, steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompt", type=int, default=2048)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--out", default="")
    p.add_argument(
        "--dtype",
        default="bfloat16",
        help="the target's dtype (features travel in it); bfloat16 may flip near-ties of the random model "
        "between batch shapes (docs/design.md §3.7), float32 checks token identity",
    )
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="ddtree-wide-") as tmp:
        root = pathlib.Path(tmp)
        target, drafter_dir = build(root)
        common = ["--threads", "1"]
        drafter = start_service(
            "drafter", ["drafter", "--model", str(drafter_dir), "--target", str(target), "--port", "0", *common,
                        "--dtype", "auto", "--window", str(args.prompt), "--warmup-sequences", "0"], root / "logs", timeout=600,
        )  # fmt: skip
        verifier = start_service(
            "verifier", ["verifier", "--model", str(target), "--drafter", drafter.address, "--port", "0", *common,
                         "--dtype", args.dtype, "--max-context", str(args.prompt + args.tokens + 64), "--kv-tokens", "16384",
                         "--draft-timeout-s", "900"], root / "logs", timeout=600,
        )  # fmt: skip
        try:
            ids = [(i * 7919) % 1000 + 5 for i in range(args.prompt)]
            with grpc.insecure_channel(verifier.address, options=GRPC_OPTIONS) as ch:
                stub = verifier_pb2_grpc.VerifierStub(ch)
                ar, _ = run(stub, ids, args.tokens, True)
                spec, steps = run(stub, ids, args.tokens, False)
        finally:
            verifier.stop()
            drafter.stop()
    first, later = steps[0], steps[1:]
    result = {
        "prompt_tokens": args.prompt,
        "target_dtype": args.dtype,
        "feature_width": len(TAPS) * HIDDEN,
        "identical_to_ar": spec == ar,
        "first_step_speculated": first.tree_nodes > 0,
        "first_step": {k: getattr(first, k) for k in ("feature_bytes", "transport_ms", "draft_ms", "verify_ms")},
        "later_steps": {
            "n": len(later),
            "median_feature_bytes": statistics.median(s.feature_bytes for s in later) if later else 0,
            "median_transport_ms": statistics.median(s.transport_ms for s in later) if later else 0,
            "median_draft_ms": statistics.median(s.draft_ms for s in later) if later else 0,
            "median_verify_ms": statistics.median(s.verify_ms for s in later) if later else 0,
            "mean_accept_length": statistics.mean(s.accept_length for s in later) if later else 0,
        },
    }
    print(json.dumps(result, indent=2))
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
