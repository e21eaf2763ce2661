"""The device runner (scripts/device/) cannot rot between the GPU runs it exists for: the wheels it carries
cover what the device image lacks of pyproject's runtime dependencies, at versions the generated stubs and
pyproject accept, and the selftest options its script passes are options of `ddtree selftest gpu`."""

from __future__ import annotations

import argparse
import re
import subprocess

import pytest
import tomllib

from scripts.device import wheels
from tests.support import installed_env as env

SCRIPT = env.ROOT / "scripts" / "device" / "selftest_gpu.sh"


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~; \[]", requirement, maxsplit=1)[0].strip().lower().replace("_", "-")


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


def _runtime_requirements() -> dict[str, str]:
    project = tomllib.loads((env.ROOT / "pyproject.toml").read_text())["project"]
    return {_name(r): r for r in project["dependencies"]}


def test_every_runtime_dependency_is_on_the_image_or_carried():
    needed = set(_runtime_requirements())
    assert needed - wheels.IMAGE_HAS - set(wheels.CARRY) == set()
    assert not wheels.IMAGE_HAS & set(wheels.CARRY), "a package both on the image and carried"


def test_carried_pins_meet_pyproject_and_the_generated_stubs():
    requirements = _runtime_requirements()
    for name, pin in wheels.CARRY.items():
        floor = re.search(r">=\s*([0-9.]+)", requirements.get(name, ""))
        if floor:
            assert _version(pin) >= _version(floor.group(1)), (name, pin, requirements[name])
    stubs = env.ROOT / "services" / "protocol" / "ddtree" / "v1"
    protobuf = re.search(r"# Protobuf Python Version: ([0-9.]+)", (stubs / "common_pb2.py").read_text()).group(1)
    grpc = re.search(r"GRPC_GENERATED_VERSION = '([0-9.]+)'", (stubs / "drafter_pb2_grpc.py").read_text()).group(1)
    assert _version(wheels.CARRY["protobuf"]) >= _version(protobuf)
    assert _version(wheels.CARRY["grpcio"]) >= _version(grpc)


def test_the_script_parses_and_passes_only_options_the_selftest_has():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    from ddtree.tools.selftest import gpu

    parser = gpu.add_parser(argparse.ArgumentParser().add_subparsers())
    known = {opt for action in parser._actions for opt in action.option_strings}
    text = SCRIPT.read_text()
    calls = re.findall(r"ddtree\.cli selftest gpu (.*?)(?<!\\)\n", text, flags=re.S)
    assert len(calls) == 2
    passed = {opt for call in calls for opt in re.findall(r"(--[a-z][a-z-]*)", call)}
    assert passed and passed <= known, passed - known


def test_the_selftest_records_a_given_commit_only_when_git_cannot_tell(tmp_path, monkeypatch):
    from ddtree.tools.selftest import gpu

    parser = gpu.add_parser(argparse.ArgumentParser().add_subparsers())
    assert parser.parse_args(["--commit", "a5df73f"]).commit == "a5df73f"
    with pytest.raises(SystemExit):
        parser.parse_args(["--commit", "HEAD; rm -rf /"])
    assert gpu.provenance("cpu", ["ddtree"], "a5df73f")["commit"] != "a5df73f (given)"  # git tells, and wins
    monkeypatch.setattr(gpu, "CHECKOUT", tmp_path)  # a copied tree: no git
    assert gpu.provenance("cpu", ["ddtree"], "a5df73f")["commit"] == "a5df73f (given)"
    assert gpu.provenance("cpu", ["ddtree"])["commit"] == "unknown"


def test_carried_wheels_meet_each_others_requirements():
    """A carried wheel's own requirements (its metadata, read from this install where it is installed at the
    carried version) are carried at versions they accept, or on the image: pydantic-core needs
    typing-extensions >= 4.16, newer than the image may hold, so it is carried."""
    from importlib import metadata

    from packaging.requirements import Requirement

    checked = 0
    for name, pin in wheels.CARRY.items():
        try:
            if metadata.version(name) != pin:
                continue
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        for text in requires:
            req = Requirement(text)
            if req.marker and not req.marker.evaluate({"extra": "", "python_version": "3.12"}):
                continue
            dep = _name(req.name)
            assert dep in wheels.CARRY or dep in wheels.IMAGE_HAS, (name, text)
            if dep in wheels.CARRY:
                assert req.specifier.contains(wheels.CARRY[dep], prereleases=True), (name, text, wheels.CARRY[dep])
            checked += 1
    assert checked and _version(wheels.CARRY["typing-extensions"]) >= (4, 16)
