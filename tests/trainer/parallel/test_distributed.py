"""Data parallelism on torch.distributed: 2 processes on CPU with gloo, each started as torchrun would start it
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) running tests/trainer/parallel/dist_worker.py.

What is checked, all against one process training on the same global batch (per_device 2 x accumulation 4 in one
process = per_device 2 x accumulation 2 x 2 ranks: the loader deals global micro batches round-robin, so each
optimizer step sees the same 8 examples, and the loss is normalised by the window's targets summed over ranks):
- DDP and FSDP2 (fp32; bf16 parameters too) log the same loss per step and end with the same weights, read from
  the consolidated Hugging Face export that rank 0 writes;
- compute_metrics sees the whole eval set once, in dataset order, gathered from both ranks: the same metrics;
- the export loads in one process with ours and with transformers and gives the same logits;
- FSDP2 sharded checkpoints (DCP) resume exactly on 2 processes; 2-process checkpoints (DDP, FSDP2) resume on 1
  process and a 1-process checkpoint on 2 (DDP, FSDP2) with the loss curve of the unbroken run; another global
  batch is refused;
- an FSDP2 model built as `trainer.sft` builds it (meta device, sharded, then filled) equals the one-process model
  bitwise, from a Hugging Face directory (uneven shards, several safetensors files), a preset and a DCP copy,
  while no rank holds a full-size weight (a preset: one at a time), and it generates;
- preference training (DPO) under DDP, FSDP2 and DeepSpeed ZeRO-3, the reference a frozen copy (under ZeRO-3
  partitioned like the policy) or precomputed, logs the same losses, reward margins and eval metrics and ends
  with the same weights; under ZeRO-3 a resume from checkpoint-2 continues as the unbroken run;
- GRPO's sampler inside the engine's `full_weights()` (FSDP2 here, ZeRO-3 in test_deepspeed.py) gives one
  process's completions while the ranks stop decoding after different numbers of steps, and leaves the model
  sharded as it found it;
- an exception on one rank ends the whole job with its message and a non-zero exit, never a hang.
Every spawn is bounded by a timeout. GPU-marked tests (NCCL, offload_params) run only where CUDA exists.
Tolerance: the 1-process and 2-process runs sum the same fp32 terms in a different order (per-rank partial
gradients, then an all-reduce), so after a few Adam steps weights agree to ~1e-5 relative, not bitwise.
"""

from __future__ import annotations

import itertools
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint
from safetensors.torch import load_file

import kernels
from tests.trainer.loop.test_trainer import small_model
from trainer.build import PRESETS, build_preset, load_pretrained, save_pretrained
from trainer.config.args import TrainingArguments
from trainer.data.preference_data import load_preference_dataset
from trainer.data.sft_data import load_sft_dataset
from trainer.data.tasks import generate_tasks, preference_pair
from trainer.data.tokenizer import byte_level_tokenizer
from trainer.loop.trainer import Trainer
from trainer.methods.preference import PreferenceArguments, PreferenceTrainer
from trainer.model.causal_lm import CausalLM, ModelConfig, generate
from trainer.model.lora import apply_lora, is_adapter_name, peft_key

ROOT = Path(__file__).resolve().parents[3]
WORKER = Path(__file__).with_name("dist_worker.py")
# per spawned job, only to turn a hang into a failure: the 2-process runs take ~10-40 s on 2 shared cores, up to 53 s
# (test_deepspeed's zero2 launch) while other jobs loaded them; 150 was under 3x that.
TIMEOUT_S = 300

BASE = dict(
    per_device_train_batch_size=2,
    learning_rate=1e-2,
    lr_scheduler_type="linear",
    warmup_steps=0,
    logging_steps=1,
    save_strategy="no",
    report_to=[],
    disable_tqdm=True,
    seed=7,
    optim="adamw_fused",
    max_steps=3,
)


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "tasks.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in generate_tasks(40, seed=3)))
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def eval_metrics(prediction) -> dict:
    """compute_metrics of the eval runs: next-token accuracy, and counts and an order checksum (row number x label
    summed) that are exact only if every eval example arrives once, in dataset order, padded alike."""
    logits, labels = prediction.predictions, prediction.label_ids  # (N, T, V), (N, T) padded with -100
    targets = labels[:, 1:]  # (N, T-1)
    mask = targets != -100
    right = (logits[:, :-1].argmax(-1) == targets) & mask
    rows = torch.arange(1, labels.shape[0] + 1, dtype=torch.float64)[:, None]  # (N, 1)
    return {
        "accuracy": right.sum().item() / mask.sum().item(),
        "rows": labels.shape[0],
        "width": labels.shape[1],
        "targets": int(mask.sum()),
        "order": float((rows * labels.clamp(min=0)).sum()),
    }


