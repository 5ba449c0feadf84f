"""`python -m trainer.sft` reads and checks every input before it prints its summary, builds the model or writes
anything (issue 21 items 7, 10, 13): a damaged model directory, data that fails, and argument values that the data
or the other arguments rule out each stop in one line naming the file or the argument, exit 2, with no
output_dir created. Each command runs as a user starts it; all of a test's commands run at once (each stops after
reading its inputs, a few seconds)."""

import json

import pytest

from tests.trainer.test_sft import TIMEOUT_S, _spawn_sft
from trainer.build import build_preset, save_pretrained

EXAMPLE = {"messages": [{"role": "user", "content": "reverse: abc"}, {"role": "assistant", "content": "cba"}]}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """A tiny model directory (one file, and sharded), four good examples and a file whose line 2 is bad."""
    root = tmp_path_factory.mktemp("inputs")
    model, tokenizer = build_preset("tiny")
    save_pretrained(model, root / "model", tokenizer=tokenizer)
    save_pretrained(model, root / "sharded", tokenizer=tokenizer, max_shard_size="1MB")
    (root / "good.jsonl").write_text("".join(json.dumps(EXAMPLE) + "\n" for _ in range(4)))
    (root / "bad.jsonl").write_text(json.dumps(EXAMPLE) + '\n{"messages": [oops]}\n')
    return root


def _copy(src, dst, damage):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    damage(dst)
    return dst


def _truncate(name, size):
    def damage(d):
        with open(d / name, "r+b") as f:
            f.truncate(size)

    return damage


def _assert_stops_first(cases, out):
    """Each (argv, what the line says) runs against `out`: exit 2, exactly one line on stderr (no summary, no
    traceback) naming what is wrong, and `out` never created."""
    procs = [
        _spawn_sft(["--output_dir", str(out), "--max_steps", "1", "--disable_tqdm", "true", *argv]) for argv, _ in cases
    ]
    for proc, (argv, message) in zip(procs, cases):
        _, err = proc.communicate(timeout=TIMEOUT_S)
        lines = err.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), (argv, err[-2000:])
        assert message in lines[0], (argv, lines[0])
    assert not out.exists()


def test_a_damaged_model_directory_stops_in_one_line_naming_the_file(inputs, tmp_path):
    """Item 7: a truncated model.safetensors was a traceback after the summary and the build; every damaged model
    directory is now one line naming the file, before anything is written."""
    shards = sorted(p.name for p in (inputs / "sharded").glob("model-*.safetensors"))
    assert len(shards) >= 2
    damaged = {
        "truncated": (inputs / "model", _truncate("model.safetensors", 100_000), "model.safetensors: not a complete"),
        "empty": (inputs / "model", _truncate("model.safetensors", 0), "model.safetensors: not a complete"),
        "config": (
            inputs / "model",
            lambda d: (d / "config.json").write_text("{oops"),
            "config.json:1:2: invalid JSON",
        ),
        "tokenizer": (inputs / "model", lambda d: (d / "tokenizer.json").unlink(), "tokenizer.json: not found"),
        "shard": (inputs / "sharded", _truncate(shards[1], 1000), f"{shards[1]}: not a complete safetensors file"),
        "missing_shard": (
            inputs / "sharded",
            lambda d: (d / shards[0]).unlink(),
            f"{shards[0]}: shard listed in model.safetensors.index.json not found",
        ),
        "index": (
            inputs / "sharded",
            lambda d: (d / "model.safetensors.index.json").write_text("[1,"),
            "model.safetensors.index.json:1:4: invalid JSON",
        ),
    }
    cases = [
        (
            ["--model", str(_copy(src, tmp_path / name, damage)), "--data", str(inputs / "good.jsonl")],
            f"error: {tmp_path / name}/{message}",
        )
        for name, (src, damage, message) in damaged.items()
    ]
    _assert_stops_first(cases, tmp_path / "out")


def test_argument_values_the_data_rules_out_stop_in_one_line(inputs, tmp_path):
    """Item 10: values that were tracebacks after the build (dataloader_drop_last with fewer examples than a batch,
    val_size leaving nothing to train on, max_tokens under the longest example, a metric_for_best_model evaluation
    does not report) or were ignored (val_size beside eval data, evaluation without eval data, a fractional count,
    negative exact-match and answer lengths). Values wrong on their own are TrainingArguments'
    (tests/trainer/config/test_args.py)."""
    good = ["--model", str(inputs / "model"), "--data", str(inputs / "good.jsonl")]
    cases = [
        (
            ["--dataloader_drop_last", "--per_device_train_batch_size", "8"],
            "dataloader_drop_last: 4 examples give no full micro batch of 8 per rank",
        ),
        (
            ["--val_size", "4"],
            "val_size=4 holds out 4 of the 4 training examples, leaving 0 to train on; expected a count from 1 to 3",
        ),
        (["--val_size", "0.9"], "val_size=0.9 holds out 4 of the 4 training examples"),
        (["--val_size", "-1"], "val_size=-1: expected 0 (no held-out split), a count of examples"),
        (["--val_size", "2.5"], "val_size=2.5: expected 0 (no held-out split), a count of examples"),
        (
            ["--val_size", "1", "--eval_data", str(inputs / "good.jsonl")],
            "val_size=1 holds out part of --data for evaluation, but --eval_data is the evaluation data already",
        ),
        (
            ["--eval_strategy", "steps", "--eval_steps", "1"],
            "eval_strategy='steps' asks for evaluation, but there is no evaluation data",
        ),
        (
            ["--batching_strategy", "dynamic_batching", "--max_tokens", "4"],
            "max_tokens=4: expected an int >= the longest example",
        ),
        (
            ["--val_size", "1", "--eval_strategy", "steps", "--eval_steps", "1", "--metric_for_best_model", "accuracy"],
            "metric_for_best_model='accuracy': the evaluation reports loss, perplexity, runtime, samples_per_second",
        ),
        (["--exact_match_examples", "-1"], "exact_match_examples=-1: expected a count >= 0 (0: no exact-match check)"),
        (["--max_new_tokens", "0"], "max_new_tokens=0: must be a positive integer"),
    ]
    _assert_stops_first([(good + argv, message) for argv, message in cases], tmp_path / "out")


def test_a_data_error_comes_before_the_summary_the_build_and_any_write(inputs, tmp_path):
    """Item 13: a bad record, in the training or in the eval data (after good training data, whose tokenisation was
    cached in output_dir/.cache before the error), or a dist_config.dcp_path that holds no DCP copy (read by the
    build), stops before the argument summary, with output_dir not created."""
    model = ["--model", str(inputs / "model")]
    cases = [
        (model + ["--data", str(inputs / "bad.jsonl")], f"{inputs / 'bad.jsonl'}:2: invalid JSON"),
        (
            model + ["--data", str(inputs / "good.jsonl"), "--eval_data", str(inputs / "bad.jsonl")],
            f"{inputs / 'bad.jsonl'}:2: invalid JSON",
        ),
        (
            model
            + [
                "--data",
                str(inputs / "good.jsonl"),
                "--dist_config",
                json.dumps({"name": "fsdp2", "dcp_path": str(inputs / "model")}),
            ],
            f"dist_config.dcp_path: {inputs / 'model'} is not a torch.distributed.checkpoint directory",
        ),
    ]
    _assert_stops_first(cases, tmp_path / "out")
