"""Every Triton kernel a verify step launches, compiled ahead of time for a GPU (no GPU needed).

    python -m scripts.bench.compile_launches [--arch 90] [--out F] -- BENCH_STEP_ARGS
    e.g. ... -- --config docs/kimi_k26_config.json --random-weights --emulate-tp 8 --layers 2 --rows 17

The kernels run interpreted in the suite (TRITON_INTERPRET=1), which accepts programs the GPU compiler
refuses (a tl.dot under 16 wide, an oversized tile) and says nothing of registers or shared memory. So:
1. record (a child process, interpreted): `ddtree bench step BENCH_STEP_ARGS --kernels triton --no-graphs`
   with every `kernel[grid](...)` recorded instead of run: its argument types, constexprs, warps, stages,
   and which pointers and integers the JIT would specialise as divisible by 16, with the kernels' wrappers
   choosing as on that GPU (`as_on_gpu`).
   The forward reads no value back to the host (`host_syncs_per_step` is 0), so kernels that do not run
   change nothing of what is launched; only the numbers are garbage;
   The step's counts (ops per MoE layer, host syncs, Triton launches) are printed per shape: what that GPU
   launches, where the suite's interpreted counts see the interpreter's exact-fp32 stand-ins;
2. compile (here, not interpreted): each distinct launch for sm_ARCH as the GPU would build it, with
   ptxas; a row per launch: registers, stack bytes (spills), shared memory against the arch's limit, or
   the compile error.
Exits 1 when a launch does not compile or needs more shared memory than the arch has.
`--shapes` repeats step 1 over several "rows:context" shapes (AR decode, trees, contexts).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile

from ddtree.tools.roofline import as_gpu
from ddtree.tools.step_cost.triton_launches import kernel_function

# What Triton takes as launch options beside the kernel's own parameters.
LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg", "enable_fp_fusion", "launch_cooperative_grid")
SHARED_LIMIT = {90: 232448, 89: 101376, 80: 166912}  # bytes of shared memory one block may take (opt-in max)
_POINTER = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "int32": "i32", "int64": "i64", "uint8": "u8",
            "int8": "i8", "int16": "i16", "bool": "i1", "float8_e4m3fn": "fp8e4nv", "float8_e5m2": "fp8e5"}  # fmt: skip


def _is_constexpr(annotation) -> bool:
    return "constexpr" in str(annotation)


def _scalar_type(value) -> str:
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"an argument of type {type(value).__name__}")


def _constexpr_json(value):
    """A constexpr as JSON: a Triton dtype (tl.bfloat16, ...) as {"dtype": its name}, the rest as is."""
    import triton.language as tl

    return {"dtype": value.name} if isinstance(value, tl.dtype) else value


def _constexpr_value(value):
    import triton.language as tl

    return tl.dtype(value["dtype"]) if isinstance(value, dict) else value


def describe_launch(kernel, args: tuple, kwargs: dict) -> dict:
    """A launch as the compiler needs it: the kernel's module and name, each parameter's type ('*bf16',
    'i32', ...) or constexpr value, and the launch options."""
    fn = kernel_function(kernel)
    options = {k: kwargs.pop(k) for k in LAUNCH_OPTIONS if k in kwargs}
    bound = inspect.signature(fn).bind(*args, **kwargs)
    bound.apply_defaults()
    signature, constexprs, divisible = {}, {}, []
    for name, param in inspect.signature(fn).parameters.items():
        value = bound.arguments[name]
        if _is_constexpr(param.annotation) or value is None:
            constexprs[name] = _constexpr_json(value)
        elif hasattr(value, "data_ptr"):
            signature[name] = "*" + _POINTER[str(value.dtype).removeprefix("torch.")]
            aligned = value.data_ptr() % 16 == 0
        else:
            signature[name] = _scalar_type(value)
            aligned = signature[name] in ("i32", "i64") and value % 16 == 0
        if name in signature and aligned:  # the JIT's specialisation: it lets loads pipeline through shared memory
            divisible.append(name)
    return dict(module=fn.__module__, name=fn.__name__, signature=signature, constexprs=constexprs,
                divisible=divisible, num_warps=options.get("num_warps", 4),
                num_stages=options.get("num_stages", 3))  # fmt: skip


@contextlib.contextmanager
def recording(launches: list[dict]):
    """While active, `kernel[grid](...)` appends the launch to `launches` and runs nothing."""
    from triton.runtime.jit import KernelInterface

    original = KernelInterface.__getitem__

    def getitem(self, grid):
        return lambda *args, **kwargs: launches.append(describe_launch(self, args, dict(kwargs)))

    KernelInterface.__getitem__ = getitem
    try:
        yield
    finally:
        KernelInterface.__getitem__ = original


def as_on_gpu(arch: int):
    """The kernels' wrappers choose as on a GPU of `arch` (tools/roofline/as_gpu.py), an H100/H200's 132 SMs."""
    return as_gpu.as_on_gpu(arch, SHARED_LIMIT[arch], 132)


STEP_KEYS = ("rows", "context", "ops_per_step", "ops_per_moe_layer", "ops_per_moe_layer_mean", "host_syncs_per_step",
             "triton_launches_per_step", "all_reduces_per_step")  # fmt: skip


def record(step_args: list[str], arch: int) -> dict:
    """{launches: the distinct launches of `ddtree bench step step_args` as on a GPU of `arch`, step: its
    report's counts (one warm-up step first, as a served step is never a model's first), as that GPU would
    launch them}. This process must interpret Triton."""
    from ddtree.tools.bench import step

    parser = argparse.ArgumentParser()
    step.add_parser(parser.add_subparsers())
    with tempfile.TemporaryDirectory() as tmp:
        report = pathlib.Path(tmp) / "step.json"
        args = parser.parse_args(["step", *step_args, "--kernels", "triton", "--no-graphs", "--warmup", "1",
                                  "--repeat", "1", "--device", "cpu", "--out", str(report)])  # fmt: skip
        launches: list[dict] = []
        with as_on_gpu(arch), recording(launches), contextlib.redirect_stdout(sys.stderr):
            step.run(args)
        counts = json.loads(report.read_text())
    distinct = {json.dumps(x, sort_keys=True): x for x in launches}
    return dict(launches=list(distinct.values()), step={k: counts[k] for k in STEP_KEYS})


def compile_for(kernel, signature: dict, constexprs: dict, arch: int, num_warps: int, num_stages: int, attrs=None):
    """A JITFunction compiled ahead of time for sm_arch (signature: every parameter's type, "constexpr" for
    those in constexprs; attrs: the JIT's specialisations, {(index,): [["tt.divisibility", 16]]})."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    src = ASTSource(kernel, signature, constexprs, attrs or {})
    return compile(src, target=GPUTarget("cuda", arch, 32), options=dict(num_warps=num_warps, num_stages=num_stages))


def build(kernel, signature: dict, constexprs: dict, arch: int, num_warps: int, num_stages: int, attrs=None) -> dict:
    """`compile_for`'s kernel: its registers, stack bytes (spills) and shared memory, as ptxas and cuobjdump
    say, and its SASS instructions per warp, whole and in the main loop (scripts/bench/sass_counts.py)."""
    import triton

    from scripts.bench import sass_counts

    built = compile_for(kernel, signature, constexprs, arch, num_warps, num_stages, attrs)
    cuobjdump = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin") as f:
        f.write(built.asm["cubin"])
        f.flush()
        usage = subprocess.run([str(cuobjdump), "-res-usage", f.name], capture_output=True, text=True).stdout
    regs, stack = (int(re.search(rf"{key}:(\d+)", usage).group(1)) for key in ("REG", "STACK"))
    sass = sass_counts.counts(built.asm["cubin"])
    return dict(registers=regs, stack_bytes=stack, shared_bytes=built.metadata.shared, sass_total=sass["total"],
                sass_loop=sass["loop"])  # fmt: skip


def compile_launch(launch: dict, arch: int) -> dict:
    """One recorded launch built for sm_arch: `build`'s numbers, or the compile error."""
    kernel = getattr(importlib.import_module(launch["module"]), launch["name"])
    while not hasattr(kernel, "arg_names") and hasattr(kernel, "fn"):  # an Autotuner around the JITFunction
        kernel = kernel.fn
    consts = {name: _constexpr_value(v) for name, v in launch["constexprs"].items()}
    row = dict(kernel=launch["name"], constexprs=launch["constexprs"], num_warps=launch["num_warps"],
               num_stages=launch["num_stages"])  # fmt: skip
    params = list(inspect.signature(kernel.fn).parameters)
    signature = {name: launch["signature"].get(name, "constexpr") for name in params}
    attrs = {(params.index(name),): [["tt.divisibility", 16]] for name in launch["divisible"]}
    try:
        return dict(row, **build(kernel, signature, consts, arch, launch["num_warps"], launch["num_stages"], attrs))
    except Exception as err:  # the compiler's own errors are of many kinds; each is this launch's finding
        return dict(row, error=f"{type(err).__name__}: {str(err).strip()[-1500:]}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    own, step_args = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", type=int, default=90, choices=sorted(SHARED_LIMIT), help="CUDA compute capability")
    p.add_argument("--shapes", default="17:1024", help="comma-separated rows:context shapes to record")
    p.add_argument("--out", type=pathlib.Path, default=None, help="also write the rows as JSON here")
    p.add_argument("--record-only", action="store_true", help=argparse.SUPPRESS)  # the child of step 1
    args = p.parse_args(own)
    if args.record_only:
        json.dump(record(step_args, args.arch), sys.stdout)
        return 0
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("compile_launches compiles: run it without TRITON_INTERPRET=1")
    launches: dict[str, dict] = {}
    steps = []
    for shape in args.shapes.split(","):
        rows, context = shape.split(":")
        child = subprocess.run(
            [sys.executable, "-m", "scripts.bench.compile_launches", "--record-only", "--arch", str(args.arch), "--", *step_args,
             "--rows", rows, "--context", context],
            env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, check=False,
        )  # fmt: skip
        if child.returncode != 0:
            raise SystemExit(f"recording the launches of shape {shape} failed:\n{child.stderr[-3000:]}")
        recorded = json.loads(child.stdout)
        for launch in recorded["launches"]:
            launches[json.dumps(launch, sort_keys=True)] = launch
        st = recorded["step"]
        steps.append(st)
        print(f"{st['rows']} rows at {st['context']}: {st['ops_per_moe_layer']} ops per MoE layer (mean "
              f"{st['ops_per_moe_layer_mean']}), {st['host_syncs_per_step']} host syncs, "
              f"{st['triton_launches_per_step']} Triton launches per step, as sm_{args.arch} would launch them")  # fmt: skip
    import triton

    out, failed = [], 0
    for launch in sorted(launches.values(), key=lambda x: (x["name"], json.dumps(x["constexprs"], sort_keys=True))):
        row = compile_launch(launch, args.arch)
        too_big = row.get("shared_bytes", 0) > SHARED_LIMIT[args.arch]
        failed += bool("error" in row or too_big)
        out.append(dict(row, fits=not too_big and "error" not in row))
        shown = row.get("error") or f"{row['registers']} registers, {row['stack_bytes']} stack bytes, " \
                                     f"{row['shared_bytes']} shared{' (OVER THE LIMIT)' if too_big else ''}"  # fmt: skip
        print(f"sm_{args.arch} {row['kernel']:>28} w{row['num_warps']} s{row['num_stages']}: {shown}", flush=True)
    print(f"{len(out)} distinct launches, {failed} failed, triton {triton.__version__}")
    if args.out is not None:
        args.out.write_text(
            json.dumps(dict(arch=args.arch, triton=triton.__version__, steps=steps, rows=out), indent=1, default=str)
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