def launch(
    tmp_path: Path,
    data_file: Path,
    jobs: list[dict],
    nproc: int = 2,
    presets: dict | None = None,
    timeout: float = TIMEOUT_S,
) -> dict:
    """Run dist_worker.py on `nproc` ranks over `jobs` ({"name", "args", "resume"?, "fail_at_step"?}, run in order
    in one process group); returns {"rcs", "logs", "out": {name: dir}, "result": {name: result.json or None}}.
    Never waits past `timeout` seconds: whatever still runs then is killed and rcs is None."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    dirs = {job["name"]: tmp_path / job["name"] for job in jobs}
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(
        json.dumps(
            {
                "data": str(data_file),
                "presets": presets or {},
                "jobs": [
                    {"output": str(dirs[job["name"]]), **{k: v for k, v in job.items() if k != "name"}} for job in jobs
                ],
            }
        )
    )
    env_base = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "WORLD_SIZE": str(nproc),
        "KERNELS_BACKEND": "reference",
        "OMP_NUM_THREADS": "1",
    }
    procs, logs = [], []
    for rank in range(nproc):
        log = open(tmp_path / f"rank{rank}.log", "w+")
        env = {**env_base, "RANK": str(rank), "LOCAL_RANK": str(rank)}
        procs.append(
            subprocess.Popen(
                [sys.executable, str(WORKER), str(spec_file)], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
            )
        )
        logs.append(log)
    deadline = time.monotonic() + timeout
    rcs = []
    try:
        for p in procs:
            rcs.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
    except subprocess.TimeoutExpired:
        rcs = None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    texts = []
    for log in logs:
        log.seek(0)
        texts.append(log.read())
        log.close()
    results = {
        name: json.loads((d / "result.json").read_text()) if (d / "result.json").is_file() else None
        for name, d in dirs.items()
    }
    return {"rcs": rcs, "logs": texts, "out": dirs, "result": results}


def ok(job: dict) -> dict:
    assert job["rcs"] == [0] * len(job["logs"]), "\n\n".join(
        f"--- rank {r} ---\n{t[-3000:]}" for r, t in enumerate(job["logs"])
    )
    return job


def single_process(tmp_path: Path, data_file: Path, args: dict, resume=None):
    """(losses, model, eval metrics with eval_metrics) of a run in this process, from step 0 or from `resume`."""
    dataset = load_sft_dataset([data_file], byte_level_tokenizer(), cutoff_len=64, show_progress=False)
    model = small_model()
    trainer = Trainer(
        model=model,
        args=TrainingArguments(output_dir=str(tmp_path / "single"), **args),
        train_dataset=dataset,
        eval_dataset=dataset,
        compute_metrics=eval_metrics,
    )
    trainer.train(resume_from_checkpoint=resume)
    state = trainer.state
    return [h["loss"] for h in state.log_history if "loss" in h], model, trainer.evaluate()


def built_and_trained(path: Path, tmp_path: Path, data_file: Path, args: dict):
    """(losses, model) of a run in this process on the model at `path`, built as the CLI builds it."""
    from trainer.build import build_model

    training_args = TrainingArguments(output_dir=str(tmp_path / "one"), **args)
    model, _ = build_model(str(path), training_args)
    dataset = load_sft_dataset([data_file], byte_level_tokenizer(), cutoff_len=64, show_progress=False)
    trainer = Trainer(model=model, args=training_args, train_dataset=dataset)
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h], model


def assert_same_weights(directory: Path, model, rtol=1e-4, atol=1e-5):
    loaded = load_pretrained(directory)
    ours = dict(model.named_parameters())
    for name, p in loaded.named_parameters():
        torch.testing.assert_close(p, ours[name].detach(), rtol=rtol, atol=atol, msg=name)


# All runs that train save checkpoint-2 (of 3 steps), which the resume runs continue from.
DIST_ARGS = {**BASE, "gradient_accumulation_steps": 2, "save_strategy": "steps", "save_steps": 2}
ONE_PROCESS_ARGS = {**DIST_ARGS, "gradient_accumulation_steps": 4}  # the same global batch of 8 on one process
CONFIGS = {
    "ddp": {},
    "fsdp2": {"dist_config": {"name": "fsdp2", "mixed_precision": "fp32"}},
    "fsdp2-bf16": {"dist_config": {"name": "fsdp2", "mixed_precision": "bf16"}},
}


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, data_file):
    """One process, per_device 2 x accumulation 4: the global batch of 2 ranks x per_device 2 x accumulation 2.
    Returns (losses, model, eval metrics, its checkpoint-2)."""
    root = tmp_path_factory.mktemp("ref")
    with kernels.backend("reference"):  # module-scoped: set up before tests/trainer/conftest.py's autouse fixture
        return (*single_process(root, data_file, ONE_PROCESS_ARGS), root / "single" / "checkpoint-2")


# Models the 2-process build jobs load: FSDP2 splits every odd dim 0 unevenly (vocab 321: 161 + 160 rows), and no
# parameter's full shape equals another's shard shape on either rank, so full-size tensors can be told apart.
ODD = {
    "model_type": "llama",
    "vocab_size": 321,
    "hidden_size": 48,
    "intermediate_size": 100,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "max_position_embeddings": 256,
    "tie_word_embeddings": True,
    "pad_token_id": 256,
    "eos_token_id": 258,
    "rms_norm_eps": 1e-5,
}
ODD_PRESET = "odd-test-preset"


@pytest.fixture(scope="module")
def odd_model_dir(tmp_path_factory) -> Path:
    """A Hugging Face directory of the ODD model in several safetensors files (with an index)."""
    path = tmp_path_factory.mktemp("odd")
    model = CausalLM(ModelConfig.from_hf(ODD))
    model.init_weights(11)
    save_pretrained(model, path, max_shard_size="40KB", tokenizer=byte_level_tokenizer())
    assert len(list(path.glob("model-*.safetensors"))) > 2
    return path


@pytest.fixture(scope="module")
def suite(tmp_path_factory, data_file, reference_run, odd_model_dir):
    """One 2-process launch running: ddp (no dist_config: the default), its resume from checkpoint-2, fsdp2 (fp32)
    and its resume, both resumed from the 1-process checkpoint-2, fsdp2 with bf16 parameters, and the FSDP2 model
    built from a Hugging Face directory, a preset and the fsdp2 run's DCP copy."""
    root = tmp_path_factory.mktemp("suite")
    jobs = []
    for name in ("ddp", "fsdp2"):
        jobs.append({"name": name, "args": {**DIST_ARGS, **CONFIGS[name]}, "metrics": True})
        jobs.append(
            {
                "name": f"{name}-resumed",
                "args": {**DIST_ARGS, **CONFIGS[name]},
                "resume": str(root / name / "run" / "checkpoint-2"),
            }
        )
        jobs.append(
            {"name": f"{name}-from-one", "args": {**DIST_ARGS, **CONFIGS[name]}, "resume": str(reference_run[3])}
        )
    jobs.append({"name": "fsdp2-bf16", "args": {**BASE, "gradient_accumulation_steps": 2, **CONFIGS["fsdp2-bf16"]}})
    for name in ("ddp", "fsdp2"):  # issue 30: the same runs with activation offloading, then with the tiled MLP too
        jobs.append({"name": f"{name}-offload", "args": {**DIST_ARGS, **CONFIGS[name], "activation_offloading": True}})
        tiled = {**DIST_ARGS, **CONFIGS[name], "activation_offloading": True, "tiled_mlp": True}
        jobs.append({"name": f"{name}-tiled", "args": tiled})
    jobs.append({"name": "ddp-qlora", "args": {**DIST_ARGS, **QLORA_ARGS}})  # issue 34: 4-bit weights under DDP
    jobs.append({"name": "fsdp2-qlora", "args": {**DIST_ARGS, **CONFIGS["fsdp2"], **QLORA_ARGS}})  # and FSDP2
    jobs.append({"name": "ddp-8bit", "args": {**DIST_ARGS, **INT8_ARGS}})  # 8-bit weights (LLM.int8) under DDP
    jobs.append(
        {
            "name": "fsdp2-host-labels",
            "args": {**DIST_ARGS, **CONFIGS["fsdp2"], "save_strategy": "no"},
            "host_labels_probe": True,
        }
    )
    fsdp2 = CONFIGS["fsdp2"]["dist_config"]
    checkpoint = root / "fsdp2" / "run" / "checkpoint-2"
    for name, model, dcp in (
        ("build-hf", odd_model_dir, None),
        ("build-preset", ODD_PRESET, None),
        ("build-dcp", checkpoint, checkpoint / "dcp"),
    ):
        jobs.append(
            {
                "name": name,
                "build": {"model": str(model), "seed": 5},
                "args": {**BASE, "dist_config": {**fsdp2, "dcp_path": str(dcp) if dcp else None}},
            }
        )
    return ok(launch(root, data_file, jobs, presets={ODD_PRESET: ODD}))


