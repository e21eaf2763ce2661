"""Service configuration: one frozen dataclass per service, filled in one place.

Every field `foo_bar` of a config is set, in order of precedence, by the flag `--foo-bar`, the
environment variable `DDTREE_FOO_BAR`, or the dataclass default. `add_config_flags` and
`config_from_flags` are the only code that reads flags and environment for configuration, so the
docker files and the CLI can be checked against `env_var_names()`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
from typing import Any

ENV_PREFIX = "DDTREE_"
# The floating-point dtypes a service or tool may be asked to compute in, by name (torch.float32, ...;
# `ddtree.models.dtypes.TORCH_DTYPES` maps them: this module does not import torch).
DTYPE_NAMES = ("float32", "bfloat16", "float16")
# How the verifier stores its target's weights on the CPU (`ddtree.models.cpu_weight_layout` applies them).
CPU_LINEAR_LAYOUTS = ("auto", "row", "column")
DEFAULT_CHECKPOINT_DIR = pathlib.Path(os.environ.get("DDTREE_HOME", pathlib.Path.home() / ".cache" / "ddtree"))


def kv_setting(kv_tokens: int, kv_memory_gb: float, kv_memory_fraction: float) -> str:
    """The one setting that takes effect; raises ValueError for a bad or conflicting one."""
    if kv_tokens < 0:
        raise ValueError(f"kv_tokens must be >= 0 (0 = not set), got {kv_tokens}")
    if not kv_memory_gb >= 0:
        raise ValueError(f"kv_memory_gb must be >= 0 (0 = not set), got {kv_memory_gb}")
    if not 0 <= kv_memory_fraction <= 1:
        raise ValueError(f"kv_memory_fraction must be in [0, 1] (0 = not set), got {kv_memory_fraction}")
    given = {"kv_tokens": kv_tokens, "kv_memory_gb": kv_memory_gb, "kv_memory_fraction": kv_memory_fraction}
    chosen = [name for name, value in given.items() if value > 0]
    if len(chosen) > 1:
        flags = ", ".join(f"--{name.replace('_', '-')} {given[name]}" for name in chosen)
        raise ValueError(
            f"set only one of --kv-tokens, --kv-memory-gb, --kv-memory-fraction (or their DDTREE_* "
            f"variables); got {flags}"
        )
    return chosen[0] if chosen else "default"


@dataclasses.dataclass(frozen=True)
class SecurityConfig:
    """How a process authenticates to, and accepts calls from, the other services
    (`ddtree.protocol.security`); every service has these, and so does `ddtree health`."""

    service_token: str = dataclasses.field(
        default="",
        metadata={
            "help": "shared secret between gateway, verifier and drafter: required on calls into verifier and "
            "drafter, sent on calls out ('' = none; prefer the env var or service_token_file)"
        },
    )
    service_token_file: str = dataclasses.field(
        default="", metadata={"help": "file holding the service token (instead of service_token)"}
    )
    tls_ca: str = dataclasses.field(
        default="", metadata={"help": "PEM CA for mutual TLS between the services ('' = plaintext)"}
    )
    tls_cert: str = dataclasses.field(default="", metadata={"help": "PEM certificate of this service (mutual TLS)"})
    tls_key: str = dataclasses.field(default="", metadata={"help": "PEM private key of this service (mutual TLS)"})
    tls_server_name: str = dataclasses.field(
        default="", metadata={"help": "name checked in the certificates of services we call ('' = the host dialled)"}
    )

    def validate(self) -> None:
        if self.service_token and self.service_token_file:
            raise ValueError("set service_token or service_token_file, not both")
        tls = {"tls_ca": self.tls_ca, "tls_cert": self.tls_cert, "tls_key": self.tls_key}
        if any(tls.values()) and not all(tls.values()):
            missing = ", ".join(name for name, path in tls.items() if not path)
            raise ValueError(f"mutual TLS needs tls_ca, tls_cert and tls_key; missing {missing}")


@dataclasses.dataclass(frozen=True)
class ServiceConfig(SecurityConfig):
    host: str = dataclasses.field(default="127.0.0.1", metadata={"help": "address to bind"})
    port: int = dataclasses.field(default=0, metadata={"help": "port to bind (0 = any free port)"})
    log_level: str = dataclasses.field(default="info", metadata={"help": "debug | info | warning | error"})
    log_format: str = dataclasses.field(default="json", metadata={"help": "json | console"})
    grace_s: float = dataclasses.field(default=5.0, metadata={"help": "seconds in-flight RPCs get on shutdown"})
    max_workers: int = dataclasses.field(
        default=32,
        metadata={
            "help": "gRPC handler threads for unary calls and health (streams get their own: the verifier's "
            "max_batch + max_queue, the gateway's max_streams); calls beyond them get RESOURCE_EXHAUSTED"
        },
    )
    metrics_port: int = dataclasses.field(default=-1, metadata={"help": "Prometheus port (-1 = off, 0 = any)"})

    def validate(self) -> None:
        super().validate()
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.log_level not in ("debug", "info", "warning", "error"):
            raise ValueError(f"log_level must be debug|info|warning|error, got {self.log_level!r}")
        if self.log_format not in ("json", "console"):
            raise ValueError(f"log_format must be json|console, got {self.log_format!r}")
        if self.grace_s < 0:
            raise ValueError(f"grace_s must be >= 0, got {self.grace_s}")
        if self.max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {self.max_workers}")


# The drafter's --window auto. On CUDA the window's attention costs little, and real drafters use their
# context. On the demo CPU, window 2048 -> 512 gave code at 4096 tokens 258 -> 290 DDTree tok/s and chat at
# 1024 380 -> 426, each with the same tau (scripts.bench.bench_ab --arm-drafter-flags "w512=--window 512").
CUDA_WINDOW = 2048
CPU_WINDOW = 512


# The engines' OpenMP spin count (ddtree.models.openmp_spin sets it, and says why this value).
DEFAULT_OMP_SPIN_COUNT = 30000


def _omp_spin_count_field():
    return dataclasses.field(
        default=DEFAULT_OMP_SPIN_COUNT,
        metadata={
            "help": "rounds an OpenMP worker busy-waits after a parallel region before it sleeps (GOMP_SPINCOUNT, "
            "set before torch loads; -1 = libgomp's own 300000, about 4 ms of a core on the demo machine, "
            "which the other engine's turn loses). A GOMP_SPINCOUNT or OMP_WAIT_POLICY in the environment wins"
        },
    )


@dataclasses.dataclass(frozen=True)
class DrafterConfig(ServiceConfig):
    model: str = dataclasses.field(default="", metadata={"help": "drafter checkpoint dir ('' = default)"})
    target: str = dataclasses.field(default="", metadata={"help": "target checkpoint dir (embed + lm_head)"})
    window: int = dataclasses.field(
        default=-1,
        metadata={
            "help": "draft context window, tokens (0 = unlimited; -1 = auto: 2048 on CUDA, 512 on the CPU, where "
            "the window's attention lies on every step's path and the demo drafter's acceptance is the same "
            "at 512 as at 2048)"
        },
    )
    default_budget: int = dataclasses.field(default=16, metadata={"help": "tree node budget when a request sets none"})
    max_budget: int = dataclasses.field(default=1024, metadata={"help": "largest tree budget accepted"})
    max_sequences: int = dataclasses.field(
        default=4096,
        metadata={
            "help": "draft contexts held at once; a Draft that would start more answers RESOURCE_EXHAUSTED, "
            "and the verifier sends a replica at its cap no new sequences (they decode with AR)"
        },
    )
    device: str = dataclasses.field(default="cpu", metadata={"help": "torch device"})
    dtype: str = dataclasses.field(
        default="auto",
        metadata={
            "help": "auto | float32 | bfloat16 | float16 (auto = bfloat16 where matmuls have it natively: CUDA, "
            "AVX512-BF16/AMX CPUs; else float32)"
        },
    )
    threads: int = dataclasses.field(default=0, metadata={"help": "torch CPU threads (0 = torch's default)"})
    omp_spin_count: int = _omp_spin_count_field()
    cuda_graphs: str = dataclasses.field(
        default="auto",
        metadata={
            "help": "auto | on | off: draft block forwards at static shapes (sequences x context-rows buckets up "
            "to the window), captured as CUDA graphs at start-up on CUDA; calls outside every bucket run "
            "eagerly. auto = on for CUDA with a bounded --window, else eager (the log says why); on = "
            "required (a bounded --window, or the drafter refuses to start; on the CPU: the static buffers "
            "run without graphs)"
        },
    )
    cpu_compile: str = dataclasses.field(
        default="off",
        metadata={
            "help": "on | off: on the CPU, compile the draft block forward at static shapes ahead of time "
            "(AOTInductor), one build per context bucket of one sequence (256 rows doubling up to the "
            "window), made at start-up (a few seconds each on the demo drafter; the log's "
            "draft_cpu_compile_built line says how long); calls outside every bucket run eagerly. Needs a C++ "
            "compiler (g++) and a bounded --window"
        },
    )
    warmup_sequences: int = dataclasses.field(
        default=16,
        metadata={
            "help": "before serving, run the matmul shapes of Draft calls of up to this many sequences once "
            "(0 = none): bf16 kernels on the CPU are built per shape, inside the first steps otherwise"
        },
    )

    def validate(self) -> None:
        super().validate()
        if self.warmup_sequences < 0:
            raise ValueError(f"warmup_sequences must be >= 0, got {self.warmup_sequences}")
        _check_omp_spin_count(self.omp_spin_count)
        if self.window < -1:
            raise ValueError(f"window must be >= -1 (-1 = auto, 0 = unlimited), got {self.window}")
        if self.max_sequences < 1:
            raise ValueError(f"max_sequences must be >= 1, got {self.max_sequences}")
        if self.cuda_graphs not in ("auto", "on", "off"):
            raise ValueError(f"cuda_graphs must be auto, on or off, got {self.cuda_graphs!r}")
        if self.cuda_graphs == "on" and self.window == 0:
            raise ValueError("--cuda-graphs on needs a bounded --window (contexts are padded to it); got 0")
        if self.cpu_compile not in ("on", "off"):
            raise ValueError(f"cpu_compile must be on or off, got {self.cpu_compile!r}")
        if self.cpu_compile == "on":
            if self.device.split(":")[0] != "cpu":
                raise ValueError(f"--cpu-compile on is for --device cpu, got {self.device!r} (CUDA: --cuda-graphs)")
            if self.window == 0:
                raise ValueError("--cpu-compile on needs a bounded --window (contexts are padded to it); got 0")
            if self.cuda_graphs == "off":
                raise ValueError("--cpu-compile on compiles the static draft, which --cuda-graphs off turns off")
        if not 1 <= self.default_budget <= self.max_budget:
            raise ValueError(f"default_budget must be in [1, max_budget={self.max_budget}], got {self.default_budget}")
        _check_dtype(self.dtype, allow_auto=True)

    def resolved_window(self) -> int:
        """--window with auto (-1) resolved by device: CPU_WINDOW on the CPU, CUDA_WINDOW elsewhere."""
        if self.window != -1:
            return self.window
        return CPU_WINDOW if self.device.split(":")[0] == "cpu" else CUDA_WINDOW


@dataclasses.dataclass(frozen=True)
class VerifierConfig(ServiceConfig):
    model: str = dataclasses.field(default="", metadata={"help": "target checkpoint dir ('' = default)"})
    drafter: str = dataclasses.field(default="", metadata={"help": "drafter address host:port ('' = AR only)"})
    max_context: int = dataclasses.field(default=8192, metadata={"help": "prompt + output tokens per request"})
    max_new_tokens_limit: int = dataclasses.field(default=4096, metadata={"help": "largest max_new_tokens"})
    max_batch: int = dataclasses.field(default=16, metadata={"help": "sequences stepped together"})
    max_queue: int = dataclasses.field(
        default=256,
        metadata={
            "help": "requests admitted beyond max_batch: more than max_batch + max_queue running or "
            "waiting get RESOURCE_EXHAUSTED"
        },
    )
    kv_tokens: int = dataclasses.field(
        default=0,
        metadata={
            "help": "latent KV cache size, tokens (0 = not set: 65536 unless kv_memory_gb or kv_memory_fraction is; "
            "set at most one of the three)"
        },
    )
    kv_memory_gb: float = dataclasses.field(default=0.0, metadata={"help": "latent KV cache size, GiB (0 = not set)"})
    kv_memory_fraction: float = dataclasses.field(
        default=0.0,
        metadata={
            "help": "latent KV cache size, a fraction of the device memory free after loading the model (0 = not set)"
        },
    )
    page_size: int = dataclasses.field(
        default=1,
        metadata={
            "help": "KV slots per page (1 for DDTree: accepted nodes stay in place; > 1: copied into place at commit)"
        },
    )
    prefill_chunk: int = dataclasses.field(default=512, metadata={"help": "prefill chunk, tokens"})
    default_budget: int = dataclasses.field(default=16, metadata={"help": "tree node budget when a request sets none"})
    max_tree_tokens: int = dataclasses.field(
        default=0,
        metadata={
            "help": "tree tokens (root + nodes) verified per step over the whole batch (0 = no limit): every tree "
            "keeps its first node and the rest goes to the drafter's best-scoring nodes over the batch "
            "(an equal share, max_tree_tokens // n - 1 nodes each, when the drafter gives no scores)"
        },
    )
    tree_cut: str = dataclasses.field(
        default="cost",
        metadata={
            "help": "cost | fixed: how many of the drafter's nodes a step verifies. cost = the tree cut where a "
            "node's expected tokens per ms fall under half the step's, from the step time measured on this "
            "verifier (per row, and per row per context token) and the drafter's node probabilities "
            "calibrated to the acceptance seen: smaller trees where rows cost (long context on a slow CPU) and "
            "drafts are unsure, with the whole trees every 8th step to keep measuring; fixed = the whole tree "
            "of the request's budget. Under --max-tree-tokens either way; the tokens are the same. On the demo "
            "CPU at 4096 tokens, against fixed: code 428 vs 422 DDTree tok/s, padding 245 vs 237"
        },
    )
    grammar_tree: str = dataclasses.field(
        default="table",
        metadata={
            "help": "table | prune: the tree of a request with a grammar. table = built here from the drafter's "
            "top-K table, of grammar-valid prefixes only; prune = the drafter's own tree, grammar-invalid nodes pruned"
        },
    )
    draft_timeout_s: float = dataclasses.field(
        default=10.0, metadata={"help": "deadline of one step's drafter calls (Append chunks + Draft)"}
    )
    feature_chunk_bytes: int = dataclasses.field(
        default=4 * 1024 * 1024,
        metadata={"help": "a commit with more feature bytes goes to the drafter in chunks of at most this size"},
    )
    step_log: str = dataclasses.field(
        default="",
        metadata={"help": "step records: '' = the service log (level info), off = none, PATH = a JSON-lines file"},
    )
    attention_backend: str = dataclasses.field(
        default="auto", metadata={"help": "auto | torch | triton (auto = triton on CUDA)"}
    )
    cuda_graphs: str = dataclasses.field(
        default="auto",
        metadata={
            "help": "auto | on | off: verify / decode steps at static shapes (batch x rows x keys buckets), "
            "captured as CUDA graphs at start-up on CUDA; steps outside every bucket run eagerly. "
            "auto = on for CUDA at tp 1 when the model allows, else eager (the log says why); "
            "on = required: needs tp 1 and unquantized routed experts, at most 16 per rank, or the verifier "
            "refuses to start (on the CPU: the static buffers run without graphs)"
        },
    )
    cpu_compile: str = dataclasses.field(
        default="off",
        metadata={
            "help": "on | off: on the CPU, compile the verify / decode forward at static shapes ahead of time (AOTInductor), "
            "one build per bucket (batch 1; rows 1 and budget + 1; keys 512 doubling up to max_context, trees up to "
            "2048), made at start-up (about 13 s each on the demo target; the log's cpu_compile_built line says how long); "
            "steps outside every bucket run eagerly. Needs a C++ compiler (g++), --tp 1, and unquantized "
            "routed experts (at most 16), or the verifier refuses to start"
        },
    )
    cuda_graph_reserve_gb: float = dataclasses.field(
        default=0.0,
        metadata={
            "help": "GiB kept free for the CUDA graphs' memory pool when kv_memory_fraction sizes the KV cache "
            "(0 = estimated from the model and the buckets; logged at start-up as kv_pool graph_reserve_bytes)"
        },
    )
    prefix_cache: bool = dataclasses.field(
        default=True, metadata={"help": "reuse the KV (and drafter features) of committed prefixes across requests"}
    )
    debug_checks: bool = dataclasses.field(
        default=False, metadata={"help": "check KV accounting (free + in use == total) after every step"}
    )
    device: str = dataclasses.field(default="cpu", metadata={"help": "torch device"})
    dtype: str = dataclasses.field(default="float32", metadata={"help": "float32 | bfloat16 | float16"})
    cpu_linear_layout: str = dataclasses.field(
        default="auto",
        metadata={
            "help": "auto | row | column: how the target's linear and bf16 expert weights are stored on "
            "the CPU at --tp 1; column-major runs the few rows of a step a little faster there (auto = "
            "column on the CPU, as loaded elsewhere)"
        },
    )
    threads: int = dataclasses.field(default=0, metadata={"help": "torch CPU threads (0 = torch's default)"})
    omp_spin_count: int = _omp_spin_count_field()
    tp: int = dataclasses.field(
        default=1,
        metadata={"help": "tensor-parallel ranks (torch.distributed; spawned locally unless RANK/WORLD_SIZE are set)"},
    )
    expert_parallel: bool = dataclasses.field(
        default=False,
        metadata={"help": "with tp > 1: each rank holds 1/tp of the routed experts whole, instead of a slice of each"},
    )
    tp_timeout_s: float = dataclasses.field(
        default=60.0,
        metadata={"help": "with tp > 1: a collective waiting longer for a peer fails and the verifier exits"},
    )

    def validate(self) -> None:
        super().validate()
        for name in ("max_context", "max_new_tokens_limit", "max_batch", "prefill_chunk", "page_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {self.max_queue}")
        _check_omp_spin_count(self.omp_spin_count)
        if self.default_budget < 0:
            raise ValueError(f"default_budget must be >= 0, got {self.default_budget}")
        if self.feature_chunk_bytes < 1:
            raise ValueError(f"feature_chunk_bytes must be >= 1, got {self.feature_chunk_bytes}")
        if self.max_tree_tokens < 0:
            raise ValueError(f"max_tree_tokens must be >= 0 (0 = no limit), got {self.max_tree_tokens}")
        kv_setting(self.kv_tokens, self.kv_memory_gb, self.kv_memory_fraction)
        if self.tree_cut not in ("cost", "fixed"):
            raise ValueError(f"tree_cut must be cost or fixed, got {self.tree_cut!r}")
        if self.grammar_tree not in ("table", "prune"):
            raise ValueError(f"grammar_tree must be table or prune, got {self.grammar_tree!r}")
        if self.cpu_linear_layout not in CPU_LINEAR_LAYOUTS:
            raise ValueError(f"cpu_linear_layout must be auto, row or column, got {self.cpu_linear_layout!r}")
        if self.cuda_graphs not in ("auto", "on", "off"):
            raise ValueError(f"cuda_graphs must be auto, on or off, got {self.cuda_graphs!r}")
        if self.cuda_graphs == "on" and self.tp > 1:
            raise ValueError(
                f"--cuda-graphs on: not supported with --tp {self.tp} yet: the sharded target has no static "
                "step (use auto or off)"
            )
        if self.cpu_compile not in ("on", "off"):
            raise ValueError(f"cpu_compile must be on or off, got {self.cpu_compile!r}")
        if self.cpu_compile == "on":
            if self.device.split(":")[0] != "cpu":
                raise ValueError(f"--cpu-compile on is for --device cpu, got {self.device!r} (CUDA: --cuda-graphs)")
            if self.tp > 1:
                raise ValueError(f"--cpu-compile on: not supported with --tp {self.tp}: the sharded target has no "
                                 "static step (use off)")  # fmt: skip
            if self.cuda_graphs == "off":
                raise ValueError("--cpu-compile on compiles the static step, which --cuda-graphs off turns off")
        if not self.cuda_graph_reserve_gb >= 0:
            raise ValueError(f"cuda_graph_reserve_gb must be >= 0 (0 = estimate), got {self.cuda_graph_reserve_gb}")
        if self.tp < 1:
            raise ValueError(f"tp must be >= 1, got {self.tp}")
        if self.tp > 1 and self.page_size > 1:
            raise ValueError(
                "page_size > 1 is not supported with tp > 1: the KV copies at commit would reach rank 0's cache only"
            )
        if not self.tp_timeout_s > 0:
            raise ValueError(f"tp_timeout_s must be > 0, got {self.tp_timeout_s}")
        _check_dtype(self.dtype)


@dataclasses.dataclass(frozen=True)
class GatewayConfig(ServiceConfig):
    verifier: str = dataclasses.field(
        default="127.0.0.1:50062",
        metadata={"help": "verifier address host:port, or several comma-separated (fewest outstanding requests wins)"},
    )
    tokenizer: str = dataclasses.field(
        default="",
        metadata={"help": "dir with tokenizer.json or tiktoken.model, + tokenizer_config.json ('' = default)"},
    )
    model_id: str = dataclasses.field(default="ddtree-demo", metadata={"help": "model name reported to clients"})
    default_max_tokens: int = dataclasses.field(default=256, metadata={"help": "max_tokens when a request sets none"})
    max_prompt_chars: int = dataclasses.field(default=1_000_000, metadata={"help": "largest prompt text accepted"})
    reasoning_parser: str = dataclasses.field(default="kimi_k2", metadata={"help": "kimi_k2 | none"})
    tool_call_parser: str = dataclasses.field(default="kimi_k2", metadata={"help": "kimi_k2 | deepseek_v3 | none"})
    max_tokens_limit: int = dataclasses.field(
        default=4096, metadata={"help": "largest max_tokens a request may ask for"}
    )
    max_prompt_tokens: int = dataclasses.field(
        default=0,
        metadata={"help": "largest prompt in tokens (0 = no gateway limit; the verifier's max_context applies)"},
    )
    http_port: int = dataclasses.field(
        default=0, metadata={"help": "OpenAI-compatible HTTP port (0 = any free port, -1 = no HTTP)"}
    )
    max_body_bytes: int = dataclasses.field(
        default=8 * 1024 * 1024,
        metadata={"help": "largest HTTP request body (413 above) and gRPC request message (RESOURCE_EXHAUSTED above)"},
    )
    api_key: str = dataclasses.field(
        default="",
        metadata={
            "help": "required as 'Authorization: Bearer KEY' (HTTP) or gRPC metadata ('' = open); prefer the env var"
        },
    )
    api_key_file: str = dataclasses.field(
        default="",
        metadata={
            "help": "file of API keys, one per line: KEY, or KEY max_budget=N for a per-key tree budget cap "
            "('#' starts a comment); combined with api_key"
        },
    )
    max_budget: int = dataclasses.field(
        default=64,
        metadata={"help": "largest tree budget a request may ask for (a key's max_budget in api_key_file overrides)"},
    )
    max_streams: int = dataclasses.field(
        default=256,
        metadata={"help": "concurrent gRPC Chat / Complete streams (more: RESOURCE_EXHAUSTED at once)"},
    )
    http_metrics: str = dataclasses.field(
        default="auto",
        metadata={"help": "GET /metrics: auto (open, or behind the API key when keys are set) | open | key | off"},
    )
    health_interval_s: float = dataclasses.field(
        default=2.0, metadata={"help": "seconds between health checks of each verifier"}
    )
    allow_special_tokens_in_content: bool = dataclasses.field(
        default=False,
        metadata={
            "help": "encode special-token strings in chat messages, names, tool ids and tool declarations as "
            "special tokens (off: as plain text, so a user cannot forge turns or tool calls)"
        },
    )

    @property
    def verifiers(self) -> tuple[str, ...]:
        return tuple(a.strip() for a in self.verifier.split(",") if a.strip())

    def validate(self) -> None:
        super().validate()
        if not self.verifiers:
            raise ValueError("verifier must name at least one host:port")
        if not -1 <= self.http_port <= 65535:
            raise ValueError(f"http_port must be in [-1, 65535] (-1 = off), got {self.http_port}")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
        if self.max_prompt_tokens < 0:
            raise ValueError(f"max_prompt_tokens must be >= 0 (0 = no gateway limit), got {self.max_prompt_tokens}")
        if self.max_budget < 1:
            raise ValueError(f"max_budget must be >= 1, got {self.max_budget}")
        if self.max_streams < 1:
            raise ValueError(f"max_streams must be >= 1, got {self.max_streams}")
        if self.http_metrics not in ("auto", "open", "key", "off"):
            raise ValueError(f"http_metrics must be auto | open | key | off, got {self.http_metrics!r}")
        if not self.health_interval_s > 0:
            raise ValueError(f"health_interval_s must be > 0, got {self.health_interval_s}")
        if self.default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be >= 1, got {self.default_max_tokens}")
        if self.max_tokens_limit < self.default_max_tokens:
            raise ValueError(
                f"max_tokens_limit must be >= default_max_tokens={self.default_max_tokens}, got {self.max_tokens_limit}"
            )


def _check_omp_spin_count(spins: int) -> None:
    if spins < -1:
        raise ValueError(f"omp_spin_count must be >= -1 (-1 = libgomp's own default), got {spins}")


def _check_dtype(name: str, allow_auto: bool = False) -> None:
    names = ("auto", *DTYPE_NAMES) if allow_auto else DTYPE_NAMES
    if name not in names:
        raise ValueError(f"dtype must be {' | '.join(names)}, got {name!r}")


def env_var_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def env_var_names(cls: type[ServiceConfig]) -> list[str]:
    return [env_var_name(f.name) for f in dataclasses.fields(cls)]


def _parse_bool(raw: str) -> bool:
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"{raw!r} is not a boolean (true/false)")


def _parser_for(kind: type):
    return _parse_bool if kind is bool else kind


def add_config_flags(parser: argparse.ArgumentParser, cls: type[ServiceConfig]) -> None:
    """One flag per field; its default is left unset so config_from_flags can tell flag from env."""
    for f in dataclasses.fields(cls):
        default = f.default
        parser.add_argument(
            "--" + f.name.replace("_", "-"),
            dest=f.name,
            type=_parser_for(type(default)),
            default=None,
            help=f"{f.metadata.get('help', '')} [env {env_var_name(f.name)}, default {default!r}]",
        )


def config_from_flags(
    cls: type[SecurityConfig],
    args: argparse.Namespace | None = None,
    environ: dict[str, str] | None = None,
    **overrides: Any,
) -> SecurityConfig:
    """Flag > DDTREE_* environment > default; overrides win over all (used by `ddtree serve`)."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        kind = type(f.default)
        flag = getattr(args, f.name, None) if args is not None else None
        if f.name in overrides:
            values[f.name] = overrides[f.name]
        elif flag is not None:
            values[f.name] = flag
        elif env_var_name(f.name) in environ:
            raw = environ[env_var_name(f.name)]
            try:
                values[f.name] = _parser_for(kind)(raw)
            except ValueError:
                raise ValueError(f"{env_var_name(f.name)}={raw!r} is not a valid {kind.__name__}") from None
    config = cls(**values)
    config.validate()
    return config
