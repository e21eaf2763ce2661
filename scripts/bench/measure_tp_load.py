"""Per-rank resident memory of `ddtree verifier --tp N` on a checkpoint, against `ddtree inspect --tp N`, and
its prefill logits against a reference TP degree (issue 16's "real width on this CPU").

    python -m scripts.bench.measure_tp_load --model DIR [--tp 8] [--ref-tp 1] [--prompt-len 8] [--new-tokens 4]
        [--threads 1] [--kv-tokens 1024] [--json OUT] [--skip-logits] [--skip-verifier] [--logits-tp 8 2]
        [--fp32-ref]

Steps (each in its own processes, one after the other, so that at most one model is resident at a time):
1. `ddtree inspect DIR --tp N --json`: the weight bytes a rank holds (rank 0, the largest share).
2. The runtime's own size: a tiny checkpoint of the same layout (scripts/data/make_kimi_shaped_checkpoint.py:
   same layers, kv_lora and INT4 group, every width small) served by `ddtree verifier --tp N` the same way;
   per rank its VmHWM minus inspect's bytes for it (torch, gloo, gRPC, the services, the KV replica).
3. `ddtree verifier --model DIR --tp N --dtype bfloat16 --port 0` (rank 0 spawns ranks 1..N-1 on this CPU,
   gloo): once it prints LISTENING, VmHWM / VmRSS / RssAnon / RssFile of every rank from /proc/PID/status
   (ranks are rank 0 and its spawned children, told apart by the `tp_rank_spawned` log lines); then one
   greedy request (--prompt-len random ids, --new-tokens, autoregressive) through gRPC, its time, and the
   ranks' VmHWM again. Expected per rank = inspect + runtime; ratio = VmHWM / expected.
4. Logits (the service does not return them): the same model code in-process, N ranks over gloo
   (`load_tp_model` + `TensorParallelModel`, as the verifier runs them; `gather_logits=True`), against
   --ref-tp ranks (1: `load_target` in one process, as `ddtree verifier --tp 1` loads it): the prefill
   logits of the prompt compared with tools/selftest/compare.py's bf16 rule (|d| <= 8e-3 * max(1, max|ref|) or
   |d| <= 2.01/128 * |ref|, cosine difference <= 1e-5), argmax per row, and --new-tokens greedy tokens
   (each step re-runs the whole sequence), also compared with the verifier's tokens. --logits-tp 8 2: more
   TP degrees against the reference; --fp32-ref: the reference also in float32 (INT4 experts stay packed),
   to show the size of bf16 rounding itself (the TP-1 bf16 model against it).

Prints a table and writes everything to --json (default: measure_tp_load.json in the current directory).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
STATUS_FIELDS = ("VmHWM", "VmRSS", "RssAnon", "RssFile")
BF16_ABS, BF16_REL, BF16_COS = 8e-3, 2.01 / 128, 1e-5  # tools/selftest/compare.py's bf16 tolerances


# ---- /proc -----------------------------------------------------------------------------------------------


def proc_status(pid: int) -> dict[str, int]:
    """VmHWM, VmRSS, RssAnon, RssFile of a process, bytes."""
    text = Path(f"/proc/{pid}/status").read_text()
    out = {}
    for field in STATUS_FIELDS:
        m = re.search(rf"^{field}:\s+(\d+) kB", text, re.M)
        out[field] = int(m.group(1)) * 1024 if m else 0
    return out


def children_of(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int(re.search(r"^PPid:\s+(\d+)", (d / "status").read_text(), re.M).group(1))
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, AttributeError):
            continue
        if ppid == pid and "resource_tracker" not in cmd:
            out.append(int(d.name))
    return sorted(out)


def wait_gone(pids: list[int], timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = [p for p in pids if Path(f"/proc/{p}").exists() and not _zombie(p)]
        if not alive:
            return
        time.sleep(0.5)
    raise RuntimeError(f"processes {alive} still alive {timeout_s:.0f} s after the verifier stopped")


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def free_memory() -> dict[str, int]:
    text = Path("/proc/meminfo").read_text()
    return {k: int(re.search(rf"^{k}:\s+(\d+) kB", text, re.M).group(1)) * 1024 for k in ("MemTotal", "MemAvailable")}


# ---- inspect ---------------------------------------------------------------------------------------------


def inspect_bytes(model: str, tp: int) -> int:
    out = subprocess.run(
        [sys.executable, "-m", "ddtree.cli", "inspect", model, "--tp", str(tp), "--json"],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
    )
    return int(json.loads(out.stdout)["weight_bytes_per_rank"])


def tiny_checkpoint(model: str, root: Path) -> Path:
    """A checkpoint of DIR's layout with every width small: what the runtime alone holds."""
    text = json.loads((Path(model) / "config.json").read_text())
    text = text.get("text_config", text)
    qc = text.get("quantization_config") or {}
    group = (qc.get("config_groups") or {}).get("group_0", {}).get("weights", {}).get("group_size", 32)
    tp_heads = max(8, text["num_attention_heads"] // 8)  # divisible by 8 (any --tp up to 8)
    args = ["--out", str(root), "--layers", str(text["num_hidden_layers"]),
            "--dense-layers", str(text.get("first_k_dense_replace", 1)), "--experts", "8", "--hidden", "256",
            "--vocab", "1024", "--heads", str(tp_heads), "--q-lora", "64", "--kv-lora", str(text["kv_lora_rank"]),
            "--moe-width", str(8 * group), "--dense-width", "512", "--group", str(group), "--no-vision"]  # fmt: skip
    subprocess.run([sys.executable, "-m", "scripts.data.make_kimi_shaped_checkpoint", *args], check=True, cwd=REPO,
                   stdout=subprocess.DEVNULL)  # fmt: skip
    return root


# ---- the verifier ----------------------------------------------------------------------------------------


def serve_and_measure(model: str, tp: int, args: argparse.Namespace, log_file: Path, prompt: list[int] | None) -> dict:
    """Start the verifier, wait for LISTENING, read every rank's memory, optionally run one greedy request."""
    cmd = [sys.executable, "-m", "ddtree.cli", "verifier", "--model", model, "--tp", str(tp),
           "--dtype", "bfloat16", "--port", "0", "--kv-tokens", str(args.kv_tokens),
           "--max-context", str(args.kv_tokens), "--max-batch", "1", "--threads", str(args.threads),
           "--tp-timeout-s", str(args.tp_timeout_s), "--log-format", "json"]  # fmt: skip
    started = time.perf_counter()
    with open(log_file, "w") as log:
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, cwd=REPO)
    address = None
    ranks: dict[int, int] = {}
    try:
        for line in p.stdout:
            if line.startswith("LISTENING verifier "):
                address = line.split()[-1]
                break
        if address is None:
            p.wait(30)
            raise RuntimeError(f"verifier --tp {tp} exited with {p.returncode} before serving; log {log_file}:\n"
                               + log_file.read_text()[-3000:])  # fmt: skip
        threading.Thread(target=lambda: [None for _ in p.stdout], daemon=True).start()  # keep draining
        serve_s = time.perf_counter() - started
        time.sleep(1.0)
        ranks = rank_pids(p.pid, tp, log_file)
        loaded = {r: proc_status(pid) for r, pid in ranks.items()}
        out = {"tp": tp, "model": model, "serve_s": round(serve_s, 2), "pids": ranks, "after_load": loaded,
               "load_s": _log_value(log_file, "tp_ready", "load_s")}  # fmt: skip
        if prompt is not None:
            t0 = time.perf_counter()
            tokens, ttft = generate(address, prompt, args.new_tokens)
            out.update(tokens=tokens, ttft_s=round(ttft, 3), request_s=round(time.perf_counter() - t0, 3))
            out["after_request"] = {r: proc_status(pid) for r, pid in ranks.items()}
        return out
    finally:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(120)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        wait_gone(list(ranks.values()))


