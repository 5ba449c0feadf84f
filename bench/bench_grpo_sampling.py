"""GRPO generation throughput: `trainer.methods.grpo_sampling.sample_completions` on our model against
transformers' `generate` on the same weights (issue 31 item 3's bench row).

Same work on both sides: B prompts of different lengths (left-padded), G completions each (ours: one prefill per
prompt and its KV cache repeated G times; transformers: `num_return_sequences=G`, which expands the prompts to B G
rows before its prefill), do_sample with the same temperature and top_p (top_k 0, TRL's default; no min_p, no
repetition penalty), EOS disabled so that both generate exactly max_new_tokens for every row. Tokens/s counts the
generated tokens, B G max_new_tokens, over the whole call (prefill included). The transformers model is
`LlamaForCausalLM.from_pretrained` of our model written with `save_pretrained` (fp32, sdpa attention, its default
dynamic cache); a greedy check first shows both decode the same tokens from those weights.

Models: `tiny` (the trainer preset: 0.77M parameters, vocab 320, the GRPO demo's model) and `small` (a Llama of
hidden 512, 8 layers, 8 heads / 4 KV heads, vocab 8192: 32M parameters), random init. One torch thread (on 2
shared cores 2 threads ran 4-5x slower, DESIGN.md), a warm-up call each, then --reps timed calls
alternating ours and transformers, medians.

    python -m bench.bench_grpo_sampling                # rows appended to bench/results/grpo_sampling.jsonl (+ .md)
    python -m bench.bench_grpo_sampling --quick        # smaller batch and length, no rows written
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
import transformers

from bench.common import env_info, write_rows
from trainer.build import build_preset, save_pretrained
from trainer.methods.grpo_sampling import sample_completions
from trainer.model.causal_lm import CausalLM, ModelConfig

SMALL = dict(
    vocab_size=8192,
    hidden_size=512,
    intermediate_size=1408,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=1024,
)


def build(name: str) -> CausalLM:
    if name == "tiny":
        return build_preset("tiny", seed=0, use_kernels=False)[0].eval()
    model = CausalLM(ModelConfig.from_hf(transformers.LlamaConfig(**SMALL).to_dict()), use_kernels=False)
    model.init_weights(seed=0)
    return model.eval()


def prompts_for(vocab: int, B: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = [12 + (7 * b) % 13 for b in range(B)]  # 12..24 tokens: left padding in the batch
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lengths]


def left_pad(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    T = max(map(len, prompts))
    ids = torch.zeros(len(prompts), T, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, T - len(p) :], mask[b, T - len(p) :] = torch.tensor(p), 1
    return ids, mask


def timed(fns, reps: int) -> list[list[float]]:
    """Seconds per call of each function, alternating them rep by rep (so that load from other work on a shared
    machine falls on both alike), after one warm-up call each."""
    for fn in fns:
        fn()
    times = [[] for _ in fns]
    for _ in range(reps):
        for fn, out in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return times


def run(name: str, B: int, G: int, new_tokens: int, reps: int, temperature: float, top_p: float) -> dict:
    ours = build(name)
    with tempfile.TemporaryDirectory() as tmp:
        save_pretrained(ours, tmp)
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32, attn_implementation="sdpa")
    hf.eval()
    prompts = prompts_for(ours.config.vocab_size, B)
    ids, mask = left_pad(prompts)

    def hf_generate(do_sample: bool, n: int, num_return_sequences: int):
        config = transformers.GenerationConfig(
            max_new_tokens=n,
            do_sample=do_sample,
            temperature=temperature if do_sample else None,
            top_p=top_p if do_sample else None,
            top_k=0 if do_sample else None,
            num_return_sequences=num_return_sequences,
            pad_token_id=0,
            eos_token_id=None,
            bos_token_id=None,
        )
        with torch.no_grad():
            return hf.generate(input_ids=ids, attention_mask=mask, generation_config=config)[:, ids.shape[1] :]

    greedy_ours = sample_completions(ours, prompts, 1, 8, temperature=0).completion_ids
    greedy_match = bool(torch.equal(greedy_ours, hf_generate(False, 8, 1)))

    def ours_call():
        out = sample_completions(ours, prompts, G, new_tokens, temperature=temperature, top_p=top_p, seed=0)
        assert out.completion_ids.shape == (B * G, new_tokens)

    def hf_call():
        out = hf_generate(True, new_tokens, G)
        assert out.shape == (B * G, new_tokens)

    tokens = B * G * new_tokens
    ours_all, hf_all = timed([ours_call, hf_call], reps)
    ours_s, hf_s = statistics.median(ours_all), statistics.median(hf_all)
    return {
        "model": name,
        "parameters": ours.num_parameters(),
        "prompts": B,
        "num_generations": G,
        "prompt_lengths": f"{min(map(len, prompts))}-{max(map(len, prompts))}",
        "max_new_tokens": new_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "greedy_match": greedy_match,
        "ours_tokens_per_s": round(tokens / ours_s, 1),
        "hf_tokens_per_s": round(tokens / hf_s, 1),
        "ratio": round(hf_s / ours_s, 3),
        "ours_s": [round(t, 4) for t in ours_all],
        "hf_s": [round(t, 4) for t in hf_all],
        "threads": torch.get_num_threads(),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="tiny,small")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--num_generations", type=int, default=8)
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--temperature", type=float, default=0.9)
    parser.add_argument("--top_p", type=float, default=0.95)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="2 prompts x 2 generations x 8 tokens, no rows written")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.quick:
        args.prompts, args.num_generations, args.max_new_tokens, args.reps = 2, 2, 8, 1
    env = env_info()
    rows = []
    for name in args.models.split(","):
        row = run(
            name, args.prompts, args.num_generations, args.max_new_tokens, args.reps, args.temperature, args.top_p
        )
        print(
            f"{name}: ours {row['ours_tokens_per_s']} tok/s, transformers {row['hf_tokens_per_s']} tok/s, "
            f"ratio {row['ratio']} (greedy match: {row['greedy_match']})",
            flush=True,
        )
        rows.append({"bench": "grpo_sampling", **row, **env})
    if not args.quick:
        print(write_rows("grpo_sampling", rows))


if __name__ == "__main__":
    main()
