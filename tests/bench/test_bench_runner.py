"""`python -m bench` (bench/__main__.py) and the end-to-end training benchmark's pieces (bench/bench_train.py).

The full training comparison runs subprocesses for minutes, so it is not run here; what is tested: the same data
and the same weights reach both trainers (HF's LlamaForCausalLM loaded from our save_pretrained gives our model's
held-out loss), the memory ladder's doubling + bisection and how it goes on past an OOM or a crashed rung, and the
CPU behaviour of liger and the memory cap. The DPO rows run for real at a tiny size (ours and trl.DPOTrainer, one
short repeat each, ~40 s): the same pairs in the same order reach the same held-out DPO loss in both.
"""

from __future__ import annotations

import json

import pytest
import torch

from bench import __main__ as runner
from bench import bench_train


def test_speedup_series_labels_and_filter():
    rows = [
        {"provider": "torch", "mode": "forward", "tokens": 8, "hidden": 64, "dtype": "bf16"},
        {
            "provider": "ours",
            "mode": "forward",
            "tokens": 8,
            "hidden": 64,
            "dtype": "bf16",
            "speedup_vs_torch": 2.0,
            "speedup_vs_liger": None,
        },
        {
            "provider": "ours",
            "mode": "full",
            "tokens": 8,
            "hidden": 64,
            "dtype": "bf16",
            "speedup_vs_torch": 1.5,
            "speedup_vs_liger": 0.5,
        },
    ]
    labels, series = runner.speedup_series(rows)
    assert labels == ["forward 8 64 bf16", "full 8 64 bf16"]
    assert series == {"liger": [None, 0.5], "torch": [2.0, 1.5]}
    # every row with speed-ups (adamw, neftune): baselines' own rows are dropped, our variants named
    rows = [
        {"impl": "torch_fused", "model": "m", "speedup_vs_torch_fused": 1.0},
        {"impl": "ours_a", "model": "m", "speedup_vs_torch_fused": 3.0},
        {"impl": "ours_b", "model": "m", "speedup_vs_torch_fused": 4.0},
    ]
    labels, series = runner.speedup_series(rows)
    assert labels == ["ours_a m", "ours_b m"] and series == {"torch_fused": [3.0, 4.0]}
    # one script benching two ops (bench_rms_norm --op rms_norm fused_add_rms_norm): the op names the shape
    rows = [
        {"op": op, "provider": "ours", "mode": "forward", "tokens": 8, "speedup_vs_torch": 2.0}
        for op in ("rms_norm", "fused_add_rms_norm")
    ]
    assert runner.speedup_series(rows)[0] == ["rms_norm forward 8", "fused_add_rms_norm forward 8"]


def test_python_m_bench_quick_writes_rows_tables_charts(tmp_path):
    assert runner.main(["--quick", "--out", str(tmp_path), "--only", "adamw"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "adamw.jsonl").read_text().splitlines()]
    assert rows and all(r["perf_figure"] is torch.cuda.is_available() for r in rows)
    assert all(r["device"] and r["date"] and r["git_sha"] and r["torch"] for r in rows)
    assert (tmp_path / "adamw.md").read_text().startswith("# adamw")
    assert (tmp_path / "adamw.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = (tmp_path / "summary.md").read_text()
    assert "## adamw" in text and "vs torch_fused_fp32" in text
    assert ("not performance figures" in text) is (not torch.cuda.is_available())


def test_bad_op_name_is_an_argparse_error():
    with pytest.raises(SystemExit):
        runner.main(["--only", "softmax"])


SPEC = {"seq_len": 32, "micro_batch": 2, "grad_accum": 2, "steps": 3, "data": "tasks", "vocab_size": 320, "seed": 0}


def test_both_trainers_get_the_same_dense_blocks():
    train, heldout = bench_train.blocks(SPEC)
    again, heldout2 = bench_train.blocks(SPEC)
    assert len(train) == 2 * 2 * 3 and heldout.shape == (bench_train.EVAL_BLOCKS, 32)
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(train, again))
    assert torch.equal(heldout, heldout2)
    batch = bench_train.collate(train[:2])
    assert batch["input_ids"].shape == (2, 32) and torch.equal(batch["labels"], batch["input_ids"])  # no padding
    assert not torch.equal(train[0]["input_ids"], train[1]["input_ids"])  # consecutive blocks of the stream