@pytest.mark.parametrize("name", ["ddp", "fsdp2"])
def test_two_processes_match_one_process(suite, reference_run, name):
    ref_losses, ref_model, ref_metrics, _ = reference_run
    result = suite["result"][name]
    assert result["world_size"] == 2
    assert result["losses"] == pytest.approx(ref_losses, rel=1e-5)
    assert result["eval_loss"] == pytest.approx(ref_metrics["eval_loss"], rel=1e-5)
    assert_same_weights(suite["out"][name] / "final", ref_model)  # the consolidated export rank 0 wrote


@pytest.mark.parametrize("name", ["ddp", "fsdp2"])
def test_offloading_and_tiles_on_two_processes(suite, name):
    plain, offloaded = suite["result"][name], suite["result"][f"{name}-offload"]
    assert plain["offloaded_bytes"] == [] and offloaded["offloaded_bytes"][0] > 0
    assert offloaded["losses"] == plain["losses"]
    assert_same_weights(suite["out"][f"{name}-offload"] / "final", load_pretrained(suite["out"][name] / "final"), 0, 0)
    # tiles: the weight gradients sum the same terms in another order (tests/trainer/model/test_tiled_mlp.py)
    assert suite["result"][f"{name}-tiled"]["losses"] == pytest.approx(plain["losses"], rel=1e-5)
    tiled_final = suite["out"][f"{name}-tiled"] / "final"
    assert_same_weights(tiled_final, load_pretrained(suite["out"][name] / "final"), rtol=1e-4, atol=1e-4)  # 1.8e-5 seen


def test_qlora_on_two_processes_matches_one_process(suite, data_file, tmp_path):
    """4-bit base weights under DDP: each rank quantizes the same weights (deterministic), DDP broadcasts rank 0's
    codes and averages the adapter's gradients; under FSDP2 each rank quantizes every weight and keeps its rows of
    the codes with the whole quantization state, and the gathered codes dequantize as one process's. Both runs equal
    one process with the same global batch."""
    with kernels.backend("reference"):
        losses, model, _ = single_process(tmp_path, data_file, {**ONE_PROCESS_ARGS, **QLORA_ARGS})
    for name in ("ddp-qlora", "fsdp2-qlora"):
        assert suite["result"][name]["losses"] == pytest.approx(losses, rel=1e-5), name
        assert_same_adapter(suite["out"][name] / "final", model)


def test_8bit_weights_on_two_processes_match_one_process(suite, data_file, tmp_path):
    """8-bit base weights under DDP: each rank quantizes the same weights; the run equals one process."""
    with kernels.backend("reference"):
        losses, model, _ = single_process(tmp_path, data_file, {**ONE_PROCESS_ARGS, **INT8_ARGS})
    assert suite["result"]["ddp-8bit"]["losses"] == pytest.approx(losses, rel=1e-5)
    assert_same_adapter(suite["out"]["ddp-8bit"] / "final", model)


def test_fsdp2_loss_skips_ignored_rows(suite, reference_run):
    """Host labels reach the fused loss through FSDP2's root pre-forward, which moves forward's tensor arguments
    to the device (there the loss would keep every row: finding the kept ones would need a host sync). The worker
    makes that move run on this CPU mesh and records what it moves (`dist_worker.HostLabelsProbe`): input_ids,
    never the labels; the loss's Triton path (interpreter) then runs its matmuls on the kept rows only. Before the
    Trainer passed FSDP2 models `HostLabels`, "labels" was among the moved tensors. Losses: the one-process run's."""
    result = suite["result"]["fsdp2-host-labels"]
    probe = result["probe"]
    assert probe["moved"] and all("input_ids" in m for m in probe["moved"]), probe["moved"]
    assert not [m for m in probe["moved"] if "labels" in m], probe["moved"]
    calls = probe["calls"]
    # 3 steps x 2 micro batches on rank 0, then the eval loss's batches: every forward with labels took the loss
    assert len(calls) >= 3 * 2 and len(calls) == len(probe["moved"]), (calls, probe["moved"])
    assert all(rows == kept for rows, kept, _ in calls), calls
    # measured: 14 of 94 targets kept in the first micro batch (the prompts are ignored)
    assert sum(kept for _, kept, _ in calls) < sum(total for _, _, total in calls) / 2, calls
    assert result["losses"] == pytest.approx(reference_run[0], rel=1e-5)


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("pairs") / "pairs.jsonl"
    path.write_text("".join(json.dumps(preference_pair(ex)) + "\n" for ex in generate_tasks(24, seed=5)))
    return path


PREF_ARGS = {**BASE, "use_kernels": True}
PREF = {"beta": 0.1}


@pytest.fixture(scope="module")
def preference_run(tmp_path_factory, pairs_file):
    """DPO on one process, per_device 2 x accumulation 4 (the global batch of 8 pairs of 2 ranks x 2 x 2), the
    reference a frozen copy: (the logged steps, the model, the eval metrics)."""
    root = tmp_path_factory.mktemp("pref")
    with kernels.backend("reference"):
        pairs = load_preference_dataset([pairs_file], byte_level_tokenizer(), show_progress=False)
        model = small_model()
        trainer = PreferenceTrainer(
            model=model,
            pref=PreferenceArguments(**PREF),
            train_dataset=pairs,
            eval_dataset=pairs,
            processing_class=byte_level_tokenizer(),
            args=TrainingArguments(output_dir=str(root / "single"), **PREF_ARGS, gradient_accumulation_steps=4),
        )
        trainer.train()
        logs = [h for h in trainer.state.log_history if "loss" in h]
        return logs, model, trainer.evaluate()


def assert_same_preference_run(result, preference_run, name):
    """A 2-process preference result (dist_worker.run_preference) against the one-process run: losses, reward
    margins, reward accuracies and eval metrics. A margin is the difference of two rewards about 50-300x larger
    here (0.0009 of rewards near -0.045 at step 2), so its fp32 noise is absolute: 1e-6 (the processes and
    the one-process run sum in different orders, as do CPUs with and without AVX512: up to 1.9e-7 measured at step 2,
    under DDP on an AVX512 CPU and under DeepSpeed's reduce-scatter alike)."""
    logs, _, metrics = preference_run
    assert result["world_size"] == 2
    assert result["losses"] == pytest.approx([h["loss"] for h in logs], rel=1e-5), name
    margins = [h["rewards/margins"] for h in logs]
    assert result["margins"] == pytest.approx(margins, rel=1e-4, abs=1e-6), name
    for key in ("eval_loss", "eval_rewards/accuracies", "eval_rewards/margins", "eval_logps/chosen"):
        assert result["metrics"][key] == pytest.approx(metrics[key], rel=1e-4, abs=1e-7), (name, key)


