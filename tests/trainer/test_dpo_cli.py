"""`python -m trainer.dpo` (trainer/dpo.py, the sft pipeline's stage dpo) as a user runs it: a short run on the
embedded pairs with its files and before/after figures, LlamaFactory's names, two FSDP2 processes equal to one,
streamed pairs equal to the pairs in memory, and bad input in one line, exit 2, nothing written."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.trainer.test_sft import _finish, _spawn_sft
from trainer.data.tasks import generate_tasks, preference_pair

ROOT = Path(__file__).resolve().parents[2]
FAST = [
    "--model",
    "tiny",
    "--max_steps",
    "2",
    "--per_device_train_batch_size",
    "4",
    "--cutoff_len",
    "64",
    "--disable_tqdm",
    "true",
    "--report_to",
    "jsonl",
    "--exact_match_examples",
    "0",
    "--plot",
    "false",
    "--logging_steps",
    "1",
]


def run(*args, module="trainer.dpo", timeout=900):
    """The command in a subprocess; the timeout guards against a hang only: the LlamaFactory run below takes 40 s of
    CPU and passed 300 s of wall time on a 2-core machine running two other test suites (2026-11-28)."""
    env = {**os.environ, "KERNELS_BACKEND": "reference"}
    return subprocess.run(
        [sys.executable, "-m", module, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_fsdp2_on_two_processes_matches_one_with_the_default_reference(tmp_path):
    """The default reference (a frozen copy of the model as given) under FSDP2 from the command line, whose model is
    built sharded and cannot be deep-copied: copied shard by shard (`trainer.build.frozen_copy`). Two gloo
    processes log the losses and reward margins of one process on the same global batch of 8 pairs and end with
    its weights, to fp32 noise."""
    i = FAST.index("--per_device_train_batch_size")
    fast = ["--stage", "dpo", *FAST[:i], *FAST[i + 2 :]]
    one = _spawn_sft([*fast, "--per_device_train_batch_size", "8", "--output_dir", str(tmp_path / "1")])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launch = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2"}
    argv = [*fast, "--per_device_train_batch_size", "4", "--output_dir", str(tmp_path / "2")]
    argv += ["--dist_config", '{"name": "fsdp2"}']
    two = [_spawn_sft(argv, **launch, RANK=str(r), LOCAL_RANK=str(r)) for r in (0, 1)]
    errs = _finish([one, *two])
    assert [p.returncode for p in (one, *two)] == [0, 0, 0], [e[-3000:] for e in errs]
    logs = [[json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()] for run in "12"]
    # a margin is beta x a difference of log-prob sums near -40 (fp32 ulp ~4e-6): ~1e-6 absolute noise
    for key, abs_tol in (("loss", 1e-7), ("rewards/margins", 2e-6)):
        values = [[row[key] for row in log if key in row] for log in logs]
        assert len(values[0]) == 2 and values[0] == pytest.approx(values[1], rel=1e-5, abs=abs_tol), key
    a, b = (load_file(tmp_path / run / "model.safetensors") for run in "12")
    for name in a:
        assert (a[name] - b[name]).abs().max() <= 1e-5 + 1e-5 * a[name].abs().max(), name


@pytest.mark.slow  # ~2 minutes here: the command also trains in the FSDP2 and DeepSpeed tests of this file
def test_a_short_run_on_the_embedded_pairs(tmp_path):
    out = tmp_path / "out"
    best = [
        "--eval_strategy",
        "steps",
        "--eval_steps",
        "2",
        "--save_steps",
        "2",
        "--metric_for_best_model",
        "rewards/accuracies",
    ]
    done = run(*FAST, "--output_dir", str(out), "--per_device_eval_batch_size", "50", *best)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "preference accuracy before training:" in done.stderr
    metrics = json.loads((out / "final_metrics.json").read_text())
    assert 0 <= metrics["preference_accuracy_before"] <= 1 and 0 <= metrics["preference_accuracy_after"] <= 1
    assert {"eval_rewards/accuracies", "eval_rewards/margins", "eval_logps/chosen"} <= set(metrics)
    saved = json.loads((out / "dpo_args.json").read_text())
    assert saved["stage"] == "dpo" and saved["beta"] == 0.1 and saved["loss_type"] == "sigmoid"
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert any("rewards/margins" in row for row in logged)
    state = json.loads(next(out.glob("checkpoint-*/trainer_state.json")).read_text())
    assert state["best_metric"] == metrics["eval_rewards/accuracies"]  # TRL's metric picks the best checkpoint
    again = run(*FAST, "--output_dir", str(out), "--per_device_eval_batch_size", "50", *best)  # the same: allowed
    assert again.returncode == 0, again.stderr[-2000:]


@pytest.mark.slow  # minutes on a loaded 2-core machine; LlamaFactory's names are mapped in tests/trainer/config
def test_llamafactory_yaml_runs_as_it_is(tmp_path):
    """LlamaFactory's names through trainer.sft, and a reference model given by name (built like the policy)."""
    config = tmp_path / "dpo.yaml"
    config.write_text(
        "stage: dpo\nmodel: tiny\nref_model: tiny\npref_beta: 0.2\npref_loss: ipo\npref_ftx: 0\n"
        "max_length: 64\n"
        f"output_dir: {tmp_path / 'out'}\nmax_steps: 1\nper_device_train_batch_size: 4\n"
        "exact_match_examples: 0\nplot: false\ndisable_tqdm: true\nreport_to: none\n"
    )
    done = run(str(config), module="trainer.sft")  # LlamaFactory's one command: the stage picks the trainer
    assert done.returncode == 0, done.stderr[-3000:]
    saved = json.loads((tmp_path / "out" / "dpo_args.json").read_text())
    assert (saved["beta"], saved["loss_type"], saved["cutoff_len"], saved["ref_model"]) == (0.2, "ipo", 64, "tiny")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--beta", "0"], "error: beta=0.0: must be > 0"),
        (["--loss_type", "kto_pair"], "loss_type"),
        (["--train_on_prompt", "true"], "error: train_on_prompt: stage dpo trains on the answers of preference pairs"),
        (["--batching_strategy", "padding_free"], "stage dpo batches pairs with batching_strategy='normal' only"),
        (["--data_format", "messages"], "data_format='messages': stage dpo reads preference pairs"),
        (["--streaming", "true"], "streaming: the embedded demo's pairs are made in memory from its tasks"),
        (
            ["--metric_for_best_model", "perplexity", "--eval_strategy", "steps"],
            "metric_for_best_model='perplexity': the evaluation reports loss, runtime, samples_per_second, "
            "rewards/chosen",
        ),
    ],
)
def test_bad_dpo_arguments_are_one_line(tmp_path, args, message):
    out = tmp_path / "out"
    done = run(*FAST, "--output_dir", str(out), *args)
    assert done.returncode == 2, done.stderr[-2000:]
    assert message in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not out.exists()


