"""One training step under torch.profiler: where the measured step's time goes (issue 47 item 3).

`bench/bench_train.py --profile` attaches `step_profiler(TrainerCallback)` to a configuration's trainer (ours or
transformers': both call on_step_begin / on_step_end once per optimizer step). The last step runs under
torch.profiler inside a `record_function("train_step")` range that opens at on_step_begin and closes at on_step_end
after a CUDA synchronize; every other step runs unprofiled, and the profiled step is left out of the timed median.

`summarize(spans)` turns that step's events into what the roofline (bench/roofline, `python -m bench.roofline`)
models, so each measured category stands beside its modelled one:
- `step_ms`: the train_step range, host to host (the profiler's own overhead included);
- `device_busy_ms`: the union of the device's kernel, copy and set intervals inside it; `device_idle_ms` the rest:
  time the GPU waited on the host (Python, autograd, launches, syncs), which the roofline's launch term models;
- `kernels_ms`: per category, summed kernel time (`categorize`: by kernel name, the categories of the roofline's
  table; what no rule names is `other_elementwise`, so HF's eager RMSNorm and residual adds land there and its
  `norms` / `residual_adds` rows are not separable by name), with the kernel count per category;
- `top_kernels`: the 15 kernels with the most summed time.
On a CPU there are no device events: the row has step_ms, zero device time and no kernels (a smoke run).
"""

from __future__ import annotations

import gzip
import json
import re
import shutil
import tempfile
from pathlib import Path

import torch

# Kernel-name rules, first match wins (order matters: a norm inside an optimizer name is the optimizer's).
CATEGORY_RULES = (
    ("optimizer", r"adam|multi_tensor_apply|LpNorm"),  # the foreach kernels: clipping's norm and scale, AdamW
    ("loss", r"cross_entropy|_flce_|nll_loss|log_softmax|SoftMax|softmax_warp|element_mul_kernel"),
    ("attention", r"flash|fmha|attention|_attn|sdpa|cudnn.*(mha|sdpa)"),
    ("matmuls", r"gemm|gemv|cutlass|xmma|nvjet|cublas|wgmma|splitK|Kernel2|matmul"),
    ("norms", r"rms_norm|layer_norm|rmsnorm"),
    ("rope", r"rope|rotary"),
    ("mlp_activation", r"swiglu|silu|glu_"),
    ("copies", r"^Memcpy|^Memset|memcpy|memset"),
)
CATEGORIES = tuple(name for name, _ in CATEGORY_RULES) + ("other_elementwise",)
_COMPILED = tuple((name, re.compile(pattern, re.IGNORECASE)) for name, pattern in CATEGORY_RULES)
RANGE = "train_step"
TOP = 15


def categorize(kernel: str) -> str:
    """The roofline category a device event's name belongs to (`other_elementwise` when no rule matches)."""
    for name, pattern in _COMPILED:
        if pattern.search(kernel):
            return name
    return "other_elementwise"


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def summarize(step: tuple[float, float], device_events: list[tuple[str, float, float]]) -> dict:
    """step: the train_step range (start_us, end_us); device_events: (name, start_us, end_us) of every kernel, copy
    and set on the device. Events outside the range are left out (a kernel still running at its end is cut
    there)."""
    lo, hi = step
    inside = [(n, max(a, lo), min(b, hi)) for n, a, b in device_events if b > lo and a < hi]
    per_cat = dict.fromkeys(CATEGORIES, 0.0)
    count = dict.fromkeys(CATEGORIES, 0)
    per_kernel: dict[str, float] = {}
    for name, a, b in inside:
        cat = categorize(name)
        per_cat[cat] += b - a
        count[cat] += 1
        per_kernel[name] = per_kernel.get(name, 0.0) + (b - a)
    busy = _union_us([(a, b) for _, a, b in inside])
    step_us = hi - lo
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:TOP]
    return {
        "step_ms": step_us / 1e3,
        "device_busy_ms": busy / 1e3,
        "device_idle_ms": (step_us - busy) / 1e3,
        "device_events": len(inside),
        "kernels_ms": {k: round(v / 1e3, 4) for k, v in per_cat.items()},
        "kernel_counts": count,
        "top_kernels": [{"name": n[:160], "ms": round(us / 1e3, 4), "category": categorize(n)} for n, us in top],
    }


DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")  # a Chrome trace's device work (not its gpu_user_annotation)