def test_hf_llama_loads_our_weights_and_gives_our_loss(tmp_path):
    from transformers import LlamaForCausalLM

    from trainer.build import load_pretrained

    config = bench_train.model_config("tiny")
    bench_train.write_model(config, seed=0, path=tmp_path / "m")
    ours = load_pretrained(tmp_path / "m", dtype=torch.float32)
    hf = LlamaForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32, attn_implementation="sdpa")
    _, heldout = bench_train.blocks(SPEC)
    a = bench_train.heldout_loss(ours, heldout[:2], torch.device("cpu"))
    b = bench_train.heldout_loss(hf, heldout[:2], torch.device("cpu"))
    assert abs(a - b) < 1e-4 * a, (a, b)
    assert 5.0 < a < 6.5  # random init over 320 ids: about ln(320) = 5.77


def test_memory_ladder_doubles_then_bisects(monkeypatch, tmp_path):
    probes = []

    def fake_worker(spec, timeout):  # 37 sequences fit; the ladder must find exactly that
        probes.append(spec["micro_batch"])
        assert spec["eval_loss"] is False and spec["steps"] == 2
        if spec["micro_batch"] <= 37:
            return {"status": "ok", "peak_memory_gb": spec["micro_batch"] / 10}
        return {"status": "oom", "reason": "test"}

    monkeypatch.setattr(bench_train, "run_worker", fake_worker)
    args = bench_train.parse_args(
        ["--quick", "--configs", "ours,hf", "--micro-batch", "1", "--ladder-max-micro-batch", "1024"]
    )
    rows = bench_train.memory_ladder(args, bench_train.model_config("tiny"), tmp_path, tmp_path, "micro_batch")
    ladders = [r for r in rows if r["bench"] == "train_memory"]
    assert [r["max_fit"] for r in ladders] == [37, 37] and [r["first_oom"] for r in ladders] == [38, 38]
    assert probes[:7] == [1, 2, 4, 8, 16, 32, 64] and len(probes) == 2 * 12
    assert ladders[0]["max_fit_vs_hf"] == 1.0 and ladders[0]["seq_len"] == args.seq_len
    rungs = [r for r in rows if r["bench"] == "train_memory_rung" and r["impl"] == "ours"]
    assert [r["status"] for r in rungs[:8]] == ["ok"] * 6 + ["oom", "oom"] and rungs[0]["peak_memory_gb"] == 0.1


def test_memory_ladder_goes_on_after_an_oom_or_an_error(monkeypatch, tmp_path):
    """An OOM ends a ladder's climb; a crashed rung ends that configuration's ladder with its reason; either way
    the next configuration still runs. A capped ladder says where it stopped; --ladder-bisect bounds the probes."""
    seen = []

    def fake_worker(spec, timeout):
        seen.append((spec["impl"], spec["seq_len"]))
        assert spec["micro_batch"] == 1
        if spec["impl"] == "ours":
            return {"status": "error", "reason": "boom"} if spec["seq_len"] == 128 else {"status": "ok"}
        return {"status": "ok"} if spec["seq_len"] <= 100 else {"status": "oom", "reason": "CUDA out of memory"}

    monkeypatch.setattr(bench_train, "run_worker", fake_worker)
    args = bench_train.parse_args(
        ["--quick", "--configs", "ours,hf", "--seq-len", "32", "--ladder-max-seq-len", "4096", "--ladder-bisect", "2"]
    )
    rows = bench_train.memory_ladder(args, bench_train.model_config("tiny"), tmp_path, tmp_path, "seq_len")
    ours, hf = (r for r in rows if r["bench"] == "train_memory")
    assert ours["status"] == "incomplete" and ours["max_fit"] == 64 and "error at seq_len=128: boom" in ours["stopped"]
    assert hf["status"] == "ok" and hf["max_fit"] == 96 and hf["first_oom"] == 112 and hf["probes"] == 5
    assert seen == [
        ("ours", 32),
        ("ours", 64),
        ("ours", 128),
        ("hf", 32),
        ("hf", 64),
        ("hf", 128),
        ("hf", 96),
        ("hf", 112),
    ]
    capped = bench_train.parse_args(
        ["--quick", "--configs", "ours", "--micro-batch", "1", "--ladder-max-micro-batch", "4"]
    )
    monkeypatch.setattr(bench_train, "run_worker", lambda spec, timeout: {"status": "ok"})
    (*_, summary) = bench_train.memory_ladder(
        capped, bench_train.model_config("tiny"), tmp_path, tmp_path, "micro_batch"
    )
    assert summary["max_fit"] == 4 and summary["capped_at"] == 4 and summary["first_oom"] is None


@pytest.mark.slow  # minutes on a 2-core CPU
def test_the_long_context_configs_run_a_rung_each(tmp_path):
    """ours_long (checkpointing + activation offloading + tiled MLP) and hf_ckpt (HF with checkpointing): the
    configurations the runbook's ladder call compares, one real rung each on the tiny model."""
    argv = ["--quick", "--configs", "ours_long,hf_ckpt", "--memory-ladder", "seq_len", "--micro-batch", "1"]
    rows = bench_train.main([*argv, "--seq-len", "16", "--ladder-max-seq-len", "16", "--out", str(tmp_path)])
    rungs = {r["impl"]: r for r in rows if r["bench"] == "train_memory_rung"}
    assert set(rungs) == {"ours_long", "hf_ckpt"} and all(r["status"] == "ok" for r in rungs.values())


