"""`--dataset_name` sources and tokenising in several processes (issue 32 items 2 and 3), on local data only (no test
touches the network): a save_to_disk directory, json/parquet/csv builders with data_files and a directory of files
tokenize exactly as the same records in a JSONL file; splits, columns, bad rows, a builder without files and a Hub id
without network are one-line errors; mixtures follow `datasets.interleave_datasets` (seeded); `num_proc` gives the
tokens, labels, order, drops and first error of one process, bit for bit, and leaves the cache key alone."""

import logging

import huggingface_hub
import numpy as np
import pytest

from tests.trainer.data.test_hf_datasets import ANSWER, OPTIONS, RECORDS, USER, as_dataset, same_tokens, write_jsonl
from trainer.data import sft_data
from trainer.data.hf_datasets import tokenize_sft_dataset
from trainer.data.hf_sources import check_sources, dataset_digest, load_preference_sources, load_sft_sources, mix
from trainer.data.preference_data import load_preference_dataset
from trainer.data.sft_data import DataError, TokenizedDataset, load_sft_dataset
from trainer.data.tasks import generate_tasks, preference_pair
from trainer.data.tokenizer import byte_level_tokenizer

datasets = pytest.importorskip("datasets")  # an optional extra (kernelwright[datasets])


@pytest.fixture(scope="module")
def tok():
    return byte_level_tokenizer()


