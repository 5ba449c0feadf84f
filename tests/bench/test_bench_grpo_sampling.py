"""bench/bench_grpo_sampling.py at its smallest (--quick, the tiny preset): both sides generate the full length
from the same weights (the greedy check matches) and a row carries the ratio; nothing is written."""

from __future__ import annotations

from bench import bench_grpo_sampling


def test_quick_row_on_the_tiny_preset():
    row = bench_grpo_sampling.run("tiny", B=2, G=2, new_tokens=4, reps=1, temperature=0.9, top_p=0.95)
    assert row["greedy_match"] and row["prompts"] == 2 and row["num_generations"] == 2
    assert row["ours_tokens_per_s"] > 0 and row["hf_tokens_per_s"] > 0 and row["ratio"] > 0
