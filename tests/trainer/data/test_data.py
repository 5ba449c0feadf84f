"""SFT data: formats and their detection, masking token by token on two templates, truncation and drops,
bad input reported as file:line, the tokenisation cache, splits and the summary.

Expected labels are built independently of the masking code: the byte-level tokenizer encodes a concatenation
as the concatenation of the encodings, so a rendered conversation is a list of (text, supervised?) segments
encoded one by one."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from trainer.coerce import ConfigError
from trainer.data.sft_data import (
    DataError,
    TokenizedDataset,
    load_sft_dataset,
    read_examples,
    save_to_cache,
    split_dataset,
    tokenize_conversation,
    tokenize_text,
)
from trainer.data.tokenizer import Tokenizer, byte_level_tokenizer

IGN = -100

LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' + m['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def tok():
    return byte_level_tokenizer()


@pytest.fixture(scope="module")
def llama_tok():
    from tokenizers import AddedToken

    backend = byte_level_tokenizer().backend
    backend.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t in ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
        ]
    )
    return Tokenizer(backend, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>", chat_template=LLAMA3_TEMPLATE)


def expected(tok, segments):
    """(ids, labels) from [(text, supervised)], with labels[0] = -100 as the pipeline sets it."""
    ids, labels = [], []
    for text, sup in segments:
        part = tok.encode(text)
        ids += part
        labels += part if sup else [IGN] * len(part)
    labels[0] = IGN
    return ids, labels


def chatml(role, content, sup_content=False):
    """One ChatML turn as segments: the header is never supervised; content + '<|im_end|>\n' when asked."""
    return [(f"<|im_start|>{role}\n", False), (f"{content}<|im_end|>\n", sup_content)]


def write_jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


CONV = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "hello"},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4"},
]


# ---- masking ------------------------------------------------------------------------------------------------
def test_chatml_multi_turn_mask_token_by_token(tok):
    ids, labels = tokenize_conversation(tok, CONV)
    want = expected(
        tok,
        chatml("system", "be brief")
        + chatml("user", "hi")
        + chatml("assistant", "hello", True)
        + chatml("user", "2+2?")
        + chatml("assistant", "4", True),
    )
    assert (ids, labels) == want
    # The stop token is a target, the next turn's header is not.
    im_end = tok.token_to_id("<|im_end|>")
    assert [i for i, lab in zip(ids, labels) if lab != IGN].count(im_end) == 2


def test_mask_history_trains_only_last_turn(tok):
    _, labels = tokenize_conversation(tok, CONV, mask_history=True)
    want = expected(
        tok,
        chatml("system", "be brief")
        + chatml("user", "hi")
        + chatml("assistant", "hello")
        + chatml("user", "2+2?")
        + chatml("assistant", "4", True),
    )
    assert labels == want[1]


def test_train_on_prompt_trains_everything_but_the_first_token(tok):
    ids, labels = tokenize_conversation(tok, CONV, train_on_prompt=True)
    assert labels[0] == IGN and labels[1:] == ids[1:]


def test_llama3_like_template_mask_token_by_token(llama_tok):
    ids, labels = tokenize_conversation(llama_tok, CONV)

    def turn(role, content, sup=False):
        return [(f"<|start_header_id|>{role}<|end_header_id|>\n\n", False), (f"{content}<|eot_id|>", sup)]

    want = expected(
        llama_tok,
        [("<|begin_of_text|>", False)]
        + turn("system", "be brief")
        + turn("user", "hi")
        + turn("assistant", "hello", True)
        + turn("user", "2+2?")
        + turn("assistant", "4", True),
    )
    assert (ids, labels) == want
    assert ids[0] == llama_tok.bos_token_id


def test_multibyte_characters_are_supervised_whole(tok):
    ids, labels = tokenize_conversation(
        tok, [{"role": "user", "content": "é?"}, {"role": "assistant", "content": "ü🌍"}]
    )
    sup = [i for i, lab in zip(ids, labels) if lab != IGN]
    assert tok.decode(sup, skip_special_tokens=False) == "ü🌍<|im_end|>\n"


def test_mask_equals_transformers_assistant_mask(tmp_path, tok):
    """Oracle: Hugging Face's return_assistant_tokens_mask on the same ChatML with {% generation %} tags."""
    transformers = pytest.importorskip("transformers")
    tok.save_pretrained(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    tagged = (
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
        "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>\\n' }}"
        "{% endgeneration %}{% else %}{{ message['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    msgs = CONV[:2] + [{"role": "assistant", "content": "hé 🌍"}] + CONV[3:]
    out = hf.apply_chat_template(
        msgs, chat_template=tagged, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    ids, labels = tokenize_conversation(tok, msgs)
    assert ids == out["input_ids"]
    assert [int(lab != IGN) for lab in labels] == out["assistant_masks"]


def test_template_that_breaks_the_prefix_property_is_a_clear_error(tmp_path, tok):
    # Prints the message count first: a prefix of the conversation renders with a different first character.
    bad = Tokenizer(
        tok.backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template="{{ messages | length }}{% for m in messages %}{{ m['content'] }}{% endfor %}",
    )
    f = write_jsonl(tmp_path / "c.jsonl", [{"messages": CONV[1:3]}])
    with pytest.raises(DataError, match=r"c\.jsonl:1: chat template problem: .* not a prefix"):
        load_sft_dataset(f, bad, show_progress=False)
    # train_on_prompt needs no spans, so that template still works there.
    assert len(load_sft_dataset(f, bad, train_on_prompt=True, show_progress=False)) == 1


# ChatML whose assistant content sits in {% generation %} blocks, the end-of-turn left out of them: the blocks,
# not the prefix rule (which would also supervise '<|im_end|>\n'), must decide the targets.
TAGGED_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}{% endgeneration %}"
    "{% else %}{{ message['content'] }}{% endif %}{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_generation_blocks_load_and_decide_the_targets(tmp_path, tok):
    tagged = Tokenizer(tok.backend, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=TAGGED_TEMPLATE)
    # The answer ends in ASCII: transformers marks only the first token of a block's last character, which
    # for a byte-level multi-byte character would leave its other bytes out (we supervise all of them).
    msgs = CONV[:2] + [{"role": "assistant", "content": "hé 🌍 ok"}] + CONV[3:]

    def turn(role, content, sup=False):
        return [(f"<|im_start|>{role}\n", False), (content, sup), ("<|im_end|>\n", False)]

    head = turn("system", "be brief") + turn("user", "hi")
    assert tokenize_conversation(tagged, msgs) == expected(
        tagged, head + turn("assistant", "hé 🌍 ok", True) + turn("user", "2+2?") + turn("assistant", "4", True)
    )
    _, last_only = tokenize_conversation(tagged, msgs, mask_history=True)
    assert (
        last_only
        == expected(tagged, head + turn("assistant", "hé 🌍 ok") + turn("user", "2+2?") + turn("assistant", "4", True))[
            1
        ]
    )
    assert tagged.apply_chat_template(msgs) == tok.apply_chat_template(msgs)  # the tag renders its body unchanged
    f = write_jsonl(tmp_path / "g.jsonl", [{"messages": msgs}])
    assert len(load_sft_dataset(f, tagged, show_progress=False)) == 1
    transformers = pytest.importorskip("transformers")  # oracle: transformers' assistant_masks on the same template
    tok.save_pretrained(tmp_path / "hf")
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    out = hf.apply_chat_template(
        msgs, chat_template=TAGGED_TEMPLATE, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    ids, labels = tokenize_conversation(tagged, msgs)
    assert ids == out["input_ids"] and [int(lab != IGN) for lab in labels] == out["assistant_masks"]


# Qwen3-style: the reasoning of assistant answers before the last user message is dropped, so a conversation's
# earlier prefix renders an answer differently from the whole (written for this test, same rule as Qwen3's).
REWRITING_TEMPLATE = (
    "{% set ns = namespace(last_user=0) %}{% for m in messages %}{% if m['role'] == 'user' %}"
    "{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
    "{% if m['role'] == 'assistant' and loop.index0 > ns.last_user %}{{ '<think>' + m['reasoning'] + '</think>' }}"
    "{% endif %}{{ m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_template_that_rewrites_earlier_turns_names_mask_history(tmp_path, tok):
    rewriting = Tokenizer(
        tok.backend, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=REWRITING_TEMPLATE
    )
    msgs = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello", "reasoning": "greet"},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning": "add"},
    ]
    f = write_jsonl(tmp_path / "q.jsonl", [{"messages": msgs}])
    with pytest.raises(DataError, match=r"q\.jsonl:1: chat template problem: .*rewrites earlier turns.*--mask_history"):
        load_sft_dataset(f, rewriting, show_progress=False)
    ds = load_sft_dataset(f, rewriting, mask_history=True, show_progress=False)
    want = expected(
        rewriting,
        chatml("user", "hi")
        + chatml("assistant", "hello")
        + chatml("user", "2+2?")
        + [("<|im_start|>assistant\n", False), ("<think>add</think>4<|im_end|>\n", True)],
    )
    assert (ds[0]["input_ids"].tolist(), ds[0]["labels"].tolist()) == want


def test_template_raise_exception_is_a_bad_example(tmp_path, tok):
    strict = Tokenizer(
        tok.backend,
        eos_token="<|im_end|>",
        chat_template=(
            "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}"
            "{{ m['content'] }}|{% endfor %}"
        ),
    )
    f = write_jsonl(tmp_path / "t.jsonl", [{"messages": CONV[1:3]}, {"messages": CONV}])
    with pytest.raises(DataError, match=r"t\.jsonl:2: the chat template failed .*no system role"):
        load_sft_dataset(f, strict, show_progress=False)
    ds = load_sft_dataset(f, strict, skip_bad_examples=True, show_progress=False)
    assert len(ds) == 1 and ds.summary["dropped"] == {"template_error": 1}


# ---- formats ------------------------------------------------------------------------------------------------
FORMAT_RECORDS = {
    "messages": {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
    "sharegpt": {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]},
    "alpaca": {"instruction": "hi", "input": "", "output": "yo"},
    "prompt_completion": {"prompt": "hi", "completion": "yo"},
    "prompt_completion_lists": {
        "prompt": [{"role": "user", "content": "hi"}],
        "completion": [{"role": "assistant", "content": "yo"}],
    },
}


@pytest.mark.parametrize("name", sorted(FORMAT_RECORDS))
def test_conversational_formats_normalise_to_the_same_tokens(tmp_path, tok, name):
    f = write_jsonl(tmp_path / "d.jsonl", [FORMAT_RECORDS[name]])
    ds = load_sft_dataset(f, tok, show_progress=False)
    want = expected(tok, chatml("user", "hi") + chatml("assistant", "yo", True))
    assert ds[0]["input_ids"].tolist() == want[0] and ds[0]["labels"].tolist() == want[1]
    assert ds[0]["input_ids"].dtype == np.int32
    assert ds.summary["formats"] == {str(f): name.replace("_lists", "")}


def test_alpaca_input_system_and_history(tmp_path, tok):
    f = write_jsonl(
        tmp_path / "a.jsonl",
        [{"instruction": "add", "input": "1 2", "output": "3", "system": "calc", "history": [["hi", "hello"]]}],
    )
    (msgs,) = [e["messages"] for e in read_examples(f)]
    assert msgs == [
        {"role": "system", "content": "calc"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "add\n1 2"},
        {"role": "assistant", "content": "3"},
    ]


def test_sharegpt_system_and_roles(tmp_path, tok):
    f = write_jsonl(
        tmp_path / "s.jsonl",
        [
            {
                "system": "sys",
                "conversations": [
                    {"from": "human", "value": "q"},
                    {"from": "gpt", "value": "a"},
                    {"from": "observation", "value": "o"},
                ],
            }
        ],
    )
    assert [m["role"] for m in read_examples(f)[0]["messages"]] == ["system", "user", "assistant", "tool"]


def test_text_format_trains_every_token_and_appends_eos(tmp_path, tok):
    f = write_jsonl(tmp_path / "p.jsonl", [{"text": "abc"}])
    ds = load_sft_dataset(f, tok, show_progress=False)
    assert ds[0]["input_ids"].tolist() == tok.encode("abc") + [tok.eos_token_id]
    assert ds[0]["labels"].tolist() == [IGN] + tok.encode("bc") + [tok.eos_token_id]
    assert tokenize_text(tok, "abc") == (ds[0]["input_ids"].tolist(), ds[0]["labels"].tolist())


def test_detection_is_per_file_and_override_wins(tmp_path, tok):
    d = tmp_path / "dir"
    d.mkdir()
    write_jsonl(d / "b.jsonl", [{"text": "plain"}])
    write_jsonl(d / "a.jsonl", [FORMAT_RECORDS["alpaca"]])
    (d / "notes.txt").write_text("ignored")
    ds = load_sft_dataset(d, tok, show_progress=False)
    assert list(ds.summary["formats"].items()) == [(str(d / "a.jsonl"), "alpaca"), (str(d / "b.jsonl"), "text")]
    # Both keys present: detection picks prompt/completion, the override reads "text".
    both = write_jsonl(tmp_path / "both.jsonl", [{"prompt": "p", "completion": "c", "text": "t"}])
    assert load_sft_dataset(both, tok, show_progress=False).summary["formats"][str(both)] == "prompt_completion"
    ds = load_sft_dataset(both, tok, data_format="text", show_progress=False)
    assert ds[0]["input_ids"].tolist() == tok.encode("t") + [tok.eos_token_id]
    with pytest.raises(DataError, match=r"both\.jsonl:1: missing field 'messages'"):
        load_sft_dataset(both, tok, data_format="messages", show_progress=False)


def test_json_list_files_report_element_lines(tmp_path, tok):
    f = tmp_path / "x.json"
    f.write_text('[\n  {"text": "a"},\n  {"text": "b"},\n  {"text": 3}\n]\n')
    with pytest.raises(DataError, match=r"x\.json:4: field 'text' is a number \(expected a string\)"):
        load_sft_dataset(f, tok, show_progress=False)
    f.write_text('[\n  {"text": "a"},\n  {"text": "b",}\n]')
    with pytest.raises(DataError, match=r"x\.json:3: invalid JSON"):
        load_sft_dataset(f, tok, show_progress=False)
    f.write_text('[{"text": "a"}, {"text": "b"}]')
    assert len(load_sft_dataset(f, tok, show_progress=False)) == 2
    f.write_text('{"text": "a"}\n{"text": "b"}\n')  # JSON lines named .json
    assert len(load_sft_dataset(f, tok, show_progress=False)) == 2


def test_tool_role_and_tools_pass_through_to_the_template(tmp_path, tok):
    tool_tok = Tokenizer(
        tok.backend,
        eos_token="<|im_end|>",
        chat_template=(
            "{% if tools %}[{{ tools | length }} tools]{% endif %}{% for m in messages %}"
            "<{{ m['role'] }}>{{ m['content'] }}{% if m.tool_calls %}{{ m.tool_calls | tojson }}{% endif %}<|im_end|>"
            "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
        ),
    )
    rec = {
        "tools": [{"name": "calc"}],
        "messages": [
            {"role": "user", "content": "1+1?"},
            {"role": "assistant", "content": None, "tool_calls": [{"name": "calc"}]},
            {"role": "tool", "content": "2"},
            {"role": "assistant", "content": "2"},
        ],
    }
    ds = load_sft_dataset(write_jsonl(tmp_path / "t.jsonl", [rec]), tool_tok, show_progress=False)
    text = tok.decode(ds[0]["input_ids"], skip_special_tokens=False)
    assert text.startswith("[1 tools]<user>1+1?") and "<tool>2<|im_end|>" in text
    sup = tok.decode([i for i in ds[0]["labels"].tolist() if i != IGN], skip_special_tokens=False)
    assert sup == '[{"name": "calc"}]<|im_end|>2<|im_end|>'


# ---- bad input ----------------------------------------------------------------------------------------------
GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
BAD_LINES = [
    ('{"messages": [', "bad_json", r"invalid JSON: .*\(expected one JSON object per line\)"),
    ("[1, 2]", "not_an_object", r"a record is a list \(expected a JSON object\)"),
    (
        {"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "x"}]},
        "unknown_role",
        r"messages\[1\]\.role is 'bot' \(expected one of system, user, assistant, tool\)",
    ),
    (
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant"}]},
        "missing_field",
        r"messages\[1\] has no 'content'",
    ),
    (
        {"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "x"}]},
        "wrong_type",
        r"messages\[0\]\.content is a number \(expected a string\)",
    ),
    (
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": " "}]},
        "empty_content",
        r"messages\[1\]\.content is empty",
    ),
    ({"messages": "hi"}, "wrong_type", r"field 'messages' is a string \(expected a list of messages\)"),
]


@pytest.mark.parametrize("line, reason, message", BAD_LINES, ids=[b[1] + str(i) for i, b in enumerate(BAD_LINES)])
def test_bad_record_on_line_3_names_file_line_and_expectation(tmp_path, tok, line, reason, message):
    f = write_jsonl(tmp_path / "x.jsonl", [GOOD, GOOD, line, GOOD])
    with pytest.raises(DataError, match=r"x\.jsonl:3: " + message) as info:
        load_sft_dataset(f, tok, show_progress=False)
    assert "\n" not in str(info.value)
    ds = load_sft_dataset(f, tok, skip_bad_examples=True, show_progress=False)
    assert len(ds) == 3 and ds.summary["dropped"] == {reason: 1} and ds.summary["examples_read"] == 4


def test_skip_bad_examples_counts_by_reason_and_detects_from_first_valid(tmp_path, tok):
    f = write_jsonl(
        tmp_path / "x.jsonl",
        [
            "not json",
            '"a string"',
            {"instruction": "a", "output": "b"},
            {"instruction": "c"},
            {"instruction": "d", "output": 7},
            "",
            {"instruction": "e", "output": "f"},
        ],
    )
    ds = load_sft_dataset(f, tok, skip_bad_examples=True, show_progress=False)
    assert len(ds) == 2
    assert ds.summary["formats"] == {str(f): "alpaca"}
    assert ds.summary["dropped"] == {"bad_json": 1, "not_an_object": 1, "missing_field": 1, "wrong_type": 1}
    assert ds.summary["examples_read"] == 6  # the blank line is not a record
    with pytest.raises(DataError, match=r"x\.jsonl:1: invalid JSON"):
        load_sft_dataset(f, tok, show_progress=False)
    g = write_jsonl(tmp_path / "y.jsonl", [{"instruction": "a", "output": "b"}, {"instruction": "c"}])
    with pytest.raises(DataError, match=r"y\.jsonl:2: missing field 'output' \(expected alpaca"):
        load_sft_dataset(g, tok, show_progress=False)


def test_skipped_and_dropped_examples_are_named_and_counted_per_kind(tmp_path, tok, caplog):
    """One bad record and 45 truncation drops: the log names each kind (file:line) and counts the rest per kind."""
    long_prompt = {"messages": [{"role": "user", "content": "q" * 60}, {"role": "assistant", "content": "a"}]}
    f = write_jsonl(tmp_path / "k.jsonl", [GOOD, {"messages": "oops"}] + [long_prompt] * 45)
    with caplog.at_level("WARNING", logger="trainer.data.sft_data"):
        ds = load_sft_dataset(f, tok, cutoff_len=40, skip_bad_examples=True, show_progress=False)
    assert len(ds) == 1 and ds.summary["dropped"] == {"wrong_type": 1, "no_targets_after_truncation": 45}
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith(f"skipping {f}:2: field 'messages' is a string") for m in messages), messages
    named = [m for m in messages if m.startswith("dropping ") and "after truncation to cutoff_len 40" in m]
    assert [m.split(": ")[0] for m in named] == [f"dropping {f}:{line}" for line in range(3, 8)]
    assert (
        messages[-1]
        == "not named above: 40 more no_targets_after_truncation (45 in all) (the first 5 of each kind are)"
    )
    assert not any("bad examples" in m for m in messages)
    assert "read 47, skipped bad 1 (wrong_type 1), dropped 45 (no_targets_after_truncation 45)" in ds.summary_text()


def test_unknown_format_and_missing_paths(tmp_path, tok):
    f = write_jsonl(tmp_path / "u.jsonl", [{"question": "q", "answer": "a"}])
    with pytest.raises(
        DataError, match=r"u\.jsonl:1: cannot tell the data format from the keys \['answer', 'question'\]"
    ):
        load_sft_dataset(f, tok, show_progress=False)
    with pytest.raises(DataError, match="no such file"):
        load_sft_dataset(tmp_path / "nope.jsonl", tok, show_progress=False)
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(DataError, match=r"unsupported file type '\.csv'"):
        load_sft_dataset(tmp_path / "d.csv", tok, show_progress=False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no data files in this directory"):
        load_sft_dataset(tmp_path / "empty", tok, show_progress=False)
    with pytest.raises(ValueError, match="data_format='csv'"):
        load_sft_dataset(f, tok, data_format="csv", show_progress=False)
    with pytest.raises(ValueError, match="cannot both be set"):
        load_sft_dataset(f, tok, train_on_prompt=True, mask_history=True, show_progress=False)


# ---- truncation and drops -----------------------------------------------------------------------------------
def test_truncation_keeps_the_start_and_empty_masks_are_dropped_and_counted(tmp_path, tok):
    long_answer = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a" * 40}]}
    long_prompt = {"messages": [{"role": "user", "content": "q" * 60}, {"role": "assistant", "content": "a"}]}
    no_assistant = {"messages": [{"role": "user", "content": "hi"}]}
    f = write_jsonl(tmp_path / "t.jsonl", [GOOD, long_answer, long_prompt, no_assistant])
    full = tokenize_conversation(tok, long_answer["messages"])
    ds = load_sft_dataset(f, tok, cutoff_len=40, show_progress=False)
    assert len(ds) == 2
    assert ds[1]["input_ids"].tolist() == full[0][:40] and ds[1]["labels"].tolist() == full[1][:40]
    s = ds.summary
    assert s["truncated"] == 2 and s["examples_read"] == 4
    assert s["dropped"] == {"no_targets": 1, "no_targets_after_truncation": 1}
    assert s["length"]["max"] == 40 and s["tokens"] == int(ds.lengths.sum())
    assert s["supervised_tokens"] == sum(int((ds[i]["labels"] != IGN).sum()) for i in range(len(ds)))
    text = ds.summary_text()
    assert "dropped 2 (no_targets 1, no_targets_after_truncation 1)" in text and "truncated 2" in text
    # With train_on_prompt a conversation without an answer still has targets.
    assert len(load_sft_dataset(f, tok, cutoff_len=None, train_on_prompt=True, show_progress=False)) == 4
    all_dropped = write_jsonl(tmp_path / "n.jsonl", [no_assistant])
    with pytest.raises(DataError, match=r"no usable examples \(no_targets 1\)"):
        load_sft_dataset(all_dropped, tok, show_progress=False)


def test_summary_percentiles(tmp_path, tok):
    f = write_jsonl(tmp_path / "p.jsonl", [{"text": "x" * n} for n in range(1, 101)])  # lengths 2..101
    s = load_sft_dataset(f, tok, show_progress=False).summary
    assert s["length"] == {"p50": 51, "p90": 91, "p99": 100, "max": 101, "mean": 51.5}
    assert s["tokens"] == sum(range(2, 102)) and s["supervised_tokens"] == s["tokens"] - 100


# ---- cache --------------------------------------------------------------------------------------------------
class CountingTokenizer(Tokenizer):
    calls = 0

    def encode_with_offsets(self, text):
        CountingTokenizer.calls += 1
        return super().encode_with_offsets(text)


def counting_tok():
    base = byte_level_tokenizer()
    return CountingTokenizer(
        base.backend, eos_token=base.eos_token, pad_token=base.pad_token, chat_template=base.chat_template
    )


def test_cache_second_load_does_not_tokenize_and_key_follows_inputs(tmp_path):
    f = write_jsonl(tmp_path / "c.jsonl", [GOOD, FORMAT_RECORDS["messages"]])
    cache = tmp_path / "cache"
    CountingTokenizer.calls = 0
    first = load_sft_dataset(f, counting_tok(), cache_dir=cache, show_progress=False)
    assert CountingTokenizer.calls == 2 and first.summary["cache_hit"] is False
    again = load_sft_dataset(f, counting_tok(), cache_dir=cache, show_progress=False)  # a fresh, equal tokenizer
    assert CountingTokenizer.calls == 2 and again.summary["cache_hit"] is True
    assert np.array_equal(again.input_ids, first.input_ids) and np.array_equal(again.labels, first.labels)
    assert np.array_equal(again.offsets, first.offsets) and again.summary["dropped"] == first.summary["dropped"]
    assert "\n  cache hit 0.4 kB " in again.summary_text() and "\n  cache miss 0.4 kB " in first.summary_text()
    # A changed option, file or template is a new key.
    load_sft_dataset(f, counting_tok(), cache_dir=cache, cutoff_len=1024, show_progress=False)
    assert CountingTokenizer.calls == 4
    load_sft_dataset(f, counting_tok(), cache_dir=cache, mask_history=True, show_progress=False)
    assert CountingTokenizer.calls == 6
    write_jsonl(f, [GOOD, GOOD, GOOD])
    load_sft_dataset(f, counting_tok(), cache_dir=cache, show_progress=False)
    assert CountingTokenizer.calls == 9
    other = counting_tok()
    other.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    load_sft_dataset(f, other, cache_dir=cache, show_progress=False)
    assert CountingTokenizer.calls == 12
    entries = [p for p in cache.glob("data-*") if p.is_dir()]
    assert len(entries) == 5
    # An unreadable cache entry is rebuilt, not trusted.
    for p in entries:
        (p / "input_ids.npy").write_bytes(b"garbage")
    assert len(load_sft_dataset(f, counting_tok(), cache_dir=cache, show_progress=False)) == 3
    assert CountingTokenizer.calls == 15


def test_a_cache_written_later_is_the_one_read_next(tmp_path):
    """write_cache=False reads the cache but writes nothing (the CLI checks every input before any write);
    save_to_cache then writes what it tokenised, and a later load reads it."""
    f = write_jsonl(tmp_path / "c.jsonl", [GOOD])
    cache = tmp_path / "cache"
    CountingTokenizer.calls = 0
    first = load_sft_dataset(f, counting_tok(), cache_dir=cache, show_progress=False, write_cache=False)
    assert not cache.exists() and first.summary["cache_hit"] is False
    save_to_cache(first)
    again = load_sft_dataset(f, counting_tok(), cache_dir=cache, show_progress=False, write_cache=False)
    assert CountingTokenizer.calls == 1 and again.summary["cache_hit"] is True
    save_to_cache(again)  # read from the cache: nothing to write
    assert [p.name for p in cache.iterdir() if p.is_dir()] == [Path(first.summary["cache"]).name]


# ---- parquet ------------------------------------------------------------------------------------------------
def test_parquet_without_pyarrow_says_how_to_install(tmp_path, tok, monkeypatch):
    f = tmp_path / "d.parquet"
    f.write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # makes `import pyarrow...` raise ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(DataError, match=r"d\.parquet: .*install pyarrow \(pip install kernelwright\[parquet\]\)"):
        load_sft_dataset(f, tok, show_progress=False)


def test_parquet_rows(tmp_path, tok):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = [
        {"instruction": "a", "input": None, "output": "b"},
        {"instruction": "c", "input": "d", "output": "e"},
        {"instruction": "f", "input": None, "output": None},
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    with pytest.raises(DataError, match=r"d\.parquet:row 3: field 'output' is null"):
        load_sft_dataset(tmp_path / "d.parquet", tok, show_progress=False)
    ds = load_sft_dataset(tmp_path / "d.parquet", tok, skip_bad_examples=True, show_progress=False)
    assert len(ds) == 2 and ds.summary["formats"][str(tmp_path / "d.parquet")] == "alpaca"
    want = expected(tok, chatml("user", "c\nd") + chatml("assistant", "e", True))
    assert ds[1]["input_ids"].tolist() == want[0] and ds[1]["labels"].tolist() == want[1]


# ---- dataset and split --------------------------------------------------------------------------------------
def test_split_is_deterministic_disjoint_and_complete():
    ds = TokenizedDataset.from_examples([([i, i + 1], [IGN, i + 1]) for i in range(100)])
    train, val = split_dataset(ds, 0.1, seed=3)
    assert (len(train), len(val)) == (90, 10)
    firsts = lambda d: [int(d[i]["input_ids"][0]) for i in range(len(d))]  # noqa: E731
    assert sorted(firsts(train) + firsts(val)) == list(range(100))
    assert firsts(val) == firsts(split_dataset(ds, 0.1, seed=3)[1])
    assert firsts(val) != firsts(split_dataset(ds, 0.1, seed=4)[1])
    assert len(split_dataset(ds, 7, seed=0)[1]) == 7
    assert val.summary["examples"] == 10 and val.summary["tokens"] == 20
    for bad in (0, 100, 1.5, "3"):
        with pytest.raises(ConfigError, match="val_size"):
            split_dataset(ds, bad, seed=0)
    with pytest.raises(ConfigError, match="val_size=0.999 holds out 100 of the 100 training examples, leaving 0"):
        split_dataset(ds, 0.999, seed=0)
    with pytest.raises(ConfigError, match="val_size=1: the training data holds 1 example, too few"):
        split_dataset(ds.select([0]), 1, seed=0)


def test_dataset_indexing_and_round_trip(tmp_path):
    ds = TokenizedDataset.from_examples([{"input_ids": [1, 2, 3], "labels": [IGN, 2, 3]}, ([4], [IGN])])
    assert len(ds) == 2 and ds.lengths.tolist() == [3, 1] and ds[-1]["input_ids"].tolist() == [4]
    with pytest.raises(IndexError):
        ds[2]
    ds.save(tmp_path / "d.npz")
    again = TokenizedDataset.load(tmp_path / "d.npz")
    assert again[0]["labels"].tolist() == [IGN, 2, 3] and again.summary == ds.summary
