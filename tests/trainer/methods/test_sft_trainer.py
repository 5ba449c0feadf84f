"""SFTTrainer (trainer/methods/sft.py): TRL's constructor over the Trainer. Raw datasets (a Dataset, a DatasetDict's
train split, a list of records) train on the tokens of a JSONL file of the same records, with the command's options;
an eval DatasetDict is evaluated split by split; the model may be a preset name and the tokenizer a path or a
transformers tokenizer; tokenized and streaming data go to the Trainer as they are; bad input is one line."""

import pytest
import torch

from tests.trainer.data.test_hf_datasets import RECORDS, as_dataset, same_tokens, small_model, write_jsonl
from trainer.build import build_model
from trainer.config.args import TrainingArguments
from trainer.data.sft_data import DataError, load_sft_dataset
from trainer.data.streaming import SFTStream
from trainer.data.tasks import generate_tasks
from trainer.data.tokenizer import byte_level_tokenizer
from trainer.loop.trainer import Trainer
from trainer.methods.sft import SFTTrainer

datasets = pytest.importorskip("datasets")  # an optional extra (kernelwright[datasets])


@pytest.fixture(scope="module")
def tok():
    return byte_level_tokenizer()


def make_args(tmp_path, **overrides) -> TrainingArguments:
    values = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=2,
        max_steps=2,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        seed=7,
        optim="adamw_torch",
        use_kernels=False,
    )
    values.update(overrides)
    return TrainingArguments(**values)


def losses(trainer) -> list[float]:
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


@pytest.mark.parametrize(
    "name, options",
    [
        ("messages", {}),
        ("messages", {"mask_history": True}),
        ("alpaca", {"cutoff_len": 40}),  # one example truncated away: dropped by both
        ("prompt_completion", {"train_on_prompt": True}),
        ("sharegpt", {"data_format": "sharegpt", "skip_bad_examples": True}),
    ],
)
def test_raw_data_trains_on_the_tokens_of_a_file_of_the_same_records(tmp_path, tok, name, options):
    records, options = RECORDS[name], dict(options)
    cutoff_len = options.pop("cutoff_len", 2048)
    args = make_args(tmp_path, cutoff_len=cutoff_len)
    want = load_sft_dataset(write_jsonl(tmp_path / "d.jsonl", records), tok, cutoff_len=cutoff_len, **options)
    for given in (as_dataset(records), datasets.DatasetDict(train=as_dataset(records)), records):
        trainer = SFTTrainer(small_model(), args, train_dataset=given, processing_class=tok, **options)
        same_tokens(trainer.train_dataset, want)
        assert trainer.train_dataset.summary["dropped"] == want.summary["dropped"]
    trainer = SFTTrainer(small_model(), args, train_dataset=as_dataset(records), processing_class=tok, **options)
    trained = losses(trainer)
    expected = losses(Trainer(small_model(), make_args(tmp_path / "t"), train_dataset=want, processing_class=tok))
    assert len(trained) == 2 and trained == expected


def test_an_eval_datasetdict_is_evaluated_split_by_split(tmp_path, tok):
    raw = datasets.Dataset.from_list(generate_tasks(8, seed=3))
    evals = datasets.DatasetDict(val=raw.select(range(4)), test=raw.select(range(4, 8)))
    args = make_args(tmp_path)
    trainer = SFTTrainer(small_model(), args, train_dataset=raw, eval_dataset=evals, processing_class=tok)
    assert set(trainer.eval_dataset) == {"val", "test"}
    metrics = trainer.evaluate()
    for split in ("val", "test"):
        tokens = load_sft_dataset(write_jsonl(tmp_path / f"{split}.jsonl", evals[split].to_list()), tok)
        assert metrics[f"eval_{split}_loss"] == trainer.evaluate(tokens)["eval_loss"]
    assert trainer.evaluate(evals["val"])["eval_loss"] == metrics["eval_val_loss"]  # raw, given to evaluate()


def test_a_model_name_a_tokenizer_path_and_a_transformers_tokenizer(tmp_path, tok):
    """model="tiny" is built as build_model builds it, with its own tokenizer when none is given; a tokenizer directory
    and the transformers tokenizer read from it tokenize as ours."""
    transformers = pytest.importorskip("transformers")
    args = make_args(tmp_path)
    raw = as_dataset(RECORDS["messages"])
    want = SFTTrainer(small_model(), args, train_dataset=raw, processing_class=tok).train_dataset
    trainer = SFTTrainer("tiny", args, train_dataset=raw)
    same_tokens(trainer.train_dataset, want)
    built, _ = build_model("tiny", args)
    for (key, got), expected in zip(trainer.model.state_dict().items(), built.state_dict().values()):
        torch.testing.assert_close(got, expected, rtol=0, atol=0, msg=key)
    tok.save_pretrained(tmp_path / "tok")
    by_path = SFTTrainer(small_model(), args, train_dataset=raw, processing_class=str(tmp_path / "tok"))
    same_tokens(by_path.train_dataset, want)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "tok")
    by_hf = SFTTrainer(small_model(), args, train_dataset=raw, processing_class=hf_tokenizer)
    same_tokens(by_hf.train_dataset, want)
    assert by_hf.processing_class.chat_template == tok.chat_template


