"""Fused linear per-token log-probs (and entropies) of the completion tokens, without the (tokens, vocab) logits.

What it computes (GRPO and its kin: the policy's, the old policy's and the reference's per-token log-probs of the
sampled completion tokens). With hidden (N, H) the last hidden states, weight (V, H) the LM head, bias (V,) or None,
targets y (N,) already shifted (row t predicts y_t; ignore_index on prompt and padding rows) and a sampling
temperature T, the logits are x_t = (hidden_t @ weight.T + bias) / T (TRL divides the logits by the temperature
before the log-softmax) and, for every row with y_t != ignore_index,

    logps[t]     = log softmax(x_t)[y_t] = x_{t,y_t} - lse_t                      (fp32)
    entropies[t] = -sum_v p_{t,v} log p_{t,v} = lse_t - sum_v p_{t,v} x_{t,v}      (fp32, p_t = softmax(x_t))

and 0 on ignored rows. The temperature enters as hidden / T and bias / T (the same logits, up to the rounding of
hidden / T in hidden's dtype; autograd carries the 1/T into the gradients), so the op itself never sees it.
Softcapping (`softcap` c, Gemma 2's final logits c tanh(z / c), capped before TRL's division by T): the capped logits
over T are (c / T) tanh((z / T) / (c / T)), so the op caps hidden / T's logits at c / T, inside the cross-entropy
kernel (kernels/cross_entropy.py) and in the entropy pass.

Backward. logps[t] = -CE(x_t, y_t), so with an upstream gradient g_t = dL/dlogps[t] the logits' gradient is
dlogits_t = -g_t (softmax(x_t) - onehot(y_t)): fused linear cross-entropy with reduction="none" and the per-row
upstream gradient -g_t, as `kernels/fused_linear_preference.py` (per-sequence sums) uses it. So this op has no
kernel of its own. Its forward is a token-chunk loop (the chunk rule and host-side row skipping of
`kernels/fused_linear_cross_entropy.py`: the ignored rows gathered out on the host when the target is on the CPU,
no device sync; chunks of C = min(K, max(ceil(K / ceil(V / H)), 2048)) rows; never a (rows, vocab) tensor beyond
one chunk) calling the cross-entropy Triton kernel without a gradient for -logp and lse, and, when entropies are
asked for, a torch pass over the same chunk in fp32 by blocks of rows (two fp32 temporaries of at most 64 MiB each,
`ENTROPY_BLOCK_ELEMENTS`). Its backward is `fused_linear_cross_entropy_bwd` (recomputes each chunk's logits, turns
them into their gradient in place, fp32 accumulation; a bf16/fp16 weight's gradient summed in fp32 by its
vocabulary pass).

Entropies are not differentiable here (returned detached). TRL 1.16 computes them from the logits in a kernel that
can backpropagate through them, but uses that only for its optional entropy bonus (`entropy_coef`); for the loss
(top_entropy_quantile masking is a no-grad threshold) and the logged entropy no gradient is needed. The bonus would
need dlogits_t += g^H_t p_t (E_p[x_t] - x_t) / T in the backward's chunk loop: not in this op yet.

FLOPs (K completion rows of N, H hidden, V vocabulary; prompt and padding rows cost nothing when the target is on
the CPU). Forward: 2 K H V (the logits, once). Backward: 6 K H V (the logits recomputed, grad_hidden, grad_weight)
for an fp32 weight; 8 K H V for a bf16/fp16 weight (its vocabulary pass recomputes the logits once more). So a
policy step costs 8 K H V (10 K H V with a bf16 weight), not the 6 K H V of an op that forms the loss's gradient
inside the forward (kernels/fused_linear_logprob_loss.py, liger's chunked-loss design, which takes the loss as a
callable): here the loss is plain torch on the (N,) log-probs, so the gradient of a row is known only in backward
and its chunk's logits must be recomputed. The old policy's and the reference's passes (under no_grad) are the
forward alone: 2 K H V each, nothing saved. tests/ count all of this with FlopCounterMode.

Peak extra memory: fused linear cross-entropy's reduction="none" (one chunk of logits; the backward's fp32 (K, H)
grad_hidden and, for a bf16/fp16 weight, a vocabulary tile and its fp32 accumulator), the gathered (K, H) rows, the
entropy blocks, O(N) vectors: 0.69 GB for 16 completions of 512 tokens after 512-token prompts at Llama-3.2-1B's
head (H 2048, V 128256, bf16), eager 33.6 GB (measured on meta tensors by
tests/kernels/test_fused_linear_logprob_loss.py).

Test: `python -m pytest tests/kernels/test_fused_linear_logprob.py -q` (Triton interpreter on CPU).
"""

