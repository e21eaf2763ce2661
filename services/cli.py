"""The `ddtree` command (README.md, "The `ddtree` command").

ddtree serve      all three services on loopback (default: the embedded demo checkpoint)
ddtree drafter | verifier | gateway    one service, as containers run them
ddtree generate   a client of the gateway (starts a private stack when --gateway is not given)
ddtree demo       the main job: start the stack, stream one chat answer, print the statistics, stop
ddtree train target | drafter    train the demo target / a DFlash drafter (tools/train_*.py)
ddtree bench context | twopoint | compare | overhead | step    decode speed; one verify step's cost (tools/bench/)
ddtree diagnose   explain a deployment's speed: profile, reconciliation, flags (tools/diagnose.py)
ddtree selftest gpu   kernels against their references, a Kimi-shaped model served end to end (tools/selftest/)
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import pathlib
import signal
import sys
import tempfile
import threading
from typing import Any

from ddtree.config import (
    DrafterConfig,
    GatewayConfig,
    SecurityConfig,
    VerifierConfig,
    add_config_flags,
    config_from_flags,
)

DEMO_PROMPT = "Write a Python function that returns the n-th Fibonacci number, and explain it briefly."


def _default_dirs():
    from ddtree.default_checkpoint import default_checkpoint

    return default_checkpoint()


def _set_threads(threads: int) -> None:
    if threads > 0:
        import torch

        torch.set_num_threads(threads)


def _wait(running) -> None:
    from ddtree.protocol.server import serve_until_stopped

    serve_until_stopped(running)


def _engine_start(cls, args, logger: str):
    """An engine command's first steps: its config, logging, and the OpenMP spin count, which must be
    set before anything imports torch (models/runtime/openmp_spin.py). Returns the config."""
    from ddtree.models.runtime.openmp_spin import apply_spin_count
    from ddtree.telemetry.logging import configure_logging, get_logger

    cfg = config_from_flags(cls, args)
    configure_logging(cfg.log_level, cfg.log_format)
    _bound_allocator(logger)
    spin = apply_spin_count(cfg.omp_spin_count)
    get_logger(logger).info("omp_spin_count", spins=cfg.omp_spin_count, setting=spin)
    return cfg


def _bound_allocator(logger: str) -> None:
    """A service's first step, before it starts threads: few malloc arenas, trimmed while it runs
    (telemetry/memory.py: what keeps RSS flat over long traffic)."""
    from ddtree.telemetry.logging import get_logger
    from ddtree.telemetry.memory import (
        DEFAULT_ARENAS,
        DEFAULT_TRIM_INTERVAL_S,
        limit_arenas,
        limit_shape_caches,
        start_trimming,
    )

    limit_shape_caches()
    limited = limit_arenas(DEFAULT_ARENAS)
    trimming = start_trimming(DEFAULT_TRIM_INTERVAL_S) is not None
    get_logger(logger).info("malloc_bounded", arenas=DEFAULT_ARENAS if limited else None, trimming=trimming)


def cmd_drafter(args) -> None:
    from ddtree.telemetry.logging import get_logger

    cfg = _engine_start(DrafterConfig, args, "ddtree.drafter")
    engine_thread = None
    if cfg.device == "cpu":  # one thread runs every forward (models/runtime/cpu)
        from ddtree.models.runtime.cpu import EngineThread, engine_threads, main_thread_single

        engine_thread = EngineThread(engine_threads(cfg.threads))
        main_thread_single()
    else:
        _set_threads(cfg.threads)
    model, target = cfg.model, cfg.target
    if not model or not target:
        d = _default_dirs()
        model, target = model or str(d.drafter), target or str(d.target)
    from ddtree.drafter.factory import make_engine
    from ddtree.drafter.server import serve_engine

    engine = make_engine(cfg, model, target)
    if cfg.warmup_sequences and hasattr(engine, "warm_up"):
        from ddtree.models.runtime.cpu import run_on

        seconds = run_on(engine_thread)(engine.warm_up, cfg.warmup_sequences)
        get_logger("ddtree.drafter").info("warmed_up", sequences=cfg.warmup_sequences, seconds=round(seconds, 3))
    _wait(serve_engine(engine, cfg, engine_thread))


def cmd_verifier(args) -> None:
    cfg = _engine_start(VerifierConfig, args, "ddtree.verifier")
    if cfg.device == "cpu" and cfg.tp == 1:  # only the scheduler thread runs parallel (models/runtime/cpu)
        from ddtree.models.runtime.cpu import engine_threads, main_thread_single

        cfg = dataclasses.replace(cfg, threads=engine_threads(cfg.threads))
        main_thread_single()
    else:
        _set_threads(cfg.threads)
    from ddtree.verifier.rpc.server import serve

    _wait(serve(cfg, cfg.model or str(_default_dirs().target)))


def cmd_gateway(args) -> None:
    from ddtree.telemetry.logging import configure_logging

    cfg = config_from_flags(GatewayConfig, args)
    configure_logging(cfg.log_level, cfg.log_format)
    _bound_allocator("gateway")
    from ddtree.gateway.api.server import serve

    _wait(serve(cfg, tokenizer_dir=cfg.tokenizer or str(_default_dirs().target)))


def cmd_health(args) -> int:
    """grpc.health.v1 check, for container health checks: exit 0 when SERVING, 1 otherwise. Dials
    mutual TLS when the service does (--tls-* or DDTREE_TLS_*, as the service itself is configured)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from ddtree.protocol.security import ServiceSecurity
    from ddtree.protocol.server import GRPC_OPTIONS

    try:
        security = ServiceSecurity.from_config(config_from_flags(SecurityConfig, args))
    except ValueError as e:
        print(f"ddtree health: {e}", file=sys.stderr)
        return 2
    try:
        with security.channel(args.address, GRPC_OPTIONS) as channel:
            resp = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout
            )
    except grpc.RpcError as err:
        print(f"{args.address} {args.service or '(server)'}: {err.code().name} {err.details() or ''}".strip())
        return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    print(f"{args.address} {args.service or '(server)'}: {status}")
    return 0 if resp.status == health_pb2.HealthCheckResponse.SERVING else 1


