"""The cost models of the ops that cannot run on meta tensors: ours by the benches' exact byte models
(`traffic_parts`), liger-kernel's from its source, SDPA as flash attention, our FusedAdamW's Triton launcher. MODELS
maps each autograd Function's class name to its model; `_function_classes` finds those classes in `kernels` and
liger-kernel (bench/roofline/recording.py's `modelled_ops` swaps them in)."""

from __future__ import annotations

import dataclasses
import importlib
import math
import pkgutil

import torch

import kernels

# Imported after `kernels` (they set TRITON_INTERPRET for kernels imported later; ours are decorated already).
from bench import (
    bench_adamw,
    bench_causal_conv1d,
    bench_gated_rms_norm,
    bench_moe,
    bench_rms_norm,
    bench_rope,
    bench_swiglu,
)
from bench import bench_fused_linear_cross_entropy as bench_flce
from bench.roofline.tracing import BF16, _like, _rec, apply_model, nbytes
from bench.sm90 import H100_SMS
from kernels import moe
from kernels.fused_linear_cross_entropy import _chunk_rows as flce_chunk_rows


# Byte models. Ours: the benches' exact `traffic_parts` (bench/bench_rms_norm.py, bench_fused_linear_cross_entropy.py,
# bench_adamw.py, bench_rope.py), which tests/bench/test_byte_models.py checks against bench/traffic.py's meter.
# Liger's, below, one function per kernel, checked against the meter by tests/bench/test_roofline.py.
def _record_parts(
    prefix: str, category: str, parts: dict[str, tuple[int, int]], skip=(), launches=None, flops=None
) -> None:
    """One recorded op per launch name of a bench's `traffic_parts` (bytes read + written); `launches` and `flops`
    per name where they are not 1 and 0."""
    for name, (read, write) in parts.items():
        if name in skip:
            continue
        _rec(
            f"{prefix}:{name}",
            category(name) if callable(category) else category,
            read + write,
            (flops or {}).get(name, 0.0),
            (launches or {}).get(name, 1),
        )


def liger_cross_entropy_bytes(rows: int, vocab: int, s: int, loss_size: int = 4) -> int:
    """liger's cross-entropy kernel (inside its fused loss, no z-loss): two passes over each row's logits and the
    gradient written in place (like ours), per row the target (int64) and its logit read, the target's logit
    written again and the loss."""
    return 3 * rows * vocab * s + rows * (8 + s) + rows * (s + loss_size)


def liger_rope_bytes(q_elems: int, k_elems: int, s: int, rows: int, half_dim: int, cos_size: int) -> int:
    """liger's RoPE kernel (in place): q and k read and written once; half a row of cos and of sin (the two halves
    hold the same angles) read per (batch, position) row, issued (the rows of a shared cos stay in cache on a GPU,
    but liger's program per row asks again)."""
    return 2 * (q_elems + k_elems) * s + 2 * rows * half_dim * cos_size


LIGER_MOE_BLOCK_M = 64  # liger_kernel.ops.fused_moe.BLOCK_M_TOKEN: the row kernels' M tile (not autotuned)


