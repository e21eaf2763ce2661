"""Peak resident memory of each verifier rank after loading a sharded bf16 checkpoint, at TP=1 and TP=2.

    python -m scripts.bench.measure_tp_memory

Writes the few-hundred-MB sharded checkpoint of scripts/bench/measure_load_memory.py, starts `ddtree verifier
--tp N --dtype bfloat16` as it is deployed (rank 0 spawns the other ranks; each reads only its slices),
waits until it serves, and prints every process's VmHWM; then the same verifier on the 18 MB demo target,
the runtime's own share (torch, gRPC, the services' imports).
"""

from __future__ import annotations

import argparse
import pathlib
import re
import subprocess
import sys
import tempfile
import time

from scripts.bench.measure_load_memory import write_checkpoint


def _peak_mib(pid: int) -> float:
    return int(re.search(r"VmHWM:\s+(\d+)", pathlib.Path(f"/proc/{pid}/status").read_text()).group(1)) / 1024


def serving_peaks(model: str, tp: int) -> list[float]:
    """Peak RSS of the verifier process and its children (spawned ranks first), MiB."""
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ddtree.cli",
            "verifier",
            "--model",
            model,
            "--tp",
            str(tp),
            "--dtype",
            "bfloat16",
            "--kv-tokens",
            "1024",
            "--max-context",
            "1024",
            "--threads",
            "1",
            "--log-format",
            "console",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        while "LISTENING" not in (line := p.stdout.readline()):
            if not line and p.poll() is not None:
                raise RuntimeError(f"verifier --tp {tp} exited with {p.returncode}")
        time.sleep(1)
        children = [
            int(c) for c in subprocess.run(["pgrep", "-P", str(p.pid)], capture_output=True, text=True).stdout.split()
        ]
        return [_peak_mib(p.pid)] + sorted((_peak_mib(c) for c in children), reverse=True)
    finally:
        p.terminate()
        p.wait(60)


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(
        prog="python -m scripts.bench.measure_tp_memory", description=__doc__.split("\n\n")[0]
    ).parse_args(argv)
    ckpt = write_checkpoint(pathlib.Path(tempfile.mkdtemp(prefix="tp-memory-")) / "ckpt", 100.0)
    shards = sorted(ckpt.glob("*.safetensors"))
    print(f"checkpoint {sum(f.stat().st_size for f in shards) / 2**20:.0f} MiB bf16 in {len(shards)} shards")
    for tp in (1, 2):
        peaks = serving_peaks(str(ckpt), tp)
        print(
            f"TP={tp}: peak RSS rank 0 {peaks[0]:.0f} MiB" + "".join(f", child {p:.0f} MiB" for p in peaks[1:]),
            flush=True,
        )
    print(f"runtime alone (demo target, 18 MB): {serving_peaks('checkpoints/demo/target', 1)[0]:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
