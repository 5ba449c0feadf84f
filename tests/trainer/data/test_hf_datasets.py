"""Hugging Face `datasets` objects as data (issue 32 item 1, first slice): a raw Dataset tokenizes to exactly the
tokens and labels of a JSONL file of the same records, for every format and option; a bad row is named by index and
split; a tokenized Dataset (labels, or TRL's completion_mask / assistant_masks) is checked row by row and trains as
the same TokenizedDataset does; raw, several-split and streaming datasets given to the Trainer are one-line errors.
Preference pairs (tokenize_preference_dataset): the tokens of a JSONL file of the same records, in every format."""

import json

import numpy as np
import pytest
import torch

from trainer.config.args import TrainingArguments
from trainer.data.hf_datasets import (
    tokenize_preference_dataset,
    tokenize_sft_dataset,
    tokenized_from_hf,
    tokenized_splits,
    trainer_dataset,
)
from trainer.data.preference_data import PreferenceDataset, load_preference_dataset
from trainer.data.sft_data import DataError, TokenizedDataset, load_sft_dataset, split_dataset
from trainer.data.tasks import generate_tasks
from trainer.data.tokenizer import byte_level_tokenizer
from trainer.loop.trainer import Trainer
from trainer.methods.sft import SFTTrainer
from trainer.model.causal_lm import CausalLM, ModelConfig

datasets = pytest.importorskip("datasets")  # an optional extra (kernelwright[datasets])

IGN = -100
SYSTEM = {"role": "system", "content": "be brief"}
USER, ANSWER = {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}

# Several rows per format, optional fields present in some rows and absent in others (a Dataset holds them as null)
RECORDS = {
    "messages": [
        {"messages": [USER, ANSWER]},
        {
            "messages": [
                SYSTEM,
                USER,
                ANSWER,
                {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4"},
            ]
        },
        {"messages": [SYSTEM, USER]},  # no answer: dropped (no_targets), by both
    ],
    "sharegpt": [
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]},
        {"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"}], "system": "calc"},
    ],
    "alpaca": [
        {"instruction": "add", "input": "1 2", "output": "3"},
        {"instruction": "hi", "output": "yo", "system": "calc", "history": [["q", "a"]]},
        {"instruction": "long " * 30, "input": "", "output": "x"},  # truncated away at cutoff_len 40
    ],
    "prompt_completion": [{"prompt": "hi", "completion": "yo"}, {"prompt": "2+2?", "completion": "4"}],
    "prompt_completion_lists": [
        {"prompt": [SYSTEM, USER], "completion": [ANSWER]},
        {"prompt": [USER], "completion": [{"role": "assistant", "content": "yo"}]},
    ],
    "text": [{"text": "plain text"}, {"text": "another document " * 5}],
}
OPTIONS = [{}, {"mask_history": True}, {"train_on_prompt": True}, {"cutoff_len": 40}]


@pytest.fixture(scope="module")
def tok():
    return byte_level_tokenizer()


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def as_dataset(records, **kwargs) -> datasets.Dataset:
    """The records as a Dataset with every column any of them has (null where absent), as load_dataset("json") reads
    a file (Dataset.from_list keeps only the first record's keys)."""
    keys = list(dict.fromkeys(k for r in records for k in r))
    return datasets.Dataset.from_dict({k: [r.get(k) for r in records] for k in keys}, **kwargs)


def same_tokens(a: TokenizedDataset, b: TokenizedDataset) -> None:
    np.testing.assert_array_equal(a.input_ids, b.input_ids)
    np.testing.assert_array_equal(a.labels, b.labels)
    np.testing.assert_array_equal(a.offsets, b.offsets)


