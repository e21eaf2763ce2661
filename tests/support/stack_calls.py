"""Calls to running services, as the process-level tests make them: the verifier's Generate (one, or one per
prompt at once) and a service's /metrics."""

from __future__ import annotations

import concurrent.futures as cf
import re
import time
import urllib.request

import grpc

from ddtree.protocol.ddtree.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc

PROMPTS = [
    "def fibonacci(n):\n    ",
    "The quick brown fox jumps over the lazy dog. The",
    "import os\nimport sys\n\nclass Config:\n",
    "Once upon a time",
    "x",
]


MAX_NEW = 24


def generate(
    address: str,
    ids: list[int],
    *,
    no_spec: bool,
    budget: int = 0,
    max_new: int = MAX_NEW,
    temperature: float = 0.0,
    seed: int | None = None,
    metadata=None,
    on_message=None,
):
    """(tokens, steps, last message); metadata: sent with the call (a service token); on_message(msg): called
    with each message as it arrives."""
    with grpc.insecure_channel(address) as ch:
        stub = verifier_pb2_grpc.VerifierStub(ch)
        sampling = common_pb2.SamplingParams(temperature=temperature)
        if seed is not None:
            sampling.seed = seed
        req = verifier_pb2.GenerateRequest(
            input_ids=ids,
            max_new_tokens=max_new,
            ignore_eos=True,
            sampling=sampling,
            spec=common_pb2.SpecOptions(no_spec=no_spec, budget=budget),
        )
        tokens, steps, last = [], [], None
        for msg in stub.Generate(req, timeout=300, metadata=metadata):
            if on_message is not None:
                on_message(msg)
            tokens.extend(msg.token_ids)
            steps.extend(msg.steps)
            last = msg
        return tokens, steps, last


VERIFIER_ARGS = [
    "--max-batch",
    "8",
    "--kv-tokens",
    "32768",
    "--max-context",
    "2048",
    "--prefill-chunk",
    "64",
    "--threads",
    "1",
]


def generate_concurrently(address, prompt_ids, steps: list | None = None, **kw):
    with cf.ThreadPoolExecutor(len(prompt_ids)) as pool:  # concurrent: several sequences per forward
        results = [
            f.result() for f in [pool.submit(generate, address, ids, max_new=MAX_NEW, **kw) for ids in prompt_ids]
        ]
    if steps is not None:
        steps += [s for _, st, _ in results for s in st]
    return [tokens for tokens, _, _ in results]


def scrape_metrics(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def metrics_port(log_path) -> int:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        m = re.search(r"LISTENING metrics [\d.]+:(\d+)", log_path.read_text())
        if m:
            return int(m.group(1))
        time.sleep(0.1)
    raise AssertionError("no metrics endpoint announced")