def test_tokenized_and_streamed_data_go_to_the_trainer_as_they_are(tmp_path, tok):
    raw = as_dataset(RECORDS["messages"])
    tokens = SFTTrainer(small_model(), make_args(tmp_path), train_dataset=raw, processing_class=tok).train_dataset
    as_hf = datasets.Dataset.from_dict(
        {"input_ids": [ex["input_ids"].tolist() for ex in tokens], "labels": [ex["labels"].tolist() for ex in tokens]}
    )
    trainer = SFTTrainer(small_model(), make_args(tmp_path), train_dataset=as_hf)  # no processing_class needed
    same_tokens(trainer.train_dataset, tokens)
    assert SFTTrainer(small_model(), make_args(tmp_path), train_dataset=tokens).train_dataset is tokens
    streamed = SFTTrainer(
        small_model(), make_args(tmp_path), train_dataset=raw.to_iterable_dataset(), processing_class=tok
    )
    assert isinstance(streamed.train_dataset, SFTStream) and streamed.train_dataset.formats == ["messages"]


def test_a_raw_iterable_dataset_streams_the_tokens_of_the_same_records(tmp_path, tok):
    """A streamed raw IterableDataset trains as the same records given whole do, in one buffer (packing_buffer >= the
    records: the stream's plan of its first buffer is the in-memory loader's first epoch)."""
    raw = datasets.Dataset.from_list(generate_tasks(12, seed=4))
    kw = dict(max_steps=3, packing_buffer=12, cutoff_len=64)
    whole = SFTTrainer(small_model(), make_args(tmp_path / "a", **kw), train_dataset=raw, processing_class=tok)
    whole.train()
    streamed = SFTTrainer(
        small_model(), make_args(tmp_path / "b", **kw), train_dataset=raw.to_iterable_dataset(), processing_class=tok
    )
    streamed.train()
    assert [h["loss"] for h in streamed.state.log_history if "loss" in h] == [
        h["loss"] for h in whole.state.log_history if "loss" in h
    ]


def test_bad_input_is_one_line_before_a_model_is_built(tmp_path, tok, monkeypatch):
    args = make_args(tmp_path)
    monkeypatch.setattr("trainer.methods.sft.build_model", lambda *a, **k: pytest.fail("built a model"))
    unknown = datasets.Dataset.from_list([{"question": "q", "answer": "a"}])
    with pytest.raises(DataError, match=r"^train_dataset: cannot tell the data format from the columns \['question'"):
        SFTTrainer("tiny", args, train_dataset=unknown)
    bad = as_dataset([{"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "x"}]}])
    with pytest.raises(DataError, match=r"^eval_dataset split 'val' row 0: messages\[1\]\.role is 'bot'"):
        SFTTrainer("tiny", args, train_dataset=RECORDS["text"], eval_dataset=datasets.DatasetDict(val=bad))
    with pytest.raises(DataError, match=r"^train_dataset: raw records need a processing_class to tokenize them"):
        SFTTrainer(small_model(), args, train_dataset=as_dataset(RECORDS["text"]))
    splits = datasets.DatasetDict(a=as_dataset(RECORDS["text"]))
    with pytest.raises(DataError, match=r"^train_dataset: a DatasetDict of splits 'a', none of them 'train'"):
        SFTTrainer(small_model(), args, train_dataset=splits, processing_class=tok)
    with pytest.raises(ValueError, match=r"^data_format='csv': expected one of auto, messages"):
        SFTTrainer(small_model(), args, train_dataset=RECORDS["text"], processing_class=tok, data_format="csv")
    with pytest.raises(ValueError, match=r"^train_on_prompt and mask_history cannot both be set"):
        SFTTrainer(small_model(), args, processing_class=tok, train_on_prompt=True, mask_history=True)
    feature_extractor = pytest.importorskip("transformers").BatchFeature()
    with pytest.raises(ValueError, match=r"^processing_class: a transformers BatchFeature \(expected a tokenizer"):
        SFTTrainer(small_model(), args, processing_class=feature_extractor)
    assert not (tmp_path / "out").exists()
