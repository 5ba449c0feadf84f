"""Run every kernel benchmark in one process, then render the tables and one speed-up chart per op.

    python -m bench                      # GPU: the full sweeps; rows appended to bench/results/<op>.jsonl
    python -m bench --quick              # CPU smoke run: tiny shapes through the Triton interpreter
    python -m bench --quick --out /tmp/r --only adamw,rms_norm

Each op's script (bench/bench_<op>.py) runs with --quick forwarded and appends its rows to <out>/<op>.jsonl, which
re-renders <out>/<op>.md (bench.common.write_rows). Then, from the rows of this run only:
- <out>/<op>.png: speed-up of ours against each baseline measured in the same run (its time / ours), one group of
  bars per shape; a dashed line at 1x. On a CPU the title says the numbers are not performance figures;
- <out>/summary.md: the same speed-ups as one table per op, with device, date and git sha.
Every row carries perf_figure (True only on a GPU; on a CPU the reference path or the Triton interpreter ran).
The end-to-end training benchmark is separate (bench/bench_train.py): it runs subprocesses for minutes.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

if not torch.cuda.is_available():
    # Read when kernels' @triton.jit decorates: set before any benchmark imports `kernels`, so that a CPU run
    # exercises our kernels through the interpreter (each script does the same when run alone).
    os.environ.setdefault("TRITON_INTERPRET", "1")

from bench import common  # noqa: E402

OPS = (
    "rms_norm",
    "cross_entropy",
    "fused_linear_cross_entropy",
    "fused_linear_preference",
    "adamw",
    "neftune",
    "rope",
    "swiglu",
    "gated_rms_norm",
    "causal_conv1d",
    "dequantize_4bit",
    "lora",
    "moe",
)
# Row keys that identify a shape (in this order in the label); the rest are measurements or context.
SHAPE_KEYS = ("mode", "model", "shape", "tokens", "hidden", "vocab", "dtype")
SPEEDUP = "speedup_vs_"


def _name(row: dict) -> str:
    """provider (or impl), with a non-default variant in brackets: cross_entropy --variant all's rows."""
    name = str(row.get("provider", row.get("impl", "")))
    variant = row.get("variant")
    return f"{name}[{variant}]" if variant not in (None, "default") else name


def speedup_series(rows: list[dict]) -> tuple[list[str], dict[str, list[float | None]]]:
    """(shape labels, {baseline: speed-up per label}) from the rows that carry speed-ups.

    A row is one of ours at one shape; its label joins its SHAPE_KEYS values, plus its provider/impl name when
    several of ours were measured (e.g. adamw's fp32 / bf16-master / stochastic-rounding variants)."""
    ours = [r for r in rows if any(k.startswith(SPEEDUP) and r[k] is not None for k in r)]
    if any(_name(r).startswith("ours") for r in ours):  # scripts that give every row speed-ups: keep ours only
        ours = [r for r in ours if _name(r).startswith("ours")]
    names = {_name(r) for r in ours}
    ops = {r.get("op") for r in ours}  # several where one script benches two ops (rms_norm and fused_add_rms_norm)
    labels, series = [], {}
    for r in ours:
        parts = [str(r[k]) for k in SHAPE_KEYS if r.get(k) is not None]
        if len(names) > 1:
            parts.insert(0, _name(r))
        if len(ops) > 1:
            parts.insert(0, str(r.get("op")))
        labels.append(" ".join(parts))
    baselines = sorted({k[len(SPEEDUP) :] for r in ours for k in r if k.startswith(SPEEDUP)})
    for b in baselines:
        series[b] = [r.get(SPEEDUP + b) for r in ours]
    return labels, series


def _draw(ax, op: str, rows: list[dict]) -> bool:
    """Grouped bars of ours' speed-up against each baseline, per shape, on ax; False when no row has speed-ups."""
    labels, series = speedup_series(rows)
    if not labels:
        return False
    width = 0.8 / max(1, len(series))
    for i, (baseline, values) in enumerate(series.items()):
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(labels))]
        ax.bar(xs, [v if v is not None else 0.0 for v in values], width, label=f"vs {baseline}")
    ax.axhline(1.0, color="black", linestyle="--", linewidth=1)
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("speed-up (baseline time / ours)")
    first = rows[0]
    note = "" if first.get("perf_figure") else "\nCPU run (reference / Triton interpreter): not performance figures"
    ax.set_title(
        f"{op} on {first.get('device')} ({first.get('date', '')[:10]}, {first.get('git_sha')}){note}", fontsize=9
    )
    ax.legend(fontsize=8)
    return True


