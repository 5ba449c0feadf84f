"""The embedded demo dataset: shipped files equal the generator's output, prompts are disjoint and short, every
answer is right (checked by a solver written apart from the generator), and the files load as SFT data."""

import json
import subprocess
import sys

import pytest

from trainer.data.preference_data import load_preference_dataset
from trainer.data.sft_data import load_sft_dataset
from trainer.data.tasks import (
    EVAL_FILE,
    KINDS,
    NUM_EVAL,
    NUM_TRAIN,
    TRAIN_FILE,
    exact_match,
    generate_tasks,
    kind_of,
    preference_pair,
    solve,
    unseen_tasks,
    write_task_files,
    wrong_answer,
)
from trainer.data.tokenizer import byte_level_tokenizer


def read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def prompt(ex):
    return ex["messages"][0]["content"]


def test_shipped_files_are_the_generators_output(tmp_path):
    train, evals = write_task_files(tmp_path)
    assert train.read_bytes() == TRAIN_FILE.read_bytes()
    assert evals.read_bytes() == EVAL_FILE.read_bytes()
    assert read(TRAIN_FILE) == generate_tasks(NUM_TRAIN + NUM_EVAL)[:NUM_TRAIN]


def test_cli_regenerates_bit_identically(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "trainer.data.tasks", "--out", str(tmp_path)], check=True, capture_output=True
    )
    assert (tmp_path / TRAIN_FILE.name).read_bytes() == TRAIN_FILE.read_bytes()
    assert (tmp_path / EVAL_FILE.name).read_bytes() == EVAL_FILE.read_bytes()


def test_train_and_eval_prompts_are_disjoint_and_distinct():
    train, evals = read(TRAIN_FILE), read(EVAL_FILE)
    assert (len(train), len(evals)) == (4000, 200)
    train_prompts = {prompt(e) for e in train}
    assert len(train_prompts) == len(train)
    assert not train_prompts & {prompt(e) for e in evals}


def test_unseen_tasks_are_new_prompts_with_right_answers():
    """The GRPO demo's prompts: in neither shipped file, distinct, balanced, each answer the solver's."""
    shipped = {prompt(e) for e in read(TRAIN_FILE) + read(EVAL_FILE)}
    new = unseen_tasks(500)
    prompts = [prompt(e) for e in new]
    assert len(set(prompts)) == 500 and not shipped & set(prompts)
    assert all(solve(e["messages"][0]["content"]) == e["messages"][1]["content"] for e in new)
    assert sorted(kind_of(p) for p in prompts) == sorted(KINDS * 100)


def test_every_answer_is_right_and_kinds_are_balanced():
    examples = read(TRAIN_FILE) + read(EVAL_FILE)
    counts = dict.fromkeys(KINDS, 0)
    for ex in examples:
        (user, assistant) = ex["messages"]
        assert (user["role"], assistant["role"]) == ("user", "assistant")
        assert len(user["content"]) <= 21 and 1 <= len(assistant["content"]) <= 6
        assert solve(user["content"]) == assistant["content"]
        counts[kind_of(user["content"])] += 1
    assert set(counts.values()) == {len(examples) // len(KINDS)}


def test_generator_is_deterministic_and_seeded():
    assert generate_tasks(50, seed=1) == generate_tasks(50, seed=1)
    assert generate_tasks(50, seed=1) != generate_tasks(50, seed=2)
    assert generate_tasks(20, seed=3) == generate_tasks(40, seed=3)[:20]


def test_exact_match_and_solver():
    assert exact_match(" cba\n", "cba") and not exact_match("cb a", "cba") and not exact_match("CBA", "cba")
    assert solve("add: 47+8") == "55" and solve("convert: 42 km to m") == "42000" and solve("sort: 5203") == "0235"
    assert kind_of("convert: 7 g to mg") == "convert" and kind_of("divide: 4/2") is None
    with pytest.raises(ValueError, match="not a task prompt"):
        solve("divide: 4/2")


def test_files_load_as_sft_data_without_loss():
    ds = load_sft_dataset(EVAL_FILE, byte_level_tokenizer(), cutoff_len=128, show_progress=False)
    s = ds.summary
    assert len(ds) == 200 and s["dropped"] == {} and s["truncated"] == 0
    assert s["length"]["max"] <= 64  # short enough for the tiny preset's context


def test_preference_pairs_reject_a_plausible_wrong_answer(tmp_path):
    """The DPO demo's pairs: every rejected answer is wrong, non-empty and of the same kind as the right one; the
    pairs load as TRL conversational preference data with the same prompt on both sides."""
    examples = generate_tasks(NUM_TRAIN + NUM_EVAL)
    for ex in examples:
        wrong = wrong_answer(prompt(ex))
        assert wrong.strip() and not exact_match(wrong, solve(prompt(ex))), prompt(ex)
    assert wrong_answer("add: 31+17") == "49" and wrong_answer("sort: 90163") == "10369"
    assert wrong_answer("reverse: abba") == "baba" and wrong_answer("convert: 5 km to m") == "500"
    pairs = [preference_pair(ex) for ex in examples[:50]]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    ds = load_preference_dataset(path, byte_level_tokenizer(), show_progress=False)
    assert len(ds) == 50 and ds.summary["dropped"] == {}
