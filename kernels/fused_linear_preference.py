"""Fused linear preference log-probs (DPO, IPO, ORPO, SimPO, ...) without materialising the (tokens, vocab) logits.

What it computes. A preference batch is S sequences (TRL's layout: [chosen; rejected], P pairs, S = 2P) whose
last hidden states are `hidden` and whose targets (already shifted: row t predicts target t) are ignore_index
off the answer. With logits x = hidden @ weight.T + bias, per sequence s:

    logps[s]       = sum_{t in s, y_t != ignore} log softmax(x_t)[y_t]          (fp32)
    counts[s]      = #{t in s : y_t != ignore}
    mean_logits[s] = sum_{t in s, y_t != ignore} mean_v x_{t,v} / max(counts[s], 1)

Every preference loss below is a function of these tiny (S,) tensors (and the reference model's logps), so
autograd differentiates the loss on them and hands this op the upstream gradient g = dL/dlogps (S,). With
dCE_t = softmax(x_t) - onehot(y_t) (the cross-entropy gradient), d logps[s] / d x_t = -dCE_t for t in s:

    dlogits_t = -g[seq(t)] * dCE_t        grad_hidden = dlogits @ weight     grad_weight = dlogits.T @ hidden
    grad_bias = sum_t dlogits_t

which is fused linear cross-entropy with reduction="none" and the per-row upstream gradient -g[seq(t)]. So this
op *is* kernels/fused_linear_cross_entropy.py (no kernel or chunk loop of its own): its forward
(`fused_linear_cross_entropy_fwd`, reduction "none": the per-row losses only, one matmul per token chunk, the
cross-entropy kernel without a gradient) gives nll_t = -logp_t, which `index_add_` sums by sequence; its backward
(`fused_linear_cross_entropy_bwd` with the per-row scale) does the gradient. Everything that file says holds
here: the ignored (prompt and padding) rows are gathered out on the host before any matmul when the target is on
the CPU (no device sync), chunks of C = max(ceil(K / ceil(V / H)), 2048) rows, an fp32 weight's gradient
accumulated in fp32 in the tensor autograd keeps, a bf16/fp16 weight's summed in fp32 per vocabulary slice (its
vocabulary pass), never a (rows, vocab) tensor beyond one chunk.

mean_logits needs no logits at all: mean_v (h . w_v + b_v) = h . mean_v(w_v) + mean(b), one (N, H) x (H, 2)
matmul with fp32 accumulation (the fp32 mean_v w_v as two parts in hidden's dtype, hi + lo) instead of a pass
over every chunk.
TRL's `logits/chosen` is the mean over all chosen answer tokens of the batch and the vocabulary:
sum_s mean_logits[s] * counts[s] / sum_s counts[s] over the chosen s (`preference_loss` does this).

FLOPs and bytes (K answer rows of N, H hidden, V vocabulary). Forward: 2 K H V (the logits), reading each
chunk's logits once in the cross-entropy kernel (s bytes each); the reference model's pass (under no_grad) is
this forward alone. Backward: the chunk logits again (2 K H V) turned into their gradient in place, grad_hidden
and grad_weight (4 K H V; for a bf16/fp16 weight the vocabulary pass recomputes the logits once more, 2 K H V).
So a policy step costs 8 K H V (10 K H V with a bf16 weight) against eager's 6 N H V over every row: below eager
when fewer than 3/4 of the rows are answer tokens (bf16 weight: 3/5). Why not liger's 6 K H V: liger computes
the loss's gradient inside the forward, chunk by chunk of whole pairs (the loss of a pair needs only that pair),
which needs the loss function inside the op; here the loss is plain torch on the (S,) outputs, so the gradient
of a row is known only in backward and its chunk's logits must be recomputed. Peak extra memory: as fused
linear cross-entropy's reduction="none" (a chunk of logits; the backward's fp32 grad_hidden of the K rows and
for a bf16/fp16 weight a vocabulary tile and its fp32 (Vs, H) accumulator), plus (N,) and (S,) vectors: at
Llama-3.2-1B's head (H 2048, V 128256, bf16) with 8 pairs of 1024 tokens, half prompt, 0.63 GB (forward 0.56 GB)
against eager's 25 GB, measured on meta tensors by tests/.

Loss functions (plain torch on the per-sequence tensors; TRL v0.24's formulas, sequences [chosen; rejected]):
  sigmoid   -logsigmoid(b d) (1 - ls) - logsigmoid(-b d) ls, d = (pi_c - pi_r) - (ref_c - ref_r); ls > 0 is
            conservative DPO (DPOTrainer.dpo_loss)
  ipo       (d - 1 / (2 b))^2 on length-averaged logps (policy and reference); rewards and logps metrics on
            the sums, as for the other types (TRL 1.x)
  hinge     relu(1 - b d)
  robust    (-logsigmoid(b d) (1 - ls) + logsigmoid(-b d) ls) / (1 - 2 ls)
  apo_zero  1 - sigmoid(b (pi_c - ref_c)) + sigmoid(b (pi_r - ref_r))
  orpo      nll - b logsigmoid(log_odds), log_odds = (a_c - a_r) - (log1p(-exp a_c) - log1p(-exp a_r)) on
            length-averaged logps a (ORPOTrainer.odds_ratio_loss); no reference
  simpo     -logsigmoid(b u) (1 - ls) - logsigmoid(-b u) ls, u = a_c - a_r - gamma / b (CPOTrainer, loss_type
            "simpo"), plus cpo_alpha * nll; no reference
  rpo_alpha (any DPO type) adds rpo_alpha * nll, nll = the chosen answer tokens' mean cross-entropy
            = -sum(chosen logps) / sum(chosen counts)
Rewards (metrics): b (pi - ref) for the DPO types (on the sums, ipo included), b a for orpo and simpo.

Test: `python -m pytest tests/kernels/test_fused_linear_preference.py -q` (Triton interpreter on CPU).
Bench: `python bench/bench_fused_linear_preference.py` (GPU), `--quick` for a CPU smoke run.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from ._dispatch import use_triton
from .cross_entropy import check_softcap, softcapped
from .fused_linear_cross_entropy import _mm_fp32, fused_linear_cross_entropy_bwd, fused_linear_cross_entropy_fwd

DPO_LOSS_TYPES = ("sigmoid", "ipo", "hinge", "robust", "apo_zero")
LOSS_TYPES = DPO_LOSS_TYPES + ("orpo", "simpo")


class PreferenceLogps(NamedTuple):
    """Per-sequence results of `fused_linear_preference`, each (S,)."""

    logps: torch.Tensor  # fp32 sum of the answer tokens' log-probabilities (differentiable)
    counts: torch.Tensor  # int64 answer tokens
    mean_logits: torch.Tensor  # fp32 mean over answer tokens and vocabulary of the logits (0 without answer tokens)


def _per_sequence(values, seq, n_seqs):
    """(S,) sums of the (R,) values by their (R,) sequence index."""
    return torch.zeros(n_seqs, dtype=values.dtype, device=values.device).index_add_(0, seq, values)


def fused_linear_preference_fwd(
    hidden,
    weight,
    target,
    seq,
    n_seqs,
    bias=None,
    *,
    ignore_index=-100,
    need_hidden=False,
    need_weight=False,
    need_bias=False,
    softcap=None,
):
    """Launcher on 2-D hidden (N, H), weight (V, H), bias (V,), target (N,) on hidden's device or the CPU and seq
    (N,) int64 on hidden's device (the sequence of each row, in [0, n_seqs)); no autograd.

    Returns (PreferenceLogps, saved, plan): `fused_linear_preference_bwd(grad_logps, seq, saved, plan)` gives the
    gradients of logps. The matmuls run in hidden's dtype (weight and bias are cast to it); with `softcap` c, of the
    logits c tanh(z / c)."""
    logit_sums = None if softcap is None else torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
    nll_rows, saved, plan = fused_linear_cross_entropy_fwd(
        hidden,
        weight,
        target,
        bias,
        ignore_index=ignore_index,
        reduction="none",
        need_hidden=need_hidden,
        need_weight=need_weight,
        need_bias=need_bias,
        out_dtype=torch.float32,
        softcap=softcap,
        sums_out=logit_sums,
    )  # (N,) fp32, 0 on ignored rows
    rows = saved[
        0
    ]  # fused_linear_cross_entropy_fwd saves the kept (answer) rows first: (K,) on hidden's device, or None
    seq_k = seq if rows is None else seq.index_select(0, rows)  # (K,)
    logps = _per_sequence(-nll_rows, seq, n_seqs)  # (S,)
    counts = _per_sequence(torch.ones_like(seq_k), seq_k, n_seqs)  # (S,)
    # mean over the vocabulary of row t's logits (module docstring)
    row_means = linear_row_means(hidden, weight, bias) if softcap is None else logit_sums / weight.shape[0]  # (N,)
    row_means = row_means if rows is None else row_means.index_select(0, rows)  # (K,)
    mean_logits = _per_sequence(row_means, seq_k, n_seqs) / counts.clamp(min=1)  # (S,)
    return PreferenceLogps(logps, counts, mean_logits), saved, plan


def linear_row_means(hidden, weight, bias):
    """(N,) fp32 mean over the vocabulary of each row's logits hidden @ weight.T + bias without them: h . mean_v w_v +
    mean_v b_v, the fp32 mean entering the matmul in hidden's dtype as a sum of two parts, hi + lo (rounded once to
    hidden's dtype it cost 2.6x PyTorch's own error in fp16, tests/, since the mean over V of the logits is far
    smaller than the logits). Softcapped logits are not linear in h: their means come from the cross-entropy
    kernel's row sums instead."""
    weight_mean = weight.mean(0, dtype=torch.float32)  # (H,)
    high = weight_mean.to(hidden.dtype)
    parts = torch.stack([high, (weight_mean - high.float()).to(hidden.dtype)], 1)  # (H, 2)
    row_means = _mm_fp32(
        hidden, parts, torch.empty((hidden.shape[0], 2), dtype=torch.float32, device=hidden.device), accumulate=False
    ).sum(1)  # (N,)
    return row_means if bias is None else row_means + bias.mean(dtype=torch.float32)


