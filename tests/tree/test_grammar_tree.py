"""The tree of a grammar-constrained sequence built from the drafter's table (services/tree/grammar_build.py).

- The build equals a brute force: every prefix of the table that a fresh matcher accepts token by token
  (stop tokens only last), sorted by (-score, ranks), the first `budget`.
- `prepare` keeps every built node and computes the same masks as pruning does, each mask once per step;
  the build consumes every node at most once and never moves the sequence's own matcher; stop tokens are
  leaves; a matcher in an error state gives no tree; a parser limit met on a draft path (built or pruned)
  gives each row plain constrained AR's mask after that node's path: the limited node's row allows nothing,
  the rest of the tree stays, and the sequence goes on (or ends, where the walk reaches that node) as plain
  decoding does.
- The demo pair, JSON schemas at temperature 0: AR, the pruned tree and the table build give the same
  tokens, and the table build keeps more nodes per step than pruning, on the same requests.
"""

from __future__ import annotations

import llguidance
import pytest
import torch

from ddtree.contract.token_tree import TokenTree
from ddtree.tree.best_first import MAX_TABLE_WIDTH, TokenTable
from ddtree.tree.grammar_build import build_grammar_tree, grammar_table_width
from ddtree.verifier.constraints.grammar import GrammarStep, SequenceGrammar
from tests.support.letter_vocab import letter_grammar, letter_tokenizer
from tests.support.tree_tables import brute_force, node_paths, random_table

VOCAB = 16  # tokens "a".."p"; "p" (15) is llguidance's eos
EOS = 15
GRAMMARS = ["([a-c][d-f]|g)+h", "(ab|ac|b[a-d])+e?", "[a-h]{2,5}"]


LT = letter_tokenizer(VOCAB)


def _grammar(regex: str, matcher=None) -> SequenceGrammar:
    return letter_grammar(LT, regex, matcher)