# ---- raw rows: the same tokens as a file --------------------------------------------------------------------
@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(o) or "default")
@pytest.mark.parametrize("name", sorted(RECORDS))
def test_a_dataset_tokenizes_as_a_jsonl_file_of_the_same_records(tmp_path, tok, name, options):
    records = RECORDS[name]
    from_file = load_sft_dataset(write_jsonl(tmp_path / "d.jsonl", records), tok, show_progress=False, **options)
    from_rows = tokenize_sft_dataset(as_dataset(records), tok, show_progress=False, **options)
    same_tokens(from_rows, from_file)
    for key in ("examples_read", "dropped", "truncated", "options", "supervised_tokens"):
        assert from_rows.summary[key] == from_file.summary[key], key
    assert list(from_rows.summary["formats"].values()) == list(from_file.summary["formats"].values())
    assert from_rows.summary["formats"] == {"dataset": name.replace("_lists", "")}
    assert (from_rows.labels != IGN).any()


@pytest.mark.parametrize("name", ["alpaca", "messages"])
def test_load_dataset_json_of_a_file_tokenizes_as_the_file(tmp_path, tok, name):
    path = write_jsonl(tmp_path / "d.jsonl", RECORDS[name])
    loaded = datasets.load_dataset("json", data_files=str(path), split="train", cache_dir=str(tmp_path / "hf"))
    from_rows = tokenize_sft_dataset(loaded, tok, show_progress=False)
    same_tokens(from_rows, load_sft_dataset(path, tok, show_progress=False))
    assert from_rows.summary["formats"] == {"dataset split 'train'": name}
    first_line = from_rows.summary_text().splitlines()[0]
    assert first_line == f"data: {len(from_rows)} examples from a dataset split 'train' ({name})"
    train, _ = split_dataset(from_rows, 1)
    assert train.summary_text().splitlines()[0] == f"data: {len(train)} examples from a dataset split 'train' ({name})"


def test_a_list_of_records_and_a_formatted_dataset_tokenize_the_same(tok):
    records = RECORDS["messages"]
    want = tokenize_sft_dataset(as_dataset(records), tok, show_progress=False)
    same_tokens(tokenize_sft_dataset(records, tok, show_progress=False), want)
    numpy_rows = as_dataset(records).with_format("numpy")  # rows as arrays: read back as lists
    same_tokens(tokenize_sft_dataset(numpy_rows, tok, show_progress=False), want)


def test_a_bad_row_is_named_by_its_index_and_split_with_the_files_message(tmp_path, tok):
    records = [{"messages": [USER, ANSWER]}, {"messages": [USER, {"role": "bot", "content": "x"}]}]
    with pytest.raises(DataError) as from_file:
        load_sft_dataset(write_jsonl(tmp_path / "d.jsonl", records), tok, show_progress=False)
    message = str(from_file.value).split(": ", 1)[1]
    assert message.startswith("messages[1].role is 'bot'")
    with pytest.raises(DataError) as plain:
        tokenize_sft_dataset(as_dataset(records), tok, show_progress=False)
    assert str(plain.value) == f"row 1: {message}"
    with pytest.raises(DataError) as named:  # the Dataset's own split
        tokenize_sft_dataset(as_dataset(records, split="train"), tok, show_progress=False)
    assert str(named.value) == f"split 'train' row 1: {message}"
    with pytest.raises(DataError, match=r"^split 'test' row 1: messages\[1\]\.role"):
        tokenize_sft_dataset(as_dataset(records), tok, split="test", show_progress=False)
    kept = tokenize_sft_dataset(as_dataset(records), tok, skip_bad_examples=True, show_progress=False)
    assert len(kept) == 1 and kept.summary["dropped"] == {"unknown_role": 1}


def test_unknown_columns_no_usable_rows_splits_and_streams_are_one_line_errors(tok):
    with pytest.raises(DataError, match=r"^dataset: cannot tell the data format from the columns \['question'\]"):
        tokenize_sft_dataset(datasets.Dataset.from_list([{"question": "q"}]), tok, show_progress=False)
    with pytest.raises(DataError, match=r"^row 0: cannot tell the data format from the keys \['question'\]"):
        tokenize_sft_dataset([{"question": "q"}], tok, show_progress=False)  # a list: its rows' own keys
    with pytest.raises(DataError, match=r"^dataset: no usable examples \(no_targets 1\)"):
        tokenize_sft_dataset(datasets.Dataset.from_list([{"messages": [USER]}]), tok, show_progress=False)
    ds = datasets.Dataset.from_list(RECORDS["text"])
    with pytest.raises(DataError, match=r"a DatasetDict of splits 'train', 'test' \(expected one split"):
        tokenize_sft_dataset(datasets.DatasetDict(train=ds, test=ds), tok)
    with pytest.raises(
        DataError, match=r"IterableDataset \(streaming\) here .* trainer\.SFTStream\(dataset, processing_class\)"
    ):
        tokenize_sft_dataset(ds.to_iterable_dataset(), tok)


