"""SFT data: read files, normalise formats to messages, render with the chat template, mask, cache.

Pipeline (`load_sft_dataset`), run once per dataset and cached:

1. Read JSONL, JSON (a list of objects, or one object per line) and Parquet files; a directory means its
   *.jsonl/*.json/*.parquet files in sorted order. Every record is located as "file:line" (Parquet:
   "file:row N") so a bad one is reported in one line: `DataError("x.jsonl:3: invalid JSON: ... (expected ...)")`.
   With `skip_bad_examples=True` bad records are counted by reason in the summary instead; the log names the
   first few of each reason (file:line) and counts the rest per reason.
2. Detect the format per file from its first valid record (or force it with `data_format`):
   messages    {"messages": [{"role", "content"}, ...]}            roles system/user/assistant/tool
   sharegpt    {"conversations": [{"from", "value"}, ...]}         human->user, gpt->assistant, system, tool
   alpaca      {"instruction", "input", "output"} (+ "system", "history": [[user, assistant], ...])
   prompt_completion {"prompt", "completion"}: two strings, or two lists of messages (as TRL allows)
   text        {"text"}: continued pre-training, every token trained, EOS appended
   All but text become a list of messages.
3. Render the conversation once with the tokenizer's chat template and find the text of each assistant turn by
   rendering prefixes: turn i spans [len(render(messages[:i], add_generation_prompt=True)),
   len(render(messages[:i+1]))). That span holds the answer and the template's end-of-turn text
   ("<|im_end|>\n", "<|eot_id|>", "</s>") so the model learns to stop, and never the next turn's header.
   Tokens are supervised when their character span (`encode_with_offsets`) overlaps a supervised span. This
   works for any template that renders a prefix of a conversation as a prefix of the whole; that is checked,
   and a template that breaks it is a `DataError` naming the problem and the ways out: templates that rewrite
   earlier turns (Qwen3 drops the reasoning of earlier answers) still work with `mask_history` (train_on_prompt=True
   needs no spans). A template with `{% generation %}` blocks (transformers' assistant-mask tag, TRL's
   `assistant_only_loss`) says itself which text is the assistant's: exactly its blocks are supervised, as
   transformers' `assistant_masks` mark them, and no prefixes are rendered.
   `train_on_prompt` supervises every token, `mask_history` only the last assistant turn (the last block).
4. Truncate to `cutoff_len` keeping the start. Labels are unshifted (the model shifts: the target of position
   t is labels[t+1]) with -100 where not supervised; labels[0] is always -100 since no position predicts it.
   An example left with no target (no assistant turn, or its answer truncated away) is dropped and counted
   under its own reason (no_targets, no_targets_after_truncation), never as a bad record.
5. Cache the result as flat int32 arrays + offsets in `<cache_dir>/data-<key>/` (trainer/data/cache.py: one root
   shared by every run, entries written atomically under a lock, read memory-mapped), where key = sha256 of the
   file contents, tokenizer.json, chat template, special tokens and the options; a second load, from any run,
   reads it without tokenising. The arrays are written as the examples are tokenised, and the process that tokenised
   them maps the entry as any other does: memory does not grow with the dataset, cached or not (without a cache_dir
   the arrays go to a temporary directory, removed once mapped).

The result is a `TokenizedDataset` (list-like; `.lengths`, `.summary`, `.summary_text()`) that the
`BatchLoader` (trainer/data/batching.py, re-exported here) turns into micro batches.

    ds = load_sft_dataset("data/", tok, cutoff_len=2048, cache_dir=trainer.data.cache.cache_root())
    print(ds.summary_text())
    train, val = split_dataset(ds, 0.05, seed=0)
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import logging
import os
import re
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
from tqdm import tqdm

from trainer.coerce import ConfigError
from trainer.data.batching import BATCHING_STRATEGIES, BatchLoader  # noqa: F401  (re-exported: data.py is the entry point)
from trainer.data.cache import ArrayWriter, building, commit, entry_bytes, entry_lock, read_entry, write_entry
from trainer.data.tokenizer import DEFAULT_CHAT_TEMPLATE

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100
DATA_FORMATS = ("auto", "messages", "sharegpt", "alpaca", "prompt_completion", "text")
ROLES = ("system", "user", "assistant", "tool")
EXTENSIONS = (".jsonl", ".json", ".parquet")
_SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
    "tool": "tool",
    "observation": "tool",
}
# Roles that must say something: an empty user turn or answer is almost always a broken export.
_NEEDS_CONTENT = ("user", "assistant")
# Bumped whenever the cached arrays would change for the same inputs (masking rules, array layout).
_CACHE_VERSION = "kernelwright-data-v2"  # v2: a directory of .npy files (memory-mapped), no longer an .npz
_MAX_WARNINGS = 5  # examples named (file:line) per kind of drop; the summary counts them all
# Well-formed examples that leave nothing to train on (dropped whether or not skip_bad_examples is set).
_NO_TARGETS = ("no_targets", "no_targets_after_truncation")


class DataError(ValueError):
    """Unusable input data, in one line: "file:line: what is wrong (expected ...)"."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split("\n")))


class _Bad(Exception):
    """One bad record: a reason (the summary's counter key) and a message for the user."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason, self.message = reason, message


class _TemplateMismatch(Exception):
    """The chat template breaks the prefix property masking relies on: a setup error, never skipped."""


# ---- reading ----------------------------------------------------------------------------------------------
def resolve_data_files(paths) -> list[Path]:
    """Files named by `paths` (a path or a list of them); a directory gives its data files, sorted."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(f for f in p.iterdir() if f.is_file() and f.suffix in EXTENSIONS)
            if not found:
                raise DataError(f"{p}: no data files in this directory (expected *.jsonl, *.json or *.parquet)")
            files += found
        elif p.is_file():
            if p.suffix not in EXTENSIONS:
                raise DataError(f"{p}: unsupported file type {p.suffix!r} (expected .jsonl, .json or .parquet)")
            files.append(p)
        else:
            raise DataError(f"{p}: no such file or directory")
    if not files:
        raise DataError("no data files given (expected a file, a directory or a list of them)")
    return files


