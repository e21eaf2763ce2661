"""Shared fixtures: the default checkpoint (built once per session) and service stacks as processes."""

from __future__ import annotations

import os
import pathlib

import pytest

from tests.support.paths import ORACLE_DRAFTER

# Triton kernels run under the interpreter on machines without a GPU; the variable must be set before
# anything (transformers included) imports triton, so it is set here, before test modules load.
if not pathlib.Path("/dev/nvidia0").exists():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# Tests that run services as processes (tests/e2e, a test on a shared stack, a module that starts services):
# one xdist group, so with `-n 2 --dist loadgroup` they run one at a time on one worker while the other takes
# the rest (mostly interpreted kernels); their timing bounds see the load of one other test, never of a second
# stack beside theirs. A test marked `beside_stacks` is left out of the group: its stack's verifier runs
# interpreted kernels (one busy process, as an interpreted kernel test is) and it bounds no time.
SERVICE_STACKS = {"oracle_stack", "dflash_stack"}
STARTS_SERVICES = ("start_stack(", "start_service(", "fuzz_suite")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which turns the group markers into node ids
def pytest_collection_modifyitems(config, items):
    starts: dict[pathlib.Path, bool] = {}
    for item in items:
        path = pathlib.Path(str(item.fspath))
        if path not in starts:
            starts[path] = path.parent.name == "e2e" or any(s in path.read_text() for s in STARTS_SERVICES)
        if item.get_closest_marker("beside_stacks"):
            continue
        if starts[path] or SERVICE_STACKS & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.xdist_group("services"))


@pytest.fixture(scope="session")
def default_ckpt(tmp_path_factory):
    """The default random checkpoint, built the way first use builds it (DDTREE_HOME or a temp dir)."""
    from ddtree.default_checkpoint import ensure_default_checkpoint

    base = os.environ.get("DDTREE_TEST_HOME") or tmp_path_factory.mktemp("ddtree-home")
    return ensure_default_checkpoint(pathlib.Path(base))


def _stack(default_ckpt, tmp_path_factory, name, drafter_args=(), verifier_args=(), drafter_module="ddtree.cli"):
    from ddtree.launcher import start_stack

    log_dir = tmp_path_factory.mktemp(f"logs-{name}")
    return start_stack(
        str(default_ckpt.target),
        str(default_ckpt.drafter),
        log_dir,
        drafter_args=tuple(drafter_args),
        verifier_args=tuple(verifier_args),
        drafter_module=drafter_module,
    )


@pytest.fixture(scope="session")
def oracle_stack(default_ckpt, tmp_path_factory):
    """Drafter = the oracle engine (the target's own continuation with noise): real multi-token acceptance."""
    stack = _stack(
        default_ckpt,
        tmp_path_factory,
        "oracle",
        ["--oracle-seed", "7"],
        ["--max-batch", "8", "--kv-tokens", "32768", "--max-context", "2048", "--prefill-chunk", "64"],
        drafter_module=ORACLE_DRAFTER,
    )
    yield stack
    stack.stop()


@pytest.fixture(scope="session")
def dflash_stack(default_ckpt, tmp_path_factory):
    """Drafter = the random DFlash model of the default checkpoint."""
    stack = _stack(
        default_ckpt,
        tmp_path_factory,
        "dflash",
        [],
        ["--max-batch", "8", "--kv-tokens", "32768", "--max-context", "2048"],
    )
    yield stack
    stack.stop()


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    """The default BPE tokenizer (stdlib-trained, Kimi specials), trained once per session."""
    from ddtree.tokenization.default_tokenizer import write_default_tokenizer

    d = tmp_path_factory.getbasetemp() / "default-tokenizer"
    if not (d / "tokenizer_config.json").is_file():
        write_default_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def tok(tokenizer_dir):
    from ddtree.tokenization.tokenizer import Tokenizer

    return Tokenizer(tokenizer_dir)


@pytest.fixture(scope="module")
def fake():
    """The fake verifier of the gateway tests (tests/support/fakes.py), one per test module."""
    from tests.support.fakes import start_fake_verifier

    servicer, running = start_fake_verifier()
    yield servicer
    running.stop(0)


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    """The sharpened 8-token target of the exact-sampling tests (tests/support/tiny_target.py), one per module."""
    from tests.support.tiny_target import build_tiny_target

    return build_tiny_target(tmp_path_factory.mktemp("tiny"))
