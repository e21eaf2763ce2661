"""Static checks of the code itself: the layer contract over the import graph, the imports inside functions
(few, each with its reason), and ruff (lint + format).

The layers, highest first. A module may import from modules of its own group, from the other groups
of its layer when they are joined by ":" (not when joined by "|": the three services share no code and
talk over gRPC only), and from every layer below; never from a layer above. Every module of the
package belongs to exactly one group. Imports inside functions count as much as top-level ones.
"""

from __future__ import annotations

import ast
import io
import pathlib
import shutil
import subprocess
import sys
import tokenize

import pytest

from tests.support import installed_env as env

LAYERS = (
    "ddtree.cli",
    "ddtree.tools",
    "ddtree.launcher : ddtree.client : ddtree.default_checkpoint : ddtree.training",
    "ddtree.gateway | ddtree.verifier | ddtree.drafter",
    "ddtree.models | ddtree.tokenization",
    "ddtree.kernels",
    "ddtree.contract : ddtree.tree : ddtree.config : ddtree.protocol : ddtree.telemetry",
)


def _groups() -> dict[str, tuple[int, str]]:
    """group name -> (layer index, the layer's separator)."""
    out = {}
    for i, layer in enumerate(LAYERS):
        sep = "|" if "|" in layer else ":"
        for name in layer.split(sep):
            out[name.strip()] = (i, sep)
    return out


def _group_of(module: str, groups: dict[str, tuple[int, str]]) -> str | None:
    best = None
    for name in groups:
        if (module == name or module.startswith(name + ".")) and (best is None or len(name) > len(best)):
            best = name
    return best


def _modules() -> dict[str, pathlib.Path]:
    """Every module of the installed package -> its file."""
    out = {}
    for package, folder in env.package_dirs().items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out.setdefault(".".join([package, *parts]), path)
    return out


def _imports(module: str, path: pathlib.Path) -> list[tuple[str, int]]:
    """(imported ddtree module, line) for every import in the file, relative ones resolved."""
    is_package = path.name == "__init__.py"
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names if a.name.split(".")[0] == "ddtree"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] == "ddtree":
                found.append((target, node.lineno))
    return found


def layer_violations() -> list[str]:
    groups = _groups()
    problems = []
    for module, path in sorted(_modules().items()):
        if module == "ddtree":
            continue
        src = _group_of(module, groups)
        if src is None:
            problems.append(f"{module}: in no layer of the contract")
            continue
        for target, line in _imports(module, path):
            dst = _group_of(target, groups)
            if dst is None or dst == src:
                continue  # `ddtree` itself, or the module's own group
            (si, sep), (di, _) = groups[src], groups[dst]
            if di < si:
                problems.append(f"{path}:{line}: {module} ({src}) imports {target} from a higher layer ({dst})")
            elif di == si and sep == "|":
                problems.append(f"{path}:{line}: {module} ({src}) imports {target} from an independent sibling ({dst})")
    return problems


def test_the_import_graph_keeps_the_layers():
    assert not layer_violations(), "\n".join(layer_violations())


def test_the_layer_check_sees_a_back_import(monkeypatch, tmp_path):
    """The check itself: a model module that imports the verifier is reported."""
    fake_root = tmp_path / "services"
    shutil.copytree(
        env.ROOT / "services", fake_root, ignore=shutil.ignore_patterns("__pycache__", "protocol", "kernels", "tools")
    )
    target = fake_root / "models" / "layers" / "rope.py"
    target.write_text(target.read_text() + "\nfrom ddtree.verifier.step.scheduler import Scheduler  # noqa\n")
    monkeypatch.setattr(env, "package_dirs", lambda: {"ddtree": fake_root})
    problems = layer_violations()
    assert any(
        "ddtree.models.layers.rope (ddtree.models) imports ddtree.verifier.step.scheduler" in p for p in problems
    ), problems