def _service_token_file(args, log_dir: pathlib.Path) -> tuple[str, bool]:
    """(the token file the stack's three services share, whether it was generated now): --service-token-file,
    else none when DDTREE_SERVICE_TOKEN(_FILE) or a --*-args flag gives the children one, else a new random
    token in log_dir: the engines are never open to callers without it."""
    from ddtree.launcher import write_service_token

    if args.service_token_file:
        return str(pathlib.Path(args.service_token_file).expanduser().resolve()), False
    given = " ".join((args.verifier_args, args.drafter_args, args.gateway_args))
    if (
        os.environ.get("DDTREE_SERVICE_TOKEN")
        or os.environ.get("DDTREE_SERVICE_TOKEN_FILE")
        or "--service-token" in given
    ):
        return "", False
    return str(write_service_token(log_dir)), True


def _start_stack(
    args,
    log_dir: pathlib.Path,
    metrics: bool = False,
    ports: tuple[int, int, int] = (0, 0, 0),
    metrics_ports: tuple[int, int, int] = (0, 0, 0),
    token_file: str | None = None,
):
    """The three services on the stack flags. The directories are checked and made absolute first (the
    children run in another working directory): a bad one is a one-line error before anything starts.
    token_file: the service token they share (None: _service_token_file's)."""
    from ddtree.launcher import check_checkpoint_dir, check_tokenizer_dir, start_stack

    model, drafter = args.model, args.drafter
    if not model or (not drafter and not args.no_drafter):
        d = _default_dirs()
        model = model or str(d.target)
        drafter = drafter or str(d.drafter)
    model = check_checkpoint_dir(model, "--model")
    drafter = None if args.no_drafter else check_checkpoint_dir(drafter, "--drafter")
    tokenizer = check_tokenizer_dir(args.tokenizer or model, "--tokenizer" if args.tokenizer else "--model")
    if token_file is None:
        token_file, _ = _service_token_file(args, log_dir)
    return start_stack(
        model,
        drafter,
        log_dir,
        host=args.host,
        verifier_args=tuple(args.verifier_args.split()),
        drafter_args=tuple(args.drafter_args.split()),
        gateway_args=("--tokenizer", tokenizer, *args.gateway_args.split()),
        metrics=metrics,
        ports=ports,
        metrics_ports=metrics_ports,
        service_token_file=token_file,
    )


