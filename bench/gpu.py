"""One entry point for a GPU machine (issue 16), run one part per call:

    python -m bench.gpu --part tests|kernels|train|memory|all --out DIR [--quick]

Each part ends within its --budget-s (default 540 s: the device tool stops a command at 10 minutes; the kernels
part starts no further benchmark once it is spent and names those it did not run) and writes at most 6 files to
DIR (docs/gpu_runbook.md runs several parts in one call and brings them back as one tarball). Expected wall time on
one H100, from the sizes below and the machine's recorded startup costs (not yet measured end to end: no GPU has
run it):
  tests    ~4 min  csrc built with nvcc where it exists (python setup.py build_ext --inplace, ~1-2 min), then
                   TRITON_INTERPRET=0 pytest -m gpu tests/ (the interpreter would run the kernels on host copies)
                   -> tests.md, tests.jsonl (one row per test), tests_junit.xml, pytest.log, csrc_build.log, tests.log
  kernels  ~5 min  every kernel benchmark at the issue's anchor shapes (ANCHORS) with torch eager, torch.compile
                   and liger-kernel (when importable) in the same run, through bench/__main__.py's runner
                   -> kernels.md (targets met/missed, speed-ups, each op's full table), kernels.jsonl, kernels.png,
                      kernels.log
  train    ~4 min  bench/bench_train.py: ours vs HF Trainer vs HF Trainer + liger, llama-3.2-1b dimensions (random
                   init from a config), bf16 autocast, seq 2048, micro batch 4 x 2 accumulation, 30 steps
                   -> train.md (targets, the headline table), train.jsonl, train_table.md, train.png, train.log
  memory   ~8 min  bench_train's memory ladder for the same three: largest micro batch at seq 2048 (from 4) and
                   longest sequence at micro batch 1 (from 2048); one subprocess per rung, so an OOM ends the rung
                   and the ladder goes on. --ladders picks one of the two for a call of its own when time is short
                   -> memory.md, train_memory.jsonl, train_memory.md, memory.png, memory.log
  all      the four in turn into DIR (more files than one device call brings back: for a machine of your own).
--quick runs each part at tiny sizes on a CPU (reference paths, the Triton interpreter) so that CI runs this file
end to end (tests/bench/test_gpu_entry.py); its rows say perf_figure=False.

Every row and every markdown header carries bench.common.env_info(): device, driver, CUDA, torch, triton,
transformers, peft, liger_kernel ("absent" when not installed), git sha, date and this command line. The git sha
comes from `git rev-parse` where the tree has .git; the device tool copies the working tree without it, so a run
there sets GIT_SHA in its command (docs/gpu_runbook.md); without either the rows say "unknown".
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import torch

if not torch.cuda.is_available():
    # Read when kernels' @triton.jit decorates: set before any benchmark imports `kernels` (as bench/__main__.py).
    os.environ.setdefault("TRITON_INTERPRET", "1")

from bench import __main__ as kernel_runner  # noqa: E402
from bench import bench_train, common  # noqa: E402

PARTS = ("tests", "kernels", "train", "memory")
# The issue's anchor shapes, per benchmark script (its own flags).
ANCHORS = {
    "rms_norm": ["--tokens", "8192", "--hidden", "4096", "--op", "rms_norm", "fused_add_rms_norm"],
    "cross_entropy": ["--tokens", "8192", "--vocab", "128256", "--label-smoothing", "0.1", "--variant", "all"],
    "fused_linear_cross_entropy": ["--tokens", "8192", "--hidden", "4096", "--vocab", "128256"],
    "fused_linear_preference": [],  # its GPU shapes: the issue's Llama-3.2-1B head at 8 pairs x 1024 tokens, and 8B's
    "adamw": ["--model", "llama-3.2-1b"],
    "neftune": ["--shapes", "8x4096x4096"],
    # Llama-3-8B heads (32/8 x 128), bf16: the smallest and the largest of bench_rope's GPU shapes (two, not four,
    # to keep the part's inductor compiles inside its budget).
    "rope": ["--shapes", "1x2048", "4x8192"],
    "swiglu": ["--tokens", "8192", "--inter", "14336"],  # Llama-3-8B's MLP
    "gated_rms_norm": ["--rows", "262144"],  # Qwen3.5-9B's Gated DeltaNet: 8192 tokens x 32 value heads of 128
    "causal_conv1d": ["--tokens", "8192"],  # Qwen3.5-9B's Gated DeltaNet: 8192 conv channels, 4 taps
    "dequantize_4bit": [],  # its GPU shapes: Llama-3-8B MLP and attention weights, NF4, blocksize 64, both absmaxes
    "lora": [],  # its GPU case: one Llama-3.1-8B layer's LoRA parts (r 16) at 8192 tokens, bf16
    # Qwen3-30B-A3B's experts at 8192 tokens (k 8 of 128) and gpt-oss-20b's at 4096 (k 4 of 32): 512 rows per expert
    "moe": ["--tokens-per-expert", "512"],
}
# The benchmarks that can add each row's device time (`--kernel-times`: torch.profiler's kernel time beside the wall).
KERNEL_TIMES = ("rms_norm", "rope", "swiglu", "neftune")
# --quick: each script's own tiny CPU shapes; aot_eager keeps torch.compile's baseline to seconds on a CPU.
QUICK = {
    op: ["--quick"]
    + (
        []
        if op in ("adamw", "fused_linear_preference", "dequantize_4bit", "lora", "moe")
        else ["--compile-backend", "aot_eager"]
    )
    for op in ANCHORS
}
QUICK["cross_entropy"] += ["--label-smoothing", "0.1"]
QUICK["rms_norm"] += ["--op", "rms_norm", "fused_add_rms_norm"]
TRAIN_CONFIGS = "ours,hf,hf_liger"
TRAIN_GPU = [
    "--model",
    "llama-3.2-1b",
    "--seq-len",
    "2048",
    "--micro-batch",
    "4",
    "--grad-accum",
    "2",
    "--steps",
    "30",
    "--warmup-steps",
    "5",
    "--repeats",
    "1",
]
TRAIN_QUICK = [
    "--quick",
    "--seq-len",
    "32",
    "--micro-batch",
    "2",
    "--steps",
    "3",
    "--warmup-steps",
    "1",
    "--repeats",
    "1",
]
MEMORY_GPU = [
    "--model",
    "llama-3.2-1b",
    "--seq-len",
    "2048",
    "--micro-batch",
    "4",
    "--ladder-bisect",
    "2",
    "--timeout",
    "300",
]
MEMORY_QUICK = [
    "--quick",
    "--seq-len",
    "16",
    "--micro-batch",
    "1",
    "--ladder-max-micro-batch",
    "1",
    "--ladder-max-seq-len",
    "16",
]

# The issue's targets (on an H100), as (op, what, which row, value, comparison, threshold).
Target = tuple[str, str, dict, str, str, float]
_CE = {"provider": "ours", "mode": "full", "variant": "default"}
_FLCE = {"provider": "ours", "mode": "full", "ignored": 0.0}
KERNEL_TARGETS: list[Target] = [
    ("cross_entropy", "fwd+bwd time, ms", _CE, "ms", "<=", 2.0),
    ("cross_entropy", "fwd+bwd vs liger-kernel", _CE, "speedup_vs_liger", ">=", 1.1),
    ("cross_entropy", "fwd+bwd vs torch eager (fp32 upcast, as HF)", _CE, "speedup_vs_torch", ">=", 1.6),
    ("cross_entropy", "peak extra memory / logits", _CE, "peak_extra_over_logits", "<=", 1.05),
    ("fused_linear_cross_entropy", "fwd+bwd vs eager linear + cross-entropy", _FLCE, "speedup_vs_torch", ">=", 1.0),
    ("fused_linear_cross_entropy", "peak memory / eager's", _FLCE, "peak_vs_torch", "<=", 0.35),
    ("fused_linear_cross_entropy", "fwd+bwd vs liger-kernel", _FLCE, "speedup_vs_liger", ">=", 1.3),
    (
        "fused_linear_cross_entropy",
        "time with half the labels ignored / none ignored (close to half)",
        _FLCE,
        "half_ignored_time_ratio",
        "<=",
        0.6,
    ),
    (
        "fused_linear_preference",
        "DPO head peak memory / eager's (the issue: <= 10%)",
        {"provider": "ours", "mode": "full", "pairs": 8},
        "peak_vs_torch",
        "<=",
        0.10,
    ),
    ("rms_norm", "forward GB/s", {"provider": "ours", "mode": "forward"}, "gb_s", ">=", 2700.0),
    ("rms_norm", "backward time, ms", {"provider": "ours", "mode": "backward"}, "ms", "<=", 0.090),
    (
        "rms_norm",
        "forward vs torch.compile",
        {"provider": "ours", "mode": "forward"},
        "speedup_vs_torch_compile",
        ">",
        1.0,
    ),
    (
        "rms_norm",
        "backward vs torch.compile",
        {"provider": "ours", "mode": "backward"},
        "speedup_vs_torch_compile",
        ">",
        1.0,
    ),
    ("adamw", "bf16 + fp32 master, effective GB/s", {"impl": "ours_bf16_master"}, "gb_s", ">=", 2600.0),
    ("adamw", "vs torch AdamW(fused=True)", {"impl": "ours_bf16_master"}, "speedup_vs_torch_fused_fp32", ">=", 1.0),
    ("adamw", "vs torch AdamW(foreach=True)", {"impl": "ours_bf16_master"}, "speedup_vs_torch_foreach_fp32", ">=", 2.5),
    (
        "adamw",
        "CUDA op vs Triton (bf16 master; > 1: the CUDA op is faster, make it the default)",
        {"impl": "ours_bf16_master_cuda"},
        "speedup_vs_triton",
        ">",
        1.0,
    ),
    # issue 47's target (the first plan's 3x assumed a bandwidth-bound kernel against HF's three passes)
    ("neftune", "vs the Hugging Face embedding hook", {"impl": "ours"}, "speedup_vs_hf_eager", ">=", 2.0),
    ("rope", "fwd+bwd vs liger-kernel", {"provider": "ours", "mode": "full"}, "speedup_vs_liger", ">", 1.0),
    ("rope", "fwd+bwd vs torch.compile", {"provider": "ours", "mode": "full"}, "speedup_vs_torch_compile", ">", 1.0),
]
TRAIN_TARGETS: list[Target] = [
    ("train", "tokens/s vs HF Trainer", {"impl": "ours"}, "tokens_per_s_vs_hf", ">=", 1.2),
    ("train", "peak memory vs HF Trainer", {"impl": "ours"}, "peak_memory_vs_hf", "<=", 0.5),
    ("train", "tokens/s vs HF Trainer + liger-kernel", {"impl": "ours"}, "tokens_per_s_vs_hf_liger", ">", 1.0),
]


# ---------------------------------------------------------------------------------------------------------
# Shared pieces
# ---------------------------------------------------------------------------------------------------------


class _Tee:
    """Writes to a stream and a log file alike (a part's stdout and stderr also go to DIR/<part>.log)."""

    def __init__(self, stream, log):
        self.stream, self.log = stream, log

    def write(self, text):
        self.stream.write(text)
        self.log.write(text)
        return len(text)

    def flush(self):
        self.stream.flush()
        self.log.flush()


@contextlib.contextmanager
def logged(path: Path):
    with (
        path.open("a") as log,
        contextlib.redirect_stdout(_Tee(sys.stdout, log)),
        contextlib.redirect_stderr(_Tee(sys.stderr, log)),
    ):
        yield


def matching(rows: list[dict], match: dict) -> dict | None:
    """The first row whose values equal all of match's (a missing key matches None)."""
    return next((r for r in rows if all(r.get(k) == v for k, v in match.items())), None)


def evaluate(targets: list[Target], rows: list[dict]) -> list[str]:
    """Markdown table of the targets: measured value, the target, and met / MISSED (or why there is no verdict)."""
    lines = ["| op | target | measured | wanted | verdict |", "|---|---|---|---|---|"]
    for op, what, match, key, cmp, threshold in targets:
        row = matching([r for r in rows if r.get("op", r.get("bench")) == op], match)
        value = None if row is None else row.get(key)
        if value is None:
            verdict = "no row (not measured: baseline absent or skipped)"
        elif not row.get("perf_figure"):
            verdict = "— (CPU run: not a performance figure)"
        else:
            met = {"<=": value <= threshold, ">=": value >= threshold, ">": value > threshold}[cmp]
            verdict = "met" if met else f"MISSED by {abs(value / threshold - 1):.0%}"
        shown = "" if value is None else f"{value:.4g}"
        lines.append(f"| {op} | {what} | {shown} | {cmp} {threshold:g} | {verdict} |")
    return lines


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(row, sort_keys=True) + "\n")