@pytest.mark.slow  # 30-95 s on 2 shared cores: two trainings through the bench runner
def test_the_transformers_path_config_trains_the_same_model(tmp_path):
    """ours_tf: our Trainer over transformers' LlamaForCausalLM (the transformers path, our norms and loss inside)
    trains the same tiny model as ours, to the same held-out loss within the run's rounding."""
    argv = ["--quick", "--configs", "ours,ours_tf", "--steps", "3", "--warmup-steps", "1", "--repeats", "1"]
    rows = {r["impl"]: r for r in bench_train.main([*argv, "--out", str(tmp_path)])}
    assert rows["ours"]["status"] == rows["ours_tf"]["status"] == "ok"
    assert rows["ours_tf"]["final_loss"] == pytest.approx(rows["ours"]["final_loss"], rel=1e-4)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU behaviour")
def test_cpu_skips_liger_and_rejects_a_memory_cap():
    assert "CUDA only" in bench_train.skip_reason("hf_liger")
    assert bench_train.skip_reason("hf") is None
    with pytest.raises(SystemExit):
        bench_train.parse_args(["--max-memory-gb", "10"])
    with pytest.raises(SystemExit):
        bench_train.parse_args(["--memory-ladder", "vocab"])


def test_synthetic_pairs_are_seq_len_tokens_a_sequence(tmp_path):
    """--data synthetic DPO pairs: half prompt, half answer, each sequence exactly --seq-len tokens."""
    from trainer.data.preference_data import load_preference_dataset
    from trainer.data.tokenizer import byte_level_tokenizer

    spec = {**SPEC, "data": "synthetic", "seq_len": 96}
    train, held = bench_train.preference_pairs(spec)
    assert len(train) == 2 * 2 * 3 and len(held) == bench_train.EVAL_PAIRS
    assert bench_train.preference_pairs(spec) == (train, held)  # deterministic for the seed
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in train))
    pairs = load_preference_dataset([path], byte_level_tokenizer(), max_length=None, show_progress=False)
    for i in range(len(pairs)):
        pair = pairs[i]
        assert len(pair["prompt_ids"]) == 48 and len(pair["chosen_ids"]) == len(pair["rejected_ids"]) == 48


@pytest.mark.slow  # minutes on a 2-core CPU
def test_dpo_rows_run_ours_and_trl(tmp_path):
    """The DPO configurations through the bench's own workers (subprocesses) at a tiny size: ours
    (PreferenceTrainer) and trl.DPOTrainer train, are timed and evaluated; with liger on a CPU the row is skipped
    with its reason. Both with torch's AdamW: the held-out DPO loss after 3 steps is the same (measured 2e-8
    apart), so both did the same work on the same pairs."""
    pytest.importorskip("trl")
    rows = bench_train.main(
        [
            "--quick",
            "--configs",
            "ours_dpo,trl_dpo,trl_dpo_liger",
            "--steps",
            "3",
            "--warmup-steps",
            "1",
            "--repeats",
            "1",
            "--micro-batch",
            "2",
            "--grad-accum",
            "2",
            "--our-optim",
            "adamw_torch",
            "--hf-optim",
            "adamw_torch",
            "--out",
            str(tmp_path),
        ]
    )
    by = {r["impl"]: r for r in rows}
    assert set(by) == {"ours_dpo", "trl_dpo", "trl_dpo_liger"}
    if not torch.cuda.is_available():
        assert by["trl_dpo_liger"]["status"] == "skipped" and "CUDA only" in by["trl_dpo_liger"]["reason"]
    for impl in ("ours_dpo", "trl_dpo"):
        row = by[impl]
        assert row["status"] == "ok", row
        assert row["tokens_per_s"] > 0 and row["pairs_per_s"] > 0 and row["final_loss_kind"] == "heldout_dpo_loss"
        assert 0.5 < row["final_loss"] < 0.75  # near ln 2 = 0.693 after 3 steps from the reference
    ours = by["ours_dpo"]
    assert ours["baseline"] == "trl_dpo" and ours["tokens_per_s_vs_hf"] > 0
    assert ours["tokens_per_step_mean"] == by["trl_dpo"]["tokens_per_step_mean"]
    assert abs(ours["final_loss_minus_hf"]) < 1e-5
    assert (tmp_path / "train.jsonl").is_file()