def cmd_serve(args) -> int:
    from ddtree.launcher import describe, free_ports, supervise

    log_dir = pathlib.Path(args.log_dir or tempfile.mkdtemp(prefix="ddtree-serve-"))
    # ports fixed up front (gRPC of gateway, verifier, drafter; HTTP; Prometheus of the three): a restarted
    # child keeps its addresses
    found = free_ports(7, args.host)
    ports, http, prom_ports = found[:3], found[3], found[4:]
    if "--http-port" not in args.gateway_args and not os.environ.get("DDTREE_HTTP_PORT"):
        args.gateway_args = f"--http-port {http} {args.gateway_args}"
    token_file, generated = _service_token_file(args, log_dir)
    if token_file:
        how = "generated for this stack" if generated else "given"
        print(f"service token: {token_file} ({how}; the verifier and drafter take only calls that carry it)")
    stack = _start_stack(
        args, log_dir, metrics=not args.no_metrics, ports=ports, metrics_ports=prom_ports, token_file=token_file
    )
    for p in stack.processes:
        print(f"{p.name:9s} {describe(p)}   log {p.log_path}", flush=True)
    print(f"http      http://{stack.gateway_http}/v1   (OpenAI-compatible)", flush=True)
    print("serving; Ctrl-C stops", flush=True)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    code = supervise(stack, done, restart=not args.no_restart, log=lambda line: print(f"serve: {line}", flush=True))
    codes = stack.stop()
    print("stopped: " + ", ".join(f"{k} exit {v}" for k, v in codes.items()), flush=True)
    return code


def _options(args):
    from ddtree.protocol.ddtree.v1 import gateway_pb2

    opts = gateway_pb2.GenerationOptions(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        ignore_eos=args.ignore_eos,
        no_spec=args.no_spec,
        budget=args.budget,
    )
    if args.seed is not None:
        opts.seed = args.seed
    return opts