def header(title: str) -> list[str]:
    return [f"# {title}", "", common.env_header(common.env_info()), ""]


# ---------------------------------------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------------------------------------


def build_csrc(log: Path, timeout: float) -> dict:
    """python setup.py build_ext --inplace (kernels/_C*.so) where setup.py would build: a CUDA torch and nvcc."""
    from torch.utils.cpp_extension import CUDA_HOME

    if torch.version.cuda is None:
        reason = f"torch {torch.__version__} is not a CUDA build"
    elif CUDA_HOME is None and shutil.which("nvcc") is None:
        reason = "nvcc was not found (set CUDA_HOME)"
    else:
        reason = None
    if reason:
        log.write_text(f"skipped: {reason}\n")
        return {"status": "skipped", "reason": reason, "seconds": 0.0}
    env = dict(os.environ, KERNELWRIGHT_FORCE_CUDA_BUILD="1", MAX_JOBS=str(os.cpu_count() or 4))
    t0 = time.monotonic()
    with log.open("w") as f:
        try:
            proc = subprocess.run(
                [sys.executable, "setup.py", "build_ext", "--inplace"],
                cwd=common.ROOT,
                env=env,
                stdout=f,
                stderr=subprocess.STDOUT,
                timeout=timeout,
            )
            status = "built" if proc.returncode == 0 else "failed"
            reason = None if proc.returncode == 0 else f"exit status {proc.returncode} (see csrc_build.log)"
        except subprocess.TimeoutExpired:
            status, reason = "failed", f"timed out after {timeout:.0f} s"
    return {"status": status, "reason": reason, "seconds": round(time.monotonic() - t0, 1)}