from __future__ import annotations

import importlib
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ._dispatch import use_triton
from .cross_entropy import check_softcap, cross_entropy_fwd, softcapped
from .fused_linear_cross_entropy import _logits, _Plan, _scatter_rows, fused_linear_cross_entropy_bwd

# the module (kernels.fused_linear_cross_entropy is the function: kernels/__init__.py): its chunk rule and row skipping
# are looked up when called, so that tests can force small chunks there once for every op built on it
_flce = importlib.import_module(".fused_linear_cross_entropy", __package__)
# Entropies are computed in torch over blocks of rows of a chunk's logits, each block's two fp32 (rows, V)
# temporaries at most this many elements (64 MiB): at Llama-3's V = 128256 a block of 130 rows, where a whole
# 2048-row chunk would have needed 2 x 1.05 GB beside its 0.53 GB of bf16 logits.
ENTROPY_BLOCK_ELEMENTS = 1 << 24


class TokenLogprobs(NamedTuple):
    """Per-token results of `fused_linear_logprob`, each shaped like the target; 0 on ignored rows."""

    logps: torch.Tensor  # fp32 log-probability of each target token (differentiable)
    entropies: torch.Tensor | None  # fp32 entropy of each row's distribution (detached), or None when not asked for


def fused_linear_logprob_fwd(
    hidden,
    weight,
    target,
    bias=None,
    *,
    ignore_index=-100,
    need_entropy=False,
    need_hidden=False,
    need_weight=False,
    need_bias=False,
    softcap=None,
):
    """Launcher on 2-D hidden (N, H), weight (V, H), bias (V,), target (N,) on hidden's device or the CPU; no autograd.

    Returns (logps (N,) fp32, entropies (N,) fp32 or None, saved, plan): `fused_linear_logprob_bwd(grad_logps,
    saved, plan)` gives the gradients of logps. The matmuls run in hidden's dtype (weight and bias cast to it); with
    `softcap` c the log-probs are those of c tanh(logits / c)."""
    n_rows, hdim = hidden.shape
    vocab = weight.shape[0]
    dev = hidden.device
    rows, hidden_k, target_k = _flce._skip_ignored(hidden, target, ignore_index)
    weight_c = weight.to(hidden.dtype)
    bias_c = None if bias is None else bias.to(hidden.dtype)
    n_kept = hidden_k.shape[0]
    nll = torch.empty(n_kept, dtype=torch.float32, device=dev)  # (K,)
    entropy = torch.empty(n_kept, dtype=torch.float32, device=dev) if need_entropy else None  # (K,)
    chunk = _flce._chunk_rows(n_kept, hdim, vocab) if n_kept else 1
    for start in range(0, n_kept, chunk):
        size = min(chunk, n_kept - start)
        target_c = target_k.narrow(0, start, size)  # (C,)
        logits = _logits(hidden_k.narrow(0, start, size), weight_c, bias_c)  # (C, V)
        lse = cross_entropy_fwd(
            logits,
            target_c,
            ignore_index=ignore_index,
            compute_grad=False,
            loss_out=nll.narrow(0, start, size),
            softcap=softcap,
        )[1]  # (C,) fp32
        if need_entropy:
            _entropy_rows(logits, lse, target_c, ignore_index, entropy.narrow(0, start, size), softcap)
        del logits  # before the next chunk's matmul: one chunk alive at a time
    logps = _scatter_rows(nll.neg_(), rows, n_rows)  # (N,), 0 on skipped rows
    entropies = None if entropy is None else _scatter_rows(entropy, rows, n_rows)
    plan = _Plan(
        "none",
        0.0,
        ignore_index,
        0.0,
        n_rows,
        hidden.dtype,
        need_hidden,
        need_weight,
        need_bias,
        weight.dtype,
        None if bias is None else bias.dtype,
        softcap,
    )
    # the layout fused_linear_cross_entropy_bwd reads for reduction="none": the rows, inputs and kept targets
    saved = (rows, hidden, weight, bias, target_k, None, None, None, None, None, None)
    return logps, entropies, saved, plan