def _api_key(args) -> str:
    """The key `generate` sends: --api-key-file's first word (comments and blank lines skipped, so a
    gateway's key file of one key serves), else DDTREE_API_KEY, else none. ValueError names the file."""
    if not args.api_key_file:
        return os.environ.get("DDTREE_API_KEY", "").strip()
    try:
        text = pathlib.Path(args.api_key_file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--api-key-file {args.api_key_file}: cannot read it ({getattr(e, 'strerror', e)})") from None
    words = [line.split("#", 1)[0].split() for line in text.splitlines()]
    key = next((w[0] for w in words if w), "")
    if not key:
        raise ValueError(f"--api-key-file {args.api_key_file}: no key in the file")
    return key


def _run_client(args, prompt: str, chat: bool, as_json: bool) -> int:
    from ddtree.client import format_stats, generate

    shown = {"mode": None}

    def show(mode: str, text: str) -> None:
        # Reasoning (<think> ... </think>, split off by the gateway's parser) and answer, labelled once each.
        if shown["mode"] != mode:
            print(f"\n[{mode}] ", end="")
            shown["mode"] = mode
        print(text, end="", flush=True)

    api_key = _api_key(args)

    def go(gateway: str):
        return generate(
            gateway,
            prompt,
            api_key=api_key,
            chat=chat,
            options=_options(args),
            on_text=None if as_json else (lambda t: show("answer", t)),
            on_reasoning=None if as_json else (lambda t: show("reasoning", t)),
        )

    if args.gateway:
        result = go(args.gateway)
    else:
        log_dir = pathlib.Path(args.log_dir or tempfile.mkdtemp(prefix="ddtree-generate-"))
        if not as_json:
            print(f"starting drafter, verifier and gateway on loopback (logs in {log_dir}) ...", flush=True)
        with _start_stack(args, log_dir) as stack:
            result = go(stack.gateway)
    if as_json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        print("\n\n" + format_stats(result), flush=True)
    return 0


def cmd_generate(args) -> int:
    return _run_client(args, args.prompt, args.chat, args.json)


def cmd_demo(args) -> int:
    return _run_client(args, args.prompt or DEMO_PROMPT, True, args.json)


def _add_stack_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="", help="target checkpoint dir (default: the embedded demo checkpoint)")
    p.add_argument("--drafter", default="", help="drafter checkpoint dir (default: the demo drafter)")
    p.add_argument("--no-drafter", action="store_true", help="start no drafter: AR decoding only")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--log-dir", default="", help="where the services' logs go (default: a temp dir)")
    p.add_argument("--tokenizer", default="", help="tokenizer dir for the gateway (default: the --model dir)")
    p.add_argument("--verifier-args", default="", help="extra verifier flags, one string (e.g. '--tp 2')")
    p.add_argument("--drafter-args", default="", help="extra drafter flags, one string (e.g. '--window 512')")
    p.add_argument(
        "--gateway-args", default="", help="extra gateway flags, one string (e.g. '--http-port 8000 --api-key-file F')"
    )
    p.add_argument(
        "--service-token-file",
        default="",
        help="the service token the three services share (default: DDTREE_SERVICE_TOKEN(_FILE) when set, else a "
        "new random one in the log dir)",
    )


def _add_client_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gateway", default="", help="gateway address host:port (default: start a private stack)")
    p.add_argument(
        "--api-key-file",
        default="",
        help="file holding the gateway's API key (its first word; default: the DDTREE_API_KEY variable)",
    )
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=0.0, help="0 = off")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--budget", type=int, default=0, help="tree node budget (0 = server default)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--no-spec", action="store_true", help="autoregressive decoding (same model code)")
    p.add_argument("--json", action="store_true", help="print text, token ids, usage, spec stats and timing as JSON")
    _add_stack_flags(p)


# Commands that live in their own modules: (parent command, name, module with add_parser(subparsers)).
COMMAND_MODULES = (
    ("train", "target", "ddtree.tools.train_target"),
    ("train", "drafter", "ddtree.tools.train_drafter"),
    ("", "bench", "ddtree.tools.bench"),
    ("", "diagnose", "ddtree.tools.diagnose"),
    ("", "inspect", "ddtree.tools.inspect"),
    ("", "selftest", "ddtree.tools.selftest"),
)
# What the engine install has and the gateway's (docker/requirements-gateway.txt) does not.
ENGINE_ONLY = frozenset({"torch", "numpy", "safetensors"})


def _add_command(sub, name: str, module_name: str) -> None:
    """Register a command from its module; in an install without torch (the gateway's) the command is
    still listed, and says what it needs instead of breaking every other command."""
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        missing = (err.name or "").partition(".")[0]
        if missing not in ENGINE_ONLY:
            raise
        # Takes any arguments (no prefix character: every word is a positional), so it can say what it needs.
        p = sub.add_parser(name, help=f"(needs {missing}: not in this install)", add_help=False, prefix_chars="\0")
        p.add_argument("rest", nargs="*")

        def unavailable(args, missing=missing) -> int:
            print(
                f"ddtree: this command needs {missing}, which this install does not have "
                f"(the gateway's); install the engine: pip install torch==2.13.0 ddtree-serve",
                file=sys.stderr,
            )
            return 2

        p.set_defaults(fn=unavailable)
        return
    module.add_parser(sub)


