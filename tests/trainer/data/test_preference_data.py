"""Preference data (trainer/data/preference_data.py): the four formats and the implicit prompt, the prompt/answer split
token by token, truncation, bad pairs as file:line (or counted), the cache, and the batch of 2k rows.

Expected tokens are built independently of the code under test: the byte-level tokenizer encodes a concatenation
as the concatenation of the encodings, so a rendered ChatML conversation is the encoding of its turns' texts."""

import json

import numpy as np
import pytest

from trainer.data import cache
from trainer.data.preference_data import (
    PreferenceDataset,
    collate_pairs,
    load_preference_dataset,
    normalize_pair,
    tokenize_pair,
    truncate_pair,
)
from trainer.data.sft_data import DataError
from trainer.data.tokenizer import byte_level_tokenizer

IGN = -100


@pytest.fixture(scope="module")
def tok():
    return byte_level_tokenizer()


def write_jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def turn(tok, role, content):
    return tok.encode(f"<|im_start|>{role}\n{content}<|im_end|>\n")


def gen_prompt(tok):
    return tok.encode("<|im_start|>assistant\n")


def answer(tok, content):
    return tok.encode(f"{content}<|im_end|>\n")


USER, GOOD, BAD = "What is 2+3?", "5", "6"
RECORDS = {
    "standard": {"prompt": USER, "chosen": GOOD, "rejected": BAD},
    "conversational": {
        "prompt": [{"role": "user", "content": USER}],
        "chosen": [{"role": "assistant", "content": GOOD}],
        "rejected": [{"role": "assistant", "content": BAD}],
    },
    "conversational_implicit": {
        "chosen": [{"role": "user", "content": USER}, {"role": "assistant", "content": GOOD}],
        "rejected": [{"role": "user", "content": USER}, {"role": "assistant", "content": BAD}],
    },
    "sharegpt": {
        "conversations": [{"from": "human", "value": USER}],
        "chosen": {"from": "gpt", "value": GOOD},
        "rejected": {"from": "gpt", "value": BAD},
    },
    "alpaca": {"instruction": USER, "chosen": GOOD, "rejected": BAD},
}


@pytest.mark.parametrize("name", sorted(RECORDS))
def test_every_format_gives_the_same_tokens(tok, tmp_path, name):
    """Each format of the same pair: the prompt ends with the generation prompt, each answer is its text and the
    end-of-turn token (what the model learns to stop with)."""
    ds = load_preference_dataset(write_jsonl(tmp_path / "p.jsonl", [RECORDS[name]]), tok, show_progress=False)
    assert len(ds) == 1
    pair = ds[0]
    assert pair["prompt_ids"].tolist() == turn(tok, "user", USER) + gen_prompt(tok)
    assert pair["chosen_ids"].tolist() == answer(tok, GOOD)
    assert pair["rejected_ids"].tolist() == answer(tok, BAD)
    expected_format = "conversational" if name.startswith("conversational") else name
    assert list(ds.summary["formats"].values()) == [expected_format]


def test_implicit_prompt_of_standard_text_leaves_the_space_to_the_answers():
    """TRL's extract_prompt: the shared prefix, and a space before the first difference goes with the answers."""
    pair = normalize_pair({"chosen": "Q: sky colour? A: blue", "rejected": "Q: sky colour? A: green"}, "standard")
    assert pair["prompt"] == [{"role": "user", "content": "Q: sky colour? A:"}]
    assert pair["chosen"] == [{"role": "assistant", "content": " blue"}]
    assert pair["rejected"] == [{"role": "assistant", "content": " green"}]


def test_multi_turn_prompt_keeps_its_assistant_turns_unsupervised(tok):
    history = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": USER},
    ]
    rec = {
        "prompt": history,
        "chosen": [{"role": "assistant", "content": GOOD}],
        "rejected": [{"role": "assistant", "content": BAD}],
    }
    prompt, chosen, rejected = tokenize_pair(tok, normalize_pair(rec, "conversational"))
    assert prompt == (
        turn(tok, "user", "hi") + turn(tok, "assistant", "hello") + turn(tok, "user", USER) + gen_prompt(tok)
    )
    assert (chosen, rejected) == (answer(tok, GOOD), answer(tok, BAD))


