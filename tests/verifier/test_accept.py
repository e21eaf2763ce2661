"""The accept walk (services/verifier/sampling/accept.py)."""

from __future__ import annotations

import random

import pytest
import torch

from ddtree.contract.token_tree import TokenTree
from ddtree.contract.verdict import Verdict
from ddtree.tree.best_first import build_tree, topk_logprobs
from ddtree.verifier.sampling.accept import accept

#        root(100)
#        /      \
#     1:a=10   2:b=11
#      |    \      \
#    3:12  5:13   4:14
#      |
#    6:15
TREE = TokenTree(token_ids=(10, 11, 12, 14, 13, 15), parents=(0, 0, 1, 2, 1, 3), depths=(1, 1, 2, 2, 2, 3))
ROOT = 100


def choices(**by_node: int) -> list[int]:
    """Target choice per node (n + 1 entries), default 99 (never a child token)."""
    out = [99] * (TREE.n + 1)
    for k, v in by_node.items():
        out[int(k[1:])] = v
    return out


@pytest.mark.parametrize(
    "name, choice, nodes, tokens, bonus",
    [
        ("all_rejected", choices(n0=42), (0,), (ROOT,), 42),
        ("partial", choices(n0=10, n1=13, n5=7), (0, 1, 5), (ROOT, 10, 13), 7),
        ("full_depth", choices(n0=10, n1=12, n3=15, n6=3), (0, 1, 3, 6), (ROOT, 10, 12, 15), 3),
        ("sibling_chosen", choices(n0=11, n2=14, n4=8), (0, 2, 4), (ROOT, 11, 14), 8),
        ("stop_mid_path", choices(n0=10, n1=12, n3=16), (0, 1, 3), (ROOT, 10, 12), 16),
        # a node token equal to a choice elsewhere does not matter: only children of the current node count
        ("not_a_child", choices(n0=12), (0,), (ROOT,), 12),
    ],
)
def test_walk_cases(name: str, choice: list[int], nodes, tokens, bonus) -> None:
    v = accept(TREE, ROOT, choice)
    assert v == Verdict(nodes, tokens, bonus), name
    assert v.num_accepted_drafts == len(nodes) - 1
    assert accept(TREE, ROOT, torch.tensor(choice)) == v  # tensor input


def test_empty_tree_and_errors() -> None:
    assert accept(TokenTree(), 5, [7]) == Verdict((0,), (5,), 7)
    with pytest.raises(ValueError, match="target_choice has 3 entries, expected n \\+ 1 = 7"):
        accept(TREE, ROOT, [1, 2, 3])
    with pytest.raises(ValueError, match="repeats among children"):
        accept(TokenTree((1, 1), (0, 0), (1, 1)), 0, [1, 1, 1])


def target_next(prefix: tuple[int, ...], vocab: int, salt: int) -> int:
    """A deterministic 'target': greedy next token of a prefix (a stand-in for argmax of logits)."""
    return random.Random(hash((salt,) + prefix)).randrange(vocab)


@pytest.mark.parametrize("seed", range(30))
def test_greedy_equals_target_argmax_path(seed: int) -> None:
    vocab = 4  # tiny vocab: the drafter often agrees with the target, paths of every length occur
    g = torch.Generator().manual_seed(seed)
    depth = 1 + seed % 5
    lp, ids = topk_logprobs(torch.randn(depth, vocab, generator=g), min(3, vocab))
    tree = build_tree(lp, ids, budget=seed % 13)
    root = seed % vocab
    paths = [()]
    for tok, parent in zip(tree.token_ids, tree.parents):
        paths.append(paths[parent] + (tok,))
    # what the verify forward gives: node i sees the root and its ancestors only
    choice = [target_next((root,) + p, vocab, seed) for p in paths]
    v = accept(tree, root, choice)

    # brute force: greedy AR continuation, the deepest node whose path is its prefix
    ar = []
    for _ in range(depth + 1):
        ar.append(target_next((root,) + tuple(ar), vocab, seed))
    matched = [i for i, p in enumerate(paths) if tuple(ar[: len(p)]) == p]
    deepest = max(matched, key=lambda i: len(paths[i]))
    assert v.accepted_nodes[-1] == deepest
    assert v.accepted_tokens == (root,) + paths[deepest]
    assert v.next_root == ar[len(paths[deepest])]
    assert list(v.accepted_nodes) == sorted(set(v.accepted_nodes)) and v.accepted_nodes[0] == 0
    assert [len(paths[i]) for i in v.accepted_nodes] == list(range(len(v.accepted_nodes)))
