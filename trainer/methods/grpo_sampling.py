"""GRPO's generation: G sampled completions per prompt from our model with a KV cache (issue 31 item 3).

`sample_completions(model, prompts, G, max_completion_length, ...)` left-pads the distinct prompts, prefills each
once, repeats its KV cache G times (`KVCache.repeat_rows`: the G completions of a prompt share its prefill) and
decodes the B G rows together, one token per step, until every row has produced EOS or max_completion_length
tokens. It returns TRL's tensors (`GRPOTrainer._generate_and_score_completions`):
  completion_ids   (B G, L) the sampled tokens, pad_token_id after a row's EOS (L: the longest completion)
  completion_mask  (B G, L) 1 up to and including the first EOS, 0 after it
  truncated        (B G,)   no EOS within the completion (what mask_truncated_completions zeroes)
Row r is the (r mod G)-th completion of prompt r // G, as TRL repeats its prompts (RepeatSampler).

Sampling, TRL's semantics through transformers' `generate` (GenerationMixin._get_logits_processor in transformers
5.x), applied to the fp32 logits in transformers' order: repetition penalty (a logit l of a token already in the
row becomes l / p if l > 0 else l p), temperature (l / T), top_k (keep the logits at least the k-th largest,
ties kept), top_p (drop the smallest tokens whose cumulative probability stays <= 1 - top_p, the most likely
always kept), min_p (drop tokens whose probability is below min_p times the largest); then softmax and one draw.
Each is skipped at its neutral value (repetition_penalty 1, temperature 1, top_k 0, top_p 1, min_p None).
temperature 0 is greedy (argmax), which TRL does not allow; tests use it.

Randomness: the draw of completion token t of global completion index i is the inverse CDF of the processed
distribution at u = hash(seed, step, i, t) / 2**32 (a counter-based generator: an integer mixing function of the
four numbers, Chris Wellons' "lowbias32" kind with both multipliers below 2**31 so that int64 torch arithmetic never
overflows). A completion therefore depends only on its prompt, the model and (seed, step, i): splitting the same
prompts over processes or micro batches (each call passing its `first_completion_index`) gives the same completions
as one call, and CPU and CUDA draw the same u. (Only the logits themselves can differ in the last bits between
batch compositions, through matmul blocking and padding; a draw changes only if u falls within that noise of a
CDF boundary.) Probabilities below 2**-32 are drawn at 2**-32 resolution.

Deliberate differences from transformers' `generate` as TRL calls it:
- the repetition penalty counts the prompt's real tokens and the completion so far, not the left padding
  (transformers' counts the pad token, so there a row's distribution depends on the batch it was padded in;
  vLLM, TRL's other generation backend, counts no padding either);
- the random stream is per completion (above), not one torch generator over the batch, so samples equal
  transformers' in distribution, not token for token.

Test: `python -m pytest tests/trainer/methods/test_grpo_sampling.py -q`; bench: `python -m bench.bench_grpo_sampling`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trainer.coerce import ConfigError
from trainer.model.causal_lm import CausalLM

_M32 = 0xFFFFFFFF


@dataclass
class Completions:
    completion_ids: torch.Tensor  # (N, L) long, pad_token_id after EOS
    completion_mask: torch.Tensor  # (N, L) long, 1 up to and including the first EOS
    truncated: torch.Tensor  # (N,) bool, no EOS within the completion


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash on int64 tensors holding values in [0, 2**32): xor-shift, multiply, xor-shift, multiply,
    xor-shift (Wellons' hash-prospector form; multipliers < 2**31 keep every product below 2**63)."""
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & _M32
    return x ^ (x >> 15)


def _fold(h: torch.Tensor, word) -> torch.Tensor:
    return _mix32(((h ^ word) + 0x9E3779B9) & _M32)  # the golden-ratio offset keeps a zero word from being a no-op


def completion_keys(seed: int, step: int, index: torch.Tensor) -> torch.Tensor:
    """(N,) int64 hash state of (seed, step, global completion index), folded once per call."""
    h = torch.full_like(index, 0x9E3779B9)  # (N,) int64
    for word in (seed & _M32, (seed >> 32) & _M32, step & _M32, index & _M32, (index >> 32) & _M32):
        h = _fold(h, word)
    return h


def uniforms(seed: int, step: int, index: torch.Tensor, t: int, keys: torch.Tensor | None = None) -> torch.Tensor:
    """u in [0, 1) for each global completion index (N,) at completion position t: a pure function of the four
    (`keys`: their `completion_keys`, when already folded)."""
    keys = completion_keys(seed, step, index) if keys is None else keys
    return _fold(keys, t & _M32).double() / 2.0**32  # (N,) float64


def process_logits(
    logits: torch.Tensor,
    seen: torch.Tensor | None,
    *,
    temperature: float,
    top_p: float,
    top_k: int,
    min_p: float | None,
    repetition_penalty: float,
) -> torch.Tensor:
    """transformers' logits processors for sampling, in its order, on fp32 logits (N, V); -inf marks a dropped
    token. `seen` (N, V) bool: the tokens the repetition penalty applies to."""
    scores = logits.float()
    if repetition_penalty != 1.0 and seen is not None:
        penalised = torch.where(scores < 0, scores * repetition_penalty, scores / repetition_penalty)
        scores = torch.where(seen, penalised, scores)
    if temperature != 1.0:
        scores = scores / temperature
    if top_k:
        kth = torch.topk(scores, min(top_k, scores.shape[-1])).values[:, -1:]  # (N, 1)
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=False)  # (N, V) ascending
        drop = sorted_scores.softmax(-1).cumsum(-1) <= 1 - top_p
        drop[:, -1] = False  # the most likely token always stays
        scores = scores.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    if min_p is not None:
        probs = scores.softmax(-1)
        drop = probs < min_p * probs.amax(-1, keepdim=True)
        drop.scatter_(1, probs.argmax(-1, keepdim=True), False)
        scores = scores.masked_fill(drop, float("-inf"))
    return scores  # (N, V)


