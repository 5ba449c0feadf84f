"""Golden GRPO loss: ours (kernels.fused_linear_logprob + trainer.methods.grpo_loss) against trl.GRPOTrainer's
`_compute_loss` (issue 31 item 6).

TRL has no standalone loss function: as its own tests do, the trainer is built with object.__new__(GRPOTrainer), the
attributes `_compute_loss` reads are set (one process, training mode, accumulation 1), and its
`_get_per_token_logps_and_entropies` returns per-token log-probs and entropies computed with plain torch
(materialised fp32 logits / temperature, log_softmax) from the same hidden states and LM head, so that TRL's loss
backpropagates into them. Ours runs the Triton kernels through the interpreter over the whole (prompt + completion)
rows, the prompt and padding rows skipped on the host. The same completions, advantages (from rewards with a None),
old policy (num_iterations 2: a perturbed head, so ratios leave the clip range) and reference (beta > 0).
Tolerances: fp32 noise, rtol 1e-5 with atol 1e-6 on the loss and metrics, 1e-5 * max|grad| on the gradients (our
chunked matmuls sum in another order than F.linear).
"""

from __future__ import annotations

import importlib
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

import kernels
from kernels import fused_linear_logprob, fused_linear_logprob_ref
from trainer.methods.grpo_loss import (
    LOSS_TYPES,
    completion_length_metrics,
    fused_grpo_loss,
    grpo_advantages,
    grpo_loss,
    grpo_normalizer,
)

fl_mod = importlib.import_module("kernels.fused_linear_cross_entropy")
trl = pytest.importorskip("trl")
from trl import GRPOTrainer  # noqa: E402
from trl.trainer.utils import nanstd as trl_nanstd  # noqa: E402

B, P, T, H, V = 8, 3, 6, 16, 97  # 2 prompts x 4 generations, prompt 3, completions up to 6 tokens
NUM_GENERATIONS = 4
TEMPERATURE = 0.9


class OneProcess:
    """What _compute_loss asks of the accelerator, for one process."""

    num_processes = 1
    process_index = 0

    def gather(self, x):
        return x

    def reduce(self, x, reduction="sum"):
        return x

    def pad_across_processes(self, x, dim=0, pad_index=0):
        return x