@pytest.mark.slow  # minutes on a 2-core CPU
def test_sft_data_given_to_dpo_and_dpo_options_given_to_sft(tmp_path):
    data = tmp_path / "sft.jsonl"
    data.write_text(
        json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}) + "\n"
    )
    done = run(*FAST, "--output_dir", str(tmp_path / "a"), "--data", str(data))
    assert done.returncode == 2 and f"{data}:1: cannot tell the data format from the keys ['messages']" in done.stderr
    done = run(*FAST, "--output_dir", str(tmp_path / "b"), "--beta", "0.3", module="trainer.sft")
    assert done.returncode == 2 and "beta: preference options, but stage is sft" in done.stderr


@pytest.mark.slow  # minutes on a 2-core CPU
def test_streamed_pairs_train_as_the_pairs_in_memory_and_resume(tmp_path):
    """`--streaming` on two JSONL files of 6 pairs each, one buffer of 12 pairs, 3 passes over 9 steps of 4 pairs:
    the losses, reward margins and weights of the same run on the pairs in memory, bit for bit; a run resumed from
    the streamed run's checkpoint-5 (inside the second pass) ends with its weights; a precomputed reference is one
    line."""
    data = tmp_path / "pairs"
    data.mkdir()
    pairs = [preference_pair(ex) for ex in generate_tasks(12, seed=5)]
    for s in range(2):
        (data / f"part-{s}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in pairs[s::2]))
    i = FAST.index("--max_steps")
    fast = [*FAST[:i], *FAST[i + 2 :], "--max_steps", "9", "--data", str(data), "--packing_buffer", "12"]
    fast += ["--save_steps", "5"]
    memory, stream, resumed = tmp_path / "memory", tmp_path / "stream", tmp_path / "resumed"
    procs = [
        _spawn_sft(["--stage", "dpo", *fast, "--output_dir", str(memory)]),
        _spawn_sft(["--stage", "dpo", *fast, "--streaming", "--output_dir", str(stream)]),
    ]
    errs = _finish(procs)
    assert [p.returncode for p in procs] == [0, 0], [e[-3000:] for e in errs]
    assert "train data: preference data: 12 pairs" in errs[0] and "train data: streamed from" in errs[1]

    def logged(out):
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        return [(r["step"], r["loss"], r["rewards/margins"]) for r in rows if "loss" in r]

    assert len(logged(stream)) == 9 and logged(stream) == logged(memory)
    a, b = load_file(memory / "model.safetensors"), load_file(stream / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    state = json.loads((stream / "checkpoint-5" / "data_state.json").read_text())
    assert state["streaming"] and state["buffer_start"]["pass"] == 1
    tail = ["--streaming", "--output_dir", str(resumed), "--resume_from_checkpoint", str(stream / "checkpoint-5")]
    proc = _spawn_sft(["--stage", "dpo", *fast, *tail])
    (err,) = _finish([proc])
    assert proc.returncode == 0, err[-3000:]
    c = load_file(resumed / "model.safetensors")
    assert all(torch.equal(b[k], c[k]) for k in b)
    assert logged(resumed) == logged(stream)[5:]
    done = run(*fast, "--streaming", "--precompute_ref_log_probs", "true", "--output_dir", str(tmp_path / "x"))
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr[-2000:]
    assert "precompute_ref_log_probs: not with --streaming" in done.stderr and not (tmp_path / "x").exists()


@pytest.mark.slow  # 20-30 s on 2 shared cores: its own launch; DPO under FSDP2 and SFT under ZeRO-3 stay in CI
def test_deepspeed_zero3_runs_as_given(tmp_path):
    """`python -m trainer.dpo --deepspeed ds_zero3.json` (one process, no launcher: DeepSpeed forms its own group),
    the reference given by name (`--ref_model tiny`, built like the policy and run through its own ZeRO-3 engine):
    it trains, evaluates with TRL's metrics, measures the preference accuracy before and after, and writes the
    consolidated model. 2 processes against one: tests/trainer/parallel/test_distributed.py."""
    pytest.importorskip("deepspeed")
    config = tmp_path / "ds_zero3.json"
    config.write_text(
        json.dumps(
            {
                "train_micro_batch_size_per_gpu": "auto",
                "gradient_accumulation_steps": "auto",
                "train_batch_size": "auto",
                "gradient_clipping": "auto",
                "zero_optimization": {"stage": 3},
            }
        )
    )
    out = tmp_path / "out"
    done = run(
        *FAST,
        "--output_dir",
        str(out),
        "--ref_model",
        "tiny",
        "--eval_strategy",
        "steps",
        "--eval_steps",
        "2",
        "--per_device_eval_batch_size",
        "50",
        "--deepspeed",
        str(config),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    metrics = json.loads((out / "final_metrics.json").read_text())
    assert metrics["global_step"] == 2
    assert {"eval_rewards/accuracies", "eval_rewards/margins", "eval_logps/chosen"} <= set(metrics)
    assert 0 <= metrics["preference_accuracy_after"] <= 1
    assert (out / "model.safetensors").is_file()
