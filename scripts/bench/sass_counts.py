"""Instruction counts of a kernel compiled ahead of time (cuobjdump -sass on its cubin; no GPU): the whole
kernel and its main loop, by opcode. The main loop is the body of the longest backward branch (a Triton K
loop, software-pipelined: what every K tile executes); the rest runs once per program (set-up, the
pipeline's prologue and epilogue, the output). Counts are per warp: each instruction is issued once by
every warp of a program.

    python -m scripts.bench.sass_counts CUBIN      # one JSON line: total, loop, loop by opcode
"""

from __future__ import annotations

import collections
import json
import pathlib
import re
import subprocess
import sys
import tempfile

_INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_BRANCH = re.compile(r"\bBRA\b[^;]*?0x([0-9a-f]+)\s*$")  # BRA 0x1960, @!P2 BRA 0x1960, BRA.U !UP0, 0x1390


def disassemble(cubin: bytes) -> str:
    import triton

    cuobjdump = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(cuobjdump), "-sass", f.name], capture_output=True, text=True, check=True).stdout


def instructions(sass: str) -> list[tuple[int, str]]:
    """(address, text) of each instruction, NOPs (alignment padding) left out."""
    rows = [(int(m.group(1), 16), m.group(2)) for m in map(_INSTRUCTION.match, sass.splitlines()) if m]
    return [(a, t) for a, t in rows if opcode(t) != "NOP"]


def opcode(text: str) -> str:
    """The mnemonic without its predicate and modifiers: '@!P2 HADD2.BF16_V2 R1, ...' -> 'HADD2'."""
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0]


def main_loop(rows: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """The instructions of the longest backward branch's body (empty: no loop)."""
    best: list[tuple[int, str]] = []
    for address, text in rows:
        m = _BRANCH.search(text)
        if m and int(m.group(1), 16) < address:
            body = [r for r in rows if int(m.group(1), 16) <= r[0] <= address]
            best = max(best, body, key=len)
    return best


def counts(cubin: bytes) -> dict:
    """total and loop instruction counts (per warp) and the loop's by opcode, most first."""
    rows = instructions(disassemble(cubin))
    loop = main_loop(rows)
    by_opcode = collections.Counter(opcode(t) for _, t in loop)
    return dict(total=len(rows), loop=len(loop), loop_opcodes=dict(by_opcode.most_common()))


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    print(json.dumps(counts(pathlib.Path(args[0]).read_bytes())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
