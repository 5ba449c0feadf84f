"""GRPO's generation (trainer/methods/grpo_sampling.py): greedy equals `generate` per row (left-padded prompts of
different lengths, a sliding window), EOS and the completion mask, truncation flags, completions independent of
how the prompts are split over calls, the logits processors equal transformers', the whole sampler equals a
no-cache reference loop draw for draw, and the draws follow the processed distribution."""

from __future__ import annotations

import pytest
import torch

from trainer.coerce import ConfigError
from trainer.methods.grpo_sampling import draw, process_logits, sample_completions, uniforms
from trainer.model.causal_lm import CausalLM, ModelConfig, generate

transformers = pytest.importorskip("transformers")

V = 97
BASE = dict(
    vocab_size=V,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
PROMPTS = [[5, 17, 3, 88, 41, 9], [12, 7], [60, 2, 33, 71], [8]]  # lengths 6, 2, 4, 1: left padding in a batch


def tiny(arch="llama", seed=0):
    config = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen3_5_text": transformers.Qwen3_5TextConfig,
        "qwen3_next": transformers.Qwen3NextConfig,
    }[arch]
    hybrid = dict(
        layer_types=["linear_attention", "full_attention"],
        head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
    )
    kw = {
        "mistral": {"sliding_window": 3},  # a window shorter than prompt + completion
        # a Gated DeltaNet layer, then gated attention: the cache carries the recurrent and convolution states
        "qwen3_5_text": hybrid,
        # the same with Qwen3-Next's fused projections and routed experts beside a shared expert
        "qwen3_next": dict(
            **hybrid, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24
        ),
    }.get(arch, {})
    model = CausalLM(ModelConfig.from_hf(config(**BASE, **kw).to_dict()), use_kernels=False)
    model.init_weights(seed=seed)
    with torch.no_grad():  # std 0.1 instead of 0.02: peaked distributions, no near-ties in greedy decoding
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(5)
    return model


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3_5_text", "qwen3_next"])
def test_greedy_equals_generate_per_row_with_left_padding(arch):
    model = tiny(arch)
    out = sample_completions(model, PROMPTS, 2, 7, temperature=0)
    assert out.completion_ids.shape == (8, 7) and not out.completion_mask.eq(0).any() and out.truncated.all()
    for b, prompt in enumerate(PROMPTS):
        ref = generate(model, prompt, 7)
        assert out.completion_ids[2 * b].tolist() == ref and out.completion_ids[2 * b + 1].tolist() == ref
    assert model.training  # the caller's mode is restored


def test_eos_stops_a_row_and_the_mask_covers_it():
    model = tiny()
    greedy = [generate(model, p, 6) for p in PROMPTS]
    eos = greedy[0][2]  # row 0 stops at its third token; others wherever (if ever) they produce it
    out = sample_completions(model, PROMPTS, 1, 6, temperature=0, eos_token_id=eos, pad_token_id=0)
    for b, ref in enumerate(greedy):
        stop = ref.index(eos) + 1 if eos in ref else len(ref)
        row, mask = out.completion_ids[b].tolist(), out.completion_mask[b].tolist()
        L = len(row)
        assert row[:stop] == ref[:stop] and row[stop:] == [0] * (L - stop)  # pad after EOS
        assert mask == [1] * stop + [0] * (L - stop)  # up to and including EOS
        assert bool(out.truncated[b]) == (eos not in ref)
    assert not out.truncated[0]
    # every row stopped early: the completion is as long as the longest row, not max_completion_length
    unused = next(t for t in range(V) if t not in greedy[0])  # a second EOS id that never comes
    everyone = sample_completions(model, [PROMPTS[0]] * 2, 1, 6, temperature=0, eos_token_id=[unused, eos])
    stop = greedy[0].index(eos) + 1
    assert everyone.completion_ids.shape == (2, stop) and not everyone.truncated.any()


def test_completions_do_not_depend_on_the_split_over_calls():
    model = tiny()
    kw = dict(temperature=0.9, top_p=0.95, top_k=40, repetition_penalty=1.2, seed=3, step=7, eos_token_id=11)
    whole = sample_completions(model, PROMPTS, 3, 8, **kw)
    parts = [
        sample_completions(model, PROMPTS[:1], 3, 8, first_completion_index=0, **kw),
        sample_completions(model, PROMPTS[1:], 3, 8, first_completion_index=3, **kw),
    ]
    for part, rows in zip(parts, (slice(0, 3), slice(3, 12))):
        L = part.completion_ids.shape[1]
        assert torch.equal(part.completion_ids, whole.completion_ids[rows, :L])
        assert torch.equal(part.completion_mask, whole.completion_mask[rows, :L])
        assert torch.equal(part.truncated, whole.truncated[rows])
    again = sample_completions(model, PROMPTS, 3, 8, **kw)
    assert torch.equal(again.completion_ids, whole.completion_ids)
    other_step = sample_completions(model, PROMPTS, 3, 8, **{**kw, "step": 8})
    assert not torch.equal(other_step.completion_ids, whole.completion_ids)
    g = whole.completion_ids.view(4, 3, -1)
    assert not torch.equal(g[0, 0], g[0, 1])  # the G completions of a prompt differ


