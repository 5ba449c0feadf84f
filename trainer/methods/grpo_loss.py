"""GRPO's advantages and loss (TRL 1.16's `GRPOTrainer`), as plain torch on per-token log-probs.

The per-token log-probs come from `kernels.fused_linear_logprob` (the LM head over the completion rows only, in
token chunks): the policy's with a gradient, the old policy's and the reference's under no_grad. Everything here
works on (B, T) completion tensors (B completions of a micro batch, T the longest completion, `completion_mask` 1
on completion tokens) and (B,) advantages.

Advantages (`grpo_advantages`, TRL's `_generate_and_score_completions` with multi_objective_aggregation
"sum_then_normalize"). rewards_per_func (B G, F): one column per reward function, NaN where a function returned
None; the G completions of a prompt are consecutive. r = nansum_f(w_f r_f) (a row whose every reward is NaN stays
NaN), A = r - nanmean_group(r), divided by (std + 1e-4) unless scale_rewards is "none", std = nanstd over the group
("group") or the whole batch ("batch"), unbiased; NaN advantages (unscorable rows) become 0.

Loss (`grpo_loss`, TRL's `_compute_loss`). With log-ratio d_t = logp_t - old_t (old = logp.detach() when there is
no old policy: num_iterations 1 and one optimizer step per generation) the importance weight is w = exp(d_t) per
token, or per sequence (GSPO) the exp of the mask-weighted mean of d over the completion, one weight broadcast over
its tokens. Per token:
  grpo, bnpo, dr_grpo, dapo  l_t = -min(w' A, clamp(w, 1 - eps, 1 + eps_high) A), w' = min(w, delta) when delta
                             is set (two-sided clipping), else w
  cispo                      l_t = -sg(min(w, eps_high)) A logp_t (sg: no gradient)
plus beta k3_t with k3_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1 (times w if use_bias_correction_kl) when
beta > 0; with top_entropy_quantile q < 1 only the tokens whose entropy is at least the (1 - q) quantile of the
micro batch's completion-token entropies keep their policy term (TRL's get_high_entropy_mask; the KL term stays).
The loss of a micro batch is a sum divided by a normaliser (the loss types differ in both):
  grpo      sum_b (sum_t l_bt m_bt / max(|m_b|, 1))    / normaliser, default B            (mean of sequence means)
  bnpo      sum_bt l_bt m_bt                           / normaliser, default sum(m)       (token mean)
  dr_grpo   sum_bt l_bt m_bt                           / normaliser, default B * max_completion_length
  dapo      sum_bt l_bt m_bt                           / normaliser, default sum(m)
  cispo     as dapo
With the defaults a single micro batch equals TRL's loss with gradient_accumulation_steps 1.

Accumulation: exact by construction, a difference from TRL on purpose. Pass the normaliser of the whole
accumulation window (`grpo_normalizer` over the window's completion mask: its completions for grpo, its completion
tokens for bnpo, its completions times max_completion_length for dr_grpo) and sum the micro batches' losses: the
gradient is then that of one batch holding the window, whatever its split (tests/: 8 x 1 equals 4 x 2). TRL
divides each micro batch's own mean by the accumulation steps instead: the same for grpo and dr_grpo always, for
bnpo only when the micro batches hold equal token counts. For dapo and cispo TRL already divides by a count that
does not depend on the split, the generation batch's completion tokens (num_items_in_batch, over ranks) times
gradient_accumulation_steps / steps_per_generation (the window's tokens when steps_per_generation equals the
accumulation steps, its default; with several steps per generation batch, its tokens shared out evenly over them):
trainer/methods/grpo.py passes that. With ranks, the normaliser is over all ranks and each rank's loss is
multiplied by the world size for the data-parallel mean (the caller's business, as for SFT).

Metrics (0-d detached tensors, no host sync, TRL's names and per-micro-batch values): kl (beta > 0), entropy (when
entropies are given), and for the clipped types clip_ratio/low_mean, clip_ratio/low_min, clip_ratio/high_mean,
clip_ratio/high_max, clip_ratio/region_mean; cispo_clip_ratio for cispo. Token-level means are weighted by the mask;
at sequence level (one weight per completion) they are means over completions. As TRL's, the clip ratios compare
the weight after the two-sided cap (delta) with the clip range. `grpo_advantages` returns reward,
reward_std, frac_reward_zero_std and rewards/<name>/mean|std; `completion_length_metrics` completions/mean_length,
min_length, max_length.

Not here (yet): TRL's sapo, luspo and vespo losses, the off-policy mask, vLLM importance-sampling correction, the
entropy bonus (entropy_coef: it needs the entropies' gradient, which the kernel does not give) and
multi_objective_aggregation "normalize_then_sum".

Fused path (`fused_grpo_loss`): the same loss with its gradient formed inside the LM-head op
(`kernels.fused_linear_logprob_loss`, chunks of whole completions), 6 K H V matmul FLOPs a policy step instead of
the 8 K H V (10 K H V with a bf16 weight) of `kernels.fused_linear_logprob` + autograd; the same numbers to fp32
noise (tests/).

Test: `python -m pytest tests/trainer/methods/test_golden_grpo.py -q` (against trl.GRPOTrainer._compute_loss).
"""

