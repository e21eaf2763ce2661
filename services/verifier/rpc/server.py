"""The Verifier gRPC service: validates requests, hands them to the scheduler, streams the steps."""

from __future__ import annotations

import pathlib
import threading

import grpc

from ddtree.config import VerifierConfig
from ddtree.contract.usage import usage_from_steps
from ddtree.models.runtime.cpu import single_threaded
from ddtree.protocol.ddtree.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc
from ddtree.protocol.security import ServiceSecurity, engine_bind_host
from ddtree.protocol.server import RunningServer, start_server
from ddtree.protocol.stream_slots import StreamSlots
from ddtree.telemetry.logging import get_logger
from ddtree.telemetry.metrics import serve_metrics
from ddtree.tokenization.grammar_vocab import ll_tokenizer
from ddtree.tokenization.tokenizer import Tokenizer
from ddtree.verifier import metrics
from ddtree.verifier.constraints.grammar import SequenceGrammar, matcher_error, new_matcher
from ddtree.verifier.engine import build_engine
from ddtree.verifier.rpc.features_rpc import stream_features
from ddtree.verifier.rpc.request_params import MAX_REQUEST_ID_CHARS, generate_params
from ddtree.verifier.sampling.logprobs import prompt_logprobs_messages
from ddtree.verifier.sequence import GenerateParams, Sequence
from ddtree.verifier.step.scheduler import AdmissionError, Scheduler

log = get_logger("ddtree.verifier")


def usage_of(seq: Sequence) -> common_pb2.Usage:
    """The usage of a finished sequence (ddtree.contract.usage defines its fields), on the verifier's clock."""
    ttft = (seq.first_token_time - seq.arrival) * 1e3 if seq.first_token_time else 0.0
    decode = (seq.last_token_time - seq.first_token_time) * 1e3 if seq.last_token_time and seq.first_token_time else 0.0
    usage = usage_from_steps(seq.prompt_len, len(seq.generated), seq.accept_lengths, ttft, decode)
    usage.cached_tokens = getattr(seq, "cached_tokens", 0)
    return usage


class NoGrammarTokenizer(Exception):
    """A grammar request to a verifier that cannot build llguidance's tokenizer (FAILED_PRECONDITION)."""