def fused_linear_preference_bwd(grad_logps, seq, saved, plan):
    """(grad_hidden, grad_weight, grad_bias) of sum(logps * grad_logps) (None where not needed): fused linear
    cross-entropy's reduction="none" backward with the per-row upstream gradient -grad_logps[seq(t)]."""
    grad_rows = grad_logps.float().neg().index_select(0, seq)  # (N,)
    return fused_linear_cross_entropy_bwd(grad_rows, saved, plan)


class FusedLinearPreferenceFunction(torch.autograd.Function):
    """Autograd wrapper around the launchers: logps is differentiable, counts and mean_logits are not."""

    @staticmethod
    def forward(ctx, hidden, weight, target, bias, seq, n_seqs, ignore_index, softcap):
        out, saved, ctx.plan = fused_linear_preference_fwd(
            hidden,
            weight,
            target,
            seq,
            n_seqs,
            bias,
            ignore_index=ignore_index,
            need_hidden=ctx.needs_input_grad[0],
            need_weight=ctx.needs_input_grad[1],
            need_bias=ctx.needs_input_grad[3],
            softcap=softcap,
        )
        ctx.save_for_backward(seq, *saved)
        ctx.mark_non_differentiable(out.counts, out.mean_logits)
        ctx.set_materialize_grads(False)  # no zero gradients for counts and mean_logits; logps is the only one used
        return tuple(out)

    @staticmethod
    def backward(ctx, grad_logps, grad_counts, grad_mean_logits):
        seq, *saved = ctx.saved_tensors
        # backward may run inside the caller's autocast region; our matmuls choose their own dtypes
        with torch.autocast(grad_logps.device.type, enabled=False):
            grad_h, grad_w, grad_b = fused_linear_preference_bwd(grad_logps, seq, saved, ctx.plan)
        return grad_h, grad_w, None, grad_b, None, None, None, None


