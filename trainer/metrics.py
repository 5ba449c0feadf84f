"""Metrics: throughput, MFU, memory, and where they are written (console, metrics.jsonl, tensorboard).

MFU = achieved model FLOP/s / the device's peak dense bf16 FLOP/s, with the model's FLOPs per token from
`CausalLM.flops_per_token` (6N + attention). The peak is known for the GPUs we are measured on; on a CPU,
or on an unknown device, MFU is not reported (None) rather than guessed.
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
from pathlib import Path

import torch

# Dense (no sparsity) peak TFLOP/s for bf16/fp16 tensor-core math, from the vendors' data sheets.
PEAK_TFLOPS = {
    "H100 SXM": 989.0,
    "H100 NVL": 835.0,
    "H100 PCIe": 756.0,
    "H100": 989.0,
    "H200": 989.0,
    "A100": 312.0,
    "L40S": 362.0,
    "A10G": 125.0,
    "RTX 4090": 165.0,
}


def device_peak_flops(device: torch.device | None = None) -> float | None:
    """Peak dense bf16 FLOP/s of the CUDA device, or None where it is not known."""
    if device is not None and torch.device(device).type != "cuda":
        return None
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    for key in sorted(PEAK_TFLOPS, key=len, reverse=True):  # most specific name first
        if key.lower() in name.lower():
            return PEAK_TFLOPS[key] * 1e12
    return None


def peak_memory_gb(device: torch.device | None = None) -> float:
    """Peak memory so far: CUDA max allocated on a GPU, else the process's max resident set size."""
    if device is not None and torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # kilobytes on Linux, bytes on macOS
    return kb / (1e9 if sys.platform == "darwin" else 1e6)


class Throughput:
    """Tokens (all and supervised) over wall time between `mark()` calls."""

    def __init__(self):
        self.start = time.perf_counter()
        self.tokens = 0
        self.supervised = 0

    def add(self, tokens: int, supervised: int) -> None:
        self.tokens += tokens
        self.supervised += supervised

    def mark(self) -> dict:
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        out = {"tokens_per_second": self.tokens / elapsed, "supervised_tokens_per_second": self.supervised / elapsed}
        self.start, self.tokens, self.supervised = time.perf_counter(), 0, 0
        return out


class MetricsWriter:
    """Writes each log dict to output_dir/metrics.jsonl and to tensorboard when asked and installed.

    metrics.jsonl reads as one unbroken run: a run resumed at `resumed_step` first drops the rows past that step (those
    logged after the checkpoint by the run that was stopped, which this run logs again; and a line torn by a kill),
    rewriting the file atomically; a fresh run never appends to an earlier run's file, it moves it aside to
    metrics.<n>.jsonl (the first free n) and says so."""

    def __init__(self, output_dir: str | Path, report_to: list[str], logging_dir: str | None = None,
                 enabled: bool = True, resumed_step: int | None = None):
        self.enabled = enabled
        self.jsonl = None
        self.tb = None
        if not enabled:
            return
        out = Path(output_dir)
        out.mkdir(parents=True, exist_ok=True)
        if "jsonl" in report_to or "all" in report_to:
            path = out / "metrics.jsonl"
            if path.exists() and resumed_step is not None:
                _truncate_after(path, resumed_step)
            elif path.exists():
                n = 1
                while (out / f"metrics.{n}.jsonl").exists():
                    n += 1
                aside = out / f"metrics.{n}.jsonl"
                os.replace(path, aside)
                print(f"metrics.jsonl: {out} held an earlier run's metrics; moved them to {aside.name}",
                      file=sys.stderr, flush=True)
            self.jsonl = path.open("a")
        if "tensorboard" in report_to or "all" in report_to:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except Exception:
                if "tensorboard" in report_to:
                    raise ValueError("report_to: tensorboard is not installed (pip install tensorboard)") from None
            else:
                self.tb = SummaryWriter(log_dir=logging_dir or str(out / "runs"))

    def write(self, logs: dict, step: int) -> None:
        if not self.enabled:
            return
        if self.jsonl is not None:
            self.jsonl.write(json.dumps({"step": step, **logs}) + "\n")
            self.jsonl.flush()
        if self.tb is not None:
            for key, value in logs.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                    self.tb.add_scalar(key, value, step)
            self.tb.flush()

    def close(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
            self.jsonl = None
        if self.tb is not None:
            self.tb.close()
            self.tb = None


def _truncate_after(path: Path, step: int) -> None:
    """Keep the rows of a metrics.jsonl up to `step` (and drop a torn, unreadable line); replace the file atomically."""
    kept = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if row.get("step", 0) <= step:
            kept.append(line + "\n")
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept))
    os.replace(tmp, path)


def format_logs(logs: dict) -> str:
    parts = []
    for key, value in logs.items():
        if isinstance(value, float):
            parts.append(f"{key}={value:.4g}")
        else:
            parts.append(f"{key}={value}")
    return " ".join(parts)


def plot_loss_curve(log_history: list[dict], path: str | Path) -> Path | None:
    """Train and eval loss against step as a PNG (None when matplotlib is not installed)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        return None
    train = [(h["step"], h["loss"]) for h in log_history if "loss" in h and "step" in h]
    evals = [(h["step"], h["eval_loss"]) for h in log_history if "eval_loss" in h and "step" in h]
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train), label="train loss")
    if evals:
        ax.plot(*zip(*evals), "o-", label="eval loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)