def rank_pids(pid: int, tp: int, log_file: Path) -> dict[int, int]:
    ranks = {0: pid}
    for line in log_file.read_text().splitlines():
        rec = _json(line)
        if rec.get("event") == "tp_rank_spawned":
            ranks[int(rec["rank"])] = int(rec["pid"])
    kids = children_of(pid)
    if len(ranks) != tp:  # no log lines: rank order unknown, spawn order assumed
        ranks = {0: pid, **{k + 1: c for k, c in enumerate(kids)}}
    if len(ranks) != tp or not set(list(ranks.values())[1:]) <= set(kids):
        raise RuntimeError(f"expected {tp} ranks, found pids {ranks} (children {kids})")
    return ranks


def _json(line: str) -> dict:
    try:
        rec = json.loads(line)
        return rec if isinstance(rec, dict) else {}
    except json.JSONDecodeError:
        return {}


def _log_value(log_file: Path, event: str, key: str):
    """`key` of the first `event` record (the ranks share one stderr: a line may be interleaved with another)."""
    text = log_file.read_text()
    for line in text.splitlines():
        rec = _json(line)
        if rec.get("event") == event:
            return rec.get(key)
    m = re.search(rf'"{key}": ([0-9.eE+-]+)[^\n]*?"event": "{event}"', text)
    return float(m.group(1)) if m else None