def liger_fused_moe_parts(
    mode: str,
    counts: list[int],
    tokens: int,
    k: int,
    hidden: int,
    inter: int,
    s: int,
    w: int,
    ws: int,
    block_m: int = LIGER_MOE_BLOCK_M,
) -> dict[str, tuple[int, int]]:
    """liger-kernel 0.8's LigerFusedMoEFunction (liger_kernel/ops/fused_moe.py), issued (read, write) bytes per kernel
    and torch op for expert row counts `counts` (sum N = T k), activations of element size s, the expert tensors' w,
    the top-k weights' ws, int32 indices, M tiles of `block_m` rows (each row kernel reads its expert's weight once per
    tile and three int32 of the tile table); every column block spanning its whole width (liger autotunes BLOCK_N up to
    256 over H = 2048-2880 and I = 768-2880: the roofline's ideal tiling, as ours gets), so each gathered row is read
    once per kernel. Forward: routing (histogram with per-assignment atomics, prefix sums, scatter: O(N) int32), the
    gather + gate_up GEMM + SwiGLU writing pre- and post-activation (N, 2I) and (N, I), the down GEMM writing (N, H)
    rows, their weighted gather-sum to (T, H). Backward (no saved (N, H)): dout W_down^T recomputed with SwiGLU's
    backward (d pre-activation, the weighted activation, dtop_k_weights by atomics), dW_down, d pre-activation
    W_gate_up^T as (N, H) rows and their gather-sum, dW_gate_up; the gradients' zero fills are torch ops."""
    n, experts = tokens * k, len(counts)
    tiles = sum(-(-c // block_m) for c in counts)
    n_tiles = -(-tokens // max(1, 1024 // (1 << (k - 1).bit_length())))  # the routing's token tiles
    table = 3 * 4 * tiles  # expert start, tile expert, tile row start per row-kernel program
    gu_w, down_w = 2 * inter * hidden * w, hidden * inter * w
    used = sum(c > 0 for c in counts)  # the weight-gradient kernels write the experts with rows (the rest stay zero)
    out: dict[str, tuple[int, int]] = {}
    if mode == "forward":
        out["_moe_router_histogram_kernel"] = (2 * 4 * n, 4 * n + 4 * experts * n_tiles)
        out["_moe_router_prefix_sum_kernel"] = (4 * experts * (n_tiles + 1), 4 * experts * n_tiles + 8 * (experts + 1))
        out["aten.sum"] = (4 * experts * n_tiles, 4 * experts)
        out["_moe_router_scatter_kernel"] = (3 * 4 * n + 4 * tiles, 3 * 4 * n + 2 * 4 * tiles)
        out["_fused_up_proj_swiglu_kernel"] = (table + n * (4 + hidden * s) + tiles * gu_w, 3 * n * inter * s)
        out["_fused_down_proj_kernel"] = (table + n * inter * s + tiles * down_w, n * hidden * s)
        out["_token_gather_weighted_sum_kernel"] = (n * (hidden * s + 4 + ws), tokens * hidden * s)
    else:
        out["aten.zeros"] = (0, n * s + tokens * hidden * s)  # dtop_k_weights' atomics and dx start at zero
        out["_moe_bwd_down_proj_kernel"] = (
            table + n * (hidden * s + 4 + 4 + ws + 2 * inter * s + s) + tiles * down_w,
            n * (2 * inter * s + inter * s + s),
        )
        out["aten.zeros_like"] = (0, gu_w * experts + down_w * experts)  # dW_down, dW_gate_up start at zero
        out["_moe_bwd_dW2_kernel"] = (2 * 4 * experts + n * (inter * s + hidden * s + 4), used * down_w)
        out["_moe_bwd_dX_expanded_kernel"] = (table + n * 2 * inter * s + tiles * gu_w, n * hidden * s)
        out["_token_gather_weighted_sum_kernel"] = (n * (hidden * s + 4), tokens * hidden * s)
        out["_moe_bwd_dW1_kernel"] = (2 * 4 * experts + n * (hidden * s + 2 * inter * s + 4), used * gu_w)
    return out


class RMSNormModel:
    """Ours (RMSNormFunction(x2d, weight, eps, offset, max_block)) by bench/bench_rms_norm.py's `traffic_parts` (the
    weight once per launch: it stays in L2; the dweight partials of about two programs per H100 SM, summed by torch).
    liger's (LigerRMSNormFunction(X, W, ...)) by the same: its kernels make the same passes over x, dy and dx (one
    program per SM for dweight), and cannot be metered here (they call libdevice, which the interpreter lacks)."""

    category = "norms"

    def __init__(self, name):
        self.name = name

    def _contiguous(self, t):
        """liger's Function makes its tensor arguments contiguous (`ensure_contiguous`: a copy of a strided view, such
        as Gemma 3's q_norm input, (B, T, H, D) projections viewed as (B, H, T, D)); ours takes 2-D rows made by its
        caller's reshape, an aten op recorded as such."""
        if not self.name.startswith("Liger") or t.is_contiguous():
            return t
        _rec(f"{self.name}:contiguous", "norms", nbytes(t) + t.numel() * t.element_size())
        return _like(t)

    def forward(self, ctx, x, weight, *rest):
        ctx.n_rest = len(rest)  # eps, offset, ...: no gradient
        x = self._contiguous(x)
        m, n = x.numel() // x.shape[-1], x.shape[-1]
        _record_parts(
            self.name,
            "norms",
            bench_rms_norm.traffic_parts("forward", m, n, x.element_size(), weight.element_size(), weight_once=True),
        )
        rstd = torch.empty(m, dtype=torch.float32, device=x.device)
        ctx.save_for_backward(x, weight, rstd)
        return _like(x)

    def backward(self, ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        dy = self._contiguous(dy)
        m, n = x.numel() // x.shape[-1], x.shape[-1]
        _record_parts(
            self.name + ".backward",
            "norms",
            bench_rms_norm.traffic_parts(
                "backward", m, n, x.element_size(), weight.element_size(), num_programs=2 * H100_SMS, weight_once=True
            ),
        )
        return _like(x), _like(weight), *([None] * (ctx.n_rest))


class SwiGLUModel:
    """silu(gate) * up (ours: SwiGLUFunction(gate, up); liger: LigerSiLUMulFunction(a, b)): forward reads gate and
    up and writes the product; backward reads dout, gate, up and writes dgate, dup (liger in place: same bytes)."""

    category = "mlp_activation"

    def __init__(self, name):
        self.name = name

    def forward(self, ctx, gate, up, *rest):
        ctx.n_rest = len(rest)
        _rec(self.name, "mlp_activation", nbytes(gate) + nbytes(up) + nbytes(gate))
        ctx.save_for_backward(gate, up)
        return _like(gate)

    def backward(self, ctx, dout):
        gate, up = ctx.saved_tensors
        _rec(self.name + ".backward", "mlp_activation", nbytes(dout) + 2 * nbytes(gate) + 2 * nbytes(up))
        return _like(gate), _like(up), *([None] * ctx.n_rest)


class SwiGLULinearModel:
    """kernels' SwiGLULinearFunction(gate, up, weight): F.linear(silu(gate) * up, weight) keeping gate, up and weight,
    not act. Forward: the SwiGLU forward kernel, then the (M, I) @ (I, H) matmul (act dies). Backward: dact = dout @
    weight, the SwiGLU backward kernel that also writes act (over dact; bench/bench_swiglu.py's `traffic_parts` with
    store_act), then dweight = dout^T @ act. Kernels as mlp_activation, matmuls as matmuls (as aten's mm records)."""

    category = "mlp_activation"
    name = "SwiGLULinearFunction"

    def forward(self, ctx, gate, up, weight, *rest):  # rest: the activation (GeGLU's the same kernels and bytes)
        ctx.n_rest = len(rest)
        n, s = gate.numel(), gate.element_size()
        i, h = gate.shape[-1], weight.shape[0]
        m = n // i
        _record_parts(self.name, "mlp_activation", bench_swiglu.traffic_parts("forward", n, s))
        act = _like(gate)  # (..., I), dies with the forward
        _mm(f"{self.name}:mm", "matmuls", m, i, h, s, weight.element_size(), s)
        del act
        ctx.save_for_backward(gate, up, weight)
        return _like(gate, shape=(*gate.shape[:-1], h))

    def backward(self, ctx, dout):
        gate, up, weight = ctx.saved_tensors
        n, s, w = gate.numel(), gate.element_size(), weight.element_size()
        i, h = gate.shape[-1], weight.shape[0]
        m = n // i
        dact = _like(gate)  # (..., I); act is written over it
        _mm(f"{self.name}.backward:mm", "matmuls", m, h, i, s, w, s)  # dact = dout @ weight
        dgate, dup = _like(gate), _like(up)
        parts = bench_swiglu.traffic_parts("backward", n, s, store_act=True)
        _record_parts(self.name + ".backward", "mlp_activation", parts)
        dweight = _like(weight)
        _mm(f"{self.name}.backward:mm", "matmuls", h, m, i, s, s, w)  # dweight = dout^T @ act
        del dact
        return dgate, dup, dweight, *([None] * ctx.n_rest)


class RoPEModel:
    """Rotary embedding of q (B, Hq, T, D) and k (B, Hkv, T, D) (transformers' layout, which both take): ours
    (RoPEFunction(q, k, cos, sin)) by bench/bench_rope.py's model (q and k read and written once, cos and sin read
    once per row of theirs), liger's (LigerRopeFunction(q, k, cos, sin, ...), in place) by `liger_rope_bytes`;
    backward the same on dq and dk. One launch each way."""

    category = "rope"

    def __init__(self, name):
        self.name = name

    def _bytes(self, q, k, cos):
        b, hq, t, d = q.shape
        if self.name.startswith("Liger"):
            return liger_rope_bytes(q.numel(), k.numel(), q.element_size(), b * t, d // 2, cos.element_size())
        return bench_rope._bytes("forward", b, t, hq, k.shape[1], d, cos.shape[0], q.element_size(), cos.element_size())

    def forward(self, ctx, q, k, cos, sin, *rest):
        ctx.n_rest = len(rest) + 2  # cos, sin, and liger's position_ids, unsqueeze_dim: no gradient
        if self.name.startswith("Liger") and not q.transpose(1, 2).is_contiguous():
            # liger's rope_forward runs on (B, T, H, D) rows: q and k made contiguous there, a copy where they are not
            # transposes of such rows (HF's Llama passes those; Gemma 3's q_norm and k_norm, liger's, return (B, H, T,
            # D) rows). Its backward's dq and dk come from attention's backward in that layout: no copy counted.
            _rec(f"{self.name}:contiguous", "rope", 2 * (nbytes(q) + nbytes(k)))
        _rec(self.name, "rope", self._bytes(q, k, cos))
        ctx.save_for_backward(cos, sin)
        return _like(q), _like(k)

    def backward(self, ctx, dq, dk):
        cos, _ = ctx.saved_tensors
        _rec(self.name + ".backward", "rope", self._bytes(dq, dk, cos))
        return _like(dq), _like(dk), *([None] * ctx.n_rest)


class FusedAddRMSNormModel:
    """Ours, FusedAddRMSNormFunction(x, residual, weight, eps, offset, max_block) -> (normed, h = x + residual), by
    bench/bench_rms_norm.py's `traffic_parts` with the residual (the weight once per launch; the dweight partials of
    about two programs per H100 SM, summed by torch): forward reads x and residual, writes h and normed (in
    promote(x, residual)'s dtype) and rstd; backward reads d_normed, d_h_out (when h's later use gave it one) and h,
    writes d_h once per input dtype (under autocast: fp32 for the residual stream, bf16 for the added update)."""

    name = "FusedAddRMSNormFunction"
    category = "norms"

    def forward(self, ctx, x, residual, weight, *rest):
        ctx.n_rest = len(rest)  # eps, offset, max_block: no gradient
        m, n = x.numel() // x.shape[-1], x.shape[-1]
        _record_parts(
            self.name,
            "norms",
            bench_rms_norm.traffic_parts(
                "forward",
                m,
                n,
                x.element_size(),
                weight.element_size(),
                weight_once=True,
                residual_size=residual.element_size(),
            ),
        )
        total = _like(x, dtype=torch.promote_types(x.dtype, residual.dtype))
        rstd = torch.empty(m, dtype=torch.float32, device=x.device)
        ctx.save_for_backward(total, weight, rstd)
        ctx.dtypes = (x.dtype, residual.dtype)
        return _like(total), total

    def backward(self, ctx, dnormed, dsum):
        total, weight, rstd = ctx.saved_tensors
        x_dtype, res_dtype = ctx.dtypes
        m, n = total.numel() // total.shape[-1], total.shape[-1]
        _record_parts(
            self.name + ".backward",
            "norms",
            bench_rms_norm.traffic_parts(
                "backward",
                m,
                n,
                x_dtype.itemsize,
                weight.element_size(),
                num_programs=2 * H100_SMS,
                weight_once=True,
                residual_size=res_dtype.itemsize,
                grad_h=dsum is not None,
            ),
        )
        dres = _like(total, dtype=res_dtype)
        dx = dres if x_dtype == res_dtype else _like(total, dtype=x_dtype)
        return dx, dres, _like(weight), *([None] * ctx.n_rest)


class GatedRMSNormModel:
    """Ours, GatedRMSNormFunction(x2d, gate2d, weight, eps) (Gated DeltaNet's output norm), by
    bench/bench_gated_rms_norm.py's `traffic_parts` (the dweight partials of about two programs per H100 SM, summed by
    torch): forward reads x and the gate, writes y and rstd; backward reads dy, x and the gate, writes dx and dgate."""

    name = "GatedRMSNormFunction"
    category = "norms"

    def forward(self, ctx, x, gate, weight, *rest):
        ctx.n_rest = len(rest)  # eps
        m, n = x.shape
        parts = bench_gated_rms_norm.traffic_parts("forward", m, n, x.element_size(), weight.element_size())
        _record_parts(self.name, "norms", parts)
        ctx.save_for_backward(x, gate, weight, torch.empty(m, dtype=torch.float32, device=x.device))
        return _like(x)

    def backward(self, ctx, dy):
        x, gate, weight, _ = ctx.saved_tensors
        m, n = x.shape
        parts = bench_gated_rms_norm.traffic_parts(
            "backward", m, n, x.element_size(), weight.element_size(), num_programs=2 * H100_SMS
        )
        _record_parts(self.name + ".backward", "norms", parts)
        return _like(x), _like(gate), _like(weight), *([None] * ctx.n_rest)


class MoEExpertsModel:
    """Ours, MoEExpertsFunction(x, weights, gate_up, down, gate_up_bias, down_bias, route, options) (a
    Mixture-of-Experts layer's grouped GEMMs, kernels/moe.py), by bench/bench_moe.py's `traffic_parts` with the rows
    spread evenly over the experts (the step carries no data: T k / E rows each) at an ideal tiling, one program per
    expert spanning every column: each operand read once and each output written once, the accounting every aten
    matmul of the other stacks gets (the GPU tiles re-read x per column block and the weights per row tile, which L2
    serves in part: the kernel bench measures how much), and the GEMMs' FLOPs:
    2 N H 2I + 2 N I H forward (N = T k assignment rows), dx and dW of both backward (twice that); "matmuls". The
    routing's torch ops (sort, searchsorted, cumsum over N integers) are recorded as they run. Memory: the buffers
    kernels/moe.py's launchers allocate, in their order and dtypes (`_forward_buffers`, `_backward_buffers`): forward h
    (N, I) and (N, H) rows, freed, and the saved pre-activation gate_up (N, 2I) (with LoRA also x A^T and h A^T,
    (N, r)); backward d gate_up (N, 2I), the fp32 dtop_k_weights partials (I / 64 blocks, N) and the (N, H) dx rows."""

    name = "MoEExpertsFunction"
    category = "matmuls"

    @staticmethod
    def _sizes(x, weights, gate_up, options):
        tokens, hidden = x.shape
        k, experts, inter = weights.shape[1], gate_up.shape[0], options["layout"].inter
        n = tokens * k
        counts = [n // experts + (e < n % experts) for e in range(experts)]
        return tokens, hidden, k, inter, counts

    def _parts(self, mode, x, weights, gate_up, gate_up_bias, options, lora_rank=(0, 0), lora_size=None):
        tokens, hidden, k, inter, counts = self._sizes(x, weights, gate_up, options)
        wide = max(hidden, 2 * inter)  # every weight-gradient pass one block wide
        parts = bench_moe.traffic_parts(
            mode,
            counts,
            tokens,
            k,
            hidden,
            inter,
            x.element_size(),
            gate_up.element_size(),
            bias=gate_up_bias is not None,
            router_size=weights.element_size(),
            tiles=dataclasses.replace(
                moe.GPU_TILES, block_m=max(counts), block_n1=inter, block_n2=hidden, block_p=wide, block_q=wide
            ),
            lora_rank=lora_rank,
            lora_size=lora_size,
        )
        gemm = 2 * tokens * k * hidden * 3 * inter  # gate, up and down over every assignment row
        return parts, gemm

    @staticmethod
    def _forward_buffers(x, weights, options, ranks=(0, 0)) -> tuple[torch.Tensor, ...]:
        """moe_experts_fwd's allocations: the saved ones (gate_up's pre-activation, and x A^T, h A^T with LoRA); h and
        the (N, H) rows live while it runs, then freed; and the output."""
        n, inter, hidden = weights.numel(), options["layout"].inter, x.shape[1]
        h = _like(x, shape=(n, inter))
        saved = tuple(_like(x, shape=(n, width)) for width in (2 * inter, *(r for r in ranks if r)))
        rows = _like(x, shape=(n, hidden))
        out = _like(x)
        del h, rows
        return out, saved

    @staticmethod
    def _backward_buffers(x, weights, options, ranks=(0, 0)) -> None:
        """moe_experts_bwd's transient allocations: d gate_up (N, 2I) (and d y B2 with LoRA on down), the fp32
        dtop_k_weights partials, the (N, H) dx rows (and d gate_up B1 with LoRA on gate_up); the gradients it returns
        are the caller's."""
        n, inter, hidden = weights.numel(), options["layout"].inter, x.shape[1]
        blocks = -(-inter // moe.GPU_TILES.block_n1)
        r1, r2 = ranks
        live = [_like(x, shape=(n, 2 * inter)), *([_like(x, shape=(n, r2))] if r2 else [])]
        live.append(_like(x, dtype=torch.float32, shape=(blocks, n)))
        live += [_like(x, shape=(n, hidden)), *([_like(x, shape=(n, r1))] if r1 else [])]
        del live

    def forward(self, ctx, x, weights, gate_up, down, gate_up_bias, down_bias, route, options):
        parts, gemm = self._parts("forward", x, weights, gate_up, gate_up_bias, options)
        flops = {"_moe_gemm1_kernel": gemm * 2 / 3, "_moe_gemm2_kernel": gemm / 3}
        _record_parts(self.name, self.category, parts, flops=flops)
        out, saved = self._forward_buffers(x, weights, options)
        ctx.options = options
        ctx.save_for_backward(x, weights, gate_up, down, gate_up_bias, down_bias, *saved)
        return out

    def backward(self, ctx, dout):
        x, weights, gate_up, down, gate_up_bias, down_bias, _ = ctx.saved_tensors
        parts, gemm = self._parts("backward", x, weights, gate_up, gate_up_bias, ctx.options)
        self._backward_buffers(x, weights, ctx.options)
        # dgrad dout W_down^T (N H I), the dx pass d gate_up W_gate_up^T (2 N H I), the two weight passes (3 N H I)
        flops = {"_moe_dgrad_kernel": gemm / 3, "_moe_gemm2_kernel": 2 * gemm / 3, "_moe_wgrad_kernel": gemm}
        launches = {"_moe_wgrad_kernel": 2}
        _record_parts(self.name + ".backward", self.category, parts, launches=launches, flops=flops)
        grads = (_like(x), _like(weights), _like(gate_up), _like(down))
        biases = tuple(None if b is None else _like(b) for b in (gate_up_bias, down_bias))
        return (*grads, *biases, None, None)


class MoEExpertsLoRAModel(MoEExpertsModel):
    """Ours with peft's LoRA on the experts, MoEExpertsLoRAFunction(x, weights, gate_up, down, gate_up_bias, down_bias,
    lora_A1, lora_B1, lora_A2, lora_B2, route, options, scalings): `traffic_parts` with the adapter's rank GEMMs (on
    gate_up, down or both; the experts' weights frozen: no weight-gradient pass of their own, the factors' instead)
    at the same ideal tiling, and their FLOPs."""

    name = "MoEExpertsLoRAFunction"

    def _lora_parts(self, mode, x, weights, gate_up, gate_up_bias, a1, a2, options):
        r1, r2 = self._ranks(gate_up, a1, a2)
        lora_size = next(a for a in (a1, a2) if a is not None).element_size()
        parts, gemm = self._parts(mode, x, weights, gate_up, gate_up_bias, options, (r1, r2), lora_size)
        tokens, hidden, k, inter, _ = self._sizes(x, weights, gate_up, options)
        n = 2 * tokens * k  # x 2 FLOPs a product: each rank GEMM is n x its rank x its other dimension
        if mode == "forward":
            flops = {
                "_moe_gemm1_kernel": gemm * 2 / 3 + n * r1 * (hidden + 2 * inter),
                "_moe_gemm2_kernel": gemm / 3 + n * r2 * (inter + hidden),
            }
        else:
            flops = {
                "_moe_dgrad_kernel": gemm / 3 + n * r2 * (hidden + inter),
                "_moe_gemm2_kernel": 2 * gemm / 3 + n * r1 * (2 * inter + hidden),
                "_moe_wgrad_kernel": n * (r1 * (hidden + 2 * inter) + r2 * (inter + hidden)),
            }
        return parts, flops, 2 * ((r1 > 0) + (r2 > 0))

    @staticmethod
    def _ranks(gate_up, a1, a2) -> tuple[int, int]:
        return tuple(0 if a is None else a.shape[0] // gate_up.shape[0] for a in (a1, a2))

    def forward(self, ctx, x, weights, gate_up, down, gate_up_bias, down_bias, a1, b1, a2, b2, route, options, scal):
        parts, flops, _ = self._lora_parts("forward", x, weights, gate_up, gate_up_bias, a1, a2, options)
        _record_parts(self.name, self.category, parts, flops=flops)
        ctx.ranks = self._ranks(gate_up, a1, a2)
        out, saved = self._forward_buffers(x, weights, options, ctx.ranks)
        ctx.options = options
        ctx.save_for_backward(x, weights, gate_up, gate_up_bias, a1, b1, a2, b2, *saved)
        return out

    def backward(self, ctx, dout):
        x, weights, gate_up, gate_up_bias, a1, b1, a2, b2, *_ = ctx.saved_tensors
        parts, flops, passes = self._lora_parts("backward", x, weights, gate_up, gate_up_bias, a1, a2, ctx.options)
        self._backward_buffers(x, weights, ctx.options, ctx.ranks)
        launches = {"_moe_wgrad_kernel": passes}
        _record_parts(self.name + ".backward", self.category, parts, launches=launches, flops=flops)
        factors = tuple(None if t is None else _like(t) for t in (a1, b1, a2, b2))
        return (_like(x), _like(weights), None, None, None, None, *factors, None, None, None)


class LigerFusedMoEModel:
    """liger's LigerFusedMoEFunction(x, gate_up_proj, down_proj, top_k_index, top_k_weights) (what liger-kernel 0.8's
    LigerExperts runs: its apply_liger_kernel_to_qwen3_moe, _mixtral, _qwen3_next and _qwen3_5_moe swap transformers
    5's experts for it; not gpt_oss's) by `liger_fused_moe_parts`, the rows spread evenly over the experts at the ideal
    tiling ours gets (MoEExpertsModel: one M tile per expert), and the GEMMs' FLOPs (6 N H I forward, 12 N H I
    backward); "matmuls". Memory: its allocations in its order: the routing's int32 tables (the three (N,) index
    arrays and the tile table saved), the pre-activation (N, 2I) (saved), the post-activation (N, I) and the (N, H) rows
    (freed); backward d pre-activation (N, 2I), the weighted activation (N, I), the (N, H) dx rows and the zero-filled
    dtop_k_weights, dx and weight gradients (in the weights' dtype: fp32 under autocast over fp32 parameters, since
    the Function is not autocast's)."""

    name = "LigerFusedMoEFunction"
    category = "matmuls"

    @staticmethod
    def _sizes(x, gate_up, top_k_index):
        (tokens, hidden), k, experts = x.shape, top_k_index.shape[1], gate_up.shape[0]
        n = tokens * k
        counts = [n // experts + (e < n % experts) for e in range(experts)]
        return tokens, hidden, k, gate_up.shape[1] // 2, counts

    def _parts(self, mode, x, gate_up, top_k_index, top_k_weights):
        tokens, hidden, k, inter, counts = self._sizes(x, gate_up, top_k_index)
        sizes = (x.element_size(), gate_up.element_size(), top_k_weights.element_size())
        parts = liger_fused_moe_parts(mode, counts, tokens, k, hidden, inter, *sizes, block_m=max(counts))
        return parts, 2 * tokens * k * hidden * inter  # one N H I GEMM's FLOPs

    def forward(self, ctx, x, gate_up, down, top_k_index, top_k_weights):
        parts, gemm = self._parts("forward", x, gate_up, top_k_index, top_k_weights)
        flops = {"_fused_up_proj_swiglu_kernel": 2 * gemm, "_fused_down_proj_kernel": gemm}
        _record_parts(self.name, self.category, parts, flops=flops)
        tokens, hidden, k, inter, counts = self._sizes(x, gate_up, top_k_index)
        n, experts, tiles = tokens * k, len(counts), len(counts)

        def i32(*shape):
            return torch.empty(shape, dtype=torch.int32, device=x.device)

        tile_counts, expert_start, tile_offset = i32(experts, 1), i32(experts + 1), i32(experts + 1)
        index = (i32(n), i32(n), i32(n), i32(tiles), i32(tiles))  # gather, scatter, reverse; tile row start, expert
        pre, post, rows = _like(x, shape=(n, 2 * inter)), _like(x, shape=(n, inter)), _like(x, shape=(n, hidden))
        out = _like(x)
        del tile_counts, tile_offset, post, rows
        ctx.save_for_backward(x, gate_up, down, pre, top_k_weights, expert_start, *index)
        return out

    def backward(self, ctx, dout):
        x, gate_up, down, pre, top_k_weights, _, gather, *_ = ctx.saved_tensors
        parts, gemm = self._parts("backward", x, gate_up, gather.view(x.shape[0], -1), top_k_weights)
        flops = {
            "_moe_bwd_down_proj_kernel": gemm,
            "_moe_bwd_dW2_kernel": gemm,
            "_moe_bwd_dX_expanded_kernel": 2 * gemm,
            "_moe_bwd_dW1_kernel": 2 * gemm,
        }
        _record_parts(self.name + ".backward", self.category, parts, flops=flops)
        n, inter = pre.shape[0], pre.shape[1] // 2
        # every buffer lives until the backward returns (liger's locals)
        d_pre, weighted = _like(dout, shape=(n, 2 * inter)), _like(dout, shape=(n, inter))
        d_weights, d_down = _like(dout, shape=(n,)), _like(down)
        rows, dx, d_gate_up = _like(dout, shape=(n, x.shape[1])), _like(dout, shape=x.shape), _like(gate_up)
        del d_pre, weighted, rows
        return dx, d_gate_up, d_down, None, d_weights.view(top_k_weights.shape)  # autograd casts to their dtype


class CausalConv1dModel:
    """Ours, CausalConv1dFunction(x2d, weight, bias, starts, silu) (Gated DeltaNet's short convolution and its SiLU),
    by bench/bench_causal_conv1d.py's `traffic_parts` (issued bytes: the shifted reads of x counted each time, as the
    meter counts them; one sequence per row of `starts`' length, the rows of the modelled step), "other elementwise"."""

    name = "CausalConv1dFunction"
    category = "other_elementwise"

    def forward(self, ctx, x, weight, bias, starts, silu):
        n_tokens, d = x.shape
        lengths = [n_tokens]  # the roofline's rows: equal lengths, the count does not change the bytes but by O(W)
        parts = bench_causal_conv1d.traffic_parts(
            "forward", lengths, d, x.element_size(), weight.element_size(), weight.shape[1], bias=bias is not None
        )
        _record_parts(self.name, self.category, parts)
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _like(x)

    def backward(self, ctx, dy):
        x, weight = ctx.saved_tensors
        n_tokens, d = x.shape
        parts = bench_causal_conv1d.traffic_parts(
            "backward", [n_tokens], d, x.element_size(), weight.element_size(), weight.shape[1], bias=ctx.has_bias
        )
        _record_parts(self.name + ".backward", self.category, parts)
        dbias = _like(weight[:, 0]) if ctx.has_bias else None
        return _like(x), _like(weight), dbias, None, None


FLA_CHUNK = 64  # flash-linear-attention's chunk size for the gated delta rule


def fla_gated_delta_rule_parts(n: int, h: int, hv: int, k: int, v: int, s: int, l2norm: bool, c: int = FLA_CHUNK):
    """flash-linear-attention's `chunk_gated_delta_rule` (fla-org/flash-linear-attention at bc3b101d, the kernels of
    fla/ops/gated_delta_rule/chunk.py) on n tokens, h key heads and hv value heads of widths k and v, activations of
    s bytes: ({pass: bytes read + written} forward, the same backward, {pass: FLOPs} forward, backward), read
    from the source kernel by kernel. Bytes are issued: a kernel's program per (chunk, value head) reads its key head's
    q and k, so those count hv / h times (L2 serves part of it on a GPU); the cumulative decay g is fp32, beta, the
    (n, hv, c) solved chunk matrix A, the (chunks, hv, k, v) per-chunk states h and their gradients dh in the
    activations' dtype, as fla allocates them. FLOPs count each chunk's matmuls (c = 64: k k^T, the triangular solve
    (2/3 c^3), w and u, the state pass, the output), as the kernels compute them."""
    nt, qk, vv, gb = n // c, n * hv * k * s, n * hv * v * s, n * hv * (4 + s)  # g fp32, beta
    states, a = nt * hv * k * v * s, n * hv * c * s
    g4 = n * hv * 4
    norm = {"l2norm_q": 2 * n * h * k * s + n * h * 4, "l2norm_k": 2 * n * h * k * s + n * h * 4} if l2norm else {}
    fwd = {
        **norm,
        "chunk_local_cumsum": 2 * g4,
        "kkt_solve": a + qk + gb + a,  # A zeroed, then k, g, beta read and A written
        "recompute_w_u": qk + vv + gb + a + qk + vv,  # k, v, beta, A, g read; w, u written
        "fwd_h": 2 * qk + vv + g4 + states + vv,  # k, w, u, g read; h, v_new written
        "fwd_o": 2 * qk + vv + states + g4 + vv,  # q, k, v_new, h, g read; o written
    }
    norm_bwd = {"l2norm_bwd_q": 3 * n * h * k * s + n * h * 4, "l2norm_bwd_k": 3 * n * h * k * s + n * h * 4}
    bwd = {
        "recompute_w_u": fwd["recompute_w_u"],
        "fwd_h": fwd["fwd_h"],
        "bwd_dv_local": 2 * qk + g4 + 2 * vv,  # q, k, g, do read; dv written
        "bwd_dhu": 3 * qk + g4 + 2 * vv + states + vv,  # q, k, w, g, do, dv read; dh, dv2 written
        # q, k, w, v_new, do, dv, h, dh, g read; dq, dk, dw, dg written
        "bwd_dqkwg": 3 * qk + 3 * vv + 2 * states + g4 + 3 * qk + g4,
        "wy_repr_bwd": 2 * qk + 2 * vv + gb + a + qk + vv + qk + vv + gb,  # k, v, beta, g, A, dw, du; dk2, dv, db, dg2
        "dk_dg_adds": 3 * qk + 3 * g4,
        "reverse_cumsum_dg": 2 * g4,
        **({"group_sums": 2 * qk + 2 * n * h * k * s} if hv != h else {}),  # dq, dk over each key head's value heads
        **(norm_bwd if l2norm else {}),
    }
    per = n * hv
    fwd_flops = {
        "kkt_solve": per * (2 * c * k + 2 * c * c / 3),
        "recompute_w_u": per * (2 * c * k + 2 * c * v),
        "fwd_h": per * 4 * k * v,
        "fwd_o": per * (2 * k * v + 2 * c * k + 2 * c * v),
    }
    bwd_flops = {
        "recompute_w_u": fwd_flops["recompute_w_u"],
        "fwd_h": fwd_flops["fwd_h"],
        "bwd_dv_local": per * (2 * c * k + 2 * c * v),
        "bwd_dhu": per * 6 * k * v,
        "bwd_dqkwg": per * (6 * k * v + 4 * c * k + 2 * c * v),
        "wy_repr_bwd": per * (8 * c * k + 4 * c * v + 4 * c * c),
    }
    return fwd, bwd, fwd_flops, bwd_flops


class FlaGatedDeltaRuleModel:
    """flash-linear-attention's chunk_gated_delta_rule(q, k, v, g, beta, ...) by `fla_gated_delta_rule_parts`: what
    the recurrence costs where fla-core is installed (ours calls it: kernels.chunk_gated_delta_rule; transformers
    finds it through its kernel hub), "attention" (the layer's token mixer, as flash attention is)."""

    name = "fla.chunk_gated_delta_rule"
    category = "attention"

    def __init__(self, l2norm: bool):
        self.l2norm = l2norm

    def _parts(self, q, v):
        b, t, h, k = q.shape
        return fla_gated_delta_rule_parts(b * t, h, v.shape[2], k, v.shape[3], v.element_size(), self.l2norm)

    def forward(self, ctx, q, k, v, g, beta):
        fwd, _, flops, _ = self._parts(q, v)
        for part, bytes_ in fwd.items():
            _rec(f"{self.name}:{part}", self.category, bytes_, flops.get(part, 0.0))
        b, t, _, _ = q.shape
        solved = torch.empty(b, t, v.shape[2], FLA_CHUNK, dtype=k.dtype, device=k.device)  # A, (B, T, Hv, 64)
        ctx.save_for_backward(q, k, v, g, beta, solved)  # what fla keeps for its backward
        return _like(v)

    def backward(self, ctx, do):
        q, k, v, g, beta, _ = ctx.saved_tensors
        _, bwd, _, flops = self._parts(q, v)
        for part, bytes_ in bwd.items():
            _rec(f"{self.name}.backward:{part}", self.category, bytes_, flops.get(part, 0.0))
        return _like(q), _like(k), _like(v), _like(g), _like(beta)


def fla_chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, **kw):
    """fla's op as the roofline models it (`FlaGatedDeltaRuleModel`), with its signature: (o, final state or None)."""
    o = apply_model(FlaGatedDeltaRuleModel(bool(kw.get("use_qk_l2norm_in_kernel"))), q, k, v, g, beta)
    state = torch.empty(q.shape[0], v.shape[2], q.shape[3], v.shape[3], device=q.device) if output_final_state else None
    return o, state


class FlashAttentionModel:
    """F.scaled_dot_product_attention(q, k, v, ...) as flash attention: (B, H, T, D) q, (B, Hkv, T, D) k and v.
    Causal: half the T x T scores; with a sliding `window` W < T (transformers' `sliding_window`: each query attends
    the W keys up to itself, flash attention's local window), W^2 / 2 for the first W queries and W for each later one.
    The bytes are the same either way."""

    name = "flash_attention"
    category = "attention"

    def __init__(self, causal: bool, window: int | None = None):
        self.causal = causal
        self.window = window

    def flops(self, q):
        b, h, t, d = q.shape
        if not self.causal:
            return 4 * b * h * t * t * d
        if self.window is not None and self.window < t:
            w = self.window
            return 4 * b * h * d * (w * w / 2 + (t - w) * w)
        return 4 * b * h * t * t * d / 2

    def forward(self, ctx, q, k, v):
        b, h, t, _ = q.shape
        o = _like(q)
        lse = torch.empty((b, h, t), dtype=torch.float32, device=q.device)
        _rec(self.name, "attention", nbytes(q) + nbytes(k) + nbytes(v) + nbytes(o) + nbytes(lse), self.flops(q))
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.n_rest = 0
        return o

    def backward(self, ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        _rec(
            self.name + ".backward",
            "attention",
            nbytes(q)
            + nbytes(k)
            + nbytes(v)
            + nbytes(o)
            + nbytes(do)
            + nbytes(lse)
            + nbytes(q)
            + nbytes(k)
            + nbytes(v),
            2.5 * self.flops(q),
            launches=2,
        )
        return _like(q), _like(k), _like(v)


def _mm(name, cat, m, k, n, a_elt, b_elt, out_elt, accumulate=False):
    """A matmul (m, k) @ (k, n): 2mkn FLOPs; bytes: its operands, its output (read too when it accumulates)."""
    out = m * n * out_elt
    _rec(name, cat, m * k * a_elt + k * n * b_elt + out * (2 if accumulate else 1), 2 * m * k * n)


# Host-side ops of our fused loss (the kept rows and the token count, found on the CPU): not GPU work.
_FLCE_HOST = ("aten.ne", "aten.sum", "aten.clamp", "aten.nonzero")


def _flce_category(name: str) -> str:
    if name in ("aten.mm", "aten.addmm", "aten.addmm_"):
        return "matmuls"
    return "other_elementwise" if name == "aten._to_copy" else "loss"  # the cast is the weight's, to bf16


class OurFLCEModel:
    """kernels' FusedLinearCrossEntropyFunction(hidden, weight, target, bias, ls, ignore_index, reduction, z_loss,
    num_items, out_dtype) by bench/bench_fused_linear_cross_entropy.py's `traffic_parts` (forward with every
    gradient, backward with grad_output 1, the weight fp32 under autocast): the K kept rows (target on the host)
    gathered, the weight cast to bf16, per chunk of C rows the logits matmul, the cross-entropy kernel, the
    grad_hidden matmul and the grad_weight matmul into the fp32 (V, H) gradient; backward rounds grad_hidden once
    and scatters it back. FLOPs and launches per chunk from the same chunking (kernels' `_chunk_rows`)."""

    category = "loss"

    name = "FusedLinearCrossEntropyFunction"

    def forward(self, ctx, hidden, weight, target, bias, ls, ignore_index, reduction, *rest):
        n, h = hidden.shape
        v = weight.shape[0]
        s, w = hidden.element_size(), weight.element_size()
        k = int((target != ignore_index).sum()) if target.device.type == "cpu" else n
        ctx.sizes = (n, h, v, s, w, k)
        held = [torch.empty((k, h), dtype=hidden.dtype, device=hidden.device)] if k < n else []
        if w != s:
            held.append(torch.empty((v, h), dtype=hidden.dtype, device=hidden.device))  # the weight's bf16 copy
        grad_hidden = torch.empty((k, h), dtype=torch.float32, device=hidden.device)
        # a frozen weight (LoRA's lm_head) gets no gradient buffer, as the kernel's need_weight (its traffic here is
        # still the full fine-tune's)
        grad_weight = torch.empty((v, h), dtype=torch.float32, device=hidden.device) if weight.requires_grad else None
        chunk = flce_chunk_rows(k, h, v) if k else 1
        chunks = math.ceil(k / chunk)
        flops = {"aten.mm": 2 * k * h * v * 2 + 2 * min(chunk, k) * h * v, "aten.addmm": 2 * max(0, k - chunk) * h * v}
        launches = {"aten.mm": 2 * chunks + 1, "aten.addmm": chunks - 1, "_cross_entropy_fwd_kernel": chunks}
        for start in range(0, k, chunk):  # the chunk's logits, for the peak memory
            logits = torch.empty((min(chunk, k - start), v), dtype=hidden.dtype, device=hidden.device)
            del logits
        _record_parts(
            "flce",
            _flce_category,
            bench_flce.traffic_parts("forward", n, h, v, s, n - k, w=w),
            skip=_FLCE_HOST,
            launches=launches,
            flops=flops,
        )
        del held
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.hidden_meta = (hidden.shape, hidden.dtype)
        ctx.n_rest = len(rest) + 3  # ls, ignore_index, reduction and the rest: no gradient
        return torch.empty((), dtype=torch.float32, device=hidden.device)

    def backward(self, ctx, grad_output):
        grad_hidden, grad_weight = ctx.saved_tensors
        shape, dtype = ctx.hidden_meta
        n, h, v, s, w, k = ctx.sizes
        _record_parts(
            "flce.backward",
            _flce_category,
            bench_flce.traffic_parts("backward", n, h, v, s, n - k, w=w),
            launches={"_cross_entropy_bwd_kernel": 2},
        )
        return (
            torch.empty(shape, dtype=dtype, device=grad_hidden.device),
            grad_weight,
            None,
            None,
            *([None] * ctx.n_rest),
        )


class LigerFLCEModel:
    """LigerFusedLinearCrossEntropyFunction(input, weight, target, bias, ce_weight, ignore_index, lse_square_scale,
    label_smoothing, reduction, ...) as liger-kernel 0.8 runs it: every row (no skipping), chunks of
    next_pow2(N / ceil(V / H)) rows; fp32 grad_input and grad_weight zeroed; the weight cast once to bf16 by
    autocast; per chunk: the input chunk cast to bf16 (fp32 input; twice: for the logits and for grad_weight),
    logits matmul, liger's cross-entropy kernel (two reads and one write per logit, the same as ours), grad_input
    matmul (bf16 out) copied into the fp32 grad_input, grad_weight addmm reading and writing the fp32 (V, H) gradient.
    Backward: grad_output is 1/num_items after the callers' division of the "sum" loss, so liger's element_mul scales
    grad_input and grad_weight (read + write each). A frozen weight (LoRA's lm_head) gets no grad_weight, its zeroing,
    its addmm or its scaling (liger's weight_needs_grad)."""

    category = "loss"

    name = "LigerFusedLinearCrossEntropyFunction"

    def forward(self, ctx, inp, weight, target, bias, ce_weight, ignore_index, lse_sq, ls, reduction, *rest):
        n, h = inp.shape
        v = weight.shape[0]
        lo = 2  # bf16 under autocast
        cast_input = inp.element_size() != lo
        train_weight = weight.requires_grad
        ctx.scaled = reduction == "sum"
        _rec(
            "liger_flce.zero_grads",
            "loss",
            n * h * inp.element_size() + (v * h * weight.element_size() if train_weight else 0) + 4 * n,
            0,
            launches=3 if train_weight else 2,
        )
        grad_input = _like(inp)
        grad_weight = _like(weight) if train_weight else None
        held = []
        if weight.element_size() != lo:
            _rec("liger_flce.weight_cast", "other_elementwise", nbytes(weight) + v * h * lo)
            held.append(torch.empty((v, h), dtype=BF16, device=inp.device))
        inc = math.ceil(v / h)
        chunk = min(1 << max(0, math.ceil(n / inc) - 1).bit_length(), n)
        for start in range(0, n, chunk):
            c = min(chunk, n - start)
            logits = torch.empty((c, v), dtype=BF16, device=inp.device)
            if cast_input:
                _rec("liger_flce.input_cast", "other_elementwise", c * h * (inp.element_size() + lo), launches=1)
            _mm("liger_flce.logits", "matmuls", c, h, v, lo, lo, lo)
            _rec("liger_flce.cross_entropy", "loss", liger_cross_entropy_bytes(c, v, lo))
            _mm("liger_flce.grad_input", "matmuls", c, v, h, lo, lo, lo)
            if inp.element_size() != lo:
                _rec("liger_flce.grad_input_copy", "other_elementwise", c * h * (lo + inp.element_size()))
            if train_weight:
                if cast_input:
                    _rec("liger_flce.input_cast", "other_elementwise", c * h * (inp.element_size() + lo))
                _mm("liger_flce.grad_weight", "matmuls", v, c, h, lo, lo, weight.element_size(), accumulate=True)
            del logits
        del held
        ctx.save_for_backward(grad_input, grad_weight)
        ctx.n_rest = (
            len(rest) + 7
        )  # target, bias, ce_weight, ignore_index, lse_square_scale, label_smoothing, reduction
        loss = torch.empty((), dtype=torch.float32, device=inp.device)
        return loss, None, None, None

    def backward(self, ctx, grad_output, *_):
        grad_input, grad_weight = ctx.saved_tensors
        if ctx.scaled:
            grads = [g for g in (grad_input, grad_weight) if g is not None]
            _rec("liger_flce.element_mul", "loss", 2 * sum(nbytes(g) for g in grads), launches=len(grads))
        return grad_input, grad_weight, *([None] * ctx.n_rest)


def _adamw_model(params, grads, exp_avgs, exp_avg_sqs, steps, masters, **hyper):
    """kernels.adamw.fused_adamw_step (the step counters' foreach add + one Triton launch per bucket) by
    bench/bench_adamw.py's `traffic_parts`."""
    fp32 = params[0].dtype == torch.float32
    variant = "ours_fp32" if fp32 else ("ours_bf16_master" if masters else "ours_bf16_sr")
    _record_parts("fused_adamw", "optimizer", bench_adamw.traffic_parts(variant, [p.numel() for p in params]))


# Function class name -> its model (a fresh one per call: it keeps what its backward needs on ctx)
MODELS = {
    "RMSNormFunction": lambda: RMSNormModel("RMSNormFunction"),
    "LigerRMSNormFunction": lambda: RMSNormModel("LigerRMSNormFunction"),
    "SwiGLUFunction": lambda: SwiGLUModel("SwiGLUFunction"),
    "LigerSiLUMulFunction": lambda: SwiGLUModel("LigerSiLUMulFunction"),
    "LigerGELUMulFunction": lambda: SwiGLUModel("LigerGELUMulFunction"),  # GeGLU: the same passes as its SiLU twin
    "SwiGLULinearFunction": SwiGLULinearModel,
    "RoPEFunction": lambda: RoPEModel("RoPEFunction"),
    "LigerRopeFunction": lambda: RoPEModel("LigerRopeFunction"),
    "FusedAddRMSNormFunction": FusedAddRMSNormModel,
    "GatedRMSNormFunction": GatedRMSNormModel,
    "CausalConv1dFunction": CausalConv1dModel,
    "MoEExpertsFunction": MoEExpertsModel,
    "MoEExpertsLoRAFunction": MoEExpertsLoRAModel,
    "LigerFusedMoEFunction": LigerFusedMoEModel,
    "FusedLinearCrossEntropyFunction": OurFLCEModel,
    "LigerFusedLinearCrossEntropyFunction": LigerFLCEModel,
}


def _function_classes() -> dict[str, type]:
    """The autograd Functions MODELS names that exist now: ours from any module of `kernels` (so a kernel that lands
    under one of the names is picked up), liger's from its ops."""
    found = {}
    for info in pkgutil.iter_modules(kernels.__path__):
        try:
            module = importlib.import_module(f"kernels.{info.name}")
        except ImportError:  # e.g. the optional CUDA extension, unbuilt
            continue
        for name in MODELS:
            cls = getattr(module, name, None)
            if isinstance(cls, type) and issubclass(cls, torch.autograd.Function):
                found[name] = cls
    liger = {
        "LigerRMSNormFunction": "liger_kernel.ops.rms_norm",
        "LigerSiLUMulFunction": "liger_kernel.ops.swiglu",
        "LigerGELUMulFunction": "liger_kernel.ops.geglu",
        "LigerRopeFunction": "liger_kernel.ops.rope",
        "LigerFusedLinearCrossEntropyFunction": "liger_kernel.ops.fused_linear_cross_entropy",
        "LigerFusedMoEFunction": "liger_kernel.ops.fused_moe",
    }
    for name, mod in liger.items():
        found[name] = getattr(importlib.import_module(mod), name)
    return found


def _modelled_apply(name: str):
    """A replacement for the `apply` of the Function called `name`: its model runs instead."""

    def apply(*args):
        return apply_model(MODELS[name](), *args)

    return staticmethod(apply)
