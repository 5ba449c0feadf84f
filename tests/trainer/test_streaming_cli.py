"""`python -m trainer.sft --streaming` (issue 32 item 5): a weighted mixture of two streamed sources (JSONL shards and
Parquet shards, read by datasets as streams) killed with SIGKILL and resumed with `--resume_from_checkpoint auto`
equals the unbroken run bit for bit; two gloo processes equal one with the same global batch, and a checkpoint saved
by one process resumes on two; bad input is one line, exit 2, nothing written."""

import json
import signal
import socket
import time

import pytest
import torch
from safetensors.torch import load_file

from tests.trainer.test_sft import TIMEOUT_S, _finish, _spawn_sft
from trainer.data.tasks import generate_tasks

datasets = pytest.importorskip("datasets")  # an optional extra (kernelwright[datasets])


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Two directories of shards: 12 conversations as 3 JSONL files, 6 as 2 Parquet files."""
    root = tmp_path_factory.mktemp("stream-sources")
    chats, more = generate_tasks(12, seed=11), generate_tasks(6, seed=12)
    (root / "a").mkdir()
    for s in range(3):
        (root / "a" / f"part-{s}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chats[s::3]))
    (root / "b").mkdir()
    for s in range(2):
        datasets.Dataset.from_list(more[s::2]).to_parquet(str(root / "b" / f"part-{s}.parquet"))
    return root


def argv(sources, out, *extra) -> list[str]:
    """A streamed weighted mixture, packed (padding_free: a micro batch is one row), over 8 steps: 32 examples, more
    than one pass over the 18 of the mixture."""
    return [
        *("--model", "tiny", "--streaming", "--output_dir", str(out)),
        *("--dataset_name", f"{sources / 'a'},{sources / 'b'}", "--mix_strategy", "interleave_over"),
        *("--interleave_probs", "0.7", "0.3", "--batching_strategy", "padding_free", "--packing_buffer", "12"),
        *("--max_steps", "8", "--save_steps", "2", "--logging_steps", "1", "--learning_rate", "1e-3"),
        *("--disable_tqdm", "true", "--report_to", "jsonl", "--eval_exact_match", "false"),
        *extra,
    ]


def run(args, **launch_env) -> str:
    proc = _spawn_sft(args, **launch_env)
    (err,) = _finish([proc])
    assert proc.returncode == 0, err[-3000:]
    return err


def losses(out) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in rows if "loss" in r]


def launch_env(rank: int, port: int) -> dict:
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2", "RANK": str(rank)} | {
        "LOCAL_RANK": str(rank)
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # four CLI runs: ~1 min on 2 shared cores, mostly start-up
def test_sigkill_then_resume_of_a_streamed_mixture_equals_the_unbroken_run(sources, tmp_path):
    full = tmp_path / "full"
    run(argv(sources, full, "--per_device_train_batch_size", "4"))
    part = tmp_path / "part"
    proc = _spawn_sft(argv(sources, part, "--per_device_train_batch_size", "4"))
    deadline = time.monotonic() + TIMEOUT_S
    while not (part / "checkpoint-4" / "trainer_state.json").exists() and time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    assert (part / "checkpoint-4").is_dir() and not (part / "model.safetensors").exists()
    run(argv(sources, part, "--per_device_train_batch_size", "4", "--resume_from_checkpoint", "auto"))
    a, b = load_file(full / "model.safetensors"), load_file(part / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert losses(part) == losses(full) and len(losses(full)) == 8
    state = json.loads((full / "checkpoint-8" / "data_state.json").read_text())
    assert state["streaming"] and state["consumed"] == 8 and state["buffer_start"]["pass"] >= 1


@pytest.mark.slow  # 30-45 s: two 2-process launches and a resume
def test_two_processes_equal_one_and_a_one_process_checkpoint_resumes_on_two(sources, tmp_path):
    one = tmp_path / "one"
    run(argv(sources, one, "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2"))
    two, port = tmp_path / "two", free_port()
    procs = [
        _spawn_sft(argv(sources, two, "--per_device_train_batch_size", "2"), **launch_env(r, port)) for r in (0, 1)
    ]
    errs = _finish(procs)
    assert [p.returncode for p in procs] == [0, 0], [e[-3000:] for e in errs]
    a, b = load_file(one / "model.safetensors"), load_file(two / "model.safetensors")
    for name in a:  # DDP's all-reduce sums in another order: fp32 noise
        assert (a[name] - b[name]).abs().max() <= 1e-5 + 1e-5 * a[name].abs().max(), name
    assert [s for s, _ in losses(two)] == list(range(1, 9))
    assert [x for _, x in losses(two)] == pytest.approx([x for _, x in losses(one)], rel=1e-5)
    # one process saved checkpoint-4; two resume it with the same global batch
    resumed, port = tmp_path / "resumed", free_port()
    tail = ["--per_device_train_batch_size", "2", "--resume_from_checkpoint", str(one / "checkpoint-4")]
    procs = [_spawn_sft(argv(sources, resumed, *tail), **launch_env(r, port)) for r in (0, 1)]
    errs = _finish(procs)
    assert [p.returncode for p in procs] == [0, 0], [e[-3000:] for e in errs]
    c = load_file(resumed / "model.safetensors")
    for name in a:
        assert (a[name] - c[name]).abs().max() <= 1e-5 + 1e-5 * a[name].abs().max(), name


def test_bad_streaming_inputs_stop_in_one_line(sources, tmp_path):
    out = tmp_path / "out"
    base = ["--model", "tiny", "--streaming", "--output_dir", str(out), "--data", str(sources / "a")]
    cases = [
        (base, "max_steps: must be set (> 0) with --streaming"),
        ([*base, "--max_steps", "2", "--val_size", "5"], "val_size=5.0: not with --streaming"),
        ([*base, "--max_steps", "2", "--dataset_num_proc", "2"], "dataset_num_proc=2: not with --streaming"),
        ([*base, "--max_steps", "2", "--packing_buffer", "0"], "packing_buffer=0: expected an int >= "),
        ([*base, "--max_steps", "2", "--stage", "grpo"], "streaming: stage grpo's command reads its data whole"),
    ]
    procs = [_spawn_sft(args) for args, _ in cases]
    for proc, (_, message) in zip(procs, cases):
        _, err = proc.communicate(timeout=TIMEOUT_S)
        assert proc.returncode == 2 and message in err and len(err.strip().splitlines()) == 1, err[-2000:]
    assert not out.exists()
