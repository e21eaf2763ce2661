"""The commit of one forward's rows for one work item, as a value (docs/design.md §3.4-§3.5).

Verify: the target's choice at every node (argmax, or one sample per node at temperature > 0), the
accept walk, then the accepted nodes become the next positions (`StepOutcome.accepted_nodes`, kept by
PageTable.commit_tree when the outcome is applied). Node acc[j] sits at depth j, so its latent was
computed at position start + j, exactly where it now belongs. The drafter's next commit is the accepted
tokens with the tapped features gathered at the accepted node indices (not the first rows). A Features
request's own tapped rows are gathered the same way. With top_logprobs, each emitted token's logprobs are
read from the row it was chosen at (the accepted node before it; logprobs.py). With prompt_logprobs, a
prefill chunk's rows (all of them computed, work_items.PrefillItem.head) score the prompt tokens after
them; the last row alone then picks the first token.

Penalties and logit masks (penalties.py): each row's logits get the request's masks, bias and penalties
from the output's counts plus the tokens of the row's own path, so every row's choice is penalised AR's.

Dead ends: a row whose masks allow no token (a grammar's, grammar.py; allowed_token_ids, bad_words and
min_tokens' stop ids) has no choice (`Choices.dead`): the accepted path is cut at the first dead row it
reaches, the outcome is a dead end there and no bonus is emitted.

Nothing here writes to the sequence: it is read, and the result returned (apply.py writes it).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from ddtree.verifier.constraints.grammar import mask_logits
from ddtree.verifier.constraints.penalties import adjust_logits
from ddtree.verifier.sampling.accept import accept
from ddtree.verifier.sampling.logprobs import prompt_logprobs, token_logprobs
from ddtree.verifier.sampling.sampling import mask_stop_tokens, stop_mask_rows, target_choices
from ddtree.verifier.sequence import Sequence, extend_pending
from ddtree.verifier.step.step_outcome import StepOutcome

if TYPE_CHECKING:
    from ddtree.contract.token_tree import TokenTree
    from ddtree.verifier.step.work_items import PrefillItem, VerifyItem


@dataclasses.dataclass(frozen=True)
class ItemOutput:
    """One work item's rows of the forward (batch.run_batch)."""

    new_slots: torch.Tensor  # int64 [q_len], slots the new tokens were written to
    logits: torch.Tensor | None  # fp32 [q_len, V] for verify and prompt_logprobs; [1, V] for a last prefill chunk
    taps: torch.Tensor | None  # [q_len, F] tapped features of the new tokens (None without taps)
    argmax: torch.Tensor | None = None  # int64 per row: the walk's rows (greedy tree) or every row (tensor parallel)
    feature_taps: torch.Tensor | None = None  # [q_len, len(feature_taps) * H]: a Features request's layers


@dataclasses.dataclass(frozen=True)
class Choices:
    tokens: list[int]  # the target's choice per row (on a dead row any token: never used, see commit_verify)
    dead: frozenset[int]  # rows whose masks (grammar, allowed ids, bad words, stop ids) allow no token


def _choices(seq: Sequence, out: ItemOutput, tree: TokenTree | None, grammar: torch.Tensor | None) -> Choices:
    """The target's choice per row: argmax, or one sample per row from the request's generator.
    tree: the verified tree (row 0 its root, row i node i), or None for a first token's single row. Row r
    chooses output token len(generated) + depth(r) (min_tokens) after its path's tokens (penalties.py)."""
    cfg = seq.params.sampling
    depths = (0,) if tree is None else (0, *tree.depths)
    masked = seq.masks_stops
    adjusted = seq.penalty_counts is not None
    needs_logits = masked or adjusted or grammar is not None
    if cfg.greedy and out.argmax is not None and (not needs_logits or out.logits is None):
        return Choices(out.argmax.tolist(), frozenset())  # tensor parallel: from the vocab shards, no gather
    logits = out.logits
    if masked:
        rows = stop_mask_rows(cfg.min_tokens, len(seq.generated), depths)
        logits = mask_stop_tokens(logits, rows, seq.params.stop_token_ids)
    if adjusted:  # each row with the counts of the output plus its own path
        logits = adjust_logits(logits, cfg, seq.penalty_counts, seq.generated, tree)
    generator = None if cfg.greedy else seq.generator(logits.device)
    if grammar is not None:
        logits = mask_logits(grammar, logits)  # each row's grammar mask, from the path to its node (grammar.py)
    elif not (masked or cfg.allowed_token_ids or cfg.bad_words):
        return Choices(target_choices(logits, cfg, generator).tolist(), frozenset())  # no row can be all -inf
    dead = torch.isneginf(logits).all(dim=-1)
    if not bool(dead.any()):
        return Choices(target_choices(logits, cfg, generator).tolist(), frozenset())
    live = logits.masked_fill(dead[:, None], 0.0)  # any finite row, for the sampler's shapes
    return Choices(target_choices(live, cfg, generator).tolist(), frozenset(dead.nonzero().flatten().tolist()))