def test_top_k_1_is_greedy():
    model = tiny()
    greedy = sample_completions(model, PROMPTS, 2, 6, temperature=0)
    assert torch.equal(
        sample_completions(model, PROMPTS, 2, 6, temperature=0.7, top_k=1).completion_ids, greedy.completion_ids
    )


def test_logits_processors_equal_transformers():
    from transformers.generation import logits_process as lp

    g = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(6, V, generator=g)
    ids = torch.randint(0, V, (6, 5), generator=g)
    seen = torch.zeros(6, V, dtype=torch.bool).scatter_(1, ids, True)
    for kw in [
        dict(temperature=0.7, top_p=0.9, top_k=20, min_p=None, repetition_penalty=1.3),
        dict(temperature=1.3, top_p=1.0, top_k=0, min_p=0.05, repetition_penalty=1.0),
        dict(temperature=1.0, top_p=0.5, top_k=7, min_p=0.1, repetition_penalty=0.8),
    ]:
        procs = lp.LogitsProcessorList()
        if kw["repetition_penalty"] != 1.0:
            procs.append(lp.RepetitionPenaltyLogitsProcessor(kw["repetition_penalty"]))
        if kw["temperature"] != 1.0:
            procs.append(lp.TemperatureLogitsWarper(kw["temperature"]))
        if kw["top_k"]:
            procs.append(lp.TopKLogitsWarper(kw["top_k"]))
        if kw["top_p"] < 1.0:
            procs.append(lp.TopPLogitsWarper(kw["top_p"]))
        if kw["min_p"] is not None:
            procs.append(lp.MinPLogitsWarper(kw["min_p"]))
        ref = procs(ids, logits.clone())
        ours = process_logits(logits, seen, **kw)
        assert torch.equal(ours.isinf(), ref.isinf())
        torch.testing.assert_close(ours[~ours.isinf()], ref[~ref.isinf()], rtol=1e-6, atol=0)


@pytest.mark.parametrize("arch", ["llama", "qwen3_5_text", "qwen3_next"])
def test_sampler_equals_a_no_cache_reference_loop(arch):
    """Prefill sharing, KV cache repetition, padding and the repetition penalty change no draw: each completion
    equals the loop that recomputes its row's full forward each step and draws with the same u (Qwen3.5: the log-probs
    of the sampling pass, through the Gated DeltaNet's cached states, are those the training forward computes)."""
    model = tiny(arch).eval()
    kw = dict(temperature=0.8, top_p=0.9, top_k=30, min_p=0.02, repetition_penalty=1.5)
    out = sample_completions(model, PROMPTS, 2, 6, seed=5, step=2, first_completion_index=10, **kw)
    for r in range(8):
        ids = torch.tensor([PROMPTS[r // 2]])
        for t in range(6):
            logits = model(ids).logits[:, -1].float()  # (1, V)
            seen = torch.zeros(1, V, dtype=torch.bool).scatter_(1, ids, True)
            token = draw(process_logits(logits, seen, **kw), uniforms(5, 2, torch.tensor([10 + r]), t))
            ids = torch.cat([ids, token[:, None]], dim=1)
        assert out.completion_ids[r].tolist() == ids[0, -6:].tolist()


def test_draws_follow_the_processed_distribution():
    model = tiny(seed=1)
    n, kw = 6000, dict(temperature=1.5, top_p=0.9)
    out = sample_completions(model, PROMPTS[:1], n, 1, seed=0, **kw)  # n first tokens of one prompt
    probs = process_logits(
        model.eval()(torch.tensor(PROMPTS[:1])).logits[:, -1], None, top_k=0, min_p=None, repetition_penalty=1.0, **kw
    ).softmax(-1)[0]
    counts = torch.bincount(out.completion_ids[:, 0], minlength=V).double()
    assert counts[probs == 0].sum() == 0  # nothing outside the nucleus
    keep = probs > 0
    expected = n * probs[keep].double()
    chi2 = ((counts[keep] - expected) ** 2 / expected).sum().item()
    dof = int(keep.sum()) - 1
    assert chi2 < dof + 5 * (2 * dof) ** 0.5  # five standard deviations of chi-square(dof)
    u = uniforms(0, 0, torch.arange(20000), 3)
    assert 0 <= u.min() and u.max() < 1 and abs(u.mean().item() - 0.5) < 0.01 and abs(u.var().item() - 1 / 12) < 0.003


def test_bad_settings_are_one_line_config_errors():
    model = tiny()
    with pytest.raises(ConfigError, match="top_p in"):
        sample_completions(model, PROMPTS, 2, 4, top_p=0.0)
    with pytest.raises(ConfigError, match="at least one token"):
        sample_completions(model, [[1], []], 2, 4)
    with pytest.raises(ConfigError, match="min_p"):
        sample_completions(model, PROMPTS, 2, 4, min_p=1.5)
