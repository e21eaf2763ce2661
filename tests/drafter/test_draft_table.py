"""The Draft RPC's table mode (SeqDraft.table_width -> DraftResponse.tables, proto/ddtree/v1/drafter.proto).

- The DFlash engine's table is the top-K of its block's log-softmax (a hand-computed reference), from the
  same forward as its trees: the tree it returns is the best-first build over the table's first columns.
- The width is validated by the Drafter server for any engine: 1..min(vocab, 256), not with chain, else
  INVALID_ARGUMENT naming table_width; the verifier asks at most the drafter's vocabulary (and the target's).
- A table the verifier cannot use (bad shape, unsorted, ids out of range, a tree where a table was asked)
  is dropped like a bad tree: that sequence takes an AR step, and a constrained sequence whose drafter
  only sends bad tables gives exactly constrained AR's tokens.
"""

from __future__ import annotations

import grpc
import llguidance
import pytest
import torch

from ddtree.config import DrafterConfig, VerifierConfig
from ddtree.contract.sampling_params import SamplingConfig
from ddtree.contract.token_tree import TokenTree
from ddtree.drafter.server import serve_engine
from ddtree.protocol.ddtree.v1 import drafter_pb2, drafter_pb2_grpc
from ddtree.protocol.tensors import tensor_to_proto
from ddtree.tree.best_first import TokenTable, build_tree, topk_logprobs
from ddtree.verifier.constraints.grammar import SequenceGrammar
from ddtree.verifier.drafting.drafter_client import DrafterClient
from ddtree.verifier.drafting.step_drafter import StepDrafter
from ddtree.verifier.sequence import DraftedTree, GenerateParams, PendingCommit, Sequence
from tests.support.draft_engines import BLOCK, draft_input, random_draft_engine
from tests.support.engines import engine_with_drafter
from tests.support.fakes import stub_engine_info
from tests.support.letter_vocab import letter_grammar, letter_tokenizer
from tests.support.tiny_target import ALLOWED, PROMPT, REGEX, VOCAB, regex_masked


def test_the_engine_table_is_its_blocks_topk_and_its_trees_table(tmp_path):
    import dataclasses

    eng = random_draft_engine(tmp_path)
    table_seq = dataclasses.replace(draft_input("k", 12, False), table_width=40)
    table, tree = eng.draft([table_seq, draft_input("t", 12, False)])
    assert isinstance(table, TokenTable) and (table.depth, table.width) == (BLOCK - 1, 40)
    model, feats = eng.model, table_seq.commit_features
    block = torch.tensor([5] + [model.config.mask_token_id] * (BLOCK - 1))
    with torch.inference_mode():
        hidden = model.forward_block(
            eng.embed_weight[block], torch.arange(4, 4 + BLOCK), model.context_kv(feats, torch.arange(4))
        )
    ref_lp, ref_ids = topk_logprobs(hidden[1:] @ eng.lm_head_weight.T, 40)
    torch.testing.assert_close(table.logprobs, ref_lp, atol=1e-4, rtol=0)
    assert torch.equal(table.token_ids, ref_ids)
    assert tree == build_tree(table.logprobs[:, :12], table.token_ids[:, :12], 12)


def _call(port: int, **fields):
    msg = drafter_pb2.SeqDraft(seq_id="s", commit_token_ids=[1, 2], commit_start=0, root_token_id=3, reset=True)
    msg.commit_features.CopyFrom(tensor_to_proto(torch.zeros(2, 64)))
    for name, value in fields.items():
        setattr(msg, name, value)
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        return drafter_pb2_grpc.DrafterStub(ch).Draft(drafter_pb2.DraftRequest(seqs=[msg]), timeout=30)


class TableEngine:
    """Answers every sequence with `answer(seq)` (a table, or anything else); vocab 4096, block 5."""

    def __init__(self, answer, hidden: int = 64, vocab: int = 4096):
        self.answer, self.hidden, self.vocab = answer, hidden, vocab
        self.seen = []

    def info(self):
        return stub_engine_info("tables", self.hidden, self.vocab, block_size=5)

    def draft(self, seqs):
        self.seen.extend(seqs)
        return [self.answer(s) for s in seqs]

    def knows(self, seq_id):
        return False

    def release(self, ids):
        return len(ids)


