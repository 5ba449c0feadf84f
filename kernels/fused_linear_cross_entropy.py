"""Fused linear + cross-entropy (the LM head and its loss) without materialising the (tokens, vocab) logits.

Math: logits = hidden @ weight.T + bias, loss = cross_entropy(logits, target) with the semantics of
`kernels.cross_entropy` (label smoothing, ignore_index, z-loss, mean/sum/none, num_items, softcap: Gemma 2's
c tanh(logits / c) taken inside the cross-entropy kernel as it reads each chunk's logits, its derivative folded into
dlogits, so softcapping costs no pass and no buffer of its own). With
dlogits = dloss/dlogits (see kernels/cross_entropy.py):

    grad_hidden = dlogits @ weight        grad_weight = dlogits.T @ hidden        grad_bias = sum_rows dlogits

Skipping ignored tokens. In SFT most targets are prompt tokens (ignore_index), and the labels are built
on the host. When target is on the CPU, its K kept rows are found there (no device sync), hidden[kept]
is gathered on the device (index and targets copied non-blocking) and every matmul below runs on K rows
only: with a fraction p ignored, (1 - p) of the matmul flops (tests/ count them with FlopCounterMode).
grad_hidden is scattered back with zeros in the ignored rows. Results equal the unskipped path's up to
the matmuls' summation order (fp32 rounding). A target already on the accelerator keeps every row
(finding them would need a sync), as does tracing under torch.compile (nonzero has no static shape).

Token pass (N below means the kept rows): the tokens are processed in chunks of C rows. Per chunk:
logits_c = hidden_c @ weight.T (+ bias) with a torch matmul (C, V); the cross-entropy kernel turns
logits_c in place into its gradient (that chunk buffer is internal, nobody else can see it) and writes
the chunk's per-row losses and log-sum-exps; then grad_hidden_c = dlogits_c @ weight, grad_bias +=
column sums and grad_weight += dlogits_c.T @ hidden_c: 3 matmuls, 6 K H V flops for K kept rows, the
same as liger-kernel's (which computes every row's), whatever the weight's dtype.

Weight gradient. An fp32 weight (our trainer's master weights, also under bf16 autocast, where the
weight is cast to bf16 for the matmuls inside the op) accumulates grad_weight in fp32 in the tensor that
backward returns and autograd keeps as .grad: no separate accumulator, no cast pass. A bf16/fp16 weight's
gradient is accumulated in its own dtype: each chunk's dlogits_c.T @ hidden_c is summed in fp32 together
with the running sum and rounded once per chunk (cuBLAS with a bf16 C and fp32 compute; `_mm_fp32`).
Why not fp32 across chunks: every chunk touches every vocabulary row, so that needs an fp32 (V, H)
accumulator (2.1 GB for Llama-3-8B's head, beyond the 0.7 GB this op may add), and the alternative kept
until issue 20 item 4, a backward pass over vocabulary slices that recomputed the logits into an fp32
(Vs, H) buffer, cost 8 K H V flops instead of 6 (+33%). Precision: ceil(K / C) roundings of the running
sum, each at most half an ulp: 4 for 8192 tokens with C = 2048 (liger: 32, with its C = 256); measured
in tests/ (64 rows, sums growing): 1 chunk 0.0096, 4 chunks 0.016 (as the fp32 accumulator), 16 chunks
0.065, 64 chunks 0.196 max error, PyTorch's single bf16 matmul 0.010.
reduction="none" cannot fold a per-row grad_output in ahead of time: its forward computes the losses
only and its backward runs the token pass with dlogits scaled per row; with a bf16/fp16 weight that
pass leaves grad_weight to the vocabulary pass (`_vocab_pass`, 8 K H V flops in all) so that it is
still summed in fp32: for each slice of Vs vocabulary rows, the slice's logits are recomputed per tile
of Ct tokens, turned into their gradient in place from the token pass's lse (`_flce_slice_grad_kernel`;
the target column takes the token pass's exact value), and dlogits_s.T @ hidden_c is summed in an fp32
(Vs, H) buffer, rounded once into the slice of grad_weight. Tiles: Ct = Vs = 8192.

Accumulation and rounding: grad_hidden, grad_bias and an fp32 weight's gradient are accumulated in fp32
(on CUDA with torch >= 2.8 cuBLAS reads the bf16/fp16 operands and accumulates into the fp32 output in
place, addmm/mm with out_dtype=float32; elsewhere the operands are upcast) and multiplied by grad_output
before their one rounding to the parameter's dtype (no host sync; in place for fp32). A bf16/fp16
weight's gradient (above) is multiplied by grad_output in place in backward, one more rounding unless
grad_output is a power of two (GradScaler's scales are); the tests hold it to twice PyTorch's error with
grad_output 2.5 in fp16 and bf16.

Chunk size and memory (bytes for bf16 activations; N tokens, H hidden, V vocab; K kept rows):

    C = min(N, max(ceil(N / ceil(V / H)), MIN_CHUNK_ROWS))        MIN_CHUNK_ROWS = 2048

The first term is Liger's rule (chunk logits about the size of the hidden states, N*H elements). The
floor exists because with an fp32 weight every chunk re-reads and re-writes grad_weight (4*V*H bytes
each way; half that for a bf16 weight's): relative to the chunk's 6*C*H*V matmul flops that costs about
8*F / (6*C*B) (F flop/s, B bytes/s; on an H100 ~300/C), ~15% at C = 2048 but ~100% at Liger's C = 256 for
H = 4096, V = 128256 (an estimate from the H100 data sheet, not a measurement; the benchmark reports the
real figure); it also bounds a bf16 weight's gradient roundings (above). Peak extra memory beyond the
inputs, the returned gradients and the loss (all in the forward; backward only rounds and scales):
  bf16 weight   2*C*V (chunk logits) + 4*K*H (fp32 grad_hidden)
  fp32 weight   2*V*H (its bf16 copy under autocast, as F.linear makes) + 2*C*V + 4*K*H
  (+ 2*K*H for the gathered rows when some are skipped)
  reduction="none" with a bf16 weight: backward 4*K*H + 2*Ct*Vs + 4*Vs*H (the vocabulary pass)
At N = 8192, H = 4096, V = 128256 that is 0.660 GB for a bf16 weight with every row kept (0.525 GB chunk
logits + 0.134 GB grad_hidden; 0.626 GB with half the labels ignored on the host; the former fp32 (V, H)
accumulator alone was 2.1 GB) and 1.71 GB for an fp32 weight under autocast, measured on meta tensors
by tests/ (test_peak_extra_memory_at_llama3_8b_head). Never a (N, V) tensor: the tests record every
tensor the op allocates with forced small tiles.

Test: `python -m pytest tests/kernels/test_fused_linear_cross_entropy.py -q` (Triton interpreter on CPU).
Bench: `python bench/bench_fused_linear_cross_entropy.py` (GPU), `--quick` for a CPU smoke run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ._dispatch import HAS_TRITON, use_triton
from .cross_entropy import (
    _check_args,
    _denominator,
    _reduce,
    _scale_saved_,
    check_softcap,
    cross_entropy_bwd,
    cross_entropy_fwd,
    cross_entropy_ref,
)

if HAS_TRITON:
    import triton
    import triton.language as tl

    from ._jit_math import tanh

# See the module docstring: below ~2048 rows per chunk the fp32 grad_weight round trips cost >15%.
MIN_CHUNK_ROWS = 2048
# Vocabulary pass tile (reduction="none" with a bf16/fp16 weight; module docstring): 8192 token rows make
# the fp32 slice accumulator's round trips <= ~7% of the tile's matmul time (8 Vs H bytes against 4 Ct Vs H
# flops, an H100 data-sheet estimate) and none at all up to 8192 tokens; 8192 vocabulary rows keep the
# accumulator at 128 MiB for H = 4096.
VOCAB_TILE_ROWS = 8192
VOCAB_TILE_COLS = 8192
_HAS_ADDMM_OUT_DTYPE = hasattr(torch.ops.aten.addmm, "dtype_out") and hasattr(torch.ops.aten.mm, "dtype_out")

if HAS_TRITON:

    @triton.jit
    def _flce_slice_grad_kernel(
        logits_ptr,  # (R, S) contiguous logits of vocabulary columns [col_start, col_start + S); becomes their gradient
        target_ptr,  # (R,) int32/int64 class indices
        lse_ptr,  # (R,) fp32 log-sum-exp of each row over the whole vocabulary (the token pass's)
        grad_target_ptr,  # (R,) the target column's gradient as the token pass stored it (the logits' dtype)
        scale_ptr,  # fp32 gradient scale: 0-d (scale_stride 0) or per row; unused without HAS_SCALE
        n_cols,  # S
        col_start,  # vocabulary index of column 0
        vocab,  # V: label smoothing spreads s / V over it; targets outside [0, V) give NaN, as in cross_entropy
        scale_stride,
        ignore_index,
        LABEL_SMOOTHING: tl.constexpr,
        Z_LOSS: tl.constexpr,
        HAS_SCALE: tl.constexpr,
        BLOCK: tl.constexpr,
        SOFTCAP: tl.constexpr,  # c > 0: the loss is over c tanh(x / c) (lse is the capped logits'); 0.0: none
    ):
        # dloss/dx_j = exp(x_j - lse) * (1 + 2 z lse) - s / V off the target (kernels/cross_entropy.py's
        # formula with p_j = exp(x_j - lse)); the target column takes the token pass's value, whose p_y - 1 is
        # computed without cancellation there. With SOFTCAP, x_j is the capped logit and the gradient is multiplied
        # by tanh's derivative 1 - tanh^2(x_j / c).
        LOG2E: tl.constexpr = 1.4426950408889634
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        y = tl.load(target_ptr + row).to(tl.int64)
        x = tl.load(logits_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        lse = tl.load(lse_ptr + row)
        scale = 1.0
        if HAS_SCALE:
            scale = tl.load(scale_ptr + row * scale_stride).to(tl.float32)
        bad = (y != ignore_index) & ((y < 0) | (y >= vocab))
        scale = tl.where(bad, float("nan"), scale)
        if SOFTCAP > 0.0:
            th = tanh(x / SOFTCAP)
            g = (1.0 + 2.0 * Z_LOSS * lse) * scale * tl.exp2((SOFTCAP * th - lse) * LOG2E) - (
                LABEL_SMOOTHING / vocab
            ) * scale
            g = g * (1.0 - th * th)
        else:
            g = (1.0 + 2.0 * Z_LOSS * lse) * scale * tl.exp2((x - lse) * LOG2E) - (LABEL_SMOOTHING / vocab) * scale
        g_y = tl.load(grad_target_ptr + row).to(tl.float32)
        g = tl.where(cols + col_start == y, g_y, g)
        g = tl.where(y == ignore_index, 0.0, g)
        tl.store(logits_ptr + row * n_cols + cols, g.to(logits_ptr.dtype.element_ty), mask=mask)


def _chunk_rows(n_rows: int, hidden: int, vocab: int) -> int:
    """Rows per chunk of the token pass (the formula of the module docstring)."""
    by_memory = triton.cdiv(n_rows, triton.cdiv(vocab, hidden))
    return max(1, min(n_rows, max(by_memory, MIN_CHUNK_ROWS)))


def _vocab_tile(n_rows: int, hidden: int, vocab: int) -> tuple[int, int]:
    """(token rows, vocabulary rows) of one vocabulary-pass tile (module docstring)."""
    return max(1, min(n_rows, VOCAB_TILE_ROWS)), max(1, min(vocab, VOCAB_TILE_COLS))


def _mm_fp32(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, accumulate: bool) -> torch.Tensor:
    """out = a @ b, or += when accumulate, for a, b of any float dtype with fp32 accumulation; returns out.

    A bf16/fp16 out is rounded once per call: the product and out's old values are summed in fp32 (cuBLAS
    with a bf16 C and fp32 compute does exactly this; elsewhere the operands are upcast)."""
    if out.dtype != torch.float32:
        if out.is_cuda and not torch.compiler.is_compiling():
            a, b = a.to(out.dtype), b.to(out.dtype)
            return torch.addmm(out, a, b, out=out) if accumulate else torch.mm(a, b, out=out)
        total = torch.addmm(out.float(), a.float(), b.float()) if accumulate else torch.mm(a.float(), b.float())
        return out.copy_(total)
    if a.dtype == torch.float32:
        return out.addmm_(a, b) if accumulate else torch.mm(a, b, out=out)
    if out.is_cuda and _HAS_ADDMM_OUT_DTYPE:
        # cuBLAS reads bf16/fp16 operands and reads/writes the fp32 out: no upcast copies.
        if torch.compiler.is_compiling():
            return out.copy_(
                torch.addmm(out, a, b, out_dtype=torch.float32)
                if accumulate
                else torch.mm(a, b, out_dtype=torch.float32)
            )
        if accumulate:
            return torch.addmm(out, a, b, out_dtype=torch.float32, out=out)
        return torch.mm(a, b, out_dtype=torch.float32, out=out)
    # CPU (and CUDA torch < 2.8): upcast the operands; exact, and only the tests and old stacks pay for it.
    return out.addmm_(a.float(), b.float()) if accumulate else torch.mm(a.float(), b.float(), out=out)


def _logits(hidden, weight, bias):
    return hidden @ weight.t() if bias is None else torch.addmm(bias, hidden, weight.t())


def _rows(t, start, size):
    """Rows [start, start + size) of t, or t itself when it is 0-d (one scale for every row)."""
    return t if t is None or t.dim() == 0 else t.narrow(0, start, size)


def _token_pass(
    hidden,
    weight,
    bias,
    target,
    *,
    label_smoothing,
    ignore_index,
    z_loss,
    softcap,
    loss_rows,
    grad_scale,
    need_hidden,
    need_bias,
    grad_weight,
    for_vocab_pass,
    sums_out=None,
):
    """One pass over the token chunks of 2-D hidden (N, H) (weight, bias in hidden's dtype); no autograd.

    Writes the per-row losses into loss_rows (fp32 (N,)). The gradients are those of the per-row losses
    times grad_scale (fp32, 0-d or (N,), or None for 1), kept in fp32 so that the caller rounds them once:
    grad_hidden (N, H) and grad_bias (V,) are returned (None where not needed), grad_weight ((V, H) in fp32 or
    the weight's dtype, or None) is accumulated in place. for_vocab_pass also returns what `_vocab_pass` needs: lse
    (fp32 (N,))
    and the target column's gradient (N,) in hidden's dtype; else those are None. `sums_out` (fp32 (N,)) optionally
    receives each row's sum of its (capped) logits.
    """
    n_rows, hdim = hidden.shape
    vocab = weight.shape[0]
    compute_grad = need_hidden or need_bias or grad_weight is not None or for_vocab_pass
    dev = hidden.device
    grad_hidden = torch.empty((n_rows, hdim), dtype=torch.float32, device=dev) if need_hidden else None  # (N, H)
    grad_bias = torch.zeros(vocab, dtype=torch.float32, device=dev) if need_bias else None  # (V,)
    lse = torch.empty(n_rows, dtype=torch.float32, device=dev) if for_vocab_pass else None  # (N,)
    grad_at_target = torch.empty(n_rows, dtype=hidden.dtype, device=dev) if for_vocab_pass else None  # (N,)
    chunk = _chunk_rows(n_rows, hdim, vocab) if n_rows else 1
    for start in range(0, n_rows, chunk):
        size = min(chunk, n_rows - start)
        hidden_c = hidden.narrow(0, start, size)  # (C, H)
        target_c = target.narrow(0, start, size)  # (C,)
        logits = _logits(hidden_c, weight, bias)  # (C, V)
        # only lse is kept from the result: holding its gradient (this chunk) would keep two chunks alive
        lse_c = cross_entropy_fwd(
            logits,
            target_c,
            label_smoothing=label_smoothing,
            ignore_index=ignore_index,
            z_loss=z_loss,
            compute_grad=compute_grad,
            grad_scale=_rows(grad_scale, start, size),
            grad_out=logits,
            loss_out=loss_rows.narrow(0, start, size),
            softcap=softcap,
            sums_out=None if sums_out is None else sums_out.narrow(0, start, size),
        )[1]
        if not compute_grad:
            del logits  # before the next chunk's matmul, or two chunks are alive (reduction="none"'s forward did that)
            continue
        # logits now holds dloss/dlogits for the chunk.
        if for_vocab_pass:
            lse.narrow(0, start, size).copy_(lse_c)
            grad_at_target.narrow(0, start, size).copy_(
                logits.gather(1, target_c.clamp(0, vocab - 1).unsqueeze(1)).squeeze(1)
            )
        _chunk_grads_(logits, hidden_c, weight, grad_hidden, grad_weight, grad_bias, start)
        del logits
    return grad_hidden, grad_bias, lse, grad_at_target


def _chunk_grads_(dlogits, hidden_c, weight, grad_hidden, grad_weight, grad_bias, start: int) -> None:
    """A token chunk's share of the gradients being formed (each None where not needed), from its logits' gradient
    dlogits (C, V) (rows [start, start + C) of the pass): grad_hidden's rows (fp32, overwritten), grad_weight (the first
    chunk, start 0, overwrites it; later ones add, `_mm_fp32`) and grad_bias (added). The three fused heads that form
    their gradients in the forward run it: this op's token pass and the logprob and preference losses."""
    if grad_hidden is not None:
        _mm_fp32(dlogits, weight, grad_hidden.narrow(0, start, dlogits.shape[0]), accumulate=False)
    if grad_weight is not None:
        _mm_fp32(dlogits.t(), hidden_c, grad_weight, accumulate=start > 0)
    if grad_bias is not None:
        grad_bias.add_(dlogits.sum(0, dtype=torch.float32))


def _slice_grad_(
    logits, target, lse, grad_at_target, grad_scale, *, col_start, vocab, label_smoothing, ignore_index, z_loss, softcap
):
    """Launch `_flce_slice_grad_kernel`: logits (R, S) of columns [col_start, col_start + S) -> their gradient, in
    place."""
    n_rows, n_cols = logits.shape
    if n_rows == 0 or n_cols == 0:
        return
    # GPU: 4096-column tiles over 8 warps (an elementwise pass, 4 bytes per element in bf16; chosen by
    # analogy with cross_entropy_bwd, not yet timed). Interpreter: one program per row (it pays per program).
    block = min(triton.next_power_of_2(n_cols), 4096 if logits.is_cuda else 8192)
    scale_stride = grad_scale.stride(0) if grad_scale is not None and grad_scale.dim() == 1 else 0
    _flce_slice_grad_kernel[(n_rows, triton.cdiv(n_cols, block))](
        logits,
        target,
        lse,
        grad_at_target,
        grad_scale if grad_scale is not None else lse,
        n_cols,
        col_start,
        vocab,
        scale_stride,
        ignore_index,
        LABEL_SMOOTHING=float(label_smoothing),
        Z_LOSS=float(z_loss),
        HAS_SCALE=grad_scale is not None,
        BLOCK=block,
        SOFTCAP=float(softcap or 0.0),
        num_warps=8 if logits.is_cuda else 4,
    )


def _vocab_pass(
    hidden,
    weight,
    bias,
    target,
    lse,
    grad_at_target,
    grad_scale,
    *,
    label_smoothing,
    ignore_index,
    z_loss,
    softcap,
    out,
    out_scale,
):
    """grad_weight of the per-row losses, vocabulary slice by slice, into `out` (V, H) (weight's dtype); no autograd.

    hidden (N, H), weight (V, H), bias in one (compute) dtype; lse and grad_at_target from `_token_pass`
    run with the same grad_scale. Each slice's logits are recomputed per token tile and turned into their
    gradient in place; the slice's weight gradient is summed over all tokens in an fp32 (Vs, H) buffer,
    then multiplied by out_scale (0-d fp32, None for 1) and rounded once into out.
    """
    n_rows, hdim = hidden.shape
    vocab = weight.shape[0]
    if n_rows == 0:
        return out.zero_()
    tile_rows, tile_cols = _vocab_tile(n_rows, hdim, vocab)
    acc_buf = torch.empty((tile_cols, hdim), dtype=torch.float32, device=hidden.device)  # (Vs, H)
    for col_start in range(0, vocab, tile_cols):
        n_cols = min(tile_cols, vocab - col_start)
        weight_s = weight.narrow(0, col_start, n_cols)  # (Vs, H)
        bias_s = None if bias is None else bias.narrow(0, col_start, n_cols)
        acc = acc_buf.narrow(0, 0, n_cols)
        for start in range(0, n_rows, tile_rows):
            size = min(tile_rows, n_rows - start)
            hidden_c = hidden.narrow(0, start, size)  # (Ct, H)
            logits = _logits(hidden_c, weight_s, bias_s)  # (Ct, Vs)
            _slice_grad_(
                logits,
                target.narrow(0, start, size),
                lse.narrow(0, start, size),
                grad_at_target.narrow(0, start, size),
                _rows(grad_scale, start, size),
                col_start=col_start,
                vocab=vocab,
                label_smoothing=label_smoothing,
                ignore_index=ignore_index,
                z_loss=z_loss,
                softcap=softcap,
            )
            _mm_fp32(logits.t(), hidden_c, acc, accumulate=start > 0)
            del logits
        out_s = out.narrow(0, col_start, n_cols)
        if out_scale is None:
            out_s.copy_(acc)
        else:
            cross_entropy_bwd(acc, out_scale, out=out_s)
    return out


@dataclass(frozen=True)
class _Plan:
    """What the backward launcher needs besides tensors."""

    reduction: str
    label_smoothing: float
    ignore_index: int
    z_loss: float
    n_rows: int  # N, the rows before ignored ones were skipped
    dtype: torch.dtype  # the matmuls' (hidden's) dtype
    need_hidden: bool
    need_weight: bool
    need_bias: bool
    weight_dtype: torch.dtype
    bias_dtype: torch.dtype | None
    softcap: float | None = None

    @property
    def vocab_pass(self) -> bool:
        """Only reduction="none" with a bf16/fp16 weight takes `_vocab_pass` (its per-row grad_output reaches the
        weight gradient only in backward); every other weight gradient is accumulated in the token pass."""
        return self.need_weight and self.weight_dtype != torch.float32 and self.reduction == "none"

    @property
    def options(self) -> dict:
        return dict(
            label_smoothing=self.label_smoothing,
            ignore_index=self.ignore_index,
            z_loss=self.z_loss,
            softcap=self.softcap,
        )


def _skip_ignored(hidden, target, ignore_index):
    """(rows, hidden_k, target_k): only the K rows with a target, found where that needs no device sync.

    target on the CPU (as a collator builds it): rows = its non-ignored rows as an int64 (K,) index on
    hidden's device (None when every row is kept), hidden_k = hidden[rows] and target_k = target[rows] on
    hidden's device, the host-to-device copies non-blocking. target on hidden's accelerator: finding the
    rows would need a host sync, so every row is kept.
    """
    dev = hidden.device
    if target.device.type != "cpu" or torch.compiler.is_compiling():
        return None, hidden, target.to(dev, non_blocking=True)
    kept = (target != ignore_index).nonzero().squeeze(1)  # (K,) on the host
    if kept.numel() == target.numel():
        return None, hidden, target.to(dev, non_blocking=True)
    target_k = target.index_select(0, kept)  # (K,)
    if dev.type == "cuda":  # from pageable memory a non_blocking copy would still wait for the host buffer
        kept, target_k = kept.pin_memory(), target_k.pin_memory()
    rows = kept.to(dev, non_blocking=True)
    return rows, hidden.index_select(0, rows), target_k.to(dev, non_blocking=True)


def _scatter_rows(values, rows, n_rows):
    """values (K, ...) placed at `rows` of zeros (N, ...); values itself when rows is None."""
    if rows is None:
        return values
    return torch.zeros((n_rows, *values.shape[1:]), dtype=values.dtype, device=values.device).index_copy_(
        0, rows, values
    )


def _new_weight_grad(weight, n_rows):
    # fp32 for an fp32 weight (the tensor autograd keeps as .grad), else weight's dtype (module docstring);
    # the first token chunk overwrites it; zeros only matter when there is no row at all
    return (torch.empty if n_rows else torch.zeros)(weight.shape, dtype=weight.dtype, device=weight.device)  # (V, H)


def fused_linear_cross_entropy_fwd(
    hidden,
    weight,
    target,
    bias=None,
    *,
    label_smoothing=0.0,
    ignore_index=-100,
    z_loss=0.0,
    reduction="mean",
    num_items=None,
    need_hidden=False,
    need_weight=False,
    need_bias=False,
    out_dtype=None,
    softcap=None,
    sums_out=None,
):
    """Launcher on 2-D hidden (N, H), weight (V, H), bias (V,), target (N,) on hidden's device or the CPU; no autograd.

    The matmuls run in hidden's dtype (weight and bias are cast to it; their gradients come back in their
    own dtypes). Returns (loss, saved, plan): `fused_linear_cross_entropy_bwd(grad_output, saved, plan)`
    gives the gradients of the loss. `sums_out` (fp32 (N,)) optionally receives each row's sum over the vocabulary of
    its (capped) logits, 0 on ignored rows.
    """
    n_rows = hidden.shape[0]
    dev = hidden.device
    if isinstance(num_items, torch.Tensor):
        num_items = num_items.to(dev, non_blocking=True)  # _denominator's own copy would block on a host tensor
    denom = _denominator(target, ignore_index, reduction, num_items, dev)
    denom = None if denom is None else denom.to(dev, non_blocking=True)  # counted on the host for a host target
    rows, hidden_k, target_k = _skip_ignored(hidden, target, ignore_index)
    plan = _Plan(
        reduction,
        float(label_smoothing),
        ignore_index,
        float(z_loss),
        n_rows,
        hidden.dtype,
        need_hidden,
        need_weight,
        need_bias,
        weight.dtype,
        None if bias is None else bias.dtype,
        softcap,
    )
    with_grad = reduction != "none"
    grad_scale = denom.reciprocal() if denom is not None else None
    # The weight's gradient is accumulated in the tensor that backward returns (scaled in place) and autograd
    # keeps as .grad: fp32 for an fp32 weight, else the weight's dtype (module docstring).
    grad_weight = _new_weight_grad(weight, hidden_k.shape[0]) if with_grad and need_weight else None
    loss_rows = torch.empty(hidden_k.shape[0], dtype=torch.float32, device=dev)  # (K,)
    sums_k = None if sums_out is None else torch.empty_like(loss_rows)  # (K,)
    grad_hidden, grad_bias, _, _ = _token_pass(
        hidden_k,
        weight.to(hidden.dtype),
        None if bias is None else bias.to(hidden.dtype),
        target_k,
        **plan.options,
        loss_rows=loss_rows,
        grad_scale=grad_scale,
        need_hidden=need_hidden and with_grad,
        need_bias=need_bias and with_grad,
        grad_weight=grad_weight,
        for_vocab_pass=False,
        sums_out=sums_k,
    )
    if sums_out is not None:
        sums_out.copy_(_scatter_rows(sums_k, rows, n_rows))
    loss = _reduce(_scatter_rows(loss_rows, rows, n_rows) if reduction == "none" else loss_rows, reduction, denom)
    if not with_grad:
        saved = (rows, hidden, weight, bias, target_k, None, None, None, None, None, None)
    else:
        saved = (rows, None, None, None, None, None, None, None, grad_hidden, grad_weight, grad_bias)
    return loss.to(out_dtype or hidden.dtype), saved, plan


def fused_linear_cross_entropy_bwd(grad_output, saved, plan):
    """(grad_hidden, grad_weight, grad_bias) of the forward's loss times grad_output (None where not needed).

    mean/sum: the forward's gradients times grad_output (fp32 ones rounded once; the weight's in place). "none":
    a token pass with grad_output folded in per row, then the vocabulary pass for a bf16/fp16 weight.
    """
    rows, hidden, weight, bias, target_k, lse, grad_at_target, grad_scale, grad_hidden, grad_weight, grad_bias = saved
    if hidden is not None:
        hidden = hidden if rows is None else hidden.index_select(0, rows)  # (K, H)
        weight_c, bias_c = weight.to(plan.dtype), None if bias is None else bias.to(plan.dtype)
    if plan.reduction == "none":
        grad_scale = grad_output.reshape(-1).float()  # (N,)
        grad_scale = grad_scale if rows is None else grad_scale.index_select(0, rows)  # (K,)
        out_scale = None

        def to_dtype(grad, dtype):
            return grad.to(dtype)

        n_kept = hidden.shape[0]
        grad_weight = _new_weight_grad(weight, n_kept) if plan.need_weight and not plan.vocab_pass else None
        grad_hidden, grad_bias, lse, grad_at_target = _token_pass(
            hidden,
            weight_c,
            bias_c,
            target_k,
            **plan.options,
            loss_rows=torch.empty(n_kept, dtype=torch.float32, device=hidden.device),
            grad_scale=grad_scale,
            need_hidden=plan.need_hidden,
            need_bias=plan.need_bias,
            grad_weight=grad_weight,
            for_vocab_pass=plan.vocab_pass,
        )
    else:
        out_scale = grad_output

        def to_dtype(grad, dtype):
            return _scale_saved_(grad, grad_output, dtype)

    if plan.vocab_pass:
        grad_weight = torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)  # (V, H)
        _vocab_pass(
            hidden,
            weight_c,
            bias_c,
            target_k,
            lse,
            grad_at_target,
            grad_scale,
            **plan.options,
            out=grad_weight,
            out_scale=out_scale,
        )
    elif grad_weight is not None:
        grad_weight = to_dtype(grad_weight, plan.weight_dtype)
    if grad_hidden is not None:
        grad_hidden = _scatter_rows(to_dtype(grad_hidden, plan.dtype), rows, plan.n_rows)
    if grad_bias is not None:
        grad_bias = to_dtype(grad_bias, plan.bias_dtype)
    return grad_hidden, grad_weight, grad_bias