def _check_args(hidden, weight, target, bias, sequence_ids, num_sequences, ignore_index, softcap=None):
    name = "fused_linear_preference"
    check_softcap(name, softcap)
    if weight.dim() != 2 or hidden.shape[-1:] != weight.shape[1:]:
        raise ValueError(
            f"{name}: weight must be (V, H) with H = hidden.shape[-1]; "
            f"got hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)}"
        )
    if sequence_ids is None:
        if hidden.dim() != 3:
            raise ValueError(
                f"{name}: hidden must be (S, T, H) (one row per sequence), or pass sequence_ids; "
                f"got {tuple(hidden.shape)}"
            )
        if num_sequences is not None:
            raise ValueError(
                f"{name}: num_sequences goes with sequence_ids (without them the sequences are hidden's rows)"
            )
    else:
        if tuple(sequence_ids.shape) != tuple(hidden.shape[:-1]) or sequence_ids.dtype not in (
            torch.int32,
            torch.int64,
        ):
            raise ValueError(
                f"{name}: sequence_ids must be int32/int64 of hidden's leading shape {tuple(hidden.shape[:-1])}, "
                f"got {sequence_ids.dtype} {tuple(sequence_ids.shape)}"
            )
        if not isinstance(num_sequences, int) or isinstance(num_sequences, bool) or num_sequences <= 0:
            raise ValueError(f"{name}: num_sequences={num_sequences!r} must be a positive int with sequence_ids")
    if tuple(target.shape) != tuple(hidden.shape[:-1]) or target.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"{name}: target must be int32/int64 of hidden's leading shape {tuple(hidden.shape[:-1])}, "
            f"got {target.dtype} {tuple(target.shape)}"
        )
    if target.device != hidden.device and target.device.type != "cpu":
        raise ValueError(f"{name}: target must be on hidden's device ({hidden.device}) or the CPU, got {target.device}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"{name}: bias must be (V,) = ({weight.shape[0]},), got {tuple(bias.shape)}")
    if not isinstance(ignore_index, int) or isinstance(ignore_index, bool):
        raise ValueError(f"{name}: ignore_index={ignore_index!r} must be an int")
    dtypes = {hidden.dtype, weight.dtype} | ({bias.dtype} if bias is not None else set())
    if not hidden.dtype.is_floating_point or (len(dtypes) != 1 and not torch.is_autocast_enabled(hidden.device.type)):
        raise ValueError(
            f"{name}: hidden, weight and bias must share one floating dtype, got hidden {hidden.dtype}, "
            f"weight {weight.dtype}, bias {None if bias is None else bias.dtype}"
        )


def _sequence_index(hidden, sequence_ids):
    """(N,) int64 sequence of every row of hidden.reshape(-1, H), on hidden's device: row // T for (S, T, H)."""
    dev = hidden.device
    if sequence_ids is None:
        return torch.arange(hidden.shape[0] * hidden.shape[1], device=dev) // hidden.shape[1]
    ids = sequence_ids.reshape(-1).long()
    if ids.device.type == "cpu" and dev.type == "cuda":  # from pageable memory a non_blocking copy would still wait
        ids = ids.pin_memory()
    return ids.to(dev, non_blocking=True)


def fused_linear_preference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    sequence_ids: torch.Tensor | None = None,
    num_sequences: int | None = None,
    softcap: float | None = None,
) -> PreferenceLogps:
    """Per-sequence answer log-probabilities of the LM head hidden @ weight.T + bias (with `softcap` c: of the logits
    c tanh(z / c), Gemma 2's), without the (tokens, vocab) logits.

    hidden (S, T, H): sequence s is hidden[s] (a padded batch, TRL's [chosen; rejected] order); or any (..., H)
    with `sequence_ids` (hidden's leading shape, ints in [0, num_sequences)) for a padding-free batch. target
    has hidden's leading shape, already shifted (row t's target is the token after t; ignore_index off the
    answer and on padding), on hidden's device or the CPU: a CPU target lets the op skip the ignored rows'
    matmuls without a device sync. weight (V, H) (the LM head), bias (V,) or None.
    Returns `PreferenceLogps(logps, counts, mean_logits)`, each (S,): logps fp32 and differentiable (backward
    through hidden, weight and bias), counts int64, mean_logits fp32. Under autocast the matmuls run in the
    autocast dtype. For the reference model call it under torch.no_grad(): the forward alone, nothing saved.
    """
    _check_args(hidden, weight, target, bias, sequence_ids, num_sequences, ignore_index, softcap)
    if not use_triton(hidden, weight, bias):
        return fused_linear_preference_ref(
            hidden,
            weight,
            target.to(hidden.device, non_blocking=True),
            bias,
            ignore_index=ignore_index,
            sequence_ids=sequence_ids,
            num_sequences=num_sequences,
            softcap=softcap,
        )
    n_seqs = hidden.shape[0] if sequence_ids is None else num_sequences
    seq = _sequence_index(hidden, sequence_ids)  # (N,)
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        # As F.linear under autocast: the matmuls in the autocast dtype; weight and bias are cast inside, so an
        # fp32 weight's gradient is accumulated in fp32 (kernels/fused_linear_cross_entropy.py)
        hidden = hidden.to(torch.get_autocast_dtype(device_type))
    hidden2d = hidden.reshape(-1, hidden.shape[-1]).contiguous()  # (N, H)
    target1d = target.reshape(-1)  # (N,)
    needs_grad = torch.is_grad_enabled() and (
        hidden.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    )
    with torch.autocast(device_type, enabled=False):
        if needs_grad:
            return PreferenceLogps(
                *FusedLinearPreferenceFunction.apply(
                    hidden2d, weight, target1d, bias, seq, n_seqs, ignore_index, softcap
                )
            )
        return fused_linear_preference_fwd(
            hidden2d, weight, target1d, seq, n_seqs, bias, ignore_index=ignore_index, softcap=softcap
        )[0]


