"""Which keys a DFlash draft block's queries see: one rule for the eager, static and training forwards.

A block is B consecutive positions q_0 .. q_{B-1} (slot 0 holds the root); its keys are the context (the
committed tokens it attends to, positions before q_0) and the block's own B slots. Slot i sees

    context key at position k   iff  window == 0  or  q_i - k < window
    block slot j                 iff  (not causal  or  j <= i)  and  (window == 0  or  |i - j| < window)

where `causal` is the config's causal_head (JetSpec: slot i sees slots <= i; DFlash: all B) and `window`
the layer's sliding window (dflash_config.DFlashConfig.layer_window; 0 = full attention). Slot i always
sees itself, so no query row is empty. The serving window (how many committed tokens the drafter keeps)
is applied by the callers on top of this: it decides which context rows exist at all.
"""

from __future__ import annotations

import torch
from torch import Tensor


def needs_mask(causal: bool, window: int) -> bool:
    """Whether the rule hides anything: a bidirectional block over a full-attention layer sees every key."""
    return causal or window > 0


def block_mask(q_pos: Tensor, ctx_pos: Tensor, causal: bool, window: int) -> Tensor:
    """bool [..., B, C + B], True = visible: slot i's view of [context ; block].

    q_pos int64 [..., B]: the block's positions (consecutive), ctx_pos int64 [..., C]: the context keys'
    positions (any; rows the caller hides are its own business). Leading dims broadcast.
    """
    b = q_pos.shape[-1]
    ctx = torch.ones(*q_pos.shape, ctx_pos.shape[-1], dtype=torch.bool, device=q_pos.device)
    if window > 0:
        ctx = ctx & (q_pos[..., :, None] - ctx_pos[..., None, :] < window)
    i = torch.arange(b, device=q_pos.device)
    own = torch.ones(b, b, dtype=torch.bool, device=q_pos.device)
    if causal:
        own = i[None, :] <= i[:, None]
    if window > 0:
        own = own & ((i[:, None] - i[None, :]).abs() < window)
    return torch.cat([ctx, own.expand(*q_pos.shape, b)], dim=-1)
