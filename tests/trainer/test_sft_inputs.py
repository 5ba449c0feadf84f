"""`python -m trainer.sft` reads and checks every input before it prints its summary, builds the model or writes
anything (issue 21 items 7, 10, 13): a damaged model directory, data that fails, and argument values that the data
or the other arguments rule out each stop in one line naming the file or the argument, exit 2, with no
output_dir created. Each command runs as a user starts it; all of a test's commands run at once (each stops after
reading its inputs, a few seconds)."""

import json
import os
import re
from pathlib import Path

import pytest

from tests.trainer.test_sft import TIMEOUT_S, _spawn_sft
from trainer.build import build_preset, save_pretrained
from trainer.cli_args import SFTArguments, _check_data_sources, _check_sft_values
from trainer.config.args import ConfigError, parse_args
from trainer.methods.base import interleave_probs
from trainer.methods.preference import PreferenceArguments

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


@pytest.mark.parametrize(
    "kinds",
    [
        ("truncated", "config", "shard", "missing_shard"),
        # a CLI start each (~6 s of CPU): the same readers as above (a cut file, invalid JSON) and the tokenizer's
        # (tests/trainer/data/test_tokenizer.py); the commands' lines in the slow run
        pytest.param(("empty", "tokenizer", "index"), marks=pytest.mark.slow),
    ],
    ids=["file", "more"],
)
def test_a_damaged_model_directory_stops_in_one_line_naming_the_file(inputs, tmp_path, kinds):
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
        if name in kinds
    ]
    _assert_stops_first(cases, tmp_path / "out")


@pytest.mark.parametrize("kind", ["data", pytest.param("values", marks=pytest.mark.slow)])
def test_argument_values_the_data_rules_out_stop_in_one_line(inputs, tmp_path, kind):
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
    # a CLI start each (~6 s of CPU): the values wrong on their own run in the slow set, and in process below
    own = ("--val_size -1", "--val_size 2.5", "--val_size 0.9", "--exact_match_examples -1", "--max_new_tokens 0")
    cases = [(argv, message) for argv, message in cases if (" ".join(argv) in own) == (kind == "values")]
    _assert_stops_first([(good + argv, message) for argv, message in cases], tmp_path / "out")


@pytest.mark.parametrize(
    "values, message",
    [
        ({"val_size": -1}, "val_size=-1: expected 0 (no held-out split), a count of examples"),
        ({"val_size": 2.5}, "val_size=2.5: expected 0 (no held-out split), a count of examples"),
        ({"exact_match_examples": -1}, "exact_match_examples=-1: expected a count >= 0 (0: no exact-match check)"),
        ({"max_new_tokens": 0}, "max_new_tokens=0: must be a positive integer"),
    ],
)
def test_the_commands_own_values_are_one_line_errors(values, message):
    with pytest.raises(ConfigError, match="^" + re.escape(message)):
        _check_sft_values(SFTArguments(**values))


def test_a_data_error_comes_before_the_summary_the_build_and_any_write(inputs, tmp_path):
    """Item 13: a bad record, in the training or in the eval data (after good training data, whose tokenisation was
    cached in the shared data cache before the error), or a dist_config.dcp_path that holds no DCP copy (read by the
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


# ---- --dataset_name (issue 32 item 2): no network, local sources -------------------------------------------------
def _offline(tmp_path):
    """The environment of the --dataset_name commands: no Hub (HF_HUB_OFFLINE), datasets' cache in tmp_path."""
    return {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_DATASETS_CACHE": str(tmp_path / "hf-cache")}


@pytest.fixture(scope="module")
def sources(inputs):
    """save_to_disk directories: a DatasetDict with train and test splits, one whose columns name no format, one
    whose row 1 is bad."""
    import datasets

    root = inputs / "sources"
    bad = {"messages": [{"role": "user", "content": "x"}, {"role": "bot", "content": "y"}]}
    splits = {
        "chat": {"train": [EXAMPLE] * 4, "test": [EXAMPLE] * 2},
        "columns": {"train": [{"question": "q", "answer": "a"}]},
        "bad": {"train": [EXAMPLE, bad]},
    }
    for name, dataset in splits.items():
        datasets.DatasetDict({k: datasets.Dataset.from_list(v) for k, v in dataset.items()}).save_to_disk(root / name)
    return root


@pytest.mark.parametrize("half", [0, pytest.param(1, marks=pytest.mark.slow)])  # a CLI start each: half in CI
def test_dataset_name_inputs_stop_in_one_line_without_touching_the_network(inputs, sources, tmp_path, half):
    """A Hub id offline, an unknown split (naming those there are), columns that name no format, a bad row
    (source:split[i]), a builder without files or unknown, and options that contradict each other: each one line,
    exit 2, before anything is built or written."""
    model, chat = ["--model", str(inputs / "model")], str(sources / "chat")
    cases = [
        (["--dataset_name", "owner/chat"], "error: dataset_name='owner/chat': not a local directory or a builder"),
        (["--dataset_name", "jsonl", "--data_files", str(inputs / "good.jsonl")], "dataset_name='jsonl': not a local"),
        (["--dataset_name", chat, "--dataset_train_split", "tr"], "no split 'tr' (its splits: train, test)"),
        (["--dataset_name", chat, "--dataset_test_split", "dev"], "no split 'dev' (its splits: train, test)"),
        (["--dataset_name", str(sources / "columns")], "columns:train: no column names a data format (columns:"),
        (["--dataset_name", str(sources / "bad")], "bad:train[1]: messages[1].role is 'bot'"),
        (["--dataset_name", "json"], "dataset_name='json': the json builder reads --data_files"),
        (["--dataset_name", "json", "--data_files", str(tmp_path / "no.jsonl")], "no.jsonl: no such file"),
        (["--data", str(inputs / "good.jsonl"), "--dataset_name", chat], "data and dataset_name: both give"),
        (
            ["--dataset_name", chat, "--dataset_test_split", "test", "--val_size", "1"],
            "dataset_test_split='test' gives the evaluation data, but val_size=1 does too",
        ),
        (["--data_files", "x.jsonl", "--data", str(inputs / "good.jsonl")], "data_files: options of --dataset_name"),
        (["--dataset_name", chat, "--preprocessing_num_workers", "0"], "dataset_num_proc=0: expected a number"),
        (["--dataset_name", f"{chat},{chat}", "--interleave_probs", "0.5", "0.5"], "interleave_probs: set, but mix"),
    ]
    cases = cases[half::2]  # every other case: the Hub, the splits, the formats and the contradictions in each half
    out = tmp_path / "out"
    procs = [
        _spawn_sft(
            ["--output_dir", str(out), "--max_steps", "1", "--disable_tqdm", "true", *model, *argv], _offline(tmp_path)
        )
        for argv, _ in cases
    ]
    for proc, (argv, message) in zip(procs, cases):
        _, err = proc.communicate(timeout=TIMEOUT_S)
        lines = err.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), (argv, err[-2000:])
        assert message in lines[0], (argv, lines[0])
    assert not out.exists()


