"""Simulate a narrower install inside the test venv: only the distributions a requirement set pulls in.

The test venv holds the test extra (transformers, triton, openai, ...), which brings packages the runtime
install may lack (numpy came that way once: `ddtree demo` failed on a fresh machine while CI was green).
`closure(requirements)` is every installed distribution those requirements reach through their own
metadata; `blocker_source(allowed)` is Python source that, run first in a fresh interpreter, makes every
import of a module that only a distribution outside `allowed` provides raise ModuleNotFoundError, as if
that distribution were not installed.
"""

from __future__ import annotations

import importlib.metadata as md
import pathlib

import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.support.paths import REPO

ROOT = REPO


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def project_name() -> str:
    return canonicalize_name(pyproject()["project"]["name"])


def package_dirs() -> dict[str, pathlib.Path]:
    """Import package -> the folder it is installed from (`ddtree` -> services/, `ddtree.kernels` -> kernels/, ...)."""
    return {name: ROOT / folder for name, folder in pyproject()["tool"]["setuptools"]["package-dir"].items()}


def import_packages() -> list[str]:
    """The package roots the project installs (one top-level name, `ddtree`, mapped onto several folders)."""
    return sorted(package_dirs())


def runtime_requirements() -> list[str]:
    return list(pyproject()["project"]["dependencies"])


def extra_requirements(exclude: tuple[str, ...] = ("test",)) -> dict[str, list[str]]:
    extras = pyproject()["project"].get("optional-dependencies", {})
    return {name: reqs for name, reqs in extras.items() if name not in exclude}


def closure(requirements: list[str]) -> set[str]:
    """Canonical names of the installed distributions `requirements` pull in (markers evaluated, no extras)."""
    seen: set[str] = set()
    todo = [Requirement(r) for r in requirements]
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name in seen:
            continue
        try:
            dist = md.distribution(req.name)
        except md.PackageNotFoundError:
            continue  # not installed here (e.g. a marker-only dependency of another platform)
        seen.add(name)
        for sub in dist.requires or ():
            r = Requirement(sub)
            if r.marker is None or r.marker.evaluate({"extra": ""}):
                todo.append(r)
    return seen


def providers() -> dict[str, set[str]]:
    """Top-level import name -> the canonical names of the installed distributions that provide it."""
    return {module: {canonicalize_name(d) for d in dists} for module, dists in md.packages_distributions().items()}


def blocked_modules(allowed: set[str]) -> list[str]:
    """Top-level names that only distributions outside `allowed` provide."""
    return sorted(m for m, dists in providers().items() if not dists & allowed and not m.startswith("_"))


def blocker_source(allowed: set[str]) -> str:
    """Python source that hides every module of a distribution outside `allowed` from imports."""
    return f"""
import sys
_BLOCKED = frozenset({blocked_modules(allowed)!r})

class _NotInstalled:
    @staticmethod
    def find_spec(name, path=None, target=None):
        top = name.partition(".")[0]
        if top in _BLOCKED:
            raise ModuleNotFoundError(f"No module named {{top!r}} (not in this install)", name=top)
        return None

sys.meta_path.insert(0, _NotInstalled)
"""