def junit_rows(path: Path) -> list[dict]:
    """One row per test case of a pytest junit XML: test id, outcome, seconds, the failure's or skip's message."""
    rows = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", None
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = (
                    (node.get("message") or node.text or "").strip().splitlines()[0][:300]
                    if (node.get("message") or node.text)
                    else ""
                )
                break
        rows.append(
            {
                "test": f"{case.get('classname')}::{case.get('name')}",
                "outcome": outcome,
                "seconds": float(case.get("time") or 0.0),
                "message": message,
            }
        )
    return rows


def part_tests(args, out: Path, deadline: float) -> int:
    build = build_csrc(out / "csrc_build.log", max(60.0, (deadline - time.monotonic()) / 2))
    print(
        f"csrc: {build['status']}" + (f" ({build['reason']})" if build["reason"] else "") + f", {build['seconds']} s",
        flush=True,
    )
    env = dict(os.environ)
    if common.on_gpu():
        env["TRITON_INTERPRET"] = "0"  # compiled kernels on the GPU (tests/conftest.py skips gpu tests otherwise)
    junit = out / "tests_junit.xml"
    paths = ["tests/test_conftest.py", "tests/csrc"] if args.quick else ["tests"]
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-m",
        "gpu",
        "-rfEs",
        "--continue-on-collection-errors",  # a module that fails to import must not stop the other GPU tests
        "-p",
        "no:cacheprovider",
        f"--junitxml={junit}",
        *paths,
    ]
    print("$ " + " ".join(cmd[1:]), flush=True)
    with (out / "pytest.log").open("w") as log:
        try:
            proc = subprocess.run(
                cmd,
                cwd=common.ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                timeout=max(30.0, deadline - time.monotonic()),
            )
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = None
    cases = junit_rows(junit) if junit.exists() else []
    env_row = common.env_info()
    write_jsonl(
        out / "tests.jsonl",
        [{"part": "tests", **case, **env_row} for case in cases]
        + [
            {
                "part": "tests",
                "test": "csrc build",
                "outcome": build["status"],
                "seconds": build["seconds"],
                "message": build["reason"],
                **env_row,
            }
        ],
    )
    counts = {k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failed", "error", "skipped")}
    pytest_state = "timed out (budget spent)" if rc is None else f"exit status {rc}"
    lines = header("GPU tests: pytest -m gpu") + [
        f"csrc build (setup.py build_ext --inplace): **{build['status']}**"
        + (f" — {build['reason']}" if build["reason"] else "")
        + f", {build['seconds']} s",
        "",
        f"pytest {' '.join(paths)}: {pytest_state}; " + ", ".join(f"{n} {k}" for k, n in counts.items()),
        "",
        "| outcome | test | message |",
        "|---|---|---|",
    ]
    lines += [f"| {c['outcome']} | {c['test']} | {c['message'] or ''} |" for c in cases if c["outcome"] != "passed"]
    lines += ["", f"Passed ({counts['passed']}): " + ", ".join(c["test"] for c in cases if c["outcome"] == "passed")]
    (out / "tests.md").write_text("\n".join(lines) + "\n")
    failed = rc not in (0,) or build["status"] == "failed" or counts["failed"] or counts["error"]
    print(f"tests: {pytest_state}, {counts}; csrc {build['status']}", flush=True)
    return 1 if failed else 0


# ---------------------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------------------


def derived_kernel_ratios(results: dict[str, list[dict]]) -> None:
    """Ratios the targets need that no script computes: fused linear CE's time with half the labels ignored over
    its time with none, and AdamW's CUDA op against our Triton kernel for the same variant."""
    flce = results.get("fused_linear_cross_entropy", [])
    for row in flce:
        if row.get("provider") == "ours" and row.get("ignored") == 0.0:
            half = matching(
                flce,
                {
                    "provider": "ours",
                    "mode": row["mode"],
                    "ignored": 0.5,
                    "tokens": row["tokens"],
                    "hidden": row["hidden"],
                    "vocab": row["vocab"],
                },
            )
            row["half_ignored_time_ratio"] = half["ms"] / row["ms"] if half and row["ms"] > 0 else None
    adamw = {r["impl"]: r for r in results.get("adamw", [])}
    for impl, row in adamw.items():
        triton = adamw.get(impl.removesuffix("_cuda")) if impl.endswith("_cuda") else None
        if triton:
            row["speedup_vs_triton"] = triton["ms"] / row["ms"]


def kernel_flags(op: str, args) -> list[str]:
    """One benchmark's flags: its anchor shapes (its tiny ones with --quick), plus --kernel-times where it has it."""
    flags = QUICK[op] if args.quick else ANCHORS[op]
    return [*flags, "--kernel-times"] if args.kernel_times and op in KERNEL_TIMES else list(flags)


def part_kernels(args, out: Path, deadline: float) -> int:
    ops = kernel_runner.parse_ops(args.only)
    results_dir = common.RESULTS
    with tempfile.TemporaryDirectory(prefix="bench_gpu_kernels_") as scratch:
        common.RESULTS = Path(scratch)  # each script's own <op>.jsonl/.md; this part gathers them into 4 files
        results, failures, not_run = {}, {}, []
        try:
            for op in ops:  # in the order given: an op not started by the deadline is listed, not run
                if time.monotonic() > deadline:
                    not_run.append(op)
                    continue
                done, failed = kernel_runner.run([op], lambda op: kernel_flags(op, args))
                results.update(done)
                failures.update(failed)
        finally:
            common.RESULTS = results_dir
        tables = {op: (Path(scratch) / f"{op}.md").read_text().split("\n", 2)[2] for op in results}
    derived_kernel_ratios(results)
    rows = [row for op in results for row in results[op]]
    write_jsonl(out / "kernels.jsonl", rows)
    png = kernel_runner.chart(results, out / "kernels.png")
    lines = header("Kernel benchmarks at the issue-16 anchor shapes")
    lines += [
        "Flags per benchmark: " + "; ".join(f"{op} `{' '.join(kernel_flags(op, args))}`" for op in ops),
        "",
        *(
            [f"Not run: {', '.join(not_run)} (the part's --budget-s was spent before they started).", ""]
            if not_run
            else []
        ),
        "## Targets (H100)",
        "",
        *evaluate([t for t in KERNEL_TARGETS if t[0] in results], rows),
        "",
        f"## Speed-ups of this run (chart: {png.name if png else 'none'})",
        "",
        *kernel_runner.summary_lines(results, failures),
    ]
    for op, table in tables.items():
        lines += [f"## {op}: every row", "", table]
    (out / "kernels.md").write_text("\n".join(lines) + "\n")
    if not_run:
        print(f"kernels: the time budget was spent before {', '.join(not_run)} started", file=sys.stderr)
    elif time.monotonic() > deadline:
        print("kernels: over the time budget", file=sys.stderr)
    if failures:
        print(f"FAILED: {', '.join(failures)}", file=sys.stderr)
    return 1 if failures else 0


# ---------------------------------------------------------------------------------------------------------
# train and memory
# ---------------------------------------------------------------------------------------------------------


def train_chart(rows: list[dict], path: Path) -> Path | None:
    ok = [r for r in rows if r["status"] == "ok"]
    if not ok:
        return None
    plt = common.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(9, 4))
    names = [r["impl"] for r in ok]
    axes[0].bar(names, [r["tokens_per_s"] for r in ok])
    axes[0].set_ylabel("tokens/s (median step)")
    axes[1].bar(names, [r["peak_memory_gb"] for r in ok])
    axes[1].set_ylabel(f"peak memory, GB ({ok[0]['peak_memory_kind']})")
    first = ok[0]
    note = "" if first["perf_figure"] else " — CPU run: not performance figures"
    fig.suptitle(
        f"{first['model']} seq {first['seq_len']} x micro {first['micro_batch']} x accum "
        f"{first['grad_accum']} on {first['device']} ({first['git_sha']}){note}",
        fontsize=9,
    )
    return common.save_figure(fig, path)