@pytest.fixture(autouse=True)
def datasets_cache(tmp_path, monkeypatch):
    """load_dataset's Arrow cache in the test's own directory, not the user's."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))


def load(names, tok, **kwargs):
    return load_sft_sources(names, tok, show_progress=False, **kwargs)


def saved(tmp_path, name, **splits):
    """A DatasetDict of `splits` (records) saved with save_to_disk in tmp_path/name."""
    path = tmp_path / name
    datasets.DatasetDict({k: as_dataset(v) for k, v in splits.items()}).save_to_disk(str(path))
    return str(path)


# ---- sources: the same tokens as a file ----------------------------------------------------------------------
@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(o) or "default")
@pytest.mark.parametrize("name", sorted(RECORDS))
def test_a_saved_dataset_tokenizes_as_a_jsonl_file_of_the_same_records(tmp_path, tok, name, options):
    records = RECORDS[name]
    want = load_sft_dataset(write_jsonl(tmp_path / "d.jsonl", records), tok, show_progress=False, **options)
    got = load([saved(tmp_path, "ds", train=records)], tok, **options)
    same_tokens(got.train, want)
    for key in ("examples_read", "dropped", "truncated", "options", "supervised_tokens"):
        assert got.train.summary[key] == want.summary[key], key
    assert got.eval is None and got.tokenized == [got.train]
    assert got.train.summary["formats"] == {f"{tmp_path / 'ds'}:train": name.replace("_lists", "")}


def test_builders_with_data_files_and_a_directory_of_files_read_as_the_file(tmp_path, tok, monkeypatch):
    records = RECORDS["prompt_completion"]
    jsonl = write_jsonl(tmp_path / "d.jsonl", records)
    want = load_sft_dataset(jsonl, tok, show_progress=False)
    as_dataset(records).to_parquet(str(tmp_path / "d.parquet"))
    as_dataset(records).to_csv(str(tmp_path / "d.csv"), index=False)
    (tmp_path / "dir").mkdir()
    write_jsonl(tmp_path / "dir" / "part.jsonl", records)
    for builder, files in (("json", jsonl), ("parquet", tmp_path / "d.parquet"), ("csv", tmp_path / "d.csv")):
        got = load([builder], tok, data_files=[str(files)])
        same_tokens(got.train, want)
        assert got.train.summary_text().startswith(f"data: 2 examples from {builder}:train (prompt_completion)")
    same_tokens(load([str(tmp_path / "dir")], tok).train, want)
    monkeypatch.chdir(tmp_path)  # data_files: paths and glob patterns relative to the working directory
    same_tokens(load(["json"], tok, data_files=["*.jsonl"]).train, want)


def test_a_test_split_is_the_eval_data_and_a_single_saved_dataset_is_the_train_split(tmp_path, tok):
    path = saved(tmp_path, "ds", train=RECORDS["alpaca"], validation=RECORDS["sharegpt"])
    got = load([path], tok, test_split="validation")
    same_tokens(got.eval, tokenize_sft_dataset(as_dataset(RECORDS["sharegpt"]), tok, show_progress=False))
    assert len(got.tokenized) == 2
    with pytest.raises(DataError, match=r"no split 'test' \(its splits: train, validation\); set --dataset_test_split"):
        load([path], tok, test_split="test")
    with pytest.raises(DataError, match=r"no split 'tr' \(its splits: train, validation\); set --dataset_train_split"):
        load([path], tok, train_split="tr")
    as_dataset(RECORDS["text"]).save_to_disk(str(tmp_path / "one"))  # a Dataset: no splits
    want = tokenize_sft_dataset(as_dataset(RECORDS["text"]), tok, show_progress=False)
    same_tokens(load([str(tmp_path / "one")], tok, train_split="anything").train, want)
    with pytest.raises(DataError, match=r"a Dataset saved without splits \(it is the training data\), so no split 'x'"):
        load([str(tmp_path / "one")], tok, test_split="x")


def test_columns_bad_rows_and_sources_that_cannot_be_read_are_one_line_errors(tmp_path, tok):
    path = saved(tmp_path, "ds", train=[{"question": "q", "answer": "a"}])
    with pytest.raises(DataError, match=r":train: no column names a data format \(columns: question, answer\)"):
        load([path], tok)
    path = saved(tmp_path, "alp", train=[{"instruction": "i", "input": ""}])
    with pytest.raises(DataError, match=r"alp:train: no column 'output' \(columns: instruction, input\)"):
        load([path], tok)
    with pytest.raises(DataError, match=r"train: no column 'text' \(columns: instruction, input\)"):
        load([path], tok, data_format="text")
    records = [{"messages": [USER, ANSWER]}] * 3 + [{"messages": [USER, {"role": "bot", "content": "x"}]}]
    path = saved(tmp_path, "bad", train=records)
    with pytest.raises(DataError) as bad:
        load([path], tok)
    assert str(bad.value).startswith(f"{path}:train[3]: messages[1].role is 'bot'")
    assert len(load([path], tok, skip_bad_examples=True).train) == 3
    with pytest.raises(DataError, match=r"^dataset_name='json': the json builder reads --data_files"):
        check_sources(["json"], None, "concat", None)
    with pytest.raises(DataError, match=r"^data_files: nothing\*.jsonl: no such file"):
        check_sources(["json"], ["nothing*.jsonl"], "concat", None)
    (tmp_path / "broken.jsonl").write_text('{"text": "a"}\n{oops\n')
    with pytest.raises(DataError, match=r"^dataset_name='json': ") as broken:
        load(["json"], tok, data_files=[str(tmp_path / "broken.jsonl")])
    assert "\n" not in str(broken.value)


def test_a_hub_id_without_network_is_one_line_before_anything_is_read(monkeypatch, tok, caplog):
    """Online: a closed port on this machine stands for the Hub (nothing leaves it); offline: datasets answers."""
    for flag in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(flag, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    with pytest.raises(DataError, match=r"^dataset_name='owner/chat': not a local directory or a builder .* the Hub "):
        check_sources(["owner/chat"], None, "concat", None)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # read by datasets and huggingface_hub when they were imported
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    check_sources(["owner/chat"], None, "concat", None)  # offline: the local cache may hold it
    with caplog.at_level(logging.DEBUG), pytest.raises(DataError) as exc:
        load(["owner/chat"], tok)
    assert str(exc.value).startswith("dataset_name='owner/chat': not a local directory or a builder (json, parquet,")
    assert "so a Hub id, and the Hub is off limits (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE)" in str(exc.value)
    assert "\n" not in str(exc.value)


# ---- mixtures ------------------------------------------------------------------------------------------------
def _tagged(n, tag):
    return [{"prompt": f"{tag}{i}", "completion": f"{tag}-{i}"} for i in range(n)]


@pytest.mark.parametrize("strategy", ["interleave_under", "interleave_over"])
@pytest.mark.parametrize("probs", [None, [0.7, 0.3]])
def test_a_mixture_is_datasets_interleave_of_the_sources(tmp_path, tok, strategy, probs):
    a, b = _tagged(7, "a"), _tagged(3, "b")
    got = load(
        [saved(tmp_path, "a", train=a), saved(tmp_path, "b", train=b)],
        tok,
        mix_strategy=strategy,
        interleave_probs=probs,
        seed=5,
    )
    stopping = "first_exhausted" if strategy == "interleave_under" else "all_exhausted"
    rows = datasets.interleave_datasets(
        [as_dataset(a), as_dataset(b)], probabilities=probs, seed=5, stopping_strategy=stopping
    )
    same_tokens(got.train, tokenize_sft_dataset(rows, tok, show_progress=False))
    assert got.train.summary["mixture"] == strategy and got.train.summary["examples_read"] == 10
    again = load([str(tmp_path / "a"), str(tmp_path / "b")], tok, mix_strategy=strategy, interleave_probs=probs, seed=5)
    same_tokens(again.train, got.train)


def test_concat_keeps_each_source_its_format_and_comma_separated_names_work(tmp_path, tok):
    a, b = saved(tmp_path, "a", train=RECORDS["alpaca"]), saved(tmp_path, "b", train=RECORDS["messages"])
    got = load([f"{a},{b}"], tok)
    parts = [tokenize_sft_dataset(as_dataset(RECORDS[k]), tok, show_progress=False) for k in ("alpaca", "messages")]
    np.testing.assert_array_equal(got.train.input_ids, np.concatenate([p.input_ids for p in parts]))
    np.testing.assert_array_equal(got.train.labels, np.concatenate([p.labels for p in parts]))
    assert got.train.summary["formats"] == {f"{a}:train": "alpaca", f"{b}:train": "messages"}
    assert got.train.summary["dropped"] == {"no_targets": 1}
    with pytest.raises(DataError, match=r"^interleave_probs: 1 values for 2 datasets"):
        load([a, b], tok, mix_strategy="interleave_under", interleave_probs=[1.0])
    with pytest.raises(DataError, match=r"^interleave_probs: \[0.5, 0.6\] \(expected probabilities >= 0 that sum"):
        load([a, b], tok, mix_strategy="interleave_over", interleave_probs=[0.5, 0.6])
    with pytest.raises(DataError, match=r"^data_files: given with 2 dataset_name values"):
        load([a, b], tok, data_files=["x.jsonl"])
    with pytest.raises(DataError, match=r"^dataset_config: .*/a is a saved dataset \(save_to_disk\), which takes no"):
        load([a], tok, config="default")
    with pytest.raises(DataError, match=r"^mix_strategy='shuffle'"):
        mix([got.train, got.train], "shuffle")


# ---- several processes -------------------------------------------------------------------------------------------
def _many_records(n=300):
    """Every format's records, bad ones and ones truncated away among them, in a fixed mixed order."""
    records = []
    for i in range(n):
        kind = i % 6
        if kind == 0:
            records.append({"messages": [USER, {"role": "assistant", "content": f"answer {i} " * (1 + i % 7)}]})
        elif kind == 1:
            records.append({"messages": [USER, {"role": "bot", "content": "x"}]})  # bad: unknown_role
        elif kind == 2:
            records.append({"messages": [{"role": "user", "content": "long " * 20}, ANSWER]})  # truncated away
        elif kind == 3:
            records.append({"messages": [USER]})  # no_targets
        else:
            records.append({"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}]})
    return records


def _same_everything(a: TokenizedDataset, b: TokenizedDataset):
    same_tokens(a, b)
    assert {k: v for k, v in a.summary.items() if k != "cache"} == {k: v for k, v in b.summary.items() if k != "cache"}


def test_num_proc_gives_the_tokens_labels_order_drops_and_errors_of_one_process(tmp_path, tok, caplog, monkeypatch):
    monkeypatch.setattr(sft_data, "_BLOCK_PER_PROCESS", 7)  # blocks of 14 or 21 items: many, the last one short
    records = _many_records()
    path = write_jsonl(tmp_path / "d.jsonl", records)
    options = dict(cutoff_len=40, skip_bad_examples=True, show_progress=False)
    with caplog.at_level(logging.WARNING):
        one = load_sft_dataset(path, tok, **options)
    warnings_one, _ = [r.getMessage() for r in caplog.records], caplog.clear()
    with caplog.at_level(logging.WARNING):
        three = load_sft_dataset(path, tok, num_proc=3, **options)
    _same_everything(three, one)
    assert [r.getMessage() for r in caplog.records] == warnings_one  # the same rows named, in the same order
    assert one.summary["dropped"] == {"no_targets": 50, "no_targets_after_truncation": 50, "unknown_role": 50}
    # the first bad row stops both, with the same line
    with pytest.raises(DataError) as serial:
        load_sft_dataset(path, tok, cutoff_len=40, show_progress=False)
    with pytest.raises(DataError) as parallel:
        load_sft_dataset(path, tok, cutoff_len=40, show_progress=False, num_proc=2)
    assert (
        str(parallel.value)
        == str(serial.value)
        == (f"{path}:2: messages[1].role is 'bot' (expected one of system, user, assistant, tool)")
    )
    ds = as_dataset(records)
    _same_everything(tokenize_sft_dataset(ds, tok, num_proc=2, **options), tokenize_sft_dataset(ds, tok, **options))
    src = saved(tmp_path, "ds", train=records)
    from_source = load([src], tok, num_proc=2, cutoff_len=40, skip_bad_examples=True).train
    same_tokens(from_source, one)
    assert all(from_source.summary[k] == one.summary[k] for k in ("examples_read", "dropped", "truncated"))


def test_the_cache_key_follows_the_rows_not_num_proc(tmp_path, tok):
    cache = tmp_path / "cache"
    path = saved(tmp_path, "ds", train=RECORDS["messages"])
    first = load([path], tok, cache_dir=cache)
    assert first.train.summary["cache_hit"] is False and len([p for p in cache.glob("data-*") if p.is_dir()]) == 1
    again = load([path], tok, cache_dir=cache, num_proc=2)
    assert again.train.summary["cache_hit"] is True and again.train.summary["cache"] == first.train.summary["cache"]
    same_tokens(again.train, first.train)
    changed = saved(tmp_path, "ds2", train=RECORDS["messages"][:2])
    assert load([changed], tok, cache_dir=cache).train.summary["cache_hit"] is False
    ds = as_dataset(RECORDS["messages"])
    assert dataset_digest(ds) == dataset_digest(as_dataset(RECORDS["messages"]))
    assert dataset_digest(ds) != dataset_digest(ds.select([1, 0, 2]))  # the order is part of it
    assert dataset_digest(ds.select([0, 1])) != dataset_digest(ds)


def test_preference_pairs_from_sources_are_the_pairs_of_the_same_records_in_a_file(tmp_path, tok):
    """Stage dpo's --dataset_name: a saved DatasetDict's train and test splits, and two sources one after the other,
    give the pairs of JSONL files of the same records (cached by the rows' digest: a second read hits); a bad pair is
    named source:split[i]."""
    records = [preference_pair(ex) for ex in generate_tasks(30, 5)]
    train, test = records[:20], records[20:]
    saved(tmp_path, "pairs", train=train, test=test)
    kw = dict(max_length=64, show_progress=False)
    got_train, got_test = load_preference_sources(
        [str(tmp_path / "pairs")], tok, test_split="test", cache_dir=tmp_path / "cache", **kw
    )
    want_train = load_preference_dataset(write_jsonl(tmp_path / "train.jsonl", train), tok, **kw)
    want_test = load_preference_dataset(write_jsonl(tmp_path / "test.jsonl", test), tok, **kw)
    for got, want in ((got_train, want_train), (got_test, want_test)):
        assert all(np.array_equal(got.ids[k], want.ids[k]) for k in ("prompt", "chosen", "rejected"))
        assert all(np.array_equal(got.offsets[k], want.offsets[k]) for k in ("prompt", "chosen", "rejected"))
    again, _ = load_preference_sources([str(tmp_path / "pairs")], tok, cache_dir=tmp_path / "cache", **kw)
    assert again.summary["cache_hit"] and np.array_equal(again.ids["chosen"], want_train.ids["chosen"])
    saved(tmp_path, "more", train=test)
    both, _ = load_preference_sources(f"{tmp_path / 'pairs'},{tmp_path / 'more'}", tok, **kw)
    assert len(both) == 30 and np.array_equal(
        both.ids["chosen"], np.concatenate([want_train.ids["chosen"], want_test.ids["chosen"]])
    )
    saved(tmp_path, "bad", train=train[:3] + [{**train[3], "rejected": train[3]["chosen"]}])
    with pytest.raises(DataError, match=r"bad:train\[3\]: chosen and rejected are identical"):
        load_preference_sources([str(tmp_path / "bad")], tok, **kw)
