"""RMSNorm: y = x * rsqrt(mean(x^2) + eps) * (offset + weight), fused forward and backward in Triton.

Math (one row x of width N; w' = offset + weight; all arithmetic in fp32 whatever the storage dtypes)
    forward   r    = 1 / sqrt(sum_j x_j^2 / N + eps)          (saved for backward: one fp32 per row)
              xh   = x * r
              y    = xh * w'                                   (one rounding: the final cast to x's dtype)
    backward  g    = dy * w'
              c    = sum_j g_j xh_j / N                        (one scalar per row)
              dx   = r * (g - xh * c)
              dw   = sum over rows of dy * xh                  (fp32 partial sums per program, then one reduction)

offset=0 is Llama/Qwen/Mistral; offset=1 with weight initialised to zeros is Gemma's (1 + weight).

fused_add_rms_norm(x, residual, weight) -> (normed, h): the pre-norm residual step of a decoder layer in one pass,
by the same kernels with a constexpr flag (HAS_RESIDUAL forward, HAS_DH backward):
    forward   h    = x + residual                             (fp32 add, rounded once to promote(x, residual)'s dtype,
                                                               as torch's add; written)
              normed = rms_norm(h)                            (from that rounded h: equal to rms_norm(x + residual))
    backward  d_h  = d_h_out + rms_norm's dx(d_normed)        (fp32, one rounding per output dtype)
              dx   = dresidual = d_h                          (one tensor; when x and residual differ in dtype, as a
                                                               bf16 update on the fp32 stream under autocast, the
                                                               same launch writes it in both dtypes)

The one deliberate difference from Hugging Face `LlamaRMSNorm`: HF casts the normalised x back to the
input dtype *before* multiplying by the weight (two roundings in bf16: xh, then xh * w). We keep fp32 until
the single final cast, so in bf16/fp16 our output is at least as close to the exact fp32 result as HF's and
differs from HF's by up to about one unit in the last place; in fp32 the two agree to rounding. Gemma's HF
norm already computes in fp32 and casts once, which is exactly what we do. The output is always in x's
dtype (HF promotes to fp32 when the weight is fp32 and x is bf16); dweight comes back in weight's dtype.

Bytes moved per element (s = element size of x; weight, rstd and the dweight partials are O(N + M)):
    forward 2s (read x, write y); backward 3s (read x and dy, write dx); the backward reads rstd instead of
    recomputing the sum of squares, which would cost nothing in bytes but a second reduction per row.
    Hidden sizes above `max_block` (forward) or 16384 (backward, every dtype) cost one extra read of x (forward) or
    of x and dy (backward). In fp32 above 8192 the backward issues the weight once per row (64 KB that stays in
    L1/L2). At 4096 x 12288 and x 16384 with 264 programs, per element (bench/bench_rms_norm.py's model, equal to
    bench/traffic.py's count at every tested shape; the weight once per launch, as DRAM sees it): bf16/fp16 6.50 B,
    fp32 12.50 B; liger's one block 6.26 B / 12.26 B (ours 1.04x / 1.02x); fp32 issued 16.50 B (liger 12.39). The
    two passes above 16384: 10.50 B in bf16/fp16 (1.68x liger's).
    fused_add_rms_norm (s = element size of every (M, N) tensor): forward 2s + 2s (read x and residual, write h and
    normed); backward 3s + 1s (read d_normed, d_h_out and h, write d_h), + 1s written in x's dtype when it differs.
    The same extra reads above the widths: the forward's second pass reads h back (after a block barrier, so every
    thread sees the whole block's writes), the backward's row-dot pass reads h and d_normed.

Launch strategy
    Rows are flattened to an (M, N) matrix with a contiguous last dim and an arbitrary row stride. A tile is
    BLOCK_M rows x BLOCK_N columns, with BLOCK_N = next_pow2(N) capped at `max_block` (and in the backward at 16384:
    32 warps above 8192, 16-bit x and dy kept as loaded across the row reduction, fp32 reloading the weight every row,
    which keeps it spill-free: `bwd_launch_config`, `_MAX_BWD_BLOCK`) and BLOCK_M chosen so a tile holds about
    `_TILE_ELEMS` elements (several short rows per program, one long row per program).
    - ONE_BLOCK (N <= BLOCK_N): the row lives in registers; x is read once.
    - otherwise: a loop over column blocks accumulates sum(x^2) (forward) or sum(dy w' x) (backward, in
      `_rms_norm_bwd_rowdot_kernel`, a separate launch so no program has to read back its own global writes),
      then a second loop over column blocks writes the outputs. Correct for any N; slower by one read.
    Forward: one program per row tile. Backward: a fixed number of programs (about two per SM on CUDA), each
    owning a contiguous chunk of rows and one fp32 row of the (programs, N) dweight partial buffer, which it
    writes exactly once per column; `torch.sum` over programs finishes dweight in fp32 (then one cast to the weight's
    dtype where it is not fp32). No atomics, so the result is deterministic. Its row loop is software-pipelined
    (`tl.range(..., num_stages=2)`: cp.async double buffering of x and dy), so a program's next rows are in flight
    while it computes the current ones.
    Registers and spills of every configuration at the benchmark widths: `python -m bench.sm90 --only rms_norm`
    (sm_90, compiled on a CPU); tests/kernels/test_sm90_compile.py keeps them spill-free.
    Float arguments (eps, offset) are cast to fp32 inside the kernels: under torch.compile Inductor may pass
    Python floats as fp64, which would otherwise drag the row math into fp64.

Host work (a lone call: bench/results/h200/README.md found the kernels the fastest on the device, 35 us forward and
69-80 us backward at 8192 x 4096 bf16, and the wall clock 0.2-0.4 ms, paying the host)
    Around its launches a call does what it needs and no more, each change bit for bit as before (the interpreter's
    outputs and gradients against the previous code; tests/kernels/test_rms_norm_host.py pins what is left):
    - x, the residual, dy and d_h_out are read where they lie when 2-D or contiguous (rows n apart, any rank:
      `_rows`): no reshape, no view of the outputs, no view nodes in the graph; outputs and gradients are allocated in
      x's shape. Other layouts are reshaped (viewed or copied) as before.
    - the launch plan (grid, tiles, constexprs, warps; the backward's program count and its SM query) is cached by
      problem (`_plan`; while torch.compile traces it is computed as before, no global state in the graph).
    - no aten op for nothing: torch.promote_types only when x and the residual differ in dtype, no .to() of an fp32
      weight's dweight, no partial buffer without a weight gradient. Pointers a configuration never reads are None,
      so Triton's launcher specialises fewer tensors (compiled code unchanged: `python -m bench.sm90`'s registers,
      spills and shared memory are the same at all 35 configurations; passing N for the outputs' row strides instead
      cost some forward configurations up to 8 registers and was dropped).
    - fused_add_rms_norm hands autograd its one gradient as one tensor for both x and the residual (autograd copies
      it where both are leaves that keep .grad; the two views it handed before shared memory there, and a second
      accumulating backward added each gradient into both).
    Measured per lone call at 8192 x 4096 bf16 with an fp32 weight and its gradient (`python bench/bench_rms_norm.py
    --host --against 5a992a2 --op rms_norm fused_add_rms_norm`; 2 x 4096 x 4096 gives the same counts, one more
    torch call): aten ops besides the launches, forward + backward, rms_norm 9 -> 5 (y, rstd, dx, the dweight
    partials, their sum; a 16-bit weight adds the cast), fused_add_rms_norm 17 -> 8 (h's allocation too, and the
    detach autograd makes saving h and unpacking it); torch calls from Python 50 -> 33 and 70 -> 46. CPU host time,
    launches not executed (fake CUDA, a loaded 2-core CPU: our Python, autograd, torch's dispatch to meta kernels
    and the harness's hook on each torch call, ~3 us; not Triton's launcher, CUDA's allocator or launches): rms_norm
    328 -> 217 us forward + backward (forward 118 -> 74), fused_add_rms_norm 794 -> 504 us (331 -> 193), about
    0.65x; Triton's Python per launch before its C launcher (binder, cache key) 14.3 -> 12.9 us forward, 19.5 ->
    18.4 us backward (rms_norm; fused_add_rms_norm's backward 20.1 -> 17.4). The counts carry over to a GPU host,
    the microseconds do not (its allocator and launches, unchanged here, are not in them): how much of the wall
    clock is left is for a GPU run with --kernel-times (docs/gpu_runbook.md). Left as it is: autograd's
    Function, Triton's launcher (calling the compiled kernel directly would skip its binder, but needs its own
    specialisation key, unverifiable without a GPU), dweight's sum and cast (torch.sum(..., dtype=) casts its input
    first: not the same sum, 0.5 apart on a (264, 4096) bf16 case).

Test:  python -m pytest tests/kernels/test_rms_norm.py tests/kernels/test_fused_add_rms_norm.py -q
       (CPU: Triton interpreter; GPU tests auto-run on CUDA)
Bench: python bench/bench_rms_norm.py [--op fused_add_rms_norm]   (GPU: real-model shapes; --quick for a CPU smoke run)
       python bench/bench_rms_norm.py --host [--against REV]       (CPU host work of a lone call, launches not run)
"""