def make_batch(seed=0):
    """Hidden states of prompt + completion rows, an LM head, an old and a reference head, completion tokens
    (lengths 1..6, one of 0), targets -100 off the completions, rewards with an unscorable row."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, P + T, H, generator=g)
    weight = torch.randn(V, H, generator=g) * 2.0 / H**0.5
    bias = torch.randn(V, generator=g) * 0.5
    old_weight = weight + 0.15 * torch.randn(V, H, generator=g)  # the policy before the first iteration's step
    ref_weight = weight + 0.1 * torch.randn(V, H, generator=g)
    lengths = torch.tensor([6, 5, 1, 6, 3, 0, 4, 2])
    completion_ids = torch.randint(0, V, (B, T), generator=g)
    completion_mask = (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).long()  # (B, T)
    target = torch.full((B, P + T), -100)
    # row P - 1 + t predicts completion token t (the shift)
    target[:, P - 1 : P - 1 + T] = torch.where(completion_mask.bool(), completion_ids, -100)
    rewards = torch.randn(B, 2, generator=g)
    rewards[3, 0] = float("nan")  # one reward function returned None
    rewards[6] = float("nan")  # every reward function returned None: unscorable
    return SimpleNamespace(
        hidden=hidden,
        weight=weight,
        bias=bias,
        old_weight=old_weight,
        ref_weight=ref_weight,
        lengths=lengths,
        completion_ids=completion_ids,
        completion_mask=completion_mask,
        target=target,
        rewards=rewards,
    )


def completion_rows(x):
    return x[:, P - 1 : P - 1 + T]  # (B, T) of a (B, P + T) tensor


def trl_loss(
    batch, advantages, old, ref, *, loss_type, level, beta, delta=None, eps_high=None, top_q=1.0, kl_correction=False
):
    """TRL's loss, the gradients of hidden, weight and bias, and its logged metrics."""
    h, w, b = (t.clone().requires_grad_() for t in (batch.hidden, batch.weight, batch.bias))
    out = fused_linear_logprob_ref(h, w, batch.target, b, temperature=TEMPERATURE, return_entropy=True)
    logps, entropies = completion_rows(out.logps), completion_rows(out.entropies)
    trainer = object.__new__(GRPOTrainer)
    trainer.args = SimpleNamespace(use_bias_correction_kl=kl_correction, delta=delta, steps_per_generation=1)
    trainer.loss_type = loss_type
    trainer.importance_sampling_level = level
    trainer.beta = beta
    trainer.epsilon_low = 0.2
    trainer.epsilon_high = 0.2 if eps_high is None else eps_high
    trainer.top_entropy_quantile = top_q
    trainer.off_policy_mask_threshold = None
    trainer.use_vllm = False
    trainer.vllm_importance_sampling_correction = False
    trainer.model = SimpleNamespace(training=True)
    trainer.current_gradient_accumulation_steps = 1
    trainer.max_completion_length = T
    trainer.accelerator = OneProcess()
    trainer._entropy_bonus_enabled = False
    trainer.aux_loss_enabled = False
    trainer._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    trainer._get_per_token_logps_and_entropies = lambda *args, **kwargs: (logps, entropies, None)
    inputs = {
        "prompt_ids": torch.zeros(B, P, dtype=torch.long),
        "prompt_mask": torch.ones(B, P, dtype=torch.long),
        "completion_ids": batch.completion_ids,
        "completion_mask": batch.completion_mask,
        "advantages": advantages,
        "num_items_in_batch": batch.completion_mask.sum(),
    }
    if old is not None:
        inputs["old_per_token_logps"] = old
    if beta != 0.0:
        inputs["ref_per_token_logps"] = ref
    loss = trainer._compute_loss(None, inputs)
    loss.backward()
    metrics = {k: v[0] for k, v in trainer._metrics["train"].items()}
    return loss.detach(), (h.grad, w.grad, b.grad), metrics


def our_loss(
    batch,
    advantages,
    old,
    ref,
    *,
    loss_type,
    level,
    beta,
    delta=None,
    eps_high=None,
    top_q=1.0,
    kl_correction=False,
    fused=False,
):
    """Our loss, gradients and metrics: fused_linear_logprob + grpo_loss, or (fused) fused_grpo_loss."""
    h, w, b = (t.clone().requires_grad_() for t in (batch.hidden, batch.weight, batch.bias))
    kw = dict(
        old_logps=old,
        ref_logps=ref if beta != 0.0 else None,
        loss_type=loss_type,
        beta=beta,
        epsilon=0.2,
        epsilon_high=eps_high,
        delta=delta,
        importance_sampling_level=level,
        top_entropy_quantile=top_q,
        use_bias_correction_kl=kl_correction,
        max_completion_length=T,
    )
    with kernels.backend("triton"):  # the kernels through the interpreter (trainer tests default to the reference)
        if fused:
            cols = slice(P - 1, P - 1 + T)
            loss, metrics = fused_grpo_loss(
                h, w, batch.target, advantages, batch.completion_mask, b, completion_columns=cols,
                temperature=TEMPERATURE, **kw,
            )  # fmt: skip
        else:
            out = fused_linear_logprob(h, w, batch.target, b, temperature=TEMPERATURE, return_entropy=True)
            loss, metrics = grpo_loss(
                completion_rows(out.logps),
                advantages,
                batch.completion_mask,
                entropies=completion_rows(out.entropies),
                **kw,
            )
    loss.backward()
    return loss.detach(), (h.grad, w.grad, b.grad), {k: v.item() for k, v in metrics.items()}