def _json_type(value) -> str:
    names = {
        dict: "an object",
        list: "a list",
        str: "a string",
        bool: "a boolean",
        int: "a number",
        float: "a number",
        type(None): "null",
    }
    return names.get(type(value), type(value).__name__)


def _jsonl_records(path: Path, lines: Iterable[bytes], first_line: int = 1) -> Iterator[tuple[str, object]]:
    # Binary lines split on b"\n" only: JSON strings may hold a raw U+2028, which str.splitlines would cut.
    for lineno, raw in enumerate(lines, first_line):
        if not raw.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            yield where, json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError:
            yield where, _Bad("bad_json", "not valid UTF-8 (expected UTF-8 encoded JSON)")
        except json.JSONDecodeError as exc:
            yield (
                where,
                _Bad("bad_json", f"invalid JSON: {exc.msg} at column {exc.colno} (expected one JSON object per line)"),
            )


_WS = re.compile(r"[ \t\n\r]*")


def _json_array_records(path: Path) -> Iterator[tuple[str, object]]:
    data = path.read_bytes()
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise DataError(f"{path}: not valid UTF-8 (expected UTF-8 encoded JSON)") from None
    pos = _WS.match(text).end()
    if pos == len(text):
        return
    if text[pos] != "[":  # JSON lines saved as .json, which the Hugging Face json loader also accepts
        yield from _jsonl_records(path, data.lstrip(b"\xef\xbb\xbf").split(b"\n"))
        return
    # Decode element by element to know the line each record starts on. A syntax error inside a JSON array
    # leaves no record boundary to resume from, so it is fatal even with skip_bad_examples.
    decoder = json.JSONDecoder()
    line, line_pos = 1, 0
    pos = _WS.match(text, pos + 1).end()
    if text.startswith("]", pos):
        return
    while True:
        line += text.count("\n", line_pos, pos)
        line_pos = pos
        try:
            value, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as exc:
            raise DataError(
                f"{path}:{exc.lineno}: invalid JSON: {exc.msg} at column {exc.colno} (expected a JSON list of objects)"
            ) from None
        yield f"{path}:{line}", value
        pos = _WS.match(text, end).end()
        if text.startswith(",", pos):
            pos = _WS.match(text, pos + 1).end()
        elif text.startswith("]", pos):
            if _WS.match(text, pos + 1).end() != len(text):
                raise DataError(
                    f"{path}:{text.count(chr(10), 0, pos) + 1}: invalid JSON: text after the closing ']' "
                    "(expected a JSON list of objects)"
                )
            return
        else:
            raise DataError(
                f"{path}:{text.count(chr(10), 0, pos) + 1}: invalid JSON: expected ',' or ']' after a "
                "list element (expected a JSON list of objects)"
            )


def _import_pyarrow_parquet(path: Path):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(
            f"{path}: reading Parquet needs pyarrow: install pyarrow (pip install kernelwright[parquet])"
        ) from None
    return pq


def _parquet_records(path: Path) -> Iterator[tuple[str, object]]:
    pq = _import_pyarrow_parquet(path)
    try:
        file = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises its own error types for unreadable files
        raise DataError(f"{path}: not a readable Parquet file: {exc} (expected a Parquet table)") from None
    row = 0
    for batch in file.iter_batches(batch_size=1024):
        for record in batch.to_pylist():
            row += 1
            yield f"{path}:row {row}", record


def _records(path: Path) -> Iterator[tuple[str, object]]:
    """(where, record) pairs; a record that cannot be decoded comes as a `_Bad`."""
    if path.suffix == ".parquet":
        yield from _parquet_records(path)
    elif path.suffix == ".json":
        yield from _json_array_records(path)
    else:
        with open(path, "rb") as f:
            yield from _jsonl_records(path, f)


# ---- formats ----------------------------------------------------------------------------------------------
def detect_format(record: dict) -> str | None:
    """The format a record's keys name, or None; the first match wins, in the order of DATA_FORMATS."""
    if "messages" in record:
        return "messages"
    if "conversations" in record:
        return "sharegpt"
    if "instruction" in record:
        return "alpaca"
    if "prompt" in record and "completion" in record:
        return "prompt_completion"
    if "text" in record:
        return "text"
    return None


def _field(record: dict, name: str, expected: str, *, optional: bool = False, allow_empty: bool = False):
    # Parquet fills an absent optional column with null, so null counts as absent for optional fields.
    value = record.get(name)
    if value is None:
        if optional:
            return None
        if name not in record:
            raise _Bad("missing_field", f"missing field {name!r} (expected {expected})")
        raise _Bad("wrong_type", f"field {name!r} is null (expected a string)")
    if not isinstance(value, str):
        raise _Bad("wrong_type", f"field {name!r} is {_json_type(value)} (expected a string)")
    if not allow_empty and not value.strip():
        raise _Bad("empty_content", f"field {name!r} is empty (expected non-empty text)")
    return value


def _check_messages(
    messages, field: str, role_key: str = "role", content_key: str = "content", role_map: dict | None = None
) -> list[dict]:
    if not isinstance(messages, list):
        raise _Bad("wrong_type", f"field {field!r} is {_json_type(messages)} (expected a list of messages)")
    if not messages:
        raise _Bad("empty_content", f"field {field!r} is an empty list (expected at least one message)")
    allowed = tuple(role_map) if role_map else ROLES
    out = []
    for i, m in enumerate(messages):
        at = f"{field}[{i}]"
        if not isinstance(m, dict):
            raise _Bad(
                "wrong_type", f"{at} is {_json_type(m)} (expected an object with {role_key!r} and {content_key!r})"
            )
        if role_key not in m or m[role_key] is None:
            raise _Bad("missing_field", f"{at} has no {role_key!r} (expected one of {', '.join(allowed)})")
        role = m[role_key]
        if not isinstance(role, str) or role not in allowed:
            raise _Bad("unknown_role", f"{at}.{role_key} is {role!r} (expected one of {', '.join(allowed)})")
        role = role_map[role] if role_map else role
        content = m.get(content_key)
        tool_calls = m.get("tool_calls")
        if content is None and not (role == "assistant" and tool_calls):
            if content_key not in m:
                raise _Bad("missing_field", f"{at} has no {content_key!r} (expected a string)")
            raise _Bad("wrong_type", f"{at}.{content_key} is null (expected a string)")
        if content is not None and not isinstance(content, str):
            raise _Bad("wrong_type", f"{at}.{content_key} is {_json_type(content)} (expected a string)")
        if role in _NEEDS_CONTENT and not (content or "").strip() and not tool_calls:
            raise _Bad("empty_content", f"{at}.{content_key} is empty (expected non-empty text for {role} messages)")
        # Other keys (tool_calls, name, ...) pass through to the template; nulls are Parquet's absent columns.
        extra = {k: v for k, v in m.items() if k not in (role_key, content_key, "role", "content") and v is not None}
        out.append({"role": role, "content": content if content is not None else "", **extra})
    return out