# ---- tokenized rows -----------------------------------------------------------------------------------------
IDS = [[5, 6, 7, 8], [9, 10, 11]]


def rows(dataset: TokenizedDataset) -> list[tuple[list, list]]:
    return [(ex["input_ids"].tolist(), ex["labels"].tolist()) for ex in dataset]


def test_labels_come_from_the_labels_column_or_from_trls_masks():
    labels = [[IGN, 6, IGN, 8], [IGN, IGN, 11]]
    ds = tokenized_from_hf(datasets.Dataset.from_dict({"input_ids": IDS, "labels": labels}))
    assert rows(ds) == list(zip(IDS, labels))
    assert ds.input_ids.dtype == np.int32
    # No labels, no mask: every token is a target (labels[0] never is: no position predicts it)
    assert rows(tokenized_from_hf(datasets.Dataset.from_dict({"input_ids": IDS}))) == [
        ([5, 6, 7, 8], [IGN, 6, 7, 8]),
        ([9, 10, 11], [IGN, 10, 11]),
    ]
    completion = [[0, 0, 1, 1], [0, 1, 1]]
    assistant = [[0, 1, 1, 0], [1, 1, 1]]
    want = {
        "completion_mask": [[IGN, IGN, 7, 8], [IGN, 10, 11]],
        "assistant_masks": [[IGN, 6, 7, IGN], [IGN, 10, 11]],
    }
    for column, mask in (("completion_mask", completion), ("assistant_masks", assistant)):
        got = tokenized_from_hf(datasets.Dataset.from_dict({"input_ids": IDS, column: mask}))
        assert rows(got) == list(zip(IDS, want[column])), column
    # Both masks: a target where both are 1, as TRL's build_labels; a labels column wins over masks, as in TRL
    both = datasets.Dataset.from_dict({"input_ids": IDS, "completion_mask": completion, "assistant_masks": assistant})
    assert rows(tokenized_from_hf(both)) == [([5, 6, 7, 8], [IGN, IGN, 7, IGN]), ([9, 10, 11], [IGN, 10, 11])]
    with_labels = datasets.Dataset.from_dict({"input_ids": IDS, "labels": IDS, "completion_mask": completion})
    assert rows(tokenized_from_hf(with_labels)) == [([5, 6, 7, 8], [IGN, 6, 7, 8]), ([9, 10, 11], [IGN, 10, 11])]
    # attention_mask of ones and other columns are fine; a torch-formatted dataset reads the same
    extra = datasets.Dataset.from_dict({"input_ids": IDS, "attention_mask": [[1] * 4, [1] * 3], "text": ["a", "b"]})
    assert rows(tokenized_from_hf(extra.with_format("torch"))) == rows(tokenized_from_hf(extra))


def test_whole_columns_and_row_by_row_give_the_same_dataset(monkeypatch):
    rng = np.random.default_rng(0)
    ids = [rng.integers(0, 300, size=n).tolist() for n in rng.integers(1, 30, size=40)]
    masks = {
        "completion_mask": [(rng.random(len(x)) < 0.5).tolist() for x in ids],  # booleans
        "assistant_masks": [rng.integers(0, 2, size=len(x)).tolist() for x in ids],
        "attention_mask": [[1] * len(x) for x in ids],
    }
    labels = [[IGN if r < 0.3 else t for t, r in zip(x, rng.random(len(x)))] for x in ids]
    for columns in ({"assistant_masks": masks["assistant_masks"]}, masks, {"labels": labels, **masks}):
        ds = datasets.Dataset.from_dict({**columns, "input_ids": ids})  # input_ids not the first column
        for view in (ds, ds.shuffle(seed=1).select(range(5, 35))):  # an indices mapping over the table
            fast = tokenized_from_hf(view)
            with monkeypatch.context() as m:
                m.setattr("trainer.data.hf_datasets._from_arrow", lambda *a: None)
                slow = tokenized_from_hf(view)
            same_tokens(fast, slow)
            assert rows(slow) == [rows(tokenized_from_hf(datasets.Dataset.from_list([r])))[0] for r in view]