class VerifierServicer(verifier_pb2_grpc.VerifierServicer):
    def __init__(
        self,
        scheduler: Scheduler,
        config: VerifierConfig,
        model_id: str,
        model_config_json: str,
        eos_token_ids: tuple[int, ...],
        tokenizer_dir: str | None = None,
    ):
        self.scheduler = scheduler
        self.tokenizer_dir = tokenizer_dir  # the checkpoint's tokenizer: grammars are compiled against it
        self._ll_tokenizer = None
        self._ll_failure: str | None = None  # why the grammar tokenizer could not be built (cached: tried once)
        self._ll_lock = threading.Lock()
        self.config = config
        self.model_id = model_id
        self.model_config_json = model_config_json
        self.eos_token_ids = eos_token_ids
        self.vocab_size = scheduler.vocab_size
        # One handler thread per admitted stream: every running or queued sequence has one.
        self.stream_slots = StreamSlots(config.max_batch + config.max_queue, "max_batch + max_queue")

    def _params(self, req: verifier_pb2.GenerateRequest) -> GenerateParams:
        """Validate a request (request_params.py); raises ValueError with the message the client will see."""
        drafter = self.scheduler.drafter
        max_budget = drafter.info.max_budget if drafter is not None else None
        return generate_params(req, self.config, self.vocab_size, self.eos_token_ids, max_budget)

    def _grammar_tokenizer(self):
        """The checkpoint's vocabulary for llguidance, built once, on the first constrained request (a
        large vocabulary takes a while: not at start-up); NoGrammarTokenizer when it cannot be (that too is decided once)."""
        with self._ll_lock:
            if self._ll_tokenizer is None and self._ll_failure is None:
                if self.tokenizer_dir is None:
                    self._ll_failure = "no tokenizer directory"
                else:
                    try:
                        self._ll_tokenizer = ll_tokenizer(Tokenizer(self.tokenizer_dir))
                    except Exception as err:  # no tokenizer files, an unreadable or unknown format
                        log.exception("grammar_tokenizer_failed", tokenizer_dir=str(self.tokenizer_dir))
                        self._ll_failure = f"{type(err).__name__}; see the verifier's log"
            if self._ll_failure is not None:
                raise NoGrammarTokenizer(
                    f"grammar: the verifier has no tokenizer for constrained decoding ({self._ll_failure})"
                )
            return self._ll_tokenizer

    def _grammar(self, params: GenerateParams) -> SequenceGrammar | None:
        """The request's grammar state, or None; ValueError when it does not compile (llguidance's
        message), NoGrammarTokenizer when this verifier cannot compile grammars."""
        if not params.grammar:
            return None
        tokenizer = self._grammar_tokenizer()
        matcher = new_matcher(tokenizer, params.grammar)
        if matcher.is_error():
            raise ValueError(f"grammar: {matcher_error(matcher)}")
        return SequenceGrammar(matcher, params.stop_token_ids, tuple(tokenizer.eos_tokens))

    def Generate(self, request, context):
        self.stream_slots.take(context)  # or RESOURCE_EXHAUSTED: health and GetInfo keep their threads
        try:
            params = self._params(request)
            grammar = self._grammar(params)
        except ValueError as err:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        except NoGrammarTokenizer as err:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(err))
        seq = Sequence(params, grammar=grammar, page_size=self.config.page_size)
        try:
            self.scheduler.submit(seq)
        except AdmissionError as err:
            context.abort(err.code, str(err))
        context.add_callback(lambda: self.scheduler.abort_sequence(seq))
        first = True
        for event in seq.iter_events(context):  # ends when the client goes away; an error event aborts
            if event.prompt_logprobs is not None:  # a prefill chunk's, in messages of bounded size (logprobs.py)
                for piece in prompt_logprobs_messages(event.prompt_logprobs):
                    yield verifier_pb2.GenerateResponse(request_id=seq.request_id, prompt_logprobs=piece)
                continue
            resp = verifier_pb2.GenerateResponse(request_id=seq.request_id, token_ids=list(event.token_ids))
            if first:  # what the prefix cache gave is known now: a gateway that cuts the stream still reports it
                resp.usage.prompt_tokens, resp.usage.cached_tokens, first = seq.prompt_len, seq.cached_tokens, False
            if event.step is not None:
                resp.steps.add(**event.step.__dict__)
            for lp, ids, lps in event.logprobs:
                resp.logprobs.add(logprob=lp, top_ids=ids, top_logprobs=lps)
            if event.finish_reason:
                resp.finish_reason = event.finish_reason
                resp.usage.CopyFrom(usage_of(seq))
                yield resp
                return
            yield resp

    def Features(self, request, context):
        """The target's generation and the tapped features of every token it read (features_rpc.py)."""
        yield from stream_features(self, request, context, usage_of)

    def Abort(self, request, context):
        if not request.request_id:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id is empty")
        if len(request.request_id) > MAX_REQUEST_ID_CHARS:  # never echoed: it could exceed the metadata limit
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"request_id is longer than {MAX_REQUEST_ID_CHARS} characters"
            )
        if not self.scheduler.abort(request.request_id):
            context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"no running request with id {request.request_id!r} (unknown or already finished)",
            )
        return verifier_pb2.AbortResponse(request_id=request.request_id)

    def GetInfo(self, request, context):
        drafter = self.scheduler.drafter
        return verifier_pb2.VerifierInfo(
            model_id=self.model_id,
            model_config_json=self.model_config_json,
            vocab_size=self.vocab_size,
            max_context=self.config.max_context,
            max_new_tokens_limit=self.config.max_new_tokens_limit,
            eos_token_ids=list(self.eos_token_ids),
            spec_enabled=drafter is not None,
            drafter_address=drafter.address if drafter else "",
            default_budget=self.config.default_budget,
            total_steps=self.scheduler.total_steps,
            total_tokens=self.scheduler.total_tokens,
            running_requests=self.scheduler.running_count,
            kv_used_tokens=self.scheduler.kv_held_by_requests,
            kv_total_tokens=self.scheduler.pool.num_slots,
            kv_cached_tokens=self.scheduler.kv_cached,
        )


def serve(config: VerifierConfig, model_dir: str) -> RunningServer:
    """Build the engine (engine.py), start its scheduler and the gRPC server."""
    engine = build_engine(config, model_dir)
    log.info("verifier_warm_up", seconds=round(engine.warm_up(), 3))  # before the server reports SERVING
    scheduler = engine.scheduler
    mcfg = engine.target.config
    scheduler.start()
    eos_ids = tuple(mcfg.eos_token_ids)
    config_json = (pathlib.Path(model_dir) / "config.json").read_text()
    servicer = VerifierServicer(scheduler, config, pathlib.Path(model_dir).name, config_json, eos_ids, model_dir)

    def register(server):
        verifier_pb2_grpc.add_VerifierServicer_to_server(servicer, server)
        return [verifier_pb2.DESCRIPTOR.services_by_name["Verifier"].full_name]

    def on_stop():
        engine.stop()

    log.info("verifier_ready", model=model_dir, drafter=config.drafter or None, kv_tokens=engine.pool.num_slots)
    security = ServiceSecurity.from_config(config)
    host = engine_bind_host(config.host, security)
    if not (security.token or security.tls):
        log.warning("engine_unauthenticated", listening_on=host, asked=config.host,
                    message="no service token or mutual TLS: listening on loopback only")  # fmt: skip
    running = start_server(
        "verifier",
        register,
        host,
        config.port,
        config.max_workers,
        config.grace_s,
        on_stop,
        stream_threads=servicer.stream_slots.limit,
        security=security,
        handler_init=single_threaded,  # only the scheduler thread runs parallel work (models/runtime/cpu)
    )
    if engine.tensor_parallel is not None:
        engine.tensor_parallel.attach(running)
    serve_metrics(config.metrics_port, config.host, metrics.REGISTRY)
    return running