def test_preference_training_on_two_processes_matches_one(tmp_path, data_file, pairs_file, preference_run):
    """DPO (issue 22 item 5) under DDP, FSDP2 and FSDP2 with precomputed reference log-probs on 2 processes: the
    losses, reward margins, eval metrics and final weights of one process on the same global batch of 8 pairs."""
    jobs = [
        {
            "name": name,
            "pairs": str(pairs_file),
            "pref": {**PREF, **extra},
            "args": {**PREF_ARGS, "gradient_accumulation_steps": 2, **CONFIGS[config]},
        }
        for name, config, extra in (
            ("ddp", "ddp", {}),
            ("fsdp2", "fsdp2", {}),
            ("fsdp2-precomputed", "fsdp2", {"precompute_ref_log_probs": True}),
        )
    ]
    runs = ok(launch(tmp_path / "dist", data_file, jobs))
    for name in ("ddp", "fsdp2", "fsdp2-precomputed"):
        assert_same_preference_run(runs["result"][name], preference_run, name)
        assert_same_weights(runs["out"][name] / "final", preference_run[1])


@pytest.mark.slow  # minutes on a 2-core CPU
def test_preference_training_under_deepspeed_zero3_matches_one_process(tmp_path, data_file, pairs_file, preference_run):
    """DPO under DeepSpeed ZeRO-3 on 2 processes (issue 22 item 5), the reference a frozen copy partitioned like the
    policy (`DeepSpeedRun.frozen`) or precomputed, and under ZeRO-2 (the reference whole, as the policy): the
    losses, reward margins, eval metrics and final weights (the consolidated export) of one process without
    DeepSpeed; each ZeRO-3 run resumed from its checkpoint-2 continues as the unbroken one (the reference rebuilt
    from the model as given, not from the checkpoint). Every parameter is partitioned (persistence threshold 0),
    so between forwards each rank holds half of the reference. With a LoRA adapter the reference is the policy's
    engine with the adapter disabled: the losses, margins and adapter of one LoRA process."""
    pytest.importorskip("deepspeed")
    config = tmp_path / "zero3.json"
    config.write_text(
        json.dumps(
            {
                "train_micro_batch_size_per_gpu": "auto",
                "gradient_accumulation_steps": "auto",
                "train_batch_size": "auto",
                "gradient_clipping": "auto",
                "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
            }
        )
    )
    args = {**PREF_ARGS, "gradient_accumulation_steps": 2, "deepspeed": str(config)}
    args |= {"save_strategy": "steps", "save_steps": 2}
    root = tmp_path / "dist"
    jobs = []
    for name, extra in (("zero3", {}), ("zero3-precomputed", {"precompute_ref_log_probs": True})):
        job = {"name": name, "pairs": str(pairs_file), "pref": {**PREF, **extra}, "args": args}
        jobs += [job, {**job, "name": f"{name}-resumed", "resume": str(root / name / "run" / "checkpoint-2")}]
    lora = {**args, **LORA_ARGS, "save_strategy": "no"}
    jobs.append({"name": "zero3-lora", "pairs": str(pairs_file), "pref": PREF, "args": lora, "lora": True})
    zero2 = tmp_path / "zero2.json"
    zero2.write_text(json.dumps({**json.loads(config.read_text()), "zero_optimization": {"stage": 2}}))
    jobs.append({"name": "zero2", "pairs": str(pairs_file), "pref": PREF, "args": {**args, "deepspeed": str(zero2)}})
    # 6 DeepSpeed runs in one launch: ~100 s on 2 loaded cores (measured): twice the default bound keeps 5x of that
    runs = ok(launch(root, data_file, jobs, timeout=2 * TIMEOUT_S))
    for name in ("zero3", "zero3-precomputed"):
        result = runs["result"][name]
        assert_same_preference_run(result, preference_run, name)
        assert_same_weights(runs["out"][name] / "final", preference_run[1])
        resumed = runs["result"][f"{name}-resumed"]
        # steps 1-2 come back with checkpoint-2's log history, step 3 is trained after the resume
        assert resumed["losses"] == pytest.approx(result["losses"], rel=1e-6), name
        assert resumed["margins"] == pytest.approx(result["margins"], rel=1e-6, abs=1e-9), name
        assert resumed["metrics"]["eval_loss"] == pytest.approx(result["metrics"]["eval_loss"], rel=1e-6), name
    for name in ("zero3", "zero3-resumed"):
        for rank in runs["result"][name]["reference_holding"]:
            assert rank["type"] == "DeepSpeedEngine", rank
            assert rank["held"] <= rank["numel"] / 2 + 64, rank  # each parameter's partition: ceil(numel / 2)
    # ZeRO-2: the reference through a stage-0 engine (the policy's dtype), whole on every rank, as the policy is
    assert_same_preference_run(runs["result"]["zero2"], preference_run, "zero2")
    assert_same_weights(runs["out"]["zero2"] / "final", preference_run[1])
    for rank in runs["result"]["zero2"]["reference_holding"]:
        assert rank["type"] == "DeepSpeedEngine" and rank["held"] == rank["numel"], rank
    assert runs["result"]["zero3-precomputed"]["reference_holding"] == [None, None]
    # LoRA: the reference is the policy's engine with the adapter disabled (no copy), against one process
    pytest.importorskip("peft")
    from trainer.model.lora import init_adapter_weights

    with kernels.backend("reference"):
        pairs = load_preference_dataset([pairs_file], byte_level_tokenizer(), show_progress=False)
        one = {**PREF_ARGS, **LORA_ARGS, "gradient_accumulation_steps": 4}
        single = TrainingArguments(output_dir=str(tmp_path / "lora"), **one)
        model = apply_lora(small_model(), single)
        init_adapter_weights(model, seed=0)
        trainer = PreferenceTrainer(
            model=model,
            pref=PreferenceArguments(**PREF),
            train_dataset=pairs,
            eval_dataset=pairs,
            processing_class=byte_level_tokenizer(),
            args=single,
        )
        trainer.train()
        lora_run = ([h for h in trainer.state.log_history if "loss" in h], model, trainer.evaluate())
    assert runs["result"]["zero3-lora"]["reference_holding"] == [None, None]
    assert_same_preference_run(runs["result"]["zero3-lora"], lora_run, "zero3-lora")
    assert_same_adapter(runs["out"]["zero3-lora"] / "final", model)


@pytest.mark.parametrize("name", ["ddp", "fsdp2"])
def test_backward_starts_from_a_gradient_of_exactly_one(suite, name):
    """The world_size factor of the gradient average lives in the loss normaliser (N / world_size), not in a loss
    multiplied before backward, so the cross-entropy backward skips its in-place scaling pass over the logits."""
    grads = suite["result"][name]["loss_grad_outputs"]
    assert len(grads) == 3 * 2 and set(grads) == {1.0}, grads  # 3 steps x 2 micro batches on rank 0


