"""Benchmark RMSNorm: ours (Triton) vs torch eager (the reference), torch.compile of the reference, liger-kernel.

Modes: forward (y from x), backward (dx and dweight from a saved forward), full (forward + backward).
Bytes are the ideal traffic (s = element size of x, w = element size of weight):
    forward  M N s (read x) + M N s (write y) + N w
    backward 3 M N s (read x and dy, write dx) + 2 N w
    full     the sum (the forward's y is never read back)
so GB/s is comparable across providers and its fraction of copy bandwidth is how close each gets to
memory speed. Byte model of our rows, per element of x (weight, rstd and dweight partials are O(N + M)):
    forward   ours 1s read + 1s write            min the same
    backward  ours 2s + 1s (x, dy; dx)           min the same (rstd saved, not recomputed)
    full      ours 3s + 2s                       min 2s + 2s (one kernel could keep x on chip for the backward) Peak extra memory is measured for the full step.

GPU: hidden 2048/3584/4096/8192 (Llama-3.2-1B/Qwen2.5-7B/Llama-3-8B/Llama-3-70B) x 4K/16K tokens, bf16.
CPU (--quick): one tiny shape through the Triton interpreter; rows say perf_figure=False (not performance).

    python bench/bench_rms_norm.py                    # GPU sweep, appends to bench/results/rms_norm.jsonl
    python bench/bench_rms_norm.py --quick            # CPU smoke run
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make `bench` and `kernels` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

if not torch.cuda.is_available():
    # Read when kernels' @triton.jit decorates, so before `kernels` is imported: CPU runs our kernels
    # through the interpreter instead of silently measuring the reference twice.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import kernels  # noqa: E402
from bench import common  # noqa: E402
from kernels.rms_norm import rms_norm, rms_norm_ref  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MODES = ("forward", "backward", "full")
PROVIDERS = ("ours", "torch", "torch_compile", "liger")
GPU_TOKENS = (4096, 16384)
GPU_HIDDEN = (2048, 3584, 4096, 8192)
CPU_SHAPES = ((8, 781),)


def _liger_fn():
    """liger-kernel's RMSNorm as f(x, w, eps, offset), or None with the reason."""
    if not torch.cuda.is_available():
        return None, "liger-kernel's RMSNorm needs libdevice, which the Triton interpreter lacks"
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    except Exception as exc:  # optional baseline
        return None, f"liger-kernel not importable ({exc.__class__.__name__}); pip install liger-kernel"
    # casting_mode "gemma" is fp32 until the final cast, the same semantics as ours.
    return (lambda x, w, eps, offset: LigerRMSNormFunction.apply(x, w, eps, offset, "gemma", False)), None


def _providers(compile_backend: str) -> dict:
    def ours(x, w, eps, offset):
        with kernels.backend("triton"):
            return rms_norm(x, w, eps, offset)

    fns = {
        "ours": ours,
        "torch": rms_norm_ref,
        "torch_compile": torch.compile(rms_norm_ref, backend=compile_backend, dynamic=False),
    }
    liger, why = _liger_fn()
    if liger is not None:
        fns["liger"] = liger
    else:
        print(f"skipping liger: {why}", file=sys.stderr)
    return fns


def _bytes(mode: str, m: int, n: int, x_size: int, w_size: int) -> int:
    fwd = 2 * m * n * x_size + n * w_size
    bwd = 3 * m * n * x_size + 2 * n * w_size
    return {"forward": fwd, "backward": bwd, "full": fwd + bwd}[mode]


def byte_model(mode: str, s: int) -> common.ByteModel:
    """Our bytes read/written per element of x and the minimum (module docstring)."""
    return {
        "forward": common.ByteModel(s, s, s, s),
        "backward": common.ByteModel(2 * s, s, 2 * s, s),
        "full": common.ByteModel(3 * s, 2 * s, 2 * s, 2 * s),
    }[mode]