def plot(op: str, rows: list[dict], out: Path) -> Path | None:
    """<out>/<op>.png: grouped bars of ours' speed-up against each baseline, per shape."""
    labels, series = speedup_series(rows)
    if not labels:
        return None
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(labels) * max(1, len(series)) + 2), 4.5))
    _draw(ax, op, rows)
    return common.save_figure(fig, out / f"{op}.png", dpi=120)


def chart(results: dict[str, list[dict]], path: Path) -> Path | None:
    """One PNG with a panel per op (the charts of plot() stacked): for runs that may bring back few files."""
    drawable = [(op, rows) for op, rows in results.items() if speedup_series(rows)[0]]
    if not drawable:
        return None
    plt = common.pyplot()
    widest = max(len(speedup_series(rows)[0]) * max(1, len(speedup_series(rows)[1])) for _, rows in drawable)
    fig, axes = plt.subplots(len(drawable), 1, figsize=(max(6.0, 0.9 * widest + 2), 4.5 * len(drawable)), squeeze=False)
    for ax, (op, rows) in zip(axes[:, 0], drawable):
        _draw(ax, op, rows)
    return common.save_figure(fig, path)


def summary_lines(results: dict[str, list[dict]], failures: dict[str, str]) -> list[str]:
    """The speed-ups of this run as one markdown table per op, then each failed benchmark's traceback."""
    lines = []
    for op, rows in results.items():
        labels, series = speedup_series(rows)
        first = rows[0] if rows else {}
        flag = "" if first.get("perf_figure") else " — CPU run, perf_figure=False: not performance figures"
        lines += [f"## {op}", "", f"{first.get('device')}, {first.get('date')}, git {first.get('git_sha')}{flag}", ""]
        if labels:
            lines.append("| shape | " + " | ".join(f"vs {b}" for b in series) + " |")
            lines.append("|---|" + "---|" * len(series))
            for j, label in enumerate(labels):
                cells = [f"{series[b][j]:.3g}x" if series[b][j] is not None else "" for b in series]
                lines.append(f"| {label} | " + " | ".join(cells) + " |")
            lines.append("")
    for op, error in failures.items():
        lines += [f"## {op}: FAILED", "", "```", error.strip(), "```", ""]
    return lines


def summary(results: dict[str, list[dict]], failures: dict[str, str], out: Path) -> Path:
    lines = [
        "# Kernel benchmarks: speed-ups of this run",
        "",
        "Rows in <op>.jsonl / <op>.md, charts <op>.png.",
        "",
        *summary_lines(results, failures),
    ]
    path = out / "summary.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def run(ops: list[str], argv_for: Callable[[str], list[str]]) -> tuple[dict[str, list[dict]], dict[str, str]]:
    """Each op's benchmark main(argv_for(op)) in this process: ({op: rows}, {op: traceback of a failure}).
    Rows are also written by each script to common.RESULTS/<op>.jsonl (+ .md)."""
    results: dict[str, list[dict]] = {}
    failures: dict[str, str] = {}
    for op in ops:
        print(f"== {op}", flush=True)
        module = importlib.import_module(f"bench.bench_{op}")
        try:
            results[op] = module.main(argv_for(op))
        except Exception:  # one broken benchmark must not hide the others' results
            failures[op] = traceback.format_exc()
            print(failures[op], file=sys.stderr, flush=True)
    return results, failures


def parse_ops(text: str) -> list[str] | None:
    """The ops of a comma-separated --only value, or None when one is not in OPS (or none is given)."""
    ops = [o.strip() for o in text.split(",") if o.strip()]
    return ops if ops and not set(ops) - set(OPS) else None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="forwarded to every benchmark: tiny shapes (CPU smoke run)")
    p.add_argument("--out", default=None, help="results directory (default bench/results)")
    p.add_argument("--only", default=",".join(OPS), help=f"comma-separated subset of {', '.join(OPS)}")
    p.add_argument("--no-plots", action="store_true", help="skip the matplotlib charts")
    args = p.parse_args(argv)
    ops = parse_ops(args.only)
    if ops is None:
        p.error(f"--only: choose from {', '.join(OPS)}")
    if args.out:
        common.RESULTS = Path(args.out)  # write_rows reads it at call time
    out = common.RESULTS
    out.mkdir(parents=True, exist_ok=True)
    results, failures = run(ops, lambda op: ["--quick"] if args.quick else [])
    if not args.no_plots:
        for op, rows in results.items():
            png = plot(op, rows, out)
            if png:
                print(f"chart: {png}", flush=True)
    print(f"summary: {summary(results, failures, out)}")
    if failures:
        print(f"FAILED: {', '.join(failures)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
