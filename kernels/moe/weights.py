"""One MoE projection stacked over a rank's local experts, in its checkpoint's packed format.

The contract between the packed model modules (`ddtree.models.deepseek_v3.moe`), the fused MoE kernel
(`moe/fused.py`, Triton), the CPU grouped path and the torch reference (`moe/reference.py`):

    kind "bf16": weight bf16/fp16/fp32 [E, N, K]
    kind "int4": weight int32 [E, N, ceil(K/8)]  (compressed-tensors pack-quantized, nibble = value + 8;
                 `paired`: the words in quant_formats' pair order, as the device path keeps them)
                 scale  bf16/fp32 [E, N, ceil(K/group)]
    kind "fp8":  weight float8_e4m3fn [E, N, K]
                 scale  fp32 [E, ceil(N/128), ceil(K/128)]  (`weight_scale_inv`, multiplied in)

E = local experts (the rank's experts in ascending global id; `expert_map` maps global ids to local
slots, -1 = held by another rank), N = output features, K = input features. W_e[n, k] is dequantized
as quant_formats.py says; what a kind means is its format object
(weight_formats.py, `ExpertWeights.fmt`). A MoE layer has three: gate [E, I, d], up [E, I, d], down [E, d, I].
Only validation lives here; this module imports no triton.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from ddtree.kernels.quant_formats import unpair_int4_words
from ddtree.kernels.weight_formats import FLOAT_DTYPES as FLOAT_DTYPES  # what fused_moe and the tests import from here
from ddtree.kernels.weight_formats import FORMATS, WeightFormat, weight_format

KINDS = tuple(FORMATS)


@dataclasses.dataclass(frozen=True)
class ExpertWeights:
    kind: str
    weight: torch.Tensor
    out_features: int  # N
    in_features: int  # K
    scale: torch.Tensor | None = None
    group_size: int = 0  # int4 only
    block: tuple[int, int] = (128, 128)  # fp8 only: (rows, cols) of a scale block
    paired: bool = False  # int4 only: words in pair order (quant_formats.pair_int4_words)

    def __post_init__(self):
        self.validate()

    @property
    def num_experts(self) -> int:
        return self.weight.shape[0]

    @property
    def fmt(self) -> WeightFormat:
        return weight_format(self.kind)

    def validate(self) -> None:
        """ValueError naming what is wrong; the shapes must be exactly the contract's."""
        if self.kind not in FORMATS:
            raise ValueError(f"expert weights: kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.weight.dim() != 3:
            raise ValueError(
                f"expert weights ({self.kind}): weight must be [E, N, K'], got shape {list(self.weight.shape)}"
            )
        self.fmt.check(self.weight, self.scale, self.out_features, self.in_features, self.group_size, self.block)
        if self.paired and self.kind != "int4":
            raise ValueError(f"expert weights ({self.kind}): only int4 words have a pair order")

    def dequantize(self, expert: int) -> torch.Tensor:
        """fp32 [N, K] of one local expert (the reference's and the CPU path's view of the weights)."""
        return self.dequantize_slices(self.weight[expert], None if self.scale is None else self.scale[expert])

    def dequantize_slices(self, weight: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        """fp32 [..., N, K] of slices of `weight` / `scale` taken along the experts (or one expert's)."""
        if self.paired:
            weight = unpair_int4_words(weight)
        return self.fmt.dequantize(weight, scale, self.in_features, self.group_size, self.block)

    def nbytes(self) -> int:
        return self.weight.nbytes + (0 if self.scale is None else self.scale.nbytes)


def routing_value_checks() -> bool:
    """Whether routing values are checked on the host (a sync per MoE call): off unless the environment
    sets DDTREE_CHECK_ROUTING=1 (debugging). Off, the kernels guard instead: an id outside
    [0, E_global) or a map value outside [-1, E_local) routes its pair nowhere (dropped, as another rank's)."""
    return os.environ.get("DDTREE_CHECK_ROUTING", "") not in ("", "0")


def check_routing(
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    rows: int,
    num_global_experts: int,
    expert_map,
    num_local_experts: int | None = None,
    values: bool | None = None,
) -> None:
    """The routing inputs of a fused MoE call: ids int [M, k], weights float [M, k], expert_map None (all
    experts local) or int [E_global]. Shapes and dtypes always; with `values` (None: routing_value_checks())
    also ids in [0, E_global) and, given num_local_experts, map values in [-1, E_local): those read the
    tensors back to the host, so the forward leaves them to the kernels' guard."""
    if topk_ids.dim() != 2 or topk_ids.shape[0] != rows:
        raise ValueError(f"fused moe: topk_ids must be [{rows}, k], got {list(topk_ids.shape)}")
    if topk_weights.shape != topk_ids.shape:
        raise ValueError(f"fused moe: topk_weights {list(topk_weights.shape)} != topk_ids {list(topk_ids.shape)}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"fused moe: topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if expert_map is not None and (expert_map.dim() != 1 or expert_map.shape[0] != num_global_experts):
        raise ValueError(f"fused moe: expert_map must be [{num_global_experts}], got {list(expert_map.shape)}")
    if not (routing_value_checks() if values is None else values):
        return
    if topk_ids.numel() and (int(topk_ids.min()) < 0 or int(topk_ids.max()) >= num_global_experts):
        raise ValueError(
            f"fused moe: expert ids must be in [0, {num_global_experts}), got {int(topk_ids.min())}..{int(topk_ids.max())}"
        )
    if expert_map is not None and num_local_experts is not None and expert_map.numel():
        lo, hi = int(expert_map.min()), int(expert_map.max())
        if lo < -1 or hi >= num_local_experts:
            raise ValueError(f"fused moe: expert_map values must be in [-1, {num_local_experts}), got {lo}..{hi}")


def local_slots(topk_ids: torch.Tensor, num_local_experts: int, expert_map: torch.Tensor | None) -> torch.Tensor:
    """int64 [M·k]: the local slot of each (token, slot) pair, -1 where it is another rank's or where the id
    (or its map value) is out of range: the range guard, on the device, of every MoE path."""
    ids = topk_ids.reshape(-1).long()
    if expert_map is None:
        return torch.where((ids >= 0) & (ids < num_local_experts), ids, -1)
    E_global = expert_map.shape[0]
    local = expert_map.long()[ids.clamp(0, E_global - 1)]
    ok = (ids >= 0) & (ids < E_global) & (local >= 0) & (local < num_local_experts)
    return torch.where(ok, local, -1)