def head_logps(batch, weight):
    """A no-grad pass of another head (the old policy's, the reference's) through our op: (B, T)."""
    with torch.no_grad(), kernels.backend("triton"):
        out = fused_linear_logprob(batch.hidden, weight, batch.target, batch.bias, temperature=TEMPERATURE)
    return completion_rows(out.logps)


def compare(batch, fused=False, **kw):
    advantages, _ = grpo_advantages(batch.rewards, NUM_GENERATIONS, reward_weights=torch.tensor([1.0, 0.5]))
    old = head_logps(batch, batch.old_weight) if kw.pop("num_iterations") == 2 else None
    ref = head_logps(batch, batch.ref_weight)
    t_loss, t_grads, t_metrics = trl_loss(batch, advantages, old, ref, **kw)
    o_loss, o_grads, o_metrics = our_loss(batch, advantages, old, ref, fused=fused, **kw)
    torch.testing.assert_close(o_loss, t_loss, rtol=1e-5, atol=1e-6)
    for name, o, t in zip(("hidden", "weight", "bias"), o_grads, t_grads):
        assert t.abs().max() > 0, name
        torch.testing.assert_close(o, t, rtol=1e-5, atol=1e-5 * t.abs().max().item(), msg=name)
    assert o_metrics.keys() == t_metrics.keys()
    for name, t in t_metrics.items():
        assert o_metrics[name] == pytest.approx(t, rel=1e-5, abs=1e-6, nan_ok=True), name
    return t_metrics


def _golden_cases():
    """Every loss type x level x beta x num_iterations through the log-prob op; through the fused loss op the same
    matrix, of which CI runs the cases with both the KL term and clipping (beta 0.04, num_iterations 2) and the rest
    is marked slow (the fused op's arithmetic does not depend on beta or the iteration: its loss callable does)."""
    for loss_type in LOSS_TYPES:
        for level in ("token", "sequence"):
            for beta in (0.0, 0.04):
                for num_iterations in (1, 2):
                    yield pytest.param(loss_type, level, beta, num_iterations, "logprob")
                    full = beta == 0.04 and num_iterations == 2
                    marks = () if full else (pytest.mark.slow,)
                    yield pytest.param(loss_type, level, beta, num_iterations, "fused", marks=marks)


@pytest.mark.parametrize("loss_type, level, beta, num_iterations, path", list(_golden_cases()))
def test_loss_gradient_and_metrics_equal_trl(loss_type, level, beta, num_iterations, path, monkeypatch):
    # fused: fused_grpo_loss, the gradient formed in the forward, in chunks of whole completions (forced small)
    monkeypatch.setattr(fl_mod, "_chunk_rows", lambda n, h, v: 7)
    metrics = compare(
        make_batch(), fused=path == "fused", loss_type=loss_type, level=level, beta=beta, num_iterations=num_iterations
    )
    if num_iterations == 2 and loss_type != "cispo":  # the clipping is exercised, not only the identity ratio
        assert metrics["clip_ratio/region_mean"] > 0


@pytest.mark.parametrize(
    "kw",
    [
        dict(loss_type="dapo", delta=1.1, eps_high=0.28),  # two-sided clipping, DAPO's clip-higher
        dict(loss_type="grpo", top_q=0.5, beta=0.04),  # only the high-entropy half of the tokens
        dict(loss_type="cispo", eps_high=1.05),  # the importance weight's cap binds
        dict(loss_type="bnpo", level="sequence", delta=1.2, top_q=0.3),
        dict(loss_type="dr_grpo", beta=0.04, delta=1.1, kl_correction=True),  # the KL term weighted by the ratio
    ],
    ids=str,
)
@pytest.mark.parametrize("path", ("logprob", "fused"))
def test_options_equal_trl(kw, path):
    kw = dict(level="token", beta=0.0, num_iterations=2) | kw
    metrics = compare(make_batch(seed=1), fused=path == "fused", **kw)
    if kw["loss_type"] == "cispo":
        assert metrics["cispo_clip_ratio"] > 0