def test_collate_puts_chosen_rows_first_with_labels_on_answers_only(tok):
    pairs = [
        {"prompt_ids": [5, 6, 7], "chosen_ids": [8, 9], "rejected_ids": [10]},
        {"prompt_ids": [11], "chosen_ids": [12], "rejected_ids": [13, 14, 15, 16]},
    ]
    batch = collate_pairs(pairs, pad_token_id=0, pad_to_multiple_of=4)
    assert batch["num_pairs"] == 2
    assert batch["input_ids"].tolist() == [
        [5, 6, 7, 8, 9, 0, 0, 0],
        [11, 12, 0, 0, 0, 0, 0, 0],
        [5, 6, 7, 10, 0, 0, 0, 0],
        [11, 13, 14, 15, 16, 0, 0, 0],
    ]
    assert batch["labels"].tolist() == [
        [IGN, IGN, IGN, 8, 9, IGN, IGN, IGN],
        [IGN, 12] + [IGN] * 6,
        [IGN, IGN, IGN, 10] + [IGN] * 4,
        [IGN, 13, 14, 15, 16, IGN, IGN, IGN],
    ]
    assert batch["attention_mask"].sum(1).tolist() == [5, 2, 4, 5]


@pytest.mark.parametrize(
    "mode, want",
    [
        ("keep_start", ([1, 2, 3, 4], [5, 6], [9, 10])),  # 8 tokens: the answers lose their ends
        ("keep_end", ([3, 4], [5, 6, 7, 8], [9, 10])),  # the longer sequence fits; the prompt loses its start
    ],
)
def test_truncation_modes(mode, want):
    got = truncate_pair([1, 2, 3, 4], [5, 6, 7, 8], [9, 10], max_length=6, max_prompt_length=None, truncation_mode=mode)
    assert got == want


def test_max_prompt_length_keeps_the_prompts_end():
    got = truncate_pair([1, 2, 3, 4], [5], [6], max_length=None, max_prompt_length=2, truncation_mode="keep_start")
    assert got == ([3, 4], [5], [6])


def test_a_pair_left_without_answer_tokens_is_dropped_and_counted(tok, tmp_path):
    long_prompt = {"prompt": "x" * 200, "chosen": GOOD, "rejected": BAD}
    path = write_jsonl(tmp_path / "p.jsonl", [RECORDS["standard"], long_prompt])
    ds = load_preference_dataset(path, tok, max_length=64, show_progress=False)
    assert len(ds) == 1 and ds.summary["dropped"] == {"no_targets_after_truncation": 1}
    assert "dropped 1 (no_targets_after_truncation 1)" in ds.summary_text()


@pytest.mark.parametrize(
    "first, record, message",
    [
        (
            "standard",
            {"prompt": USER, "chosen": GOOD, "rejected": GOOD},
            "p.jsonl:2: chosen and rejected are identical",
        ),
        ("standard", {"prompt": USER, "chosen": " ", "rejected": BAD}, "p.jsonl:2: field 'chosen' is empty"),
        ("standard", {"prompt": USER, "chosen": GOOD}, "p.jsonl:2: missing field 'rejected'"),
        (
            "conversational_implicit",
            {
                "chosen": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
                "rejected": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
            },
            "p.jsonl:2: the chosen answer is empty",
        ),
        (
            "sharegpt",
            {"conversations": [{"from": "human", "value": USER}], "chosen": GOOD, "rejected": BAD},
            "p.jsonl:2: field 'chosen' is a string",
        ),
        ("standard", "{not json", "p.jsonl:2: invalid JSON"),
    ],
)
def test_bad_pairs_are_one_line_with_file_and_line(tok, tmp_path, first, record, message):
    path = write_jsonl(tmp_path / "p.jsonl", [RECORDS[first], record])
    with pytest.raises(DataError, match=message.replace("+", r"\+").replace("(", r"\(")) as info:
        load_preference_dataset(path, tok, show_progress=False)
    assert "\n" not in str(info.value)
    skipped = load_preference_dataset(path, tok, skip_bad_examples=True, show_progress=False)
    assert len(skipped) == 1 and sum(skipped.summary["dropped"].values()) == 1


