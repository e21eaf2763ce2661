"""Static checks of the code itself: the layer contract over the import graph, and ruff (lint + format).

The layers, highest first. A module may import from modules of its own group, from the other groups
of its layer when they are joined by ":" (not when joined by "|": the three services share no code and
talk over gRPC only), and from every layer below; never from a layer above. Every module of the
package belongs to exactly one group. Imports inside functions count as much as top-level ones.
"""

from __future__ import annotations

import ast
import pathlib
import shutil
import subprocess
import sys

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


def _ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ruff", *args], cwd=env.ROOT, capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize("args", [("check", "."), ("format", "--check", ".")], ids=["lint", "format"])
def test_ruff(args):
    res = _ruff(*args)
    assert res.returncode == 0, (res.stdout + res.stderr)[-6000:]