def fused_linear_preference_ref(
    hidden, weight, target, bias=None, *, ignore_index=-100, sequence_ids=None, num_sequences=None, softcap=None
) -> PreferenceLogps:
    """The unfused reference: F.linear in the inputs' (or autocast) dtype, softcapped (with `softcap`), log_softmax and
    gather in fp32, sums by sequence."""
    logits = softcapped(F.linear(hidden, weight, bias).float(), softcap)  # (..., V)
    logits = logits.reshape(-1, logits.shape[-1])  # (N, V)
    t = target.reshape(-1)  # (N,)
    answer = t != ignore_index
    logp = logits.log_softmax(-1).gather(1, torch.where(answer, t, 0).long().unsqueeze(1)).squeeze(1)  # (N,)
    if sequence_ids is None:
        n_seqs = hidden.shape[0]
        seq = torch.arange(t.numel(), device=hidden.device) // hidden.shape[1]
    else:
        n_seqs, seq = num_sequences, sequence_ids.reshape(-1).long().to(hidden.device)
    logps = _per_sequence(torch.where(answer, logp, 0.0), seq, n_seqs)
    counts = _per_sequence(answer.long(), seq, n_seqs)
    mean_logits = _per_sequence(torch.where(answer, logits.detach().mean(-1), 0.0), seq, n_seqs) / counts.clamp(min=1)
    return PreferenceLogps(logps, counts, mean_logits)