def _valid(regex: str, path: tuple[int, ...]) -> bool:
    """A fresh matcher walks the path: each token in its mask, a stop token only last (never consumed)."""
    m = llguidance.LLMatcher(LT, llguidance.LLMatcher.grammar_from_regex(regex), log_level=0)
    for i, tok in enumerate(path):
        bits = m.compute_bitmask()
        if not bits[tok // 8] >> (tok % 8) & 1:
            return False
        if tok == EOS:
            return i == len(path) - 1
        assert m.consume_token(tok)
    return True


def _table(seed: int, depth: int = 4, width: int = 4) -> TokenTable:
    return TokenTable(*random_table(depth, width, VOCAB, seed))


@pytest.mark.parametrize("regex", GRAMMARS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_build_is_the_best_valid_prefixes(regex, seed):
    table = _table(seed)
    everything = brute_force(table.logprobs, table.token_ids, 10**9)
    valid = [r for r in everything if _valid(regex, r[1])]
    for budget in (1, 3, 8, 20, 60):
        tree = build_grammar_tree(_grammar(regex), table, budget)
        tree.validate()
        assert node_paths(tree) == [r[1] for r in valid[:budget]], (regex, seed, budget)
        assert list(tree.scores) == [r[2] for r in valid[:budget]]


def _plain_rows(fresh, tree: TokenTree) -> torch.Tensor:
    """Plain constrained AR's mask at every row of the tree: a fresh grammar state (`fresh()`) takes the node's
    path (up to a stop token, where the answer ends: a stop node's row is its parent's), then its next mask."""
    rows = []
    for path in [()] + node_paths(tree):
        g = fresh()
        g.advance(list(path))
        rows.append(g.prepare().masks[0])
    return torch.stack(rows)


class _Counting:
    """An LLMatcher whose consume_token calls (its forks' too) are logged, with the matcher they ran on."""

    def __init__(self, inner, log: list):
        self._inner, self._log = inner, log

    def consume_token(self, tok):
        self._log.append((self, tok))
        return self._inner.consume_token(tok)

    def deep_copy(self):
        return _Counting(self._inner.deep_copy(), self._log)

    def __getattr__(self, name):
        return getattr(self._inner, name)


@pytest.mark.parametrize("regex", GRAMMARS)
def test_prepare_keeps_the_built_tree_with_the_pruned_masks_each_computed_once(regex):
    for seed in range(4):
        log: list = []
        root = _Counting(llguidance.LLMatcher(LT, llguidance.LLMatcher.grammar_from_regex(regex), log_level=0), log)
        g = _grammar(regex, root)
        tree = build_grammar_tree(g, _table(seed, width=8), 24)
        assert len(log) <= tree.n and all(m is not root for m, _ in log), "a node consumed twice, or the root moved"
        assert len({id(m) for m, _ in log}) == len(log), "a fork consumed more than its own node"
        assert all(tree.token_ids[p - 1] != EOS for p in tree.parents if p), "a stop token has children"
        step = g.prepare(tree)
        assert step.tree is tree
        pruned = _grammar(regex)
        pruned_step = pruned.prepare(tree)
        assert pruned_step.tree == tree
        assert torch.equal(step.masks, pruned_step.masks)
        assert torch.equal(step.masks, _plain_rows(lambda: _grammar(regex), tree))
        assert g.mask_count == pruned.mask_count, "a mask computed twice (or one missing)"
        assert g.kept_nodes == g.drafted_nodes == tree.n


def test_a_matcher_in_an_error_state_gives_no_tree():
    broken = llguidance.LLMatcher(LT, llguidance.LLMatcher.grammar_from_regex("ab"), log_level=0)
    assert not broken.consume_token(5) and broken.is_error()
    g = _grammar("", broken)
    assert build_grammar_tree(g, _table(0), 8) == TokenTree()
    step = g.prepare(TokenTree())
    assert step.tree == TokenTree() and step.masks.shape[0] == 1 and not step.masks.any()


# Every "a" opens more ways to parse the rest: after 8 "a"s, two more and a mask needs more than 50 Earley
# items (a parser limit, an error state that stays); a "b" closes them.
AMBIGUOUS = llguidance.LLMatcher.grammar_from_lark('start: x*\nx: "a" | "a" "b" | y\ny: "a"+')
A_FIRST = TokenTable(torch.tensor([[-0.1, -3.0]] * 4), torch.tensor([[0, 1]] * 4))  # "a" first, then "b"


def _limited() -> SequenceGrammar:
    limits = llguidance.LLParserLimits(step_max_items=50, verbose_errors=False)
    m = llguidance.LLMatcher(LT, AMBIGUOUS, log_level=0, limits=limits)
    assert m.consume_tokens([0] * 8) and not m.is_error()
    return _grammar("", m)


def _limited_step(mode: str) -> tuple[SequenceGrammar, TokenTree, GrammarStep]:
    """(grammar state, tree, prepare's step) of one step: the table build, or the same tree pruned."""
    g = _limited()
    tree = build_grammar_tree(g, A_FIRST, 8)
    if mode == "prune":
        g = _limited()  # nothing offered: prepare computes every row
    return g, tree, g.prepare(tree)


@pytest.mark.parametrize("mode", ["table", "prune"])
def test_a_parser_limit_on_a_draft_path_costs_that_row_only(mode):
    """Rows are plain constrained AR's masks after each node's path: the nodes whose path meets the limit
    allow nothing, the rest of the tree stays, and the sequence's matcher goes on as plain decoding does."""
    g, tree, step = _limited_step(mode)
    assert step.tree == tree and tree.n == 8, "a limit on a draft path dropped the step's tree"
    rows = _plain_rows(_limited, tree)
    assert torch.equal(step.masks, rows)
    assert rows[0, 0] and rows[0, 1] and not rows.any(dim=1).all(), "the limit is met on a draft path"
    assert not g.matcher.is_error()
    pruned = _limited()
    pruned.prepare(tree)
    assert g.mask_count == pruned.mask_count == tree.n + 1, "a mask computed twice (or one missing)"
    g.advance([1], step)  # the target chose "b" at the root
    after = g.prepare()
    after_b = _plain_rows(_limited, TokenTree((1,), (0,), (1,)))[1]
    assert not g.matcher.is_error() and torch.equal(after.masks[0], after_b) and after_b.any()


@pytest.mark.parametrize("mode", ["table", "prune"])
def test_the_walk_reaching_a_limit_ends_as_plain_decoding_does(mode):
    """The accept walk reaching a node whose row allows nothing (a dead end: no choice there): after its path, the
    sequence's matcher is in plain decoding's error state (the dead end reads llguidance's reason)."""
    g, tree, step = _limited_step(mode)
    dead = next(i for i in range(1, tree.n + 1) if not step.masks[i].any())
    path = node_paths(tree)[dead - 1]
    g.advance(list(path), step)
    plain = _limited()
    plain.advance(list(path))
    plain_step = plain.prepare()
    assert plain.matcher.is_error() and not plain_step.masks.any()
    assert g.matcher.is_error() and not g.matcher.is_accepting()
    assert g.dead_end_reason() == plain.dead_end_reason() and "Too many items" in g.dead_end_reason()
    last = g.prepare()
    assert last.masks.shape[0] == 1 and not last.masks.any()


def test_table_width():
    assert grammar_table_width(False, 8192) == MAX_TABLE_WIDTH
    assert grammar_table_width(False, 10) == 10
    assert grammar_table_width(True, 8192) == 1


@pytest.fixture(scope="module")
def demo_pair():
    from ddtree.default_checkpoint import default_checkpoint
    from scripts.bench.grammar_runs import DemoPair

    pair = DemoPair(default_checkpoint())
    yield pair
    pair.close()


def test_demo_pair_table_build_equals_constrained_ar_and_keeps_more(demo_pair):
    from scripts.bench.grammar_runs import REQUESTS, json_grammar

    requests = [(prompt, json_grammar(schema)) for prompt, schema in REQUESTS]
    ar = demo_pair.run(requests, 0, "ar")
    assert all(r.finish_reason == "stop" for r in ar), [r.finish_reason for r in ar]
    kept = {}
    for budget in (8, 32):
        for mode in ("prune", "table"):
            runs = demo_pair.run(requests if budget == 8 else requests[:2], budget, mode)
            for i, r in enumerate(runs):
                assert r.tokens == ar[i].tokens and r.finish_reason == "stop", (budget, mode, i)
            kept[budget, mode] = sum(r.kept_nodes for r in runs) / sum(len(r.accept_lengths) for r in runs)
        assert kept[budget, "table"] > kept[budget, "prune"], kept
