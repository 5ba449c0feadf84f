"""The gated RMSNorm of Gated DeltaNet layers (Qwen3.5, Qwen3-Next): y = rmsnorm(x) * weight * silu(z) over each
value head's V channels, fused forward and backward in Triton (transformers' Qwen3_5RMSNormGated, fla's
FusedRMSNormGated).

Math (one row x of width N with its gate z; all arithmetic in fp32 whatever the storage dtypes)
    forward   r    = 1 / sqrt(sum_j x_j^2 / N + eps)          (saved for backward: one fp32 per row)
              xh   = x r,   a = silu(z) = z sigmoid(z)
              y    = xh w a                                    (one rounding: the final cast to x's dtype)
    backward  g    = dy w a
              c    = sum_j g_j xh_j / N                        (one scalar per row)
              dx   = r (g - xh c)
              dz   = dy xh w silu'(z),  silu'(z) = s (1 + z (1 - s)), s = sigmoid(z)
              dw   = sum over rows of dy xh a                  (fp32 partial sums per program, then one reduction)
The backward recomputes silu(z) from the saved gate (which autograd holds anyway: it is in_proj_z's output).

transformers casts the normalised row to x's dtype before the weight and computes the gate's SiLU in fp32, then casts
the product once more (`trainer.model.gated_deltanet.gated_rms_norm_plain` does exactly that); we keep fp32 to the
single final cast, so in bf16/fp16 we are at least as close to the exact fp32 result and differ from transformers'
by up to about one unit in the last place; in fp32 the two agree to rounding (tests/kernels/test_gated_rms_norm.py).

Bytes moved per element (s = element size of x and z; weight, rstd and the dweight partials are O(N + M)):
    forward 3s (read x and z, write y); backward 5s (read dy, x and z, write dx and dz). Both the minimum for these
    inputs and outputs (bench/bench_gated_rms_norm.py's model; tests/bench/test_byte_models.py holds it equal to the
    traffic meter).

Launch strategy: rows are flattened to (M, N) with contiguous columns (a head's V channels: 128 in Qwen3.5); a tile is
BLOCK_M rows x BLOCK_N = next_pow2(N) columns, the whole row in registers, with BLOCK_M chosen so a tile holds about
4096 elements forward (32 rows of 128), 2048 backward. Rows up to `MAX_N` wide; wider rows are refused in one line
(no Gated DeltaNet has them). Forward: one program per tile. Backward: a fixed number of programs (about two per
SM on CUDA), each owning a contiguous chunk of rows and one fp32 row of the (programs, N) dweight partial buffer,
written once; `torch.sum` finishes dweight in fp32: no atomics, deterministic. Not yet timed on a GPU; registers and
spills: `python -m bench.sm90 --only gated_rms_norm`.

Test:  python -m pytest tests/kernels/test_gated_rms_norm.py -q   (CPU: Triton interpreter)
Bench: python bench/bench_gated_rms_norm.py                       (GPU: Qwen3.5-9B's heads; --quick for a CPU run)
"""

from __future__ import annotations

import numbers

import torch
import torch.nn.functional as F

from ._dispatch import HAS_TRITON, num_sms, use_triton

