"""--max-tree-tokens: under load each sequence's tree shrinks so the batch's tree tokens fit the cap; the
output stays exactly the AR output."""
from __future__ import annotations

import concurrent.futures as cf

from services.verifier.scheduler import tree_budget
from tests.test_e2e_lossless import _generate

CAP = 24


def test_tree_budget_arithmetic():
    assert tree_budget(16, 1, 0) == 16 and tree_budget(16, 8, 0) == 16  # no cap
    assert tree_budget(16, 1, 64) == 16  # 17 tree tokens fit
    assert tree_budget(16, 4, 64) == 15 and tree_budget(16, 8, 64) == 7
    assert tree_budget(16, 30, 64) == 1  # never below one node
    assert tree_budget(0, 8, 64) == 0


def test_capped_trees_are_lossless(default_ckpt, tmp_path):
    from services.gateway.tokenizer import Tokenizer
    from services.launcher import start_stack
    tok = Tokenizer(default_ckpt.target)
    prompts = [tok.encode(f"def function_{i}(x):\n    return x * {i} + ") for i in range(4)]
    with start_stack(str(default_ckpt.target), str(default_ckpt.drafter), tmp_path,
                     drafter_args=("--engine", "oracle", "--oracle-seed", "7"),
                     verifier_args=("--max-tree-tokens", str(CAP), "--max-batch", "4")) as stack:
        ar = [_generate(stack.verifier, ids, no_spec=True, max_new=48)[0] for ids in prompts]
        with cf.ThreadPoolExecutor(4) as pool:
            runs = list(pool.map(lambda ids: _generate(stack.verifier, ids, no_spec=False, budget=16, max_new=48),
                                 prompts))
    assert [r[0] for r in runs] == ar
    nodes = [s.tree_nodes for r in runs for s in r[1]]
    assert max(nodes) <= CAP - 1  # a sequence alone: at most cap - 1 nodes
    # with four running, at most cap // 4 - 1 = 5 nodes each: most steps of these concurrent streams
    assert sum(n <= CAP // 4 - 1 for n in nodes) >= len(nodes) // 2, nodes
    assert max(s.accept_length for r in runs for s in r[1]) > 1
