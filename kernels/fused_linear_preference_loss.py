"""Fused linear preference loss (DPO, IPO, hinge, robust, APO-zero, ORPO, SimPO, RPO): the loss and its gradient in one
pass over the answer rows, without materialising the (tokens, vocab) logits: 6 K H V matmul FLOPs a policy step.

What it computes. `preference_loss(fused_linear_preference(hidden, weight, target, bias), ref_logps, ...)` (both in
kernels/fused_linear_preference.py, whose docstring has the per-sequence numbers and every loss formula): the loss
and TRL's metrics of a batch of P pairs, sequences [chosen; rejected] (S = 2P rows of hidden (S, T, H)).

Why another op. `fused_linear_preference` returns the per-sequence log-probs and leaves the loss to autograd on
those (S,) tensors, so a row's upstream gradient is known only in backward, and the backward must recompute every
chunk's logits: 8 K H V matmul FLOPs for K answer rows. Here the loss is inside the op. Its batch loss is

    L = (1 / P) sum_p l(pair p's logps, counts, reference logps) + a * nll,
    nll = -(sum of the chosen sequences' logps) / (chosen answer tokens of the whole batch)

(`pair_losses`, a = rpo_alpha / 1 for orpo / cpo_alpha for simpo, none without an NLL term): the gradient of L with
respect to one pair's logps needs only that pair's numbers and two batch constants known up front (P, and the
chosen answer tokens, counted from the targets). So the answer rows are taken chunk by chunk of whole pairs (a
pair's chosen rows then its rejected rows; liger-kernel's chunked loss design), and for each chunk

    logits_c = hidden_c @ weight.T + bias                         (C, V)  matmul 1: 2 C H V
    nll_t, lse_t  by the cross-entropy kernel, no gradient           reads logits_c once
    logps_c[s] = -sum_{t in s} nll_t;   g = dL / dlogps_c            autograd on the chunk's (2 p_c,) numbers
    dlogits_t = -g[seq(t)] (softmax(x_t) - onehot(y_t))            the cross-entropy kernel again, per-row scale
                                                                   -g[seq(t)], in place: reads and writes logits_c
    grad_hidden_c = dlogits_c @ weight                             matmul 2: 2 C H V (fp32)
    grad_weight  += dlogits_c.T @ hidden_c                         matmul 3: 2 C H V
    grad_bias    += sum_t dlogits_t

all in the forward, like fused linear cross-entropy's "mean" (kernels/fused_linear_cross_entropy.py, whose helpers,
cross-entropy kernel and backward launcher this op reuses): backward only multiplies the saved gradients by the
loss's upstream gradient (`fused_linear_cross_entropy_bwd` with reduction "sum"). The cross-entropy kernel runs
twice per chunk (the scale needs the chunk's logps first): one extra read of the chunk's logits (s C V bytes),
instead of a third matmul pass. Matmul FLOPs of a policy step: 6 K H V + 4 K H (the mean-logit matmul below), the
eager (materialised) step's 6 N H V times (answer rows / all rows); the reference model's forward, under no_grad
through `fused_linear_preference`, adds 2 K H V as before. The loss's value and metrics are `preference_loss`'s on
the op's logps (the same formulas), so the op is exact wherever its logps are.

Chunks: the answer rows (prompt and padding rows skipped on the host when the target is on the CPU, as in fused
linear cross-entropy; with a target on the device every row of each sequence is kept) are reordered pair by pair
and cut into chunks of whole pairs of about C = fused linear cross-entropy's `_chunk_rows(K, H, V)` rows (pairs are
added while the chunk stays within C; a pair longer than C is a chunk of its own, so the chunk logits are at most
max(C, the longest pair's answer rows) x V). Weight gradient: an fp32 weight's accumulated in fp32 in the tensor
autograd keeps, a bf16/fp16 weight's summed in fp32 per chunk and rounded once per chunk (no vocabulary pass), as
fused linear cross-entropy's "mean". mean_logits (TRL's logits/* metrics) need no logits: h . mean_v w_v +
mean(b), one (K, H) x (H, 2) matmul (as in fused_linear_preference).

Peak extra memory: fused linear cross-entropy's "mean" (one chunk of logits, the fp32 (K, H) grad_hidden, the
gathered (K, H) rows) plus O(K) vectors.

Layout: hidden (S, T, H), sequence s = row s (padded batches, the trainer's); no padding-free sequence_ids here
(fused_linear_preference has them).

Test: `python -m pytest tests/kernels/test_fused_linear_preference_loss.py -q` (Triton interpreter on CPU).
Bench: `python bench/bench_fused_linear_preference.py` (provider "fused"; GPU), `--quick` for a CPU smoke run.
"""