def trl_advantages(rewards_per_func, weights, num_generations, scale_rewards):
    """A transcription of TRL 1.16's `_generate_and_score_completions` advantage lines (sum_then_normalize; the
    method itself also generates), with TRL's own nanstd."""
    unscorable = torch.isnan(rewards_per_func).all(dim=1)
    rewards = (rewards_per_func * weights.unsqueeze(0)).nansum(dim=1)
    rewards[unscorable] = torch.nan
    mean_grouped = torch.nanmean(rewards.view(-1, num_generations), dim=1).repeat_interleave(num_generations, dim=0)
    if scale_rewards in ["group", "none"]:
        std = trl_nanstd(rewards.view(-1, num_generations), dim=1).repeat_interleave(num_generations, dim=0)
    else:
        std = trl_nanstd(rewards).expand_as(rewards)
    advantages = rewards - mean_grouped
    if scale_rewards != "none":
        advantages = advantages / (std + 1e-4)
    is_std_zero = torch.isclose(std, torch.zeros_like(std))
    advantages = torch.nan_to_num(advantages, nan=0.0)
    metrics = {
        "reward": torch.nanmean(rewards).item(),
        "reward_std": trl_nanstd(rewards).item(),
        "frac_reward_zero_std": is_std_zero.float().mean().item(),
    }
    for i in range(rewards_per_func.shape[1]):
        metrics[f"rewards/f{i}/mean"] = torch.nanmean(rewards_per_func[:, i]).item()
        metrics[f"rewards/f{i}/std"] = trl_nanstd(rewards_per_func[:, i]).item()
    return advantages, metrics


@pytest.mark.parametrize("scale_rewards", ("group", "batch", "none"))
def test_advantages_and_reward_metrics_equal_trl(scale_rewards):
    rewards = make_batch().rewards
    rewards[4:8, 0] = 1.0  # a group whose first reward is constant
    rewards[4:8, 1] = float("nan")  # ... and whose second returned None: zero std
    weights = torch.tensor([1.0, 0.5])
    ours, metrics = grpo_advantages(
        rewards, NUM_GENERATIONS, reward_weights=weights, scale_rewards=scale_rewards, reward_func_names=["f0", "f1"]
    )
    theirs, t_metrics = trl_advantages(rewards, weights, NUM_GENERATIONS, scale_rewards)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
    assert ours[6] == 0.0  # the unscorable completion
    assert metrics.keys() == t_metrics.keys()
    for name, t in t_metrics.items():
        assert metrics[name].item() == pytest.approx(t, rel=1e-6), name
    if scale_rewards != "batch":
        assert metrics["frac_reward_zero_std"].item() == 0.5


def test_completion_length_metrics():
    m = completion_length_metrics(make_batch().completion_mask.sum(1))
    assert {k: v.item() for k, v in m.items()} == {
        "completions/mean_length": 27 / 8,
        "completions/min_length": 0.0,
        "completions/max_length": 6.0,
    }


