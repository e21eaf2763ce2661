"""JSON-schema requests on the demo pair through the verifier's scheduler, in one process: AR, DDTree with
the drafter's tree pruned by the grammar (`grammar_tree prune`), DDTree with the tree built from the
drafter's top-K table (`grammar_tree table`).

The drafter is the real DFlash engine of the pair (`make_engine` + `serve_engine` on a loopback port, a
`DrafterClient` to it), the target the pair's target in fp32 (`LocalTarget`). Requests run one at a time
(batch 1), so each one's wall time is its own. Used by tests/tree/test_grammar_tree.py and
scripts/bench/bench_grammar.py.
"""

from __future__ import annotations

import dataclasses
import json
import time

import torch

# Prompts the demo target (trained on Python source) continues with data, and a schema for each.
REQUESTS = [
    (
        "# The service's settings, as JSON.\nSETTINGS = ",
        {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 12}, "port": {"type": "integer"}},
            "required": ["name", "port"],
        },
    ),
    (
        "def default_options():\n    return ",
        {
            "type": "object",
            "properties": {"verbose": {"type": "boolean"}, "level": {"enum": ["debug", "info", "error"]}},
            "required": ["verbose", "level"],
        },
    ),
    (
        "    values = ",
        {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": 2, "maxItems": 6},
    ),
    (
        "        self.header = ",
        {
            "type": "object",
            "properties": {
                "path": {"type": "string", "maxLength": 16},
                "mode": {"type": "string", "maxLength": 8},
                "size": {"type": "integer", "minimum": 0, "maximum": 99999},
            },
            "required": ["path", "mode", "size"],
        },
    ),
    (
        "    return {'args': ",
        {"type": "array", "items": {"type": "string", "maxLength": 10}, "minItems": 1, "maxItems": 4},
    ),
]


def closed(schema):
    """The schema with objects closed (no extra keys), integers bounded: a small model's answer ends."""
    if isinstance(schema, dict):
        schema = {k: closed(v) for k, v in schema.items()}
        if schema.get("type") == "object":
            schema.setdefault("additionalProperties", False)
        if schema.get("type") == "integer":
            schema.setdefault("minimum", -999)
            schema.setdefault("maximum", 999)
    elif isinstance(schema, list):
        schema = [closed(v) for v in schema]
    return schema


def json_grammar(schema: dict) -> str:
    """The llguidance grammar the gateway sends for `response_format` json_schema (compact JSON)."""
    body = {**closed(schema), "x-guidance": {"whitespace_flexible": False}}
    return json.dumps({"grammars": [{"json_schema": body}]})


@dataclasses.dataclass(frozen=True)
class Run:
    """One request's outcome."""

    tokens: tuple[int, ...]
    finish_reason: str
    accept_lengths: tuple[int, ...]  # per verify step (tau = their mean)
    wall_s: float
    drafted_nodes: int
    kept_nodes: int
    mask_count: int
    mask_s: float


class DemoPair:
    """The pair's target, tokenizer and a drafter server, loaded once."""

    def __init__(self, checkpoint, drafter_dtype: str = "float32"):
        from ddtree.config import DrafterConfig
        from ddtree.drafter.factory import make_engine
        from ddtree.drafter.server import serve_engine
        from ddtree.models.checkpoint.loader import load_target
        from ddtree.tokenization.grammar_vocab import ll_tokenizer
        from ddtree.tokenization.tokenizer import Tokenizer

        self.model = load_target(str(checkpoint.target), dtype=torch.float32, device="cpu").eval()
        self.tok = Tokenizer(str(checkpoint.target))
        self.ll_tok = ll_tokenizer(self.tok)
        self.stop_ids = frozenset(self.model.config.eos_token_ids)
        dcfg = DrafterConfig(port=0, grace_s=0.0, max_budget=256, dtype=drafter_dtype)
        self.engine = make_engine(dcfg, str(checkpoint.drafter), str(checkpoint.target))
        self.drafter = serve_engine(self.engine, dcfg)

    def close(self) -> None:
        self.drafter.stop(0)

    def run(self, requests: list[tuple[str, str]], budget: int, mode: str, max_new: int = 64) -> list[Run]:
        """(prompt text, grammar) requests at temperature 0, one at a time; mode ar | prune | table."""
        from ddtree.config import VerifierConfig
        from ddtree.contract.sampling_params import SamplingConfig
        from ddtree.verifier.constraints.grammar import SequenceGrammar, new_matcher
        from ddtree.verifier.drafting.drafter_client import DrafterClient
        from ddtree.verifier.engine import build_engine
        from ddtree.verifier.sequence import GenerateParams, Sequence

        spec = mode != "ar"
        client = DrafterClient(f"127.0.0.1:{self.drafter.port}", timeout_s=120) if spec else None
        vcfg = VerifierConfig(
            max_batch=1,
            kv_tokens=4096,
            prefill_chunk=256,
            grammar_tree="prune" if mode == "prune" else "table",
            prefix_cache=False,
        )
        sched = build_engine(vcfg, model=self.model, drafter=client).scheduler
        sched.start()
        runs = []
        try:
            for i, (prompt, grammar) in enumerate(requests):
                ids = tuple(self.tok.encode(prompt))
                params = GenerateParams(
                    f"{mode}-{i}", ids, SamplingConfig(), max_new, self.stop_ids, spec, budget if spec else 0
                )
                params = dataclasses.replace(params, grammar=grammar)
                seq = Sequence(params)
                seq.grammar = SequenceGrammar(
                    new_matcher(self.ll_tok, grammar), self.stop_ids, tuple(self.ll_tok.eos_tokens)
                )
                t0 = time.perf_counter()
                sched.submit(seq)
                while not (event := seq.events.get(timeout=600)).finish_reason:
                    pass
                g = seq.grammar
                runs.append(
                    Run(
                        tuple(seq.generated),
                        event.finish_reason if event.error is None else f"error: {event.error}",
                        tuple(seq.accept_lengths),
                        time.perf_counter() - t0,
                        g.drafted_nodes,
                        g.kept_nodes,
                        g.mask_count,
                        g.mask_s,
                    )
                )
            deadline = time.perf_counter() + 5
            while self.engine.active_sequences and time.perf_counter() < deadline:  # the finished ones' Releases
                time.sleep(0.01)
        finally:
            sched.stop()
            if client is not None:
                client.close()
        return runs
