"""Tree policy in one room: how a draft tree is built, and how much of it a step verifies.

- `best_first.py`: the input table (`TokenTable`, `topk_logprobs`) and the best-first build by a heap
  (`build_tree`; `build_checked_tree` under a validity predicate). It is the reference every other build is
  tested against, the drafter's build on the CPU, and the grammar build's engine.
- `device_build.py`: the same trees for a whole Draft call with tensor ops on the drafter's device
  (bit-identical to the heap: tests/tree/test_device_tree.py).
- `drafted.py`: the drafter's entry point, `drafted_trees` (which build, per sequence a tree or a table).
- `grammar_build.py`: the verifier's build of a grammar-constrained sequence's tree from the drafter's table
  (`build_grammar_tree`, `grammar_table_width`).
- `cut.py`: the verifier's entry point for how much of each tree a step verifies, `TreeCut` (`cut` after
  each Draft call, `observe` after each step), over `budget.py` (`tree_budget`, `allocate_nodes`,
  `cost_cut`: pure functions) and `step_cost.py` (`StepCostModel`, `AcceptCalibration`: the estimates).

Entry points: the drafter calls `drafted_trees`; the verifier (verifier/drafting/step_drafter.py) calls
`build_grammar_tree` for a grammar's table and `TreeCut` for every step's trees.

It may import `ddtree.contract` (the token tree), `ddtree.telemetry` (a log line) and torch / numpy only:
no service, no model. The
grammar build takes the verifier's grammar state through a Protocol (`grammar_build.SequenceGrammar`).
"""

from __future__ import annotations

from .best_first import LEAF, MAX_TABLE_WIDTH, TokenTable, build_checked_tree, build_tree, check_table, topk_logprobs
from .budget import allocate_nodes, cost_cut, tree_budget
from .cut import TreeCut
from .device_build import build_trees
from .drafted import drafted_trees
from .grammar_build import BuiltTree, build_grammar_tree, grammar_table_width
from .step_cost import AcceptCalibration, StepCostModel, StepShape

__all__ = [
    "LEAF", "MAX_TABLE_WIDTH", "AcceptCalibration", "BuiltTree", "StepCostModel", "StepShape", "TokenTable", "TreeCut",
    "allocate_nodes", "build_checked_tree", "build_grammar_tree", "build_tree", "build_trees", "check_table",
    "cost_cut", "drafted_trees", "grammar_table_width", "topk_logprobs", "tree_budget",
]  # fmt: skip