from __future__ import annotations

import importlib

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
from .fused_linear_preference import (
    PreferenceLogps,
    _check_loss_args,
    _nll_weight,
    _per_sequence,
    fused_linear_preference,
    fused_linear_preference_ref,
    linear_row_means,
    pair_losses,
    preference_loss,
    preference_metrics,
)
from .fused_linear_preference import (
    _check_args as _check_lm_head_args,
)

# the module, not the function kernels/__init__ exports under its name: its chunk rule is looked up at each call
_flce = importlib.import_module(f"{__package__}.fused_linear_cross_entropy")


def _target_on_host(target):
    """Whether the kept rows can be found on the host: a CPU target, outside torch.compile's tracing."""
    return target.device.type == "cpu" and not torch.compiler.is_compiling()


def _plan_chunks(target, ignore_index, n_pairs, hdim, vocab):
    """Host plan (no device sync): (rows, seq_rows, chunks, counts).

    rows: the flat indices (K,) int64 of the kept rows, pair by pair (chosen rows then rejected rows of pair 0, then
    pair 1, ...), or None when that is every row in order; seq_rows (K,) int64 their sequences; chunks: a list of
    (first row, rows, first pair, pairs); counts: the answer tokens per sequence, (S,) int64 on the host, or None
    when the target is on the device (every row kept; the caller counts on the device)."""
    n_seqs, seq_len = target.shape
    on_host = _target_on_host(target)
    if on_host:
        kept = (target != ignore_index).numpy()  # (S, T)
        per_seq = kept.sum(1)  # (S,)
    else:
        kept = None
        per_seq = np.full(n_seqs, seq_len)
    per_pair = per_seq[:n_pairs] + per_seq[n_pairs:]  # (P,)
    n_kept = int(per_pair.sum())
    budget = _flce._chunk_rows(n_kept, hdim, vocab) if n_kept else 1
    chunks, first, row = [], 0, 0
    while first < n_pairs:  # greedy: whole pairs while the chunk stays within budget (at least one)
        last, size = first + 1, int(per_pair[first])
        while last < n_pairs and size + per_pair[last] <= budget:
            size += int(per_pair[last])
            last += 1
        chunks.append((row, size, first, last - first))
        row, first = row + size, last
    order = np.concatenate(
        [np.r_[first : first + n, n_pairs + first : n_pairs + first + n] for _, _, first, n in chunks]
    )
    flat = np.arange(n_seqs * seq_len).reshape(n_seqs, seq_len)[order]  # (S, T) in pair order
    rows = flat[kept[order]] if kept is not None else flat.reshape(-1)  # (K,)
    seq_rows = np.repeat(order, per_seq[order])  # (K,)
    if np.array_equal(rows, np.arange(n_seqs * seq_len)):
        rows = None
    counts = torch.from_numpy(per_seq.astype(np.int64)) if on_host else None
    return rows, torch.from_numpy(seq_rows), chunks, counts


def _to_device(t, dev):
    if t.device.type == "cpu" and dev.type == "cuda":  # from pageable memory a non_blocking copy would still wait
        t = t.pin_memory()
    return t.to(dev, non_blocking=True)