def generate(address: str, prompt: list[int], new_tokens: int) -> tuple[list[int], float]:
    import grpc

    from ddtree.protocol.ddtree.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc

    req = verifier_pb2.GenerateRequest(input_ids=prompt, max_new_tokens=new_tokens, ignore_eos=True,
                                       sampling=common_pb2.SamplingParams(temperature=0.0),
                                       spec=common_pb2.SpecOptions(no_spec=True))  # fmt: skip
    tokens: list[int] = []
    t0 = time.perf_counter()
    ttft = None
    with grpc.insecure_channel(address) as ch:
        for msg in verifier_pb2_grpc.VerifierStub(ch).Generate(req, timeout=3600):
            if msg.token_ids and ttft is None:
                ttft = time.perf_counter() - t0
            tokens.extend(msg.token_ids)
    return tokens, ttft or 0.0


# ---- logits in-process -----------------------------------------------------------------------------------


def run_ranks(model: str, world: int, dtype: str, prompt: list[int], args: argparse.Namespace, tmp: Path) -> dict:
    """The model code in `world` processes (world 1: load_target, no group); rank 0's logits and tokens."""
    out = tmp / f"logits-tp{world}-{dtype}.pt"
    store = tmp / f"store-tp{world}-{dtype}"
    threads = args.threads if world > 1 else max(args.threads, os.cpu_count() or 1)
    procs = []
    started = time.perf_counter()
    for rank in range(world):
        cmd = [sys.executable, "-m", "scripts.bench.measure_tp_load", "--child", model, str(rank), str(world),
               str(store), str(out), json.dumps(prompt), str(args.new_tokens), str(threads),
               str(args.tp_timeout_s), dtype]  # fmt: skip
        with open(f"{out}.rank{rank}.log", "w") as log:
            procs.append(subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT))
    codes = [p.wait() for p in procs]
    if any(codes):
        tails = "".join(f"--- rank {r}:\n" + Path(f"{out}.rank{r}.log").read_text()[-2000:] for r in range(world))
        raise RuntimeError(f"in-process TP {world}: rank exit codes {codes}\n{tails}")
    import torch

    res = torch.load(out)
    res["wall_s"] = round(time.perf_counter() - started, 2)
    res["hwm"] = {r: json.loads((tmp / f"{out.name}.rank{r}.json").read_text()) for r in range(world)}
    return res


