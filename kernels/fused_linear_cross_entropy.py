"""Fused linear + cross-entropy (the LM head and its loss) without materialising the (tokens, vocab) logits.

Math: logits = hidden @ weight.T + bias, loss = cross_entropy(logits, target) with the semantics of
`kernels.cross_entropy` (label smoothing, ignore_index, z-loss, mean/sum/none, num_items). With
dlogits = dloss/dlogits (see kernels/cross_entropy.py):

    grad_hidden = dlogits @ weight        grad_weight = dlogits.T @ hidden        grad_bias = sum_rows dlogits

Strategy: the N tokens are processed in chunks of C rows. Per chunk: logits_c = hidden_c @ weight.T
(+ bias) with a torch matmul (C, V); the cross-entropy kernel turns logits_c in place into its gradient
(that chunk buffer is internal, nobody else can see it) and writes the chunk's per-row losses; then,
still in the forward, grad_hidden_c = dlogits_c @ weight and grad_weight += dlogits_c.T @ hidden_c,
grad_bias += column sums. reduction="none" cannot fold a per-row grad_output into grad_weight ahead of
time, so its forward computes the losses only and its backward re-runs the chunk loop with dlogits
scaled per row (one extra hidden @ weight.T matmul: 8 N H V flops instead of 6).

Accumulation and rounding: the three gradients are kept in fp32 (on CUDA with torch >= 2.8 cuBLAS
reads the bf16/fp16 operands and accumulates into the fp32 output in place, addmm/mm with
out_dtype=float32; elsewhere the operands are upcast). Backward multiplies them by grad_output and
rounds once to the parameters' dtype in one pass (no host sync; in place and skipped when grad_output
== 1 for fp32 parameters). Rounding at the end of the forward and scaling in backward would round twice
when grad_output != 1 (e.g. loss / accumulation_steps): measured here, fp16 grad_weight errors then
exceed twice PyTorch's own.

Chunk size and memory (bytes for bf16; N tokens, H hidden, V vocab):

    C = min(N, max(ceil(N / ceil(V / H)), MIN_CHUNK_ROWS))        MIN_CHUNK_ROWS = 2048

The first term is Liger's rule (chunk logits about the size of the hidden states, N*H elements). The
floor exists because every chunk re-reads and re-writes the fp32 grad_weight accumulator (8*V*H bytes):
relative to the chunk's 6*C*H*V matmul flops that costs about 8*F / (6*C*B) (F flop/s, B bytes/s; on an
H100 ~300/C), ~15% at C = 2048 but ~100% at Liger's C = 256 for H = 4096, V = 128256 (an estimate from the
H100 data sheet, not a measurement; the benchmark reports the real figure). Peak extra memory:
  forward   2*C*V (chunk logits) + 4*V*H + 4*N*H (fp32 gradients)
  backward  6*V*H + 6*N*H (fp32 gradients + the rounded ones handed to autograd)
bounded by the chunk, never 2*N*V. The tests record every tensor the op allocates with a forced small
chunk and check that no (N, V) tensor exists.

Test: `python -m pytest tests/kernels/test_fused_linear_cross_entropy.py -q` (Triton interpreter on CPU).
Bench: `python bench/bench_fused_linear_cross_entropy.py` (GPU), `--quick` for a CPU smoke run.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._dispatch import HAS_TRITON, use_triton
from .cross_entropy import _check_args, _denominator, _reduce, _scale_saved_, cross_entropy_fwd, cross_entropy_ref

if HAS_TRITON:
    import triton

# See the module docstring: below ~2048 rows per chunk the fp32 grad_weight round trips cost >15%.
MIN_CHUNK_ROWS = 2048
_HAS_ADDMM_OUT_DTYPE = hasattr(torch.ops.aten.addmm, "dtype_out") and hasattr(torch.ops.aten.mm, "dtype_out")


def _chunk_rows(n_rows: int, hidden: int, vocab: int) -> int:
    """Rows per chunk (the formula of the module docstring)."""
    by_memory = triton.cdiv(n_rows, triton.cdiv(vocab, hidden))
    return max(1, min(n_rows, max(by_memory, MIN_CHUNK_ROWS)))


def _mm_fp32(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, accumulate: bool) -> torch.Tensor:
    """out (fp32) = a @ b, or += when accumulate, for a, b of any float dtype with fp32 accumulation; returns out."""
    if a.dtype == torch.float32:
        return out.addmm_(a, b) if accumulate else torch.mm(a, b, out=out)
    if out.is_cuda and _HAS_ADDMM_OUT_DTYPE:
        # cuBLAS reads bf16/fp16 operands and reads/writes the fp32 out: no upcast copies.
        if torch.compiler.is_compiling():
            return out.copy_(torch.addmm(out, a, b, out_dtype=torch.float32) if accumulate else torch.mm(a, b, out_dtype=torch.float32))
        if accumulate:
            return torch.addmm(out, a, b, out_dtype=torch.float32, out=out)
        return torch.mm(a, b, out_dtype=torch.float32, out=out)
    # CPU (and CUDA torch < 2.8): upcast the operands; exact, and only the tests and old stacks pay for it.
    return out.addmm_(a.float(), b.float()) if accumulate else torch.mm(a.float(), b.float(), out=out)


def _flce_chunks(hidden, weight, bias, target, *, label_smoothing, ignore_index, z_loss, loss_rows, grad_scale, need_hidden, need_weight, need_bias):
    """One pass over the token chunks of 2-D hidden (N, H); no autograd.

    Writes the per-row losses into loss_rows (fp32 (N,)). Returns fp32 gradients (grad_hidden (N, H),
    grad_weight (V, H), grad_bias (V,); None where not needed) of the per-row losses multiplied by
    grad_scale (fp32, 0-d or (N,), or None for 1): still fp32 so that the caller rounds them once.
    """
    n_rows, hdim = hidden.shape
    vocab = weight.shape[0]
    compute_grad = need_hidden or need_weight or need_bias
    dev = hidden.device
    grad_hidden = torch.empty((n_rows, hdim), dtype=torch.float32, device=dev) if need_hidden else None  # (N, H)
    # the first chunk overwrites grad_weight; zeros only matter when there is no chunk at all
    alloc = torch.empty if n_rows else torch.zeros
    grad_weight = alloc((vocab, hdim), dtype=torch.float32, device=dev) if need_weight else None  # (V, H)
    grad_bias = torch.zeros(vocab, dtype=torch.float32, device=dev) if need_bias else None  # (V,)
    chunk = _chunk_rows(n_rows, hdim, vocab) if n_rows else 1
    for start in range(0, n_rows, chunk):
        stop = min(n_rows, start + chunk)
        hidden_c = hidden[start:stop]  # (C, H)
        logits = hidden_c @ weight.t() if bias is None else torch.addmm(bias, hidden_c, weight.t())  # (C, V)
        scale = grad_scale
        if grad_scale is not None and grad_scale.dim() == 1:
            scale = grad_scale[start:stop]
        cross_entropy_fwd(
            logits,
            target[start:stop],
            label_smoothing=label_smoothing,
            ignore_index=ignore_index,
            z_loss=z_loss,
            compute_grad=compute_grad,
            grad_scale=scale,
            grad_out=logits,
            loss_out=loss_rows[start:stop],
        )
        if not compute_grad:
            continue
        # logits now holds dloss/dlogits for the chunk.
        if need_hidden:
            _mm_fp32(logits, weight, grad_hidden[start:stop], accumulate=False)
        if need_weight:
            _mm_fp32(logits.t(), hidden_c, grad_weight, accumulate=start > 0)
        if need_bias:
            grad_bias.add_(logits.sum(0, dtype=torch.float32))
        del logits
    return grad_hidden, grad_weight, grad_bias


def fused_linear_cross_entropy_fwd(hidden, weight, target, bias=None, *, label_smoothing=0.0, ignore_index=-100, z_loss=0.0, reduction="mean", num_items=None, need_hidden=False, need_weight=False, need_bias=False, out_dtype=None):
    """Launcher on 2-D hidden (N, H), target (N,): returns (loss, grad_hidden, grad_weight, grad_bias), no autograd.

    The gradients (reduction "mean"/"sum" only, else None) are those of the returned loss, in fp32:
    `fused_linear_cross_entropy_bwd` scales them by grad_output and rounds them to the inputs' dtype.
    """
    n_rows = hidden.shape[0]
    loss_rows = torch.empty(n_rows, dtype=torch.float32, device=hidden.device)
    denom = _denominator(target, ignore_index, reduction, num_items, hidden.device)
    with_grad = reduction != "none"
    grads = _flce_chunks(
        hidden, weight, bias, target,
        label_smoothing=label_smoothing, ignore_index=ignore_index, z_loss=z_loss, loss_rows=loss_rows,
        grad_scale=denom.reciprocal() if denom is not None else None,
        need_hidden=need_hidden and with_grad, need_weight=need_weight and with_grad, need_bias=need_bias and with_grad,
    )
    return (_reduce(loss_rows, reduction, denom).to(out_dtype or hidden.dtype), *grads)


def fused_linear_cross_entropy_bwd(grad_output, grads32, dtype):
    """grad_output (0-d) times each fp32 gradient of the forward, rounded once to `dtype` (in place when fp32)."""
    return tuple(None if g is None else _scale_saved_(g, grad_output, dtype) for g in grads32)


class FusedLinearCrossEntropyFunction(torch.autograd.Function):
    """Autograd wrapper: mean/sum compute every gradient in the forward; "none" recomputes in backward."""

    @staticmethod
    def forward(ctx, hidden, weight, target, bias, label_smoothing, ignore_index, reduction, z_loss, num_items, out_dtype):
        need_h, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[3]
        loss, grad_h, grad_w, grad_b = fused_linear_cross_entropy_fwd(
            hidden, weight, target, bias,
            label_smoothing=label_smoothing, ignore_index=ignore_index, z_loss=z_loss, reduction=reduction,
            num_items=num_items, need_hidden=need_h, need_weight=need_w, need_bias=need_b, out_dtype=out_dtype,
        )
        ctx.reduction = reduction
        ctx.dtype = hidden.dtype
        if reduction == "none":
            ctx.options = (label_smoothing, ignore_index, z_loss)
            ctx.needs = (need_h, need_w, need_b)
            ctx.save_for_backward(hidden, weight, target, bias)
        else:
            ctx.save_for_backward(grad_h, grad_w, grad_b)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        # backward may run inside the caller's autocast region; our matmuls choose their own dtypes
        with torch.autocast(grad_output.device.type, enabled=False):
            return FusedLinearCrossEntropyFunction._backward(ctx, grad_output)

    @staticmethod
    def _backward(ctx, grad_output):
        if ctx.reduction != "none":
            grad_h, grad_w, grad_b = fused_linear_cross_entropy_bwd(grad_output, ctx.saved_tensors, ctx.dtype)
        else:
            hidden, weight, target, bias = ctx.saved_tensors
            label_smoothing, ignore_index, z_loss = ctx.options
            need_h, need_w, need_b = ctx.needs
            scratch = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
            grads32 = _flce_chunks(
                hidden, weight, bias, target,
                label_smoothing=label_smoothing, ignore_index=ignore_index, z_loss=z_loss, loss_rows=scratch,
                grad_scale=grad_output.reshape(-1).float(), need_hidden=need_h, need_weight=need_w, need_bias=need_b,
            )
            grad_h, grad_w, grad_b = (None if g is None else g.to(ctx.dtype) for g in grads32)
        return grad_h, grad_w, None, grad_b, None, None, None, None, None, None


def _check_shapes(hidden, weight, target, bias):
    if hidden.dim() < 2 or weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"fused_linear_cross_entropy: hidden must be (..., H) and weight (V, H); got hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)}"
        )
    if tuple(target.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"fused_linear_cross_entropy: target shape {tuple(target.shape)} must equal hidden.shape[:-1] = {tuple(hidden.shape[:-1])}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"fused_linear_cross_entropy: bias must be (V,) = ({weight.shape[0]},), got {tuple(bias.shape)}")
    dtypes = {hidden.dtype, weight.dtype} | ({bias.dtype} if bias is not None else set())
    if len(dtypes) != 1:
        raise ValueError(
            f"fused_linear_cross_entropy: hidden, weight and bias must share one dtype, got hidden {hidden.dtype}, "
            f"weight {weight.dtype}, bias {None if bias is None else bias.dtype}"
        )


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    label_smoothing: float = 0.0,
    ignore_index: int = -100,
    reduction: str = "mean",
    z_loss: float = 0.0,
    num_items: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """cross_entropy(hidden @ weight.T + bias, target) without the (tokens, vocab) logits.

    hidden (..., H), weight (V, H) (the nn.Linear / LM-head layout), bias (V,) or None, target
    hidden.shape[:-1]. Options as in `kernels.cross_entropy`. Returns a 0-d loss ("mean"/"sum") or the
    per-token losses shaped like target ("none"), in hidden's dtype.
    """
    _check_args("fused_linear_cross_entropy", hidden, target, label_smoothing, ignore_index, reduction, z_loss, num_items)
    device_type = hidden.device.type
    out_dtype = None
    if torch.is_autocast_enabled(device_type):
        # As F.linear + F.cross_entropy under autocast: matmuls in the autocast dtype (autograd casts the
        # gradients back to the parameters' dtype) and an fp32 loss.
        dtype = torch.get_autocast_dtype(device_type)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
        out_dtype = torch.float32
    _check_shapes(hidden, weight, target, bias)
    if not use_triton(hidden, weight, target, bias):
        return fused_linear_cross_entropy_ref(
            hidden, weight, target, bias, label_smoothing=label_smoothing, ignore_index=ignore_index,
            reduction=reduction, z_loss=z_loss, num_items=num_items,
        )
    hidden2d = hidden.reshape(-1, hidden.shape[-1]).contiguous()  # (N, H)
    target1d = target.reshape(-1)  # (N,)
    out_dtype = out_dtype or hidden.dtype
    needs_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad))
    # Our matmuls pick their dtypes themselves (fp32 accumulation): autocast must not recast them.
    with torch.autocast(device_type, enabled=False):
        if needs_grad:
            loss = FusedLinearCrossEntropyFunction.apply(
                hidden2d, weight, target1d, bias, float(label_smoothing), ignore_index, reduction, float(z_loss), num_items, out_dtype
            )
        else:
            loss = fused_linear_cross_entropy_fwd(
                hidden2d, weight, target1d, bias, label_smoothing=float(label_smoothing), ignore_index=ignore_index,
                z_loss=float(z_loss), reduction=reduction, num_items=num_items, out_dtype=out_dtype,
            )[0]
    return loss.reshape(target.shape) if reduction == "none" else loss


def fused_linear_cross_entropy_ref(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    label_smoothing: float = 0.0,
    ignore_index: int = -100,
    reduction: str = "mean",
    z_loss: float = 0.0,
    num_items: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """The unfused reference: F.linear in the inputs' (or autocast) dtype, then `cross_entropy_ref` (fp32 math)."""
    return cross_entropy_ref(
        F.linear(hidden, weight, bias), target, label_smoothing=label_smoothing, ignore_index=ignore_index,
        reduction=reduction, z_loss=z_loss, num_items=num_items,
    )