def test_no_usable_pair_and_unknown_keys(tok, tmp_path):
    with pytest.raises(DataError, match=r"p.jsonl:1: cannot tell the data format from the keys \['text'\]"):
        load_preference_dataset(write_jsonl(tmp_path / "p.jsonl", [{"text": "hi"}]), tok, show_progress=False)
    with pytest.raises(DataError, match="no usable pairs"):
        load_preference_dataset(
            write_jsonl(tmp_path / "q.jsonl", [{"prompt": "x" * 100, "chosen": "a", "rejected": "b"}]),
            tok,
            max_length=16,
            show_progress=False,
        )


def test_bad_options_name_the_argument(tok, tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [RECORDS["standard"]])
    for kwargs, name in (
        (dict(truncation_mode="keep_middle"), "truncation_mode"),
        (dict(max_length=1), "max_length"),
        (dict(data_format="ranking"), "data_format"),
    ):
        with pytest.raises(ValueError, match=name):
            load_preference_dataset(path, tok, show_progress=False, **kwargs)


def test_cache_round_trip_and_select(tok, tmp_path):
    path = write_jsonl(
        tmp_path / "p.jsonl",
        [
            {"prompt": f"{a}+{b}?", "chosen": str(a + b), "rejected": str(a + b + 1)}
            for a, b in ((1, 2), (30, 4), (5, 600), (7, 8), (90, 10), (11, 1200))
        ],
    )
    first = load_preference_dataset(path, tok, cache_dir=tmp_path / "cache", show_progress=False)
    again = load_preference_dataset(path, tok, cache_dir=tmp_path / "cache", show_progress=False)
    assert not first.summary["cache_hit"] and again.summary["cache_hit"]
    for i in range(len(first)):
        assert all(np.array_equal(first[i][k], again[i][k]) for k in first[i])
    other = load_preference_dataset(
        path, tok, cache_dir=tmp_path / "cache", truncation_mode="keep_end", show_progress=False
    )
    assert not other.summary["cache_hit"]  # the options are part of the key
    picked = first.select([5, 0])
    assert picked[0]["chosen_ids"].tolist() == first[5]["chosen_ids"].tolist()
    assert picked.lengths.tolist() == [first.lengths[5], first.lengths[0]]


def test_pairs_are_written_as_they_come_and_mapped(tok, tmp_path, monkeypatch):
    """Cold or warm, cached or not, the pairs' arrays are memory-mapped from files written through bounded buffers
    (cache.WRITE_BUFFER, here a few values): the same pairs and summary as the pairs gathered in memory."""
    records = [{"prompt": f"{a}+{b}?" * a, "chosen": str(a + b), "rejected": str(a - b)} for a, b in ((1, 2), (30, 4))]
    path = write_jsonl(tmp_path / "p.jsonl", records * 3)
    monkeypatch.setattr(cache, "WRITE_BUFFER", 8)
    cold = load_preference_dataset(path, tok, cache_dir=tmp_path / "cache", show_progress=False)
    uncached = load_preference_dataset(path, tok, show_progress=False)
    pairs = [tokenize_pair(tok, normalize_pair(r, "standard")) for r in records * 3]
    expected = PreferenceDataset.from_pairs([dict(zip(("prompt_ids", "chosen_ids", "rejected_ids"), p)) for p in pairs])
    for ds in (cold, uncached):
        for name, array in expected.arrays().items():
            assert isinstance(ds.arrays()[name], np.memmap) and np.array_equal(ds.arrays()[name], array), name
        assert {k: ds.summary[k] for k in expected.summary} == expected.summary
        assert (ds.summary["pairs_read"], ds.summary["dropped"], ds.summary["truncated"]) == (6, {}, 0)