def draw(scores: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Token i with probability softmax(scores)_i by the inverse CDF at u (N,): the first token whose cumulative
    probability exceeds u times the total (a zero-probability token is never chosen)."""
    cdf = scores.softmax(-1).double().cumsum(-1)  # (N, V)
    token = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)  # (N, 1)
    return token.squeeze(1).clamp(max=scores.shape[-1] - 1)  # (N,)


def _check(prompts, num_generations, max_completion_length, temperature, top_p, top_k, min_p, repetition_penalty):
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ConfigError("sample_completions: every prompt needs at least one token")
    if num_generations < 1 or max_completion_length < 1:
        raise ConfigError(
            f"num_generations and max_completion_length must be >= 1, got {num_generations}, {max_completion_length}"
        )
    if temperature < 0 or not 0 < top_p <= 1 or top_k < 0 or repetition_penalty <= 0:
        raise ConfigError(
            f"sampling needs temperature >= 0, top_p in (0, 1], top_k >= 0 and repetition_penalty > 0, got "
            f"{temperature}, {top_p}, {top_k}, {repetition_penalty}"
        )
    if min_p is not None and not 0 <= min_p <= 1:
        raise ConfigError(f"min_p must be in [0, 1], got {min_p}")


@torch.no_grad()
def sample_completions(
    model: CausalLM,
    prompts: list[list[int]],
    num_generations: int,
    max_completion_length: int,
    *,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float | None = None,
    repetition_penalty: float = 1.0,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int = 0,
    seed: int = 0,
    step: int = 0,
    first_completion_index: int = 0,
) -> Completions:
    """num_generations completions of each prompt (token-id lists, any lengths), rows grouped by prompt; completion
    row r has global index first_completion_index + r (see the module docstring)."""
    _check(prompts, num_generations, max_completion_length, temperature, top_p, top_k, min_p, repetition_penalty)
    device = next(model.parameters()).device
    c, G = model.config, num_generations
    B, T = len(prompts), max(len(p) for p in prompts)
    ids = torch.full((B, T), pad_token_id, dtype=torch.long, device=device)
    real = torch.zeros(B, T, dtype=torch.bool, device=device)
    for b, p in enumerate(prompts):  # left padding, as TRL's prompts
        ids[b, T - len(p) :] = torch.as_tensor(p, dtype=torch.long, device=device)
        real[b, T - len(p) :] = True
    eos = None if eos_token_id is None else torch.tensor([eos_token_id]).flatten().to(device)
    cache = model.decode_cache(B, T + max_completion_length)
    if not bool(real.all()):
        cache.pad = (~real).sum(-1)  # (B,)
    N = B * G
    index = first_completion_index + torch.arange(N, device=device)  # (N,) global completion indices
    keys = completion_keys(seed, step, index)  # (N,)
    seen = None
    if repetition_penalty != 1.0:  # the real prompt tokens, then each sampled token
        seen = torch.zeros(B, c.vocab_size, dtype=torch.bool, device=device)
        seen.scatter_(1, torch.where(real, ids, ids[:, -1:]), True)  # padding re-marks the last real token
        seen = seen.repeat_interleave(G, 0)  # (N, V)
    was_training = model.training
    model.eval()
    try:
        logits = model.decode_step(ids, cache).repeat_interleave(G, 0)  # (N, V): one prefill per prompt
        cache.repeat_rows(G)
        tokens, done = [], torch.zeros(N, dtype=torch.bool, device=device)
        for t in range(max_completion_length):
            if temperature == 0:
                token = logits.argmax(-1)  # (N,)
            else:
                scores = process_logits(
                    logits,
                    seen,
                    temperature=temperature,
                    top_p=top_p,
                    top_k=top_k,
                    min_p=min_p,
                    repetition_penalty=repetition_penalty,
                )
                token = draw(scores, uniforms(seed, step, index, t, keys))  # (N,)
            token = torch.where(done, pad_token_id, token)
            tokens.append(token)
            if eos is not None:
                done = done | torch.isin(token, eos)
            if t + 1 == max_completion_length or bool(done.all()):
                break
            if seen is not None:
                seen.scatter_(1, token[:, None], True)
            logits = model.decode_step(token[:, None], cache)  # (N, V)
    finally:
        model.train(was_training)
    completion_ids = torch.stack(tokens, dim=1)  # (N, L)
    L = completion_ids.shape[1]
    is_eos = torch.isin(completion_ids, eos) if eos is not None else torch.zeros_like(completion_ids, dtype=torch.bool)
    has_eos = is_eos.any(1)  # (N,)
    # TRL: the mask runs up to and including the first EOS, over the whole row without one
    eos_idx = torch.where(has_eos, is_eos.int().argmax(1), L)  # (N,)
    completion_mask = (torch.arange(L, device=device)[None] <= eos_idx[:, None]).long()  # (N, L)
    return Completions(completion_ids, completion_mask, ~has_eos)
