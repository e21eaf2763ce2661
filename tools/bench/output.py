"""What the bench commands print and save: text tables, JSON, PNG plots (the progress bar is
`ddtree.training.progress.Progress`)."""

from __future__ import annotations

import json
import pathlib


def format_table(headers: list[str], rows: list[list]) -> str:
    """Right-aligned columns; floats with 2 decimals unless already strings."""
    cells = [[c if isinstance(c, str) else (f"{c:.2f}" if isinstance(c, float) else str(c)) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    line = lambda r: " | ".join(c.rjust(w) for c, w in zip(r, widths))  # noqa: E731
    return "\n".join([line(headers), "-+-".join("-" * w for w in widths), *(line(r) for r in cells)])


def save_json(path: pathlib.Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2))


def save_report(args, command: str, endpoint: str, rows: list[dict]) -> pathlib.Path:
    """Every bench command's result file: the command, its arguments, the endpoint measured and the rows,
    at --out (printed as `saved PATH`)."""
    out = pathlib.Path(args.out)
    arguments = {k: str(v) for k, v in vars(args).items() if k != "fn"}
    save_json(out, {"command": command, "args": arguments, "endpoint": endpoint, "rows": rows})
    print(f"saved {out}")
    return out


def pyplot():
    """matplotlib.pyplot with a file-only backend, or a clear error naming the extra to install."""
    try:
        import matplotlib
    except ModuleNotFoundError:
        raise SystemExit(
            "the PNG plot needs matplotlib: pip install 'ddtree-serve[bench]' "
            "(or pip install matplotlib), or pass --no-plot"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_context(rows: list[dict], path: pathlib.Path, title: str) -> None:
    """Three panels over context, one line per kind: tok/s (DDTree solid, AR dashed), tau, step ms."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    kinds = sorted({r["kind"] for r in rows}, key=[r["kind"] for r in rows].index)
    for i, kind in enumerate(kinds):
        rs = sorted((r for r in rows if r["kind"] == kind), key=lambda r: r["context"])
        x = [r["context"] for r in rs]
        color = f"C{i}"
        axes[0].plot(x, [r["tok_s"] for r in rs], "o-", color=color, label=f"{kind} DDTree")
        axes[0].plot(x, [r["ar_tok_s"] for r in rs], "s--", color=color, alpha=0.6, label=f"{kind} AR")
        axes[1].plot(x, [r["tau"] for r in rs], "o-", color=color, label=kind)
        axes[2].plot(x, [r["step_ms"] for r in rs], "o-", color=color, label=f"{kind} DDTree")
        axes[2].plot(x, [r["ar_step_ms"] for r in rs], "s--", color=color, alpha=0.6, label=f"{kind} AR")
    for ax, ylabel in zip(axes, ("decode tok/s", "avg commit (tokens / step)", "step ms")):
        ax.set_xlabel("context (prompt tokens)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
