"""The verifier's latent KV cache: its size (one of three settings), its pages, and prefix reuse."""

from __future__ import annotations

import dataclasses

from .flags import ConfigBase, option


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
class KvFields(ConfigBase):
    flag_group = "KV cache"

    kv_tokens: int = option(
        0,
        "latent KV cache size in tokens (0 = not set: 65536 unless --kv-memory-gb or --kv-memory-fraction is; "
        "set at most one of the three)",
    )
    kv_memory_gb: float = option(0.0, "latent KV cache size in GiB (0 = not set)")
    kv_memory_fraction: float = option(
        0.0, "latent KV cache size as a fraction of the device memory free once the model is loaded (0 = not set)"
    )
    page_size: int = option(
        1,
        "KV slots per page: 1 for DDTree, where accepted nodes stay in place; above 1, they are copied into "
        "place at commit",
        at_least=1,
    )
    prefix_cache: bool = option(True, "reuse the KV cache (and the drafter's features) of committed prefixes")
    prefix_feature_mb: float = option(
        256.0,
        "host memory for the drafter features of cached prefixes, MiB: past it the least recently used edges "
        "drop theirs (a speculative request on such a prefix prefills it again); they would otherwise grow "
        "with the KV pool (a token's features can outweigh its KV)",
        at_least=0,
    )
    debug_checks: bool = option(False, "check the KV accounting (free + in use == total) after every step")

    def validate(self) -> None:
        super().validate()
        kv_setting(self.kv_tokens, self.kv_memory_gb, self.kv_memory_fraction)
