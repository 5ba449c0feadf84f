"""`python -m trainer.grpo` (issue 31 items 1, 2, 5): a user's prompts and reward function through the command line,
two gloo processes equal to one, and bad input in one line (exit 2) before anything is built or written."""

import json
import os
import socket
import subprocess
import sys

import pytest
from safetensors.torch import load_file

from tests.trainer.model.tiny_hf import write_tiny
from tests.trainer.test_sft import ROOT, TIMEOUT_S, _finish, _spawn_sft

PROMPTS = [
    {"prompt": [{"role": "user", "content": f"add: {a}+{b}"}], "solution": str(a + b)}
    for a, b in ((1, 2), (3, 4), (10, 5), (7, 7), (2, 9), (12, 30), (8, 1), (6, 6))
]
EVAL_PROMPTS = [
    {"prompt": [{"role": "user", "content": f"add: {a}+{b}"}], "solution": str(a + b)}
    for a, b in ((4, 5), (20, 3), (9, 9))
]
REWARD = '''
def digits(prompts, completions, solution, **kwargs):
    """The share of digits in the completion, plus 1 for the right answer."""
    out = []
    for completion, answer in zip(completions, solution):
        text = completion[0]["content"]
        out.append(sum(ch.isdigit() for ch in text) / max(len(text), 1) + float(text.strip() == answer))
    return out


def broken(prompts, completions, **kwargs):
    raise KeyError("score")
'''
# a run small enough for seconds: 2 prompts x 4 completions a step, completions of up to 6 tokens
SMALL = ["--model", "tiny", "--num_generations", "4", "--max_completion_length", "6", "--max_steps", "2"]
SMALL += [
    "--learning_rate",
    "0.1",
    "--optim",
    "sgd",
    "--logging_steps",
    "1",
    "--disable_tqdm",
    "true",
    "--report_to",
    "jsonl",
]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpo-inputs")
    (root / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    (root / "eval.jsonl").write_text("".join(json.dumps(p) + "\n" for p in EVAL_PROMPTS))
    (root / "rewards.py").write_text(REWARD)
    return root


def _spawn_grpo(argv, **launch_env):
    return _spawn_sft(["--stage", "grpo", *argv], None, **launch_env)


CYCLE = ["--num_iterations", "2", "--generation_batch_size", "16", "--max_steps", "4", "--beta", "0.04"]
# evaluated at every step: 3 prompts, 2 a batch over all processes (the second process's share of the last is empty)
EVAL = ["--eval_strategy", "steps", "--eval_steps", "1"]


def _parallel_args(parallel: str, tmp_path) -> list[str]:
    """The two-process run's data parallelism: DDP (the default), FSDP2, or DeepSpeed ZeRO-2/3 (our optimizer its
    client optimizer, the batch keys filled from the arguments)."""
    if parallel == "fsdp2":
        return ["--dist_config", '{"name": "fsdp2"}']
    if parallel.startswith("zero"):
        pytest.importorskip("deepspeed")
        auto = {
            k: "auto" for k in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")
        }
        path = tmp_path / f"{parallel}.json"
        path.write_text(json.dumps({**auto, "zero_optimization": {"stage": int(parallel[-1])}}))
        return ["--deepspeed", str(path)]
    return []


@pytest.mark.parametrize(
    "options, generations, parallel, model_type",
    [
        (EVAL, 2, "ddp", None),
        (CYCLE, 1, "ddp", None),
        ([*CYCLE, *EVAL], 1, "fsdp2", None),
        pytest.param(CYCLE, 1, "zero2", None, marks=pytest.mark.slow),  # ZeRO-3's run covers its sampling and more
        pytest.param(CYCLE, 1, "zero3", None, marks=pytest.mark.slow),  # ZeRO-3 GRPO: test_deepspeed's slow suite
        # no LoRA dropout: its draws depend on the number of processes (with 0.05 the adapters differ by ~30%)
        pytest.param([*CYCLE, "--use_peft", "true", "--lora_dropout", "0"], 1, "fsdp2", None, marks=pytest.mark.slow),
        # the transformers path: softcapping and sliding windows, mixture of experts, hybrid linear attention
        pytest.param(CYCLE, 1, "fsdp2", "gemma2", marks=pytest.mark.slow),  # 20-30 s: our FSDP2 GRPO stays in CI
        pytest.param(CYCLE, 1, "zero3", "gemma2", marks=pytest.mark.slow),
        pytest.param([*CYCLE, "--model_impl", "transformers"], 1, "zero3", "qwen3_moe", marks=pytest.mark.slow),
        pytest.param([*CYCLE, "--model_impl", "transformers"], 1, "fsdp2", "qwen3_5_text", marks=pytest.mark.slow),
        # our model's Gated DeltaNet layers: sampling carries their convolution and recurrent states in the cache
        pytest.param(CYCLE, 1, "fsdp2", "qwen3_5_text", marks=pytest.mark.slow),
    ],
    ids=[
        *("one-step-generations", "generation-of-2-steps-x-2-iterations", "fsdp2", "zero2", "zero3", "fsdp2-lora"),
        *("gemma2-fsdp2", "gemma2-zero3", "qwen3_moe-zero3", "qwen3_5_text-fsdp2", "qwen3_5_text-ours-fsdp2"),
    ],
)
def test_a_users_prompts_and_reward_on_two_processes_match_one(
    inputs, tmp_path, options, generations, parallel, model_type
):
    """The same global batch (8 completions a step) on one process and on two gloo processes (DDP): the same
    rewards logged and the same weights at the end, to fp32 noise; completions.jsonl holds every completion once.
    Also with a generation batch of 16 completions shared by 2 optimizer steps and trained on twice
    (num_iterations 2): the rows of every rank gathered, shuffled and dealt to the steps alike, the old policy's
    and the reference's log-probs summed over the ranks; and so under FSDP2 and DeepSpeed ZeRO-2/3, whose
    generation holds the whole weights (the same completions: the same rewards), the loss and update through the
    sharded engine (with a LoRA adapter too, the reference the model with the adapter disabled). Evaluated at every
    step (DDP and FSDP2): the same eval metrics from eval batches of 2 prompts, one process's or two's. And so on
    the transformers path (a tiny checkpoint of `model_type` written by transformers): sampling through
    transformers' KV cache inside the engine's whole weights, the loss through our fused GRPO head."""
    model = ["--model", str(write_tiny(model_type, tmp_path / model_type))] if model_type else []
    data = ["--data", str(inputs / "prompts.jsonl"), "--reward_funcs", f"{inputs / 'rewards.py'}:digits", *options]
    data += model  # after SMALL's --model tiny: the last one given counts
    if options[: len(EVAL)] == EVAL or options[-len(EVAL) :] == EVAL:
        data += ["--eval_data", str(inputs / "eval.jsonl")]
    one = _spawn_grpo(
        [*SMALL, *data, "--per_device_train_batch_size", "8", "--per_device_eval_batch_size", "8"]
        + ["--output_dir", str(tmp_path / "one")]
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launch = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2"}
    two_argv = [*SMALL, *data, "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "4"]
    two_argv += ["--output_dir", str(tmp_path / "two")]
    two_argv += _parallel_args(parallel, tmp_path)
    two = [
        _spawn_grpo([*two_argv, "--log_completions", "true"], **launch, RANK=str(r), LOCAL_RANK=str(r)) for r in (0, 1)
    ]
    errs = _finish([one, *two])
    assert [p.returncode for p in (one, *two)] == [0, 0, 0], [e[-3000:] for e in errs]
    logs = [
        [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        for run in ("one", "two")
    ]
    rewards = [[row["reward"] for row in log if "reward" in row] for log in logs]
    assert len(rewards[0]) == generations and rewards[0] == pytest.approx(rewards[1], abs=1e-6)
    evals = [[row[k] for row in log if "eval_loss" in row for k in ("eval_reward", "eval_loss")] for log in logs]
    assert len(evals[0]) == (2 * len([r for r in logs[0] if "loss" in r]) if "--eval_data" in data else 0)
    assert evals[0] == pytest.approx(evals[1], abs=1e-6)
    weights = "adapter_model.safetensors" if "--use_peft" in options else "model.safetensors"
    a, b = (load_file(tmp_path / run / weights) for run in ("one", "two"))
    for name in a:
        assert (a[name] - b[name]).abs().max() <= 1e-5 + 1e-5 * a[name].abs().max(), name
    rows = [json.loads(line) for line in (tmp_path / "two" / "completions.jsonl").read_text().splitlines()]
    assert len(rows) == 16 and {r["step"] for r in rows} == set(range(1, generations + 1)) and "digits" in rows[0]


def test_bad_grpo_inputs_stop_in_one_line(inputs, tmp_path):
    """Each one line on stderr, exit 2, and output_dir never created; the failing reward function on the first
    batch too (before any update)."""
    (tmp_path / "no_prompt.jsonl").write_text(json.dumps(PROMPTS[0]) + "\n" + json.dumps({"question": "x"}) + "\n")
    data = ["--data", str(inputs / "prompts.jsonl")]
    cases = [
        (["--data", str(tmp_path / "no_prompt.jsonl")], "no_prompt.jsonl:2: no prompt"),
        ([*data, "--num_generations", "3"], "num_generations=3: must divide the completions of a generation batch"),
        (
            [*data, "--generation_batch_size", "6", "--per_device_train_batch_size", "2"],
            "num_generations=4: must divide the completions of a generation batch on each process, "
            "per_device_train_batch_size x steps_per_generation = 2 x 3 = 6",
        ),
        (
            [*data, "--gradient_accumulation_steps", "2", "--steps_per_generation", "3"],
            "steps_per_generation=3: must be a multiple of gradient_accumulation_steps (2)",
        ),
        (
            [*data, "--steps_per_generation", "2", "--generation_batch_size", "16"],
            "steps_per_generation=2 and generation_batch_size=16: set one of them",
        ),
        ([*data, "--num_iterations", "0"], "num_iterations=0: expected an int >= 1"),
        ([*data, "--loss_type", "sigmoid"], "loss_type='sigmoid': expected one of grpo, bnpo, dr_grpo, dapo, cispo"),
        ([*data, "--reward_funcs", "no_such_module:f"], "reward function 'no_such_module:f'"),
        (
            [*data, "--reward_funcs", "no_such_module.f"],
            "reward function 'no_such_module.f': tried module no_such_module, function 'f' (module no_such_module "
            "does not import: ModuleNotFoundError: No module named 'no_such_module'; looked in the working directory, "
            "then sys.path) and a reward model directory no_such_module.f (there is none)",
        ),
        ([*data, "--beta", "-1"], "beta=-1.0: must be >= 0"),
        (
            [*data, "--eval_strategy", "steps"],
            "eval_strategy='steps' asks for evaluation, but there is no evaluation data: give --eval_data FILE "
            "(prompt records)",
        ),
        (
            [*data, "--eval_data", str(inputs / "eval.jsonl"), "--per_device_eval_batch_size", "6"],
            "per_device_eval_batch_size=6: must be a multiple of num_generations_eval=4",
        ),
        ([*data, "--train_on_prompt", "true"], "train_on_prompt: stage grpo samples answers to prompts"),
        ([*data, "--per_device_train_batch_size", "64"], "8 prompts, but a generation batch samples 4 completions"),
        ([*data, "--steps_per_generation", "8"], "8 prompts, but a generation batch samples 4 completions each of 16"),
        (
            [*data, "--dist_config", '{"name": "fsdp2", "offload_params": true}'],
            "stage grpo does not support FSDP2's CPU offload yet",
        ),
        (
            [*data, "--reward_funcs", f"{inputs / 'rewards.py'}:broken", "--per_device_train_batch_size", "4"],
            "reward function 'broken' raised on row 0: KeyError: 'score'",
        ),
    ]
    out = tmp_path / "out"
    procs = [
        _spawn_grpo([*SMALL, "--output_dir", str(out), *argv]) for argv, _ in cases[:-1]
    ]  # the failing reward function writes output_dir's lock before the first batch: run it on its own
    last = _spawn_grpo([*SMALL, "--output_dir", str(tmp_path / "out-reward"), *cases[-1][0]])
    for proc, (argv, message) in zip([*procs, last], cases):
        _, err = proc.communicate(timeout=TIMEOUT_S)
        lines = err.strip().splitlines()
        error = [line for line in lines if line.startswith("error: ")]
        assert proc.returncode == 2 and len(error) == 1, (argv, err[-2000:])
        assert message in error[0], (argv, error[0])
        if proc is not last:
            assert len(lines) == 1, (argv, err[-2000:])
    assert not out.exists()
    assert not list((tmp_path / "out-reward").glob("checkpoint-*"))


EXACT = """
def exact(prompts, completions, solution, **kwargs):
    return [float(c[0]["content"].strip() == answer) for c, answer in zip(completions, solution)]
"""


def test_trls_dotted_reward_path_trains_from_the_working_directory(inputs, tmp_path):
    """TRL's form (issue 43 item 4): `python -m trainer.grpo --reward_funcs rewards.exact rewards.digits
    think_format_reward` in a directory holding rewards.py trains, as `trl grpo` would there (the module imported
    from the working directory, TRL's registry name beside it); each function is logged under its name."""
    (tmp_path / "rewards.py").write_text(REWARD + EXACT)
    argv = [*SMALL, "--data", str(inputs / "prompts.jsonl"), "--per_device_train_batch_size", "8"]
    argv += ["--reward_funcs", "rewards.exact", "rewards.digits", "think_format_reward", "--output_dir", "out"]
    base = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "KERNELS_BACKEND", "PYTHONPATH")}
    run = subprocess.run(
        [sys.executable, "-m", "trainer.grpo", *argv],
        cwd=tmp_path,
        env={**base, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},  # this checkout, the working directory first
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    logs = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    rewards = [row for row in logs if "reward" in row]
    assert len(rewards) == 2 and (tmp_path / "out" / "model.safetensors").is_file()
    for name in ("exact", "digits", "think_format_reward"):
        assert all(f"rewards/{name}/mean" in row for row in rewards), (name, rewards[0])
