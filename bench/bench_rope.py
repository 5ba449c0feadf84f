"""Benchmark RoPE: ours (`kernels.rope`, q and k in one launch) vs transformers' apply_rotary_pos_emb in eager (the
Hugging Face model's path), torch.compile of it, and liger-kernel's LigerRopeFunction.

Inputs as the models hold them: q (B, Hq, T, D) and k (B, Hkv, T, D) are transposes of (B, T, H, D) projection
outputs; cos/sin (Bc, T, D) fp32 from the rotary module: Bc = 1 when every row starts at position 0 (our model's
and Hugging Face's default), Bc = B with --per-row-cos (packed rows, whose position_ids differ per row). The eager
and compiled baselines get cos/sin cast to q's dtype first, as transformers' rotary module returns them (not
timed); liger gets them in fp32, as our model's liger path passes them.
Modes: forward (q_rot, k_rot), backward (dq, dk from a saved forward), full (forward + backward).

Bytes (s = element size of q and k, c = of cos/sin): every row's GB/s is the op's minimum traffic
    forward   2 (Hq + Hkv) B T D s (read q, k; write q_rot, k_rot) + 2 Bc T D c (cos, sin once per row)
    backward  the same with the gradients; full = forward + backward,
so rows compare directly. Byte model of our rows, per element of q and k (n = (Hq + Hkv) B T D):
    forward   ours s + 2 Bc T D c / n read, s write     min the same (kernels/rope.py's docstring)
    backward  the same; full the sum.   Measured equal by bench/traffic.py (tests/kernels/test_rope.py).
On CUDA a batch-shared cos/sin row is issued once per batch by adjacent programs: modelled as L2 hits, once from DRAM.
liger-kernel reads half of cos/sin (it assumes duplicated halves) but rotates in place, which a caller that keeps
q pays for with a copy; transformers' eager path is ten launches (per tensor: a product, a negation, a cat, a
product, a sum). Peak extra memory is measured for the full step.

GPU: Llama-3-8B heads (Hq 32, Hkv 8, D 128), B 1 and 4, T 2048 and 8192, bf16.
CPU (--quick): one tiny shape through the Triton interpreter; rows say perf_figure=False (not performance).

    python bench/bench_rope.py                        # GPU sweep, appends to bench/results/rope.jsonl
    python bench/bench_rope.py --quick                # CPU smoke run
    python bench/bench_rope.py --shapes 4x8192 --per-row-cos
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

from transformers.models.llama.modeling_llama import apply_rotary_pos_emb  # noqa: E402

import kernels  # noqa: E402
from bench import common  # noqa: E402
from kernels.rope import rope  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MODES = ("forward", "backward", "full")
PROVIDERS = ("ours", "torch", "torch_compile", "liger")
GPU_SHAPES = ("1x2048", "1x8192", "4x2048", "4x8192")  # batch x sequence
HEADS = (32, 8, 128)  # Hq, Hkv, D: Llama-3-8B
CPU_SHAPES = ((2, 9, 4, 2, 16),)  # (B, T, Hq, Hkv, D)


def parse_shape(text: str) -> tuple[int, int]:
    try:
        b, t = (int(p) for p in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shapes: {text!r} is not BxT (e.g. 4x8192)") from None
    if min(b, t) < 1:
        raise argparse.ArgumentTypeError(f"--shapes: {text!r} must have positive sizes")
    return b, t


def _liger_fn():
    """liger-kernel's RoPE as f(q, k, cos, sin), or None with the reason."""
    try:
        from liger_kernel.ops.rope import LigerRopeFunction
    except Exception as exc:  # optional baseline
        return None, f"liger-kernel not importable ({exc.__class__.__name__}); pip install liger-kernel"
    return (lambda q, k, cos, sin: LigerRopeFunction.apply(q, k, cos, sin)), None


def _providers(compile_backend: str) -> dict:
    def ours(q, k, cos, sin):
        with kernels.backend("triton"):
            return rope(q, k, cos, sin)

    def hf(q, k, cos, sin):  # cos/sin already in q's dtype (see _case)
        return apply_rotary_pos_emb(q, k, cos, sin)

    fns = {"ours": ours, "torch": hf, "torch_compile": torch.compile(hf, backend=compile_backend, dynamic=False)}
    liger, why = _liger_fn()
    if liger is not None:
        fns["liger"] = liger
    else:
        print(f"skipping liger: {why}", file=sys.stderr)
    return fns


def _bytes(mode: str, B: int, T: int, Hq: int, Hkv: int, D: int, Bc: int, s: int, c: int) -> int:
    one = 2 * (Hq + Hkv) * B * T * D * s + 2 * Bc * T * D * c
    return 2 * one if mode == "full" else one


def byte_model(mode: str, B: int, Hq: int, Hkv: int, Bc: int, s: int, c: int) -> common.ByteModel:
    """Our bytes read/written per element of q and k, and the minimum (the module docstring): equal."""
    cos_sin = 2 * Bc * c / (B * (Hq + Hkv))  # cos + sin rows per element of q and k
    n = 2 if mode == "full" else 1
    return common.ByteModel(n * (s + cos_sin), n * s, n * (s + cos_sin), n * s)