@pytest.mark.parametrize(
    "columns, error",
    [
        ({"input_ids": [[1, 2], [3, 4.5]]}, r"row 0: input_ids holds 1\.0 \(expected a list of integer token ids\)"),
        ({"input_ids": [["a"], ["b"]]}, r"row 0: input_ids holds 'a' \(expected a list of integer token ids\)"),
        ({"input_ids": [[1, 2], []]}, r"row 1: input_ids is empty"),
        ({"input_ids": [[[1], [2]], [[3]]]}, r"row 0: input_ids is not a flat list"),
        ({"input_ids": [[1, 2], [-1, 4]]}, r"row 1: input_ids holds -1 \(expected token ids >= 0\)"),
        ({"input_ids": IDS, "labels": [[1, 2, 3, 4], [1, 2]]}, r"row 1: labels has 2 values for 3 input_ids"),
        ({"input_ids": IDS, "labels": [[1, 2, 3, -5], [1, 2, 3]]}, r"row 0: labels holds -5 \(expected token ids"),
        ({"input_ids": IDS, "completion_mask": [[0, 1, 1, 1], [1, 1]]}, r"row 1: completion_mask has 2 values for 3"),
        ({"input_ids": IDS, "assistant_masks": [[0, 2, 1, 1], [1, 1, 1]]}, r"row 0: assistant_masks is not a list of"),
        ({"input_ids": IDS, "attention_mask": [[1, 1, 1, 1], [1, 1, 0]]}, r"row 1: attention_mask has 0s, a padded"),
    ],
)
def test_a_malformed_tokenized_row_is_named_with_its_split(columns, error):
    with pytest.raises(DataError, match="^train_dataset " + error):
        trainer_dataset(datasets.Dataset.from_dict(columns), "train_dataset")
    with pytest.raises(DataError, match="^eval_dataset split 'val' " + error):
        trainer_dataset(datasets.DatasetDict(val=datasets.Dataset.from_dict(columns)), "eval_dataset")


def test_raw_missing_several_splits_and_streaming_datasets_are_refused_in_one_line():
    raw = datasets.Dataset.from_list([{"messages": [USER, ANSWER]}])
    with pytest.raises(
        DataError, match=r"^train_dataset: the dataset holds raw messages records .*tokenize_sft_dataset"
    ):
        trainer_dataset(raw, "train_dataset")
    with pytest.raises(DataError, match=r"raw text records \(columns \['text'\]\), not tokens; tokenize it first"):
        trainer_dataset(datasets.Dataset.from_list([{"text": "t"}]), "train_dataset")
    with pytest.raises(DataError, match=r"^train_dataset: no input_ids column \(columns \['x'\]\)"):
        trainer_dataset(datasets.Dataset.from_list([{"x": 1}]), "train_dataset")
    with pytest.raises(DataError, match=r"^train_dataset: the dataset has no rows"):
        trainer_dataset(datasets.Dataset.from_dict({"input_ids": []}), "train_dataset")
    tokens = datasets.Dataset.from_dict({"input_ids": IDS})
    with pytest.raises(DataError, match=r"^train_dataset: a DatasetDict of splits 'train' \(expected one split"):
        trainer_dataset(datasets.DatasetDict(train=tokens), "train_dataset")
    with pytest.raises(DataError, match=r"^train_dataset: an IterableDataset \(streaming\) here"):
        trainer_dataset(tokens.to_iterable_dataset(), "train_dataset")
    plain = TokenizedDataset.from_examples([(IDS[0], IDS[0])])
    assert trainer_dataset(plain, "train_dataset") is plain  # what is not a `datasets` object passes as it is
    evals = {"a": plain, "b": plain}
    assert trainer_dataset(evals, "eval_dataset") is evals


