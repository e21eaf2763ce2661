"""The project installs one import package, `ddtree`, mapped onto the design card's folders."""

from __future__ import annotations

import importlib.metadata as md
import json
import subprocess
import sys

from tests.support import installed_env as env


def test_every_package_folder_is_listed_and_nothing_else():
    listed = set(env.pyproject()["tool"]["setuptools"]["packages"])
    found = set()
    for name, folder in env.package_dirs().items():
        for init in folder.rglob("__init__.py"):
            found.add(".".join([name, *init.parent.relative_to(folder).parts]))
    assert listed == found, {"not listed": sorted(found - listed), "listed, no folder": sorted(listed - found)}
    assert {name.partition(".")[0] for name in listed} == {"ddtree"}


def test_only_ddtree_is_importable_from_outside_the_repository(tmp_path):
    """From a folder outside the checkout (no repository folder on sys.path), only `ddtree` resolves."""
    code = (
        "import importlib.util, json; print(json.dumps({n: importlib.util.find_spec(n) is not None "
        "for n in ('ddtree', 'ddtree.kernels', 'ddtree.tools', 'services', 'kernels', 'tools')}))"
    )
    res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout) == {
        "ddtree": True,
        "ddtree.kernels": True,
        "ddtree.tools": True,
        "services": False,
        "kernels": False,
        "tools": False,
    }


def test_the_distribution_declares_one_top_level_name():
    dist = md.distribution(env.pyproject()["project"]["name"])
    assert (dist.read_text("top_level.txt") or "").split() == ["ddtree"]