class FusedLinearCrossEntropyFunction(torch.autograd.Function):
    """Autograd wrapper around the launchers; hidden arrives in the matmuls' dtype, weight and bias in their own."""

    @staticmethod
    def forward(
        ctx,
        hidden,
        weight,
        target,
        bias,
        label_smoothing,
        ignore_index,
        reduction,
        z_loss,
        num_items,
        out_dtype,
        softcap,
    ):
        loss, saved, ctx.plan = fused_linear_cross_entropy_fwd(
            hidden,
            weight,
            target,
            bias,
            label_smoothing=label_smoothing,
            ignore_index=ignore_index,
            z_loss=z_loss,
            reduction=reduction,
            num_items=num_items,
            need_hidden=ctx.needs_input_grad[0],
            need_weight=ctx.needs_input_grad[1],
            need_bias=ctx.needs_input_grad[3],
            out_dtype=out_dtype,
            softcap=softcap,
        )
        ctx.save_for_backward(*saved)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        # backward may run inside the caller's autocast region; our matmuls choose their own dtypes
        with torch.autocast(grad_output.device.type, enabled=False):
            grad_h, grad_w, grad_b = fused_linear_cross_entropy_bwd(grad_output, ctx.saved_tensors, ctx.plan)
        return grad_h, grad_w, None, grad_b, None, None, None, None, None, None, None


