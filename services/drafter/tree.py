"""The drafter's tree builder: the best-first DDTree build over its per-depth marginals.

One copy, shared with the verifier (which builds the trees of grammar-constrained sequences from the
drafter's top-K table): `ddtree.contract.tree_build`. Imported here under the drafter's names.
"""

from __future__ import annotations

from ddtree.contract.tree_build import MAX_TABLE_WIDTH, TokenTable, build_tree, check_table, topk_logprobs

__all__ = ["MAX_TABLE_WIDTH", "TokenTable", "build_tree", "check_table", "topk_logprobs"]
