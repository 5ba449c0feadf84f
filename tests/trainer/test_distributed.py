"""Data parallelism on torch.distributed: 2 processes on CPU with gloo, each started as torchrun would start it
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) running tests/trainer/dist_worker.py.

What is checked, all against one process training on the same global batch (per_device 2 x accumulation 4 in one
process = per_device 2 x accumulation 2 x 2 ranks: the loader deals global micro batches round-robin, so each
optimizer step sees the same 8 examples, and the loss is normalised by the window's targets summed over ranks):
- DDP and FSDP2 (fp32; bf16 parameters too) log the same loss per step and end with the same weights, read from
  the consolidated Hugging Face export that rank 0 writes;
- the export loads in one process with ours and with transformers and gives the same logits;
- FSDP2 sharded checkpoints (DCP) resume exactly on 2 processes;
- an exception on one rank ends the whole job with its message and a non-zero exit, never a hang.
Every spawn is bounded by a timeout. GPU-marked tests (NCCL, offload_params) run only where CUDA exists.
Tolerance: the 1-process and 2-process runs sum the same fp32 terms in a different order (per-rank partial
gradients, then an all-reduce), so after a few Adam steps weights agree to ~1e-5 relative, not bitwise.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import kernels

from trainer.args import TrainingArguments
from trainer.model import load_pretrained
from trainer.tasks import generate_tasks
from trainer.trainer import Trainer
from trainer.data import load_sft_dataset
from trainer.tokenizer import byte_level_tokenizer

from .test_trainer import small_model

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("dist_worker.py")
TIMEOUT_S = 150  # per spawned job; the 2-process runs take ~10-40 s on 2 shared cores

BASE = dict(per_device_train_batch_size=2, learning_rate=1e-2, lr_scheduler_type="linear", warmup_steps=0,
            logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True, seed=7, optim="adamw_fused",
            max_steps=3)


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "tasks.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in generate_tasks(40, seed=3)))
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(tmp_path: Path, data_file: Path, args: dict, nproc: int = 2, name: str = "job", **spec) -> dict:
    """Run dist_worker.py on `nproc` ranks; returns {"rcs", "logs", "result", "out"}; never waits past TIMEOUT_S."""
    out = tmp_path / name
    out.mkdir(parents=True, exist_ok=True)
    spec_file = out / "spec.json"
    spec_file.write_text(json.dumps({"output": str(out), "data": str(data_file), "args": args, **spec}))
    port = _free_port()
    env_base = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(nproc),
                "KERNELS_BACKEND": "reference", "OMP_NUM_THREADS": "1"}
    procs, logs = [], []
    for rank in range(nproc):
        log = open(out / f"rank{rank}.log", "w+")
        env = {**env_base, "RANK": str(rank), "LOCAL_RANK": str(rank)}
        procs.append(subprocess.Popen([sys.executable, str(WORKER), str(spec_file)], cwd=ROOT, env=env,
                                      stdout=log, stderr=subprocess.STDOUT))
        logs.append(log)
    deadline = time.monotonic() + TIMEOUT_S
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
    result_file = out / "result.json"
    return {"rcs": rcs, "logs": texts, "out": out,
            "result": json.loads(result_file.read_text()) if result_file.is_file() else None}


def ok(job: dict) -> dict:
    assert job["rcs"] == [0] * len(job["logs"]), "\n\n".join(f"--- rank {r} ---\n{t[-3000:]}" for r, t in enumerate(job["logs"]))
    return job


def single_process(tmp_path: Path, data_file: Path, args: dict):
    dataset = load_sft_dataset([data_file], byte_level_tokenizer(), cutoff_len=64, show_progress=False)
    model = small_model()
    trainer = Trainer(model=model, args=TrainingArguments(output_dir=str(tmp_path / "single"), **args),
                      train_dataset=dataset, eval_dataset=dataset)
    state = trainer.train()
    return [h["loss"] for h in state.log_history if "loss" in h], model, trainer.evaluate()["eval_loss"]


def assert_same_weights(directory: Path, model, rtol=1e-4, atol=1e-5):
    loaded = load_pretrained(directory)
    ours = dict(model.named_parameters())
    for name, p in loaded.named_parameters():
        torch.testing.assert_close(p, ours[name].detach(), rtol=rtol, atol=atol, msg=name)


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, data_file):
    """One process, per_device 2 x accumulation 4: the global batch of 2 ranks x per_device 2 x accumulation 2."""
    with kernels.backend("reference"):  # module-scoped: set up before tests/trainer/conftest.py's autouse fixture
        return single_process(tmp_path_factory.mktemp("ref"), data_file, {**BASE, "gradient_accumulation_steps": 4})


# Both 2-process runs also save checkpoint-2 (of 3 steps), which the resume tests continue from.
DIST_ARGS = {**BASE, "gradient_accumulation_steps": 2, "save_strategy": "steps", "save_steps": 2}
CONFIGS = {"ddp": None, "fsdp2": {"name": "fsdp2", "mixed_precision": "fp32"}}


@pytest.fixture(scope="module", params=list(CONFIGS))
def dist_job(request, tmp_path_factory, data_file):
    config = CONFIGS[request.param]
    args = {**DIST_ARGS, **({"dist_config": config} if config else {})}  # no dist_config: DDP, the default
    return request.param, args, ok(launch(tmp_path_factory.mktemp(request.param), data_file, args))


def test_two_processes_match_one_process(dist_job, reference_run):
    name, _, job = dist_job
    ref_losses, ref_model, ref_eval = reference_run
    assert job["result"]["world_size"] == 2
    assert job["result"]["losses"] == pytest.approx(ref_losses, rel=1e-5), name
    assert job["result"]["eval_loss"] == pytest.approx(ref_eval, rel=1e-5), name
    assert_same_weights(job["out"] / "final", ref_model)  # the consolidated export rank 0 wrote


def test_checkpoint_layout(dist_job):
    name, _, job = dist_job
    checkpoint = job["out"] / "run" / "checkpoint-2"
    files = {p.name for p in checkpoint.iterdir()}
    assert {"model.safetensors", "config.json", "rng_state_0.pth", "rng_state_1.pth", "scheduler.pt",
            "trainer_state.json", "data_state.json"} <= files
    if name == "fsdp2":  # model + optimizer shards of both ranks, instead of optimizer.pt
        assert "dcp" in files and "optimizer.pt" not in files and (checkpoint / "dcp" / ".metadata").is_file()
    else:
        assert "optimizer.pt" in files and "dcp" not in files


def test_resume_on_two_processes_is_exact(tmp_path, data_file, dist_job):
    name, args, first = dist_job
    job = ok(launch(tmp_path, data_file, args, resume=str(first["out"] / "run" / "checkpoint-2")))
    assert job["result"]["losses"] == first["result"]["losses"]  # steps 1-2 restored, step 3 recomputed: bitwise
    a, b = load_pretrained(first["out"] / "final"), load_pretrained(job["out"] / "final")
    for (name_a, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), name_a


def test_consolidated_export_loads_in_one_process_with_ours_and_transformers(dist_job):
    transformers = pytest.importorskip("transformers")
    _, _, job = dist_job
    path = job["out"] / "final"
    ours = load_pretrained(path, use_kernels=False).eval()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, theirs(ids).logits, atol=1e-5, rtol=0)


def test_a_failing_rank_ends_the_job_with_its_error(tmp_path, data_file):
    started = time.monotonic()
    job = launch(tmp_path, data_file, {**BASE, "max_steps": 6, "gradient_accumulation_steps": 1}, fail_at_step=2)
    assert job["rcs"] is not None, f"the job hung (killed after {TIMEOUT_S} s)"
    assert job["rcs"][1] != 0 and job["rcs"][0] != 0, job["rcs"]
    assert "injected failure on rank 1 at step 2" in job["logs"][1]
    assert "[rank 0/2] error" in job["logs"][0]  # rank 0 learnt from the broken collective, did not wait
    assert time.monotonic() - started < TIMEOUT_S


def test_fsdp2_bf16_parameters_train_like_fp32(tmp_path, data_file, reference_run):
    """mixed_precision bf16: blocks compute with bf16 copies of the fp32 shards, gradients reduce in fp32. The loss
    follows the fp32 run within bf16's error (8 significant bits: ~0.4% per rounding, a few roundings deep)."""
    ref_losses, _, ref_eval = reference_run
    args = {**BASE, "gradient_accumulation_steps": 2, "dist_config": {"name": "fsdp2", "mixed_precision": "bf16"}}
    job = ok(launch(tmp_path, data_file, args))
    assert job["result"]["losses"] == pytest.approx(ref_losses, rel=2e-2)
    assert job["result"]["losses"] != pytest.approx(ref_losses, rel=1e-6)  # bf16 really was used
    assert job["result"]["eval_loss"] == pytest.approx(ref_eval, rel=2e-2)
    assert load_pretrained(job["out"] / "final").model.embed_tokens.weight.dtype == torch.float32  # fp32 masters


