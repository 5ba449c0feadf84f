"""Shared plumbing for the benchmarks: timing, memory, device physics and result rows.

Every row carries device, date, versions and git sha, and `perf_figure`: True only on a GPU. On a CPU
the scripts still run (reference path / Triton interpreter) so they never rot, but those numbers are
not performance figures and are flagged as such.

Byte models: each kernel benchmark states, per element of its op, the bytes our implementation reads and writes
and the least the op itself must move (`ByteModel`), and prints GB/s at both beside the time
(`ByteModel.columns`, `byte_model_text`). GB/s at our bytes near the copy bandwidth with GB/s at the minimum
well below it means the shortfall is extra traffic; both low means latency (or compute).
Each kernel benchmark derives its per-element model from exact totals, `traffic_model(...) -> (read, write)`
bytes (per launch: `traffic_parts`) and `min_traffic(...)`, documented in its docstring.

Bytes are measured, not only modelled: `bench/traffic.py` runs a kernel under the Triton interpreter and counts
the global-memory bytes of every load, store, tensor-descriptor access and atomic (active lanes times element
size), per launch and per tensor argument, as "issued" (every access) and "distinct" (each address once per
launch); with `torch_ops=True` it also records the torch ops between the launches, with one-pass modelled
bytes. Real DRAM traffic on a GPU lies between distinct (every re-read a cache hit) and issued (none); the
models count issued bytes, except where a benchmark says it counts a small re-read tensor (a norm's weight)
once. tests/bench/test_byte_models.py holds every model equal to the meter at small shapes, for each mode,
dtype, ignored fraction and algorithm switch: a kernel change that moves its bytes fails there, naming the
model to update.

Timing: on CUDA `triton.testing.do_bench` (median, p20, p80 in ms; CUDA graphs via
`do_bench_cudagraph` for very short kernels); on CPU `time.perf_counter` over a few repetitions.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import functools
import importlib.metadata
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
QUANTILES = (0.5, 0.2, 0.8)


def on_gpu() -> bool:
    return torch.cuda.is_available()


def device() -> torch.device:
    return torch.device("cuda" if on_gpu() else "cpu")


ABSENT = "absent"  # the version of a package that is not installed


def _version(distribution: str) -> str:
    """The installed version of a distribution (pip's name), or ABSENT."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return ABSENT


def git_sha() -> str:
    """The GIT_SHA environment variable where it is set, else the short HEAD sha with "+dirty" when tracked files
    differ from it (the rows then ran uncommitted code), else "unknown".

    GIT_SHA comes first: whoever starts a run on the device machine sets it (docs/gpu_runbook.md), since the copy
    of the working tree there may carry no .git, or (seen on 2026-11-26) the .git of the session's start, whose
    HEAD is older than the commit the tree holds."""
    from_env = os.environ.get("GIT_SHA", "").strip()
    if from_env:
        return from_env
    if not (ROOT / ".git").exists():
        return "unknown"
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10
        )
        sha = out.stdout.strip() or "unknown"
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=10,
        )
        return sha + ("+dirty" if status.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


@functools.lru_cache(maxsize=1)
def driver_version() -> str:
    """The NVIDIA driver's version as nvidia-smi reports it, or ABSENT (no GPU, or no nvidia-smi)."""
    if not on_gpu() or shutil.which("nvidia-smi") is None:
        return ABSENT
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        return ABSENT
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else ABSENT


def env_info() -> dict:
    """Device, driver, date, versions, git sha and the command line: the context columns of every result row."""
    name = (
        torch.cuda.get_device_name()
        if on_gpu()
        else f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    )
    return {
        "device": name,
        "driver": driver_version(),
        "cuda": torch.version.cuda or ABSENT,
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "liger_kernel": _version("liger_kernel"),
        "transformers": _version("transformers"),
        "peft": _version("peft"),
        "git_sha": git_sha(),
        "command": shlex.join(sys.orig_argv),
        "perf_figure": on_gpu(),
        "triton_interpret": os.environ.get("TRITON_INTERPRET", "0") == "1",
    }


def measure(
    fn: Callable[[], object], *, warmup: int = 25, rep: int = 100, cuda_graph: bool = False, cpu_reps: int = 3
) -> dict:
    """Median, p20 and p80 of fn's runtime in milliseconds."""
    if on_gpu():
        import triton.testing as tt

        if cuda_graph:
            q = tt.do_bench_cudagraph(fn, rep=rep, quantiles=list(QUANTILES))
        else:
            q = tt.do_bench(fn, warmup=warmup, rep=rep, quantiles=list(QUANTILES))
        return {"ms": q[0], "ms_p20": q[1], "ms_p80": q[2]}
    fn()  # warm-up (compiles, caches)
    times = []
    for _ in range(cpu_reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return {"ms": statistics.median(times), "ms_p20": times[0], "ms_p80": times[-1]}


def kernel_times(fn: Callable[[], object], reps: int = 20, flush_bytes: int = 256 << 20) -> dict:
    """The device's own time for one call of fn, CUDA only: {"kernel_ms": summed kernel (and memset/memcpy) time
    per call, "kernels": {name: ms per call}}, read from torch.profiler's CUDA events. Beside do_bench's wall time
    it tells a kernel that is slow from a call whose host side (Python, autograd, launches) cannot keep the GPU
    busy. The L2 is flushed before each call as do_bench does; the flush's own kernels, profiled alone, are
    subtracted. {} on a CPU."""
    if not on_gpu():
        return {}
    flush = torch.empty(flush_bytes, dtype=torch.int8, device="cuda")

    def device_us(body) -> dict[str, float]:
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                flush.zero_()
                body()
            torch.cuda.synchronize()
        per_name: dict[str, float] = {}
        for evt in prof.events():
            if evt.device_type == torch.autograd.DeviceType.CUDA:
                per_name[evt.name] = per_name.get(evt.name, 0.0) + evt.time_range.elapsed_us()
        return per_name

    fn()  # warm-up: compiles and caches stay out of the profile
    with_fn, flush_only = device_us(fn), device_us(lambda: None)
    kernels = {k: (us - flush_only.get(k, 0.0)) / reps / 1e3 for k, us in with_fn.items()}
    kernels = {k: ms for k, ms in kernels.items() if ms > 1e-6}
    return {"kernel_ms": sum(kernels.values()), "kernels": kernels}


def peak_extra_memory(fn: Callable[[], object]) -> int | None:
    """Peak bytes allocated by fn above what was allocated before it (CUDA only; None on CPU)."""
    if not on_gpu():
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def mode_times(forward: Callable[[], object], full: Callable[[], object], reset: Callable[[], None], reps: int):
    """({"forward", "backward", "full"} -> measure()'s times, peak extra memory of full): backward is full - forward
    (derived; it can come out <= 0 within timing noise on a CPU). reset() frees the gradients before the peak is
    taken."""
    t_fwd = measure(forward, cpu_reps=reps)
    t_full = measure(full, cpu_reps=reps)
    reset()
    peak = peak_extra_memory(full)
    reset()
    t_bwd = {k: t_full[k] - t_fwd[k] for k in ("ms", "ms_p20", "ms_p80")}
    return {"forward": t_fwd, "backward": t_bwd, "full": t_full}, peak


_COPY_BW: float | None = None


def copy_bandwidth_gbs() -> float | None:
    """The device's measured device-to-device copy bandwidth (read + write bytes / time), once per process."""
    global _COPY_BW
    if not on_gpu():
        return None
    if _COPY_BW is None:
        n = 1 << 28  # 1 GiB of fp32
        src = torch.empty(n, device="cuda")
        dst = torch.empty_like(src)
        ms = measure(lambda: dst.copy_(src))["ms"]
        _COPY_BW = 2 * src.numel() * src.element_size() / (ms * 1e-3) / 1e9
        del src, dst
    return _COPY_BW


def physics(ms: float, *, bytes_moved: float | None = None, flops: float | None = None) -> dict:
    """GB/s (and fraction of copy bandwidth) and TFLOP/s for a runtime."""
    row: dict = {}
    if bytes_moved is not None:
        gbs = bytes_moved / (ms * 1e-3) / 1e9
        row["gb_s"] = gbs
        bw = copy_bandwidth_gbs()
        row["frac_copy_bw"] = gbs / bw if bw else None
    if flops is not None:
        row["tflop_s"] = flops / (ms * 1e-3) / 1e12
    return row


@dataclass(frozen=True)
class ByteModel:
    """Bytes read and written per element of the op: by our implementation, and the least the op must move."""

    read: float
    write: float
    min_read: float
    min_write: float

    def columns(self, n_elements: int, ms: float) -> dict:
        """Result-row columns: the model ("read+write" bytes per element) and GB/s at our bytes and at the minimum."""

        def gbs(per_elem: float):
            return per_elem * n_elements / (ms * 1e-3) / 1e9 if ms > 0 else None

        return {
            "bytes_rw": f"{self.read:.4g}+{self.write:.4g}",
            "bytes_rw_min": f"{self.min_read:.4g}+{self.min_write:.4g}",
            "gb_s_ours": gbs(self.read + self.write),
            "gb_s_min": gbs(self.min_read + self.min_write),
        }

    @classmethod
    def from_totals(cls, ours: tuple[int, int], minimum: tuple[int, int], n_elements: int) -> ByteModel:
        """Per-element model from total (read, write) bytes of our kernels and of the minimum over n_elements."""
        n = max(1, n_elements)
        return cls(ours[0] / n, ours[1] / n, minimum[0] / n, minimum[1] / n)


def byte_model_text(row: dict) -> str:
    """The byte model of a row for a printed line, e.g. " | B/elt r+w ours 4+2: 2510 GB/s, min 2+2: 1673 GB/s";
    empty for rows without one (baselines)."""
    if "bytes_rw" not in row:
        return ""

    def fmt(v):
        return "-" if v is None else f"{v:.4g} GB/s"

    ours = f"ours {row['bytes_rw']}: {fmt(row['gb_s_ours'])}"
    return f" | B/elt r+w {ours}, min {row['bytes_rw_min']}: {fmt(row['gb_s_min'])}"


def finish_case(case_rows: list[dict], timings: dict[str, float], label: str) -> None:
    """One shape and mode of a provider bench (rms_norm, rope, swiglu): give our row speedup_vs_<provider> (their
    median time over ours) and print the times with our byte model."""
    for row in case_rows:
        if row["provider"] == "ours":
            row.update({f"speedup_vs_{base}": ms / row["ms"] for base, ms in timings.items() if base != "ours"})
    print(
        " | ".join(f"{label} {k}: {v:.3f} ms" for k, v in timings.items())
        + "".join(byte_model_text(r) for r in case_rows)
    )
    for row in case_rows:
        if row.get("kernel_ms") is not None:
            top = sorted(row["kernels"].items(), key=lambda kv: -kv[1])[:4]
            print(
                f"    {row['provider']}: kernels {row['kernel_ms']:.3f} ms of {row['ms']:.3f} ms wall; "
                + ", ".join(f"{name[:48]} {ms:.3f}" for name, ms in top)
            )


def provider_parser(doc: str, dtypes: dict, modes: tuple, providers: tuple, dtype_help: str):
    """The arguments every provider bench shares: --quick, --dtype, --modes, --providers."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one tiny shape, few repetitions (CPU smoke run)")
    ap.add_argument("--dtype", choices=sorted(dtypes), default="bf16", help=dtype_help)
    ap.add_argument("--modes", nargs="+", choices=modes, default=list(modes))
    ap.add_argument("--providers", nargs="+", choices=providers, default=list(providers))
    ap.add_argument(
        "--kernel-times",
        action="store_true",
        help="on CUDA also profile each case's kernels (kernel_ms, kernels): device time beside the wall time",
    )
    return ap


def write_rows(name: str, rows: list[dict], render: Callable[[Path], Path] | None = None) -> Path:
    """Append rows to bench/results/<name>.jsonl and re-render bench/results/<name>.md (with `render`, a bench's own
    page, else `render_markdown`'s table)."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.jsonl"
    with path.open("a") as f:
        for row in rows:
            f.write(json.dumps(row, sort_keys=True) + "\n")
    (render or render_markdown)(path)
    return path


def env_header(env: dict) -> str:
    """One markdown line naming where and with what a row (or the newest of a table's rows) was measured."""
    versions = ", ".join(f"{k} {env.get(k)}" for k in ("torch", "triton", "transformers", "peft", "liger_kernel"))
    return (
        f"Measured on {env.get('device')} (driver {env.get('driver')}, CUDA {env.get('cuda')}), {versions}; "
        f"git {env.get('git_sha')}, {env.get('date')}; command `{env.get('command')}`"
    )


def render_markdown(path: Path) -> Path:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    context = (
        "date",
        "driver",
        "cuda",
        "torch",
        "triton",
        "liger_kernel",
        "transformers",
        "peft",
        "git_sha",
        "command",
        "triton_interpret",
    )
    cols: list[str] = []
    for row in rows:
        for key in row:
            if key not in cols and key not in context:
                cols.append(key)
    cols += [c for c in ("date", "git_sha") if any(c in r for r in rows)]

    def fmt(v):
        if isinstance(v, float):
            return f"{v:.4g}"
        return "" if v is None else str(v)

    lines = [
        f"# {path.stem}",
        "",
        env_header(rows[-1]) if rows else "",
        "",
        "Rows with perf_figure=False were measured on a CPU (reference path or Triton interpreter): "
        "not performance figures.",
        "",
    ]
    lines.append("| " + " | ".join(cols) + " |")
    lines.append("|" + "---|" * len(cols))
    for row in rows:
        lines.append("| " + " | ".join(fmt(row.get(c)) for c in cols) + " |")
    out = path.with_suffix(".md")
    out.write_text("\n".join(lines) + "\n")
    return out


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display); imported on first use: only the charts need it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path, dpi: int = 100) -> Path:
    """Lay `fig` out, write it to `path` as a PNG and free it; returns `path`."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    return path
