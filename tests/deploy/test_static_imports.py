"""Ordinary static tools see the `ddtree` package: pyright resolves every `ddtree.*` import, grimp draws its graph.

How: the repository carries `ddtree -> services`, `services/kernels -> ../kernels` and `services/tools -> ../tools`
as symlinks, so the import package has a folder of its own name (what editors, type checkers and import-graph
tools look for) while the code stays in the design card's folders. The install is unchanged (`package-dir`).
The reference here is the code's own text: every import statement naming `ddtree`, read with `ast`.
"""

from __future__ import annotations

import ast
import json
import pathlib
import subprocess
import sys

import grimp

from tests.support import installed_env as env

SOURCE_FOLDERS = ("services", "kernels", "tools", "tests", "scripts")


def _python_files() -> list[pathlib.Path]:
    out = []
    for folder in SOURCE_FOLDERS:
        for path in (env.ROOT / folder).rglob("*.py"):
            rel = path.relative_to(env.ROOT)
            if any(part in ("kernels", "tools") for part in rel.parts[1:2]) and rel.parts[0] == "services":
                continue  # the symlinks: the same files as kernels/ and tools/
            out.append(path)
    return sorted(out)


def _ddtree_imports(path: pathlib.Path) -> list[tuple[str, str | None]]:
    """(module, imported name or None) for every `import ddtree...` / `from ddtree... import name` in a file."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, None) for a in node.names if a.name.split(".")[0] == "ddtree"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "ddtree":
            out += [(node.module, a.name) for a in node.names if a.name != "*"]
    return out


def test_the_symlinks_point_at_the_design_card_folders():
    assert (env.ROOT / "ddtree").resolve() == (env.ROOT / "services").resolve()
    assert (env.ROOT / "services" / "kernels").resolve() == (env.ROOT / "kernels").resolve()
    assert (env.ROOT / "services" / "tools").resolve() == (env.ROOT / "tools").resolve()


def test_pyright_resolves_every_ddtree_import(tmp_path):
    """Every distinct `ddtree` import of the checkout, written into one probe file that pyright checks as an
    editor would: from the repository as its root, with the README's venv as its interpreter."""
    lines = set()
    for path in _python_files():
        for module, name in _ddtree_imports(path):
            lines.add(f"import {module}" if name is None else f"from {module} import {name}")
    assert len(lines) > 500, "the probe must cover the code's imports"
    probe_dir = env.ROOT / ".cache"
    probe_dir.mkdir(exist_ok=True)
    probe = probe_dir / "pyright_import_probe.py"
    probe.write_text("\n".join(sorted(lines)) + "\n")
    config = tmp_path / "pyrightconfig.json"
    config.write_text(
        json.dumps(
            {
                "typeCheckingMode": "off",
                "reportMissingImports": "error",
                "reportAttributeAccessIssue": "error",
                "executionEnvironments": [{"root": str(env.ROOT)}],
            }
        )
    )
    try:
        res = subprocess.run(
            [
                sys.executable,
                "-m",
                "pyright",
                "--outputjson",
                "--pythonpath",
                sys.executable,
                "-p",
                str(config),
                str(probe),
            ],
            cwd=env.ROOT,
            capture_output=True,
            text=True,
            timeout=600,
        )
    finally:
        probe.unlink(missing_ok=True)
    report = json.loads(res.stdout)
    problems = [
        f"{d['range']['start']['line'] + 1}: {d['message']}"
        for d in report["generalDiagnostics"]
        if d["severity"] == "error"
    ]
    assert report["summary"]["filesAnalyzed"] >= 1
    assert not problems, "\n".join(problems[:20])


def test_grimp_draws_every_module_and_import_of_the_package():
    graph = grimp.build_graph("ddtree")
    files = {}  # module -> its file, from the package folders on disk
    for package, folder in env.package_dirs().items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            if folder.name == "services" and parts[0] in ("kernels", "tools"):
                continue  # the symlinks: their own package folders list them
            files[".".join([package, *(parts[:-1] if parts[-1] == "__init__" else parts)])] = path
    assert set(files) <= set(graph.modules), sorted(set(files) - set(graph.modules))[:20]
    missing = []
    for module, path in sorted(files.items()):
        if ".protocol.ddtree" in module:
            continue  # generated stubs
        for target, name in _ddtree_imports(path):
            imported = f"{target}.{name}" if name and f"{target}.{name}" in graph.modules else target
            if imported != module and not graph.direct_import_exists(importer=module, imported=imported):
                missing.append(f"{module} -> {imported}")
    assert not missing, missing[:20]
    assert graph.count_imports() > 700