# ---- the Trainer --------------------------------------------------------------------------------------------
def small_model() -> CausalLM:
    config = ModelConfig(
        vocab_size=320,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=128,
        eos_token_id=258,
        pad_token_id=256,
    )
    model = CausalLM(config, use_kernels=False)
    model.init_weights(0)
    return model


def train_losses(tmp_path, train_dataset, eval_dataset=None) -> tuple[list[float], Trainer]:
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=2,
        max_steps=3,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        seed=7,
        optim="adamw_torch",
    )
    trainer = Trainer(model=small_model(), args=args, train_dataset=train_dataset, eval_dataset=eval_dataset)
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h], trainer


def test_the_trainer_trains_on_a_tokenized_dataset_as_on_the_same_tokens(tmp_path, tok):
    raw = datasets.Dataset.from_list(generate_tasks(8, seed=3))
    tokens = tokenize_sft_dataset(raw, processing_class=tok, cutoff_len=64, show_progress=False)  # as the README
    as_hf = datasets.Dataset.from_dict(
        {"input_ids": [ex["input_ids"].tolist() for ex in tokens], "labels": [ex["labels"].tolist() for ex in tokens]}
    )
    want, _ = train_losses(tmp_path / "a", tokens)
    got, trainer = train_losses(tmp_path / "b", as_hf, eval_dataset=datasets.DatasetDict(val=as_hf))
    assert len(want) == 3 and got == want
    assert isinstance(trainer.train_dataset, TokenizedDataset)
    trainer.train_dataset = as_hf  # set after __init__: converted when training starts
    trainer.train()
    assert isinstance(trainer.train_dataset, TokenizedDataset)
    metrics = trainer.evaluate()
    assert torch.isfinite(torch.tensor(metrics["eval_val_loss"]))
    assert trainer.evaluate(as_hf)["eval_loss"] == metrics["eval_val_loss"]


def test_the_trainer_refuses_a_raw_dataset_before_building_anything(tmp_path):
    raw = datasets.Dataset.from_list([{"messages": [USER, ANSWER]}])
    args = TrainingArguments(output_dir=str(tmp_path / "out"), report_to=[])
    with pytest.raises(DataError, match=r"^train_dataset: the dataset holds raw messages records"):
        Trainer(model=small_model(), args=args, train_dataset=raw)
    with pytest.raises(DataError, match=r"^eval_dataset: the dataset holds raw messages records"):
        Trainer(model=small_model(), args=args, eval_dataset=raw.to_iterable_dataset())  # read whole, then refused
    assert not (tmp_path / "out").exists()


def test_a_streamed_eval_set_evaluates_as_the_same_rows_in_memory(tmp_path, tok):
    """An IterableDataset as eval_dataset (HF's Trainer evaluates every row of one) is read whole: Trainer with
    tokens, SFTTrainer with raw rows, in __init__ and in evaluate(), alone or in a dict, give the Dataset's eval
    loss; a bad row is named with the stream's split."""
    rows = generate_tasks(6, seed=3)
    tokens = tokenize_sft_dataset(rows, processing_class=tok, cutoff_len=64, show_progress=False)
    as_hf = datasets.Dataset.from_dict(
        {"input_ids": [ex["input_ids"].tolist() for ex in tokens], "labels": [ex["labels"].tolist() for ex in tokens]}
    )
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), report_to=[], per_device_eval_batch_size=4, cutoff_len=64
    )
    trainer = Trainer(model=small_model(), args=args, eval_dataset=as_hf.to_iterable_dataset(num_shards=2))
    want = trainer.evaluate(as_hf)["eval_loss"]
    assert trainer.evaluate()["eval_loss"] == want
    assert trainer.evaluate({"val": as_hf.to_iterable_dataset()})["eval_val_loss"] == want
    sft = SFTTrainer(
        model=small_model(),
        args=args,
        eval_dataset=datasets.Dataset.from_list(rows).to_iterable_dataset(),
        processing_class=tok,
    )
    assert sft.evaluate()["eval_loss"] == want
    bad = [
        {"messages": [USER, ANSWER]},
        {"messages": [USER, ANSWER]},
        {"messages": [USER, {"role": "bot", "content": "x"}]},
    ]
    path = write_jsonl(tmp_path / "bad.jsonl", bad)
    bad = datasets.load_dataset("json", data_files={"test": str(path)}, split="test", streaming=True)
    with pytest.raises(DataError, match=r"^eval_dataset split 'test' row 2: messages\[1\]\.role is 'bot'"):
        sft.evaluate(bad)