def test_the_server_checks_the_width(tmp_path):
    for engine, top in ((random_draft_engine(tmp_path), 64), (TableEngine(lambda s: TokenTree()), 256)):
        running = serve_engine(engine, DrafterConfig(port=0, grace_s=0.0))
        try:
            for fields in ({"table_width": -1}, {"table_width": top + 1}, {"table_width": 2, "chain": True}):
                with pytest.raises(grpc.RpcError) as err:
                    _call(running.port, **fields)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "table_width" in err.value.details(), err.value.details()
            if isinstance(engine, TableEngine):
                assert engine.seen == [], "a bad width reached the engine"
            else:
                resp = _call(running.port, table_width=top)
                assert not resp.trees and len(resp.tables) == 1
                table = resp.tables[0]
                assert (table.seq_id, table.depth, table.width) == ("s", BLOCK - 1, top)
                assert len(table.logprobs) == len(table.token_ids) == (BLOCK - 1) * top
        finally:
            running.stop(0)


def _good(depth: int = 4, width: int = 3) -> TokenTable:
    lp = -torch.arange(1, width + 1, dtype=torch.float32).repeat(depth, 1)
    return TokenTable(lp, torch.arange(width).repeat(depth, 1) + 10)


BAD_TABLES = {
    "unsorted": TokenTable(_good().logprobs.flip(-1), _good().token_ids),
    "ids out of range": TokenTable(_good().logprobs, _good().token_ids + 5000),
    "negative id": TokenTable(_good().logprobs, -_good().token_ids),
    "repeated id": TokenTable(_good().logprobs, torch.full((4, 3), 10)),
    "positive log-prob": TokenTable(_good().logprobs + 2, _good().token_ids),
    "not finite": TokenTable(torch.full((4, 3), float("-inf")), _good().token_ids),
    "shape mismatch": TokenTable(_good().logprobs, _good().token_ids[:, :2]),
    "wrong width": _good(width=2),
    "too deep": _good(depth=6),
}


def _sequence(i: int) -> Sequence:
    seq = Sequence(GenerateParams(f"r{i}", (1, 2, 3), SamplingConfig(), 8, frozenset(), True, 4))
    seq.root = 7
    seq.pending_commit = PendingCommit([1, 2, 3], 0, torch.zeros(3, 64))
    return seq


@pytest.mark.parametrize("kind", list(BAD_TABLES))
def test_a_bad_table_is_dropped(kind):
    answers = {"good": _good(), "bad": BAD_TABLES[kind]}
    engine = TableEngine(lambda s: answers[s.seq_id.split(":")[0]])
    running = serve_engine(engine, DrafterConfig(port=0, grace_s=0.0))
    client = DrafterClient(f"127.0.0.1:{running.port}", timeout_s=30)
    try:
        good, bad = _sequence(0), _sequence(1)
        good.draft_id, bad.draft_id = f"good:{good.draft_id}", f"bad:{bad.draft_id}"
        result = client.draft([(good, 4), (bad, 4)], 4096, {good.draft_id: 3, bad.draft_id: 3})
        assert bad.draft_id not in result.tables and bad.draft_id not in result.trees
        assert torch.equal(result.tables[good.draft_id].token_ids, _good().token_ids)
        assert [s.table_width for s in engine.seen] == [3, 3]
    finally:
        client.close()
        running.stop(0)


def test_a_tree_where_a_table_was_asked_is_taken_as_a_tree():
    """A drafter that predates tables ignores table_width and answers a tree: it is verified as a tree (the
    grammar prunes it); a table where a tree was asked is dropped."""
    engine = TableEngine(lambda s: TokenTree((10,), (0,), (1,)) if s.table_width else _good())
    running = serve_engine(engine, DrafterConfig(port=0, grace_s=0.0))
    client = DrafterClient(f"127.0.0.1:{running.port}", timeout_s=30)
    try:
        asked_table, asked_tree = _sequence(0), _sequence(1)
        result = client.draft([(asked_table, 4), (asked_tree, 4)], 4096, {asked_table.draft_id: 3})
        assert result.trees == {asked_table.draft_id: TokenTree((10,), (0,), (1,))} and not result.tables
    finally:
        client.close()
        running.stop(0)


