"""Benchmark NEFTune embedding noise: ours (`kernels.neftune_noise`) vs the Hugging Face hook formula.

Baselines, measured in the same run on the same tensors:
- hf_eager: `e + torch.zeros_like(e).uniform_(-mag, mag)` (transformers' neftune_post_forward_hook): three
  launches moving 5 bytes-per-element-size (zeros: write; uniform_: write; add: read 2, write 1);
- hf_compile: the same formula under torch.compile (one fused kernel with inductor's RNG).
Ours: one kernel reading and writing each element once; `ours_mask` adds the per-sequence length from an
attention mask (a few tiny (B, T) ops, then the same kernel with a per-row scale).

GB/s is the effective bandwidth of the minimum traffic, read x + write y = 2 * numel * element size,
for every row, so the rows compare directly; `frac_copy_bw` puts it against the device's measured copy
bandwidth. GPU target: ours >= 3x hf_eager.

Byte model of our rows: `traffic_model(b, t, d, s, mask=False)` -> (read, write) bytes of our kernel, exact, checked
against bench/traffic.py's count by tests/bench/test_byte_models.py; `min_traffic` the least the op moves;
`byte_model` both per element. Per element (s = element size): ours 1s read + 1s write, min the same; plus the
8-byte Philox seed per program, and with `ours_mask` the (B*T,) fp32 row scale, read by each of the row's
cdiv(d, 4096) column programs (d rounded up to a multiple of 8 in bf16/fp16, of 4 in fp32): 4/d bytes per element
up to d = 4096, 8/d at d = 8192 (the model printed before this meter said 4/d everywhere; the difference is 0.012%
of the bytes in bf16). The meter agrees with these exactly. The torch ops that build the row scale from the mask are
(B, T)-sized and not counted.

Not bytes but instructions bound the kernel as the H200 ran it (df5b252: 1.11x hf_eager, 1.2 TB/s): 28.9 SASS
instructions per bf16 element; 15.0 now (kernels/neftune.py, "What it costs"; `python -m bench.sm90 --only neftune
--sass`). Issue 47's target: ours >= 2x hf_eager at 8 x 4096 x 4096 bf16 (docs/gpu_runbook.md).

Usage:
    python bench/bench_neftune.py                 # GPU: 8x4096x4096 bf16 and friends
    python bench/bench_neftune.py --quick         # CPU: one tiny shape, only proves the script runs
    python bench/bench_neftune.py --shapes 4x2048x4096 --dtype fp16
    python bench/bench_neftune.py --kernel-times  # GPU: + each row's device time (torch.profiler), host apart
Rows go to bench/results/neftune.jsonl (+ .md) via bench.common.write_rows.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench import common  # noqa: E402
from kernels import neftune_noise, use_triton  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
GPU_SHAPES = ["8x4096x4096", "4x4096x4096", "1x8192x8192", "8x2048x2048"]
CPU_SHAPES = ["2x64x256", "1x128x512"]
CPU_QUICK_SHAPES = ["2x16x128"]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def traffic_model(b: int, t: int, d: int, s: int, mask: bool = False) -> tuple[int, int]:
    """Exact (read, write) bytes of our kernel on a (b, t, d) input of element size s (kernels/neftune.py's grid)."""
    n_rows = b * t
    per = 8 if s == 2 else 4  # noise values per Philox call: 16-bit halves in bf16/fp16
    groups = _cdiv(d, per)
    block_c = min((1 << max(0, (groups - 1).bit_length())) * per, 4096)
    block_r = 8192 // block_c
    col_programs = _cdiv(groups * per, block_c)
    programs = _cdiv(n_rows, block_r) * col_programs
    read = n_rows * d * s + 8 * programs + (4 * n_rows * col_programs if mask else 0)  # x, seed, row scale
    return read, n_rows * d * s


def min_traffic(b: int, t: int, d: int, s: int) -> tuple[int, int]:
    """The least the op moves: read x, write y."""
    return b * t * d * s, b * t * d * s


def hf_hook(e: torch.Tensor, mag: float) -> torch.Tensor:
    """The formula of transformers' neftune_post_forward_hook (mag = alpha / sqrt(T * d))."""
    return e + torch.zeros_like(e).uniform_(-mag, mag)


def parse_shape(text: str) -> tuple[int, int, int]:
    try:
        b, t, d = (int(p) for p in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shapes: {text!r} is not BxTxD (e.g. 8x4096x4096)") from None
    if min(b, t, d) < 1:
        raise argparse.ArgumentTypeError(f"--shapes: {text!r} must have positive sizes")
    return b, t, d


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="one tiny shape and few repetitions (CPU smoke run)")
    p.add_argument("--shapes", type=str, default=None, help="comma-separated BxTxD (default: by device)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default bf16 on GPU, fp32 on CPU")
    p.add_argument("--alpha", type=float, default=5.0, help="NEFTune alpha (default 5.0)")
    p.add_argument(
        "--kernel-times", action="store_true", help="on CUDA also profile each row's kernels (kernel_ms, kernels)"
    )
    p.add_argument(
        "--compile-backend",
        default="inductor",
        help="torch.compile backend for the hf_compile baseline (default inductor)",
    )
    args = p.parse_args(argv)
    if args.alpha < 0 or not math.isfinite(args.alpha):
        p.error(f"--alpha must be a finite number >= 0, got {args.alpha}")
    default = GPU_SHAPES if common.on_gpu() else (CPU_QUICK_SHAPES if args.quick else CPU_SHAPES)
    args.shapes = [parse_shape(s) for s in (args.shapes.split(",") if args.shapes else default)]
    args.dtype = args.dtype or ("bf16" if common.on_gpu() else "fp32")
    return args


def bench_shape(
    shape, dtype_name: str, alpha: float, compile_backend: str, quick: bool, kernel_times: bool = False
) -> list[dict]:
    dev = common.device()
    dtype = DTYPES[dtype_name]
    B, T, d = shape
    e = torch.randn(shape, device=dev, dtype=dtype)  # (B, T, d)
    lengths = torch.randint(T // 2, T + 1, (B,), device=dev)  # (B,)
    mask = (torch.arange(T, device=dev)[None, :] < lengths[:, None]).long()  # (B, T), right padding
    mag = alpha / math.sqrt(T * d)
    hf_compiled = torch.compile(hf_hook, backend=compile_backend)
    reps = {"rep": 20, "cpu_reps": 2} if quick else {}
    impls = {
        "hf_eager": lambda: hf_hook(e, mag),
        "hf_compile": lambda: hf_compiled(e, mag),
        "ours": lambda: neftune_noise(e, alpha),
        "ours_mask": lambda: neftune_noise(e, alpha, attention_mask=mask),
    }
    bytes_min = 2 * e.numel() * e.element_size()
    s = e.element_size()
    byte_models = {
        name: common.ByteModel.from_totals(
            traffic_model(B, T, d, s, mask=name == "ours_mask"), min_traffic(B, T, d, s), e.numel()
        )
        for name in ("ours", "ours_mask")
    }
    path = "triton" if use_triton(e) else "reference"
    timings = {name: common.measure(fn, **reps) for name, fn in impls.items()}
    env = common.env_info()
    rows = []
    for name, fn in impls.items():
        t = timings[name]
        rows.append(
            {
                "op": "neftune",
                "impl": name,
                "path": path if name.startswith("ours") else "torch",
                "shape": "x".join(map(str, shape)),
                "dtype": dtype_name,
                **t,
                **common.physics(t["ms"], bytes_moved=bytes_min),
                "peak_extra_bytes": common.peak_extra_memory(fn),
                "speedup_vs_hf_eager": timings["hf_eager"]["ms"] / t["ms"],
                "speedup_vs_hf_compile": timings["hf_compile"]["ms"] / t["ms"],
                **(byte_models[name].columns(e.numel(), t["ms"]) if name in byte_models else {}),
                **(common.kernel_times(fn) if kernel_times else {}),
                **env,
            }
        )
    return rows


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    rows = []
    for shape in args.shapes:
        rows += bench_shape(shape, args.dtype, args.alpha, args.compile_backend, args.quick, args.kernel_times)
        if common.on_gpu():
            torch.cuda.empty_cache()
    path = common.write_rows("neftune", rows)
    for r in rows:
        gbs = f"{r['gb_s']:.1f} GB/s" if r.get("gb_s") is not None else ""
        device = f" (device {r['kernel_ms']:.4f} ms)" if "kernel_ms" in r else ""
        print(
            f"{r['shape']:>14} {r['dtype']} {r['impl']:<11} {r['ms']:.4f} ms{device}  {gbs}  "
            f"x{r['speedup_vs_hf_eager']:.2f} vs hf_eager" + common.byte_model_text(r)
        )
    print(f"rows -> {path}")
    return rows


if __name__ == "__main__":
    main()