# ---- preference pairs ---------------------------------------------------------------------------------------
PAIRS = {
    "standard": [
        {"prompt": "2+3?", "chosen": "5", "rejected": "6"},
        {"chosen": "Q: sky? A: blue", "rejected": "Q: sky? A: green"},  # implicit prompt (a null prompt in a Dataset)
    ],
    "conversational": [
        {"prompt": [USER], "chosen": [ANSWER], "rejected": [{"role": "assistant", "content": "bye"}]},
        {  # implicit prompt: the shared first messages
            "chosen": [SYSTEM, USER, ANSWER],
            "rejected": [SYSTEM, USER, {"role": "assistant", "content": "go away " * 20}],  # > max_length 60
        },
    ],
    "sharegpt": [
        {
            "conversations": [{"from": "human", "value": "hi"}],
            "chosen": {"from": "gpt", "value": "yo"},
            "rejected": {"from": "gpt", "value": "no"},
            "system": "calc",
        },
        {
            "conversations": [{"from": "human", "value": "a"}],
            "chosen": {"from": "gpt", "value": "b"},
            "rejected": {"from": "gpt", "value": "c"},
        },
    ],
    "alpaca": [
        {"instruction": "add", "input": "1 2", "chosen": "3", "rejected": "4"},
        {"instruction": "hi", "chosen": "yo", "rejected": "no", "history": [["q", "a"]]},
        {"instruction": "long " * 30, "chosen": "x", "rejected": "y"},  # > max_length 60
    ],
}
PAIR_OPTIONS = [{}, {"max_length": 60}, {"max_length": 60, "truncation_mode": "keep_end"}, {"max_prompt_length": 8}]


def same_pairs(a: PreferenceDataset, b: PreferenceDataset) -> None:
    for part in ("prompt", "chosen", "rejected"):
        np.testing.assert_array_equal(a.ids[part], b.ids[part])
        np.testing.assert_array_equal(a.offsets[part], b.offsets[part])


@pytest.mark.parametrize("options", PAIR_OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "default")
@pytest.mark.parametrize("name", sorted(PAIRS))
def test_preference_pairs_of_a_dataset_tokenize_as_a_jsonl_file_of_the_same_records(tmp_path, tok, name, options):
    records = PAIRS[name]
    from_file = load_preference_dataset(write_jsonl(tmp_path / "p.jsonl", records), tok, show_progress=False, **options)
    from_rows = tokenize_preference_dataset(as_dataset(records), tok, show_progress=False, **options)
    same_pairs(from_rows, from_file)
    same_pairs(tokenize_preference_dataset(records, tok, show_progress=False, **options), from_file)  # a list
    for key in ("pairs_read", "dropped", "truncated", "options", "pairs"):
        assert from_rows.summary[key] == from_file.summary[key], key
    assert from_rows.summary["formats"] == {"dataset": name}