def _case(fn, mode, x, w, dy, eps, offset):
    """A zero-argument callable timing `mode` of fn; the backward reuses one saved forward graph."""
    if mode == "forward":
        return lambda: fn(x, w, eps, offset)
    xg, wg = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    if mode == "backward":
        y = fn(xg, wg, eps, offset)
        return lambda: torch.autograd.grad(y, [xg, wg], dy, retain_graph=True)
    return lambda: torch.autograd.grad(fn(xg, wg, eps, offset), [xg, wg], dy)


def run(shapes, dtype, modes, providers, *, offset=0.0, eps=1e-6, compile_backend="inductor", cpu_reps=3):
    fns = {k: v for k, v in _providers(compile_backend).items() if k in providers}
    dev = common.device()
    env = common.env_info()
    rows = []
    for m, n in shapes:
        g = torch.Generator(device=dev).manual_seed(0)
        x = torch.randn(m, n, device=dev, dtype=dtype, generator=g)
        w = (1.0 + 0.1 * torch.randn(n, device=dev, generator=g)).to(dtype)
        dy = torch.randn(m, n, device=dev, dtype=dtype, generator=g)
        for mode in modes:
            timings = {}
            for name, fn in fns.items():
                step = _case(fn, mode, x, w, dy, eps, offset)
                t = common.measure(step, cpu_reps=cpu_reps)
                moved = _bytes(mode, m, n, x.element_size(), w.element_size())
                row = {
                    "op": "rms_norm", "provider": name, "mode": mode, "tokens": m, "hidden": n,
                    "dtype": str(dtype).replace("torch.", ""), "offset": offset,
                    "compile_backend": compile_backend if name == "torch_compile" else None,
                    **t, "bytes": moved, **common.physics(t["ms"], bytes_moved=moved),
                    "peak_extra_bytes": common.peak_extra_memory(step) if mode == "full" else None,
                    **env,
                }
                if name == "ours":
                    row.update(byte_model(mode, x.element_size()).columns(m * n, t["ms"]))
                timings[name] = t["ms"]
                rows.append(row)
            for row in rows[-len(fns):]:
                if row["provider"] == "ours":
                    for base, ms in timings.items():
                        if base != "ours":
                            row[f"speedup_vs_{base}"] = ms / row["ms"]
            print(" | ".join(f"{m}x{n} {mode:8s} {k}: {v:.3f} ms" for k, v in timings.items())
                  + "".join(common.byte_model_text(r) for r in rows[-len(fns):]))
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one tiny shape, few repetitions (CPU smoke run)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="activation and weight dtype")
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    ap.add_argument("--providers", nargs="+", choices=PROVIDERS, default=list(PROVIDERS))
    ap.add_argument("--tokens", nargs="+", type=int, help="rows (batch x sequence); default: real-model sweep on GPU")
    ap.add_argument("--hidden", nargs="+", type=int, help="hidden sizes; default: real-model sweep on GPU")
    ap.add_argument("--offset", type=float, default=0.0, help="0 (Llama) or 1 (Gemma)")
    ap.add_argument("--compile-backend", default="inductor", help="torch.compile backend for the compiled baseline")
    args = ap.parse_args(argv)

    if args.tokens or args.hidden:
        shapes = [(t, h) for t in (args.tokens or GPU_TOKENS) for h in (args.hidden or GPU_HIDDEN)]
    elif args.quick or not common.on_gpu():
        shapes = list(CPU_SHAPES)
    else:
        shapes = [(t, h) for t in GPU_TOKENS for h in GPU_HIDDEN]
    rows = run(
        shapes, DTYPES[args.dtype], args.modes, args.providers,
        offset=args.offset, compile_backend=args.compile_backend, cpu_reps=1 if args.quick else 5,
    )
    path = common.write_rows("rms_norm", rows)
    print(f"wrote {len(rows)} rows to {path}")
    return rows


if __name__ == "__main__":
    main()
