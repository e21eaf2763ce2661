"""The gateway's config: its verifiers, tokenizer, public HTTP and gRPC limits, and API keys."""

from __future__ import annotations

import dataclasses
from typing import Literal

from .flags import option
from .service import ServiceConfig


@dataclasses.dataclass(frozen=True)
class GatewayConfig(ServiceConfig):
    flag_group = "gateway"

    verifier: str = option(
        "127.0.0.1:50062",
        "verifier address host:port, or several comma-separated (a request goes to the one with the fewest "
        "outstanding)",
    )
    tokenizer: str = option(
        "", "dir with tokenizer.json or tiktoken.model, and tokenizer_config.json ('' = the default checkpoint's)"
    )
    model_id: str = option("ddtree-demo", "model name reported to clients")
    # The cap on max_tokens is the verifier's --max-new-tokens-limit, which the gateway asks it (GetInfo).
    default_max_tokens: int = option(256, "max_tokens of a request that sets none", at_least=1)
    max_prompt_chars: int = option(1_000_000, "largest prompt text accepted, in characters")
    reasoning_parser: str = option("kimi_k2", "parser of the reasoning in the output: kimi_k2 or none")
    tool_call_parser: str = option("kimi_k2", "parser of the tool calls in the output: kimi_k2, deepseek_v3 or none")
    max_prompt_tokens: int = option(
        0, "largest prompt in tokens (0 = no gateway limit; the verifier's max_context applies)", at_least=0
    )
    http_port: int = option(
        0, "OpenAI-compatible HTTP port (0 = any free port, -1 = no HTTP)", at_least=-1, at_most=65535
    )
    max_body_bytes: int = option(
        8 * 1024 * 1024,
        "largest HTTP request body (413 above) and gRPC request message (RESOURCE_EXHAUSTED above)",
        at_least=1,
    )
    api_key: str = option(
        "",
        "required as 'Authorization: Bearer KEY' (HTTP) or gRPC metadata ('' = open); prefer the DDTREE_API_KEY variable",
    )
    api_key_file: str = option(
        "",
        "file of API keys, one per line: KEY, or KEY max_budget=N for a per-key tree budget cap ('#' starts a "
        "comment); combined with --api-key",
    )
    max_budget: int = option(
        64, "largest tree budget a request may ask for (a key's max_budget in --api-key-file overrides)", at_least=1
    )
    max_streams: int = option(
        256, "concurrent gRPC Chat / Complete streams (more get RESOURCE_EXHAUSTED at once)", at_least=1
    )
    http_metrics: Literal["auto", "open", "key", "off"] = option(
        "auto", "GET /metrics: open, behind the API key, or off (auto = behind the key when keys are set, else open)"
    )
    health_interval_s: float = option(2.0, "seconds between health checks of each verifier", above=0)
    allow_special_tokens_in_content: bool = option(
        False,
        "encode special-token strings in chat messages, names, tool ids and tool declarations as special tokens "
        "(off: as plain text, so that a user cannot forge turns or tool calls)",
    )

    @property
    def verifiers(self) -> tuple[str, ...]:
        return tuple(a.strip() for a in self.verifier.split(",") if a.strip())

    def validate(self) -> None:
        super().validate()
        if not self.verifiers:
            raise ValueError("verifier must name at least one host:port")
