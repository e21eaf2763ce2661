"""Shared memory per thread block: the budget of each architecture, the estimate of a kernel config's use, and
the launch that shrinks a config on OutOfResources (the fused MoE's and the MLA kernels' one copy).

Budgets (bytes one block may use, the opt-in maximum; CUDA programming guide, compute capabilities):

    sm_90  (H100, H200)                         227 KiB  (228 KiB per SM)
    sm_100 (B200)                               227 KiB
    sm_120 (RTX PRO 6000 Blackwell, RTX 50xx)    99 KiB  (100 KiB per SM)

The estimate is what Triton 3.9 allocates, read off compiled kernels (`metadata.shared` of an AOT compile
for sm_90 and sm_120, the same on both; tests/deploy/test_kernel_shared_memory.py compiles them again): a
loop that feeds tl.dot keeps the tiles it loads, as loaded (packed INT4 words, e4m3 bytes, bf16), in
num_stages - 1 buffers (one when num_stages is 1), and a tile converted before the dot (an INT4 weight
dequantized, an fp32 copy) once more, at the dot's width:

    smem = buffers x sum(loop tiles: rows x cols x bytes) + sum(converted tiles: rows x cols x bytes)

e.g. a bf16 GEMM's  buffers x (BLOCK_M x BLOCK_K + BLOCK_K x BLOCK_N) x 2, where buffers is num_stages for
a tile of 64 rows or more (on sm_90 those dots are wgmma, whose pipeline keeps every stage in shared memory)
and max(1, num_stages - 1) below (mma.sync, every architecture): exact on sm_90, an upper bound by one
stage on sm_100 / sm_120 at 64 rows and more. The MLA split
kernel has its own (mla.plan.mla_smem_bytes). The estimate picks a config before the first launch;
OutOfResources at launch, the device's own answer, still shrinks it further (launch_with_fallback).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import TypeVar

import torch

try:
    from triton.runtime.errors import OutOfResources
except ImportError:  # where older Triton releases define it
    from triton.runtime.autotuner import OutOfResources

KIB = 1024
SMEM_PER_BLOCK = {"sm_90": 227 * KIB, "sm_100": 227 * KIB, "sm_120": 99 * KIB}
TRITON_DEFAULT_STAGES = 3  # what a launch without num_stages gets on NVIDIA GPUs

Config = TypeVar("Config")
Tile = tuple[int, int, float]  # rows, cols, element bytes


WGMMA_ROWS = 64  # sm_90 runs a dot of this many rows or more as wgmma


def dot_smem_bytes(
    num_stages: int, block_m: int, loop_tiles: Iterable[Tile], converted_tiles: Iterable[Tile] = ()
) -> int:
    """The module docstring's estimate for a dot of block_m rows."""
    buffers = num_stages if block_m >= WGMMA_ROWS else max(1, num_stages - 1)
    return int(buffers * sum(r * c * b for r, c, b in loop_tiles) + sum(r * c * b for r, c, b in converted_tiles))


def arch_of(major: int, minor: int) -> str:
    return f"sm_{major}{minor}"


def device_smem_budget(device: torch.device | str | None) -> int | None:
    """Bytes of shared memory one block may use on `device`; None off CUDA (the interpreter has no limit)."""
    if device is None or torch.device(device).type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    optin = getattr(props, "shared_memory_per_block_optin", 0)
    return optin or SMEM_PER_BLOCK.get(arch_of(props.major, props.minor), 48 * KIB)


def stages_within(budget: int | None, smem: Callable[[int], int], most: int = TRITON_DEFAULT_STAGES) -> int:
    """The most pipeline stages (at most `most`, at least 1) whose smem(stages) fits `budget` (None: `most`)."""
    if budget is None:
        return most
    return next((s for s in range(most, 1, -1) if smem(s) <= budget), 1)


def fit_config(
    cfg: Config, smaller: Callable[[Config], Iterator[Config]], smem: Callable[[Config], int], budget: int | None
) -> Config:
    """cfg, or the first of smaller(cfg) whose estimate fits `budget` (the smallest when none does)."""
    if budget is None:
        return cfg
    c = cfg
    for c in itertools.chain((cfg,), smaller(cfg)):
        if smem(c) <= budget:
            return c
    return c


def launch_with_fallback(
    launch: Callable[[Config], None],
    cfg: Config,
    cache: dict,
    key: Hashable,
    smaller: Callable[[Config], Iterator[Config]],
    describe: Callable[[Config], str],
    kernel: str,
) -> Config:
    """launch(cfg), or while that raises OutOfResources, launch(c) for each c of smaller(cfg) in turn;
    cache[key] keeps the config that launched, where later calls with the key start. Returns that config;
    when none fits, raises the last OutOfResources again, naming the configs tried."""
    start = cache.get(key, cfg)
    tried = []
    for c in itertools.chain((start,), smaller(start)):
        try:
            launch(c)
        except OutOfResources as e:
            tried.append(c)
            error = e
            continue
        cache[key] = c
        return c
    names = ", ".join(describe(c) for c in tried)
    raise OutOfResources(error.required, error.limit, f"{error.name} ({kernel} tried {names})") from error