def normalize_record(record: dict, data_format: str) -> dict:
    """One record -> {"messages": [...], "tools": ...} or {"text": str}; raises `_Bad` for bad records."""
    if data_format == "text":
        return {"text": _field(record, "text", "text: a string")}
    if data_format == "messages":
        if "messages" not in record:
            raise _Bad("missing_field", "missing field 'messages' (expected messages: a list of {role, content})")
        return {"messages": _check_messages(record["messages"], "messages"), **tools_field(record)}
    if data_format == "sharegpt":
        if "conversations" not in record:
            raise _Bad("missing_field", "missing field 'conversations' (expected sharegpt: a list of {from, value})")
        messages = _check_messages(record["conversations"], "conversations", "from", "value", _SHAREGPT_ROLES)
        system = _field(record, "system", "a string", optional=True, allow_empty=True)
        if system and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": system})
        return {"messages": messages}
    if data_format == "alpaca":
        expected = "alpaca: instruction, input, output"
        prompt = alpaca_prompt(record, expected)
        return {"messages": prompt + [{"role": "assistant", "content": _field(record, "output", expected)}]}
    if data_format == "prompt_completion":
        expected = "prompt_completion: prompt and completion, both strings or both lists of messages"
        for name in ("prompt", "completion"):
            if name not in record:
                raise _Bad("missing_field", f"missing field {name!r} (expected {expected})")
        prompt, completion = record["prompt"], record["completion"]
        if isinstance(prompt, list) and isinstance(completion, list):
            messages = _check_messages(prompt, "prompt") + _check_messages(completion, "completion")
            return {"messages": messages}
        return {
            "messages": [
                {"role": "user", "content": _field(record, "prompt", expected)},
                {"role": "assistant", "content": _field(record, "completion", expected)},
            ]
        }
    raise ValueError(f"data_format={data_format!r}: expected one of {', '.join(DATA_FORMATS)}")


def tools_field(record: dict) -> dict:
    """{"tools": [...]} when the record gives tool schemas for the template, else {}."""
    tools = record.get("tools")
    if tools is None:
        return {}
    if not isinstance(tools, list):
        raise _Bad("wrong_type", f"field 'tools' is {_json_type(tools)} (expected a list of tool schemas)")
    return {"tools": tools}


def alpaca_prompt(record: dict, expected: str) -> list[dict]:
    """The messages before the answer of an alpaca record: system, the history's turns, instruction + input."""
    instruction = _field(record, "instruction", expected)
    extra_input = _field(record, "input", expected, optional=True, allow_empty=True)
    system = _field(record, "system", expected, optional=True, allow_empty=True)
    messages = [{"role": "system", "content": system}] if system else []
    history = record.get("history")
    if history is not None:
        if not isinstance(history, list) or not all(
            isinstance(p, list) and len(p) == 2 and all(isinstance(s, str) and s.strip() for s in p) for p in history
        ):
            raise _Bad("wrong_type", "field 'history' is malformed (expected a list of [user, assistant] strings)")
        for user, assistant in history:
            messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    user = instruction + ("\n" + extra_input if extra_input and extra_input.strip() else "")
    return messages + [{"role": "user", "content": user}]


_SFT_FORMATS_TEXT = "messages, conversations, instruction/output, prompt/completion or text"


def checked_records(
    files: list[Path], data_format: str, formats: dict, detect=None, expected: str = _SFT_FORMATS_TEXT
) -> Iterator[tuple[str, object]]:
    """(where, (record, format)) for every record of `files`, or (where, `_Bad`) for one that is not a JSON object
    of a known format. The format is found per file from its first valid record by `detect` (default
    `detect_format`; None: unknown, `expected` says what is known) unless `data_format` names one; `formats`
    receives each file's."""
    for path in files:
        yield from checked_source(str(path), _records(path), data_format, formats, detect, expected)


def checked_source(
    source: str, records, data_format: str, formats: dict, detect=None, expected: str = _SFT_FORMATS_TEXT
) -> Iterator[tuple[str, object]]:
    """`checked_records` for one source: `records` are its (where, record) pairs (a file's, or the rows of a
    `datasets.Dataset`); `formats[source]` receives the format found from its first valid record."""
    detect = detect or detect_format
    fmt = None if data_format == "auto" else data_format
    for where, record in records:
        if isinstance(record, _Bad):
            yield where, record
        elif not isinstance(record, dict):
            yield where, _Bad("not_an_object", f"a record is {_json_type(record)} (expected a JSON object)")
        elif fmt is None and (fmt := detect(record)) is None:
            yield (
                where,
                _Bad(
                    "unknown_format",
                    f"cannot tell the data format from the keys {sorted(record)} "
                    f"(expected {expected}; or set data_format)",
                ),
            )
        else:
            yield where, (record, fmt)
    formats[source] = fmt or "unknown"


