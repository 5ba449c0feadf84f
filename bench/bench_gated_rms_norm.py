"""Benchmark the gated RMSNorm of Gated DeltaNet layers, rmsnorm(x) * weight * silu(gate) per value head: ours
(`kernels.gated_rms_norm`, one pass each way) vs transformers' Qwen3_5RMSNormGated math in eager (its casts:
`trainer.model.gated_deltanet.gated_rms_norm_plain`) and torch.compile of it.

Modes: forward (y), backward (dx, dgate, dweight from a saved forward), full (forward + backward).
Bytes are the ideal traffic (s = element size; n = rows x V, rows = tokens x value heads):
    forward  3 n s (read x and the gate, write y)
    backward 5 n s (read dy, x and the gate, write dx and dgate)
    full     8 n s
Byte model of our rows, per element (`traffic_parts`, equal to bench/traffic.py's meter in
tests/bench/test_byte_models.py, O(rows) rstd and O(programs) weight and dweight partials included):
    forward   ours 2s + 1s (+ 4 B rstd per row)    min 2s + 1s
    backward  ours 3s + 2s (+ rstd, partials)      min 3s + 2s
Peak extra memory is measured for the full step.

GPU: Qwen3.5-9B's Gated DeltaNet (32 value heads of 128) at 8192 tokens, bf16: rows 262144 x 128.
CPU (--quick): one tiny shape through the Triton interpreter; rows say perf_figure=False (not performance).

    python bench/bench_gated_rms_norm.py              # GPU, appends to bench/results/gated_rms_norm.jsonl
    python bench/bench_gated_rms_norm.py --quick      # CPU smoke run
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make `bench` and `kernels` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

if not torch.cuda.is_available():
    # Read when kernels' @triton.jit decorates, so before `kernels` is imported (see bench_rms_norm.py).
    os.environ.setdefault("TRITON_INTERPRET", "1")

import kernels  # noqa: E402
from bench import common  # noqa: E402
from kernels.gated_rms_norm import _BWD_TILE_ELEMS, _CPU_BWD_PROGRAMS, launch_config  # noqa: E402
from trainer.model.gated_deltanet import gated_rms_norm_plain  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MODES = ("forward", "backward", "full")
PROVIDERS = ("ours", "torch", "torch_compile")
GPU_SHAPES = ((8192 * 32, 128),)  # Qwen3.5-9B: 8192 tokens x 32 value heads, V = 128
CPU_SHAPES = ((37, 100),)
EPS = 1e-6


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def bwd_programs(m: int, block_m: int, num_programs: int | None = None) -> int:
    """Programs of the backward launch (kernels/gated_rms_norm.py's rule), so rows of the dweight partial buffer."""
    if num_programs is None:
        num_programs = (
            2 * torch.cuda.get_device_properties(0).multi_processor_count if common.on_gpu() else _CPU_BWD_PROGRAMS
        )
    tiles = _cdiv(m, block_m)
    return _cdiv(m, _cdiv(tiles, min(num_programs, tiles)) * block_m)


def traffic_parts(
    mode: str, m: int, n: int, s: int, w: int, *, num_programs: int | None = None, compute_dw: bool = True
) -> dict[str, tuple[int, int]]:
    """Exact issued (read, write) bytes per launch on (m, n) x and gate of element size s, a weight of size w: the
    Triton kernels' names, and the dweight finish's torch ops ("aten.sum" of the fp32 partials, "aten._to_copy" to
    the weight's dtype) as bench/traffic.py's `torch_ops` names them. The weight is read once per program."""
    out: dict[str, tuple[int, int]] = {}
    mn = m * n
    if mode in ("forward", "full"):
        block_m, _, _ = launch_config(m, n)
        out["_gated_rms_norm_fwd_kernel"] = (2 * mn * s + _cdiv(m, block_m) * n * w, mn * s + 4 * m)  # y, rstd
    if mode in ("backward", "full"):
        programs = bwd_programs(m, launch_config(m, n, _BWD_TILE_ELEMS)[0], num_programs)
        partials = programs * n * 4 if compute_dw else 0
        out["_gated_rms_norm_bwd_kernel"] = (3 * mn * s + programs * n * w + 4 * m, 2 * mn * s + partials)
        if compute_dw:
            out["aten.sum"] = (partials, 4 * n)
            if w != 4:
                out["aten._to_copy"] = (4 * n, n * w)
    return out


def byte_model(mode: str, m: int, n: int, s: int, w: int) -> common.ByteModel:
    """Our bytes per element (`traffic_parts`) and the minimum (the module docstring's ideal traffic)."""
    parts = traffic_parts(mode, m, n, s, w).values()
    ours = (sum(r for r, _ in parts), sum(wr for _, wr in parts))
    reads, writes = {"forward": (2, 1), "backward": (3, 2), "full": (5, 3)}[mode]
    return common.ByteModel.from_totals(ours, (reads * m * n * s, writes * m * n * s), m * n)


def _providers(compile_backend: str) -> dict:
    def ours(x, z, weight):
        with kernels.backend("triton"):
            return kernels.gated_rms_norm(x, z, weight, EPS)

    def eager(x, z, weight):
        return gated_rms_norm_plain(x, z, weight, EPS)

    return {
        "ours": ours,
        "torch": eager,
        "torch_compile": torch.compile(eager, backend=compile_backend, dynamic=False),
    }


def _case(fn, mode, x, z, weight, dy):
    """A zero-argument callable timing `mode` of fn; the backward reuses one saved forward graph."""
    if mode == "forward":
        return lambda: fn(x, z, weight)
    x, z, weight = (t.detach().clone().requires_grad_() for t in (x, z, weight))
    if mode == "backward":
        y = fn(x, z, weight)
        return lambda: torch.autograd.grad(y, [x, z, weight], dy, retain_graph=True)
    return lambda: torch.autograd.grad(fn(x, z, weight), [x, z, weight], dy)


def run(shapes, dtype, modes, providers, *, compile_backend="inductor", cpu_reps=3, kernel_times=False):
    fns = {k: v for k, v in _providers(compile_backend).items() if k in providers}
    dev = common.device()
    env = common.env_info()
    rows = []
    for m, n in shapes:
        g = torch.Generator(device=dev).manual_seed(0)
        x, z, dy = (torch.randn(m, n, device=dev, generator=g).to(dtype) for _ in range(3))
        weight = (1 + 0.1 * torch.randn(n, device=dev, generator=g)).to(dtype)
        s = x.element_size()
        for mode in modes:
            timings = {}
            for name, fn in fns.items():
                step = _case(fn, mode, x, z, weight, dy)
                t = common.measure(step, cpu_reps=cpu_reps)
                moved = {"forward": 3, "backward": 5, "full": 8}[mode] * m * n * s
                row = {
                    "op": "gated_rms_norm",
                    "provider": name,
                    "mode": mode,
                    "tokens": m,
                    "hidden": n,
                    "dtype": str(dtype).replace("torch.", ""),
                    "compile_backend": compile_backend if name == "torch_compile" else None,
                    **t,
                    "bytes": moved,
                    **common.physics(t["ms"], bytes_moved=moved),
                    "peak_extra_bytes": common.peak_extra_memory(step) if mode == "full" else None,
                    **(common.kernel_times(step) if kernel_times else {}),
                    **env,
                }
                if name == "ours":
                    row.update(byte_model(mode, m, n, s, s).columns(m * n, t["ms"]))
                timings[name] = t["ms"]
                rows.append(row)
            common.finish_case(rows[-len(fns) :], timings, f"{m}x{n} {mode:8s}")
    return rows


def main(argv=None):
    ap = common.provider_parser(__doc__, DTYPES, MODES, PROVIDERS, "activation dtype")
    ap.add_argument("--rows", nargs="+", type=int, help="rows (tokens x value heads); default 262144 on GPU")
    ap.add_argument("--head-dim", type=int, default=128, help="V, a value head's channels (default 128)")
    ap.add_argument("--compile-backend", default="inductor", help="torch.compile backend for the compiled baseline")
    args = ap.parse_args(argv)
    if args.rows:
        shapes = [(r, args.head_dim) for r in args.rows]
    elif args.quick or not common.on_gpu():
        shapes = list(CPU_SHAPES)
    else:
        shapes = list(GPU_SHAPES)
    rows = run(
        shapes,
        DTYPES[args.dtype],
        args.modes,
        args.providers,
        compile_backend=args.compile_backend,
        cpu_reps=1 if args.quick else 5,
        kernel_times=args.kernel_times,
    )
    path = common.write_rows("gated_rms_norm", rows)
    print(f"wrote {len(rows)} rows to {path}")
    return rows


if __name__ == "__main__":
    main()