def _logprobs(seq: Sequence, out: ItemOutput, rows: list[int], tokens: list[int]) -> tuple:
    """The logprobs of the tokens about to be emitted (token k chosen at row rows[k]); () unless asked."""
    top = seq.params.top_logprobs
    if top is None or not tokens:
        return ()
    assert out.logits is not None, "a logprobs request asks for full logits (work_items.head)"
    return tuple(token_logprobs(out.logits, rows[: len(tokens)], tokens, top))


def commit_prefill(item: PrefillItem, out: ItemOutput, window: int) -> StepOutcome:
    """The chunk's tokens enter the cache; after the last chunk its last row chooses the first token."""
    seq = item.seq
    chunk = tuple(seq.params.input_ids[item.start : item.end])
    taps = None if out.taps is None else out.taps.cpu()
    pending = extend_pending(seq.pending_commit, list(chunk), item.start, taps, window) if seq.use_spec else None
    prompt_rows = None
    if item.scores_prompt:
        prompt_rows = prompt_logprobs(out.logits, seq.params.input_ids, item.start, seq.params.prompt_logprobs)
        last = None if out.argmax is None else out.argmax[-1:]
        out = dataclasses.replace(out, logits=out.logits[-1:], argmax=last)  # the first token reads the last row
    feature_rows = None if out.feature_taps is None else out.feature_taps.cpu()
    common = dict(
        committed=chunk,
        kv_rows=len(chunk),
        prefill_end=item.end,
        pending=pending,
        taps=taps,
        feature_rows=feature_rows,
        prompt_logprobs=prompt_rows,
    )
    if not item.is_last:
        return StepOutcome(**common)
    choices = _choices(seq, out, None, None if item.grammar is None else item.grammar.masks)
    common["grammar"] = item.grammar
    if 0 in choices.dead:
        return StepOutcome(**common, starts_decode=True, dead_end=True)
    first = choices.tokens[0]
    logprobs = _logprobs(seq, out, [0], [first])
    return StepOutcome(**common, emitted=(first,), logprobs=logprobs, next_root=first, starts_decode=True)


def commit_verify(item: VerifyItem, out: ItemOutput, window: int) -> StepOutcome:
    """The accepted path enters the cache; the matched node tokens, then the bonus, are emitted."""
    seq, tree = item.seq, item.tree
    choices = _choices(seq, out, tree, None if item.grammar is None else item.grammar.masks)
    verdict = accept(tree, seq.root, choices.tokens)
    nodes, tokens = verdict.accepted_nodes, verdict.accepted_tokens
    # The walk ends at the first dead row it reaches: that row has no choice, so nothing after it is accepted
    # (a grammar pruned its children already; masks of allowed ids or bad words did not).
    cut = next((k for k, node in enumerate(nodes) if node in choices.dead), None)
    dead_end = cut is not None
    if dead_end:
        nodes, tokens = nodes[: cut + 1], tokens[: cut + 1]
    emitted = tokens[1:] if dead_end else (*tokens[1:], verdict.next_root)
    acc = torch.tensor(nodes, dtype=torch.int64)
    # The accepted rows' taps stay where the forward left them: the drafter's next call copies them (a GPU
    # ring: device to device; gRPC or shared memory: to the host then).
    taps = out.taps.index_select(0, acc.to(out.taps.device)) if out.taps is not None else None
    feature_rows = None
    if out.feature_taps is not None:
        feature_rows = out.feature_taps.index_select(0, acc.to(out.feature_taps.device)).cpu()
    # Every speculating sequence's commit went to the drafter in this step's Draft call: the new one starts here.
    # A context the drafter lost keeps its unseen commit, this step's tokens appended: sent again with reset.
    pending = extend_pending(None, list(tokens), seq.context_len, taps, window) if item.speculating else None
    if item.resend:
        pending = extend_pending(seq.pending_commit, list(tokens), seq.context_len, taps, window)
    return StepOutcome(
        committed=tokens,
        accepted_nodes=nodes,
        emitted=emitted,
        logprobs=_logprobs(seq, out, list(nodes), list(emitted)),  # token k was chosen at accepted node k
        next_root=None if dead_end else verdict.next_root,
        dead_end=dead_end,
        pending=pending,
        drafted=item.drafted,
        drafter_has_context=item.speculating,
        stops_speculating=item.lost,
        resends_context=item.resend,
        taps=taps,
        feature_rows=feature_rows,
        verified=tree,
        grammar=item.grammar,
    )
