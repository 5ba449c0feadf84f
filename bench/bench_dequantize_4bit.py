"""Benchmark NF4/FP4 dequantization: ours (Triton, kernels.dequantize_4bit) vs bitsandbytes' dequantize_4bit (its CUDA
kernel, plus its separate dequantize_blockwise and add launches for double-quantized absmax), and that the two agree
bit for bit on every row (`bit_exact`; against our reference where bitsandbytes is not installed).

Bytes (n elements, s = output element size, b = blocksize, nb = ceil(n / b) blocks; `dram_bytes`): read ceil(n / 2)
codes + 4 nb absmax (double quantized: nb uint8 codes + 4 ceil(nb / 256) scales + the 1 KiB code book + a 4-byte
offset), write n s. NF4, blocksize 64, nested, bf16: 0.516 B read + 2 B written per element. That is the least the op
moves and what our one launch moves from DRAM; bitsandbytes' nested path also writes and reads the fp32 absmax
(8 B a block) in two extra launches. GB/s columns use these bytes.

Byte model of our kernel as issued (`traffic_parts`, equal to bench/traffic.py's meter in
tests/bench/test_byte_models.py): the DRAM bytes above counted as loaded (each tile row loads its scale: ceil(n / COLS)
rows, COLS = min(b, TILE); nested: a uint8 code, a code-book entry and a second-level scale per row, the offset once
per program), plus the two 16-entry table lookups per code byte (8 B issued per byte, L1 hits).

GPU: Llama-3-8B's weights as QLoRA stores them (NF4, blocksize 64, double quantized, bf16): the MLP's 14336 x 4096
and an attention projection's 4096 x 4096 (and --shapes/--quant-type/--dtype/--blocksize/--no-nested for others).
CPU (--quick): one small shape through the Triton interpreter (ours) and bitsandbytes' CPU kernel; rows say
perf_figure=False (not performance: they check that it runs and is exact).

    python bench/bench_dequantize_4bit.py                 # GPU, appends to bench/results/dequantize_4bit.jsonl
    python bench/bench_dequantize_4bit.py --quick         # CPU smoke run
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
    # Read when kernels' @triton.jit decorates, so before `kernels` is imported (see bench_rms_norm.py).
    os.environ.setdefault("TRITON_INTERPRET", "1")

import kernels  # noqa: E402
from bench import common  # noqa: E402
from kernels.dequantize_4bit import NestedAbsmax, dequantize_4bit_ref, launch_config  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
GPU_SHAPES = ((14336, 4096), (4096, 4096))  # Llama-3-8B: MLP and attention projections
CPU_SHAPES = ((96, 250),)
NESTED_BLOCKSIZE = 256  # quantize_4bit's second-level blocksize
KERNEL = "_dequantize_4bit_kernel"


def _bnb():
    """bitsandbytes.functional, or None with the reason."""
    try:
        import bitsandbytes.functional as bnb_functional
    except Exception as exc:  # optional baseline
        return None, f"bitsandbytes not importable ({exc.__class__.__name__}); pip install bitsandbytes"
    return bnb_functional, None


def dram_bytes(n: int, s: int, blocksize: int, nested: bool) -> tuple[int, int]:
    """(read, write): the least the op moves, and what our launch moves from DRAM (module docstring)."""
    blocks = -(-n // blocksize)
    scales = blocks + 4 * -(-blocks // NESTED_BLOCKSIZE) + 4 * 256 + 4 if nested else 4 * blocks
    return (n + 1) // 2 + scales, n * s


def traffic_tensors(n: int, s: int, blocksize: int, nested: bool, cuda: bool) -> dict[str, tuple[int, int]]:
    """(read, write) bytes our kernel issues per tensor argument (the meter's names) for n elements."""
    tile, cols, _ = launch_config(n, blocksize, cuda)
    rows, programs, packed = -(-n // cols), -(-n // tile), (n + 1) // 2
    parts = {"codes_ptr": (packed, 0), "table_ptr": (8 * packed, 0), "out_ptr": (0, n * s)}
    if nested:
        parts |= {"absmax_ptr": (rows, 0), "code2_ptr": (4 * rows, 0), "absmax2_ptr": (4 * rows, 0)}
        parts["offset_ptr"] = (4 * programs, 0)
    else:
        parts["absmax_ptr"] = (4 * rows, 0)
    return parts


def traffic_parts(n: int, s: int, blocksize: int, nested: bool, cuda: bool) -> dict[str, tuple[int, int]]:
    """(read, write) bytes of our one launch, per kernel (tests/bench/test_byte_models.py holds them to the meter)."""
    parts = traffic_tensors(n, s, blocksize, nested, cuda).values()
    return {KERNEL: (sum(r for r, _ in parts), sum(w for _, w in parts))}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def _quantize(bnb_functional, shape, dtype, quant_type, blocksize, nested, dev):
    """(our arguments, bitsandbytes' (codes, state) or None) for a random weight of shape."""
    g = torch.Generator(device=dev).manual_seed(0)
    w = (0.02 * torch.randn(shape, device=dev, generator=g)).to(dtype)
    if bnb_functional is None:  # quantize by hand: random codes and scales (the arithmetic is the same)
        n = w.numel()
        blocks = -(-n // blocksize)
        codes = torch.randint(0, 256, ((n + 1) // 2, 1), dtype=torch.uint8, device=dev, generator=g)
        if nested:
            second = NestedAbsmax(
                torch.linspace(-1, 1, 256, device=dev),
                torch.rand(-(-blocks // NESTED_BLOCKSIZE), device=dev, generator=g),
                NESTED_BLOCKSIZE,
                torch.tensor(0.05, device=dev),
            )
            absmax = torch.randint(0, 256, (blocks,), dtype=torch.uint8, device=dev, generator=g)
        else:
            second, absmax = None, torch.rand(blocks, device=dev, generator=g)
        return (codes, absmax, quant_type, blocksize, tuple(shape), dtype, second), None
    codes, state = bnb_functional.quantize_4bit(
        w, blocksize=blocksize, compress_statistics=nested, quant_type=quant_type
    )
    second = None
    if state.nested:
        second = NestedAbsmax(state.state2.code, state.state2.absmax, state.state2.blocksize, state.offset)
    return (codes, state.absmax, quant_type, blocksize, tuple(shape), dtype, second), (codes, state)


def run(shapes, dtype, quant_type, blocksize, nested_options, *, cpu_reps=3, kernel_times=False):
    bnb_functional, why = _bnb()
    if bnb_functional is None:
        print(f"skipping bitsandbytes: {why}", file=sys.stderr)
    dev = common.device()
    env = common.env_info()
    s = torch.empty((), dtype=dtype).element_size()
    rows = []
    for shape in shapes:
        for nested in nested_options:
            args, theirs = _quantize(bnb_functional, shape, dtype, quant_type, blocksize, nested, dev)

            def ours():
                with kernels.backend("triton"):
                    return kernels.dequantize_4bit(*args)

            fns = {"ours": ours}
            if theirs is not None:
                fns["bitsandbytes"] = lambda: bnb_functional.dequantize_4bit(*theirs)
            expected = fns["bitsandbytes"]() if theirs is not None else dequantize_4bit_ref(*args)
            n = expected.numel()
            read, write = dram_bytes(n, s, blocksize, nested)
            timings, case_rows = {}, []
            for name, fn in fns.items():
                t = common.measure(fn, cpu_reps=cpu_reps)
                row = {
                    "op": "dequantize_4bit",
                    "provider": name,
                    "mode": "nested absmax" if nested else "fp32 absmax",  # a shape key of bench/__main__'s labels
                    "shape": "x".join(map(str, shape)),
                    "dtype": str(dtype).replace("torch.", ""),
                    "quant_type": quant_type,
                    "blocksize": blocksize,
                    "nested": nested,
                    "bit_exact": bool(torch.equal(_bits(fn()), _bits(expected))),
                    "exact_against": "bitsandbytes" if theirs is not None else "reference",
                    **t,
                    "bytes": read + write,
                    **common.physics(t["ms"], bytes_moved=read + write),
                    **(common.kernel_times(fn) if kernel_times else {}),
                    **env,
                }
                if name == "ours":
                    row.update(common.ByteModel.from_totals((read, write), (read, write), n).columns(n, t["ms"]))
                timings[name] = t["ms"]
                case_rows.append(row)
            rows += case_rows
            label = f"{'x'.join(map(str, shape))} {quant_type} bs{blocksize} {'nested' if nested else 'fp32 absmax'}"
            common.finish_case(case_rows, timings, label)
            if not all(r["bit_exact"] for r in case_rows):
                print(f"NOT BIT-EXACT: {label}", file=sys.stderr)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="one small shape, few repetitions (CPU smoke run)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="output dtype (the weight's)")
    ap.add_argument("--quant-type", choices=("nf4", "fp4"), default="nf4")
    ap.add_argument("--blocksize", type=int, default=64)
    ap.add_argument("--no-nested", action="store_true", help="fp32 absmax only (default: both fp32 and nested)")
    ap.add_argument("--shapes", nargs="+", help="weights as OUTxIN; default Llama-3-8B's 14336x4096 and 4096x4096")
    ap.add_argument("--kernel-times", action="store_true", help="on CUDA also profile each case's kernels")
    args = ap.parse_args(argv)

    if args.shapes:
        shapes = [tuple(int(d) for d in s.split("x")) for s in args.shapes]
    elif args.quick or not common.on_gpu():
        shapes = list(CPU_SHAPES)
    else:
        shapes = list(GPU_SHAPES)
    rows = run(
        shapes,
        DTYPES[args.dtype],
        args.quant_type,
        args.blocksize,
        (False,) if args.no_nested else (False, True),
        cpu_reps=1 if args.quick else 5,
        kernel_times=args.kernel_times,
    )
    path = common.write_rows("dequantize_4bit", rows)
    print(f"wrote {len(rows)} rows to {path}")
    return rows


if __name__ == "__main__":
    main()