def test_a_failed_dataset_run_leaves_an_existing_output_dir_as_it_was(inputs, sources, tmp_path):
    out = tmp_path / "out"
    (out / ".cache").mkdir(parents=True)
    (out / "notes.txt").write_text("mine")
    (out / ".cache" / "data-old.npz").write_bytes(b"old")
    before = sorted((p.relative_to(out), p.read_bytes()) for p in out.rglob("*") if p.is_file())
    argv = ["--model", str(inputs / "model"), "--output_dir", str(out), "--dataset_name", str(sources / "bad")]
    proc = _spawn_sft([*argv, "--max_steps", "1", "--disable_tqdm", "true"], _offline(tmp_path))
    _, err = proc.communicate(timeout=TIMEOUT_S)
    assert proc.returncode == 2 and len(err.strip().splitlines()) == 1, err[-2000:]
    assert sorted((p.relative_to(out), p.read_bytes()) for p in out.rglob("*") if p.is_file()) == before


def test_a_mixture_of_saved_datasets_trains_and_evaluates_on_its_test_splits(inputs, sources, tmp_path):
    """--dataset_name twice, interleaved with probabilities, its test splits as eval data, tokenised in two processes
    (LlamaFactory's preprocessing_num_workers): trains, and caches every split's tokens in the shared data cache
    (tests/conftest.py gives each test its own), none in output_dir."""
    out = tmp_path / "out"
    chat = str(sources / "chat")
    argv = ["--model", str(inputs / "model"), "--output_dir", str(out), "--dataset_name", f"{chat},{chat}"]
    argv += ["--mix_strategy", "interleave_over", "--interleave_probs", "0.5", "0.5", "--dataset_test_split", "test"]
    argv += ["--preprocessing_num_workers", "2", "--max_steps", "1", "--per_device_train_batch_size", "2"]
    argv += ["--disable_tqdm", "true", "--plot", "false", "--eval_strategy", "steps", "--eval_steps", "1"]
    proc = _spawn_sft(argv, _offline(tmp_path))
    _, err = proc.communicate(timeout=TIMEOUT_S)
    assert proc.returncode == 0, err[-3000:]
    assert f"examples from {chat}:train (messages), mixed by interleave_over" in err  # the same source twice
    assert "eval data: 4 examples" in err
    cache = Path(os.environ["KERNELWRIGHT_DATA_CACHE"])
    assert len([p for p in cache.glob("data-*") if p.is_dir()]) == 2  # the train split and the test split (twice each)
    assert not (out / ".cache").exists()
    saved = json.loads((out / "sft_args.json").read_text())
    assert saved["dataset_name"] == [f"{chat},{chat}"] and saved["dataset_num_proc"] == 2


