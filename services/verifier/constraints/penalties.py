"""Penalties and logit masks on every row of a tree, as vLLM's sampler applies them to one sequence.

Each row's choice is the next token after its own context: the committed output (Sequence.generated,
whose last token is the root) followed by the tokens of the row's tree path (node i's path = the nodes
from depth 1 down to i itself; the root row's path is empty). So each row is adjusted with the counts of
the output plus its path, and AR decoding with the same parameters adjusts its one row with the counts of
exactly the same tokens: the target's choice at every node is the penalised AR choice, the accept walk
commits only such choices, and DDTree stays token-identical to penalised AR at temperature 0 and exact in
distribution above it (sampling.py's argument, with the adjusted logits as the target's).

Conventions (vLLM v1, `Sampler.apply_logits_processors` then `apply_penalties`), in this order:
1. allowed_token_ids: every other token's logit is -inf.
2. bad_words: a word's last token is -inf where the word's other tokens end the row's output + path (a
   one-token word is always banned). Only output tokens count, never the prompt.
3. (min_tokens' stop mask: sampling.mask_stop_tokens, before this module.)
4. logit_bias: added.
5. repetition_penalty r, for tokens in the prompt or in output + path: logit / r where logit > 0, else
   logit * r (vLLM's kernel divides; it does not multiply by 1/r).
6. frequency_penalty f and presence_penalty p, from output + path counts c only:
   logit - f * c, then - p * (c > 0).
-inf stays -inf through 4-6. Temperature and the filters come after (sampling.sampling_probs).

Sizes: the [rows, V] count matrix is never built. The output's counts [V] apply to every row by
broadcast, and the path's tokens (at most depth entries per row) are corrected by a gather and a scatter
that redo step 5-6 with count + path count at those (row, token) entries only: the same elementwise
function of the same values, so the result equals the dense one bit for bit.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ddtree.contract.sampling_params import SamplingConfig
from ddtree.contract.token_tree import TokenTree


class PenaltyCounts:
    """A sequence's token counts for penalties: the output's counts [V] (fp32, exact integers) and the
    prompt's presence [V] (bool), plus the request's static bias [V] and allowed mask [V], on the device
    the logits live on. Built from the tokens on first use per device (a cache, as Sequence.generator);
    apply.py adds every token appended to Sequence.generated (`add`), so they always count it exactly."""

    def __init__(self, cfg: SamplingConfig, prompt: tuple[int, ...]):
        self.cfg = cfg
        self.prompt = prompt
        self._by_device: dict[str, dict[str, Tensor]] = {}

    def tensors(self, generated: list[int], device: torch.device, vocab: int) -> dict[str, Tensor]:
        key = str(device)
        if key not in self._by_device:
            cfg = self.cfg
            out = {"counts": _bincount(generated, vocab, device)}
            if cfg.penalizes:
                out["prompt"] = _bincount(self.prompt, vocab, device) > 0
            if cfg.logit_bias:
                bias = torch.zeros(vocab, dtype=torch.float32)
                ids, values = zip(*cfg.logit_bias, strict=True)
                bias[list(ids)] = torch.tensor(values, dtype=torch.float32)
                out["bias"] = bias.to(device)
            if cfg.allowed_token_ids:
                banned = torch.ones(vocab, dtype=torch.bool)
                banned[list(cfg.allowed_token_ids)] = False
                out["banned"] = banned.to(device)
            self._by_device[key] = out
        return self._by_device[key]

    def add(self, tokens: list[int]) -> None:
        """Count newly generated tokens (apply.py, as they join Sequence.generated)."""
        if not tokens:
            return
        for t in self._by_device.values():
            counts = t["counts"]
            ids = torch.tensor(tokens, dtype=torch.int64, device=counts.device)
            counts.index_add_(0, ids, torch.ones(len(tokens), dtype=counts.dtype, device=counts.device))


def _bincount(tokens, vocab: int, device: torch.device) -> Tensor:
    ids = torch.tensor(list(tokens), dtype=torch.int64)
    return torch.bincount(ids, minlength=vocab).to(torch.float32).to(device)


def path_entries(tree: TokenTree | None, vocab: int) -> tuple[Tensor, Tensor, Tensor]:
    """The tree paths' (row, token, count) entries, distinct (row, token) pairs: row i's path holds the
    tokens of node i and its ancestors but the root (already in the output). Empty for no tree (a first
    token's single row) or the empty tree. int64 [K] each, CPU."""
    if tree is None or tree.n == 0:
        empty = torch.zeros(0, dtype=torch.int64)
        return empty, empty, empty
    parent = torch.tensor((0, *tree.parents), dtype=torch.int64)  # [T]; the root is its own parent
    token = torch.tensor((-1, *tree.token_ids), dtype=torch.int64)  # [T]; the root's is never read
    rows = torch.arange(tree.n + 1)
    node, keys = rows, []
    for _ in range(tree.max_depth):
        on_path = node > 0  # [T]: this ancestor is a node, not the root
        keys.append((rows * vocab + token[node])[on_path])
        node = parent[node]
    unique, counts = torch.unique(torch.cat(keys), return_counts=True)
    return unique // vocab, unique % vocab, counts


def trailing_tokens(generated: list[int], tree: TokenTree | None, length: int) -> Tensor:
    """int64 [rows, length]: each row's output + path read backwards (column 0 = its last token: node i's
    token, or the output's last for the root row), -1 past the beginning of the output."""
    depths = torch.tensor((0, *(tree.depths if tree is not None else ())), dtype=torch.int64)  # [T]
    parent = torch.tensor((0, *(tree.parents if tree is not None else ())), dtype=torch.int64)
    token = torch.tensor((-1, *(tree.token_ids if tree is not None else ())), dtype=torch.int64)
    past = torch.tensor([-1, *reversed(generated)], dtype=torch.int64)  # past[k] = generated[-k], -1 at 0
    out = torch.empty(depths.numel(), length, dtype=torch.int64)
    node = torch.arange(depths.numel())
    for s in range(length):
        back = (s - depths + 1).clamp(min=0, max=len(generated) + 1)  # output tokens back, once the path is read
        from_output = past.index_select(0, back.clamp(max=len(generated))).masked_fill(back > len(generated), -1)
        out[:, s] = torch.where(s < depths, token[node], from_output)
        node = parent[node]
    return out


def bad_word_bans(generated: list[int], tree: TokenTree | None, words: tuple[tuple[int, ...], ...]):
    """(rows, tokens) int64 [K]: the entries bad_words sets to -inf (vLLM's `apply_bad_words`)."""
    longest = max(len(w) for w in words) - 1
    tail = trailing_tokens(generated, tree, longest) if longest else None
    rows_n = 1 + (tree.n if tree is not None else 0)
    rows, toks = [], []
    for word in words:
        prefix = torch.tensor(word[-2::-1] if len(word) > 1 else (), dtype=torch.int64)  # newest first
        hit = (
            (tail[:, : prefix.numel()] == prefix).all(dim=-1)
            if prefix.numel()
            else torch.ones(rows_n, dtype=torch.bool)
        )
        r = hit.nonzero().flatten()
        rows.append(r)
        toks.append(torch.full_like(r, word[-1]))
    return torch.cat(rows), torch.cat(toks)


def _penalize(x: Tensor, counts: Tensor, seen: Tensor, cfg: SamplingConfig) -> Tensor:
    """Steps 5-6 elementwise (x, counts, seen broadcast together)."""
    if cfg.repetition_penalty != 1.0:
        r = torch.where(seen, torch.tensor(cfg.repetition_penalty, dtype=x.dtype, device=x.device), 1.0)
        x = torch.where(x > 0, x / r, x * r)
    if cfg.frequency_penalty != 0.0:
        x = x - cfg.frequency_penalty * counts
    if cfg.presence_penalty != 0.0:
        x = x - cfg.presence_penalty * (counts > 0).to(x.dtype)
    return x


def adjust_logits(
    logits: Tensor, cfg: SamplingConfig, state: PenaltyCounts, generated: list[int], tree: TokenTree | None
) -> Tensor:
    """fp32 [rows, V] logits (row 0 the root, then the tree's nodes; one row without a tree) with the
    request's masks, bias and penalties applied per row (steps 1-6). A new tensor; `logits` is untouched."""
    vocab = logits.shape[-1]
    t = state.tensors(generated, logits.device, vocab)
    x = logits.float().clone()
    if "banned" in t:
        x.masked_fill_(t["banned"], float("-inf"))
    if cfg.bad_words:
        rows, toks = bad_word_bans(generated, tree, cfg.bad_words)
        x[rows.to(x.device), toks.to(x.device)] = float("-inf")
    if "bias" in t:
        x = x + t["bias"]
    if not cfg.penalizes:
        return x
    counts = t["counts"]
    seen = (counts > 0) | t["prompt"]
    out = _penalize(x, counts, seen, cfg)  # [rows, V]: the output's counts, every row
    rows, toks, extra = (e.to(x.device) for e in path_entries(tree, vocab))
    if rows.numel():  # the path's tokens: count + path count, seen
        c = counts[toks] + extra.to(counts.dtype)
        out[rows, toks] = _penalize(x[rows, toks], c, torch.ones_like(rows, dtype=torch.bool), cfg)
    return out
