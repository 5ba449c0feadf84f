"""Metrics: throughput, MFU, memory, and `MetricsWriter`, which hands each log dict to the loggers in report_to.

MFU = achieved model FLOP/s / the device's peak dense bf16 FLOP/s, with the model's FLOPs per token from
`CausalLM.flops_per_token` (6N + attention). The peak is known for the GPUs we are measured on; on a CPU,
or on an unknown device, MFU is not reported (None) rather than guessed.
"""

from __future__ import annotations

import resource
import sys
import time
from pathlib import Path

import torch

from trainer.loop.loggers import open_logger

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
    """Sends each log dict to every logger in `report_to` (see trainer.loop.loggers); does nothing when not enabled
    (ranks other than 0). `run_ids` ({report_to name: run id}, from a checkpoint) continue those logged runs;
    `self.run_ids` holds the ids of this run's loggers, for the checkpoint. `resumed_step` (the step a resumed run
    starts from) makes metrics.jsonl read as one unbroken run (trainer.loop.loggers.JsonlLogger)."""

    def __init__(
        self,
        output_dir: str | Path,
        report_to: list[str],
        logging_dir: str | None = None,
        enabled: bool = True,
        *,
        run_name: str | None = None,
        config: dict | None = None,
        run_ids: dict[str, str] | None = None,
        resumed_step: int | None = None,
    ):
        self.loggers = {}
        if enabled:
            for name in report_to:
                self.loggers[name] = open_logger(
                    name,
                    output_dir=output_dir,
                    logging_dir=logging_dir,
                    run_name=run_name,
                    config=config or {},
                    run_id=(run_ids or {}).get(name),
                    resumed_step=resumed_step,
                )
        self.run_ids = {name: lg.run_id for name, lg in self.loggers.items() if lg.run_id is not None}

    def write(self, logs: dict, step: int) -> None:
        for lg in self.loggers.values():
            lg.log(logs, step)

    def close(self) -> None:
        for lg in self.loggers.values():
            lg.finish()
        self.loggers = {}


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
    if train or evals:  # a run shorter than logging_steps logged no loss: an empty plot, no legend
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)
