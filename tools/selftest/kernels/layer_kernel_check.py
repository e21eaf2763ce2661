"""The decoder layer's small kernels in part (a) of `ddtree selftest gpu`, against kernels/layer_reference.py
and the position RoPE, timed: the router (scores, correction bias, grouped top-k, renormalised and scaled
weights in one kernel whose programs split the experts and meet through a ticket counter, an ordering the
interpreter, running programs one after another, never exercises), the fused residual add + RMSNorm, SiLU-
and-mul, and the queries' RoPE.

A router row is ok when every row's experts are the reference's and the weights agree, except rows where a
cut of the routing (the kept groups', the k-th expert's) is within ROUTER_TIE of a tie in the fp32
reference: there the kernel's summation order may pick either side, as two exact implementations would
(counted in the row's detail).

`layer_kernel_cases(dry_run, device, measure, row, compare)` returns rows in kernel_check's format.
"""

from __future__ import annotations

import torch

from ddtree.kernels.layer_reference import add_rms_norm_ref, route_ref, silu_and_mul_ref

ROUTER_TIE = 1e-4
# (name, experts, groups, kept groups, top-k, routed scaling): Kimi K2.6 and DeepSeek-V3's routers
ROUTERS = (("kimi", 384, 1, 1, 8, 2.827), ("deepseek-v3", 256, 8, 4, 8, 2.5))
DRY_ROUTERS = (("grouped", 16, 4, 2, 4, 2.5), ("flat", 24, 1, 1, 3, 1.0))


