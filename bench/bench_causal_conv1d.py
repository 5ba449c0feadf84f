"""Benchmark Gated DeltaNet's short causal convolution with its SiLU (Qwen3.5, Qwen3-Next; Mamba's too): ours
(`kernels.causal_conv1d`, the activation fused, packed rows through per-token sequence starts) vs the reference's
math in eager (`kernels.causal_conv1d_ref`: F.conv1d per sequence, then F.silu, as transformers' fallback without the
`causal-conv1d` package) and torch.compile of it.

Modes: forward (y), backward (dx, dweight from a saved forward), full (forward + backward).
Bytes are the ideal traffic (s = element size; n = tokens x channels):
    forward  2 n s (read x, write y)
    backward 3 n s (read dy and x, write dx)
    full     5 n s
Byte model of our rows, per element (`traffic_parts`: issued bytes, equal to bench/traffic.py's meter in
tests/bench/test_byte_models.py; kernels/causal_conv1d.py says why DRAM sees about the minimum):
    forward   ours W s + 1s issued (+ 4 B of sequence start per token)
    backward  ours (W (W + 1) + W) s + 1s issued (+ W starts per token, the O(D W) partials)
Peak extra memory is measured for the full step.

GPU: Qwen3.5-9B's Gated DeltaNet, 8192 tokens x (2 x 16 x 128 + 32 x 128) = 8192 channels, 4 taps, bf16.
CPU (--quick): one tiny shape through the Triton interpreter; rows say perf_figure=False (not performance).

    python bench/bench_causal_conv1d.py              # GPU, appends to bench/results/causal_conv1d.jsonl
    python bench/bench_causal_conv1d.py --quick      # CPU smoke run
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
from kernels.causal_conv1d import BLOCK_D, BLOCK_T, t_programs  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MODES = ("forward", "backward", "full")
PROVIDERS = ("ours", "torch", "torch_compile")
GPU_SHAPES = ((8192, 8192),)  # Qwen3.5-9B: tokens x conv channels
CPU_SHAPES = ((37, 200),)
WIDTH = 4


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def traffic_parts(
    mode: str, lengths: list[int], d: int, s: int, w: int, width: int = WIDTH, *, bias: bool = False
) -> dict[str, tuple[int, int]]:
    """Exact issued (read, write) bytes per launch over sequences of `lengths` tokens (rows, or the sequences packed
    into one) of d channels of element size s, a (d, width) weight of size w: the Triton kernels, and the dweight
    (dbias) finish's torch ops as bench/traffic.py's `torch_ops` names them ("aten.sum" of the fp32 partials,
    "aten._to_copy" to the weight's dtype). A load of x before its token's sequence start is masked and moves
    nothing: a sequence's first W - 1 tokens read fewer taps. The weights are read per tile as the kernels' loops
    reach them, in every tile a backward program walks (its last program may walk tiles past the end)."""
    out: dict[str, tuple[int, int]] = {}
    n_tokens = sum(lengths)
    nd = n_tokens * d
    t_tiles, d_blocks = _cdiv(n_tokens, BLOCK_T), _cdiv(d, BLOCK_D)

    def taps_read(shift: int) -> int:
        """Tokens t whose tap at t - shift lies in their own sequence (t itself included: shift >= 0)."""
        return sum(max(0, length - shift) for length in lengths)

    if mode in ("forward", "full"):
        x_reads = sum(taps_read(width - 1 - i) for i in range(width)) * d * s
        params = t_tiles * (width + bias) * d * w  # each tap's weights, the bias, once per tile
        out["_conv_fwd_kernel"] = (x_reads + params + 4 * n_tokens * d_blocks, nd * s)
    if mode in ("backward", "full"):
        programs, per = t_programs(n_tokens, d, torch.device("cuda" if common.on_gpu() else "cpu"))
        walked = programs * per  # tiles the programs walk, empty ones past the end included
        # t = s + j in s's sequence reads x at t - (W - 1) + i within it: s's position p >= W - 1 - i - j, and
        # p <= L - 1 - j; then the tile's own taps again for dweight (j = 0)
        x_reads = 0
        for length in lengths:
            for j in range(width):
                for i in range(width):
                    x_reads += max(0, length - j - max(0, width - 1 - i - j))
        x_reads += sum(taps_read(width - 1 - i) for i in range(width))
        dy_reads = sum(taps_read(j) for j in range(width))  # dy[t], t = s + j in s's sequence
        starts = (n_tokens + sum(max(0, n_tokens - j) for j in range(width))) * 4 * d_blocks  # s's, then each t's
        params = walked * (width * width + width) * d * w + (programs * d * w if bias else 0)
        partials = programs * d * width * 4 + (programs * d * 4 if bias else 0)
        out["_conv_bwd_kernel"] = ((x_reads + dy_reads) * d * s + params + starts, nd * s + partials)
        out["aten.sum"] = (partials, d * width * 4 + (d * 4 if bias else 0))
        if w != 4:
            out["aten._to_copy"] = (4 * d * (width + bias), d * (width + bias) * w)
    return out


def byte_model(mode: str, n_tokens: int, d: int, s: int) -> common.ByteModel:
    """Our issued bytes per element (`traffic_parts`) and the minimum (the module docstring's ideal traffic)."""
    parts = traffic_parts(mode, [n_tokens], d, s, s).values()
    ours = (sum(r for r, _ in parts), sum(wr for _, wr in parts))
    reads, writes = {"forward": (1, 1), "backward": (2, 1), "full": (3, 2)}[mode]
    return common.ByteModel.from_totals(ours, (reads * n_tokens * d * s, writes * n_tokens * d * s), n_tokens * d)


def _providers(compile_backend: str) -> dict:
    def ours(x, weight):
        with kernels.backend("triton"):
            return kernels.causal_conv1d(x, weight)

    def eager(x, weight):
        return kernels.causal_conv1d_ref(x, weight)

    return {
        "ours": ours,
        "torch": eager,
        "torch_compile": torch.compile(eager, backend=compile_backend, dynamic=False),
    }


def _case(fn, mode, x, weight, dy):
    if mode == "forward":
        return lambda: fn(x, weight)
    x, weight = x.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    if mode == "backward":
        y = fn(x, weight)
        return lambda: torch.autograd.grad(y, [x, weight], dy, retain_graph=True)
    return lambda: torch.autograd.grad(fn(x, weight), [x, weight], dy)


def run(shapes, dtype, modes, providers, *, compile_backend="inductor", cpu_reps=3, kernel_times=False):
    fns = {k: v for k, v in _providers(compile_backend).items() if k in providers}
    dev = common.device()
    env = common.env_info()
    rows = []
    for n_tokens, d in shapes:
        g = torch.Generator(device=dev).manual_seed(0)
        x, dy = (torch.randn(1, n_tokens, d, device=dev, generator=g).to(dtype) for _ in range(2))
        weight = (0.5 * torch.randn(d, WIDTH, device=dev, generator=g)).to(dtype)
        s = x.element_size()
        for mode in modes:
            timings = {}
            for name, fn in fns.items():
                step = _case(fn, mode, x, weight, dy)
                t = common.measure(step, cpu_reps=cpu_reps)
                moved = {"forward": 2, "backward": 3, "full": 5}[mode] * n_tokens * d * s
                row = {
                    "op": "causal_conv1d",
                    "provider": name,
                    "mode": mode,
                    "tokens": n_tokens,
                    "hidden": d,
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
                    row.update(byte_model(mode, n_tokens, d, s).columns(n_tokens * d, t["ms"]))
                timings[name] = t["ms"]
                rows.append(row)
            common.finish_case(rows[-len(fns) :], timings, f"{n_tokens}x{d} {mode:8s}")
    return rows


def main(argv=None):
    ap = common.provider_parser(__doc__, DTYPES, MODES, PROVIDERS, "activation dtype")
    ap.add_argument("--tokens", nargs="+", type=int, help="tokens; default 8192 on GPU")
    ap.add_argument("--channels", type=int, default=8192, help="conv channels, 2 Hk K + Hv V (default 8192)")
    ap.add_argument("--compile-backend", default="inductor", help="torch.compile backend for the compiled baseline")
    args = ap.parse_args(argv)
    if args.tokens:
        shapes = [(t, args.channels) for t in args.tokens]
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
    path = common.write_rows("causal_conv1d", rows)
    print(f"wrote {len(rows)} rows to {path}")
    return rows


if __name__ == "__main__":
    main()
