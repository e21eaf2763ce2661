"""Commit the result of one forward into a sequence (docs/design.md §3.4-§3.5).

Verify: the target's choice at every node (argmax, or one sample per node at temperature > 0), the
accept walk, then the accepted nodes become the next positions (PageTable.commit_tree). Node acc[j]
sits at depth j, so its latent was computed at position start + j, exactly where it now belongs: with
page size 1 the table keeps its slot and the others are freed (nothing moves); with page size P it is
copied to the slot of position start + j and the scratch pages are freed. The drafter's next commit
is the accepted tokens with the tapped features gathered at the accepted node indices (not the first
rows). A Features request's own tapped rows (batch.ItemOutput.feature_taps) go to its stream, gathered
the same way. With top_logprobs, each emitted token's logprobs are read from the row it was chosen at
(the accepted node before it; logprobs.py) and handed to Sequence.emit with the tokens. With
prompt_logprobs, a prefill chunk's rows (all of them computed, batch._head) score the prompt tokens after
them and go to the stream at once (ahead of the first token); the last row alone then picks the first token.
"""

from __future__ import annotations

import dataclasses

import torch

from ddtree.contract.verdict import Verdict
from ddtree.verifier.accept import accept
from ddtree.verifier.batch import ItemOutput, PrefillItem, VerifyItem
from ddtree.verifier.grammar import DEAD_END
from ddtree.verifier.kv_pool import LatentKVPool
from ddtree.verifier.logprobs import prompt_logprobs, token_logprobs
from ddtree.verifier.sampling import make_generator, mask_stop_tokens, stop_mask_rows, target_choices
from ddtree.verifier.sequence import PendingCommit, Sequence, StreamEvent


def _log_features(seq: Sequence, features: torch.Tensor | None) -> None:
    if seq.feature_log is not None and features is not None:
        seq.feature_log.append(features)


def _stream_features(seq: Sequence, rows: torch.Tensor | None) -> None:
    """A Features request's rows of the tokens just committed, to its stream (ahead of their tokens)."""
    if rows is not None:
        seq.events.put(StreamEvent((), features=rows.cpu()))


def append_pending(seq: Sequence, tokens: list[int], start: int, features: torch.Tensor | None, window: int) -> None:
    """Queue committed tokens for the drafter, keeping at most `window` of them (0 = all)."""
    if not seq.use_spec:
        return
    pend = seq.pending_commit
    if pend is None:
        pend = PendingCommit(list(tokens), start, features)
    else:
        assert pend.start + len(pend.token_ids) == start, "pending commit must stay contiguous"
        feats = None if features is None else torch.cat([pend.features, features])
        pend = PendingCommit(pend.token_ids + list(tokens), pend.start, feats)
    if window and len(pend.token_ids) > window:
        cut = len(pend.token_ids) - window
        pend = PendingCommit(
            pend.token_ids[cut:], pend.start + cut, None if pend.features is None else pend.features[cut:].clone()
        )
    seq.pending_commit = pend


def _choices(seq: Sequence, out: ItemOutput, depths: tuple[int, ...]) -> list[int]:
    """The target's choice per row: argmax, or one sample per row from the request's generator.
    depths[r]: row r's depth (its choice is output token len(generated) + depth), for min_tokens.
    A grammar row that allows no token (grammar.py, dead ends) chooses DEAD_END."""
    cfg = seq.params.sampling
    masked = seq.masks_stops
    if cfg.greedy and out.argmax is not None and (not masked and seq.grammar is None or out.logits is None):
        return out.argmax.tolist()  # tensor parallel: combined from the vocab shards, logits never gathered
    logits = out.logits
    if masked:
        rows = stop_mask_rows(cfg.min_tokens, len(seq.generated), depths)
        logits = mask_stop_tokens(logits, rows, seq.params.stop_token_ids)
    if seq.grammar is not None:  # each row's grammar mask, from the path to its node (grammar.py)
        logits = seq.grammar.mask_logits(logits)
    if not cfg.greedy and not seq.generator_ready:
        seq.generator = make_generator(cfg, logits.device)
        seq.generator_ready = True
    if seq.grammar is None:
        return target_choices(logits, cfg, seq.generator).tolist()
    dead = torch.isneginf(logits).all(dim=-1)
    if not bool(dead.any()):
        return target_choices(logits, cfg, seq.generator).tolist()
    live = logits.masked_fill(dead[:, None], 0.0)  # any finite row: its choice is replaced below
    return target_choices(live, cfg, seq.generator).masked_fill(dead, DEAD_END).tolist()