def _top_level_imports(path: pathlib.Path) -> set[str]:
    """The first name of every absolute import in the file (lazy ones too)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_neither_the_package_nor_the_scripts_import_the_tests():
    """The installed package imports neither `tests` nor `scripts` (a checkout's folders, not installed), and
    no script imports `tests`: what a script and the tests share lives in the package (ddtree.tools.selftest)
    or in the scripts."""
    bad = [f"{path}: imports {name}" for path in _modules().values() for name in ("tests", "scripts")
           if name in _top_level_imports(path)]  # fmt: skip
    bad += [
        f"{path}: imports tests" for path in (env.ROOT / "scripts").rglob("*.py") if "tests" in _top_level_imports(path)
    ]
    assert not bad, "\n".join(bad)


# Imports inside functions under services/ (the package's own folder, kernels/ and tools/ aside): at most this
# many. Each is lazy for a reason its comment gives (an optional extra, torch kept out of the gateway's
# install), never to dodge an import cycle. cli.py is exempt: its lazy imports keep every command but the
# one run, and so torch, out of the gateway's start; the generated stubs are not hand-written.
LAZY_IMPORT_LIMIT = 15
LAZY_IMPORT_EXEMPT = ("cli.py", "protocol/ddtree/")


PRAGMAS = ("noqa", "type:", "fmt:", "pyright:")  # comments for tools, not reasons


def lazy_imports_in(source: str) -> list[tuple[int, str]]:
    """(line, reason) of every import statement inside a function of `source`. The reason is the comment on
    the statement's lines, else the comment lines right above it, or the comment of the block opener above it
    (`try:  # ...`); a statement right below another lazy import shares that one's reason (one comment above
    a block of them). Tool pragmas (noqa, ...) are no reason; "" when there is none."""
    comments, code_before = {}, {}  # line -> its comment; the code before that comment
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT and not (text := tok.string.lstrip("#").strip()).startswith(PRAGMAS):
            comments[tok.start[0]], code_before[tok.start[0]] = text, tok.line[: tok.start[1]].strip()

    def above(line: int) -> str:
        block = []
        while line in comments and not code_before[line]:
            block.insert(0, comments[line])
            line -= 1
        opener = comments[line] if line in comments and code_before[line].endswith(":") else ""
        return " ".join(block) or opener

    nodes = set()
    for fn in ast.walk(ast.parse(source)):
        if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            nodes |= {node for node in ast.walk(fn) if isinstance(node, ast.Import | ast.ImportFrom)}
    found: list[tuple[int, str]] = []
    reason_by_end: dict[int, str] = {}
    for node in sorted(nodes, key=lambda n: n.lineno):
        own = " ".join(comments[i] for i in range(node.lineno, node.end_lineno + 1) if i in comments)
        reason = own or reason_by_end.get(node.lineno - 1) or above(node.lineno - 1)
        reason_by_end[node.end_lineno] = reason
        found.append((node.lineno, reason))
    return found


def lazy_imports() -> dict[str, list[tuple[int, str]]]:
    """services/ file (relative, posix) -> its lazy imports, the exempt files aside."""
    root = env.package_dirs()["ddtree"]
    out = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if any(rel == e or rel.startswith(e) for e in LAZY_IMPORT_EXEMPT):
            continue
        if not path.resolve().is_relative_to(root.resolve()):
            continue  # services/kernels, services/tools: links to their own folders
        found = lazy_imports_in(path.read_text())
        if found:
            out[rel] = found
    return out


MAX_MODULES_PER_FOLDER = 16  # issue 46: a room a newcomer reads at a glance; more is a room to split


def test_no_folder_of_the_package_holds_more_than_16_modules():
    counts: dict[pathlib.Path, int] = {}
    for path in _modules().values():
        if path.name != "__init__.py" and "protocol" not in path.parts:  # generated gRPC stubs aside
            counts[path.parent] = counts.get(path.parent, 0) + 1
    assert len(counts) > 20, "the package's folders were not found"
    crowded = {str(folder): n for folder, n in counts.items() if n > MAX_MODULES_PER_FOLDER}
    assert not crowded, f"folders over {MAX_MODULES_PER_FOLDER} modules (split them into rooms): {crowded}"


def test_few_imports_inside_functions_each_with_its_reason():
    found = lazy_imports()
    listing = "\n".join(f"services/{rel}:{line}: {reason or '(no reason)'}" for rel, hits in found.items()
                        for line, reason in hits)  # fmt: skip
    assert sum(len(hits) for hits in found.values()) <= LAZY_IMPORT_LIMIT, listing
    assert all(reason for hits in found.values() for _, reason in hits), listing
    assert not any("cycle" in reason.lower() for hits in found.values() for _, reason in hits), listing


def test_the_lazy_import_check_reads_reasons():
    source = """
import os


def a():
    # triton is an optional extra:
    # loaded when chosen
    from x import y
    from x import z

    import q  # torch: not in the gateway's install
    try:  # is it installed?
        import w  # noqa: F401
    except ImportError:
        pass
    return os


def b():
    x = 1  # a comment, not above an import
    import bare  # noqa: F401
"""
    assert lazy_imports_in(source) == [
        (8, "triton is an optional extra: loaded when chosen"),
        (9, "triton is an optional extra: loaded when chosen"),
        (11, "torch: not in the gateway's install"),
        (13, "is it installed?"),
        (21, ""),
    ]


def _ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ruff", *args], cwd=env.ROOT, capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize("args", [("check", "."), ("format", "--check", ".")], ids=["lint", "format"])
def test_ruff(args):
    res = _ruff(*args)
    assert res.returncode == 0, (res.stdout + res.stderr)[-6000:]