def _check_shapes(hidden, weight, target, bias):
    if hidden.dim() < 2 or weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            "fused_linear_cross_entropy: hidden must be (..., H) and weight (V, H); "
            f"got hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)}"
        )
    if tuple(target.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(
            f"fused_linear_cross_entropy: target shape {tuple(target.shape)} must equal "
            f"hidden.shape[:-1] = {tuple(hidden.shape[:-1])}"
        )
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(
            f"fused_linear_cross_entropy: bias must be (V,) = ({weight.shape[0]},), got {tuple(bias.shape)}"
        )
    if target.device != hidden.device and target.device.type != "cpu":
        raise ValueError(
            f"fused_linear_cross_entropy: target must be on hidden's device ({hidden.device}) or the CPU, "
            f"got {target.device}"
        )
    dtypes = {hidden.dtype, weight.dtype} | ({bias.dtype} if bias is not None else set())
    if len(dtypes) != 1 and not torch.is_autocast_enabled(hidden.device.type):
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
    softcap: float | None = None,
) -> torch.Tensor:
    """cross_entropy(hidden @ weight.T + bias, target) without the (tokens, vocab) logits.

    hidden (..., H), weight (V, H) (the nn.Linear / LM-head layout), bias (V,) or None, target
    hidden.shape[:-1], on hidden's device or the CPU: a CPU target (labels as the collator built them)
    lets the op skip the ignored rows' matmuls without a device sync. Options as in `kernels.cross_entropy`
    (`softcap`: the loss over softcap * tanh(logits / softcap)).
    Returns a 0-d loss ("mean"/"sum") or the per-token losses shaped like target ("none"), in hidden's
    dtype (fp32 under autocast).
    """
    _check_args(
        "fused_linear_cross_entropy", hidden, target, label_smoothing, ignore_index, reduction, z_loss, num_items
    )
    _check_shapes(hidden, weight, target, bias)
    check_softcap("fused_linear_cross_entropy", softcap)
    if not use_triton(hidden, weight, bias):
        return fused_linear_cross_entropy_ref(
            hidden,
            weight,
            target.to(hidden.device, non_blocking=True),
            bias,
            label_smoothing=label_smoothing,
            ignore_index=ignore_index,
            reduction=reduction,
            z_loss=z_loss,
            num_items=num_items,
            softcap=softcap,
        )
    device_type = hidden.device.type
    out_dtype = hidden.dtype
    if torch.is_autocast_enabled(device_type):
        # As F.linear + F.cross_entropy under autocast: matmuls in the autocast dtype and an fp32 loss. Only
        # hidden is cast here (autograd casts its gradient back); weight and bias are cast inside, so that an
        # fp32 weight's gradient is accumulated in fp32 straight into the tensor autograd keeps (not rounded
        # to the autocast dtype and cast back, as F.linear's is: a deliberate, more accurate difference).
        hidden = hidden.to(torch.get_autocast_dtype(device_type))
        out_dtype = torch.float32
    hidden2d = hidden.reshape(-1, hidden.shape[-1]).contiguous()  # (N, H)
    target1d = target.reshape(-1)  # (N,)
    needs_grad = torch.is_grad_enabled() and (
        hidden.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    )
    # Our matmuls pick their dtypes themselves (fp32 accumulation): autocast must not recast them.
    with torch.autocast(device_type, enabled=False):
        if needs_grad:
            loss = FusedLinearCrossEntropyFunction.apply(
                hidden2d,
                weight,
                target1d,
                bias,
                float(label_smoothing),
                ignore_index,
                reduction,
                float(z_loss),
                num_items,
                out_dtype,
                softcap,
            )
        else:
            loss = fused_linear_cross_entropy_fwd(
                hidden2d,
                weight,
                target1d,
                bias,
                label_smoothing=float(label_smoothing),
                ignore_index=ignore_index,
                z_loss=float(z_loss),
                reduction=reduction,
                num_items=num_items,
                out_dtype=out_dtype,
                softcap=softcap,
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
    softcap: float | None = None,
) -> torch.Tensor:
    """The unfused reference: F.linear in the inputs' (or autocast) dtype, then `cross_entropy_ref` (fp32 math)."""
    return cross_entropy_ref(
        F.linear(hidden, weight, bias),
        target,
        label_smoothing=label_smoothing,
        ignore_index=ignore_index,
        reduction=reduction,
        z_loss=z_loss,
        num_items=num_items,
        softcap=softcap,
    )
