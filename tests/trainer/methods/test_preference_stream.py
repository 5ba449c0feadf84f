"""Streamed preference pairs (issue 32): a `datasets.IterableDataset` of pairs given to PreferenceTrainer is read,
tokenised and batched as training goes (trainer/data/streaming.py's PairStream and StreamLoader); in one buffer it
batches as the in-memory pairs do, a DPO run on it equals the run on the same pairs in memory bit for bit, a run
resumed from a checkpoint equals the unbroken one bit for bit, a streamed eval set evaluates as the pairs, and what
cannot work is one line."""

import json

import pytest
import torch

from tests.trainer.methods.test_preference import make_args, small_model
from trainer.config.args import ConfigError
from trainer.data.preference_data import PreferenceDataset
from trainer.data.sft_data import DataError
from trainer.data.streaming import PairStream, StreamLoader
from trainer.data.tasks import generate_tasks, preference_pair
from trainer.data.tokenizer import byte_level_tokenizer
from trainer.methods.preference import PreferenceArguments, PreferenceTrainer

datasets = pytest.importorskip("datasets")  # an optional extra (kernelwright[datasets])

PAIRS = 16


@pytest.fixture(scope="module")
def tokenizer():
    return byte_level_tokenizer()


@pytest.fixture(scope="module")
def records():
    return [preference_pair(ex) for ex in generate_tasks(PAIRS, 4)]


def json_stream(tmp_path, records):
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return datasets.load_dataset("json", data_files=str(path), split="train", streaming=True)


def trainer(tmp_path, train_dataset, tokenizer, pref=None, **overrides):
    return PreferenceTrainer(
        model=small_model(),
        args=make_args(tmp_path, **overrides),
        pref=pref or PreferenceArguments(),
        train_dataset=train_dataset,
        processing_class=tokenizer,
    )


def same(a: list[dict], b: list[dict]) -> bool:
    keys = ("input_ids", "labels", "position_ids", "attention_mask")
    return len(a) == len(b) and all(
        x["num_pairs"] == y["num_pairs"]
        and x["num_items"] == y["num_items"]
        and all(torch.equal(x[k], y[k]) for k in keys)
        for x, y in zip(a, b)
    )


def test_one_buffer_of_streamed_pairs_batches_as_the_in_memory_pairs(tmp_path, tokenizer, records):
    """Shuffled, 8 micro batches of 2 pairs: the stream's (raw pairs, or TRL's tokenized columns) are the in-memory
    PreferenceDataset's (TRL's tokenized columns: those columns in memory), through PreferenceTrainer's loaders."""
    pref = PreferenceArguments(max_prompt_length=30, truncation_mode="keep_end")  # 7 of the 16 pairs truncated
    options = dict(pref=pref, train_shuffle=True, packing_buffer=PAIRS, cutoff_len=36)
    in_memory = trainer(tmp_path, records, tokenizer, **options)
    assert in_memory.train_dataset.summary["truncated"] == 7
    assert isinstance(in_memory.train_dataset, PreferenceDataset)
    want = list(in_memory._train_loader(2))
    streamed = trainer(tmp_path, datasets.Dataset.from_list(records).to_iterable_dataset(), tokenizer, **options)
    loader = streamed._train_loader(2)
    assert isinstance(streamed.train_dataset, PairStream) and isinstance(loader, StreamLoader)
    assert len(want) == len(loader) == 8 and same([b for _, b in zip(range(len(want)), loader)], want)
    pairs = in_memory.train_dataset
    columns = {
        f"{part}_input_ids": [pairs[i][f"{part}_ids"].tolist() for i in range(len(pairs))]
        for part in ("prompt", "chosen", "rejected")
    }
    # TRL's tokenized columns: streamed in 2 shards, batched as the same columns in memory are
    want = list(trainer(tmp_path, datasets.Dataset.from_dict(columns), None, **options)._train_loader(2))
    tokens = datasets.Dataset.from_dict(columns).to_iterable_dataset(num_shards=2)
    assert same(
        [b for _, b in zip(range(len(want)), trainer(tmp_path, tokens, None, **options)._train_loader(2))], want
    )


