"""Where `ddtree bench` and `ddtree diagnose` send requests, and what one measured generation returns.

An endpoint is a running verifier (`--verifier HOST:PORT`: token ids in, the verifier's own clock out),
a running gateway (`--gateway HOST:PORT`: the prompt goes as text, no chain option), or a private
drafter + verifier started from checkpoint dirs (`--model DIR --drafter DIR`, default: the shipped demo
pair in checkpoints/demo when present, else the random default). Every generation is greedy with a
fixed length (ignore_eos); speed is read from the verifier's usage record (first to last token), so the
client and the stream are not measured.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import pathlib
import tempfile
import time
import uuid

import grpc

from ddtree.config import SecurityConfig, config_from_flags
from ddtree.contract.step_record import STEP_FIELDS
from ddtree.protocol.ddtree.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from ddtree.protocol.security import ServiceSecurity
from ddtree.protocol.server import GRPC_OPTIONS
from ddtree.telemetry.report import StepSummary, summarize


@dataclasses.dataclass
class Run:
    token_ids: list[int]
    steps: list[dict]  # step records: StepStats fields + request_id
    prompt_tokens: int
    completion_tokens: int
    ttft_ms: float  # verifier: arrival to first token (prefill)
    decode_ms: float  # verifier: first token to last token
    wall_s: float  # client: call to last message, what a stopwatch around the request gives

    @property
    def summary(self) -> StepSummary:
        return summarize(self.steps)

    @property
    def tau(self) -> float:
        return self.summary.tau

    @property
    def decode_tok_s(self) -> float:
        """Tokens after the first per second of decode, on the verifier's clock."""
        return 1e3 * (self.completion_tokens - 1) / self.decode_ms if self.decode_ms > 0 else 0.0

    @property
    def wall_step_ms(self) -> float:
        """Decode time per step (step records + the scheduler's time between steps)."""
        return self.decode_ms / len(self.steps) if self.steps else 0.0

    def to_json(self) -> dict:
        s = self.summary
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "steps": s.steps,
            "tau": s.tau,
            "decode_tok_s": self.decode_tok_s,
            "wall_step_ms": self.wall_step_ms,
            "step_ms": {"draft": s.draft_ms, "verify": s.verify_ms, "transport": s.transport_ms, "total": s.step_ms},
            "ttft_ms": self.ttft_ms,
            "decode_ms": self.decode_ms,
            "wall_s": self.wall_s,
        }


def _step_dict(rid: str, s) -> dict:
    return {"request_id": rid, **{f: getattr(s, f) for f in STEP_FIELDS}}


def engine_security() -> ServiceSecurity:
    """How a tool calls an engine: the service token (and TLS) of DDTREE_SERVICE_TOKEN(_FILE) / DDTREE_TLS_*,
    as a service reads them (`ddtree serve`'s engines take only calls with its token)."""
    return ServiceSecurity.from_config(config_from_flags(SecurityConfig))


class VerifierEndpoint:
    kind = "verifier"
    supports_chain = True

    def __init__(self, address: str, timeout_s: float = 3600.0):
        self.address = address
        self.timeout_s = timeout_s
        self.channel = engine_security().channel(address, GRPC_OPTIONS)
        self.stub = verifier_pb2_grpc.VerifierStub(self.channel)
        self.info = self.stub.GetInfo(verifier_pb2.VerifierInfoRequest(), timeout=120, wait_for_ready=True)
        self.max_context = self.info.max_context
        self.vocab_size = self.info.vocab_size

    def generate(
        self, ids: list[int], max_new_tokens: int, *, no_spec: bool = False, budget: int = 0, chain: bool = False
    ) -> Run:
        rid = f"bench-{uuid.uuid4().hex[:12]}"
        req = verifier_pb2.GenerateRequest(
            request_id=rid,
            input_ids=ids,
            max_new_tokens=max_new_tokens,
            ignore_eos=True,
            spec=common_pb2.SpecOptions(no_spec=no_spec, budget=budget, chain=chain),
        )
        out, steps, usage = [], [], None
        t0 = time.perf_counter()
        for msg in self.stub.Generate(req, timeout=self.timeout_s):
            out.extend(msg.token_ids)
            steps.extend(_step_dict(rid, s) for s in msg.steps)
            if msg.finish_reason:
                usage = msg.usage
        wall = time.perf_counter() - t0
        return Run(out, steps, usage.prompt_tokens, usage.completion_tokens, usage.ttft_ms, usage.decode_ms, wall)

    def close(self) -> None:
        self.channel.close()


class GatewayEndpoint:
    """Prompts go as text (decoded with the local tokenizer; the gateway re-encodes them, so the context
    can differ by a few tokens: rows report the prompt_tokens the verifier saw)."""

    kind = "gateway"
    supports_chain = False

    def __init__(self, address: str, tokenizer, timeout_s: float = 3600.0):
        self.address = address
        self.tokenizer = tokenizer
        self.timeout_s = timeout_s
        self.channel = grpc.insecure_channel(address, options=GRPC_OPTIONS)
        self.stub = gateway_pb2_grpc.GatewayStub(self.channel)
        self.info = self.stub.GetInfo(gateway_pb2.GatewayInfoRequest(), timeout=120, wait_for_ready=True)
        self.max_context = self.info.max_context
        self.vocab_size = self.info.vocab_size

    def generate(
        self, ids: list[int], max_new_tokens: int, *, no_spec: bool = False, budget: int = 0, chain: bool = False
    ) -> Run:
        if chain:
            raise ValueError("the gateway has no chain option: measure chains with --verifier")
        opts = gateway_pb2.GenerationOptions(
            max_tokens=max_new_tokens, temperature=0.0, ignore_eos=True, no_spec=no_spec, budget=budget
        )
        req = gateway_pb2.CompleteRequest(prompt=self.tokenizer.decode(ids), options=opts)
        out, steps, usage, rid = [], [], None, ""
        t0 = time.perf_counter()
        for chunk in self.stub.Complete(req, timeout=self.timeout_s):
            rid = rid or chunk.request_id or "gateway"
            out.extend(chunk.token_ids)
            steps.extend(_step_dict(rid, s) for s in chunk.steps)
            if chunk.finish_reason:
                usage = chunk.usage
        wall = time.perf_counter() - t0
        return Run(out, steps, usage.prompt_tokens, usage.completion_tokens, usage.ttft_ms, usage.decode_ms, wall)

    def close(self) -> None:
        self.channel.close()