def load_cached(cache_dir, name: str, files: list, tokenizer, options: dict, dataset_cls, build, *, write: bool = True):
    """`build`'s dataset, read from the entry `<cache_dir>/<name>-<key>/` when there (key: the files' contents, or
    the digests given for other sources, the tokenizer and `options`) and written there when not (`write=False`: not
    yet, `save_to_cache` does it later). `build(entry)` tokenises and returns the dataset written as the cache entry
    `entry` and read back from it, memory-mapped as a later run reads it; `build(None)` one not written there (without
    a cache_dir, or with `write=False`). Writing holds the entry's lock while it builds: of several processes that
    miss the same entry at once, one tokenises and the others wait, then read its entry (trainer/data/cache.py).
    `dataset_cls.load/save` read and write an entry; `summary["cache"]`, `["cache_hit"]` and `["cache_bytes"]`
    say which, where and how big."""
    if cache_dir is None:
        return build(None)
    entry = Path(cache_dir) / f"{name}-{_cache_key(files, tokenizer, options)[:32]}"
    ds = _read_cached(entry, dataset_cls)
    if ds is None:
        with entry_lock(entry) if write else contextlib.nullcontext():
            ds = _read_cached(entry, dataset_cls)  # written by another process while this one waited
            if ds is None:
                ds = build(entry if write else None)
                ds.summary.update(cache=str(entry), cache_hit=False)
    ds.summary["cache_bytes"] = entry_bytes(ds.arrays().values())
    return ds


def _read_cached(entry: Path, dataset_cls):
    """The dataset of `entry`, or None when there is none (or an unreadable one, which is rebuilt)."""
    if not (entry / "summary.json").is_file():
        return None
    try:
        ds = dataset_cls.load(entry)
    except (OSError, ValueError, KeyError) as exc:
        logger.warning("data cache %s is unreadable (%s); tokenizing again", entry, exc)
        return None
    ds.summary.update(cache=str(entry), cache_hit=True)
    return ds


# ---- rendering and masking --------------------------------------------------------------------------------
def _render(tokenizer, messages: list[dict], add_generation_prompt: bool, tools) -> str:
    kwargs = {"tools": tools} if tools is not None else {}
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **kwargs)
    except Exception as exc:  # the template is user code: raise_exception, undefined names, type errors
        raise _Bad(
            "template_error",
            f"the chat template failed on this conversation: {exc} (expected a conversation the template accepts)",
        ) from None


def _assistant_spans(tokenizer, messages: list[dict], text: str, tools, last_only: bool) -> list[tuple[int, int]]:
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if last_only:
        turns = turns[-1:]
    spans = []
    for i in turns:
        before = _render(tokenizer, messages[:i], True, tools)
        # The last turn's rendering is the whole text, already at hand (a third of the renders, single-turn).
        through = text if i + 1 == len(messages) else _render(tokenizer, messages[: i + 1], False, tools)
        if not through.startswith(before) or not text.startswith(through):
            part = (
                f"messages[:{i}] with the generation prompt"
                if not through.startswith(before)
                else f"messages[:{i + 1}]"
            )
            # Templates that rewrite earlier turns (Qwen3 drops the reasoning of answers before the last user
            # message) still render the last turn as a continuation of the rest: mask_history trains that one.
            way_out = (
                "set mask_history=True (--mask_history) to train on the last assistant turn only, "
                "train_on_prompt=True, or a template"
                if not last_only
                else "set train_on_prompt=True, or use a template"
            )
            raise _TemplateMismatch(
                f"chat template problem: the rendering of {part} is not a prefix of the rendering of the whole "
                "conversation (the template rewrites earlier turns), so assistant turns cannot be located; "
                f"{way_out} whose rendering of a conversation's prefix is a prefix of the whole, or one that marks "
                "answers with {% generation %} blocks"
            )
        spans.append((len(before), len(through)))
    return spans


def _supervised_tokens(offsets: list[tuple[int, int]], spans: list[tuple[int, int]], n_chars: int) -> np.ndarray:
    """Per token: does its character span overlap a supervised span (zero-width tokens: does it sit in one)?"""
    chars = np.zeros(n_chars + 1, dtype=np.int32)
    for start, end in spans:
        chars[start:end] = 1
    before = np.concatenate([[0], np.cumsum(chars)])  # before[k] = supervised characters in text[:k]
    pairs = itertools.chain.from_iterable(offsets)  # 2.4x faster than np.asarray on the list of tuples
    off = np.fromiter(pairs, dtype=np.int64, count=2 * len(offsets)).reshape(-1, 2)
    start, end = np.minimum(off[:, 0], n_chars), np.minimum(off[:, 1], n_chars)
    return ((before[end] - before[start]) > 0) | ((start == end) & (chars[start] > 0))


def _generation_spans(tokenizer, messages: list[dict], tools) -> tuple[str, list[tuple[int, int]]]:
    kwargs = {"tools": tools} if tools is not None else {}
    try:
        return tokenizer.render_with_generation_spans(messages, add_generation_prompt=False, **kwargs)
    except Exception as exc:  # user code, as in _render
        raise _Bad(
            "template_error",
            f"the chat template failed on this conversation: {exc} (expected a conversation the template accepts)",
        ) from None


def _encode_conversation(tokenizer, messages, tools, train_on_prompt, mask_history) -> tuple[list[int], np.ndarray]:
    if train_on_prompt:
        ids = tokenizer.encode(_render(tokenizer, messages, False, tools))
        return ids, np.ones(len(ids), dtype=bool)
    if tokenizer.has_generation_blocks:  # the template says which text is the assistant's
        text, spans = _generation_spans(tokenizer, messages, tools)
        spans = spans[-1:] if mask_history else spans
    else:
        text = _render(tokenizer, messages, False, tools)
        spans = _assistant_spans(tokenizer, messages, text, tools, last_only=mask_history)
    ids, offsets = tokenizer.encode_with_offsets(text)
    return ids, _supervised_tokens(offsets, spans, len(text))


def _encode_text(tokenizer, text: str) -> tuple[list[int], np.ndarray]:
    ids = tokenizer.encode(text)
    if tokenizer.add_bos_token and tokenizer.bos_token_id is not None:
        ids = [tokenizer.bos_token_id] + ids
    if tokenizer.eos_token_id is None:
        raise DataError(
            "the text format appends EOS, but the tokenizer names no eos_token (expected an eos_token "
            "in tokenizer_config.json)"
        )
    ids.append(tokenizer.eos_token_id)  # the model must learn where a document ends
    return ids, np.ones(len(ids), dtype=bool)