if HAS_TRITON:
    import triton
    import triton.language as tl

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_N = 8192  # widest row kept in registers: x, z, dy, w and the dweight accumulator live at once in backward
_TILE_ELEMS = 4096  # elements per forward tile: several short rows per program (and few interpreter programs)
# The backward keeps x, the gate and dy of a tile live: at 4096 elements over 8 warps (16 per thread) ptxas (sm_90) gave
# 130-140 registers, one program per SM; tiles of 2048 over 8 warps (8 per thread): 96 in bf16, 77 in fp32, two
# programs per SM, no spills (`python -m bench.sm90 --only gated_rms_norm`).
_BWD_TILE_ELEMS = 2048
_BWD_ELEMS_PER_WARP = 256
_CPU_BWD_PROGRAMS = 4  # interpreter: enough programs to exercise the cross-program dweight reduction


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def launch_config(
    n_rows: int, n_cols: int, tile_elems: int = _TILE_ELEMS, elems_per_warp: int = 512
) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) for an (n_rows, n_cols) problem: the whole row in one block, about `tile_elems`
    elements per tile, `elems_per_warp` per warp (512: 16 fp32 values per thread per live tensor), 4 to 16 warps."""
    block_n = _next_pow2(n_cols)
    block_m = max(1, min(tile_elems // block_n, _next_pow2(n_rows)))
    return block_m, block_n, min(16, max(4, _next_pow2(block_m * block_n // elems_per_warp)))


if HAS_TRITON:

    @triton.jit
    def _gated_rms_norm_fwd_kernel(
        x_ptr,  # (M, N) input, row stride stride_x, unit column stride
        z_ptr,  # (M, N) gate, row stride stride_z
        w_ptr,  # (N,) weight, any float dtype
        y_ptr,  # (M, N) output in x's dtype, contiguous
        rstd_ptr,  # (M,) fp32 output: 1 / sqrt(mean(x^2) + eps), saved for the backward
        M,
        N,
        stride_x,
        stride_z,
        eps,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        eps32 = tl.cast(eps, tl.float32)  # a Python float may arrive as fp64 under torch.compile
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
        row_mask = rows < M
        rows64 = rows.to(tl.int64)  # M * N may pass 2^31
        cols = tl.arange(0, BLOCK_N)
        col_mask = cols < N
        mask = row_mask[:, None] & col_mask[None, :]
        x = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + rows64[:, None] * stride_z + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / N + eps32)  # (BLOCK_M,)
        w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)  # (BLOCK_N,)
        y = x * rstd[:, None] * w[None, :] * (z * tl.sigmoid(z))
        tl.store(y_ptr + rows64[:, None] * N + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(rstd_ptr + rows, rstd, mask=row_mask)

    @triton.jit
    def _gated_rms_norm_bwd_kernel(
        dy_ptr,  # (M, N) upstream gradient, row stride stride_dy
        x_ptr,  # (M, N) forward input, row stride stride_x
        z_ptr,  # (M, N) forward gate, row stride stride_z
        w_ptr,  # (N,) weight
        rstd_ptr,  # (M,) fp32 rstd from the forward
        dx_ptr,  # (M, N) output in x's dtype, contiguous
        dz_ptr,  # (M, N) output in z's dtype, contiguous
        dw_ptr,  # (programs, N) fp32 output: this program's partial sum of dy * xh * silu(z) over its rows
        M,
        N,
        rows_per_prog,
        stride_dy,
        stride_x,
        stride_z,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        COMPUTE_DW: tl.constexpr,
    ):
        pid = tl.program_id(0)
        row_start = pid * rows_per_prog
        row_end = tl.minimum(row_start + rows_per_prog, M)
        cols = tl.arange(0, BLOCK_N)
        col_mask = cols < N
        w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)  # (BLOCK_N,)
        dw_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for r0 in tl.range(row_start, row_end, BLOCK_M, num_stages=2):
            rows = r0 + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
            row_mask = rows < row_end
            rows64 = rows.to(tl.int64)
            mask = row_mask[:, None] & col_mask[None, :]
            x = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            z = tl.load(z_ptr + rows64[:, None] * stride_z + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + rows64[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)  # (BLOCK_M,)
            xh = x * rstd[:, None]
            s = tl.sigmoid(z)
            a = z * s
            if COMPUTE_DW:
                dw_acc += tl.sum(dy * xh * a, axis=0)
            dyw = dy * w[None, :]
            g = dyw * a
            c = tl.sum(g * xh, axis=1) / N  # (BLOCK_M,)
            dx = (g - xh * c[:, None]) * rstd[:, None]
            dz = dyw * xh * (s + a * (1.0 - s))
            out = rows64[:, None] * N + cols[None, :]
            tl.store(dx_ptr + out, dx.to(dx_ptr.dtype.element_ty), mask=mask)
            tl.store(dz_ptr + out, dz.to(dz_ptr.dtype.element_ty), mask=mask)
        if COMPUTE_DW:
            tl.store(dw_ptr + pid.to(tl.int64) * N + cols, dw_acc, mask=col_mask)


def _unit_col_stride(t: torch.Tensor) -> torch.Tensor:
    # the kernels take any row stride (a stride-0 broadcast dy included) but need contiguous columns
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


def gated_rms_norm_fwd(x2d: torch.Tensor, z2d: torch.Tensor, weight: torch.Tensor, eps: float):
    """Launch the forward on (M, N) x and gate. Returns y (M, N) in x's dtype and rstd (M,) fp32. No autograd."""
    x2d, z2d, weight = _unit_col_stride(x2d), _unit_col_stride(z2d), weight.contiguous()
    M, N = x2d.shape
    y = torch.empty((M, N), dtype=x2d.dtype, device=x2d.device)
    rstd = torch.empty((M,), dtype=torch.float32, device=x2d.device)
    if M == 0:
        return y, rstd
    block_m, block_n, num_warps = launch_config(M, N)
    _gated_rms_norm_fwd_kernel[(triton.cdiv(M, block_m),)](
        x2d,
        z2d,
        weight,
        y,
        rstd,
        M,
        N,
        x2d.stride(0),
        z2d.stride(0),
        eps,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        num_warps=num_warps,
    )
    return y, rstd


