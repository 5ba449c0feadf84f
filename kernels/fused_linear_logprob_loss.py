"""Fused linear log-prob loss: a loss of per-token log-probs (GRPO's and its kin's) and its gradient in one pass over
the completion rows, without the (tokens, vocab) logits: 6 K H V matmul FLOPs a policy step.

What it computes. `kernels/fused_linear_logprob.py` gives the per-token log-probs logp[s, t] (and entropies) of the
LM head with logits (hidden @ weight.T + bias) / T; a loss on them is then plain torch, and autograd hands that op the
loss's per-row gradient in backward, which must recompute every chunk's logits: 8 K H V FLOPs for K completion
rows (10 K H V with a bf16 weight). Here the loss is inside the op, given as a callable:

    L = sum over chunks c of loss_fn(logps[seqs_c], entropies[seqs_c], seqs_c)

for chunks of whole sequences (rows of the (S, T) batch), so the loss must be a sum of per-sequence terms, each
depending only on its sequence's log-probs (every batch-wide number, a normaliser, an entropy mask, is fixed by the
caller beforehand). GRPO's loss is (trainer/methods/grpo_loss.py): per token with token-level importance weights,
per sequence with GSPO's, divided by a normaliser counted from the mask. For each chunk:

    logits_c = (hidden_c @ weight.T + bias) / T                    (C, V)  matmul 1: 2 C H V
    nll_t, lse_t by the cross-entropy kernel, no gradient            reads logits_c once
    entropies (optional, torch fp32 over blocks of rows)            as fused_linear_logprob
    g = d loss_fn / d logps_c                                       autograd on the chunk's (s_c, T) numbers
    dlogits_t = -g_t (softmax(x_t) - onehot(y_t))                   the cross-entropy kernel again, per-row scale
                                                                   -g_t, in place: reads and writes logits_c
    grad_hidden_c = dlogits_c @ weight                              matmul 2: 2 C H V (fp32)
    grad_weight  += dlogits_c.T @ hidden_c                          matmul 3: 2 C H V
    grad_bias    += sum_t dlogits_t

all in the forward, exactly as kernels/fused_linear_preference_loss.py does for DPO (its chunks are whole pairs,
these whole sequences; the same helpers of kernels/fused_linear_cross_entropy.py): backward only multiplies the
saved gradients by the loss's upstream gradient. The temperature enters as hidden / T and bias / T (autograd
carries the 1/T into their gradients), as in fused_linear_logprob.

Chunks: the kept rows (prompt and padding rows skipped on the host when the target is on the CPU; with a target on
the device every row is kept, ignored ones contributing nothing) cut into chunks of whole sequences of about
C = fused linear cross-entropy's `_chunk_rows(K, H, V)` rows (sequences are added while the chunk stays within C;
a longer sequence is a chunk of its own). Weight gradient: an fp32 weight's accumulated in fp32 in the tensor
autograd keeps, a bf16/fp16 weight's summed in fp32 per chunk and rounded once per chunk (no vocabulary pass). Peak
extra memory: one chunk of logits, the entropies' two fp32 blocks (at most 64 MiB each), the fp32 (K, H) grad_hidden,
the gathered (K, H) rows, O(N) vectors: 0.76 GB for 16 completions of 512 tokens after 512-token prompts at
Llama-3.2-1B's head (H 2048, V 128256, bf16), eager 33.6 GB (measured on meta tensors by tests/).

The log-probs and entropies come back detached (for metrics); the entropies have no gradient (as in
fused_linear_logprob: TRL's entropy bonus is not supported).

Test: `python -m pytest tests/kernels/test_fused_linear_logprob_loss.py -q` (Triton interpreter on CPU).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import numpy as np
import torch

from ._dispatch import use_triton
from .cross_entropy import cross_entropy_fwd
from .fused_linear_cross_entropy import (
    _chunk_grads_,
    _logits,
    _new_weight_grad,
    _Plan,
    fused_linear_cross_entropy_bwd,
)
from .fused_linear_logprob import (
    TokenLogprobs,
    _check_args,
    _entropy_rows,
    _scaled_inputs,
    fused_linear_logprob_ref,
    scaled_softcap,
)
from .fused_linear_preference_loss import _target_on_host, _to_device

# the module, not the function kernels/__init__ exports under its name: its chunk rule is looked up at each call
_flce = importlib.import_module(f"{__package__}.fused_linear_cross_entropy")

LossFn = Callable[[torch.Tensor, "torch.Tensor | None", slice], torch.Tensor]


def _plan_chunks(target, ignore_index, hdim, vocab):
    """Host plan (no device sync): (rows, chunks). rows: the flat indices (K,) int64 of the kept rows in order, or
    None when every row is kept; chunks: a list of (first kept row, kept rows, first sequence, sequences)."""
    n_seqs, seq_len = target.shape
    if _target_on_host(target):
        kept = (target != ignore_index).numpy()  # (S, T)
        per_seq = kept.sum(1)  # (S,)
    else:
        kept = None
        per_seq = np.full(n_seqs, seq_len)
    n_kept = int(per_seq.sum())
    budget = _flce._chunk_rows(n_kept, hdim, vocab) if n_kept else 1
    chunks, first, row = [], 0, 0
    while first < n_seqs:  # greedy: whole sequences while the chunk stays within budget (at least one)
        last, size = first + 1, int(per_seq[first])
        while last < n_seqs and size + per_seq[last] <= budget:
            size += int(per_seq[last])
            last += 1
        chunks.append((row, size, first, last - first))
        row, first = row + size, last
    rows = None if kept is None or kept.all() else np.flatnonzero(kept.reshape(-1))
    return rows, chunks


def fused_linear_logprob_loss_fwd(
    hidden,
    weight,
    target,
    bias,
    loss_fn,
    *,
    ignore_index=-100,
    need_entropy=False,
    need_hidden=True,
    need_weight=True,
    need_bias=False,
    softcap=None,
):
    """Launcher on hidden (S, T, H), weight (V, H), bias (V,) or None, target (S, T) on hidden's device or the CPU;
    no autograd. The gradients asked for (need_hidden, need_weight, need_bias) are formed here (with `softcap` c,
    of the log-probs of c tanh(logits / c)).

    Returns (loss (fp32 0-d), logps (S, T) fp32, entropies (S, T) fp32 or None, saved, plan):
    `fused_linear_cross_entropy_bwd(grad_loss, saved, plan)` gives the gradients times grad_loss."""
    n_seqs, seq_len, hdim = hidden.shape
    vocab, dev = weight.shape[0], hidden.device
    rows, chunks = _plan_chunks(target, ignore_index, hdim, vocab)
    hidden2d = hidden.reshape(-1, hdim)  # (N, H)
    target1d = target.reshape(-1)  # (N,)
    if rows is None:
        rows_dev = torch.arange(n_seqs * seq_len, device=dev)  # (K,) = (N,)
        hidden_k, target_k = hidden2d, target1d.to(dev, non_blocking=True)
    else:
        rows_dev = _to_device(torch.from_numpy(rows), dev)  # (K,)
        hidden_k = hidden2d.index_select(0, rows_dev)  # (K, H)
        target_k = _to_device(target1d.index_select(0, torch.from_numpy(rows)), dev)  # (K,)
    n_kept = hidden_k.shape[0]
    weight_c = weight.to(hidden.dtype)
    bias_c = None if bias is None else bias.to(hidden.dtype)
    grad_hidden = torch.empty((n_kept, hdim), dtype=torch.float32, device=dev) if need_hidden else None  # (K, H)
    grad_weight = _new_weight_grad(weight, n_kept) if need_weight else None  # (V, H), fp32 or weight's dtype
    grad_bias = torch.zeros(vocab, dtype=torch.float32, device=dev) if need_bias else None  # (V,)
    logps = torch.zeros(n_seqs * seq_len, dtype=torch.float32, device=dev)  # (N,)
    entropies = torch.zeros(n_seqs * seq_len, dtype=torch.float32, device=dev) if need_entropy else None  # (N,)
    nll = torch.empty(n_kept, dtype=torch.float32, device=dev)  # (K,)
    entropy = torch.empty(n_kept, dtype=torch.float32, device=dev) if need_entropy else None  # (K,)
    loss = torch.zeros((), dtype=torch.float32, device=dev)
    for start, size, first, n in chunks:
        seqs = slice(first, first + n)
        hidden_c = hidden_k.narrow(0, start, size)  # (C, H)
        target_c = target_k.narrow(0, start, size)  # (C,)
        local = rows_dev.narrow(0, start, size) - first * seq_len  # (C,) rows within the chunk's (n, T) block
        nll_c = nll.narrow(0, start, size)
        logits = _logits(hidden_c, weight_c, bias_c)  # (C, V)
        lse = cross_entropy_fwd(
            logits, target_c, ignore_index=ignore_index, compute_grad=False, loss_out=nll_c, softcap=softcap
        )[1]
        ent_c = None
        if need_entropy:
            _entropy_rows(logits, lse, target_c, ignore_index, entropy.narrow(0, start, size), softcap)
            ent_c = torch.zeros(n * seq_len, dtype=torch.float32, device=dev).index_copy_(
                0, local, entropy.narrow(0, start, size)
            )
            ent_c = ent_c.view(n, seq_len)  # (n, T)
        with torch.enable_grad():
            lp = nll_c.neg().requires_grad_()  # (C,)
            dense = torch.zeros(n * seq_len, dtype=torch.float32, device=dev).index_copy(0, local, lp)
            share = loss_fn(dense.view(n, seq_len), ent_c, seqs)
            (grad_lp,) = torch.autograd.grad(share, lp, allow_unused=True)
        loss += share.detach()
        scale = torch.zeros_like(lp) if grad_lp is None else grad_lp.neg()  # (C,): dlogp_t / dx_t = -(p - onehot)
        cross_entropy_fwd(
            logits,
            target_c,
            ignore_index=ignore_index,
            grad_scale=scale,
            grad_out=logits,
            loss_out=nll_c,
            softcap=softcap,
        )  # logits now holds dL/dlogits of the chunk; nll_c is rewritten with the same values
        _chunk_grads_(logits, hidden_c, weight_c, grad_hidden, grad_weight, grad_bias, start)
        del logits
    logps.index_copy_(0, rows_dev, nll.neg())
    if need_entropy:
        entropies.index_copy_(0, rows_dev, entropy)
    plan = _Plan(
        "sum",
        0.0,
        ignore_index,
        0.0,
        n_seqs * seq_len,
        hidden.dtype,
        need_hidden,
        need_weight,
        need_bias,
        weight.dtype,
        None if bias is None else bias.dtype,
        softcap,
    )
    saved = (None if rows is None else rows_dev, None, None, None, None, None, None, None)
    saved += (grad_hidden, grad_weight, grad_bias)
    shape = (n_seqs, seq_len)
    return loss, logps.view(shape), None if entropies is None else entropies.view(shape), saved, plan


class FusedLinearLogprobLossFunction(torch.autograd.Function):
    """Autograd wrapper around the launcher: the loss is differentiable (its gradients formed in forward), the
    per-token log-probs and entropies are not."""

    @staticmethod
    def forward(ctx, hidden, weight, target, bias, loss_fn, ignore_index, need_entropy, softcap):
        loss, logps, entropies, saved, ctx.plan = fused_linear_logprob_loss_fwd(
            hidden,
            weight,
            target,
            bias,
            loss_fn,
            ignore_index=ignore_index,
            need_entropy=need_entropy,
            need_hidden=ctx.needs_input_grad[0],
            need_weight=ctx.needs_input_grad[1],
            need_bias=ctx.needs_input_grad[3],
            softcap=softcap,
        )
        ctx.hidden_shape = hidden.shape
        ctx.save_for_backward(*saved)
        outs = (logps,) if entropies is None else (logps, entropies)
        ctx.mark_non_differentiable(*outs)
        ctx.set_materialize_grads(False)
        return (loss, *outs)

    @staticmethod
    def backward(ctx, grad_loss, *grad_outs):
        with torch.autocast(grad_loss.device.type, enabled=False):
            grad_h, grad_w, grad_b = fused_linear_cross_entropy_bwd(grad_loss, ctx.saved_tensors, ctx.plan)
        grad_h = None if grad_h is None else grad_h.view(ctx.hidden_shape)
        return grad_h, grad_w, None, grad_b, None, None, None, None


def fused_linear_logprob_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    loss_fn: LossFn,
    bias: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
    ignore_index: int = -100,
    return_entropy: bool = False,
    softcap: float | None = None,
) -> tuple[torch.Tensor, TokenLogprobs]:
    """(loss, TokenLogprobs(logps, entropies)) with loss = the sum over chunks of whole sequences of
    loss_fn(logps (s, T) fp32, entropies (s, T) or None, slice of those sequences), its gradient formed in the
    forward (module docstring): loss_fn must be a sum of per-sequence terms.

    hidden (S, T, H), weight (V, H), bias (V,) or None; target (S, T), already shifted, ignore_index off the
    completions, on hidden's device or the CPU (a CPU target lets the op skip the prompt rows without a device sync).
    logps and entropies (S, T) fp32, detached, 0 on ignored rows (the same numbers as `fused_linear_logprob`, whose
    `softcap` this takes too).
    """
    _check_args(hidden, weight, target, bias, temperature, ignore_index, softcap, name="fused_linear_logprob_loss")
    if hidden.dim() != 3:
        raise ValueError(f"fused_linear_logprob_loss: hidden must be (S, T, H), got {tuple(hidden.shape)}")
    if not use_triton(hidden, weight, bias):
        return fused_linear_logprob_loss_ref(
            hidden,
            weight,
            target.to(hidden.device, non_blocking=True),
            loss_fn,
            bias,
            temperature=temperature,
            ignore_index=ignore_index,
            return_entropy=return_entropy,
            softcap=softcap,
        )
    device_type = hidden.device.type
    hidden, bias = _scaled_inputs(hidden, bias, temperature)
    cap = scaled_softcap(softcap, temperature)
    with torch.autocast(device_type, enabled=False):
        out = FusedLinearLogprobLossFunction.apply(
            hidden.contiguous(), weight, target, bias, loss_fn, ignore_index, return_entropy, cap
        )
    loss, logps = out[0], out[1]
    return loss, TokenLogprobs(logps, out[2] if return_entropy else None)


def fused_linear_logprob_loss_ref(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    loss_fn: LossFn,
    bias: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
    ignore_index: int = -100,
    return_entropy: bool = False,
    softcap: float | None = None,
) -> tuple[torch.Tensor, TokenLogprobs]:
    """The unfused reference: `fused_linear_logprob_ref`'s log-probs of every sequence, one loss_fn call over all."""
    out = fused_linear_logprob_ref(
        hidden,
        weight,
        target,
        bias,
        temperature=temperature,
        ignore_index=ignore_index,
        return_entropy=return_entropy,
        softcap=softcap,
    )
    loss = loss_fn(out.logps, out.entropies, slice(0, hidden.shape[0]))
    return loss, TokenLogprobs(out.logps.detach(), out.entropies)