def _add_service_commands(sub, names: tuple[str, ...]) -> None:
    for name, cls, fn in (
        ("drafter", DrafterConfig, cmd_drafter),
        ("verifier", VerifierConfig, cmd_verifier),
        ("gateway", GatewayConfig, cmd_gateway),
    ):
        if name in names:
            p = sub.add_parser(name, help=f"run the {name} service")
            add_config_flags(p, cls)
            p.set_defaults(fn=fn)


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("ddtree-serve")
    except metadata.PackageNotFoundError:  # a checkout run without installing
        return "unknown"


def _root_parser() -> tuple[argparse.ArgumentParser, Any]:
    parser = argparse.ArgumentParser(prog="ddtree", description="DDTree speculative decoding for MLA + MoE models")
    parser.add_argument("--version", action="version", version=f"ddtree {_version()}")
    return parser, parser.add_subparsers(dest="command", required=True)


def engine_parser(name: str) -> argparse.ArgumentParser:
    """The parser of one engine command alone. build_parser imports the command modules, and they
    import torch; an engine must set its OpenMP spin count before torch loads (models/runtime/openmp_spin.py)."""
    parser, sub = _root_parser()
    _add_service_commands(sub, (name,))
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser, sub = _root_parser()
    _add_service_commands(sub, ("drafter", "verifier", "gateway"))
    p = sub.add_parser("health", help="check a service's grpc.health.v1 status (exit 0 = SERVING)")
    p.add_argument("address", help="HOST:PORT")
    p.add_argument("--service", default="", help="service name, e.g. ddtree.v1.Verifier ('' = the server)")
    p.add_argument("--timeout", type=float, default=5.0)
    add_config_flags(p, SecurityConfig)
    p.set_defaults(fn=cmd_health)
    p = sub.add_parser(
        "serve",
        help="run drafter, verifier and gateway on loopback",
        description=(
            "Run drafter, verifier and gateway. The gateway serves gRPC and the OpenAI-compatible HTTP API "
            "(/v1/chat/completions, /v1/completions, /v1/models; Anthropic's /v1/messages) on the address it "
            "prints as 'http'. The HTTP port is any free one unless set: DDTREE_HTTP_PORT=8000, or "
            "--gateway-args '--http-port 8000'."
        ),
    )
    _add_stack_flags(p)
    p.add_argument(
        "--no-metrics", action="store_true", help="no Prometheus port per service (default: each on a free port)"
    )
    p.add_argument(
        "--no-restart",
        action="store_true",
        help="exit non-zero when a service exits (default: restart it on its address, with backoff)",
    )
    p.set_defaults(fn=cmd_serve)
    p = sub.add_parser("generate", help="send one request through the gateway")
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="apply the chat template (default: raw completion)")
    _add_client_flags(p)
    p.set_defaults(fn=cmd_generate)
    p = sub.add_parser("demo", help="start the stack, stream one chat answer with its statistics, stop")
    p.add_argument("--prompt", default="")
    _add_client_flags(p)
    p.set_defaults(fn=cmd_demo)
    p = sub.add_parser("train", help="train a model (tools/train_*.py)")
    train_sub = p.add_subparsers(dest="train_command", required=True)
    for parent, name, module_name in COMMAND_MODULES:
        _add_command(train_sub if parent == "train" else sub, name, module_name)
    return parser


ENGINE_COMMANDS = ("drafter", "verifier")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = engine_parser(argv[0]) if argv and argv[0] in ENGINE_COMMANDS else build_parser()
    args = parser.parse_args(argv)
    from ddtree.launcher import ServiceStartError

    try:
        return args.fn(args) or 0
    except (ValueError, OSError, ServiceStartError) as err:  # expected failures: one clear line, exit 2
        # (configuration, a checkpoint or tokenizer that is not there, a gateway that refused, a service
        # that did not start: its message's first line names its log)
        line = str(err).splitlines()[0] if str(err) else type(err).__name__
        print(f"ddtree {args.command}: error: {line}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