def _entropy_rows(logits, lse, target, ignore_index, out, softcap=None):
    """out (C,) = lse - sum_v softmax(x)_v x_v per row of the chunk logits (C, V) (x softcapped with `softcap`), 0
    where target is ignore_index (rows kept only because the target is on the device; lse is not defined there). fp32
    math over blocks of rows, so that its two fp32 temporaries (three with a softcap) stay within
    ENTROPY_BLOCK_ELEMENTS each whatever the chunk."""
    n_rows, vocab = logits.shape
    block = max(1, ENTROPY_BLOCK_ELEMENTS // vocab)
    for start in range(0, n_rows, block):
        size = min(block, n_rows - start)
        x = softcapped(logits.narrow(0, start, size).float(), softcap)  # (Cb, V) fp32 (a view of fp32 logits: read)
        lse_b = lse.narrow(0, start, size)  # (Cb,)
        probs = (x - lse_b.unsqueeze(1)).exp_()  # (Cb, V)
        ent = lse_b - probs.mul_(x).sum(1)  # (Cb,); in place: linalg.vecdot would make a third (Cb, V) temporary
        out.narrow(0, start, size).copy_(torch.where(target.narrow(0, start, size) != ignore_index, ent, 0.0))
        del x, probs  # before the next block's: else three blocks are alive at once (measured on meta in tests/)


def fused_linear_logprob_bwd(grad_logps, saved, plan):
    """(grad_hidden, grad_weight, grad_bias) of sum(logps * grad_logps) (None where not needed): fused linear
    cross-entropy's reduction="none" backward with the per-row upstream gradient -grad_logps."""
    return fused_linear_cross_entropy_bwd(grad_logps.float().neg(), saved, plan)


class FusedLinearLogprobFunction(torch.autograd.Function):
    """Autograd wrapper around the launchers: logps is differentiable, entropies are not (module docstring)."""

    @staticmethod
    def forward(ctx, hidden, weight, target, bias, ignore_index, need_entropy, softcap):
        logps, entropies, saved, ctx.plan = fused_linear_logprob_fwd(
            hidden,
            weight,
            target,
            bias,
            ignore_index=ignore_index,
            need_entropy=need_entropy,
            need_hidden=ctx.needs_input_grad[0],
            need_weight=ctx.needs_input_grad[1],
            need_bias=ctx.needs_input_grad[3],
            softcap=softcap,
        )
        ctx.save_for_backward(*saved)
        if entropies is None:
            return logps
        ctx.mark_non_differentiable(entropies)
        return logps, entropies

    @staticmethod
    def backward(ctx, grad_logps, *grad_entropies):
        # backward may run inside the caller's autocast region; our matmuls choose their own dtypes
        with torch.autocast(grad_logps.device.type, enabled=False):
            grad_h, grad_w, grad_b = fused_linear_logprob_bwd(grad_logps, ctx.saved_tensors, ctx.plan)
        return grad_h, grad_w, None, grad_b, None, None, None


def _check_args(hidden, weight, target, bias, temperature, ignore_index, softcap=None, name="fused_linear_logprob"):
    if hidden.dim() < 2 or weight.dim() != 2 or hidden.shape[-1:] != weight.shape[1:]:
        raise ValueError(
            f"{name}: hidden must be (..., H) and weight (V, H); got hidden {tuple(hidden.shape)}, "
            f"weight {tuple(weight.shape)}"
        )
    if tuple(target.shape) != tuple(hidden.shape[:-1]) or target.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"{name}: target must be int32/int64 of hidden's leading shape {tuple(hidden.shape[:-1])}, "
            f"got {target.dtype} {tuple(target.shape)}"
        )
    if target.device != hidden.device and target.device.type != "cpu":
        raise ValueError(f"{name}: target must be on hidden's device ({hidden.device}) or the CPU, got {target.device}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"{name}: bias must be (V,) = ({weight.shape[0]},), got {tuple(bias.shape)}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0:
        raise ValueError(f"{name}: temperature={temperature!r} must be a number > 0")
    if not isinstance(ignore_index, int) or isinstance(ignore_index, bool):
        raise ValueError(f"{name}: ignore_index={ignore_index!r} must be an int")
    check_softcap(name, softcap)
    dtypes = {hidden.dtype, weight.dtype} | ({bias.dtype} if bias is not None else set())
    if not hidden.dtype.is_floating_point or (len(dtypes) != 1 and not torch.is_autocast_enabled(hidden.device.type)):
        raise ValueError(
            f"{name}: hidden, weight and bias must share one floating dtype, got hidden {hidden.dtype}, "
            f"weight {weight.dtype}, bias {None if bias is None else bias.dtype}"
        )


def scaled_softcap(softcap: float | None, temperature: float) -> float | None:
    """The cap of the temperature-scaled logits: c tanh(z / c) / T = (c / T) tanh((z / T) / (c / T))."""
    return None if softcap is None else softcap / temperature


def _scaled_inputs(hidden: torch.Tensor, bias: torch.Tensor | None, temperature: float):
    """(hidden, bias) as the fused ops feed them to the LM head: hidden in the autocast dtype when autocast is on (as
    F.linear would cast it; weight and bias are cast inside, so an fp32 weight's gradient is accumulated in fp32:
    kernels/fused_linear_cross_entropy.py), both divided by the temperature (logits / T without touching the
    (rows, V) logits)."""
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        hidden = hidden.to(torch.get_autocast_dtype(device_type))
    if temperature != 1:
        hidden = hidden / temperature  # (..., H)
        bias = None if bias is None else bias / temperature
    return hidden, bias


def fused_linear_logprob(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
    ignore_index: int = -100,
    return_entropy: bool = False,
    softcap: float | None = None,
) -> TokenLogprobs:
    """Per-token log-probabilities log softmax((hidden @ weight.T + bias) / temperature)[target] of the LM head,
    without the (tokens, vocab) logits (with `softcap` c: of c tanh(logits / c) / temperature).

    hidden (..., H), weight (V, H), bias (V,) or None; target hidden.shape[:-1], already shifted (row t's target is
    the token after t), ignore_index on prompt and padding rows, on hidden's device or the CPU: a CPU target lets
    the op skip the ignored rows' matmuls without a device sync. Returns `TokenLogprobs(logps, entropies)` shaped
    like target, fp32, 0 on ignored rows: logps differentiable (through hidden, weight and bias), entropies detached
    (None unless return_entropy). Under autocast the matmuls run in the autocast dtype. For the old policy's and
    the reference's log-probs call it under torch.no_grad(): the forward alone, nothing saved.
    """
    _check_args(hidden, weight, target, bias, temperature, ignore_index, softcap)
    if not use_triton(hidden, weight, bias):
        return fused_linear_logprob_ref(
            hidden,
            weight,
            target.to(hidden.device, non_blocking=True),
            bias,
            temperature=temperature,
            ignore_index=ignore_index,
            return_entropy=return_entropy,
            softcap=softcap,
        )
    device_type = hidden.device.type
    hidden, bias = _scaled_inputs(hidden, bias, temperature)
    cap = scaled_softcap(softcap, temperature)
    hidden2d = hidden.reshape(-1, hidden.shape[-1]).contiguous()  # (N, H)
    target1d = target.reshape(-1)  # (N,)
    needs_grad = torch.is_grad_enabled() and (
        hidden.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    )
    with torch.autocast(device_type, enabled=False):
        if needs_grad:
            out = FusedLinearLogprobFunction.apply(hidden2d, weight, target1d, bias, ignore_index, return_entropy, cap)
            logps, entropies = out if return_entropy else (out, None)
        else:
            logps, entropies, _, _ = fused_linear_logprob_fwd(
                hidden2d, weight, target1d, bias, ignore_index=ignore_index, need_entropy=return_entropy, softcap=cap
            )
    return TokenLogprobs(logps.reshape(target.shape), None if entropies is None else entropies.reshape(target.shape))


def fused_linear_logprob_ref(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
    ignore_index: int = -100,
    return_entropy: bool = False,
    softcap: float | None = None,
) -> TokenLogprobs:
    """The unfused reference: F.linear in the inputs' (or autocast) dtype, then fp32 log_softmax over the full
    (rows, V) logits (softcapped first with `softcap`) divided by the temperature, the target's entry gathered; 0 on
    ignored rows."""
    logits = softcapped(F.linear(hidden, weight, bias).float(), softcap) / temperature  # (..., V)
    log_probs = logits.log_softmax(-1)  # (..., V)
    kept = target != ignore_index
    logps = log_probs.gather(-1, torch.where(kept, target, 0).long().unsqueeze(-1)).squeeze(-1)
    logps = torch.where(kept, logps, 0.0)
    entropies = None
    if return_entropy:
        with torch.no_grad():
            entropies = torch.where(kept, -(log_probs.exp() * log_probs).sum(-1), 0.0)
    return TokenLogprobs(logps, entropies)
