"""--omp-spin-count: the engines set libgomp's GOMP_SPINCOUNT before torch loads (models/runtime/openmp_spin.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ddtree.config import DEFAULT_OMP_SPIN_COUNT, DrafterConfig, VerifierConfig, config_from_flags
from ddtree.models.runtime.openmp_spin import apply_spin_count


def test_apply_sets_the_variable_before_torch_loads():
    environ = {"PATH": "/bin"}
    assert apply_spin_count(30000, environ, torch_loaded=False) == "set"
    assert environ == {"PATH": "/bin", "GOMP_SPINCOUNT": "30000"}


@pytest.mark.parametrize("variable", ["GOMP_SPINCOUNT", "OMP_WAIT_POLICY"])
def test_an_operators_variable_wins(variable):
    environ = {variable: "passive" if variable == "OMP_WAIT_POLICY" else "5"}
    before = dict(environ)
    assert apply_spin_count(30000, environ, torch_loaded=False) == "environment"
    assert environ == before


def test_minus_one_keeps_libgomps_default_and_late_calls_write_nothing():
    environ: dict[str, str] = {}
    assert apply_spin_count(-1, environ, torch_loaded=False) == "libgomp default"
    assert apply_spin_count(30000, environ, torch_loaded=True) == "too late"
    assert environ == {}


@pytest.mark.parametrize("cls", [DrafterConfig, VerifierConfig])
def test_config_default_and_range(cls):
    assert config_from_flags(cls, None, environ={}).omp_spin_count == DEFAULT_OMP_SPIN_COUNT
    assert config_from_flags(cls, None, environ={"DDTREE_OMP_SPIN_COUNT": "-1"}).omp_spin_count == -1
    with pytest.raises(ValueError, match="omp_spin_count must be >= -1"):
        config_from_flags(cls, None, environ={"DDTREE_OMP_SPIN_COUNT": "-2"})


def _engine_start_log(service: str, flags: list[str], extra_env: dict[str, str], tmp_path) -> dict:
    """Run `ddtree SERVICE` on a directory with no checkpoint: it logs its spin setting at start, then
    exits with a one-line error. Returns the omp_spin_count log record."""
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    missing = str(tmp_path / "no-checkpoint")
    args = ["--model", missing] + (["--target", missing] if service == "drafter" else [])
    proc = subprocess.run(
        [sys.executable, "-m", "ddtree.cli", service, *args, "--port", "0", *flags],
        env={**env, **extra_env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "no config.json" in proc.stderr and "Traceback" not in proc.stderr
    records = [json.loads(line) for line in proc.stderr.splitlines() if line.startswith("{")]
    return next(r for r in records if r.get("event") == "omp_spin_count")


@pytest.mark.parametrize("service", ["drafter", "verifier"])
def test_engine_commands_set_it_before_importing_torch(service, tmp_path):
    """The real command path: "set" means torch was not in sys.modules when the variable was written,
    so libgomp reads it when torch loads. An operator's variable and -1 are left alone."""
    assert _engine_start_log(service, [], {}, tmp_path)["setting"] == "set"
    record = _engine_start_log(service, ["--omp-spin-count", "50000"], {"GOMP_SPINCOUNT": "7"}, tmp_path)
    assert (record["spins"], record["setting"]) == (50000, "environment")
    assert _engine_start_log(service, ["--omp-spin-count", "-1"], {}, tmp_path)["setting"] == "libgomp default"
