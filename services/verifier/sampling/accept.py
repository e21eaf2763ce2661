"""The DDTree accept walk (docs/design.md §3.4): pure function from target choices to a Verdict.

Setting. The target ran one forward over the flattened tree (root + n nodes) with the ancestor-only
mask, so its distribution at node i is p(. | context, path(i)), where path(i) is the root..i token
path. target_choice[i] is the target's token at node i: the argmax (temperature 0) or one sample
from that distribution (see sampling.py).

Walk. Start at the root; let c = target_choice[root]. While some child of the current node carries
token c, move to that child and read its choice. The walk stops at node m whose choice b is no
child's token (or m is a leaf).

Invariants.
  - accepted_nodes = (0, a_1, ..., a_k) is a root-to-node path, so it is strictly increasing
    (parents precede children) and depth(a_j) = j.
  - accepted_tokens = (root_token, tok(a_1), ..., tok(a_k)): each tok(a_j) equals
    target_choice[a_{j-1}], i.e. every committed token after the root is exactly the target's own
    choice given the committed prefix, and the bonus b = target_choice[a_k] is one more such choice.
    Hence greedy output equals autoregressive greedy decoding token for token, and at temperature > 0
    each emitted token is a fresh draw from the target's conditional (the tree does not depend on
    the target's draws).
  - len(accepted_tokens) = k + 1 = the acceptance length tau (it counts the root / bonus slot).
  - Siblings carry distinct tokens (TokenTree.validate), so the walk is unambiguous.
"""

from __future__ import annotations

from collections import abc

from torch import Tensor

from ddtree.contract.token_tree import TokenTree
from ddtree.contract.verdict import Verdict


def accept(tree: TokenTree, root_token: int, target_choice: abc.Sequence[int] | Tensor) -> Verdict:
    """Walk the tree along the target's choices.

    target_choice: n + 1 token ids (row 0 = root, row i = node i), a sequence or a 1-D tensor.
    """
    tree.validate()
    choice = target_choice.tolist() if isinstance(target_choice, Tensor) else list(target_choice)
    if len(choice) != tree.n + 1:
        raise ValueError(f"target_choice has {len(choice)} entries, expected n + 1 = {tree.n + 1}")
    children = tree.child_maps()  # children[i] = {token: child index}
    nodes = [0]
    tokens = [int(root_token)]
    cur = 0
    nxt = int(choice[0])
    while nxt in children[cur]:
        cur = children[cur][nxt]
        nodes.append(cur)
        tokens.append(nxt)
        nxt = int(choice[cur])
    return Verdict(tuple(nodes), tuple(tokens), nxt)