def events_of(trace: dict) -> tuple[tuple[float, float], list[tuple[str, float, float]]]:
    """The train_step range (the host's, as the CPU annotation spans it) and the device's kernels, copies and sets, as
    (name, start_us, end_us), from a Chrome trace that torch.profiler exported. The trace's categories tell device
    work from the annotations the profiler mirrors onto the device timeline (a `train_step` and an optimizer's
    `Optimizer.step#...` there span kernels; counting them would count those kernels twice)."""
    step = None
    device = []
    for e in trace["traceEvents"]:
        cat = e.get("cat")
        if cat in DEVICE_CATS:
            device.append((e["name"], float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))))
        elif cat == "user_annotation" and e.get("name") == RANGE and step is None:
            step = (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
    if step is None:
        raise RuntimeError(f"the trace holds no {RANGE!r} range")
    return step, device


def read_trace(path: Path) -> dict:
    """A Chrome trace as written by `step_profiler` (gzipped) or by torch.profiler (plain JSON)."""
    raw = path.read_bytes()
    return json.loads(gzip.decompress(raw) if path.suffix == ".gz" else raw)


def step_profiler(base, profile_step: int, trace_path: Path | None):
    """A callback of either trainer that profiles optimizer step `profile_step` (0-based) and keeps its summary in
    `.summary` (and a gzipped Chrome trace at trace_path, when given)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    class StepProfiler(base):
        def __init__(self):
            self.step = 0
            self.summary: dict | None = None
            self._prof = None
            self._range = None

        def on_step_begin(self, args, state, control, **kwargs):
            if self.step == profile_step:
                activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                self._prof = profile(activities=activities)
                self._prof.__enter__()
                self._range = record_function(RANGE)
                self._range.__enter__()
            return control

        def on_step_end(self, args, state, control, **kwargs):
            if self._prof is not None:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                self._range.__exit__(None, None, None)
                self._prof.__exit__(None, None, None)
                with tempfile.TemporaryDirectory() as tmp:
                    raw = Path(tmp) / "trace.json"
                    self._prof.export_chrome_trace(str(raw))
                    self.summary = summarize(*events_of(read_trace(raw)))
                    if trace_path is not None:
                        trace_path.parent.mkdir(parents=True, exist_ok=True)
                        with raw.open("rb") as src, gzip.open(trace_path, "wb") as dst:
                            shutil.copyfileobj(src, dst)
                self._prof = self._range = None
            self.step += 1
            return control

    return StepProfiler()


def write_markdown(path: Path, rows: list[dict], source: str) -> None:
    """train_profile.md: the title, `source` (where and how the rows were measured), the table of `markdown`."""
    title = "# One training step under torch.profiler, per configuration"
    path.write_text("\n".join([title, "", source, "", *markdown(rows)]) + "\n")


def markdown(rows: list[dict]) -> list[str]:
    """A table of the profiled rows: one column per configuration, one row per category (ms), then busy and idle."""
    rows = [r for r in rows if r.get("profile")]
    if not rows:
        return []
    head = "| ms in the profiled step | " + " | ".join(r["impl"] for r in rows) + " |"
    lines = [head, "|---" * (len(rows) + 1) + "|"]
    for cat in CATEGORIES:
        lines.append(
            f"| {cat} | "
            + " | ".join(f"{r['profile']['kernels_ms'][cat]:.2f} ({r['profile']['kernel_counts'][cat]})" for r in rows)
            + " |"
        )
    for key in ("device_busy_ms", "device_idle_ms", "step_ms"):
        lines.append(f"| {key} | " + " | ".join(f"{r['profile'][key]:.2f}" for r in rows) + " |")
    lines.append(
        "| unprofiled median step_ms | " + " | ".join(f"{r.get('step_ms', float('nan')):.2f}" for r in rows) + " |"
    )
    lines += ["", "(kernel counts in brackets)", ""]
    for r in rows:
        lines.append(
            f"Top kernels, {r['impl']}: "
            + "; ".join(f"{k['name'][:80]} {k['ms']:.2f} ms [{k['category']}]" for k in r["profile"]["top_kernels"])
        )
        lines.append("")
    return lines


def main(argv=None) -> int:
    """Re-read committed traces: `python -m bench.step_profile --rows train.jsonl --out train_profile.md TRACE...`
    summarizes each trace (profile_<impl>.json.gz) into its row of train.jsonl and writes the table."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m bench.step_profile", description=main.__doc__)
    p.add_argument("traces", nargs="+", type=Path, help="profile_<impl>.json.gz files written by bench_train --profile")
    p.add_argument("--rows", required=True, type=Path, help="the train.jsonl of the same run")
    p.add_argument("--out", required=True, type=Path, help="the markdown file to write")
    args = p.parse_args(argv)
    rows = {r["impl"]: r for r in map(json.loads, args.rows.read_text().splitlines()) if r.get("status") == "ok"}
    picked = []
    for trace in args.traces:
        impl = trace.name.removeprefix("profile_").split(".")[0]
        if impl not in rows:
            p.error(f"{trace}: no ok row for {impl!r} in {args.rows}")
        picked.append({**rows[impl], "profile": summarize(*events_of(read_trace(trace)))})
    head = rows[picked[0]["impl"]]
    source = (
        f"Measured on {head['device']}, git {head['git_sha']}, {head['date']}; the rows' command "
        f"`{head.get('command')}`; summarized by `python -m bench.step_profile` from the traces "
        + ", ".join(t.name for t in args.traces)
    )
    write_markdown(args.out, picked, source)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