def child(model: str, rank: int, world: int, store: str, out: str, prompt: list[int], new_tokens: int,
          threads: int, timeout_s: float, dtype_name: str) -> None:  # fmt: skip
    import torch

    from ddtree.models.checkpoint.loader import load_target
    from ddtree.models.layers.attention import AttentionMetadata, SeqAttention

    torch.set_num_threads(threads)
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype_name]
    t0 = time.perf_counter()
    tp = None
    if world == 1:
        model_ = load_target(model, dtype=dtype)
        runner = model_
    else:
        from ddtree.models.parallel.process_group import destroy_tp, init_tp
        from ddtree.models.parallel.tp_model import TensorParallelModel, load_tp_model
        from ddtree.verifier.tp_worker import worker_loop

        tp = init_tp(world, rank, torch.device("cpu"), timeout_s, init_method=f"file://{store}")
        model_ = load_tp_model(model, tp, dtype=dtype)
    load_s = time.perf_counter() - t0
    status = {"load_s": round(load_s, 2), **proc_status(os.getpid())}
    Path(f"{out}.rank{rank}.json").write_text(json.dumps(status))
    if tp is not None and rank > 0:
        worker_loop(model_, tp)
        destroy_tp()
        sys.stdout.flush()
        os._exit(0)
    if tp is not None:
        runner = TensorParallelModel(model_, tp, ping_interval_s=timeout_s / 4)
    kv = model_.new_kv_cache(len(prompt) + new_tokens)
    if tp is not None:
        runner.replicate_kv(kv)

    def forward(ids: list[int], all_rows: bool):
        n = len(ids)
        meta = AttentionMetadata((SeqAttention(0, n, torch.empty(0, dtype=torch.int64), torch.arange(n), None),))
        rows = None if all_rows else torch.tensor([n - 1])
        kw = {"gather_logits": True} if tp is not None else {}
        return runner.forward(torch.tensor(ids), torch.arange(n), meta, kv, logits_rows=rows, **kw)

    with torch.inference_mode():
        t1 = time.perf_counter()
        first = forward(prompt, True)
        prefill_s = time.perf_counter() - t1
        logits = first.logits.float().clone()
        tokens = [int(logits[-1].argmax())]
        t2 = time.perf_counter()
        for _ in range(new_tokens - 1):
            o = forward(prompt + tokens, False)
            tokens.append(int(o.logits.float()[-1].argmax()))
        decode_s = time.perf_counter() - t2
    if tp is not None:
        runner.close()
    status = {**json.loads(Path(f"{out}.rank{rank}.json").read_text()), "after_forward": proc_status(os.getpid())}
    Path(f"{out}.rank{rank}.json").write_text(json.dumps(status))
    torch.save({"logits": logits, "tokens": tokens, "load_s": round(load_s, 2), "prefill_s": round(prefill_s, 2),
                "greedy_steps_s": round(decode_s, 2)}, out)  # fmt: skip
    if tp is not None:
        destroy_tp()
    sys.stdout.flush()
    os._exit(0)  # skip the interpreter's teardown of gloo's threads (see tp_worker.run_worker)


def compare_logits(actual, expected) -> dict:
    a, e = actual.double(), expected.double()
    err = (a - e).abs()
    abs_tol = BF16_ABS * max(1.0, e.abs().max().item())
    passed = (err <= abs_tol) | (err <= BF16_REL * e.abs())
    cos = 1 - 2 * (a * e).sum().item() / (a * a + e * e).sum().item()
    top2 = e.topk(2, dim=-1).values
    ia, ie = a.argmax(-1), e.argmax(-1)
    mismatches = [
        {"row": r, "ref_id": int(ie[r]), "id": int(ia[r]),
         "ref_gap": (e[r, ie[r]] - e[r, ia[r]]).item(),  # how far the reference has the other's choice behind
         "gap": (a[r, ia[r]] - a[r, ie[r]]).item(), "row_max_abs_diff": err[r].max().item()}
        for r in range(e.shape[0]) if ia[r] != ie[r]
    ]  # fmt: skip
    return {
        "shape": list(e.shape),
        "max_abs_diff": err.max().item(),
        "max_abs_ref": e.abs().max().item(),
        "ref_std": e.std().item(),
        "rel_l2": ((a - e).norm() / e.norm()).item(),
        "cos_diff": cos,
        "elementwise_pass_fraction": passed.double().mean().item(),
        "worst_err_over_tol": (err / (BF16_REL * e.abs()).clamp(min=abs_tol)).max().item(),  # <= 1: all pass
        "abs_tol": abs_tol,
        "elementwise_pass": bool(passed.all()),
        "cos_pass": cos <= BF16_COS,
        "argmax_equal_rows": int((ia == ie).sum()),
        "argmax_mismatches": mismatches,
        "rows": int(e.shape[0]),
        "min_top2_margin_ref": (top2[:, 0] - top2[:, 1]).min().item(),
    }