def _grammar_step(engine: TableEngine, grammar: SequenceGrammar) -> DraftedTree | None:
    """One StepDrafter Draft call (target vocab 4096) for a grammar-constrained sequence, served by engine:
    its drafted tree (None: the call failed, the sequence falls back to AR)."""
    running = serve_engine(engine, DrafterConfig(port=0, grace_s=0.0))
    client = DrafterClient(f"127.0.0.1:{running.port}", timeout_s=30)
    try:
        seq = _sequence(0)
        seq.grammar = grammar
        drafts = StepDrafter(client, 4096, VerifierConfig()).draft([seq])
        return None if seq.draft_id in drafts.lost else drafts.trees.get(seq.draft_id)
    finally:
        client.close()
        running.stop(0)


def test_the_width_asked_fits_the_drafters_vocabulary():
    """A drafter whose vocabulary is smaller than the target's (and than 256) is asked a table no wider than its
    vocabulary: it answers (a wider one is INVALID_ARGUMENT for the whole call, and every sequence of it
    would fall back to AR)."""
    engine = TableEngine(lambda s: _good(width=s.table_width), vocab=100)
    drafted = _grammar_step(engine, letter_grammar(letter_tokenizer(16), "[k-m]+"))
    assert [s.table_width for s in engine.seen] == [100]
    assert drafted is not None, "the Draft call failed: the sequence fell back to AR"


def test_a_table_is_checked_once(monkeypatch):
    """Where the Draft RPC returns it (TokenTable.validate), not again by the grammar build."""
    from ddtree.tree import best_first as tree_build

    checks, check = [], tree_build._check_tensors
    monkeypatch.setattr(tree_build, "_check_tensors", lambda lp, ids: checks.append(lp.shape) or check(lp, ids))
    drafted = _grammar_step(
        TableEngine(lambda s: _good(width=s.table_width)), letter_grammar(letter_tokenizer(16), "[k-m]+")
    )
    assert drafted.tree.n == _sequence(0).params.budget, "the grammar build did not run"
    assert checks == [(4, 256)]


def test_bad_tables_give_constrained_ar_steps(tiny_target):
    """A grammar-constrained sequence whose drafter answers every table badly: AR steps (no tree verified),
    and the tokens of constrained AR (the target's masked argmax at each position, by hand)."""
    bad = iter(list(BAD_TABLES.values()) * 4)
    engine = TableEngine(lambda s: next(bad), hidden=tiny_target.config.hidden_size, vocab=VOCAB)
    lt = letter_tokenizer(VOCAB)
    grammar = llguidance.LLMatcher.grammar_from_regex(REGEX)
    seq = Sequence(GenerateParams("c", PROMPT, SamplingConfig(), 3, frozenset(), True, 4, grammar=grammar))
    seq.grammar = SequenceGrammar(llguidance.LLMatcher(lt, grammar), frozenset(), tuple(lt.eos_tokens))
    vcfg = VerifierConfig(max_batch=4, kv_tokens=256, prefill_chunk=64)
    steps = []
    with engine_with_drafter(tiny_target, vcfg, engine) as verifier:
        verifier.scheduler.submit(seq)
        verifier.start()
        while not (event := seq.events.get(timeout=120)).finish_reason:
            steps.append(event.step)
    ids = list(PROMPT)
    for position in range(len(ALLOWED)):
        ids.append(int(regex_masked(tiny_target, ids, SamplingConfig(), position).argmax()))
    assert seq.generated == ids[len(PROMPT) :]
    assert engine.seen and all(s.table_width == VOCAB for s in engine.seen)
    assert [s for s in steps if s is not None] and all(s.tree_nodes == 0 for s in steps if s is not None)