@pytest.mark.parametrize("path", ("logprob", "fused"))
@pytest.mark.parametrize("level", ("token", "sequence"))
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_one_micro_batch_of_8_equals_two_of_4(loss_type, level, path, monkeypatch):
    # with the window's normaliser the summed micro-batch losses are the whole batch's loss: the gradients agree to
    # fp32 noise (bnpo's micro batches hold 18 and 9 tokens here: TRL's mean of micro-batch means would differ).
    # logprob: the reference log-probs + grpo_loss; fused: fused_grpo_loss through the interpreter, chunks of 7 rows
    monkeypatch.setattr(fl_mod, "_chunk_rows", lambda n, h, v: 7)
    batch = make_batch(seed=2)
    advantages, _ = grpo_advantages(batch.rewards, NUM_GENERATIONS)
    old = head_logps(batch, batch.old_weight)
    ref = head_logps(batch, batch.ref_weight)
    kw = dict(
        loss_type=loss_type, importance_sampling_level=level, beta=0.04, max_completion_length=T, epsilon_high=0.28
    )
    norm = grpo_normalizer(loss_type, batch.completion_mask, T)

    def micro_loss(h, w, b, s, normalizer):
        if path == "fused":
            with kernels.backend("triton"):
                return fused_grpo_loss(
                    h[s], w, batch.target[s], advantages[s], batch.completion_mask[s], b,
                    completion_columns=slice(P - 1, P - 1 + T), temperature=TEMPERATURE, old_logps=old[s],
                    ref_logps=ref[s], normalizer=normalizer, **kw,
                )[0]  # fmt: skip
        out = fused_linear_logprob(h[s], w, batch.target[s], b, temperature=TEMPERATURE)
        return grpo_loss(
            completion_rows(out.logps),
            advantages[s],
            batch.completion_mask[s],
            old_logps=old[s],
            ref_logps=ref[s],
            normalizer=normalizer,
            **kw,
        )[0]

    grads = []
    for splits in ((slice(0, 8),), (slice(0, 4), slice(4, 8))):
        h, w, b = (t.clone().requires_grad_() for t in (batch.hidden, batch.weight, batch.bias))
        total = 0.0
        for s in splits:
            loss = micro_loss(h, w, b, s, norm)
            loss.backward()
            total += loss.item()
        grads.append((total, h.grad, w.grad, b.grad))
    (l1, *g1), (l2, *g2) = grads
    assert l1 == pytest.approx(l2, rel=1e-6, abs=1e-7)
    for name, a, c in zip(("hidden", "weight", "bias"), g1, g2):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6 * c.abs().max().item(), msg=name)
    # one micro batch: the window's normaliser is the default (TRL's single-batch loss)
    h, w, b = batch.hidden, batch.weight, batch.bias
    assert torch.equal(micro_loss(h, w, b, slice(0, 8), None), micro_loss(h, w, b, slice(0, 8), norm))


def test_bad_arguments():
    logps, mask, adv = torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2)
    with pytest.raises(ValueError, match="loss_type"):
        grpo_loss(logps, adv, mask, loss_type="ppo")
    with pytest.raises(ValueError, match="ref_logps"):
        grpo_loss(logps, adv, mask, beta=0.1)
    with pytest.raises(ValueError, match="max_completion_length"):
        grpo_loss(logps, adv, mask, loss_type="dr_grpo")
    with pytest.raises(ValueError, match="importance_sampling_level"):
        grpo_loss(logps, adv, mask, importance_sampling_level="batch")
    with pytest.raises(ValueError, match="advantages"):
        grpo_loss(logps, torch.zeros(3), mask)
    with pytest.raises(ValueError, match="scale_rewards"):
        grpo_advantages(torch.zeros(4, 1), 2, scale_rewards="max")


def test_fused_grpo_loss_does_not_sync_with_the_host(monkeypatch):
    # loss, gradient and metrics stay on the device (top_entropy_quantile < 1 would: its quantile, as TRL's)
    batch = make_batch(seed=3)
    advantages, _ = grpo_advantages(batch.rewards, NUM_GENERATIONS)
    old = head_logps(batch, batch.old_weight)
    ref = head_logps(batch, batch.ref_weight)
    h, w, b = (t.clone().requires_grad_() for t in (batch.hidden, batch.weight, batch.bias))

    def host_sync(*args, **kwargs):
        raise AssertionError("host synchronisation inside fused_grpo_loss")

    for name in ("item", "tolist", "__bool__", "__int__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, host_sync)
    with kernels.backend("triton"):
        loss, metrics = fused_grpo_loss(
            h, w, batch.target, advantages, batch.completion_mask, b, completion_columns=slice(P - 1, P - 1 + T),
            old_logps=old, ref_logps=ref, beta=0.04, loss_type="grpo", importance_sampling_level="sequence",
        )  # fmt: skip
        loss.backward()
    monkeypatch.undo()
    assert torch.isfinite(loss) and all(torch.isfinite(t.grad).all() for t in (h, w, b))
    assert {"kl", "entropy", "clip_ratio/region_mean"} <= metrics.keys()
