"""What each install brings is enough for the code it runs, checked inside the test venv.

- runtime (`pip install -e .`): every module of the package imports with only the distributions
  [project.dependencies] pulls in, except modules that need a named optional extra (triton kernels);
- every third-party import anywhere in the package (lazy ones too) is a declared distribution: a
  runtime dependency or an optional extra, never something that only the test extra brings;
- gateway (`docker/requirements-gateway.txt`, no torch): `ddtree gateway` starts and answers a chat
  with only those distributions importable.
"""

from __future__ import annotations

import ast
import json
import pathlib
import subprocess
import sys
import time

import grpc
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from ddtree.protocol.ddtree.v1 import gateway_pb2, gateway_pb2_grpc
from tests.support import installed_env as env
from tests.support.fakes import script_for, start_fake_verifier

GATEWAY_REQUIREMENTS = env.ROOT / "docker" / "requirements-gateway.txt"
DEMO_TARGET = env.ROOT / "checkpoints" / "demo" / "target"
# The modules the `ddtree` command runs: they must import with the runtime dependencies alone.
ENTRY_MODULES = (
    "ddtree.cli",
    "ddtree.verifier.rpc.server",
    "ddtree.drafter.server",
    "ddtree.drafter.factory",
    "ddtree.gateway.api.server",
    "ddtree.gateway.api.http",
    "ddtree.launcher",
    "ddtree.client",
)


def _names(requirements: list[str]) -> set[str]:
    return {canonicalize_name(Requirement(r).name) for r in requirements}


def _run_isolated(allowed: set[str], code: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", env.blocker_source(allowed) + code],
        cwd=env.ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_every_module_imports_with_the_runtime_dependencies_alone():
    allowed = env.closure(env.runtime_requirements()) | {env.project_name()}
    optional = set().union(*(_names(reqs) for reqs in env.extra_requirements().values()))
    code = f"""
import importlib, json, pkgutil
results = {{}}
for top in {env.import_packages()!r}:
    pkg = importlib.import_module(top)
    for info in pkgutil.walk_packages(pkg.__path__, top + "."):
        try:
            importlib.import_module(info.name)
            results[info.name] = None
        except ModuleNotFoundError as err:
            results[info.name] = "missing:" + str(err.name).partition(".")[0]
        except Exception as err:
            results[info.name] = "error:" + repr(err)
from ddtree.cli import build_parser
build_parser()  # imports every command's module (train, bench, diagnose, inspect)
print(json.dumps(results))
"""
    res = _run_isolated(allowed, code)
    assert res.returncode == 0, res.stderr[-3000:]
    results = json.loads(res.stdout.strip().splitlines()[-1])
    assert len(results) > 50, f"walked only {len(results)} modules"
    errors = {m: r for m, r in results.items() if r and r.startswith("error:")}
    assert not errors, errors
    providers = env.providers()
    needs_extra = {m: r.removeprefix("missing:") for m, r in results.items() if r and r.startswith("missing:")}
    undeclared = {m: top for m, top in needs_extra.items() if not providers.get(top, {top}) & optional}
    assert not undeclared, f"modules that import a distribution neither runtime nor an optional extra: {undeclared}"
    assert not needs_extra.keys() & set(ENTRY_MODULES), {
        m: needs_extra[m] for m in needs_extra.keys() & set(ENTRY_MODULES)
    }
    for name in ENTRY_MODULES:
        assert name in results, f"{name} was not found by the walk"


def _third_party_imports(path: pathlib.Path, own: set[str]) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names = [node.module]
        else:
            continue
        for name in names:
            top = name.partition(".")[0]
            if top not in sys.stdlib_module_names and top not in own and top != "__future__":
                found.add(top)
    return found


def test_every_third_party_import_is_a_declared_distribution():
    """Lazy imports included: a function-level `import numpy` must be declared as much as a top-level one."""
    own = {name.partition(".")[0] for name in env.import_packages()}
    declared = _names(env.runtime_requirements()).union(*(_names(r) for r in env.extra_requirements().values()))
    providers = env.providers()
    undeclared = {}
    for folder in env.package_dirs().values():
        for path in sorted(folder.rglob("*.py")):
            for module in _third_party_imports(path, own):
                # not installed here (an optional extra the test venv lacks): the import name is the dist's
                dists = providers.get(module, {canonicalize_name(module)})
                if not dists & declared:
                    undeclared.setdefault(str(path.relative_to(env.ROOT)), set()).add(f"{module} ({sorted(dists)})")
    assert not undeclared, undeclared


def _gateway_requirements() -> list[str]:
    lines = [ln.split("#")[0].strip() for ln in GATEWAY_REQUIREMENTS.read_text().splitlines()]
    return [ln for ln in lines if ln]


def test_gateway_requirements_are_the_runtime_ones_without_torch():
    gateway = _gateway_requirements()
    runtime = {canonicalize_name(Requirement(r).name): r for r in env.runtime_requirements()}
    for line in gateway:  # one version range per distribution: the pyproject's
        name = canonicalize_name(Requirement(line).name)
        assert runtime.get(name) == line, f"{line!r} is not the pyproject's requirement {runtime.get(name)!r}"
    pulled = env.closure(gateway)
    assert not pulled & {"torch", "numpy", "safetensors", "triton"}, sorted(pulled)


def test_the_gateway_serves_a_completion_with_the_gateway_requirements_alone():
    """`ddtree gateway` in a process where torch, numpy and safetensors are not importable."""
    allowed = env.closure(_gateway_requirements()) | {env.project_name()}
    assert "torch" not in allowed
    from ddtree.tokenization.tokenizer import Tokenizer

    tok = Tokenizer(DEMO_TARGET)
    fake, fake_server = start_fake_verifier()
    ids = tok.encode("Hello from a gateway without torch")
    fake.reset(script_for(ids, finish="length"))
    code = f"""
import sys
from ddtree.cli import main
sys.exit(main(["gateway", "--port", "0", "--http-port", "-1", "--verifier", {fake.address!r},
               "--tokenizer", {str(DEMO_TARGET)!r}, "--log-level", "warning"]))
"""
    proc = subprocess.Popen(
        [sys.executable, "-c", env.blocker_source(allowed) + code],
        cwd=env.ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("LISTENING gateway "), (line, proc.stderr.read() if proc.poll() is not None else "")
        address = line.split()[-1]
        with grpc.insecure_channel(address) as channel:
            grpc.channel_ready_future(channel).result(timeout=30)
            stub = gateway_pb2_grpc.GatewayStub(channel)
            deadline = time.monotonic() + 30
            while True:  # the router marks the verifier healthy after its first health poll
                try:
                    chunks = list(stub.Complete(gateway_pb2.CompleteRequest(prompt="Hi"), timeout=30))
                    break
                except grpc.RpcError as err:
                    if err.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)
        text = "".join(c.text_delta for c in chunks)
        assert text == tok.decode(ids)
        assert chunks[-1].finish_reason == "length"
        assert proc.poll() is None, "the gateway exited"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        fake_server.stop(0)


def test_engine_commands_in_the_gateway_install_say_what_they_need():
    allowed = env.closure(_gateway_requirements()) | {env.project_name()}
    code = """
from ddtree.cli import main
print("EXIT", main(["train", "target", "--corpus", "x"]))
"""
    res = _run_isolated(allowed, code, timeout=60)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split()[-1] == "2"
    assert "needs torch" in res.stderr and "pip install" in res.stderr, res.stderr