@pytest.mark.parametrize("name", ["ddp", "fsdp2"])
def test_compute_metrics_sees_the_whole_eval_set_once_in_order(suite, reference_run, name):
    """40 eval examples in batches of 8 make 5 global batches: rank 0 holds 3, rank 1 holds 2 and a filler. The
    gathered predictions give the 1-process metrics: counts and order checksum exactly, accuracy to the weights'
    ~1e-5 difference (no argmax flipped here), the loss as the token-weighted mean over all ranks."""
    ref = reference_run[2]
    got = suite["result"][name]["metrics"]
    assert got["eval_rows"] == ref["eval_rows"] == 40
    for key in ("eval_width", "eval_targets", "eval_order", "eval_accuracy"):
        assert got[key] == ref[key], key
    assert got["eval_loss"] == pytest.approx(ref["eval_loss"], rel=1e-5)


@pytest.mark.parametrize("name", ["ddp", "fsdp2"])
def test_checkpoint_layout(suite, name):
    checkpoint = suite["out"][name] / "run" / "checkpoint-2"
    files = {p.name for p in checkpoint.iterdir()}
    assert {
        "model.safetensors",
        "config.json",
        "rng_state_0.pth",
        "rng_state_1.pth",
        "scheduler.pt",
        "trainer_state.json",
        "data_state.json",
    } <= files
    if name == "fsdp2":  # model + optimizer shards of both ranks, instead of optimizer.pt
        assert "dcp" in files and "optimizer.pt" not in files and (checkpoint / "dcp" / ".metadata").is_file()
    else:
        assert "optimizer.pt" in files and "dcp" not in files


@pytest.mark.parametrize("name", ["ddp", "fsdp2"])
def test_resume_on_two_processes_is_exact(suite, name):
    first, resumed = suite["result"][name], suite["result"][f"{name}-resumed"]
    assert resumed["losses"] == first["losses"]  # steps 1-2 restored from the checkpoint, step 3 recomputed: bitwise
    a = load_pretrained(suite["out"][name] / "final")
    b = load_pretrained(suite["out"][f"{name}-resumed"] / "final")
    for (param_name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), param_name


@pytest.mark.parametrize("name", ["ddp", "fsdp2"])
def test_consolidated_export_loads_in_one_process_with_ours_and_transformers(suite, name):
    transformers = pytest.importorskip("transformers")
    path = suite["out"][name] / "final"
    ours = load_pretrained(path, use_kernels=False).eval()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, theirs(ids).logits, atol=1e-5, rtol=0)


def test_fsdp2_bf16_parameters_train_like_fp32(suite, reference_run):
    """mixed_precision bf16: blocks compute with bf16 copies of the fp32 shards, gradients reduce in fp32. The loss
    follows the fp32 run within bf16's error (8 significant bits: ~0.4% per rounding, a few roundings deep)."""
    ref_losses, _, ref_metrics, _ = reference_run
    ref_eval = ref_metrics["eval_loss"]
    result = suite["result"]["fsdp2-bf16"]
    assert result["losses"] == pytest.approx(ref_losses, rel=2e-2)
    assert result["losses"] != pytest.approx(ref_losses, rel=1e-6)  # bf16 really was used
    assert result["eval_loss"] == pytest.approx(ref_eval, rel=2e-2)
    # the parameters (the optimizer's master weights) stay fp32
    assert load_pretrained(suite["out"]["fsdp2-bf16"] / "final").model.embed_tokens.weight.dtype == torch.float32


def test_a_failing_rank_ends_the_job_with_its_error(tmp_path, data_file):
    job = launch(tmp_path, data_file, [{"name": "fail", "args": {**BASE, "max_steps": 6}, "fail_at_step": 2}])
    # Both ranks exited (launch waits on the processes): rank 0 did not sit out the process group's 30 min timeout
    # in the broken collective. No elapsed-time check beside it: how long a healthy job takes is the machine's speed.
    assert job["rcs"] is not None, f"the job hung (killed after {TIMEOUT_S} s)"
    assert job["rcs"][1] != 0 and job["rcs"][0] != 0, job["rcs"]
    assert "injected failure on rank 1 at step 2" in job["logs"][1]
    assert "[rank 0/2] error" in job["logs"][0]  # rank 0 learnt from the broken collective, did not wait


def test_offload_params_without_cuda_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("CUDA present: offload is allowed")
    from trainer.parallel.transforms import apply_fsdp

    with pytest.raises(ValueError, match="offload_params=true needs a CUDA device"):
        apply_fsdp(small_model(), {"name": "fsdp2", "offload_params": True})


def test_init_distributed_is_a_no_op_for_one_process(monkeypatch):
    from trainer.dist import init_distributed

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert init_distributed() == (0, 1) and not torch.distributed.is_initialized()
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(RuntimeError, match="launch with torchrun"):
        init_distributed()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.parametrize(
    "config",
    [
        None,
        {"name": "fsdp2", "mixed_precision": "fp32"},
        {"name": "fsdp2", "mixed_precision": "fp32", "offload_params": True},
    ],
    ids=["ddp-nccl", "fsdp2-nccl", "fsdp2-offload"],
)
def test_two_gpus_match_one_process(tmp_path, data_file, reference_run, config):
    """On 2 GPUs (nccl; offload_params keeps the shards in pinned CPU memory): the same run as on the CPU."""
    args = {**BASE, "gradient_accumulation_steps": 2, **({"dist_config": config} if config else {})}
    job = ok(launch(tmp_path, data_file, [{"name": "gpu", "args": args}]))
    ref_losses, ref_model, _, _ = reference_run
    # GPU matmuls (TF32 off by default in torch) sum in another order than the CPU: fp32 tolerance, not bitwise.
    assert job["result"]["gpu"]["losses"] == pytest.approx(ref_losses, rel=1e-4)
    assert_same_weights(job["out"]["gpu"] / "final", ref_model, rtol=1e-3, atol=1e-4)


@pytest.mark.gpu
def test_nccl_initialises_with_one_process(tmp_path, monkeypatch):
    """trainer.dist's backend string (nccl for CUDA tensors, gloo beside it) on one GPU: the group forms, a CUDA
    all-reduce and a CPU object gather run, and it tears down (issue 16: NCCL initialisation with one process)."""
    from trainer.dist import init_distributed, world

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # WORLD_SIZE=1 is a no-op for init_distributed (one process needs no group), so the group is formed as it
    # forms one for several processes: the same backend string, a one-rank TCP store.
    for key, value in {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }.items():
        monkeypatch.setenv(key, value)
    assert init_distributed() == (0, 1) and not torch.distributed.is_initialized()
    torch.distributed.init_process_group(backend="cuda:nccl,cpu:gloo", rank=0, world_size=1)
    try:
        assert world() == (0, 1)
        x = torch.arange(4.0, device="cuda")
        torch.distributed.all_reduce(x)
        torch.cuda.synchronize()
        assert x.tolist() == [0.0, 1.0, 2.0, 3.0]
        gathered = [None]
        torch.distributed.all_gather_object(gathered, {"rank": 0})
        assert gathered == [{"rank": 0}]
    finally:
        torch.distributed.destroy_process_group()