def part_train(args, out: Path, deadline: float) -> int:
    configs = args.configs or TRAIN_CONFIGS
    n = len(configs.split(","))
    timeout = max(60.0, (deadline - time.monotonic() - 60) / n)  # the parent's model write takes the rest
    with tempfile.TemporaryDirectory(prefix="bench_gpu_train_") as scratch:
        argv = (TRAIN_QUICK if args.quick else TRAIN_GPU) + [
            "--configs",
            configs,
            "--timeout",
            f"{timeout:.0f}",
            "--out",
            scratch,
        ]
        rows = bench_train.main(argv)
        (out / "train_table.md").write_text((Path(scratch) / "train.md").read_text())
    hf_liger = next((r for r in rows if r["impl"] == "hf_liger" and r["status"] == "ok"), None)
    for row in rows:
        if row["status"] == "ok" and hf_liger and row["impl"] != "hf_liger":
            row["tokens_per_s_vs_hf_liger"] = row["tokens_per_s"] / hf_liger["tokens_per_s"]
            row["final_loss_minus_hf_liger"] = row["final_loss"] - hf_liger["final_loss"]
    write_jsonl(out / "train.jsonl", rows)
    png = train_chart(rows, out / "train.png")
    lines = header("End to end: our Trainer vs Hugging Face Trainer (+ liger-kernel)")
    lines += [
        f"`python bench/bench_train.py {' '.join(argv[:-2])}`; every row in train.jsonl, all columns in "
        f"train_table.md, chart {png.name if png else 'none'}.",
        "",
        "## Targets (H100)",
        "",
        *evaluate(TRAIN_TARGETS, [{**r, "bench": "train"} for r in rows]),
        "",
        "## Headline",
        "",
        "| trainer | status | tokens/s | vs HF | MFU | peak memory GB | vs HF | held-out loss after "
        f"{rows[0]['steps']} steps | minus HF |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def fmt(v, spec=".4g"):
        return "" if v is None else format(v, spec)

    for r in rows:
        lines.append(
            f"| {r['impl']} | {r['status']}{' (' + r['reason'] + ')' if r.get('reason') else ''} | "
            f"{fmt(r.get('tokens_per_s'), '.0f')} | {fmt(r.get('tokens_per_s_vs_hf'), '.3g')} | "
            f"{fmt(r.get('mfu'), '.1%')} | {fmt(r.get('peak_memory_gb'), '.3g')} | "
            f"{fmt(r.get('peak_memory_vs_hf'), '.3g')} | {fmt(r.get('final_loss'))} | "
            f"{fmt(r.get('final_loss_minus_hf'), '+.3g')} |"
        )
    lines += [
        "",
        "The three held-out losses should agree to bf16 noise; ours sees the blocks in another order than "
        "HF's sampler (bench_train.py's docstring), which adds its own difference.",
    ]
    (out / "train.md").write_text("\n".join(lines) + "\n")
    return 0 if all(r["status"] in ("ok", "skipped") for r in rows) else 1


def memory_chart(rows: list[dict], path: Path) -> Path | None:
    rungs = [r for r in rows if r["bench"] == "train_memory_rung"]
    ladders = sorted({r["ladder"] for r in rungs})
    if not ladders:
        return None
    plt = common.pyplot()
    fig, axes = plt.subplots(1, len(ladders), figsize=(5 * len(ladders), 4), squeeze=False)
    for ax, ladder in zip(axes[0], ladders):
        for impl in dict.fromkeys(r["impl"] for r in rungs if r["ladder"] == ladder):
            mine = sorted((r for r in rungs if r["ladder"] == ladder and r["impl"] == impl), key=lambda r: r[ladder])
            fits = [r for r in mine if r["status"] == "ok"]
            line = ax.plot([r[ladder] for r in fits], [r["peak_memory_gb"] for r in fits], marker="o", label=impl)[0]
            for r in mine:
                if r["status"] == "oom":
                    ax.axvline(r[ladder], color=line.get_color(), linestyle=":", linewidth=1)
        ax.set_xscale("log", base=2)
        ax.set_xlabel(f"{ladder} (dotted: first OOM)")
        ax.set_ylabel("peak memory, GB")
        ax.legend(fontsize=8)
    first = rows[0]
    fig.suptitle(
        f"memory ladder on {first['device']} ({first['git_sha']})"
        + ("" if first["perf_figure"] else " — CPU run: max RSS, no OOM"),
        fontsize=9,
    )
    return common.save_figure(fig, path)


def part_memory(args, out: Path, deadline: float) -> int:
    configs = args.configs or TRAIN_CONFIGS
    budget = max(30.0, deadline - time.monotonic() - 60)  # the parent's model write and the files take the rest
    argv = list(MEMORY_QUICK if args.quick else MEMORY_GPU)
    if args.seq_len:  # the seq_len ladder's first rung, the micro_batch ladder's sequence length
        argv[argv.index("--seq-len") + 1] = str(args.seq_len)
    argv += [
        "--memory-ladder",
        args.ladders,
        "--configs",
        configs,
        "--budget-s",
        f"{budget:.0f}",
        "--out",
        str(out),
    ]
    if args.max_memory_gb:
        argv += ["--max-memory-gb", str(args.max_memory_gb)]
    rows = bench_train.main(argv)  # writes train_memory.jsonl and train_memory.md to out
    png = memory_chart(rows, out / "memory.png")
    lines = header("Memory ladder: what fits, per trainer")
    lines += [
        f"`python bench/bench_train.py {' '.join(argv[:-2])}`; every rung in train_memory.jsonl / "
        f"train_memory.md, chart {png.name if png else 'none'}.",
        "",
        "| trainer | ladder | at | largest that fits | first OOM | vs HF | probes | status |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["bench"] != "train_memory":
            continue
        if r["status"] == "skipped":
            lines.append(f"| {r['impl']} | {r['ladder']} | | | | | | skipped: {r['reason']} |")
            continue
        at = f"seq_len {r['seq_len']}" if r["ladder"] == "micro_batch" else f"micro_batch {r['micro_batch']}"
        capped = f" (capped at {r['capped_at']})" if r.get("capped_at") else ""
        vs = r.get("max_fit_vs_hf")
        lines.append(
            f"| {r['impl']} | {r['ladder']} | {at} | {r['max_fit'] or 'nothing'}{capped} | "
            f"{r['first_oom'] or ''} | {'' if vs is None else f'{vs:.3g}x'} | {r['probes']} | "
            f"{r['status']}{': ' + r['stopped'] if r.get('stopped') else ''} |"
        )
    (out / "memory.md").write_text("\n".join(lines) + "\n")
    return 0 if all(r["status"] in ("ok", "skipped") for r in rows if r["bench"] == "train_memory") else 1


# ---------------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------------

RUN = {"tests": part_tests, "kernels": part_kernels, "train": part_train, "memory": part_memory}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.gpu",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    p.add_argument("--part", required=True, choices=(*PARTS, "all"))
    p.add_argument("--out", required=True, help="folder for the part's files (created)")
    p.add_argument("--quick", action="store_true", help="tiny sizes: a CPU smoke run of the entry point")
    p.add_argument(
        "--budget-s",
        type=float,
        default=540.0,
        help="seconds a part may take (default 540; the device tool stops a command at 600)",
    )
    p.add_argument(
        "--only",
        default=",".join(kernel_runner.OPS),
        help="kernels: comma-separated subset of " + ", ".join(kernel_runner.OPS),
    )
    p.add_argument(
        "--kernel-times",
        action="store_true",
        help="kernels: each row's device time beside its wall time, for " + ", ".join(KERNEL_TIMES),
    )
    p.add_argument(
        "--configs",
        default=None,
        help=f"train, memory: comma-separated subset of {', '.join(bench_train.CONFIGS)} (default {TRAIN_CONFIGS})",
    )
    p.add_argument(
        "--ladders",
        default=",".join(bench_train.LADDERS),
        help="memory: comma-separated subset of " + ", ".join(bench_train.LADDERS),
    )
    p.add_argument(
        "--max-memory-gb",
        type=float,
        default=None,
        help="memory: cap each worker's CUDA memory in GB of 1e9 bytes (85 ladders an H100 80GB, 79.6 GiB, on an H200)",
    )
    p.add_argument(
        "--seq-len",
        type=int,
        default=None,
        help="memory: the seq_len ladder's first rung and the micro_batch ladder's sequence length (default 2048)",
    )
    args = p.parse_args(argv)
    if kernel_runner.parse_ops(args.only) is None:
        p.error(f"--only: choose from {', '.join(kernel_runner.OPS)}")
    if args.budget_s <= 0:
        p.error("--budget-s must be positive")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = common.env_info()
    if env["git_sha"] == "unknown":
        print("warning: no .git here and GIT_SHA is unset: the rows will say git_sha=unknown", file=sys.stderr)
    status = 0
    for part in PARTS if args.part == "all" else (args.part,):
        deadline = time.monotonic() + args.budget_s
        with logged(out / f"{part}.log"):
            print(f"== {part} ({common.env_header(env)})", flush=True)
            t0 = time.monotonic()
            rc = RUN[part](args, out, deadline)
            print(f"== {part}: {'ok' if rc == 0 else 'FAILED'} in {time.monotonic() - t0:.0f} s", flush=True)
        status = status or rc
    return status


if __name__ == "__main__":
    sys.exit(main())