# ---- arguments and private services ------------------------------------------------------------------
def add_endpoint_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("where to measure (default: a private drafter + verifier of --model/--drafter)")
    g.add_argument("--verifier", default="", help="a running verifier HOST:PORT")
    g.add_argument("--gateway", default="", help="a running gateway HOST:PORT (text prompts; no chain)")
    g.add_argument(
        "--model",
        default="",
        help="target checkpoint dir (default: checkpoints/demo/target, else "
        "the random default); also the tokenizer unless --tokenizer",
    )
    g.add_argument(
        "--drafter",
        default="",
        help="drafter checkpoint dir (default: checkpoints/demo/drafter, else the random default)",
    )
    g.add_argument("--tokenizer", default="", help="tokenizer dir (default: --model)")
    g.add_argument("--verifier-args", default="", help="extra flags for the private verifier, one string")
    g.add_argument("--drafter-args", default="", help="extra flags for the private drafter, one string")
    g.add_argument("--log-dir", default="", help="logs of the private services (default: a new temp dir)")


def checkpoint_dirs(args) -> tuple[str, str]:
    model, drafter = args.model, args.drafter
    if not model or not drafter:
        from ddtree.default_checkpoint import default_checkpoint

        d = default_checkpoint()  # the shipped demo pair when present, else the random pair
        model, drafter = model or str(d.target), drafter or str(d.drafter)
    return model, drafter


def load_tokenizer(args):
    from ddtree.tokenization.tokenizer import Tokenizer

    return Tokenizer(args.tokenizer or checkpoint_dirs(args)[0])


@contextlib.contextmanager
def private_verifier(
    model: str,
    drafter: str,
    max_context: int,
    log_dir: pathlib.Path,
    drafter_args: tuple[str, ...] = (),
    verifier_args: tuple[str, ...] = (),
    name: str = "",
    env: dict[str, str] | None = None,
    python: str | None = None,
):
    """A drafter + verifier pair as child processes on loopback; yields the verifier's address. env: extra
    environment variables of both processes (over the launcher's engine defaults); python: the interpreter
    of both (another install's, to run another commit's code; this one by default)."""
    from ddtree.launcher import default_engine_threads, start_service

    d = start_service(
        f"drafter{name}",
        [
            "drafter",
            "--model",
            drafter,
            "--target",
            model,
            "--port",
            "0",
            "--threads",
            str(default_engine_threads("drafter")),
            *drafter_args,
        ],
        log_dir,
        env=env,
        python=python,
    )
    try:
        v = start_service(
            f"verifier{name}",
            [
                "verifier",
                "--model",
                model,
                "--port",
                "0",
                "--drafter",
                d.address,
                "--max-context",
                str(max_context),
                "--kv-tokens",
                str(2 * max_context + 1024),
                "--threads",
                str(default_engine_threads("verifier")),
                *verifier_args,
            ],
            log_dir,
            env=env,
            python=python,
        )
        try:
            yield v.address
        finally:
            v.stop()
    finally:
        d.stop()


def make_log_dir(args) -> pathlib.Path:
    return pathlib.Path(args.log_dir) if args.log_dir else pathlib.Path(tempfile.mkdtemp(prefix="ddtree-bench-"))


@contextlib.contextmanager
def open_endpoint(args, max_context: int, tokenizer=None, private_verifier_args: tuple[str, ...] = ()):
    """The endpoint the arguments name; a private one sized for `max_context` tokens when none is named
    (with private_verifier_args before the user's --verifier-args, which override them)."""
    if args.verifier:
        ep = VerifierEndpoint(args.verifier)
    elif args.gateway:
        ep = GatewayEndpoint(args.gateway, tokenizer or load_tokenizer(args))
    else:
        model, drafter = checkpoint_dirs(args)
        log_dir = make_log_dir(args)
        print(f"starting a private drafter + verifier (logs in {log_dir}) ...", flush=True)
        with private_verifier(
            model,
            drafter,
            max_context,
            log_dir,
            tuple(args.drafter_args.split()),
            private_verifier_args + tuple(args.verifier_args.split()),
        ) as address:
            ep = VerifierEndpoint(address)
            try:
                yield ep
            finally:
                ep.close()
        return
    try:
        if tokenizer is not None and tokenizer.vocab_size > ep.vocab_size:
            raise ValueError(
                f"the tokenizer has {tokenizer.vocab_size} tokens, the served model {ep.vocab_size}: "
                f"pass the served checkpoint's --model or --tokenizer"
            )
        if max_context > ep.max_context:
            raise ValueError(
                f"this run needs {max_context} tokens of context, {ep.address} allows {ep.max_context}: "
                f"use shorter --contexts / --tokens"
            )
        yield ep
    finally:
        ep.close()