# ---- main ------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="checkpoint directory")
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--ref-tp", type=int, default=1, help="reference TP degree of the logits comparison")
    p.add_argument("--prompt-len", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=4)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--kv-tokens", type=int, default=1024)
    p.add_argument("--tp-timeout-s", type=float, default=1800.0)
    p.add_argument("--seed", type=int, default=0, help="of the prompt ids")
    p.add_argument("--json", type=Path, default=Path("measure_tp_load.json"))
    p.add_argument("--skip-logits", action="store_true")
    p.add_argument("--skip-verifier", action="store_true")
    p.add_argument(
        "--logits-tp",
        type=int,
        nargs="*",
        default=None,
        help="TP degrees whose logits are compared with --ref-tp's (default: --tp)",
    )
    p.add_argument(
        "--fp32-ref",
        action="store_true",
        help="also --ref-tp in float32 (packed experts stay INT4): every bf16 run against it, the scale of "
        "bf16 rounding itself (needs ~2x the non-expert bytes of memory)",
    )
    p.add_argument("--save-logits", type=Path, default=None, help="directory to keep the runs' logits in (.pt)")
    p.add_argument("--child", nargs=10, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        c = args.child
        child(c[0], int(c[1]), int(c[2]), c[3], c[4], json.loads(c[5]), int(c[6]), int(c[7]), float(c[8]), c[9])
        return 0
    if not args.model:
        p.error("--model is required")
    import torch

    model = str(Path(args.model).resolve())
    vocab = json.loads((Path(model) / "config.json").read_text())
    vocab = vocab.get("text_config", vocab)["vocab_size"]
    prompt = torch.randint(0, vocab, (args.prompt_len,), generator=torch.Generator().manual_seed(args.seed)).tolist()
    files = sorted(Path(model).glob("*.safetensors"))
    report: dict = {"model": model, "checkpoint_bytes": sum(f.stat().st_size for f in files), "shards": len(files),
                    "tp": args.tp, "ref_tp": args.ref_tp, "prompt": prompt, "memory_before": free_memory()}  # fmt: skip
    print(f"checkpoint {model}: {len(files)} shards, {report['checkpoint_bytes'] / 1e9:.2f} GB; prompt {prompt}")
    with tempfile.TemporaryDirectory(prefix="measure-tp-load-") as tmp_dir:
        tmp = Path(tmp_dir)
        t0 = time.perf_counter()
        report["inspect_bytes_per_rank"] = inspect_bytes(model, args.tp)
        report["inspect_bytes_ref"] = inspect_bytes(model, args.ref_tp)
        print(f"inspect --tp {args.tp}: {report['inspect_bytes_per_rank'] / 2**20:.1f} MiB per rank; "
              f"--tp {args.ref_tp}: {report['inspect_bytes_ref'] / 2**20:.1f} MiB")  # fmt: skip
        if not args.skip_verifier:
            tiny = tiny_checkpoint(model, tmp / "tiny")
            tiny_bytes = inspect_bytes(str(tiny), args.tp)
            rt = serve_and_measure(str(tiny), args.tp, args, tmp / "verifier-tiny.log", None)
            report["runtime"] = {"tiny_inspect_bytes": tiny_bytes, "tiny": rt,
                                 "per_rank": {r: s["VmHWM"] - tiny_bytes for r, s in rt["after_load"].items()}}  # fmt: skip
            print(f"runtime (tiny checkpoint, verifier --tp {args.tp}): " + ", ".join(
                f"rank {r} {b / 2**20:.0f} MiB" for r, b in report["runtime"]["per_rank"].items()), flush=True)  # fmt: skip
            t1 = time.perf_counter()
            log_file = tmp / "verifier.log"
            try:
                full = serve_and_measure(model, args.tp, args, log_file, prompt)
            finally:
                report["verifier_log_tail"] = log_file.read_text()[-4000:] if log_file.exists() else ""
            full["wall_s"] = round(time.perf_counter() - t1, 2)
            report["verifier"] = full
            rows = []
            for r, s in full["after_load"].items():
                expected = report["inspect_bytes_per_rank"] + report["runtime"]["per_rank"][r]
                rows.append({"rank": r, "inspect": report["inspect_bytes_per_rank"],
                             "runtime": report["runtime"]["per_rank"][r], "expected": expected,
                             "vmhwm_load": s["VmHWM"], "vmrss_load": s["VmRSS"], "rss_file_load": s["RssFile"],
                             "vmhwm_request": full["after_request"][r]["VmHWM"],
                             "ratio": s["VmHWM"] / expected})  # fmt: skip
            report["table"] = rows
            print_table(rows)
            print(f"verifier --tp {args.tp}: serving after {full['serve_s']} s (load {full['load_s']} s); request "
                  f"{full['request_s']} s, first token {full['ttft_s']} s; tokens {full['tokens']}", flush=True)  # fmt: skip
        if not args.skip_logits:
            report["logits"] = logits_section(model, prompt, args, tmp, report.get("verifier", {}).get("tokens"))
        report["total_s"] = round(time.perf_counter() - t0, 1)
    args.json.write_text(json.dumps(report, indent=1, default=str))
    print(f"wrote {args.json} ({report['total_s']} s)")
    return 0


def logits_section(model: str, prompt: list[int], args: argparse.Namespace, tmp: Path, verifier_tokens) -> dict:
    worlds = args.logits_tp or [args.tp]
    todo = [(w, "bfloat16") for w in dict.fromkeys([*worlds, args.ref_tp])]
    todo += [(args.ref_tp, "float32")] if args.fp32_ref else []
    runs = {}
    for world, dtype in todo:
        key = f"tp{world}-{dtype}"
        t1 = time.perf_counter()
        runs[key] = run_ranks(model, world, dtype, prompt, args, tmp)
        r = runs[key]
        if args.save_logits is not None:
            import torch

            args.save_logits.mkdir(parents=True, exist_ok=True)
            torch.save({"prompt": prompt, "logits": r["logits"], "tokens": r["tokens"]}, args.save_logits / f"{key}.pt")
        print(f"in-process TP {world} {dtype}: load {r['load_s']} s, prefill {r['prefill_s']} s, greedy tokens "
              f"{r['tokens']} ({time.perf_counter() - t1:.1f} s)", flush=True)  # fmt: skip
    ref = f"tp{args.ref_tp}-bfloat16"
    pairs = [(f"tp{w}-bfloat16", ref) for w in worlds if w != args.ref_tp]
    if args.fp32_ref:
        pairs += [(f"tp{w}-bfloat16", f"tp{args.ref_tp}-float32") for w in dict.fromkeys([*worlds, args.ref_tp])]
    out: dict = {"runs": {k: {n: v for n, v in r.items() if n != "logits"} for k, r in runs.items()}, "compare": {}}
    for a, b in pairs:
        cmp = compare_logits(runs[a]["logits"], runs[b]["logits"])
        cmp["tokens_equal"] = runs[a]["tokens"] == runs[b]["tokens"]
        out["compare"][f"{a} vs {b}"] = cmp
        print(f"logits {a} vs {b} {cmp['shape']}: max |d| {cmp['max_abs_diff']:.4g} (max |ref| "
              f"{cmp['max_abs_ref']:.3g}, std {cmp['ref_std']:.3g}), rel L2 {cmp['rel_l2']:.3g}, cos diff "
              f"{cmp['cos_diff']:.3g} ({'<=' if cmp['cos_pass'] else '>'} {BF16_COS:g}); elementwise bf16 rule "
              f"{100 * cmp['elementwise_pass_fraction']:.3f}% of elements, worst {cmp['worst_err_over_tol']:.2f}x "
              f"the tolerance; argmax equal {cmp['argmax_equal_rows']}/{cmp['rows']}; greedy tokens equal "
              f"{cmp['tokens_equal']}", flush=True)  # fmt: skip
        for m in cmp["argmax_mismatches"]:
            print(f"  row {m['row']}: argmax {m['id']} vs ref {m['ref_id']}, {m['ref_gap']:.4g} apart in the ref, "
                  f"{m['gap']:.4g} the other way here (row max |d| {m['row_max_abs_diff']:.4g})")  # fmt: skip
    if verifier_tokens is not None:
        out["verifier_tokens"] = verifier_tokens
        out["verifier_tokens_equal_ref"] = verifier_tokens == runs[ref]["tokens"]
        print(f"verifier --tp {args.tp} greedy tokens {verifier_tokens} == in-process {ref}: "
              f"{out['verifier_tokens_equal_ref']}")  # fmt: skip
    return out


def print_table(rows: list[dict]) -> None:
    mib = 2**20
    print(f"{'rank':>4} {'inspect MiB':>12} {'runtime MiB':>12} {'expected MiB':>13} {'VmHWM MiB':>10} "
          f"{'ratio':>6} {'RssFile MiB':>12} {'VmHWM after req':>16}")  # fmt: skip
    for r in rows:
        print(f"{r['rank']:>4} {r['inspect'] / mib:>12.1f} {r['runtime'] / mib:>12.1f} {r['expected'] / mib:>13.1f} "
              f"{r['vmhwm_load'] / mib:>10.1f} {r['ratio']:>6.3f} {r['rss_file_load'] / mib:>12.1f} "
              f"{r['vmhwm_request'] / mib:>16.1f}")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