def _live(tokens: list[int]) -> list[int]:
    """The emitted tokens without a closing DEAD_END."""
    return tokens[:-1] if tokens and tokens[-1] == DEAD_END else tokens


def _keep_logprobs(seq: Sequence, out: ItemOutput, rows: list[int], tokens: list[int]) -> None:
    """The logprobs of the tokens about to be emitted (token k chosen at row rows[k]), for emit."""
    top = seq.params.top_logprobs
    tokens = _live(tokens)
    if top is not None:
        assert out.logits is not None, "a logprobs request asks for full logits (batch._head)"
        seq.step_logprobs = token_logprobs(out.logits, rows[: len(tokens)], tokens, top)


def _stream_prompt_logprobs(seq: Sequence, out: ItemOutput) -> ItemOutput:
    """A prompt_logprobs chunk: its rows' prompt logprobs to the stream; the output cut to the last row."""
    item = out.item
    rows = prompt_logprobs(out.logits, seq.params.input_ids, item.start, seq.params.prompt_logprobs)
    if rows is not None:
        seq.events.put(StreamEvent((), prompt_logprobs=rows))
    last = None if out.argmax is None else out.argmax[-1:]
    return dataclasses.replace(out, logits=out.logits[-1:], argmax=last)


def commit_prefill(out: ItemOutput, pool: LatentKVPool, window: int) -> list[int]:
    """Returns the tokens to emit: [first token] after the last chunk, [] before it (a grammar's dead end:
    [DEAD_END])."""
    item = out.item
    assert isinstance(item, PrefillItem)
    seq = item.seq
    chunk = list(seq.params.input_ids[item.start : item.end])
    taps = None if out.taps is None else out.taps.cpu()
    append_pending(seq, chunk, item.start, taps, window)
    _log_features(seq, taps)
    _stream_features(seq, out.feature_taps)
    if item.scores_prompt:
        out = _stream_prompt_logprobs(seq, out)
    seq.committed.extend(chunk)
    seq.table.commit(len(chunk))
    seq.prefill_done = item.end
    if not item.is_last:
        return []
    first = _choices(seq, out, (0,))[0]
    seq.root = first
    _keep_logprobs(seq, out, [0], [first])
    return [first]


def commit_verify(out: ItemOutput, pool: LatentKVPool, window: int) -> tuple[Verdict, list[int]]:
    """Returns the verdict and the tokens to emit (matched node tokens, then the bonus; the bonus is
    DEAD_END where a grammar allows no token: the sequence ends after the tokens before it)."""
    item = out.item
    assert isinstance(item, VerifyItem)
    seq = item.seq
    choices = _choices(seq, out, (0, *item.tree.depths))
    verdict = accept(item.tree, seq.root, choices)
    acc = torch.tensor(verdict.accepted_nodes, dtype=torch.int64)
    seq.table.commit_tree(pool, verdict.accepted_nodes)
    start = seq.context_len
    features = out.taps.index_select(0, acc.to(out.taps.device)).cpu() if out.taps is not None else None
    append_pending(seq, list(verdict.accepted_tokens), start, features, window)
    _log_features(seq, features)
    if out.feature_taps is not None:
        _stream_features(seq, out.feature_taps.index_select(0, acc.to(out.feature_taps.device)))
    seq.committed.extend(verdict.accepted_tokens)
    seq.root = verdict.next_root
    emitted = list(verdict.accepted_tokens[1:]) + [verdict.next_root]
    _keep_logprobs(seq, out, list(verdict.accepted_nodes), emitted)  # token k was chosen at accepted node k
    return verdict, emitted
