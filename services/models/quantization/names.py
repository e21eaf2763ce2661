"""Which modules a quantization_config covers: `ignore` / `modules_to_not_convert` / `targets` entries.

An entry `re:<regex>` matches a module name with `re.match` (compressed-tensors); any other entry matches
the whole name, a leading part of it up to a module boundary, or a trailing part of it from a module
boundary ("lm_head" matches "language_model.lm_head"; "model.layers.1" does not match "model.layers.11";
transformers `should_convert_module`). The special target "Linear" means every projection (a leaf name
ending in `_proj`, and `kv_a_proj_with_mqa`) and `lm_head`; the router `mlp.gate` and the embedding are
not Linear layers.
"""

from __future__ import annotations

import re
from collections.abc import Iterable


def name_matches(name: str, pattern: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return name == pattern or name.startswith(pattern + ".") or name.endswith("." + pattern)


def any_matches(names: Iterable[str], patterns: Iterable[str]) -> bool:
    patterns = tuple(patterns)
    return any(name_matches(n, p) for n in names for p in patterns)


def is_projection(module: str) -> bool:
    """An attention / MLP / expert projection (`q_a_proj`, ..., `kv_a_proj_with_mqa`, `down_proj`)."""
    leaf = module.rpartition(".")[2]
    return leaf.endswith("_proj") or leaf == "kv_a_proj_with_mqa"


def is_linear(module: str) -> bool:
    return is_projection(module) or module.rpartition(".")[2] == "lm_head"


def is_targeted(names: tuple[str, ...], targets: Iterable[str]) -> bool:
    """`names`: the module's name as stored (e.g. with a `language_model.` prefix) and as the model has it."""
    return any(is_linear(names[-1]) if t == "Linear" else any_matches(names, (t,)) for t in targets)