def gated_rms_norm_bwd(
    dy2d: torch.Tensor,
    x2d: torch.Tensor,
    z2d: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    *,
    compute_dw: bool = True,
    num_programs: int | None = None,
):
    """Launch the backward. Returns dx (M, N) in x's dtype, dz (M, N) in z's dtype and dweight (N,) in weight's dtype
    (None when compute_dw is False); `num_programs` overrides the number of backward programs (dweight partial rows)."""
    dy2d, x2d, z2d = _unit_col_stride(dy2d), _unit_col_stride(x2d), _unit_col_stride(z2d)
    weight = weight.contiguous()
    M, N = x2d.shape
    dx = torch.empty((M, N), dtype=x2d.dtype, device=x2d.device)
    dz = torch.empty((M, N), dtype=z2d.dtype, device=z2d.device)
    if M == 0:
        return dx, dz, (torch.zeros_like(weight) if compute_dw else None)
    block_m, block_n, num_warps = launch_config(M, N, _BWD_TILE_ELEMS, _BWD_ELEMS_PER_WARP)
    if num_programs is None:
        num_programs = 2 * num_sms(x2d.device.index or 0) if x2d.is_cuda else _CPU_BWD_PROGRAMS
    tiles = triton.cdiv(M, block_m)
    rows_per_prog = triton.cdiv(tiles, min(num_programs, tiles)) * block_m  # whole tiles: only the last is ragged
    programs = triton.cdiv(M, rows_per_prog)
    # every (program, column) of the partial buffer is written exactly once: no zero-fill
    dw_partial = torch.empty((programs, N) if compute_dw else (1,), dtype=torch.float32, device=x2d.device)
    _gated_rms_norm_bwd_kernel[(programs,)](
        dy2d,
        x2d,
        z2d,
        weight,
        rstd,
        dx,
        dz,
        dw_partial,
        M,
        N,
        rows_per_prog,
        dy2d.stride(0),
        x2d.stride(0),
        z2d.stride(0),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        COMPUTE_DW=compute_dw,
        num_warps=num_warps,
    )
    return dx, dz, (dw_partial.sum(dim=0).to(weight.dtype) if compute_dw else None)


class GatedRMSNormFunction(torch.autograd.Function):
    """Autograd over the Triton launchers; (M, N) x and gate. Saves x, the gate, the weight and rstd."""

    @staticmethod
    def forward(ctx, x2d, z2d, weight, eps):
        y, rstd = gated_rms_norm_fwd(x2d, z2d, weight, eps)
        ctx.save_for_backward(x2d, z2d, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x2d, z2d, weight, rstd = ctx.saved_tensors
        dx, dz, dw = gated_rms_norm_bwd(dy, x2d, z2d, weight, rstd, compute_dw=ctx.needs_input_grad[2])
        return dx, dz, dw, None


def _check_args(x, gate, weight, eps) -> None:
    for name, t in (("x", x), ("gate", gate), ("weight", weight)):
        if not isinstance(t, torch.Tensor) or t.dtype not in _DTYPES:
            got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise TypeError(f"gated_rms_norm: {name} must be a float32, bfloat16 or float16 tensor, got {got}")
    if x.dim() < 1 or x.shape[-1] < 1 or gate.shape != x.shape:
        raise ValueError(
            f"gated_rms_norm: x and gate must share a shape with a last dim >= 1, got {tuple(x.shape)} and "
            f"{tuple(gate.shape)}"
        )
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"gated_rms_norm: weight must have shape ({x.shape[-1]},), got {tuple(weight.shape)}")
    if len({x.device, gate.device, weight.device}) != 1:
        raise ValueError("gated_rms_norm: x, gate and weight must share a device")
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not eps >= 0:
        raise ValueError(f"gated_rms_norm: eps must be a real number >= 0, got {eps!r}")


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """rmsnorm(x) * weight * silu(gate) over the last dim, any leading dims, fp32 math, output in x's dtype.

    CUDA tensors run the Triton kernels (rows up to MAX_N wide), CPU tensors the reference (`kernels._dispatch`)."""
    _check_args(x, gate, weight, eps)
    if not use_triton(x, gate, weight):
        return gated_rms_norm_ref(x, gate, weight, eps)
    n = x.shape[-1]
    if n > MAX_N:
        raise ValueError(f"gated_rms_norm: rows of {n} channels are wider than the Triton kernel's {MAX_N}")
    y = GatedRMSNormFunction.apply(x.reshape(-1, n), gate.reshape(-1, n), weight, float(eps))  # (M, N)
    return y.view(x.shape)


def gated_rms_norm_ref(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Plain PyTorch: fp32 math (fp64 for fp64 inputs), one cast back to x's dtype; autograd-differentiable."""
    compute = torch.promote_types(x.dtype, torch.float32)
    xc = x.to(compute)  # (..., N)
    rstd = torch.rsqrt(xc.pow(2).mean(dim=-1, keepdim=True) + eps)  # (..., 1)
    return (xc * rstd * weight.to(compute) * F.silu(gate.to(compute))).to(x.dtype)