def test_a_bad_pair_is_named_by_its_index_and_split(tmp_path, tok):
    records = [{"prompt": "p", "chosen": "a", "rejected": "b"}, {"prompt": "p", "chosen": "a", "rejected": "a"}]
    with pytest.raises(DataError) as from_file:
        load_preference_dataset(write_jsonl(tmp_path / "p.jsonl", records), tok, show_progress=False)
    message = str(from_file.value).split(": ", 1)[1]
    assert message.startswith("chosen and rejected are identical")
    with pytest.raises(DataError) as named:
        tokenize_preference_dataset(as_dataset(records, split="train"), tok, show_progress=False)
    assert str(named.value) == f"split 'train' row 1: {message}"
    kept = tokenize_preference_dataset(as_dataset(records), tok, skip_bad_examples=True, show_progress=False)
    assert len(kept) == 1 and kept.summary["dropped"] == {"identical_answers": 1}
    with pytest.raises(DataError, match=r"^dataset: cannot tell the data format from the columns \['prompt', 'answer'"):
        tokenize_preference_dataset(datasets.Dataset.from_list([{"prompt": "p", "answer": "a"}]), tok)
    with pytest.raises(DataError, match=r"^split 'x' row 0: field 'chosen' is a number \(expected a string\)"):
        tokenize_preference_dataset(as_dataset([{"prompt": "p", "chosen": 1, "rejected": 2}]), tok, split="x")
    with pytest.raises(ValueError, match=r"^truncation_mode='middle': expected one of keep_start, keep_end"):
        tokenize_preference_dataset(as_dataset(records), tok, truncation_mode="middle")


def test_what_the_method_trainers_tokenize_and_what_they_pass_on(tok):
    """tokenized_splits: raw parts tokenized (a DatasetDict as train_dataset by its 'train' split, an eval dict split
    by split), errors named by the argument, the rest passed on as it is."""
    seen = []

    def tokenize(rows, split):
        seen.append((len(rows), split))
        return tokenize_sft_dataset(rows, tok, split=split, show_progress=False)

    raw = as_dataset(RECORDS["messages"])
    tokens = datasets.Dataset.from_dict({"input_ids": IDS})
    assert isinstance(tokenized_splits(raw, "train_dataset", tokenize, "input_ids"), TokenizedDataset)
    assert isinstance(tokenized_splits(RECORDS["text"], "train_dataset", tokenize, "input_ids"), TokenizedDataset)
    tokenized_splits(datasets.DatasetDict(train=raw, test=raw.select([0])), "train_dataset", tokenize, "input_ids")
    evals = tokenized_splits(datasets.DatasetDict(a=raw, b=tokens), "eval_dataset", tokenize, "input_ids")
    assert seen == [(3, None), (2, None), (3, "train"), (3, "a")]
    assert isinstance(evals["a"], TokenizedDataset) and evals["b"] is tokens  # tokenized: the Trainer converts it
    streamed = raw.to_iterable_dataset()
    for passed in (tokens, streamed, [{"input_ids": [1, 2]}], [], None):
        assert tokenized_splits(passed, "train_dataset", tokenize, "input_ids") is passed
    with pytest.raises(DataError, match=r"^train_dataset: raw records need a processing_class"):
        tokenized_splits(tokens, "train_dataset", None, None)  # pairs (token_column None): any Dataset is raw
    with pytest.raises(DataError, match=r"^train_dataset: a DatasetDict of splits 'a', 'b', none of them 'train'"):
        tokenized_splits(datasets.DatasetDict(a=raw, b=raw), "train_dataset", tokenize, "input_ids")
    with pytest.raises(DataError, match=r"^eval_dataset: raw records need a processing_class to tokenize them"):
        tokenized_splits({"val": raw}, "eval_dataset", None, "input_ids")
    bad = as_dataset([{"messages": [USER, ANSWER]}, {"messages": [USER, {"role": "bot", "content": "x"}]}])
    with pytest.raises(DataError, match=r"^eval_dataset split 'val' row 1: messages\[1\]\.role is 'bot'"):
        tokenized_splits({"val": bad}, "eval_dataset", tokenize, "input_ids")
    with pytest.raises(DataError, match=r"^train_dataset row 1: messages\[1\]\.role is 'bot'"):
        tokenized_splits(bad, "train_dataset", tokenize, "input_ids")
    with pytest.raises(DataError, match=r"^train_dataset: cannot tell the data format from the columns \['x'\]"):
        tokenized_splits(datasets.Dataset.from_list([{"x": 1}]), "train_dataset", tokenize, "input_ids")