from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import torch

from ._dispatch import HAS_TRITON, num_sms, use_triton

if HAS_TRITON:
    import triton
    import triton.language as tl

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Largest BLOCK_N the forward keeps in registers: 16384 fp32 over 16 warps is 32 values per thread per live
# tensor (x and w'); ptxas for sm_90 gives 59 registers, no spills. Larger hidden sizes take the column loop.
_MAX_BLOCK = 16384
# The backward keeps x, dy, w' and the dweight accumulator live across the row reduction, four row-sized
# tensors. ptxas (sm_90, `python -m bench.sm90`): 8192 takes 108 registers (16 warps), 4096 108 (8 warps), and the
# column loop at 8192 per block 63 (and 50 for the row-dot pass), none spilling. One block of 16384 with fp32 copies
# of x and dy live took 128 registers at 16 warps and spilled 176 bytes per thread (132 at 32 warps, 64 registers).
# Rows wider than 8192 up to 16384 stay in one block of 32 warps (64 registers, the most 1024 threads may have):
# - bf16 and fp16 x and dy are kept as loaded across the reduction (two to a register) and upcast again after it
#   (`_upcast_again`: integer paths the compiler cannot merge with the first conversion; a plain second conversion of
#   fp16 was merged, keeping fp32 copies live: 72 bytes spilled). 12 bytes still spilled with the column predicate
#   and the cp.async pipelining (STAGES=2), none without the predicate (EVEN_N: hidden exactly 16384), or, for a
#   masked 8193..16383, without the pipelining (STAGES=1). bf16 and fp16 alike: 64 registers, no spills.
# - fp32: x, dy, w' and the dweight accumulator at 16 values per thread each are 64 registers before any address,
#   all of the register file: one of the four cannot stay. w' is reloaded every row (W_PER_ROW, a 64 KB row that
#   stays in L1/L2, so DRAM still reads x and dy once) and g = dy w' kept across the reduction instead of dy: 64
#   registers, no spills at 12288 and 16384 unpipelined (STAGES=1) with the column predicate kept (16 bytes spilled
#   without it, 92 pipelined; at 16 warps, 128 registers: 24 unpipelined, 0 pipelined but 108 masked). w' kept and
#   reloaded nowhere spilled 56-60 bytes at 32 warps, 84 at 16.
# So x and dy of every dtype are read once up to 16384 (3 s moved per element, as liger's, whose one block keeps all
# of it live at 16 warps and spills). Wider rows take the column loop (5 s): 16384 per block in bf16/fp16 (64
# registers), 8192 in fp32 (16384 spilled 28 bytes). x and dy of different dtypes stay at 8192. Not yet timed on
# a GPU.
_MAX_BWD_BLOCK = 16384
_MAX_BWD_BLOCK_KEPT = 8192  # widest one-block row with every row tensor's fp32 copy live (and the fp32 column loop)
# Elements per tile: rows narrower than this are packed several to a program so short rows still give each
# program enough work (and the interpreter, at ~37 us per program, far fewer programs).
_TILE_ELEMS = 4096
# Backward programs when not on CUDA (interpreter): enough to exercise the cross-program dweight reduction.
_CPU_BWD_PROGRAMS = 4


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def launch_config(
    n_rows: int, n_cols: int, max_block: int | None = None, max_warps: int = 16
) -> tuple[int, int, bool, int]:
    """(BLOCK_M, BLOCK_N, ONE_BLOCK, num_warps) for an (n_rows, n_cols) problem."""
    cap = _MAX_BLOCK if max_block is None else max_block
    if cap < 16 or cap & (cap - 1):
        raise ValueError(f"max_block={cap} must be a power of two >= 16")
    block_n = min(_next_pow2(n_cols), cap)
    block_m = max(1, min(_TILE_ELEMS // block_n, _next_pow2(n_rows)))
    # 512 elements per warp (16 fp32 per thread) up to 16 warps (32 for the backward's 16384-wide bf16 rows); never
    # fewer than 4 so loads stay wide.
    num_warps = min(max_warps, max(4, _next_pow2(block_m * block_n // 512)))
    return block_m, block_n, n_cols <= block_n, num_warps


class BwdConfig(NamedTuple):
    """The backward's launch: BLOCK_M rows x BLOCK_N columns per tile, the row in one block or a column loop, warps,
    the row loop's pipeline stages, no column predicate (EVEN_N) and w' reloaded every row (W_PER_ROW)."""

    block_m: int
    block_n: int
    one_block: bool
    num_warps: int
    stages: int
    even_n: bool
    w_per_row: bool


def bwd_launch_config(
    n_rows: int,
    n_cols: int,
    dtype: torch.dtype | None,
    max_block: int | None = None,
    has_dh: bool = False,
    two_dx: bool = False,
) -> BwdConfig:
    """The backward's launch for x and dy of `dtype` (None when they differ); has_dh: fused_add_rms_norm's d_h_out is
    read too, two_dx: its gradient is written in two dtypes. Rows up to 16384 wide (`_MAX_BWD_BLOCK`) stay in one block
    (32 warps above 8192), unpipelined and with the column predicate where a 16384 block has masked columns, fp32 rows,
    or fp16 rows and d_h_out; wider rows loop over 16384-wide column blocks (8192 in fp32). x and dy of different
    dtypes, and fp32 with two dx dtypes (220 bytes spilled in one 16384 block): 8192 both ways."""
    if dtype in (torch.bfloat16, torch.float16):
        one_cap, loop_cap = _MAX_BWD_BLOCK, _MAX_BWD_BLOCK
    elif dtype == torch.float32 and not two_dx:
        one_cap, loop_cap = _MAX_BWD_BLOCK, _MAX_BWD_BLOCK_KEPT
    else:
        one_cap = loop_cap = _MAX_BWD_BLOCK_KEPT
    if max_block is not None:  # launch_config validates it
        one_cap, loop_cap = min(one_cap, max_block), min(loop_cap, max_block)
    cap = one_cap if _next_pow2(n_cols) <= one_cap else loop_cap
    block_m, block_n, one_block, num_warps = launch_config(n_rows, n_cols, cap, max_warps=32)
    wide = one_block and block_n > _MAX_BWD_BLOCK_KEPT
    w_per_row = wide and dtype == torch.float32
    unpipelined = wide and (n_cols != block_n or w_per_row or (dtype == torch.float16 and has_dh))
    even_n = n_cols == block_n and not unpipelined
    return BwdConfig(block_m, block_n, one_block, num_warps, 1 if unpipelined else 2, even_n, w_per_row)


if HAS_TRITON:

    @triton.jit
    def _rms_norm_fwd_kernel(
        x_ptr,  # (M, N) input, row stride stride_x, unit column stride
        res_ptr,  # (M, N) residual added to x when HAS_RESIDUAL (else None), row stride stride_res
        w_ptr,  # (N,) weight, any float dtype
        y_ptr,  # (M, N) output in h's dtype (x's without a residual), row stride stride_y
        h_ptr,  # (M, N) output when HAS_RESIDUAL (else None): h = x + residual rounded once to its dtype; stride_h
        rstd_ptr,  # (M,) fp32 output: 1 / sqrt(mean(h^2) + eps), saved for the backward
        M,
        N,
        stride_x,
        stride_res,
        stride_y,
        stride_h,
        eps,
        offset,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        ONE_BLOCK: tl.constexpr,
        HAS_RESIDUAL: tl.constexpr,
    ):
        eps32 = tl.cast(eps, tl.float32)
        off32 = tl.cast(offset, tl.float32)
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
        row_mask = rows < M
        rows64 = rows.to(tl.int64)  # M * N may pass 2^31
        x_rows = x_ptr + rows64[:, None] * stride_x  # (BLOCK_M, 1)
        y_rows = y_ptr + rows64[:, None] * stride_y  # (BLOCK_M, 1)
        if HAS_RESIDUAL:
            res_rows = res_ptr + rows64[:, None] * stride_res  # (BLOCK_M, 1)
            h_rows = h_ptr + rows64[:, None] * stride_h  # (BLOCK_M, 1)
        if ONE_BLOCK:
            cols = tl.arange(0, BLOCK_N)
            col_mask = cols < N
            mask = row_mask[:, None] & col_mask[None, :]
            x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)  # (BLOCK_M, BLOCK_N)
            if HAS_RESIDUAL:
                # Rounded to h's dtype before the norm reads it, as torch's x + residual is: normed = rms_norm(h).
                h = (x + tl.load(res_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)).to(
                    h_ptr.dtype.element_ty
                )
                tl.store(h_rows + cols[None, :], h, mask=mask)
                x = h.to(tl.float32)
            rstd = tl.rsqrt(tl.sum(x * x, axis=1) / N + eps32)  # (BLOCK_M,)
            w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32) + off32  # (BLOCK_N,)
            y = x * rstd[:, None] * w[None, :]
            tl.store(y_rows + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for start in tl.range(0, N, BLOCK_N):
                cols = start + tl.arange(0, BLOCK_N)
                mask = row_mask[:, None] & (cols < N)[None, :]
                x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                if HAS_RESIDUAL:
                    h = (x + tl.load(res_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)).to(
                        h_ptr.dtype.element_ty
                    )
                    tl.store(h_rows + cols[None, :], h, mask=mask)
                    x = h.to(tl.float32)
                acc += x * x
            rstd = tl.rsqrt(tl.sum(acc, axis=1) / N + eps32)  # (BLOCK_M,)
            src_rows = x_rows
            if HAS_RESIDUAL:
                # The second pass reads back the h this program wrote: the barrier makes every thread's stores
                # visible to the whole block (bar.sync orders global memory within a block).
                tl.debug_barrier()
                src_rows = h_rows
            for start in tl.range(0, N, BLOCK_N):
                cols = start + tl.arange(0, BLOCK_N)
                col_mask = cols < N
                mask = row_mask[:, None] & col_mask[None, :]
                x = tl.load(src_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32) + off32
                y = x * rstd[:, None] * w[None, :]
                tl.store(y_rows + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(rstd_ptr + rows, rstd, mask=row_mask)

    @triton.jit
    def _rms_norm_bwd_rowdot_kernel(
        dy_ptr,  # (M, N) upstream gradient, row stride stride_dy
        x_ptr,  # (M, N) forward input, row stride stride_x
        w_ptr,  # (N,) weight
        rstd_ptr,  # (M,) fp32 rstd from the forward
        c_ptr,  # (M,) fp32 output: c = sum_j(dy_j w'_j xh_j) / N per row
        M,
        N,
        stride_dy,
        stride_x,
        offset,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        off32 = tl.cast(offset, tl.float32)
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
        row_mask = rows < M
        rows64 = rows.to(tl.int64)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for start in tl.range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            col_mask = cols < N
            mask = row_mask[:, None] & col_mask[None, :]
            x = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + rows64[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32) + off32
            acc += dy * w[None, :] * x
        rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
        tl.store(c_ptr + rows, tl.sum(acc, axis=1) * rstd / N, mask=row_mask)

    @triton.jit
    def _upcast_again(v):
        """v as fp32, for a second use after a first `.to(tl.float32)` of the same v, by an integer path the compiler
        does not merge with the first conversion, so that v as loaded (two 16-bit values to a register) stays live
        instead of its fp32 copy. Bit-exact for every value but NaNs, which stay NaN (tests/kernels/test_rms_norm.py
        checks all 65536).
        bf16: the 16 bits shifted into the top of an fp32. fp16 (a branch-free conversion, as in Maratyszcza's FP16
        library): sign dropped, exponent and mantissa shifted into place and rebiased by an exponent add and a
        multiply by 2^-112 (normals, infinities and NaNs), subnormals m * 2^-24 as (0.5 + m * 2^-24) - 0.5, the sign
        put back. Other dtypes: a plain conversion (merged with the first)."""
        if v.dtype == tl.bfloat16:
            return (v.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
        if v.dtype == tl.float16:
            bits = v.to(tl.uint16, bitcast=True).to(tl.uint32)
            two_w = bits << 17  # exponent and mantissa at the top, sign shifted out
            normal = ((two_w >> 4) + 0x70000000).to(tl.float32, bitcast=True) * 1.925929944387236e-34  # * 2^-112
            sub = ((two_w >> 17) | 0x3F000000).to(tl.float32, bitcast=True) - 0.5
            mag = tl.where(two_w < 0x08000000, sub, normal)  # exponent field 0: subnormal (or zero)
            return (mag.to(tl.uint32, bitcast=True) | ((bits & 0x8000) << 16)).to(tl.float32, bitcast=True)
        return v.to(tl.float32)

    @triton.jit
    def _store_dx(
        dx,
        dh_ptr,
        dx_ptr,
        dx2_ptr,
        rows64,
        cols,
        mask,
        stride_dh,
        stride_dx,
        stride_dx2,
        HAS_DH: tl.constexpr,
        TWO_DX: tl.constexpr,
    ):
        """Store the fp32 input gradient dx (BLOCK_M, BLOCK_N) of rows64 x cols: plus the gradient arriving at the sum
        (HAS_DH: d_h = d_h_out + dx, the gradient of both x and the residual), rounded once to each output's dtype."""
        if HAS_DH:
            dx += tl.load(dh_ptr + rows64[:, None] * stride_dh + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(dx_ptr + rows64[:, None] * stride_dx + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
        if TWO_DX:
            tl.store(dx2_ptr + rows64[:, None] * stride_dx2 + cols[None, :], dx.to(dx2_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _rms_norm_bwd_kernel(
        dy_ptr,  # (M, N) upstream gradient, row stride stride_dy
        x_ptr,  # (M, N) forward input, row stride stride_x
        w_ptr,  # (N,) weight
        rstd_ptr,  # (M,) fp32 rstd from the forward
        c_ptr,  # (M,) fp32 per-row c from _rms_norm_bwd_rowdot_kernel when not ONE_BLOCK (else None)
        dh_ptr,  # (M, N) gradient arriving at h = x + residual when HAS_DH (else None), row stride stride_dh
        dx_ptr,  # (M, N) output (the residual's dtype with HAS_DH, else x's), row stride stride_dx
        dx2_ptr,  # (M, N) the same gradient in a second dtype when TWO_DX (the added x's; else None), stride_dx2
        dw_ptr,  # (programs, N) fp32 output when COMPUTE_DW (else None): this program's partial sum of dy * xh
        M,
        N,
        rows_per_prog,
        stride_dy,
        stride_x,
        stride_dh,
        stride_dx,
        stride_dx2,
        offset,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        ONE_BLOCK: tl.constexpr,
        COMPUTE_DW: tl.constexpr,
        HAS_DH: tl.constexpr,
        TWO_DX: tl.constexpr,
        EVEN_N: tl.constexpr,
        STAGES: tl.constexpr,
        W_PER_ROW: tl.constexpr,
    ):
        off32 = tl.cast(offset, tl.float32)
        pid = tl.program_id(0)
        row_start = pid * rows_per_prog
        row_end = tl.minimum(row_start + rows_per_prog, M)
        if ONE_BLOCK:
            cols = tl.arange(0, BLOCK_N)
            # EVEN_N (N == BLOCK_N): no per-column predicate; at BLOCK_N 16384 in 16 bits that is what fits 64 registers
            col_mask = cols < (BLOCK_N if EVEN_N else N)
            if not W_PER_ROW:
                w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32) + off32  # (BLOCK_N,)
            dw_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
            # STAGES=2: the next tile's x, dy and rstd stream into shared memory (cp.async) while this
            # one is computed. ptxas, sm_90, bf16: 120 -> 106 registers at hidden 4096 and 8192; without it
            # each row waited on its own loads (one row per iteration, 1-2 blocks per SM). 1 where 2 would spill
            # (`bwd_launch_config`).
            for r0 in tl.range(row_start, row_end, BLOCK_M, num_stages=STAGES):
                rows = r0 + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
                row_mask = rows < row_end
                rows64 = rows.to(tl.int64)
                mask = row_mask[:, None] & col_mask[None, :]
                x_st = tl.load(
                    x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0
                )  # storage dtype
                dy_st = tl.load(dy_ptr + rows64[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0)
                rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)  # (BLOCK_M,)
                if W_PER_ROW:
                    # fp32 rows wider than 8192: w' from L1/L2 every row (its registers are dweight's: _MAX_BWD_BLOCK)
                    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32) + off32
                xh = x_st.to(tl.float32) * rstd[:, None]  # (BLOCK_M, BLOCK_N)
                dy = dy_st.to(tl.float32)
                if COMPUTE_DW:
                    dw_acc += tl.sum(dy * xh, axis=0)
                g = dy * w[None, :]
                c = tl.sum(g * xh, axis=1) / N  # (BLOCK_M,)
                if W_PER_ROW:
                    # x and g live across the reduction (fp32, 16 registers each), dy and w' dead
                    dx = (g - xh * c[:, None]) * rstd[:, None]
                else:
                    # After the row reduction x and dy are upcast again from their storage dtype, so that what stays
                    # live across it is x and dy as loaded (16-bit: two to a register), not fp32 copies (_upcast_again).
                    xh = _upcast_again(x_st) * rstd[:, None]
                    dx = (_upcast_again(dy_st) * w[None, :] - xh * c[:, None]) * rstd[:, None]
                _store_dx(
                    dx, dh_ptr, dx_ptr, dx2_ptr, rows64, cols, mask, stride_dh, stride_dx, stride_dx2, HAS_DH, TWO_DX
                )
            if COMPUTE_DW:
                tl.store(dw_ptr + pid.to(tl.int64) * N + cols, dw_acc, mask=col_mask)
        else:
            # Columns outer, rows inner: dweight for one column block accumulates in registers over all of
            # this program's rows and is written once, so no program reads back its own global writes.
            for start in tl.range(0, N, BLOCK_N):
                cols = start + tl.arange(0, BLOCK_N)
                col_mask = cols < N
                w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32) + off32
                dw_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
                # Pipelined like the ONE_BLOCK loop: 127 -> 99 registers at BLOCK_N 16384 (63 at 8192).
                for r0 in tl.range(row_start, row_end, BLOCK_M, num_stages=2):
                    rows = r0 + tl.arange(0, BLOCK_M)
                    row_mask = rows < row_end
                    rows64 = rows.to(tl.int64)
                    mask = row_mask[:, None] & col_mask[None, :]
                    x = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                    dy = tl.load(dy_ptr + rows64[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(
                        tl.float32
                    )
                    rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
                    c = tl.load(c_ptr + rows, mask=row_mask, other=0.0)
                    xh = x * rstd[:, None]
                    dx = (dy * w[None, :] - xh * c[:, None]) * rstd[:, None]
                    _store_dx(
                        dx,
                        dh_ptr,
                        dx_ptr,
                        dx2_ptr,
                        rows64,
                        cols,
                        mask,
                        stride_dh,
                        stride_dx,
                        stride_dx2,
                        HAS_DH,
                        TWO_DX,
                    )
                    if COMPUTE_DW:
                        dw_acc += tl.sum(dy * xh, axis=0)
                if COMPUTE_DW:
                    tl.store(dw_ptr + pid.to(tl.int64) * N + cols, dw_acc, mask=col_mask)


def _require_triton() -> None:
    if not HAS_TRITON:
        raise RuntimeError("kernels.rms_norm: the Triton path needs triton (pip install triton)")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)  # triton.cdiv, without its constexpr-function wrapper's cost on the host


def _flat(t: torch.Tensor, n: int) -> torch.Tensor:
    """t as the kernels' rows of n: t itself where it is 2-D (any row stride) or contiguous (its rows n apart, whatever
    its rank), else t.reshape(-1, n) (a view, or a copy where the rows cannot be viewed so). No view op where none is
    needed (module docstring, "Host work")."""
    return t if t.dim() == 2 or t.is_contiguous() else t.reshape(-1, n)


def _rows(t: torch.Tensor, n: int) -> tuple[torch.Tensor, int]:
    """(the tensor the kernels read t's rows of n from, its row stride): `_flat`, then a contiguous copy where the
    columns' stride is not 1. The kernels take any row stride (a stride-0 broadcast dy included) but need contiguous
    columns."""
    if t.dim() != 2:
        if t.is_contiguous():
            return t, n
        t = t.reshape(-1, n)
    stride = t.stride()
    if stride[1] != 1 and n > 1:
        t = t.contiguous()
        stride = t.stride()
    return t, stride[0]


def _n_rows(shape: torch.Size) -> int:
    return shape[0] if len(shape) == 2 else math.prod(shape[:-1])


# Launch plans (grid, tiles, constexprs, warps; the backward's program count) by problem: a plain function of the
# problem's sizes, dtypes and device, computed once rather than on every call. Not used while torch.compile traces
# (the plan is computed there as it always was, no global state in the graph). fake CUDA (bench/sm90.py) clears it, as
# its SM count is not the machine's.
_PLANS: dict = {}
_MAX_PLANS = 4096  # a cap, for callers whose row counts never repeat


def clear_launch_plans() -> None:
    """Forget every cached launch plan (after the device's reported SM count changed, as under fake CUDA)."""
    _PLANS.clear()


def _plan(build, *key):
    if torch.compiler.is_compiling():
        return build(*key)
    plan = _PLANS.get((build, *key))
    if plan is None:
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        plan = _PLANS[(build, *key)] = build(*key)
    return plan


def _fwd_plan(m, n, max_block, has_residual):
    """(grid, the launch's constexprs and warps) of the forward."""
    block_m, block_n, one_block, num_warps = launch_config(m, n, max_block)
    meta = dict(BLOCK_M=block_m, BLOCK_N=block_n, ONE_BLOCK=one_block, HAS_RESIDUAL=has_residual, num_warps=num_warps)
    return (_cdiv(m, block_m),), meta


def _bwd_plan(m, n, same_dtype, max_block, has_dh, two_dx, compute_dw, num_programs, device):
    """(programs, rows per program, the row-dot pass's grid and constexprs or None, the backward's constexprs)."""
    cfg = bwd_launch_config(m, n, same_dtype, max_block, has_dh=has_dh, two_dx=two_dx)
    block_m, block_n, num_warps = cfg.block_m, cfg.block_n, cfg.num_warps
    if num_programs is None:
        # About two programs per SM keeps every SM streaming while one waits on memory (not yet tuned on a
        # GPU: bench/bench_rms_norm.py is the place to revisit it).
        num_programs = 2 * num_sms(device.index or 0) if device.type == "cuda" else _CPU_BWD_PROGRAMS
    if num_programs < 1:
        raise ValueError(f"num_programs={num_programs} must be >= 1")
    tiles = _cdiv(m, block_m)
    # Whole tiles per program so only the last program sees a ragged tile.
    rows_per_prog = _cdiv(tiles, min(num_programs, tiles)) * block_m
    programs = _cdiv(m, rows_per_prog)
    rowdot = None
    if not cfg.one_block:
        rowdot = (tiles,), dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps)
    meta = dict(
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        ONE_BLOCK=cfg.one_block,
        COMPUTE_DW=compute_dw,
        HAS_DH=has_dh,
        TWO_DX=two_dx,
        EVEN_N=cfg.even_n,
        STAGES=cfg.stages,
        W_PER_ROW=cfg.w_per_row,
        num_warps=num_warps,
    )
    return programs, rows_per_prog, rowdot, meta


def _fwd(x, residual, weight, eps, offset, max_block):
    """The forward launch: (y, h, rstd); h = x + residual (None without a residual) and y in promote(x, residual), both
    in x's shape (any rank: its rows are its last dim)."""
    _require_triton()
    shape, x_dtype, device = x.shape, x.dtype, x.device
    n, m = shape[-1], _n_rows(shape)
    x, stride_x = _rows(x, n)
    weight = weight.contiguous()
    if residual is None:
        out_dtype, h = x_dtype, None
    else:
        residual, stride_res = _rows(residual, n)
        res_dtype = residual.dtype
        # as torch's x + residual (torch.promote_types is an aten op: not called when the dtypes agree)
        out_dtype = x_dtype if res_dtype == x_dtype else torch.promote_types(x_dtype, res_dtype)
        h = torch.empty(shape, dtype=out_dtype, device=device)  # x's shape, contiguous: rows n apart
    y = torch.empty(shape, dtype=out_dtype, device=device)  # x's shape, contiguous: rows n apart
    rstd = torch.empty((m,), dtype=torch.float32, device=device)  # (M,)
    if m == 0:
        return y, h, rstd
    grid, meta = _plan(_fwd_plan, m, n, max_block, residual is not None)
    if residual is None:  # None: no pointer to specialise (the stride is not read either)
        stride_res = stride_x
    _rms_norm_fwd_kernel[grid](x, residual, weight, y, h, rstd, m, n, stride_x, stride_res, n, n, eps, offset, **meta)
    return y, h, rstd


def rms_norm_fwd(x2d: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, *, max_block: int | None = None):
    """Launch the forward on an (M, N) input (or any rank, rows in the last dim). Returns y in x's shape and dtype and
    rstd (M,) fp32. No autograd."""
    y, _, rstd = _fwd(x2d, None, weight, eps, offset, max_block)
    return y, rstd


def fused_add_rms_norm_fwd(
    x2d: torch.Tensor,
    res2d: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    offset: float,
    *,
    max_block: int | None = None,
):
    """Launch the forward of rms_norm(x + residual) on (M, N) inputs (or any rank), one pass. Returns normed and
    h = x + residual in x's shape and promote(x, residual)'s dtype, and rstd (M,) fp32. No autograd."""
    return _fwd(x2d, res2d, weight, eps, offset, max_block)


def _bwd(dy, x, weight, rstd, offset, dh, dx_dtypes, compute_dw, max_block, num_programs):
    """The backward launches: ([dx in each of dx_dtypes (one or two), in dy's shape], dweight or None); with dh, dx
    includes it. dy, x and dh: the same rows, any rank each (x as the forward saved it)."""
    _require_triton()
    shape, device, w_dtype = dy.shape, x.device, weight.dtype
    n, m = shape[-1], _n_rows(x.shape)
    dy, stride_dy = _rows(dy, n)
    x, stride_x = _rows(x, n)
    weight = weight.contiguous()
    dxs = [torch.empty(shape, dtype=d, device=device) for d in dx_dtypes]  # dy's shape, contiguous: rows n apart
    if m == 0:
        dw = torch.zeros((n,), dtype=w_dtype, device=weight.device) if compute_dw else None
        return dxs, dw
    x_dtype = x.dtype
    same_dtype = x_dtype if x_dtype == dy.dtype else None
    programs, rows_per_prog, rowdot, meta = _plan(
        _bwd_plan, m, n, same_dtype, max_block, dh is not None, len(dxs) == 2, compute_dw, num_programs, device
    )
    # Every (program, column) of the partial buffer is written exactly once, so no zero-fill is needed. Unused
    # pointers are None (no dweight, no row-dot pass, no d_h_out, one dx dtype): nothing to allocate or specialise.
    dw_partial = torch.empty((programs, n), dtype=torch.float32, device=device) if compute_dw else None
    if rowdot is None:
        c = None
    else:
        c = torch.empty((m,), dtype=torch.float32, device=device)  # (M,)
        grid, rowdot_meta = rowdot
        _rms_norm_bwd_rowdot_kernel[grid](dy, x, weight, rstd, c, m, n, stride_dy, stride_x, offset, **rowdot_meta)
    dx2 = dxs[1] if len(dxs) == 2 else None
    dh, stride_dh = (None, stride_dy) if dh is None else _rows(dh, n)
    _rms_norm_bwd_kernel[(programs,)](
        dy,
        x,
        weight,
        rstd,
        c,
        dh,
        dxs[0],
        dx2,
        dw_partial,
        m,
        n,
        rows_per_prog,
        stride_dy,
        stride_x,
        stride_dh,
        n,
        n,
        offset,
        **meta,
    )
    if not compute_dw:
        return dxs, None
    dw = dw_partial.sum(dim=0)  # (N,), summed in fp32
    return dxs, (dw if w_dtype == torch.float32 else dw.to(w_dtype))  # then rounded once to weight's dtype


def rms_norm_bwd(
    dy2d: torch.Tensor,
    x2d: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    offset: float,
    *,
    compute_dw: bool = True,
    max_block: int | None = None,
    num_programs: int | None = None,
):
    """Launch the backward. Returns dx in dy's shape (M, N) and x's dtype, and dweight (N,) in weight's dtype (None when
    compute_dw is False). `num_programs` overrides the number of backward programs (dweight partial rows)."""
    (dx,), dw = _bwd(dy2d, x2d, weight, rstd, offset, None, [x2d.dtype], compute_dw, max_block, num_programs)
    return dx, dw


def fused_add_rms_norm_bwd(
    dnormed: torch.Tensor,
    dh_out: torch.Tensor | None,
    h: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    offset: float,
    x_dtype: torch.dtype,
    res_dtype: torch.dtype,
    *,
    compute_dw: bool = True,
    max_block: int | None = None,
    num_programs: int | None = None,
):
    """Launch the backward of (normed, h) = fused_add_rms_norm(x, residual): d_h = dh_out + the norm's dx, which is
    the gradient of both x and the residual. Returns (dx in x_dtype, dresidual in res_dtype: the same tensor when the
    dtypes agree, else written by the same launch), dweight (None when compute_dw is False)."""
    dtypes = [res_dtype] if x_dtype == res_dtype else [res_dtype, x_dtype]
    dxs, dw = _bwd(dnormed, h, weight, rstd, offset, dh_out, dtypes, compute_dw, max_block, num_programs)
    return dxs[-1], dxs[0], dw


class RMSNormFunction(torch.autograd.Function):
    """Autograd over the Triton launchers; takes x of any rank (rows in the last dim), y in its shape. A 2-D or
    contiguous x is read where it lies: no view op, and no view node in the graph."""

    @staticmethod
    def forward(ctx, x, weight, eps, offset, max_block=None):
        rows = _flat(x, x.shape[-1])  # x, or its rows viewed (or copied) where x is neither 2-D nor contiguous
        y, _, rstd = _fwd(rows, None, weight, eps, offset, max_block)
        ctx.save_for_backward(rows, weight, rstd)
        ctx.offset, ctx.max_block = offset, max_block
        return y if rows is x else y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        need_dx, need_dw = ctx.needs_input_grad[:2]
        (dx,), dw = _bwd(dy, x, weight, rstd, ctx.offset, None, [x.dtype], need_dw, ctx.max_block, None)
        return (dx if need_dx else None), dw, None, None, None


class FusedAddRMSNormFunction(torch.autograd.Function):
    """Autograd over the Triton launchers for (normed, h) = (rms_norm(x + residual), x + residual); inputs of any rank
    (rows in the last dim), outputs in x's shape. Saves h (which the caller keeps anyway as the residual stream), the
    weight and rstd."""

    @staticmethod
    def forward(ctx, x, residual, weight, eps, offset, max_block=None):
        y, h, rstd = _fwd(x, residual, weight, eps, offset, max_block)
        ctx.save_for_backward(h, weight, rstd)
        ctx.offset, ctx.max_block, ctx.dtypes = offset, max_block, (x.dtype, residual.dtype)
        ctx.set_materialize_grads(False)  # an unused h hands back None: no zero tensor to read
        return y, h

    @staticmethod
    def backward(ctx, dnormed, dh):
        h, weight, rstd = ctx.saved_tensors
        if dnormed is None:  # normed unused: the norm adds nothing to d_h
            dnormed = torch.zeros_like(h)
        x_dtype, res_dtype = ctx.dtypes
        dtypes = [res_dtype] if x_dtype == res_dtype else [res_dtype, x_dtype]
        dxs, dw = _bwd(dnormed, h, weight, rstd, ctx.offset, dh, dtypes, ctx.needs_input_grad[2], ctx.max_block, None)
        return dxs[-1], dxs[0], dw, None, None, None


def _check_args(x, weight, eps, offset, op="rms_norm") -> None:
    if not isinstance(x, torch.Tensor) or x.dtype not in _DTYPES:
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"{op}: x must be a float32, bfloat16 or float16 tensor, got {got}")
    shape = x.shape
    if len(shape) < 1 or shape[-1] < 1:
        raise ValueError(f"{op}: x must have a last dim (the hidden size) >= 1, got shape {tuple(shape)}")
    if not isinstance(weight, torch.Tensor) or weight.dtype not in _DTYPES:
        got = weight.dtype if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise TypeError(f"{op}: weight must be a float32, bfloat16 or float16 tensor, got {got}")
    w_shape = weight.shape
    if len(w_shape) != 1 or w_shape[0] != shape[-1]:
        raise ValueError(f"{op}: weight must have shape ({shape[-1]},) to match x's last dim, got {tuple(w_shape)}")
    if weight.device != x.device:
        raise ValueError(f"{op}: weight is on {weight.device} but x is on {x.device}; they must share a device")
    # type(...) is float first: the common case without numbers.Real's abstract-class check
    if type(eps) is not float and (isinstance(eps, bool) or not isinstance(eps, numbers.Real)) or not eps >= 0:
        raise ValueError(f"{op}: eps must be a real number >= 0, got {eps!r}")
    if type(offset) is not float and (isinstance(offset, bool) or not isinstance(offset, numbers.Real)):
        raise ValueError(f"{op}: offset must be a real number (0.0 for Llama, 1.0 for Gemma), got {offset!r}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, offset: float = 0.0) -> torch.Tensor:
    """y = x * rsqrt(mean(x^2, -1) + eps) * (offset + weight), any leading dims, fp32 math, output in x's dtype.

    CUDA tensors run the Triton kernels, CPU tensors the reference (see `kernels._dispatch`)."""
    _check_args(x, weight, eps, offset)
    if not use_triton(x, weight):
        return rms_norm_ref(x, weight, eps, offset)
    return RMSNormFunction.apply(x, weight, float(eps), float(offset), None)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, offset: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(h, weight, eps, offset), h) with h = x + residual, in one pass: the pre-norm residual step of a
    decoder layer. h is rounded once to promote(x, residual)'s dtype, as torch's add is, and normed is computed from
    that h; both come back in that dtype. The gradient reaching h (from normed and from h's own later use) is the
    gradient of both x and residual.

    CUDA tensors run the Triton kernels, CPU tensors the reference (see `kernels._dispatch`)."""
    _check_args(x, weight, eps, offset, "fused_add_rms_norm")
    if not isinstance(residual, torch.Tensor) or residual.dtype not in _DTYPES:
        got = residual.dtype if isinstance(residual, torch.Tensor) else type(residual).__name__
        raise TypeError(f"fused_add_rms_norm: residual must be a float32, bfloat16 or float16 tensor, got {got}")
    if residual.shape != x.shape or residual.device != x.device:
        raise ValueError(
            f"fused_add_rms_norm: residual must have x's shape {tuple(x.shape)} and device {x.device}, "
            f"got {tuple(residual.shape)} on {residual.device}"
        )
    if not use_triton(x, residual, weight):
        return fused_add_rms_norm_ref(x, residual, weight, eps, offset)
    return FusedAddRMSNormFunction.apply(x, residual, weight, float(eps), float(offset), None)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, offset: float = 0.0) -> torch.Tensor:
    """Plain PyTorch RMSNorm: fp32 math (fp64 for fp64 inputs), one cast back to x's dtype; autograd-differentiable."""
    compute = torch.promote_types(x.dtype, torch.float32)
    xc = x.to(compute)  # (..., N)
    rstd = torch.rsqrt(xc.pow(2).mean(dim=-1, keepdim=True) + eps)  # (..., 1)
    return (xc * rstd * (offset + weight.to(compute))).to(x.dtype)


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, offset: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain PyTorch (rms_norm_ref(x + residual), x + residual); autograd-differentiable."""
    h = x + residual
    return rms_norm_ref(h, weight, eps, offset), h
