"""Log-probabilities the target reports: of the emitted tokens (OpenAI's logprobs / top_logprobs) and of
the prompt's tokens (vLLM's prompt_logprobs).

Which distribution: the target's raw one, log_softmax of the model's logits before temperature,
top_k / top_p / min_p and the min_tokens mask (vLLM's default, "raw_logprobs"). It does not depend on
the sampling settings, so a greedy and a sampled request report the same numbers for the same tokens.

Why it is lossless: the row of tree node i holds the target's logits given the prefix and the path to
i, exactly what an AR step at that position computes. An emitted token is the target's choice at the
accepted node before it (the root for the first, the last accepted node for the bonus), so its logprob
is read from that node's row: the same distribution AR decoding reports, up to the float rounding of a
different batch shape.

Prompt logprobs: a prefill chunk of a request that asks for them computes the LM head on every row;
row p (prompt position p) scores the prompt token at p + 1, so position 0 has no entry and the prompt's
last row scores nothing (it gives the first output token). Each chunk keeps only k + 1 numbers per row
(the prompt token's logprob and rank, the top k) and drops its logits: no [prompt, vocab] tensor is
ever held. The rows reach the client before the first token, in messages of at most
PROMPT_LOGPROBS_PER_MESSAGE positions.
"""

from __future__ import annotations

import dataclasses
from collections import abc

import torch

from ddtree.protocol.ddtree.v1 import common_pb2

PROMPT_LOGPROBS_PER_MESSAGE = 1024  # positions per stream message: at most ~1024 * 21 * 10 bytes
ROW_BLOCK = 256  # rows per log_softmax: the transient fp32 copy is [ROW_BLOCK, V], not [chunk, V]


def _top(lp: torch.Tensor, top: int) -> list[tuple[list[int], list[float]]]:
    """lp [k, V] -> per row the `top` most likely ids and their logprobs, most likely first (ties: lower
    id first). topk is O(V) per row: no full sort."""
    values, order = lp.topk(min(top, lp.shape[-1]), dim=-1)  # [k, top]
    out = []
    for ids_row, vals_row in zip(order.tolist(), values.tolist()):
        pairs = sorted(zip(ids_row, vals_row), key=lambda p: (-p[1], p[0]))
        out.append(([p[0] for p in pairs], [p[1] for p in pairs]))
    return out


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
    return [(c, ids_row, vals_row) for c, (ids_row, vals_row) in zip(chosen, _top(lp, top))]


@dataclasses.dataclass(frozen=True)
class PromptRows:
    """The prompt logprobs of one prefill chunk: positions start, start + 1, ... (each entry's token is
    the prompt token there)."""

    start: int
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    ranks: tuple[int, ...]  # the tokens at least as likely, itself included (vLLM's rank; 1 = most likely)
    top: tuple[tuple[list[int], list[float]], ...]  # per entry the k most likely ids and their logprobs

    def __len__(self) -> int:
        return len(self.token_ids)


def prompt_logprobs(logits: torch.Tensor, prompt: abc.Sequence[int], start: int, top: int) -> PromptRows | None:
    """logits [R, V] of prompt positions start .. start + R - 1 -> the entries of positions start + 1 ..
    (row r scores prompt[start + r + 1]); None when the rows score no prompt token (a one-row last chunk)."""
    n = min(logits.shape[0], len(prompt) - 1 - start)
    if n <= 0:
        return None
    targets = list(prompt[start + 1 : start + 1 + n])
    chosen: list[float] = []
    ranks: list[int] = []
    tops: list[tuple[list[int], list[float]]] = []
    for b in range(0, n, ROW_BLOCK):
        lp = torch.log_softmax(logits[b : min(b + ROW_BLOCK, n)].float(), dim=-1)  # [rows, V]
        ids = torch.tensor(targets[b : b + lp.shape[0]], dtype=torch.int64, device=lp.device)
        own = lp.gather(1, ids.unsqueeze(1))  # [rows, 1]
        chosen += own.squeeze(1).tolist()
        ranks += (lp >= own).sum(dim=-1).tolist()  # vLLM's batched_count_greater_than
        tops += _top(lp, top) if top > 0 else [([], [])] * lp.shape[0]
    return PromptRows(start + 1, tuple(targets), tuple(chosen), tuple(ranks), tuple(tops))


def prompt_logprobs_messages(rows: PromptRows, per_message: int = PROMPT_LOGPROBS_PER_MESSAGE):
    """The entries as common_pb2.PromptLogprobs messages of at most `per_message` positions, in order."""
    for a in range(0, len(rows), per_message):
        b = min(a + per_message, len(rows))
        yield common_pb2.PromptLogprobs(
            start=rows.start + a,
            token_ids=rows.token_ids[a:b],
            logprobs=[
                common_pb2.TokenLogprobs(logprob=lp, top_ids=ids, top_logprobs=lps)
                for lp, (ids, lps) in zip(rows.logprobs[a:b], rows.top[a:b])
            ],
            ranks=rows.ranks[a:b],
        )