def test_dataset_options_read_as_trl_and_llamafactory_write_them(tmp_path):
    """TRL's names as flags; LlamaFactory's `dataset: a,b`-style comma lists, `interleave_probs: "0.7,0.3"` and
    `preprocessing_num_workers` in YAML."""

    def parse(argv):
        return parse_args(argv, extra_dataclasses=(SFTArguments, PreferenceArguments))[1]

    sft = parse(["--dataset_name", "a", "b", "--interleave_probs", "0.7", "0.3", "--dataset_num_proc", "4"])
    assert (sft.dataset_name, interleave_probs(sft), sft.dataset_num_proc) == (["a", "b"], [0.7, 0.3], 4)
    config = tmp_path / "run.yaml"
    config.write_text(
        'dataset_name: a,b\nmix_strategy: interleave_under\ninterleave_probs: "0.6,0.4"\npreprocessing_num_workers: 3\n'
    )
    sft = parse([str(config)])
    assert (sft.dataset_name, interleave_probs(sft), sft.dataset_num_proc) == (["a,b"], [0.6, 0.4], 3)
    assert sft.mix_strategy == "interleave_under" and sft.dataset_train_split == "train"


def test_dpo_refuses_dataset_num_proc_and_a_mixture_in_one_line():
    """Stage dpo tokenises its pairs in one process and reads several --dataset_name sources one after the other:
    --dataset_num_proc > 1 and an interleaved mixture are refused there, not ignored (checked in process: no data is
    read)."""
    interleaved = SFTArguments(stage="dpo", dataset_name=["a", "b"], mix_strategy="interleave_under")
    for sft, message in (
        (interleaved, "mix_strategy='interleave_under': stage dpo reads several --dataset_name sources one after"),
        (SFTArguments(stage="dpo", dataset_num_proc=2), "dataset_num_proc: stage dpo tokenises its pairs in one"),
        (SFTArguments(dataset_name=["json"], dataset_config="x", data_files=["*.nothing"]), "data_files: *.nothing"),
    ):
        with pytest.raises(ConfigError, match=f"^{re.escape(message)}"):
            _check_data_sources(sft)


# ---- the shared data cache (issue 32 item 4) ----------------------------------------------------------------------
def test_a_data_cache_that_cannot_be_written_stops_in_one_line(inputs, tmp_path):
    """--data_cache_dir, or KERNELWRIGHT_DATA_CACHE, under a file: one line, exit 2, before anything is built or
    written (no output_dir, no cache)."""
    (tmp_path / "file").write_text("x")
    out, cache = tmp_path / "out", tmp_path / "file" / "cache"
    argv = ["--model", str(inputs / "model"), "--data", str(inputs / "good.jsonl"), "--output_dir", str(out)]
    argv += ["--max_steps", "1", "--disable_tqdm", "true"]
    procs = [
        _spawn_sft([*argv, "--data_cache_dir", str(cache)]),
        _spawn_sft(argv, {"KERNELWRIGHT_DATA_CACHE": str(cache)}),
    ]
    for proc in procs:
        _, err = proc.communicate(timeout=TIMEOUT_S)
        lines = err.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1, err[-2000:]
        assert lines[0] == f"error: data_cache_dir: {tmp_path / 'file'} is a file, not a directory (data cache {cache})"
    assert not out.exists()


def test_a_second_run_reads_the_first_runs_tokens_and_a_failed_run_loses_nothing(inputs, tmp_path):
    """Two runs with other output_dirs share one cache entry: the first's summary says miss, the second's hit, same
    entry and size. A run that fails on its eval data afterwards (with --overwrite_output_dir) leaves the cache and
    both output_dirs as they were."""
    cache = Path(os.environ["KERNELWRIGHT_DATA_CACHE"])
    argv = ["--model", str(inputs / "model"), "--data", str(inputs / "good.jsonl"), "--max_steps", "1"]
    argv += ["--disable_tqdm", "true", "--plot", "false", "--save_strategy", "no"]
    lines = []
    for run in ("a", "b"):
        proc = _spawn_sft([*argv, "--output_dir", str(tmp_path / run)])
        _, err = proc.communicate(timeout=TIMEOUT_S)
        assert proc.returncode == 0, err[-3000:]
        lines.append(re.search(r"\n  cache (hit|miss) ([0-9.]+ kB) (\S+)\n", err).groups())
    (entry,) = [p for p in cache.iterdir() if p.is_dir()]
    assert lines == [("miss", lines[0][1], str(entry)), ("hit", lines[0][1], str(entry))]
    assert not (tmp_path / "a" / ".cache").exists()

    def files():
        return {
            p: p.read_bytes()
            for root in (cache, tmp_path / "a", tmp_path / "b")
            for p in root.rglob("*")
            if p.is_file()
        }

    before = files()
    bad = ["--eval_data", str(inputs / "bad.jsonl"), "--overwrite_output_dir"]  # it would move b's model aside
    proc = _spawn_sft([*argv, "--output_dir", str(tmp_path / "b"), *bad])
    _, err = proc.communicate(timeout=TIMEOUT_S)
    assert proc.returncode == 2 and "bad.jsonl:2: invalid JSON" in err, err[-2000:]
    after = files()  # the same, and an empty lock file of the entry it tried (locks are never removed: flock's race)
    assert {p: after[p] for p in before} == before and all(p.suffix == ".lock" for p in set(after) - set(before))