def test_a_dpo_run_on_a_stream_equals_the_run_on_the_pairs(tmp_path, tokenizer, records):
    """The whole set in one buffer: the same losses, metrics and weights, bit for bit."""
    in_memory = trainer(tmp_path / "a", records, tokenizer, train_shuffle=True)
    in_memory.train()
    streamed = trainer(tmp_path / "b", json_stream(tmp_path, records), tokenizer, train_shuffle=True)
    streamed.train()

    def measured(trainer):  # the steps' numbers, not their timing
        logs = [h for h in trainer.state.log_history if "loss" in h]
        return [{k: v for k, v in h.items() if "per_second" not in k and k != "peak_memory_gb"} for h in logs]

    assert len(measured(streamed)) == 4 and measured(streamed) == measured(in_memory)
    for (name, p), q in zip(streamed.model.state_dict().items(), in_memory.model.state_dict().values()):
        assert torch.equal(p, q), name


def test_a_run_resumed_from_a_checkpoint_equals_the_unbroken_run(tmp_path, tokenizer, records):
    """Buffers of 5 pairs, 4 pairs a step, 6 steps: the run reads the stream one and a half times, and its
    checkpoint at step 3 falls inside a buffer."""
    options = dict(max_steps=6, train_shuffle=True, packing_buffer=5, save_strategy="steps", save_steps=3)
    unbroken = trainer(tmp_path / "a", json_stream(tmp_path, records), tokenizer, **options)
    unbroken.train()
    resumed = trainer(tmp_path / "a", json_stream(tmp_path, records), tokenizer, **options)
    resumed.train(resume_from_checkpoint=str(tmp_path / "a" / "out" / "checkpoint-3"))
    want = [(h["loss"], h["rewards/margins"]) for h in unbroken.state.log_history if "loss" in h]
    got = [(h["loss"], h["rewards/margins"]) for h in resumed.state.log_history if "loss" in h]
    assert len(want) == 6 and got == want
    for (name, p), q in zip(unbroken.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(p, q), name
    state = json.loads((tmp_path / "a" / "out" / "checkpoint-3" / "data_state.json").read_text())
    assert state["streaming"] and state["consumed"] == 6  # 3 steps x 2 micro batches


def test_a_streamed_eval_set_evaluates_as_the_pairs(tmp_path, tokenizer, records):
    """An IterableDataset of pairs as eval_dataset is read whole (trainer.data.hf_datasets.eval_whole): the eval loss
    and TRL's metrics of the same pairs in memory."""
    pairs = trainer(tmp_path, records, tokenizer)
    want = pairs.evaluate(records)
    streamed = PreferenceTrainer(
        model=small_model(),
        args=make_args(tmp_path),
        train_dataset=records,
        eval_dataset=json_stream(tmp_path, records),
        processing_class=tokenizer,
    )
    assert isinstance(streamed.eval_dataset, PreferenceDataset)
    got = streamed.evaluate()
    keys = [k for k in want if "runtime" not in k and "per_second" not in k]
    assert "eval_rewards/margins" in keys and {k: got[k] for k in keys} == {k: want[k] for k in keys}


def test_bad_streams_are_one_line(tmp_path, tokenizer, records):
    stream = datasets.Dataset.from_list(records).to_iterable_dataset()
    with pytest.raises(ConfigError, match=r"^max_steps: must be set \(> 0\) when the training data"):
        trainer(tmp_path, stream, tokenizer, max_steps=-1).train()
    with pytest.raises(ConfigError, match=r"^precompute_ref_log_probs: the training pairs are a stream"):
        trainer(tmp_path, stream, tokenizer, pref=PreferenceArguments(precompute_ref_log_probs=True))
    with pytest.raises(
        DataError, match=r"^train_dataset: raw pairs \(columns \['chosen', 'prompt', 'rejected'\]\) and"
    ):
        trainer(tmp_path, stream, None)
    with pytest.raises(DataError, match=r"^train_dataset: cannot tell the pair format from the columns \['messages'\]"):
        trainer(tmp_path, datasets.Dataset.from_list(generate_tasks(2)).to_iterable_dataset(), tokenizer)
    bad = records[:2] + [{**records[2], "rejected": records[2]["chosen"]}]
    with pytest.raises(DataError, match=r"^train_dataset\[2\]: chosen and rejected are identical"):
        next(iter(trainer(tmp_path, datasets.Dataset.from_list(bad).to_iterable_dataset(), tokenizer)._train_loader(2)))