@pytest.fixture
def one_rank_group(tmp_path):
    """A 1-process gloo group in this process (DDP and FSDP2 need one), destroyed afterwards."""
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        torch.distributed.destroy_process_group()


def _two_micro_steps(model, batches):
    from trainer.parallel.transforms import gradient_sync

    for i, ids in enumerate(batches):
        with gradient_sync(model, i == len(batches) - 1):
            model(ids, labels=ids).loss.backward()


def test_gradient_sync_reduces_once_per_window_with_ddp(one_rank_group):
    from trainer.parallel.transforms import apply_ddp

    model = apply_ddp(small_model())
    reductions = []

    def count(state, bucket):  # a DDP communication hook: called once per bucket per synchronised backward
        reductions.append(len(bucket.gradients()))
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    model.register_comm_hook(None, count)
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
    model(ids, labels=ids).loss.backward()  # a window of one micro step: synchronised
    once = sum(reductions)
    assert once == len(list(model.parameters()))  # every gradient reduced exactly once
    reductions.clear()
    _two_micro_steps(model, [ids, ids.flip(0), ids])  # 3 micro steps: only the last one reduces
    assert sum(reductions) == once


def test_gradient_sync_reduces_once_per_window_with_fsdp2(one_rank_group):
    from trainer.parallel.transforms import apply_fsdp

    model = apply_fsdp(small_model(), {"name": "fsdp2", "mixed_precision": "fp32"})
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
    from trainer.parallel.transforms import gradient_sync

    with gradient_sync(model, False):
        model(ids, labels=ids).loss.backward()
    # Without sync FSDP2 keeps the unsharded gradient to itself: no sharded .grad exists yet.
    assert all(p.grad is None for p in model.parameters())
    with gradient_sync(model, True):
        model(ids, labels=ids).loss.backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_fused_adamw_updates_dtensor_shards_like_plain_tensors(one_rank_group, backend):
    """FusedAdamW on FSDP2's DTensor parameters runs on the local shards (the launch tables need plain memory)
    and keeps DTensor moments, so DCP saves them sharded; the update equals the plain-tensor one bitwise.
    `triton` runs the kernel through the interpreter."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    gen = torch.Generator().manual_seed(0)
    values = [torch.randn(37, 5, generator=gen), torch.randn(11, generator=gen)]
    grads = [torch.randn_like(v) for v in values]
    plain = [torch.nn.Parameter(v.clone()) for v in values]
    sharded = [torch.nn.Parameter(distribute_tensor(v.clone(), mesh, [Shard(0)])) for v in values]
    with kernels.backend(backend):
        for params in (plain, sharded):
            opt = kernels.FusedAdamW(params, lr=1e-2, weight_decay=0.1)
            for step in range(2):
                for p, g in zip(params, grads):
                    p.grad = (
                        distribute_tensor(g * (step + 1), mesh, [Shard(0)])
                        if isinstance(p, DTensor)
                        else g * (step + 1)
                    )
                opt.step()
    for p, q in zip(plain, sharded):
        assert isinstance(q, DTensor) and isinstance(opt.state[q]["exp_avg"], DTensor)
        assert torch.equal(p.detach(), q.detach().full_tensor())


@pytest.mark.parametrize("name", ["ddp", "fsdp2"])
def test_two_process_checkpoint_resumes_on_one_process(suite, reference_run, data_file, tmp_path, capsys, name):
    """checkpoint-2 of the 2-process run (DDP: optimizer.pt; FSDP2: the DCP copy, resharded to whole tensors) resumed
    by one process with accumulation 4: step 3 gives the loss and weights of the unbroken runs to fp32 rounding."""
    ref_losses, ref_model, _, _ = reference_run
    args = {**ONE_PROCESS_ARGS, **CONFIGS[name], "save_strategy": "no"}
    losses, model, _ = single_process(tmp_path, data_file, args, resume=suite["out"][name] / "run" / "checkpoint-2")
    assert losses[:2] == suite["result"][name]["losses"][:2]  # restored from the checkpoint's log history
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert losses == pytest.approx(suite["result"][name]["losses"], rel=1e-5)
    for (param_name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-4, atol=1e-5, msg=param_name)
    warning = [line for line in capsys.readouterr().err.splitlines() if "re-seeded" in line]
    assert len(warning) == 1 and "saved by 2 process(es), resumed by 1" in warning[0]


@pytest.mark.parametrize("name", ["ddp", "fsdp2"])
def test_one_process_checkpoint_resumes_on_two_processes(suite, reference_run, name):
    """The 1-process checkpoint-2 (whole optimizer.pt; FSDP2 splits it into each rank's rows) resumed by 2 processes
    with accumulation 2: the unbroken 1-process loss curve and weights, to fp32 rounding."""
    ref_losses, ref_model, _, _ = reference_run
    result = suite["result"][f"{name}-from-one"]
    assert result["losses"][:2] == ref_losses[:2]
    assert result["losses"] == pytest.approx(ref_losses, rel=1e-5)
    assert_same_weights(suite["out"][f"{name}-from-one"] / "final", ref_model)


@pytest.mark.parametrize(
    "change, message",
    [
        (
            {"gradient_accumulation_steps": 2},
            r"the global batch .* was 2 x 2 x 2 = 8, is 4; set gradient_accumulation_steps=4",
        ),
        ({"per_device_train_batch_size": 4}, r"per_device_train_batch_size must stay 2 \(got 4\)"),
        ({"group_by_length": True}, r"group_by_length=True"),
    ],
)
def test_resuming_under_another_number_of_processes_needs_the_same_batches(suite, data_file, tmp_path, change, message):
    from trainer.loop.checkpoint import CheckpointError

    dataset = load_sft_dataset([data_file], byte_level_tokenizer(), cutoff_len=64, show_progress=False)
    args = TrainingArguments(output_dir=str(tmp_path), **{**ONE_PROCESS_ARGS, **change})
    trainer = Trainer(model=small_model(), args=args, train_dataset=dataset)
    with pytest.raises(CheckpointError, match=r"saved by 2 process\(es\), this run has 1: " + message):
        trainer.train(resume_from_checkpoint=str(suite["out"]["ddp"] / "run" / "checkpoint-2"))


@pytest.mark.parametrize("source", ["build-hf", "build-preset", "build-dcp"])
def test_fsdp2_model_built_sharded_equals_the_one_process_model(suite, reference_run, odd_model_dir, source):
    """Gathered after the build, the sharded model is bitwise the 1-process one: the Hugging Face directory loaded
    by load_pretrained, the preset's init with the same seed, the checkpoint (whose model.safetensors holds the
    same weights as its DCP copy); and it generates the same greedy tokens."""
    from safetensors.torch import load_file

    if source == "build-hf":
        ref = load_pretrained(odd_model_dir)
    elif source == "build-preset":
        PRESETS[ODD_PRESET] = ODD
        try:
            ref = build_preset(ODD_PRESET, seed=5)[0]
        finally:
            del PRESETS[ODD_PRESET]
    else:
        ref = load_pretrained(suite["out"]["fsdp2"] / "run" / "checkpoint-2")
    gathered = load_file(str(suite["out"][source] / "gathered.safetensors"))
    expected = ref.state_dict()
    assert set(gathered) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(gathered[name], tensor), name
    result = suite["result"][source]
    assert result["sharded"] == "FSDPCausalLM"
    assert result["generated"] == generate(ref.eval(), [5, 6, 7, 8], 6)


# GRPO's sampling under a sharded engine: rank 0 decodes 1 token (its prefill only), rank 1 seven
SAMPLE = {"model": "tiny", "prompts": [[5, 6, 7, 8], [9, 3, 4], [11, 12], [7, 7, 7, 7, 2]], "lengths": [1, 7]}


def assert_sampled_as_one_process(result: dict) -> None:
    """The sampling job's completions (each rank's, sampled twice) are those of the seed-0 preset on one process,
    and its forward after them gives the same logits (to fp32 noise)."""
    from trainer.methods.grpo_sampling import sample_completions

    ref = build_preset(SAMPLE["model"], seed=0)[0].eval()
    share = len(SAMPLE["prompts"]) // 2
    for rank, tokens in enumerate(result["tokens"]):
        prompts = SAMPLE["prompts"][rank * share : (rank + 1) * share]
        expected = sample_completions(
            ref, prompts, 2, SAMPLE["lengths"][rank], temperature=0.0, first_completion_index=rank * share * 2
        ).completion_ids.tolist()
        assert tokens == [expected, expected], rank
    with torch.no_grad():
        logits = ref(input_ids=torch.tensor(SAMPLE["prompts"][:1])).logits[0, -1]
    torch.testing.assert_close(torch.tensor(result["logits"]), logits, rtol=1e-5, atol=1e-5)


def test_fsdp2_sampling_holds_the_whole_weights_while_ranks_stop_apart(tmp_path, data_file):
    """GRPO's generation under FSDP2 (`TorchEngine.full_weights`): each unit gathered once, in the prefill, so a rank
    that stops decoding early leaves no other waiting in an all-gather (without it rank 1's second step would
    wait forever); the completions of one process; afterwards the model is sharded and trains as before."""
    runs = ok(launch(tmp_path, data_file, [{"name": "fsdp2", "args": {**CONFIGS["fsdp2"]}, "sample": SAMPLE}]))
    assert_sampled_as_one_process(runs["result"]["fsdp2"])


@pytest.mark.parametrize("source", ["build-hf", "build-preset", "build-dcp"])
def test_fsdp2_build_never_holds_a_full_weight(suite, source):
    """Every safetensors read is one rank's rows (the two ranks' rows tile each tensor), and the number of tensors of
    a full weight's shape in memory at once stays 0 (HF; DCP: a copy saved by 2 ranks loads chunk by chunk) or 1 (a
    preset draws each full weight in turn). safetensors' full-shape views of its mmap of the file are not memory:
    only the pages of the rows copied out are read."""
    ranks = suite["result"][source]["ranks"]
    for rank in ranks:
        assert rank["watched_shapes"] >= 4
        assert rank["peak_full_size_alive"] == (1 if source == "build-preset" else 0), rank["rank"]
    if source != "build-hf":
        assert all(rank["reads"] == [] for rank in ranks)
        return
    covered = {}
    for rank in ranks:
        assert sorted(name for name, _, _ in rank["reads"]) == sorted(rank["shards"])  # each tensor once (tied: once)
        for name, rows, shape in rank["reads"]:
            full, local = rank["shards"][name]
            assert rows is not None and shape == local == [rows[1] - rows[0], *full[1:]] and shape[0] < full[0], name
            covered.setdefault(name, []).append(rows)
    for name, spans in covered.items():
        spans.sort()
        full_rows = ranks[0]["shards"][name][0][0]
        assert (
            spans[0][0] == 0 and spans[-1][1] == full_rows and all(a[1] == b[0] for a, b in itertools.pairwise(spans))
        ), name
    assert sorted(r[0] for r in covered["model.embed_tokens.weight"]) == [0, 161]  # uneven: 161 + 160 rows


def test_dcp_path_that_is_not_a_dcp_copy_is_a_clear_error(tmp_path, monkeypatch):
    from trainer.build import build_model
    from trainer.config.args import ConfigError
    from trainer.parallel import transforms as parallel

    monkeypatch.setattr(parallel, "world", lambda: (0, 2))  # as if launched on 2 processes
    args = TrainingArguments(output_dir=str(tmp_path), dist_config={"name": "fsdp2", "dcp_path": str(tmp_path)})
    with pytest.raises(ConfigError, match=r"dist_config.dcp_path: .* is not a torch.distributed.checkpoint directory"):
        build_model("tiny", args)


def test_fp16_with_fsdp2_is_refused(monkeypatch, tmp_path):
    from trainer.config.args import ConfigError
    from trainer.parallel import transforms as parallel

    monkeypatch.setattr(parallel, "world", lambda: (0, 2))  # as if launched on 2 processes
    args = TrainingArguments(output_dir=str(tmp_path), fp16=True, dist_config={"name": "fsdp2"})
    with pytest.raises(ConfigError, match="fp16=True with dist_config name fsdp2 is not supported"):
        parallel.apply_all(small_model(), args)


def assert_same_adapter(final: Path, model) -> None:
    """`final` holds an adapter alone (peft's layout) whose weights are `model`'s (a LoRA model of one process)."""
    assert (final / "adapter_config.json").is_file() and not (final / "model.safetensors").exists()
    saved = load_file(str(final / "adapter_model.safetensors"))
    ours = {peft_key(n): p.detach() for n, p in model.named_parameters() if is_adapter_name(n)}
    assert saved.keys() == ours.keys()
    for key, value in ours.items():
        torch.testing.assert_close(saved[key], value, rtol=1e-4, atol=1e-5, msg=key)


# ---- LoRA (trainer/model/lora.py) under DDP and FSDP2 -------------------------------------------------------------
LORA_ARGS = {"use_peft": True, "lora_r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "lora_target_modules": ["all-linear"]}
QLORA_ARGS = {**LORA_ARGS, "load_in_4bit": True}  # issue 34: the decoder's linear layers in 4 bits under the adapter
INT8_ARGS = {**LORA_ARGS, "load_in_8bit": True}  # and in 8 bits (LLM.int8)


@pytest.fixture(scope="module")
def lora_suite(tmp_path_factory, data_file):
    """2 processes: LoRA under DDP and FSDP2 (3 steps, checkpoint-2), FSDP2 resumed from its checkpoint-2, and a
    LoRA model built sharded on the meta device as trainer.sft builds it (the tiny preset, seed 3)."""
    root = tmp_path_factory.mktemp("lora")
    jobs = [{"name": name, "args": {**DIST_ARGS, **LORA_ARGS, **CONFIGS[name]}} for name in ("ddp", "fsdp2")]
    jobs.append(
        {
            "name": "fsdp2-resume",
            "args": {**DIST_ARGS, **LORA_ARGS, **CONFIGS["fsdp2"]},
            "resume": str(root / "fsdp2" / "run" / "checkpoint-2"),
        }
    )
    jobs.append(
        {"name": "build", "args": {**BASE, **LORA_ARGS, **CONFIGS["fsdp2"]}, "build": {"model": "tiny", "seed": 3}}
    )
    return ok(launch(root, data_file, jobs))


@pytest.mark.parametrize("name", ["ddp", "fsdp2", "fsdp2-resume"])
def test_lora_on_two_processes_matches_one_process(lora_suite, data_file, tmp_path, name):
    with kernels.backend("reference"):
        losses, model, _ = single_process(tmp_path, data_file, {**ONE_PROCESS_ARGS, **LORA_ARGS})
    assert lora_suite["result"][name]["losses"] == pytest.approx(losses, rel=1e-5)
    assert_same_adapter(lora_suite["out"][name] / "final", model)
    if name == "fsdp2":  # the sharded copy holds the adapter and its optimizer state, not the frozen base
        metadata = torch.distributed.checkpoint.FileSystemReader(
            str(lora_suite["out"][name] / "run" / "checkpoint-2" / "dcp")
        ).read_metadata()
        model_keys = {k for k in metadata.state_dict_metadata if k.startswith("model.")}
        # torch's ignore_frozen_params keeps a tied weight's second name (lm_head = embed_tokens here), nothing else
        assert {k for k in model_keys if "lora_" not in k} == {"model.lm_head.weight"}
        assert len(model_keys) == 1 + 2 * 7 * 2


def test_a_lora_model_built_sharded_equals_the_one_process_model(lora_suite):
    gathered = load_file(str(lora_suite["out"]["build"] / "gathered.safetensors"))  # the trainable weights
    # and, a quirk of torch's ignore_frozen_params, the tied head's second name (see the DCP check above)
    assert set(gathered) - {n for n in gathered if is_adapter_name(n)} == {"lm_head.weight"}
    gathered = {n: t for n, t in gathered.items() if is_adapter_name(n)}
    args = TrainingArguments(output_dir="unused", **BASE, **LORA_ARGS)  # the adapter is drawn from args.seed
    model = apply_lora(build_preset("tiny", seed=3)[0], args)
    adapter = {n: p for n, p in model.named_parameters() if is_adapter_name(n)}
    assert gathered.keys() == adapter.keys() and len(adapter) == 4 * 7 * 2
    for name, value in adapter.items():
        assert torch.equal(gathered[name], value.detach()), name
    assert lora_suite["result"]["build"]["generated"]  # decoding runs through the sharded adapter


@pytest.mark.parametrize("model_type", ["qwen3_moe", "qwen3_next"])
def test_fsdp2_trains_our_moe_as_one_process(model_type, tmp_path, data_file):
    """Our Qwen3-MoE and Qwen3-Next (issues 45, 46: Gated DeltaNet, shared experts) under FSDP2 on two processes,
    their experts sharded by expert unevenly (5: 3 + 2 rows of every (E, ., .) tensor, read from the per-expert files
    each rank holds) and the load-balancing loss on: the losses and the exported weights of one process on the same
    global batches."""
    from tests.trainer.model.tiny_hf import write_tiny

    path = write_tiny(model_type, tmp_path / model_type, num_experts=5, num_local_experts=5, output_router_logits=True)
    job = {"name": "fsdp2-moe", "model": str(path), "args": {**DIST_ARGS, **CONFIGS["fsdp2"], "save_strategy": "no"}}
    result = ok(launch(tmp_path / "runs", data_file, [job]))
    losses, model = built_and_trained(path, tmp_path, data_file, {**ONE_PROCESS_ARGS, "save_strategy": "no"})
    assert model.config.model_type == model_type and model.config.num_experts == 5 and model.config.output_router_logits
    assert len(losses) == 3 and result["result"]["fsdp2-moe"]["losses"] == pytest.approx(losses, rel=1e-5)
    # Adam at lr 1e-2 divides each gradient by its own size: the two runs' summation orders
    # leave up to ~8e-5 between weights of ~0.1 after 3 steps (observed), past the dense suite's 1e-5
    assert_same_weights(result["out"]["fsdp2-moe"] / "final", model, rtol=1e-3, atol=2e-4)


def test_fsdp2_trains_qlora_moe_as_one_process(tmp_path, data_file):
    """QLoRA on our Qwen3-MoE under FSDP2 on two processes (issue 46): the experts in 4 bits (Experts4bit), their
    packed codes sharded by rows like a Linear4bit's and gathered per decoder layer to dequantize with the whole state
    each rank keeps, peft's all-linear adapter on the experts and the router beside the 4-bit attention: the losses
    and the adapter of one process on the same global batches."""
    pytest.importorskip("bitsandbytes")
    from tests.trainer.model.tiny_hf import write_tiny
    from trainer.model.quant import Experts4bit

    path = write_tiny("qwen3_moe", tmp_path / "qwen3_moe", num_experts=5, output_router_logits=True)
    # checkpoint-2 (DCP) and the final adapter are saved from the sharded model, its 4-bit layers built on the meta
    # device and quantized as read (bitsandbytes' state_dict pieces must not reach the sharded codes)
    job = {"name": "fsdp2-qlora-moe", "model": str(path), "args": {**DIST_ARGS, **CONFIGS["fsdp2"], **QLORA_ARGS}}
    result = ok(launch(tmp_path / "runs", data_file, [job]))
    assert (result["out"]["fsdp2-qlora-moe"] / "run" / "checkpoint-2" / "dcp").is_dir()
    losses, model = built_and_trained(path, tmp_path, data_file, {**ONE_PROCESS_ARGS, **QLORA_ARGS})
    assert any(isinstance(m, Experts4bit) for m in model.modules())
    assert len(losses) == 3 and result["result"]["fsdp2-qlora-moe"]["losses"] == pytest.approx(losses, rel=1e-5)
    assert_same_adapter(result["out"]["fsdp2-qlora-moe"] / "final", model)