# ---- the losses on the per-sequence tensors (TRL's formulas; module docstring) ---------------------------------


def dpo_losses(
    chosen_logps,
    rejected_logps,
    ref_chosen_logps,
    ref_rejected_logps,
    *,
    loss_type="sigmoid",
    beta=0.1,
    label_smoothing=0.0,
):
    """Per-pair DPO losses (P,) for loss_type in DPO_LOSS_TYPES (TRL DPOTrainer.dpo_loss); the logps as the loss uses
    them (length-averaged for ipo). A reference-free run passes zeros for the reference."""
    chosen_logratios = chosen_logps - ref_chosen_logps
    rejected_logratios = rejected_logps - ref_rejected_logps
    delta = chosen_logratios - rejected_logratios
    if loss_type == "sigmoid":
        return -F.logsigmoid(beta * delta) * (1 - label_smoothing) - F.logsigmoid(-beta * delta) * label_smoothing
    if loss_type == "ipo":
        return (delta - 1 / (2 * beta)) ** 2
    if loss_type == "hinge":
        return torch.relu(1 - beta * delta)
    if loss_type == "robust":
        return (-F.logsigmoid(beta * delta) * (1 - label_smoothing) + F.logsigmoid(-beta * delta) * label_smoothing) / (
            1 - 2 * label_smoothing
        )
    if loss_type == "apo_zero":
        return 1 - torch.sigmoid(beta * chosen_logratios) + torch.sigmoid(beta * rejected_logratios)
    raise ValueError(f"dpo_losses: loss_type={loss_type!r} is not one of {', '.join(DPO_LOSS_TYPES)}")


