"""Per-token log-probabilities of the emitted tokens (OpenAI's logprobs / top_logprobs).

Which distribution: the target's raw one, log_softmax of the model's logits before temperature,
top_k / top_p / min_p and the min_tokens mask (vLLM's default, "raw_logprobs"). It does not depend on
the sampling settings, so a greedy and a sampled request report the same numbers for the same tokens.

Why it is lossless: the row of tree node i holds the target's logits given the prefix and the path to
i, exactly what an AR step at that position computes. An emitted token is the target's choice at the
accepted node before it (the root for the first, the last accepted node for the bonus), so its logprob
is read from that node's row: the same distribution AR decoding reports, up to the float rounding of a
different batch shape.
"""

from __future__ import annotations

from collections import abc

import torch


def token_logprobs(
    logits: torch.Tensor, rows: abc.Sequence[int], tokens: abc.Sequence[int], top: int
) -> list[tuple[float, list[int], list[float]]]:
    """logits fp32 [N, V]; token tokens[k] was chosen from row rows[k] -> per token (its logprob,
    the `top` most likely ids, their logprobs), most likely first."""
    if len(rows) != len(tokens):
        raise ValueError(f"{len(rows)} rows but {len(tokens)} tokens")
    if not rows:
        return []
    r = torch.tensor(list(rows), dtype=torch.int64, device=logits.device)
    lp = torch.log_softmax(logits.index_select(0, r).float(), dim=-1)  # [k, V]
    ids = torch.tensor(list(tokens), dtype=torch.int64, device=logits.device)
    chosen = lp.gather(1, ids.unsqueeze(1)).squeeze(1).tolist()  # [k]
    if top <= 0:
        return [(c, [], []) for c in chosen]
    values, order = lp.topk(min(top, lp.shape[-1]), dim=-1)  # [k, top]: O(V) per row, no full sort
    out = []
    for c, ids_row, vals_row in zip(chosen, order.tolist(), values.tolist()):
        pairs = sorted(zip(ids_row, vals_row), key=lambda p: (-p[1], p[0]))  # ties: lower id first
        out.append((c, [p[0] for p in pairs], [p[1] for p in pairs]))
    return out