def _rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved pairs (x[2i], x[2i+1]) rotated by the position's angle, in fp32, back to x's dtype."""
    a, b = x.float()[..., 0::2], x.float()[..., 1::2]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.stack((a * c - b * s, b * c + a * s), dim=-1).flatten(-2).to(x.dtype)


def _decision_margin(choice: torch.Tensor, groups: int, kept: int, k: int) -> torch.Tensor:
    """Per row, how far the routing's two cuts are from a tie (fp32): the kept groups' last against the
    first dropped one (their top-2 sums), and the k-th chosen expert against the (k+1)-th left in them."""
    N, E = choice.shape
    grouped = choice.view(N, groups, E // groups)
    margin = torch.full((N,), float("inf"), device=choice.device)
    if kept < groups:
        group_top = grouped.topk(2, dim=-1).values.sum(-1).topk(kept + 1, dim=-1).values
        margin = group_top[:, kept - 1] - group_top[:, kept]
        keep = grouped.topk(2, dim=-1).values.sum(-1).topk(kept, dim=-1).indices
        mask = torch.zeros(N, groups, dtype=torch.bool, device=choice.device).scatter_(1, keep, True)
        choice = grouped.masked_fill(~mask[:, :, None], float("-inf")).view(N, E)
    top = choice.topk(k + 1, dim=-1).values
    return torch.minimum(margin, (top[:, k - 1] - top[:, k]).nan_to_num(posinf=float("inf")))


def router_case(name, E, groups, kept, k, scaling, N, d, device, measure, row, compare) -> dict:
    from ddtree.kernels.moe.router import route

    gen = torch.Generator().manual_seed(E * 7 + N)
    x = torch.randn(N, d, generator=gen).to(device, torch.bfloat16)
    w = (torch.randn(E, d, generator=gen) / d**0.5).to(device, torch.bfloat16)
    bias = (0.05 * torch.randn(E, generator=gen)).to(device)
    args = (k, groups, kept, True, scaling)
    weights, ids = route(x, w, bias, *args)
    ref_w, ref_ids = route_ref(x, w, bias, *args)
    clear = (
        _decision_margin(torch.nn.functional.linear(x.float(), w.float()).sigmoid() + bias, groups, kept, k)
        > ROUTER_TIE
    )
    got_ids, order = ids.sort(dim=-1)
    want_ids, want_order = ref_ids.sort(dim=-1)
    same = (got_ids == want_ids).all(dim=-1)
    bad = int((~same & clear).sum())
    ok, detail = compare(f"router {name} N{N}", weights.gather(1, order)[same], ref_w.gather(1, want_order)[same])
    ok = ok and bad == 0
    detail = f"{bad} rows chose other experts; {int((~clear).sum())} near-ties exempt. {detail}".strip()
    t = measure(lambda: route(x, w, bias, *args))
    t_ref = measure(lambda: route_ref(x, w, bias, *args))
    shape = f"{name} N={N} E={E} d={d} top{k} groups {kept}/{groups}"
    return row("layer", "router", shape, t * 1e6, t_ref * 1e6, (N + E) * d * 2, ok, detail)


def norm_case(N, d, device, measure, row, compare) -> dict:
    from ddtree.kernels.rmsnorm import add_rms_norm

    gen = torch.Generator().manual_seed(N + d)
    x, res = (torch.randn(N, d, generator=gen).to(device, torch.bfloat16) for _ in range(2))
    weight = (1 + 0.1 * torch.randn(d, generator=gen)).to(device, torch.bfloat16)
    got, got_sum = add_rms_norm(x, res, weight, 1e-6)
    want, want_sum = add_rms_norm_ref(x, res, weight, 1e-6)
    ok, detail = compare(f"add rms norm N{N} d{d}", got, want)
    ok_sum, detail_sum = compare(f"add rms norm sum N{N} d{d}", got_sum, want_sum)
    t = measure(lambda: add_rms_norm(x, res, weight, 1e-6))
    t_ref = measure(lambda: add_rms_norm_ref(x, res, weight, 1e-6))
    return row("layer", "add rms norm", f"N={N} d={d} bf16", t * 1e6, t_ref * 1e6, 4 * N * d * 2, ok and ok_sum,
               detail or detail_sum)  # fmt: skip


def silu_case(N, inter, device, measure, row, compare) -> dict:
    from ddtree.kernels.activation import silu_and_mul

    gate_up = torch.randn(N, 2 * inter, generator=torch.Generator().manual_seed(N)).to(device, torch.bfloat16)
    ok, detail = compare(f"silu mul N{N}", silu_and_mul(gate_up), silu_and_mul_ref(gate_up))
    t = measure(lambda: silu_and_mul(gate_up))
    t_ref = measure(lambda: silu_and_mul_ref(gate_up))
    return row("layer", "silu and mul", f"N={N} I={inter} bf16", t * 1e6, t_ref * 1e6, 3 * N * inter * 2, ok, detail)


def rope_case(T, H, dr, device, measure, row, compare) -> dict:
    from ddtree.kernels.rope import rope_q

    gen = torch.Generator().manual_seed(T * H)
    x = torch.randn(T, H, dr, generator=gen).to(device, torch.bfloat16)
    angle = torch.rand(T, dr // 2, generator=gen) * 1000.0
    cos, sin = angle.cos().to(device), angle.sin().to(device)
    ok, detail = compare(f"rope q T{T}", rope_q(x, cos, sin), _rope_ref(x, cos, sin))
    t = measure(lambda: rope_q(x, cos, sin))
    t_ref = measure(lambda: _rope_ref(x, cos, sin))
    return row("layer", "rope q", f"T={T} H={H} dr={dr} bf16", t * 1e6, t_ref * 1e6, 2 * T * H * dr * 2, ok, detail)


def layer_kernel_cases(dry_run: bool, device, measure, row, compare) -> list[dict]:
    """Rows at the Kimi K2.6 TP-8 rank's shapes (hidden 7168, 8 local heads, the shared expert's 256
    columns) for AR, a 17-row tree and a 512-token chunk; tiny ones in the dry run."""
    d, heads, inter, ns = (64, 2, 32, (1, 5)) if dry_run else (7168, 8, 256, (1, 17, 512))
    rows = [router_case(*r, n, d, device, measure, row, compare) for r in (DRY_ROUTERS if dry_run else ROUTERS)
            for n in ns]  # fmt: skip
    rows += [norm_case(n, d, device, measure, row, compare) for n in ns]
    rows += [silu_case(n, inter, device, measure, row, compare) for n in ns]
    rows += [rope_case(n, heads, 16 if dry_run else 64, device, measure, row, compare) for n in ns]
    return rows
