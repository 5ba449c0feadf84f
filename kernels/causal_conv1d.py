"""The short causal convolution of Gated DeltaNet (and Mamba-style) layers, in plain PyTorch: each of D channels
convolved with its own W taps over the tokens before it (depthwise, left-padded with W - 1 zeros), then an activation:

    y[t, d] = act(bias[d] + sum_{i < W} weight[d, i] x[t - (W - 1) + i, d])      (x before a sequence's start: 0)

x: (B, T, D); weight: (D, W) (nn.Conv1d's (D, 1, W) squeezed, as transformers passes it); bias (D,) or None;
activation "silu" or None. With `cu_seqlens` ((N + 1,) offsets of N sequences packed into one row, B = 1) the
convolution restarts at every boundary: no token reads the sequence before it, so a packed row gives each sequence's
outputs and gradients as if it ran alone (transformers' fallback, and `causal_conv1d_fn` without `seq_idx`, read
across). `causal_conv1d_ref` computes it in fp32 (fp64 for fp64 inputs), returned in x's dtype, differentiable through
autograd; `causal_conv1d` in Triton (CUDA tensors, or the interpreter), fused with the activation, forward and
backward.

Math of the kernels (s indexes tokens of the flattened (B T) rows, each token's sequence starting at start[s]; a
product of x before start[s] is 0; fp32 whatever the storage dtypes; act' = silu' = sg (1 + p (1 - sg)), sg =
sigmoid(p))
    forward   p[t]    = bias + sum_i w[i] x[t - (W - 1) + i]          y[t] = act(p[t])   (one rounding: y's cast)
    backward  dp[t]   = dy[t] act'(p[t])                                (p recomputed from x: nothing saved but x)
              dx[s]   = sum_j w[W - 1 - j] dp[s + j]                    (t = s + j in s's own sequence only)
              dw[i]   = sum_t dp[t] x[t - (W - 1) + i],  dbias = sum_t dp[t]   (fp32 partials per program, summed)
A program owns a tile of BLOCK_T (backward: BWD_BLOCK_T) tokens x BLOCK_D channels. Forward: the W shifted tiles of
x a token reads. Backward: for each of the W tokens t = s + j whose taps read x[s], p[t] again from its W shifted
tiles of x and dy[t] (dp of every token a dx needs, its own and the next W - 1), then the tile's own taps once more
for dw; where t lies in s's sequence, x before start[s] is before start[t] too, so one mask serves every shift. A
fixed number of programs along the tokens (about two per SM with the channel blocks) each loops over its tiles and
keeps its dw and dbias partials in registers, written once: no atomics, deterministic.

Bytes per element (s = element size of x; the weight, bias, starts and dw partials are O(D W + tokens)): forward
issues W reads of x (the shifted tiles are the same cache lines: DRAM sees x about once) and writes y once; backward
issues W (W + 1) reads of x and W of dy (DRAM about one of each: the shifted tiles of a program's tokens stay in
L1/L2) and writes dx once. The minimum is 2s forward, 3s backward. `bench/bench_causal_conv1d.py`'s `traffic_parts`
counts the issued bytes exactly (the meter agrees: tests/bench/test_byte_models.py). Registers and spills:
`python -m bench.sm90 --only causal_conv1d`. Not yet timed on a GPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._dispatch import HAS_TRITON, num_sms, use_triton
from ._packed import sequence_spans

if HAS_TRITON:
    import triton
    import triton.language as tl

ACTIVATIONS = (None, "silu")
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_WIDTH = 8  # taps the kernels unroll (Qwen3.5 and Mamba use 4)
BLOCK_T, BLOCK_D = 32, 128  # a forward tile: 4096 elements, 16 per thread at 8 warps
# The backward's W x W unrolled taps keep more live: ptxas (sm_90, bf16, 8 warps) gave 255 registers at 32 tokens, 134
# at 16, 104 at 8 (110 in fp32): two programs per SM, no spills (`python -m bench.sm90 --only causal_conv1d`).
BWD_BLOCK_T = 8
_NUM_WARPS = 8
_CPU_T_PROGRAMS = 3  # interpreter: backward programs along the tokens (the dweight partials' rows)


def causal_conv1d_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """The causal depthwise convolution (module docstring): (B, T, D) in x's dtype."""
    _check_args(x, weight, bias, activation)
    B, T, D = x.shape
    spans = sequence_spans("causal_conv1d", B, T, cu_seqlens)
    compute = torch.promote_types(x.dtype, torch.float32)
    w = weight.to(compute)[:, None, :]  # (D, 1, W)
    width = weight.shape[1]
    outs = []
    for start, end in spans:
        if end == start:  # an empty sequence
            continue
        part = x[:, start:end].to(compute).transpose(1, 2)  # (B, D, t)
        y = F.conv1d(F.pad(part, (width - 1, 0)), w, None if bias is None else bias.to(compute), groups=D)
        outs.append(y.transpose(1, 2))
    y = torch.cat(outs, dim=1) if outs else x.new_zeros(x.shape, dtype=compute)
    return (F.silu(y) if activation == "silu" else y).to(x.dtype)