def _chunk_grad(logps_c, counts_c, ref_c, n_pairs, chosen_tokens, loss_args):
    """dL/dlogps_c (2 p_c,) of the batch loss L for one chunk's pairs (logps_c [chosen; rejected] of those pairs):
    the chunk's share of L, (1 / P) sum of its pair losses + a * its share of the NLL (module docstring)."""
    loss_type, beta, label_smoothing, rpo_alpha, simpo_gamma, cpo_alpha = loss_args
    with torch.enable_grad():
        lp = logps_c.detach().requires_grad_()
        share = (
            pair_losses(
                lp,
                counts_c,
                ref_c,
                loss_type=loss_type,
                beta=beta,
                label_smoothing=label_smoothing,
                simpo_gamma=simpo_gamma,
            ).sum()
            / n_pairs
        )
        weight = _nll_weight(loss_type, rpo_alpha, cpo_alpha)
        if weight is not None:
            share = share - weight * lp[: lp.shape[0] // 2].sum() / chosen_tokens
        return torch.autograd.grad(share, lp)[0]


def fused_linear_preference_loss_fwd(
    hidden,
    weight,
    target,
    bias,
    ref_logps,
    loss_args,
    *,
    ignore_index=-100,
    need_hidden=True,
    need_weight=True,
    need_bias=False,
    softcap=None,
):
    """Launcher on hidden (S, T, H), weight (V, H), bias (V,) or None, target (S, T) on hidden's device or the CPU,
    ref_logps (S,) or None, loss_args (loss_type, beta, label_smoothing, rpo_alpha, simpo_gamma, cpo_alpha); no
    autograd. The gradients asked for (need_hidden, need_weight, need_bias) are formed here (with `softcap` c, those
    of the logits c tanh(z / c)).

    Returns (loss (fp32 0-d), PreferenceLogps (S,), saved, plan): `fused_linear_cross_entropy_bwd(grad_loss, saved,
    plan)` gives the gradients times grad_loss. The matmuls run in hidden's dtype (weight and bias cast to it)."""
    n_seqs, seq_len, hdim = hidden.shape
    n_pairs, vocab, dev = n_seqs // 2, weight.shape[0], hidden.device
    rows, seq_rows, chunks, counts = _plan_chunks(target, ignore_index, n_pairs, hdim, vocab)
    on_host = counts is not None  # else every row is kept, ignored ones included
    hidden2d = hidden.reshape(-1, hdim)  # (N, H)
    target1d = target.reshape(-1)  # (N,)
    if rows is None:
        hidden_k, target_k = hidden2d, target1d.to(dev, non_blocking=True)
    else:
        rows_dev = _to_device(torch.from_numpy(rows), dev)  # (K,)
        hidden_k = hidden2d.index_select(0, rows_dev)  # (K, H)
        if on_host:
            target_k = _to_device(target1d.index_select(0, torch.from_numpy(rows)), dev)  # (K,)
        else:
            target_k = target1d.index_select(0, rows_dev)  # (K,)
    seq_k = _to_device(seq_rows, dev)  # (K,)
    counts = _to_device(counts, dev) if on_host else (target != ignore_index).sum(1)  # (S,)
    counts_f = counts.float()
    chosen_tokens = counts_f[:n_pairs].sum().clamp(min=1)
    ref = None if ref_logps is None else ref_logps.to(dev, torch.float32)
    n_kept = hidden_k.shape[0]
    weight_c = weight.to(hidden.dtype)
    bias_c = None if bias is None else bias.to(hidden.dtype)
    grad_hidden = torch.empty((n_kept, hdim), dtype=torch.float32, device=dev) if need_hidden else None  # (K, H)
    # (V, H): fp32 for an fp32 weight, else the weight's dtype (kernels/fused_linear_cross_entropy.py)
    grad_weight = _new_weight_grad(weight, n_kept) if need_weight else None
    grad_bias = torch.zeros(vocab, dtype=torch.float32, device=dev) if need_bias else None  # (V,)
    logps = torch.zeros(n_seqs, dtype=torch.float32, device=dev)  # (S,)
    grad_seq = torch.zeros(n_seqs, dtype=torch.float32, device=dev)  # (S,) dL/dlogps, filled chunk by chunk
    nll_rows = torch.empty(n_kept, dtype=torch.float32, device=dev)  # (K,)
    # softcapped logits are not linear in h: their row sums come from the cross-entropy kernel's first pass
    logit_sums = None if softcap is None else torch.zeros(n_kept, dtype=torch.float32, device=dev)  # (K,)
    for start, size, first, n in chunks:
        if size == 0:  # pairs without a kept row: their logps stay 0, and so does their gradient's reach
            continue
        seqs = torch.cat([torch.arange(first, first + n), torch.arange(n_pairs + first, n_pairs + first + n)])
        seqs = _to_device(seqs, dev)  # (2 p_c,)
        hidden_c = hidden_k.narrow(0, start, size)  # (C, H)
        target_c = target_k.narrow(0, start, size)  # (C,)
        seq_c = seq_k.narrow(0, start, size)  # (C,)
        nll_c = nll_rows.narrow(0, start, size)
        logits = _logits(hidden_c, weight_c, bias_c)  # (C, V)
        cross_entropy_fwd(
            logits,
            target_c,
            ignore_index=ignore_index,
            compute_grad=False,
            loss_out=nll_c,
            softcap=softcap,
            sums_out=None if logit_sums is None else logit_sums.narrow(0, start, size),
        )
        logps.index_add_(0, seq_c, nll_c, alpha=-1.0)
        ref_c = None if ref is None else ref.index_select(0, seqs)
        grad_c = _chunk_grad(
            logps.index_select(0, seqs), counts_f.index_select(0, seqs), ref_c, n_pairs, chosen_tokens, loss_args
        )  # (2 p_c,)
        grad_seq.index_copy_(0, seqs, grad_c)
        scale = grad_seq.index_select(0, seq_c).neg_()  # (C,): dlogp_t / dx_t = -(softmax - onehot)
        cross_entropy_fwd(
            logits,
            target_c,
            ignore_index=ignore_index,
            grad_scale=scale,
            grad_out=logits,
            loss_out=nll_c,
            softcap=softcap,
        )  # logits now holds dL/dlogits of the chunk
        _chunk_grads_(logits, hidden_c, weight_c, grad_hidden, grad_weight, grad_bias, start)
        del logits
    # mean over the vocabulary of row t's logits (kernels/fused_linear_preference.py)
    row_means = linear_row_means(hidden_k, weight, bias) if softcap is None else logit_sums / vocab  # (K,)
    if not on_host:
        row_means = row_means * (target_k != ignore_index)  # every row kept: the ignored ones add nothing
    mean_logits = _per_sequence(row_means, seq_k, n_seqs) / counts.clamp(min=1)  # (S,)
    out = PreferenceLogps(logps, counts, mean_logits)
    loss_type, beta, label_smoothing, rpo_alpha, simpo_gamma, cpo_alpha = loss_args
    loss, _ = preference_loss(
        out,
        ref,
        loss_type=loss_type,
        beta=beta,
        label_smoothing=label_smoothing,
        rpo_alpha=rpo_alpha,
        simpo_gamma=simpo_gamma,
        cpo_alpha=cpo_alpha,
    )
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
    rows_saved = None if rows is None else rows_dev
    saved = (rows_saved, None, None, None, None, None, None, None, grad_hidden, grad_weight, grad_bias)
    return loss, out, saved, plan


class FusedLinearPreferenceLossFunction(torch.autograd.Function):
    """Autograd wrapper around the launcher: the loss is differentiable (its gradients formed in forward), the
    per-sequence numbers are not."""

    @staticmethod
    def forward(ctx, hidden, weight, target, bias, ref_logps, loss_args, ignore_index, softcap):
        loss, out, saved, ctx.plan = fused_linear_preference_loss_fwd(
            hidden,
            weight,
            target,
            bias,
            ref_logps,
            loss_args,
            ignore_index=ignore_index,
            need_hidden=ctx.needs_input_grad[0],
            need_weight=ctx.needs_input_grad[1],
            need_bias=ctx.needs_input_grad[3],
            softcap=softcap,
        )
        ctx.hidden_shape = hidden.shape
        ctx.save_for_backward(*saved)
        ctx.mark_non_differentiable(*out)
        ctx.set_materialize_grads(False)  # no zero gradients for the per-sequence outputs; the loss's is used
        return (loss, *out)

    @staticmethod
    def backward(ctx, grad_loss, grad_logps, grad_counts, grad_mean_logits):
        # backward may run inside the caller's autocast region; the saved gradients are only scaled and cast
        with torch.autocast(grad_loss.device.type, enabled=False):
            grad_h, grad_w, grad_b = fused_linear_cross_entropy_bwd(grad_loss, ctx.saved_tensors, ctx.plan)
        grad_h = None if grad_h is None else grad_h.view(ctx.hidden_shape)
        return grad_h, grad_w, None, grad_b, None, None, None, None


def _check_args(hidden, weight, target, bias, ref_logps, loss_type, beta, label_smoothing, ignore_index, softcap):
    name = "fused_linear_preference_loss"
    if hidden.dim() != 3 or hidden.shape[0] % 2:
        raise ValueError(
            f"{name}: hidden must be (S, T, H) with S = 2P sequences [chosen; rejected], got {tuple(hidden.shape)}"
        )
    _check_lm_head_args(hidden, weight, target, bias, None, None, ignore_index, softcap)
    seqs = PreferenceLogps(torch.empty(hidden.shape[0], device="meta"), None, None)
    _check_loss_args(seqs, ref_logps, loss_type, beta, label_smoothing)


def fused_linear_preference_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    ref_logps: torch.Tensor | None = None,
    *,
    loss_type: str = "sigmoid",
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    rpo_alpha: float | None = None,
    simpo_gamma: float = 0.5,
    cpo_alpha: float = 1.0,
    ignore_index: int = -100,
    softcap: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(loss, metrics) of `preference_loss(fused_linear_preference(hidden, weight, target, bias, softcap=softcap),
    ref_logps, ...)`, with the gradient formed in one pass over the answer rows (module docstring).

    hidden (S, T, H), S = 2P sequences [chosen; rejected]; target (S, T), already shifted (ignore_index off the
    answers), on hidden's device or the CPU (a CPU target lets the op skip the prompt rows without a device sync);
    weight (V, H), bias (V,) or None; ref_logps (S,) the reference model's answer log-probs, None for none.
    The loss options and the metrics are `kernels.preference_loss`'s. Under no_grad (evaluation) it is that
    composition, forward only. Under autocast the matmuls run in the autocast dtype.
    """
    _check_args(hidden, weight, target, bias, ref_logps, loss_type, beta, label_smoothing, ignore_index, softcap)
    options = dict(
        loss_type=loss_type,
        beta=beta,
        label_smoothing=label_smoothing,
        rpo_alpha=rpo_alpha,
        simpo_gamma=simpo_gamma,
        cpo_alpha=cpo_alpha,
    )
    needs_grad = torch.is_grad_enabled() and (
        hidden.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    )
    if not use_triton(hidden, weight, bias):
        return fused_linear_preference_loss_ref(
            hidden, weight, target, bias, ref_logps, ignore_index=ignore_index, softcap=softcap, **options
        )
    if not needs_grad:
        policy = fused_linear_preference(hidden, weight, target, bias, ignore_index=ignore_index, softcap=softcap)
        return preference_loss(policy, ref_logps, **options)
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        # as F.linear under autocast: the matmuls in the autocast dtype; weight and bias are cast inside, so an fp32
        # weight's gradient is accumulated in fp32 (kernels/fused_linear_cross_entropy.py)
        hidden = hidden.to(torch.get_autocast_dtype(device_type))
    loss_args = (loss_type, float(beta), float(label_smoothing), rpo_alpha, float(simpo_gamma), float(cpo_alpha))
    with torch.autocast(device_type, enabled=False):
        loss, *seqs = FusedLinearPreferenceLossFunction.apply(
            hidden.contiguous(), weight, target, bias, ref_logps, loss_args, ignore_index, softcap
        )
    policy = PreferenceLogps(*seqs)
    nll = None
    if _nll_weight(loss_type, rpo_alpha, cpo_alpha) is not None:
        nll = -policy.logps[: hidden.shape[0] // 2].sum() / policy.counts[: hidden.shape[0] // 2].sum().clamp(min=1)
    return loss, preference_metrics(policy, ref_logps, nll, loss_type=loss_type, beta=beta)


def fused_linear_preference_loss_ref(
    hidden, weight, target, bias=None, ref_logps=None, *, ignore_index=-100, softcap=None, **loss_options
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The unfused reference: `fused_linear_preference_ref` (materialised logits) then `preference_loss`."""
    policy = fused_linear_preference_ref(
        hidden, weight, target.to(hidden.device, non_blocking=True), bias, ignore_index=ignore_index, softcap=softcap
    )
    return preference_loss(policy, ref_logps, **loss_options)