def _labels(ids: list[int], supervised: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    ids = np.asarray(ids, dtype=np.int32)
    labels = np.where(supervised, ids, IGNORE_INDEX).astype(np.int32)
    if len(labels):
        labels[0] = IGNORE_INDEX  # no position predicts the first token
    return ids, labels


def tokenize_conversation(
    tokenizer, messages: list[dict], *, train_on_prompt: bool = False, mask_history: bool = False, tools=None
) -> tuple[list[int], list[int]]:
    """Render and tokenize one conversation -> (input_ids, labels), labels unshifted with -100 off target."""
    try:
        ids, supervised = _encode_conversation(tokenizer, messages, tools, train_on_prompt, mask_history)
    except (_Bad, _TemplateMismatch) as exc:
        raise DataError(str(exc)) from None
    ids, labels = _labels(ids, supervised)
    return ids.tolist(), labels.tolist()


def tokenize_text(tokenizer, text: str) -> tuple[list[int], list[int]]:
    """Tokenize one pre-training document (EOS appended, every token a target) -> (input_ids, labels)."""
    ids, labels = _labels(*_encode_text(tokenizer, text))
    return ids.tolist(), labels.tolist()


# ---- the dataset ------------------------------------------------------------------------------------------
def flat(array, dtype) -> np.ndarray:
    """`array` as a contiguous array of `dtype`: itself when it is one already (a memory-mapped cache entry stays
    mapped), else a copy."""
    if isinstance(array, np.ndarray) and array.dtype == dtype and array.flags.c_contiguous:
        return array
    return np.ascontiguousarray(array, dtype=dtype)


class TokenizedDataset(Sequence):
    """Tokenized examples stored flat: example i is input_ids[offsets[i]:offsets[i+1]] (int32), same for labels."""

    def __init__(self, input_ids: np.ndarray, labels: np.ndarray, offsets: np.ndarray, summary: dict | None = None):
        self.input_ids = flat(input_ids, np.int32)
        self.labels = flat(labels, np.int32)
        self.offsets = flat(offsets, np.int64)
        if self.input_ids.shape != self.labels.shape or self.offsets[-1] != len(self.input_ids):
            raise ValueError("TokenizedDataset: input_ids, labels and offsets do not describe the same examples")
        if summary is None:
            summary = _stats(self.lengths, _target_count(self.labels, self.offsets))
        self.summary = dict(summary)

    @classmethod
    def from_examples(cls, examples: Iterable, summary: dict | None = None) -> TokenizedDataset:
        """From (input_ids, labels) pairs or {"input_ids", "labels"} dicts, e.g. for tests or custom pipelines."""
        ids, labels, lengths = [], [], [0]
        for ex in examples:
            i, lab = (ex["input_ids"], ex["labels"]) if isinstance(ex, dict) else ex
            if len(i) != len(lab) or len(i) == 0:
                raise ValueError(
                    "TokenizedDataset.from_examples: each example needs equally long, non-empty input_ids and labels"
                )
            ids.append(np.asarray(i, dtype=np.int32))
            labels.append(np.asarray(lab, dtype=np.int32))
            lengths.append(len(i))
        if not ids:
            raise ValueError("TokenizedDataset.from_examples: no examples")
        return cls(np.concatenate(ids), np.concatenate(labels), np.cumsum(lengths), summary)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> dict:
        if not -len(self) <= i < len(self):
            raise IndexError(f"example {i} out of range for a dataset of {len(self)}")
        i %= len(self)
        a, b = self.offsets[i], self.offsets[i + 1]
        return {"input_ids": self.input_ids[a:b], "labels": self.labels[a:b]}

    @property
    def lengths(self) -> np.ndarray:
        """Tokens per example (int64)."""
        return np.diff(self.offsets)

    def select(self, indices) -> TokenizedDataset:
        """A new dataset of the given examples, in that order (the summary's statistics are recomputed)."""
        indices = np.asarray(indices, dtype=np.int64)
        if len(indices) == 0:
            raise ValueError("TokenizedDataset.select: no indices")
        starts, ends = self.offsets[indices], self.offsets[indices + 1]
        offsets = np.concatenate([[0], np.cumsum(ends - starts)])
        take = np.arange(offsets[-1]) + np.repeat(starts - offsets[:-1], ends - starts)  # flat source positions
        out = TokenizedDataset(self.input_ids[take], self.labels[take], offsets)
        kept = ("files", "formats", "options", "from_dataset")  # where the examples came from, and how
        out.summary = {**{k: v for k, v in self.summary.items() if k in kept}, **out.summary}
        return out

    def summary_text(self) -> str:
        return summary_text(self.summary)

    def arrays(self) -> dict[str, np.ndarray]:
        """The arrays a cache entry stores."""
        return {"input_ids": self.input_ids, "labels": self.labels, "offsets": self.offsets}

    def save(self, path: str | Path) -> None:
        """Write as the cache entry (directory) `path`, atomically (trainer/data/cache.py)."""
        write_entry(path, self.arrays(), self.summary)

    @classmethod
    def load(cls, path: str | Path) -> TokenizedDataset:
        """The dataset of the cache entry `path`, its arrays memory-mapped (read-only)."""
        arrays, summary = read_entry(path, ("input_ids", "labels", "offsets"))
        return cls(arrays["input_ids"], arrays["labels"], arrays["offsets"], summary)


def _target_count(labels: np.ndarray, offsets: np.ndarray) -> int:
    """The target tokens of the examples that `offsets` cut `labels` into (never the first token of one)."""
    targets = labels != IGNORE_INDEX
    targets[offsets[:-1]] = False
    return int(targets.sum())


def _stats(lengths: np.ndarray, supervised_tokens: int) -> dict:
    """The summary's statistics of examples of `lengths` holding `supervised_tokens` target tokens."""
    if len(lengths):
        # pXX = the smallest length that XX% of the examples do not exceed (an actual example length).
        p50, p90, p99 = (int(v) for v in np.percentile(lengths, [50, 90, 99], method="inverted_cdf"))
        length = {
            "p50": p50,
            "p90": p90,
            "p99": p99,
            "max": int(lengths.max()),
            "mean": round(float(lengths.mean()), 1),
        }
    else:
        length = {"p50": 0, "p90": 0, "p99": 0, "max": 0, "mean": 0.0}
    return {
        "examples": len(lengths),
        "tokens": int(lengths.sum()),
        "supervised_tokens": supervised_tokens,
        "length": length,
    }


def summary_text(summary: dict) -> str:
    """The summary as a few printable lines."""
    lines = []
    formats = summary.get("formats")
    if formats and summary.get("from_dataset"):  # `datasets` splits, named as in errors ("dataset split 'train'")
        # tokenize_sft_dataset's one split reads "from a dataset split 'train'", --dataset_name's "from data/x:train"
        sources = ", ".join(f"{'a ' * source.startswith('dataset')}{source} ({fmt})" for source, fmt in formats.items())
        mixture = f", mixed by {summary['mixture']}" if summary.get("mixture") else ""
        lines.append(f"data: {summary['examples']:,} examples from {sources}{mixture}")
    elif formats:
        files = ", ".join(f"{Path(f).name} ({fmt})" for f, fmt in formats.items())
        lines.append(f"data: {summary['examples']:,} examples from {len(formats)} file(s): {files}")
    else:
        lines.append(f"data: {summary['examples']:,} examples")
    if "examples_read" in summary:
        counts = sorted(summary.get("dropped", {}).items())  # bad records and examples without a target, by reason
        line = f"  read {summary['examples_read']:,}"
        for what, kinds in (
            ("skipped bad", {k: v for k, v in counts if k not in _NO_TARGETS}),
            ("dropped", {k: v for k, v in counts if k in _NO_TARGETS}),
        ):
            if kinds or what == "dropped":
                reasons = ", ".join(f"{k} {v:,}" for k, v in kinds.items())
                line += f", {what} {sum(kinds.values()):,}" + (f" ({reasons})" if reasons else "")
        lines.append(
            line + f", truncated {summary.get('truncated', 0):,} (cutoff_len {summary['options']['cutoff_len']})"
        )
    tokens, sup = summary["tokens"], summary["supervised_tokens"]
    lines.append(f"  tokens {tokens:,}, supervised {sup:,} ({100.0 * sup / max(tokens, 1):.1f}%)")
    ln = summary["length"]
    lines.append(f"  length p50 {ln['p50']} p90 {ln['p90']} p99 {ln['p99']} max {ln['max']} mean {ln['mean']}")
    if summary.get("cache"):
        lines.append(cache_line(summary))
    return "\n".join(lines)


def cache_line(summary: dict) -> str:
    """The summary's cache line: "cache hit|miss <size> <entry>" (a hit was read, a miss tokenised; the size of its
    arrays, in MB, or kB below 0.1 MB)."""
    size = summary.get("cache_bytes", 0)
    size = f"{size / 1e6:.1f} MB" if size >= 1e5 else f"{size / 1e3:.1f} kB"
    return f"  cache {'hit' if summary.get('cache_hit') else 'miss'} {size} {summary['cache']}"


# ---- loading ----------------------------------------------------------------------------------------------
def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _cache_key(files: list, tokenizer, options: dict) -> str:
    """sha256 of what decides the tokens: `files` (paths, whose contents are hashed, or the content digests of
    other sources as strings, e.g. `trainer.data.hf_sources.dataset_digest`), the tokenizer and `options`."""
    h = hashlib.sha256()
    parts = [
        _CACHE_VERSION,
        json.dumps(options, sort_keys=True),
        tokenizer.backend.to_str(),
        tokenizer.chat_template or DEFAULT_CHAT_TEMPLATE,
        json.dumps([tokenizer.bos_token, tokenizer.eos_token, tokenizer.add_bos_token]),
    ]
    # The suffix decides how a file is parsed; the name and location do not matter.
    parts += [f if isinstance(f, str) else f"{f.suffix}:{_file_digest(f)}" for f in files]
    for part in parts:
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def checked_options(data_format, cutoff_len, train_on_prompt, mask_history, skip_bad_examples) -> dict:
    """The tokenisation options (the cache key's part), checked: a file's (`load_sft_dataset`) or a Dataset's
    (`trainer.data.hf_datasets.tokenize_sft_dataset`)."""
    if data_format not in DATA_FORMATS:
        raise ValueError(f"data_format={data_format!r}: expected one of {', '.join(DATA_FORMATS)}")
    if cutoff_len is not None and (not isinstance(cutoff_len, int) or cutoff_len < 2):
        raise ValueError(f"cutoff_len={cutoff_len!r}: expected an int >= 2, or None for no truncation")
    if train_on_prompt and mask_history:
        raise ValueError(
            "train_on_prompt and mask_history cannot both be set (train_on_prompt supervises every "
            "token, mask_history only the last assistant turn)"
        )
    return {
        "data_format": data_format,
        "cutoff_len": cutoff_len,
        "train_on_prompt": train_on_prompt,
        "mask_history": mask_history,
        "skip_bad_examples": skip_bad_examples,
    }


def load_sft_dataset(
    paths,
    tokenizer,
    *,
    data_format: str = "auto",
    cutoff_len: int | None = 2048,
    train_on_prompt: bool = False,
    mask_history: bool = False,
    skip_bad_examples: bool = False,
    cache_dir: str | Path | None = None,
    show_progress: bool = True,
    write_cache: bool = True,
    num_proc: int | None = None,
) -> TokenizedDataset:
    """Read, normalise, render, mask, truncate and tokenize `paths` once (cached under `cache_dir`). With
    `write_cache=False` a dataset tokenised anew is not saved yet: `save_to_cache(ds)` saves it once the caller may
    write (the CLI reads and checks every input before it writes anything). `num_proc` > 1 tokenises in that many
    processes (TRL's dataset_num_proc), with the same result bit for bit; it is not part of the cache key. The
    arrays are memory-mapped, whether read or tokenised (`_build`): without `cache_dir` (or with `write_cache=False`)
    from files in a temporary directory ($TMPDIR), removed once mapped, whose space is freed with the dataset."""
    options = checked_options(data_format, cutoff_len, train_on_prompt, mask_history, skip_bad_examples)
    files = resolve_data_files(paths)
    formats: dict[str, str] = {}
    items = checked_records(files, data_format, formats)
    ds = load_cached(
        cache_dir,
        "data",
        files,
        tokenizer,
        options,
        TokenizedDataset,
        lambda entry: _build(
            items, [str(f) for f in files], formats, tokenizer, options, show_progress, num_proc, entry
        ),
        write=write_cache,
    )
    _keep_chat_template(tokenizer, ds)
    return ds


def save_to_cache(ds: TokenizedDataset) -> None:
    """Save a dataset that `load_sft_dataset(..., write_cache=False)` tokenised into its cache entry (a no-op for one
    read from the cache, one whose entry another process wrote meanwhile, or one loaded without a cache_dir)."""
    if ds.summary.get("cache") and not ds.summary.get("cache_hit"):
        entry = Path(ds.summary["cache"])
        with entry_lock(entry):
            if not (entry / "summary.json").is_file():
                ds.save(entry)


def _keep_chat_template(tokenizer, ds: TokenizedDataset) -> None:
    """Conversations rendered with ChatML because the tokenizer has no template: say so once, and make ChatML the
    tokenizer's template, so that it is saved with the model and generation (here and in transformers) renders the
    same way."""
    rendered = any(fmt not in ("text", "unknown", "tokens") for fmt in ds.summary.get("formats", {}).values())
    if rendered and tokenizer.adopt_default_chat_template():
        logger.warning(
            "tokenizer: %s has no chat template; the conversations are rendered with ChatML "
            "(<|im_start|>role ...<|im_end|>), which is saved with the model (chat_template.jinja) so that "
            "generation uses it too",
            tokenizer.name_or_path or "the tokenizer",
        )


def _encode_item(where: str, item, tokenizer, options: dict) -> tuple:
    """One item of `checked_records` encoded: ("ok", ids, labels, truncated), ("bad", reason, message) for a bad
    record, ("drop", reason, message, truncated) for an example left with no target, or ("fatal", message), an error no
    option skips. A pure function of its arguments: `_build` runs it in this process or in a pool's workers, and
    gets the same outcomes either way."""
    try:
        if isinstance(item, _Bad):
            raise item
        example = normalize_record(*item)
        if "text" in example:
            ids, supervised = _encode_text(tokenizer, example["text"])
        else:
            ids, supervised = _encode_conversation(
                tokenizer,
                example["messages"],
                example.get("tools"),
                options["train_on_prompt"],
                options["mask_history"],
            )
    except _Bad as exc:
        return ("bad", exc.reason, exc.message)
    except _TemplateMismatch as exc:
        return ("fatal", f"{where}: {exc}")
    except DataError as exc:  # the tokenizer cannot encode this format at all (text without an eos_token)
        return ("fatal", str(exc))
    ids, labels = _labels(ids, supervised)
    had_targets = bool((labels != IGNORE_INDEX).any())
    cutoff_len = options["cutoff_len"]
    truncated = cutoff_len is not None and len(ids) > cutoff_len
    if truncated:
        ids, labels = ids[:cutoff_len], labels[:cutoff_len]
    if not (labels != IGNORE_INDEX).any():
        if had_targets:
            return (
                "drop",
                "no_targets_after_truncation",
                f"no target token left after truncation to cutoff_len {cutoff_len} (the answer starts later; raise "
                "cutoff_len to keep it)",
                truncated,
            )
        return ("drop", "no_targets", "no target token (no assistant answer to train on)", truncated)
    return ("ok", ids, labels, truncated)


_BLOCK_PER_PROCESS = 1024  # items read ahead per worker process by `_outcomes`
# A worker's tokenizer and options, set once per worker by the pool's initializer (not sent with every item).
_WORKER: dict = {}


def _init_worker(tokenizer, options: dict) -> None:
    _WORKER.update(tokenizer=tokenizer, options=options)


def _encode_in_worker(pair) -> tuple:
    where, item = pair
    return _encode_item(where, item, _WORKER["tokenizer"], _WORKER["options"])


def _outcomes(items, tokenizer, options: dict, num_proc: int | None) -> Iterator[tuple[str, tuple]]:
    """(where, `_encode_item`'s outcome) for every item, in the order of `items`: in this process, or with
    `num_proc` > 1 in a pool of that many processes. This process reads `items` (the files, the format detection)
    a block at a time; the pool encodes each block in contiguous chunks and `imap` returns the results in the
    block's order, so the dataset, the drops and the first error are those of one process, bit for bit
    (tests/trainer/data/test_hf_sources.py). Measured on this 2-core machine, shared with other work (20,000 short
    embedded-task conversations, byte-level tokenizer): one process 4.7 s; two 7.6 s wall, with 5.7 s of CPU in the
    workers (the 4.6 s of encoding, plus pickling) and 1.0 s here (reading, pickling). So a gain needs free cores;
    this process's share bounds it near 5x for examples this short, more for longer ones. (Measured with fork
    workers; forkserver adds its start: the two num_proc tests of tests/trainer/data/test_hf_sources.py, five pools,
    took 5.3 s with fork and 8.6 s with forkserver.)"""
    if not num_proc or num_proc <= 1:
        for where, item in items:
            yield where, _encode_item(where, item, tokenizer, options)
        return
    import multiprocessing

    # Not fork: forking this process, whose other threads (a launcher's, a logger's, torch's) may hold locks at that
    # moment, can leave a worker deadlocked and imap waiting for ever. forkserver forks the workers from a clean
    # single-threaded server that has imported this module once (a second or two, once per process); spawn where
    # there is none. Both pickle the tokenizer to the workers.
    method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    context = multiprocessing.get_context(method)
    if method == "forkserver":
        context.set_forkserver_preload([__name__])
    items = iter(items)
    with context.Pool(num_proc, initializer=_init_worker, initargs=(tokenizer, options)) as pool:
        while block := list(itertools.islice(items, _BLOCK_PER_PROCESS * num_proc)):  # bounds what is in memory
            chunksize = max(1, len(block) // (4 * num_proc))  # a few chunks per worker: balance against pickling
            for (where, _), outcome in zip(block, pool.imap(_encode_in_worker, block, chunksize=chunksize)):
                yield where, outcome


_ARRAYS = (("input_ids", np.int32), ("labels", np.int32), ("offsets", np.int64))  # a TokenizedDataset's, as stored


def _build(
    items,
    sources: list[str],
    formats: dict,
    tokenizer,
    options: dict,
    show_progress: bool,
    num_proc: int | None = None,
    entry: Path | None = None,
) -> TokenizedDataset:
    """The dataset of `items`, (where, (record, format)) or (where, `_Bad`) as `checked_records` yields them;
    `sources` (files, or a `datasets.Dataset`) and `formats` (filled while reading) for errors and the summary.
    `num_proc` > 1 tokenises in that many processes, with the same result (`_outcomes`). The arrays are written as the
    examples come (`ArrayWriter`, a bounded buffer each) into the cache entry `entry`, renamed into place
    once whole (trainer/data/cache.py), and the dataset returned is read back from it, memory-mapped as a later run
    reads it: this process never holds the arrays whole. Without `entry` (no cache, or not written yet) they are
    written into a temporary directory (tempfile's, $TMPDIR) that is removed once they are mapped: the mapping keeps
    the files' data, on disk, until the dataset is freed."""
    skip = options["skip_bad_examples"]
    dropped: Counter = Counter()
    read = truncated = kept = tokens = supervised = 0
    desc = "tokenizing" + (f" ({num_proc} processes)" if num_proc and num_proc > 1 else "")
    progress = tqdm(desc=desc, unit=" examples", disable=not show_progress, mininterval=0.5)

    def drop(where: str, reason: str, message: str) -> None:
        dropped[reason] += 1
        if dropped[reason] <= _MAX_WARNINGS:
            logger.warning("%s %s: %s", "dropping" if reason in _NO_TARGETS else "skipping", where, message)

    with building(entry) as (directory, entry):
        writers = {name: ArrayWriter(directory / f"{name}.npy", dtype) for name, dtype in _ARRAYS}
        writers["offsets"].append([0])
        try:
            for where, outcome in _outcomes(items, tokenizer, options, num_proc):
                read += 1
                progress.update()
                kind = outcome[0]
                if kind == "fatal":
                    raise DataError(outcome[1])
                if kind == "bad":
                    if not skip:
                        raise DataError(f"{where}: {outcome[2]}")
                    drop(where, outcome[1], outcome[2])
                elif kind == "drop":  # a truncated example counts as truncated, kept or not
                    truncated += outcome[3]
                    drop(where, outcome[1], outcome[2])
                else:
                    _, ids, labels, was_truncated = outcome
                    truncated += was_truncated
                    kept += 1
                    tokens += len(ids)
                    supervised += int(np.count_nonzero(labels[1:] != IGNORE_INDEX))  # the first token: never a target
                    writers["input_ids"].append(ids)
                    writers["labels"].append(labels)
                    writers["offsets"].append([tokens])
        finally:
            progress.close()
            for writer in writers.values():
                writer.close()

        if not kept:
            reasons = ", ".join(f"{k} {v}" for k, v in sorted(dropped.items())) or "no records"
            raise DataError(
                f"{', '.join(sources)}: no usable examples ({reasons}) (expected at least one example with a target "
                "token)"
            )
        unnamed = {reason: n - _MAX_WARNINGS for reason, n in sorted(dropped.items()) if n > _MAX_WARNINGS}
        if unnamed:
            logger.warning(
                "not named above: %s (the first %d of each kind are)",
                ", ".join(f"{n:,} more {reason} ({dropped[reason]:,} in all)" for reason, n in unnamed.items()),
                _MAX_WARNINGS,
            )
        lengths = np.diff(np.load(directory / "offsets.npy", mmap_mode="r"))
        summary = {
            "files": sources,
            "formats": formats,
            "options": options,
            "examples_read": read,
            "dropped": dict(sorted(dropped.items())),
            "truncated": truncated,
            **_stats(np.asarray(lengths), supervised),
        }
        commit(directory, entry, summary)
        return TokenizedDataset.load(entry)


def read_examples(paths, *, data_format: str = "auto", skip_bad_examples: bool = False) -> list[dict]:
    """The normalised records ({"messages"} or {"text"}, plus "source": "file:line"), e.g. to prompt for evals."""
    checked_options(data_format, None, False, False, skip_bad_examples)
    out = []
    for where, item in checked_records(resolve_data_files(paths), data_format, {}):
        try:
            if isinstance(item, _Bad):
                raise item
            out.append({**normalize_record(*item), "source": where})
        except _Bad as exc:
            if not skip_bad_examples:
                raise DataError(f"{where}: {exc.message}") from None
    return out


def split_dataset(
    ds: TokenizedDataset, val_size: int | float, seed: int = 0
) -> tuple[TokenizedDataset, TokenizedDataset]:
    """A held-out split: (train, val), val_size a count (int) or a fraction in (0, 1); deterministic for a seed.
    A val_size that leaves no example on either side is a one-line ConfigError (a ValueError) naming the count."""
    n = len(ds)
    if isinstance(val_size, bool) or not isinstance(val_size, (int, float)):
        raise ConfigError(f"val_size={val_size!r}: expected an int count or a float fraction in (0, 1)")
    if isinstance(val_size, float):
        if not 0.0 < val_size < 1.0:
            raise ConfigError(f"val_size={val_size!r}: a fraction must lie in (0, 1)")
        n_val = max(1, int(round(n * val_size)))
    else:
        n_val = val_size
    if n < 2:
        raise ConfigError(
            f"val_size={val_size!r}: the training data holds {n} example, too few to hold one out and "
            "train on the rest; expected val_size 0 (no held-out split), or more data"
        )
    if not 1 <= n_val < n:
        raise ConfigError(
            f"val_size={val_size!r} holds out {n_val} of the {n} training examples, leaving "
            f"{max(n - n_val, 0)} to train on; expected a count from 1 to {n - 1} or a fraction in "
            "(0, 1) that leaves at least one example to train on"
        )
    perm = np.random.default_rng(seed).permutation(n)
    # Both halves keep the dataset's order, so a split reads like a filter of the file.
    return ds.select(np.sort(perm[n_val:])), ds.select(np.sort(perm[:n_val]))