if HAS_TRITON:

    @triton.jit
    def _conv_fwd_kernel(
        x_ptr,  # (N, D) tokens of every row, contiguous
        w_ptr,  # (D, W) taps, contiguous
        b_ptr,  # (D,) bias (unused without HAS_BIAS)
        start_ptr,  # (N,) int32: the index of each token's sequence start
        y_ptr,  # (N, D) output in x's dtype
        N,
        D,
        W: tl.constexpr,
        SILU: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # (BLOCK_T,)
        d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)  # (BLOCK_D,)
        t_ok, d_ok = t < N, d < D
        start = tl.load(start_ptr + t, mask=t_ok, other=0)  # (BLOCK_T,)
        p = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
        if HAS_BIAS:
            p += tl.load(b_ptr + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
        for i in tl.static_range(W):
            u = t - (W - 1) + i  # the token tap i reads
            ok = (t_ok & (u >= start))[:, None] & d_ok[None, :]
            xu = tl.load(x_ptr + u.to(tl.int64)[:, None] * D + d[None, :], mask=ok, other=0.0).to(tl.float32)
            p += tl.load(w_ptr + d * W + i, mask=d_ok, other=0.0).to(tl.float32)[None, :] * xu
        if SILU:
            p = p * tl.sigmoid(p)
        out = t.to(tl.int64)[:, None] * D + d[None, :]
        tl.store(y_ptr + out, p.to(y_ptr.dtype.element_ty), mask=t_ok[:, None] & d_ok[None, :])

    @triton.jit
    def _conv_bwd_kernel(
        dy_ptr,  # (N, D) upstream gradient, contiguous
        x_ptr,  # (N, D) forward input
        w_ptr,  # (D, W) taps
        b_ptr,  # (D,) bias (unused without HAS_BIAS)
        start_ptr,  # (N,) int32 sequence starts
        dx_ptr,  # (N, D) output in x's dtype
        dw_ptr,  # (programs along T, D, W) fp32: this program's partial dweight
        db_ptr,  # (programs along T, D) fp32: its partial dbias (unused without HAS_BIAS)
        N,
        D,
        tiles_per_prog,
        W: tl.constexpr,
        WP: tl.constexpr,
        SILU: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        pid_t, pid_d = tl.program_id(0), tl.program_id(1)
        d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
        d_ok = d < D
        bias = tl.zeros([BLOCK_D], dtype=tl.float32)
        if HAS_BIAS:
            bias = tl.load(b_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
        db_acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        taps = tl.arange(0, WP)  # (WP,) W padded to a power of two
        dw_acc = tl.zeros([BLOCK_D, WP], dtype=tl.float32)
        for tile in range(pid_t * tiles_per_prog, (pid_t + 1) * tiles_per_prog):
            s = tile * BLOCK_T + tl.arange(0, BLOCK_T)  # (BLOCK_T,) the tokens whose dx this tile writes
            s_ok = s < N
            start = tl.load(start_ptr + s, mask=s_ok, other=0)
            dx = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
            for j in tl.static_range(W):  # t = s + j: the tokens whose taps read x[s]
                t = s + j
                t_ok = s_ok & (t < N)
                same = t_ok & (tl.load(start_ptr + t, mask=t_ok, other=-1) == start)  # t in s's sequence
                p = bias[None, :] + tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
                for i in tl.static_range(W):
                    u = t - (W - 1) + i
                    ok = (same & (u >= start))[:, None] & d_ok[None, :]
                    xu = tl.load(x_ptr + u.to(tl.int64)[:, None] * D + d[None, :], mask=ok, other=0.0).to(tl.float32)
                    p += tl.load(w_ptr + d * W + i, mask=d_ok, other=0.0).to(tl.float32)[None, :] * xu
                ok_t = same[:, None] & d_ok[None, :]
                dp = tl.load(dy_ptr + t.to(tl.int64)[:, None] * D + d[None, :], mask=ok_t, other=0.0).to(tl.float32)
                if SILU:
                    sg = tl.sigmoid(p)
                    dp = dp * sg * (1.0 + p * (1.0 - sg))
                dx += tl.load(w_ptr + d * W + (W - 1 - j), mask=d_ok, other=0.0).to(tl.float32)[None, :] * dp
                if j == 0:  # the tile's own tokens: their taps' weight gradients
                    db_acc += tl.sum(dp, axis=0)
                    for i in tl.static_range(W):
                        u = s - (W - 1) + i
                        ok = (s_ok & (u >= start))[:, None] & d_ok[None, :]
                        xu = tl.load(x_ptr + u.to(tl.int64)[:, None] * D + d[None, :], mask=ok, other=0.0)
                        dw_i = tl.sum(dp * xu.to(tl.float32), axis=0)  # (BLOCK_D,)
                        dw_acc += tl.where(taps[None, :] == i, dw_i[:, None], 0.0)
            out = s.to(tl.int64)[:, None] * D + d[None, :]
            tl.store(dx_ptr + out, dx.to(dx_ptr.dtype.element_ty), mask=s_ok[:, None] & d_ok[None, :])
        partial = dw_ptr + (pid_t.to(tl.int64) * D + d[:, None]) * W + taps[None, :]
        tl.store(partial, dw_acc, mask=d_ok[:, None] & (taps < W)[None, :])
        if HAS_BIAS:
            tl.store(db_ptr + pid_t.to(tl.int64) * D + d, db_acc, mask=d_ok)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def token_starts(B: int, T: int, cu_seqlens: torch.Tensor | None, device) -> torch.Tensor:
    """(B T,) int32: the flattened index of each token's sequence start (its row's, or its packed sequence's)."""
    spans = sequence_spans("causal_conv1d", B, T, cu_seqlens)
    if cu_seqlens is None:
        return (torch.arange(B * T, device=device, dtype=torch.int32) // T) * T
    lengths = torch.tensor([e - b for b, e in spans], device=device)
    firsts = torch.tensor([b for b, _ in spans], device=device, dtype=torch.int32)
    return torch.repeat_interleave(firsts, lengths, output_size=T)


def causal_conv1d_fwd(x2d, weight, bias, starts, silu: bool) -> torch.Tensor:
    """Launch the forward on (N, D) tokens; y (N, D) in x's dtype. No autograd."""
    N, D = x2d.shape
    y = torch.empty_like(x2d)
    if N == 0:
        return y
    grid = (triton.cdiv(N, BLOCK_T), triton.cdiv(D, BLOCK_D))
    _conv_fwd_kernel[grid](
        x2d,
        weight,
        weight if bias is None else bias,
        starts,
        y,
        N,
        D,
        W=weight.shape[1],
        SILU=silu,
        HAS_BIAS=bias is not None,
        BLOCK_T=BLOCK_T,
        BLOCK_D=BLOCK_D,
        num_warps=_NUM_WARPS,
    )
    return y


def t_programs(N: int, D: int, device: torch.device, num_programs: int | None = None) -> tuple[int, int]:
    """(programs along the tokens, token tiles each) of the backward: about two programs per SM with the channel
    blocks (`_CPU_T_PROGRAMS` off CUDA), whole tiles each."""
    tiles = -(-N // BWD_BLOCK_T)
    if num_programs is None:
        if device.type == "cuda":
            num_programs = max(1, 2 * num_sms(device.index or 0) // -(-D // BLOCK_D))
        else:
            num_programs = _CPU_T_PROGRAMS
    per = -(-tiles // max(1, min(num_programs, tiles)))
    return -(-tiles // per), per


def causal_conv1d_bwd(dy2d, x2d, weight, bias, starts, silu: bool, num_programs: int | None = None):
    """Launch the backward: (dx (N, D) in x's dtype, dweight (D, W) in weight's dtype, dbias (D,) or None)."""
    N, D = x2d.shape
    W = weight.shape[1]
    dx = torch.empty_like(x2d)
    programs, per = t_programs(N, D, x2d.device, num_programs)
    dw_partial = torch.empty((programs, D, W), dtype=torch.float32, device=x2d.device)
    db_partial = torch.empty((programs, D) if bias is not None else (1,), dtype=torch.float32, device=x2d.device)
    if N == 0:
        dw_partial.zero_(), db_partial.zero_()
    else:
        _conv_bwd_kernel[(programs, triton.cdiv(D, BLOCK_D))](
            dy2d,
            x2d,
            weight,
            weight if bias is None else bias,
            starts,
            dx,
            dw_partial,
            db_partial,
            N,
            D,
            per,
            W=W,
            WP=_next_pow2(W),
            SILU=silu,
            HAS_BIAS=bias is not None,
            BLOCK_T=BWD_BLOCK_T,
            BLOCK_D=BLOCK_D,
            num_warps=_NUM_WARPS,
        )
    dweight = dw_partial.sum(dim=0).to(weight.dtype)  # (D, W), summed in fp32
    dbias = db_partial.sum(dim=0).to(bias.dtype) if bias is not None else None
    return dx, dweight, dbias


class CausalConv1dFunction(torch.autograd.Function):
    """Autograd over the Triton launchers on (N, D) tokens with their sequence starts; saves x (p is recomputed)."""

    @staticmethod
    def forward(ctx, x2d, weight, bias, starts, silu):
        ctx.save_for_backward(x2d, weight, bias, starts)
        ctx.silu = silu
        return causal_conv1d_fwd(x2d, weight, bias, starts, silu)

    @staticmethod
    def backward(ctx, dy):
        x2d, weight, bias, starts = ctx.saved_tensors
        dx, dweight, dbias = causal_conv1d_bwd(dy.contiguous(), x2d, weight, bias, starts, ctx.silu)
        return dx, dweight, dbias, None, None


def _check_args(x, weight, bias, activation) -> None:
    if x.dim() != 3 or weight.dim() != 2 or weight.shape[0] != x.shape[-1]:
        raise ValueError(
            f"causal_conv1d: x must be (B, T, D) and weight (D, W) for the same D, got x {tuple(x.shape)} and "
            f"weight {tuple(weight.shape)}"
        )
    if bias is not None and bias.shape != (x.shape[-1],):
        raise ValueError(f"causal_conv1d: bias must be ({x.shape[-1]},) or None, got {tuple(bias.shape)}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"causal_conv1d: activation must be one of {ACTIVATIONS}, got {activation!r}")


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """`causal_conv1d_ref`'s convolution (module docstring) with its activation fused, in Triton for CUDA tensors
    (float32, bfloat16, float16; up to MAX_WIDTH taps), the reference otherwise (`kernels._dispatch`)."""
    _check_args(x, weight, bias, activation)
    if not use_triton(x, weight, bias):
        return causal_conv1d_ref(x, weight, bias, activation, cu_seqlens)
    if x.dtype not in _DTYPES or weight.shape[1] > MAX_WIDTH:
        raise ValueError(
            f"causal_conv1d: the Triton kernels take float32/bfloat16/float16 x and up to {MAX_WIDTH} taps, got "
            f"{x.dtype} and {weight.shape[1]}"
        )
    B, T, D = x.shape
    starts = token_starts(B, T, cu_seqlens, x.device)
    y = CausalConv1dFunction.apply(
        x.reshape(B * T, D).contiguous(), weight.contiguous(), bias, starts, activation == "silu"
    )
    return y.view(B, T, D)