def orpo_losses(chosen_avg_logps, rejected_avg_logps, *, beta=0.1):
    """(losses (P,), log_odds (P,)): ORPO's odds-ratio term beta * logsigmoid(log_odds), which the loss subtracts from
    the NLL (TRL ORPOTrainer.odds_ratio_loss), on length-averaged logps."""
    log_odds = (chosen_avg_logps - rejected_avg_logps) - (
        torch.log1p(-torch.exp(chosen_avg_logps)) - torch.log1p(-torch.exp(rejected_avg_logps))
    )
    return beta * F.logsigmoid(log_odds), log_odds


def simpo_losses(chosen_avg_logps, rejected_avg_logps, *, beta=2.0, simpo_gamma=0.5, label_smoothing=0.0):
    """Per-pair SimPO losses (P,) on length-averaged logps (TRL CPOTrainer.cpo_loss, loss_type "simpo")."""
    u = chosen_avg_logps - rejected_avg_logps - simpo_gamma / beta
    return -F.logsigmoid(beta * u) * (1 - label_smoothing) - F.logsigmoid(-beta * u) * label_smoothing


def _check_loss_args(policy, ref_logps, loss_type, beta, label_smoothing):
    name = "preference_loss"
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"{name}: loss_type={loss_type!r} is not one of {', '.join(LOSS_TYPES)}")
    if not beta > 0:
        raise ValueError(f"{name}: beta={beta!r} must be > 0")
    if loss_type == "robust" and not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"{name}: label_smoothing={label_smoothing!r} must be in [0, 0.5) for loss_type 'robust'")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"{name}: label_smoothing={label_smoothing!r} must be in [0, 1]")
    if policy.logps.dim() != 1 or policy.logps.shape[0] % 2:
        raise ValueError(
            f"{name}: the per-sequence tensors must be (2P,) = [chosen; rejected], got {tuple(policy.logps.shape)}"
        )
    if ref_logps is not None and ref_logps.shape != policy.logps.shape:
        raise ValueError(
            f"{name}: ref_logps shape {tuple(ref_logps.shape)} != the policy's {tuple(policy.logps.shape)}"
        )


def preference_loss(
    policy: PreferenceLogps,
    ref_logps: torch.Tensor | None = None,
    *,
    loss_type: str = "sigmoid",
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    rpo_alpha: float | None = None,
    simpo_gamma: float = 0.5,
    cpo_alpha: float = 1.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(loss, metrics) of a batch of P pairs: the mean over pairs of the per-pair loss, plus the NLL terms.

    policy: `fused_linear_preference`'s output for the [chosen; rejected] sequences (2P,); ref_logps: the reference
    model's logps (2P,) (the same op under no_grad, or precomputed), None for reference-free (zeros; orpo and
    simpo take none). rpo_alpha (DPO types): + rpo_alpha * nll; simpo: + cpo_alpha * nll (TRL's CPOConfig
    default 1.0; the SimPO paper uses 0); orpo: nll - mean(beta * logsigmoid(log_odds)); nll is the mean
    cross-entropy over the chosen answer tokens. metrics: 0-d detached tensors with TRL's names (rewards/chosen,
    rewards/rejected, rewards/accuracies, rewards/margins, logps/chosen, logps/rejected, logits/chosen,
    logits/rejected; nll_loss when it is part of the loss; log_odds_ratio and log_odds_chosen for orpo).
    """
    _check_loss_args(policy, ref_logps, loss_type, beta, label_smoothing)
    n_pairs = policy.logps.shape[0] // 2
    counts = policy.counts.to(policy.logps.dtype)
    losses = pair_losses(
        policy.logps,
        counts,
        ref_logps,
        loss_type=loss_type,
        beta=beta,
        label_smoothing=label_smoothing,
        simpo_gamma=simpo_gamma,
    )
    nll_weight = _nll_weight(loss_type, rpo_alpha, cpo_alpha)
    loss = losses.mean()
    nll = None
    if nll_weight is not None:
        nll = -policy.logps[:n_pairs].sum() / counts[:n_pairs].sum().clamp(min=1)
        loss = loss + nll_weight * nll
    return loss, preference_metrics(policy, ref_logps, nll, loss_type=loss_type, beta=beta)


def _nll_weight(loss_type, rpo_alpha, cpo_alpha):
    """The weight of the chosen answers' mean NLL in the loss, or None when the loss has no NLL term."""
    if loss_type in DPO_LOSS_TYPES:
        return rpo_alpha
    return 1.0 if loss_type == "orpo" else cpo_alpha