from __future__ import annotations

import torch

import kernels

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo")
CLIPPED_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
SCALE_REWARDS = ("group", "batch", "none")


def nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Unbiased standard deviation ignoring NaNs (TRL's trl.trainer.utils.nanstd), over `dim` or everything."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    count = (~torch.isnan(x)).sum(dim=dim) if dim is not None else (~torch.isnan(x)).sum()
    variance = torch.nanmean((x - mean) ** 2, dim=dim)
    return torch.sqrt(variance * count / (count - 1))


def grpo_advantages(
    rewards_per_func: torch.Tensor,
    num_generations: int,
    *,
    reward_weights: torch.Tensor | None = None,
    scale_rewards: str = "group",
    reward_func_names: list[str] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(advantages (B G,), metrics) of the (B G, F) reward matrix (NaN for a reward function's None), the G
    completions of each prompt consecutive; the module docstring has the formulas (TRL's sum_then_normalize)."""
    if rewards_per_func.dim() != 2 or rewards_per_func.shape[0] % num_generations:
        raise ValueError(
            f"grpo_advantages: rewards_per_func must be (B * {num_generations}, F), got {tuple(rewards_per_func.shape)}"
        )
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"grpo_advantages: scale_rewards={scale_rewards!r} is not one of {', '.join(SCALE_REWARDS)}")
    n_funcs = rewards_per_func.shape[1]
    weights = torch.ones(n_funcs) if reward_weights is None else torch.as_tensor(reward_weights, dtype=torch.float32)
    if weights.shape != (n_funcs,):
        raise ValueError(f"grpo_advantages: reward_weights must hold {n_funcs} weights, got {tuple(weights.shape)}")
    weights = weights.to(rewards_per_func.device, rewards_per_func.dtype)
    unscorable = torch.isnan(rewards_per_func).all(dim=1)  # (B G,)
    rewards = (rewards_per_func * weights.unsqueeze(0)).nansum(dim=1)  # (B G,)
    rewards = torch.where(unscorable, torch.nan, rewards)
    mean_grouped = torch.nanmean(rewards.view(-1, num_generations), dim=1).repeat_interleave(num_generations)
    if scale_rewards == "batch":
        std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    elif num_generations > 1:  # "group", and "none" for the zero-std metric
        std = nanstd(rewards.view(-1, num_generations), dim=1).repeat_interleave(num_generations)
    else:
        std = torch.zeros_like(rewards)
    advantages = rewards - mean_grouped
    if scale_rewards != "none":
        advantages = advantages / (std + 1e-4)
    advantages = torch.nan_to_num(advantages, nan=0.0)
    metrics = {}
    names = reward_func_names or [f"reward_{i}" for i in range(n_funcs)]
    for i, name in enumerate(names):
        metrics[f"rewards/{name}/mean"] = torch.nanmean(rewards_per_func[:, i])
        metrics[f"rewards/{name}/std"] = nanstd(rewards_per_func[:, i])
    metrics["reward"] = torch.nanmean(rewards)
    metrics["reward_std"] = nanstd(rewards)
    metrics["frac_reward_zero_std"] = torch.isclose(std, torch.zeros_like(std)).float().mean()
    return advantages, metrics


def completion_length_metrics(completion_lengths: torch.Tensor) -> dict[str, torch.Tensor]:
    """TRL's completions/mean_length, min_length, max_length of the (B,) completion lengths."""
    lengths = completion_lengths.float()
    return {
        "completions/mean_length": lengths.mean(),
        "completions/min_length": lengths.min(),
        "completions/max_length": lengths.max(),
    }


def grpo_normalizer(
    loss_type: str, completion_mask: torch.Tensor, max_completion_length: int | None = None
) -> torch.Tensor:
    """The denominator of `grpo_loss` for the completions of `completion_mask` (B, T): give it the whole
    accumulation window's mask for exact accumulation; a micro batch's own is `grpo_loss`'s default."""
    if loss_type == "grpo":
        return torch.tensor(float(completion_mask.shape[0]), device=completion_mask.device)
    if loss_type == "dr_grpo":
        if max_completion_length is None:
            raise ValueError("grpo_loss: loss_type 'dr_grpo' needs max_completion_length")
        return torch.tensor(float(completion_mask.shape[0] * max_completion_length), device=completion_mask.device)
    return completion_mask.sum().float().clamp(min=1.0)


def high_entropy_mask(entropies: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """(B, T) bool: completion tokens whose entropy is at least the `threshold` quantile of the completion tokens'
    entropies (TRL's get_high_entropy_mask on one rank)."""
    local = entropies[mask.bool()].float()
    if local.numel() == 0:
        return torch.zeros_like(entropies, dtype=torch.bool)
    cut = torch.quantile(local, threshold)
    return ((entropies * mask.float()) >= cut) & mask.bool()


def _check(loss_type, importance_sampling_level, beta, ref_logps, logps, completion_mask, advantages, top_q):
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"grpo_loss: loss_type={loss_type!r} is not one of {', '.join(LOSS_TYPES)}")
    if importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(
            f"grpo_loss: importance_sampling_level={importance_sampling_level!r} is not one of "
            f"{', '.join(IMPORTANCE_SAMPLING_LEVELS)}"
        )
    if beta != 0.0 and ref_logps is None:
        raise ValueError(f"grpo_loss: beta={beta} > 0 needs the reference's log-probs (ref_logps)")
    if logps.dim() != 2 or completion_mask.shape != logps.shape:
        raise ValueError(
            f"grpo_loss: logps and completion_mask must be (B, T) alike, got {tuple(logps.shape)} and "
            f"{tuple(completion_mask.shape)}"
        )
    if advantages.shape not in ((logps.shape[0],), tuple(logps.shape)):
        raise ValueError(f"grpo_loss: advantages must be (B,) or (B, T), got {tuple(advantages.shape)}")
    if not 0.0 < top_q <= 1.0:
        raise ValueError(f"grpo_loss: top_entropy_quantile={top_q!r} must be in (0, 1]")


def grpo_loss(
    logps: torch.Tensor,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    old_logps: torch.Tensor | None = None,
    ref_logps: torch.Tensor | None = None,
    entropies: torch.Tensor | None = None,
    loss_type: str = "dapo",
    beta: float = 0.0,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    delta: float | None = None,
    importance_sampling_level: str = "token",
    top_entropy_quantile: float = 1.0,
    use_bias_correction_kl: bool = False,
    max_completion_length: int | None = None,
    normalizer: torch.Tensor | float | None = None,
    entropy_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(loss, metrics) of a micro batch of B completions (the module docstring has the formulas).

    logps (B, T) fp32, differentiable: the policy's per-token log-probs; old_logps (B, T) the old policy's (None
    when the batch is trained on at once: logps.detach(), as TRL); ref_logps (B, T) the reference's (beta > 0);
    entropies (B, T) (for top_entropy_quantile and the entropy metric), advantages (B,) or (B, T), completion_mask
    (B, T) 0/1. epsilon, epsilon_high (default epsilon), delta: TRL's GRPOConfig names. normalizer: the
    denominator (`grpo_normalizer` of the accumulation window for exact accumulation), default the micro batch's
    own; max_completion_length is needed by dr_grpo's default. entropy_mask (B, T) bool: the top_entropy_quantile
    mask computed beforehand (`high_entropy_mask`; `fused_grpo_loss` passes it for each chunk of sequences).
    """
    top_q = top_entropy_quantile
    _check(loss_type, importance_sampling_level, beta, ref_logps, logps, completion_mask, advantages, top_q)
    eps_low = epsilon
    eps_high = epsilon if epsilon_high is None else epsilon_high
    mask = completion_mask.to(logps.dtype)  # (B, T)
    adv = advantages.to(logps.dtype)
    adv = adv.unsqueeze(1) if adv.dim() == 1 else adv  # (B, 1) or (B, T)
    old = logps.detach() if old_logps is None else old_logps
    log_ratio = logps - old  # (B, T)
    if importance_sampling_level == "token":
        log_weights = log_ratio
    else:  # GSPO: one weight per sequence, the exp of the mean log-ratio over its completion tokens
        log_weights = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)  # (B, 1)
    coef_1 = torch.exp(log_weights)

    if entropy_mask is None and top_q < 1.0:
        if entropies is None:
            raise ValueError("grpo_loss: top_entropy_quantile < 1 needs the entropies")
        entropy_mask = high_entropy_mask(entropies, completion_mask, 1 - top_q)

    if loss_type == "cispo":
        per_token = -torch.clamp(coef_1, max=eps_high).detach() * adv * logps
    else:
        coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
        # two-sided clipping; TRL's clip metrics below see the capped weight too (it reassigns coef_1)
        coef_1 = coef_1 if delta is None else torch.clamp(coef_1, max=delta)
        per_token = -torch.min(coef_1 * adv, coef_2 * adv)
    if entropy_mask is not None:
        per_token = per_token * entropy_mask
    per_token_kl = None
    if beta != 0.0:
        diff = ref_logps - logps
        per_token_kl = torch.exp(diff) - diff - 1  # k3
        if use_bias_correction_kl:
            per_token_kl = per_token_kl * torch.exp(log_weights)  # the uncapped weight, as TRL
        per_token = per_token + beta * per_token_kl

    if normalizer is None:
        normalizer = grpo_normalizer(loss_type, completion_mask, max_completion_length)
    if loss_type == "grpo":
        total = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).sum()
    else:
        total = (per_token * mask).sum()
    loss = total / normalizer
    return loss, grpo_metrics(coef_1, adv, mask, per_token_kl, entropies, loss_type, eps_low, eps_high)


@torch.no_grad()
def grpo_metrics(coef_1, adv, mask, per_token_kl, entropies, loss_type, eps_low, eps_high):
    """TRL's per-micro-batch metrics (`grpo_loss`'s docstring) as 0-d detached tensors."""

    def masked_mean(x):  # TRL's global_masked_mean on one rank
        if x.shape[1] == 1:  # sequence level: one value per completion
            return x.sum() / max(x.shape[0], 1)
        return (x * mask).sum() / mask.sum().clamp(min=1.0)

    def seq_mean(x):  # TRL's masked_seq_mean: NaN for a completion without tokens
        return x.squeeze(1) if x.shape[1] == 1 else (x * mask).sum(-1) / mask.sum(-1)

    metrics = {}
    if per_token_kl is not None:
        metrics["kl"] = masked_mean(per_token_kl.detach())
    if entropies is not None:
        metrics["entropy"] = masked_mean(entropies.detach())
    coef_1 = coef_1.detach()
    if loss_type in CLIPPED_LOSS_TYPES:
        low = ((coef_1 < 1 - eps_low) & (adv < 0)).float()
        high = ((coef_1 > 1 + eps_high) & (adv > 0)).float()
        region = torch.maximum(low, high)
        metrics["clip_ratio/low_mean"] = masked_mean(low)
        metrics["clip_ratio/high_mean"] = masked_mean(high)
        metrics["clip_ratio/region_mean"] = masked_mean(region)
        metrics["clip_ratio/low_min"] = _nanmin(seq_mean(low))
        metrics["clip_ratio/high_max"] = _nanmax(seq_mean(high))
    else:
        metrics["cispo_clip_ratio"] = masked_mean(((coef_1 > eps_high) & (adv > 0)).float())
    return metrics


def _nanmin(x):
    """TRL's nanmin: the minimum ignoring NaNs, NaN when all are (no host sync)."""
    return torch.where(torch.isnan(x).all(), torch.nan, torch.where(torch.isnan(x), torch.inf, x).min())


def _nanmax(x):
    """TRL's nanmax: the maximum ignoring NaNs, NaN when all are (no host sync)."""
    return torch.where(torch.isnan(x).all(), torch.nan, torch.where(torch.isnan(x), -torch.inf, x).max())


def fused_grpo_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    completion_columns: slice,
    temperature: float = 1.0,
    old_logps: torch.Tensor | None = None,
    ref_logps: torch.Tensor | None = None,
    loss_type: str = "dapo",
    top_entropy_quantile: float = 1.0,
    max_completion_length: int | None = None,
    normalizer: torch.Tensor | float | None = None,
    softcap: float | None = None,
    **options,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`grpo_loss` straight from the LM head's inputs, its gradient formed in the forward by
    `kernels.fused_linear_logprob_loss` (6 K H V matmul FLOPs a policy step, not 8 K H V; the same loss, gradients
    and metrics to fp32 noise).

    hidden (B, L, H), target (B, L) (ignore_index off the completions; a CPU target skips the prompt rows),
    weight (V, H), bias: the policy's LM head (its logits softcapped with `softcap`, Gemma 2's); completion_columns:
    the columns of the (B, L) rows that are the completion's T tokens (row t predicting completion token t);
    advantages, completion_mask, old_logps, ref_logps and the options as `grpo_loss`'s, on the (B, T) completion
    tokens. The normaliser (default the micro batch's)
    and the top_entropy_quantile mask (one no-grad pass over the head more, 2 K H V) are fixed before the chunks,
    since each chunk's loss must be its sequences' share of the batch loss.
    """
    cols = completion_columns
    if normalizer is None:
        normalizer = grpo_normalizer(loss_type, completion_mask, max_completion_length)
    entropy_mask = None
    if top_entropy_quantile < 1.0:
        with torch.no_grad():
            ent = kernels.fused_linear_logprob(
                hidden, weight, target, bias, temperature=temperature, return_entropy=True, softcap=softcap
            )
        entropy_mask = high_entropy_mask(ent.entropies[:, cols], completion_mask, 1 - top_entropy_quantile)
    kw = dict(loss_type=loss_type, max_completion_length=max_completion_length, normalizer=normalizer, **options)

    def rows(t, seqs):
        return None if t is None else t[seqs]

    def loss_fn(logps, entropies, seqs):  # the chunk's sequences' share of the batch loss
        return grpo_loss(
            logps[:, cols],
            advantages[seqs],
            completion_mask[seqs],
            old_logps=rows(old_logps, seqs),
            ref_logps=rows(ref_logps, seqs),
            entropy_mask=rows(entropy_mask, seqs),
            **kw,
        )[0]

    loss, out = kernels.fused_linear_logprob_loss(
        hidden, weight, target, loss_fn, bias, temperature=temperature, return_entropy=True, softcap=softcap
    )
    _, metrics = grpo_loss(
        out.logps[:, cols],
        advantages,
        completion_mask,
        old_logps=old_logps,
        ref_logps=ref_logps,
        entropies=out.entropies[:, cols],
        entropy_mask=entropy_mask,
        **kw,
    )
    return loss, metrics