def _case(name, fn, mode, q, k, cos, sin, dq, dk):
    """A zero-argument callable timing `mode` of fn; the backward reuses one saved forward graph."""
    if name in ("torch", "torch_compile"):
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)  # transformers' rotary module returns them in q's dtype
    if mode == "forward":
        return lambda: fn(q, k, cos, sin)
    qg, kg = q.detach().clone().requires_grad_(), k.detach().clone().requires_grad_()
    if mode == "backward":
        out = fn(qg, kg, cos, sin)
        return lambda: torch.autograd.grad(out, [qg, kg], [dq, dk], retain_graph=True)
    return lambda: torch.autograd.grad(fn(qg, kg, cos, sin), [qg, kg], [dq, dk])


def run(
    shapes, dtype, modes, providers, *, shared_cos=True, compile_backend="inductor", cpu_reps=3, kernel_times=False
):
    fns = {k: v for k, v in _providers(compile_backend).items() if k in providers}
    dev = common.device()
    env = common.env_info()
    rows = []
    for B, T, Hq, Hkv, D in shapes:
        Bc = 1 if shared_cos else B
        g = torch.Generator(device=dev).manual_seed(0)
        q = torch.randn(B, T, Hq, D, device=dev, dtype=dtype, generator=g).transpose(1, 2)  # (B, Hq, T, D)
        k = torch.randn(B, T, Hkv, D, device=dev, dtype=dtype, generator=g).transpose(1, 2)  # (B, Hkv, T, D)
        angles = torch.arange(T, device=dev, dtype=torch.float32)[:, None] * torch.rand(D, device=dev, generator=g)
        cos, sin = angles.cos().expand(Bc, T, D).contiguous(), angles.sin().expand(Bc, T, D).contiguous()  # (Bc, T, D)
        # Output gradients as attention's backward hands them: (B, T, H, D) memory.
        dq = torch.randn(B, T, Hq, D, device=dev, dtype=dtype, generator=g).transpose(1, 2)
        dk = torch.randn(B, T, Hkv, D, device=dev, dtype=dtype, generator=g).transpose(1, 2)
        s, c = q.element_size(), cos.element_size()
        for mode in modes:
            timings = {}
            for name, fn in fns.items():
                step = _case(name, fn, mode, q, k, cos, sin, dq, dk)
                t = common.measure(step, cpu_reps=cpu_reps)
                moved = _bytes(mode, B, T, Hq, Hkv, D, Bc, s, c)
                row = {
                    "op": "rope",
                    "provider": name,
                    "mode": mode,
                    "shape": f"{B}x{T}x{Hq}/{Hkv}x{D}",
                    "batch": B,
                    "seq": T,
                    "q_heads": Hq,
                    "kv_heads": Hkv,
                    "head_dim": D,
                    "cos_batch": Bc,
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
                    row.update(byte_model(mode, B, Hq, Hkv, Bc, s, c).columns((Hq + Hkv) * B * T * D, t["ms"]))
                timings[name] = t["ms"]
                rows.append(row)
            common.finish_case(rows[-len(fns) :], timings, f"{B}x{T}x{Hq}/{Hkv}x{D} {mode:8s}")
    return rows


def main(argv=None):
    ap = common.provider_parser(__doc__, DTYPES, MODES, PROVIDERS, "q and k dtype (cos/sin are fp32)")
    ap.add_argument(
        "--shapes",
        nargs="+",
        type=parse_shape,
        metavar="BxT",
        help=f"batch x sequence; default on GPU: {' '.join(GPU_SHAPES)}",
    )
    ap.add_argument(
        "--heads",
        nargs=3,
        type=int,
        metavar=("HQ", "HKV", "D"),
        default=list(HEADS),
        help="query heads, key/value heads, head_dim (default: Llama-3-8B's 32 8 128)",
    )
    ap.add_argument("--per-row-cos", action="store_true", help="cos/sin (B, T, D) (packed rows) instead of (1, T, D)")
    ap.add_argument("--compile-backend", default="inductor", help="torch.compile backend for the compiled baseline")
    args = ap.parse_args(argv)

    if args.shapes or not (args.quick or not common.on_gpu()):
        shapes = [(b, t, *args.heads) for b, t in (args.shapes or [parse_shape(x) for x in GPU_SHAPES])]
    else:
        shapes = list(CPU_SHAPES)
    rows = run(
        shapes,
        DTYPES[args.dtype],
        args.modes,
        args.providers,
        shared_cos=not args.per_row_cos,
        compile_backend=args.compile_backend,
        cpu_reps=1 if args.quick else 5,
        kernel_times=args.kernel_times,
    )
    path = common.write_rows("rope", rows)
    print(f"wrote {len(rows)} rows to {path}")
    return rows


if __name__ == "__main__":
    main()