def test_offload_params_without_cuda_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("CUDA present: offload is allowed")
    from trainer.parallel import apply_fsdp

    with pytest.raises(ValueError, match="offload_params=true needs a CUDA device"):
        apply_fsdp(small_model(), {"name": "fsdp2", "offload_params": True})


def test_init_distributed_is_a_no_op_for_one_process(monkeypatch):
    from trainer.parallel import init_distributed

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert init_distributed() == (0, 1) and not torch.distributed.is_initialized()
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(RuntimeError, match="launch with torchrun"):
        init_distributed()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.parametrize("config", [None, {"name": "fsdp2", "mixed_precision": "fp32"},
                                    {"name": "fsdp2", "mixed_precision": "fp32", "offload_params": True}],
                         ids=["ddp-nccl", "fsdp2-nccl", "fsdp2-offload"])
def test_two_gpus_match_one_process(tmp_path, data_file, reference_run, config):
    """On 2 GPUs (nccl; offload_params keeps the shards in pinned CPU memory): the same run as on the CPU."""
    args = {**BASE, "gradient_accumulation_steps": 2, **({"dist_config": config} if config else {})}
    job = ok(launch(tmp_path, data_file, args))
    ref_losses, ref_model, _ = reference_run
    # GPU matmuls (TF32 off by default in torch) sum in another order than the CPU: fp32 tolerance, not bitwise.
    assert job["result"]["losses"] == pytest.approx(ref_losses, rel=1e-4)
    assert_same_weights(job["out"] / "final", ref_model, rtol=1e-3, atol=1e-4)