def pair_losses(logps, counts, ref_logps, *, loss_type, beta, label_smoothing=0.0, simpo_gamma=0.5):
    """Per-pair losses (P,) of the [chosen; rejected] logps (2P,) (fp32 counts (2P,), the reference's (2P,) or None):
    the loss of a batch is their mean plus the NLL term (`preference_loss`). A pair's loss needs only that pair's
    numbers, which is what lets `kernels.fused_linear_preference_loss` form the gradient chunk by chunk of pairs."""
    n_pairs = logps.shape[0] // 2
    if loss_type in DPO_LOSS_TYPES:
        ref = torch.zeros_like(logps) if ref_logps is None else ref_logps.to(logps.dtype)
        # ipo's loss takes the log-ratios averaged over each answer's tokens (TRL); its metrics, like every other
        # type's, the sums (TRL 1.x; v0.24 logged the averages)
        scale = counts.clamp(min=1) if loss_type == "ipo" else 1.0
        return dpo_losses(
            *((logps / scale).chunk(2)),
            *((ref / scale).chunk(2)),
            loss_type=loss_type,
            beta=beta,
            label_smoothing=label_smoothing,
        )
    avg = logps / counts.clamp(min=1)
    if loss_type == "orpo":  # the loss is nll - mean(beta logsigmoid(log_odds))
        return -orpo_losses(avg[:n_pairs], avg[n_pairs:], beta=beta)[0]
    return simpo_losses(
        avg[:n_pairs], avg[n_pairs:], beta=beta, simpo_gamma=simpo_gamma, label_smoothing=label_smoothing
    )


@torch.no_grad()
def preference_metrics(policy, ref_logps, nll, *, loss_type, beta):
    """TRL's metrics of a batch (0-d detached tensors; `preference_loss`'s docstring); nll: the NLL term or None."""
    n_pairs = policy.logps.shape[0] // 2
    counts = policy.counts.to(policy.logps.dtype)
    chosen_counts, rejected_counts = counts[:n_pairs], counts[n_pairs:]
    metrics = {}
    if nll is not None:
        metrics["nll_loss"] = nll.detach()
    if loss_type in DPO_LOSS_TYPES:
        ref = torch.zeros_like(policy.logps) if ref_logps is None else ref_logps.to(policy.logps.dtype)
        logps = policy.logps.detach()
        rewards = beta * (logps - ref)
    else:
        logps = policy.logps.detach() / counts.clamp(min=1)
        rewards = beta * logps
        if loss_type == "orpo":
            log_odds = orpo_losses(logps[:n_pairs], logps[n_pairs:], beta=beta)[1]
            metrics["log_odds_ratio"] = F.logsigmoid(log_odds).mean()
            metrics["log_odds_chosen"] = log_odds.mean()
    chosen_rewards, rejected_rewards = rewards[:n_pairs], rewards[n_pairs:]
    logit_sums = policy.mean_logits * counts
    metrics.update(
        {
            "rewards/chosen": chosen_rewards.mean(),
            "rewards/rejected": rejected_rewards.mean(),
            "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean(),
            "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
            "logps/chosen": logps[:n_pairs].mean(),
            "logps/rejected": logps[n_pairs:].mean(),
            "logits/chosen": logit_sums[:n_pairs].sum() / chosen_counts.sum().clamp(min=1),
            "logits/rejected": logit_sums[n_pairs:].sum() / rejected_counts.sum().clamp(min=1),
        }
    )
    return metrics
