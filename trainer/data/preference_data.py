"""Preference data for DPO and its family: read pairs, normalise, render, split prompt from answers, truncate, cache.

Pipeline (`load_preference_dataset`), run once per dataset and cached like the SFT data (trainer/data/sft_data.py, whose
readers, file:line errors, skip_bad_examples counting and cache key it shares):

1. Formats, detected per file from its first valid record (or forced with `data_format`):
   standard        {"prompt"?, "chosen": str, "rejected": str}                       TRL's standard preference
   conversational  {"prompt"?: [messages], "chosen": [messages], "rejected": [messages]}  TRL's conversational
   sharegpt        {"conversations": [{from, value}], "chosen": {from, value}, "rejected": {from, value}}
                   (LlamaFactory's ranking data, optional "system")
   alpaca          {"instruction", "input"?, "chosen": str, "rejected": str} (LlamaFactory's ranking data,
                   optional "system" and "history")
   Without a "prompt" the prompt is implicit: the longest shared prefix of chosen and rejected, in messages for
   conversational data and in characters for standard data (TRL's `extract_prompt`, which also leaves a space
   that ends the shared prefix to the answers).
2. Every pair becomes messages: a string prompt is one user turn and a string answer one assistant turn (as the
   SFT data's prompt/completion strings are). Deliberate difference from TRL, which concatenates standard-format
   strings without the chat template: here the answer always follows the template's generation prompt, the text
   the model sees before an answer when it is used.
3. Tokens as TRL's DPOTrainer makes them: prompt = render(prompt, add_generation_prompt=True), and each answer's
   sequence = render(prompt + answer). The answer starts where the token ids of the prompt and of the whole
   sequence first differ, taken over both answers (a template or a tokenizer that merges across the boundary
   moves the split, never the answer text).
4. Truncation: `max_prompt_length` keeps the prompt's last tokens (TRL before 1.0); `max_length` cuts each whole
   sequence, keeping its start (`truncation_mode="keep_start"`, TRL's default) or its end ("keep_end": the shared
   prompt loses its first tokens until the longer sequence fits, and an answer longer than max_length keeps its
   last tokens; TRL cuts the two sequences apart, so there the shorter one can keep more of its prompt).
   A pair is dropped and counted when a side keeps no answer token (`no_targets_after_truncation`).
5. Bad pairs are one-line `DataError`s naming file:line (or, with `skip_bad_examples`, counted by reason):
   identical answers (`identical_answers`: nothing to prefer), an empty answer (`empty_content`), missing or
   mistyped fields.

The result is a `PreferenceDataset`: per pair the prompt's token ids and each answer's; `collate_pairs` makes
the model's batch of 2k rows, the k chosen sequences first, then the k rejected ones, labels on answer tokens
only.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from trainer.data.cache import ArrayWriter, building, commit, read_entry, write_entry
from trainer.data.sft_data import (
    _MAX_WARNINGS,
    _SHAREGPT_ROLES,
    IGNORE_INDEX,
    DataError,
    _Bad,
    _check_messages,
    _field,
    _json_type,
    _render,
    alpaca_prompt,
    cache_line,
    checked_records,
    flat,
    load_cached,
    logger,
    resolve_data_files,
    tools_field,
)

PREFERENCE_FORMATS = ("auto", "standard", "conversational", "sharegpt", "alpaca")
TRUNCATION_MODES = ("keep_start", "keep_end")
_CACHE_VERSION = "kernelwright-preference-v2"  # v2: a directory of .npy files (memory-mapped)
_PARTS = ("prompt", "chosen", "rejected")
PAIR_FORMATS_TEXT = "chosen and rejected, with prompt, conversations or instruction"  # what the formats' keys are


# ---- formats ----------------------------------------------------------------------------------------------
def detect_preference_format(record: dict) -> str | None:
    """The preference format a record's keys name, or None."""
    if "chosen" not in record or "rejected" not in record:
        return None
    if "conversations" in record:
        return "sharegpt"
    if "instruction" in record:
        return "alpaca"
    return "conversational" if isinstance(record["chosen"], list) else "standard"


def _shared_prefix(chosen: Sequence, rejected: Sequence) -> int:
    """Length of the longest shared prefix (TRL's extract_prompt: for text, a space before the first difference
    goes with the answers)."""
    n = min(len(chosen), len(rejected))
    for i in range(n):
        if chosen[i] != rejected[i]:
            return i - 1 if i > 0 and isinstance(chosen, str) and chosen[i - 1] == " " else i
    return n


def _answer(messages: list[dict], part: str) -> list[dict]:
    if not any(m["role"] == "assistant" for m in messages):
        raise _Bad("no_answer", f"field {part!r} holds no assistant message (expected the answer to prefer or reject)")
    return messages


def normalize_pair(record: dict, data_format: str) -> dict:
    """One record -> {"prompt": messages, "chosen": messages, "rejected": messages}; raises `_Bad` for bad records."""
    expected = {
        "standard": "standard: prompt, chosen and rejected strings",
        "conversational": "conversational: chosen and rejected message lists, prompt optional",
        "sharegpt": "sharegpt: conversations, chosen and rejected {from, value}",
        "alpaca": "alpaca: instruction, chosen and rejected strings",
    }.get(data_format)
    if expected is None:
        raise ValueError(f"data_format={data_format!r}: expected one of {', '.join(PREFERENCE_FORMATS)}")
    for name in ("chosen", "rejected"):
        if name not in record:
            raise _Bad("missing_field", f"missing field {name!r} (expected {expected})")
    if data_format == "standard":
        chosen, rejected = _field(record, "chosen", expected), _field(record, "rejected", expected)
        prompt = _field(record, "prompt", expected, optional=True)
        if prompt is None:
            cut = _shared_prefix(chosen, rejected)
            prompt, chosen, rejected = chosen[:cut], chosen[cut:], rejected[cut:]
            if not prompt.strip():
                raise _Bad(
                    "no_prompt",
                    "chosen and rejected share no prompt text (expected a 'prompt' field, or "
                    "answers that start with the same prompt)",
                )
        pair = {"prompt": [{"role": "user", "content": prompt}]}
        for name, text in (("chosen", chosen), ("rejected", rejected)):
            if not text.strip():
                raise _Bad("empty_content", f"the {name} answer is empty (expected non-empty text)")
            pair[name] = [{"role": "assistant", "content": text}]
    elif data_format == "conversational":
        chosen = _check_messages(record["chosen"], "chosen")
        rejected = _check_messages(record["rejected"], "rejected")
        if record.get("prompt") is not None:
            prompt = _check_messages(record["prompt"], "prompt")
        else:
            cut = _shared_prefix(chosen, rejected)
            prompt, chosen, rejected = chosen[:cut], chosen[cut:], rejected[cut:]
            if not prompt:
                raise _Bad(
                    "no_prompt",
                    "chosen and rejected share no first message (expected a 'prompt' field, or "
                    "conversations that start with the same prompt)",
                )
        for name, messages in (("chosen", chosen), ("rejected", rejected)):
            if not messages:
                raise _Bad(
                    "empty_content",
                    f"the {name} answer is empty (chosen and rejected are the same conversation up to its end)",
                )
        pair = {"prompt": prompt, "chosen": _answer(chosen, "chosen"), "rejected": _answer(rejected, "rejected")}
    elif data_format == "sharegpt":
        if "conversations" not in record:
            raise _Bad("missing_field", f"missing field 'conversations' (expected {expected})")
        prompt = _check_messages(record["conversations"], "conversations", "from", "value", _SHAREGPT_ROLES)
        system = _field(record, "system", expected, optional=True, allow_empty=True)
        if system and prompt[0]["role"] != "system":
            prompt.insert(0, {"role": "system", "content": system})
        pair = {"prompt": prompt}
        for name in ("chosen", "rejected"):
            value = record[name]
            if not isinstance(value, dict):
                raise _Bad("wrong_type", f"field {name!r} is {_json_type(value)} (expected an object {{from, value}})")
            pair[name] = _answer(_check_messages([value], name, "from", "value", _SHAREGPT_ROLES), name)
    else:  # alpaca
        pair = {"prompt": alpaca_prompt(record, expected)}
        for name in ("chosen", "rejected"):
            pair[name] = [{"role": "assistant", "content": _field(record, name, expected)}]
    if pair["chosen"] == pair["rejected"]:
        raise _Bad(
            "identical_answers", "chosen and rejected are identical (expected two different answers, one to prefer)"
        )
    return pair | tools_field(record)


# ---- tokens -----------------------------------------------------------------------------------------------
def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def tokenize_pair(tokenizer, pair: dict) -> tuple[list[int], list[int], list[int]]:
    """(prompt ids, chosen answer ids, rejected answer ids) of a normalised pair, before truncation (module
    docstring, step 3); raises `_Bad` when the template fails on it."""
    tools = pair.get("tools")
    prompt = tokenizer.encode(_render(tokenizer, pair["prompt"], True, tools))
    chosen = tokenizer.encode(_render(tokenizer, pair["prompt"] + pair["chosen"], False, tools))
    rejected = tokenizer.encode(_render(tokenizer, pair["prompt"] + pair["rejected"], False, tools))
    cut = min(_common_prefix(prompt, chosen), _common_prefix(prompt, rejected))
    return prompt[:cut], chosen[cut:], rejected[cut:]


def truncate_pair(
    prompt: list[int],
    chosen: list[int],
    rejected: list[int],
    *,
    max_length: int | None,
    max_prompt_length: int | None,
    truncation_mode: str,
) -> tuple[list[int], list[int], list[int]]:
    """The pair after truncation (module docstring, step 4); a side may come back without answer tokens."""
    if max_prompt_length is not None:
        prompt = prompt[-max_prompt_length:]
    if max_length is None:
        return prompt, chosen, rejected
    if truncation_mode == "keep_start":
        keep = max(0, max_length - len(prompt))
        return prompt[:max_length], chosen[:keep], rejected[:keep]
    # keep_end: each sequence keeps its last max_length tokens; the prompt kept is the longer side's share
    drop = max(len(chosen), len(rejected)) + len(prompt) - max_length
    if drop <= 0:
        return prompt, chosen, rejected
    lost_prompt = min(drop, len(prompt))
    prompt = prompt[lost_prompt:]
    room = max_length - len(prompt)
    return prompt, chosen[-room:] if room else [], rejected[-room:] if room else []


# ---- the dataset ------------------------------------------------------------------------------------------
class PreferenceDataset(Sequence):
    """Tokenized pairs stored flat: pair i's prompt is prompt_ids[offsets[0][i]:offsets[0][i+1]], and likewise the
    chosen and rejected answers with offsets[1] and offsets[2]."""

    def __init__(self, ids: dict[str, np.ndarray], offsets: dict[str, np.ndarray], summary: dict | None = None):
        self.ids = {k: flat(ids[k], np.int32) for k in _PARTS}
        self.offsets = {k: flat(offsets[k], np.int64) for k in _PARTS}
        counts = {len(o) for o in self.offsets.values()}
        if len(counts) != 1 or any(self.offsets[k][-1] != len(self.ids[k]) for k in _PARTS):
            raise ValueError("PreferenceDataset: ids and offsets do not describe the same pairs")
        self.summary = dict(summary) if summary is not None else _stats(self)

    @classmethod
    def from_pairs(cls, pairs, summary: dict | None = None) -> PreferenceDataset:
        """From {"prompt_ids", "chosen_ids", "rejected_ids"} dicts (tests, custom pipelines)."""
        ids = {k: [] for k in _PARTS}
        for pair in pairs:
            for k in _PARTS:
                ids[k].append(np.asarray(pair[f"{k}_ids"], dtype=np.int32))
        if not ids["prompt"]:
            raise ValueError("PreferenceDataset.from_pairs: no pairs")
        if any(len(c) == 0 for k in ("chosen", "rejected") for c in ids[k]):
            raise ValueError("PreferenceDataset.from_pairs: every pair needs non-empty chosen and rejected ids")
        offsets = {k: np.concatenate([[0], np.cumsum([len(x) for x in ids[k]])]) for k in _PARTS}
        return cls({k: np.concatenate(ids[k]) for k in _PARTS}, offsets, summary)

    def _part(self, name: str, i: int) -> np.ndarray:
        o = self.offsets[name]
        return self.ids[name][o[i] : o[i + 1]]

    def __len__(self) -> int:
        return len(self.offsets["prompt"]) - 1

    def __getitem__(self, i: int) -> dict:
        if not -len(self) <= i < len(self):
            raise IndexError(f"pair {i} out of range for a dataset of {len(self)}")
        i %= len(self)
        return {f"{k}_ids": self._part(k, i) for k in _PARTS}

    @property
    def lengths(self) -> np.ndarray:
        """Tokens of each pair's longer sequence (prompt + answer): the width the pair's rows pad to (int64)."""
        prompt = np.diff(self.offsets["prompt"])
        return prompt + np.maximum(np.diff(self.offsets["chosen"]), np.diff(self.offsets["rejected"]))

    def select(self, indices) -> PreferenceDataset:
        """A new dataset of the given pairs, in that order."""
        pairs = [self[int(i)] for i in np.asarray(indices, dtype=np.int64)]
        out = PreferenceDataset.from_pairs(pairs)
        out.summary = {**{k: v for k, v in self.summary.items() if k in ("files", "formats", "options")}, **out.summary}
        return out

    def summary_text(self) -> str:
        s = self.summary
        lines = [
            f"preference data: {s['pairs']:,} pairs"
            + (
                f" from {len(s['formats'])} file(s): "
                + ", ".join(f"{Path(f).name} ({fmt})" for f, fmt in s["formats"].items())
                if s.get("formats")
                else ""
            )
        ]
        if "pairs_read" in s:
            reasons = ", ".join(f"{k} {v:,}" for k, v in sorted(s.get("dropped", {}).items()))
            lines.append(
                f"  read {s['pairs_read']:,}, dropped {sum(s.get('dropped', {}).values()):,}"
                + (f" ({reasons})" if reasons else "")
                + f", truncated {s.get('truncated', 0):,}"
            )
        lines.append(
            f"  tokens: prompt {s['prompt_tokens']:,}, chosen {s['chosen_tokens']:,}, rejected "
            f"{s['rejected_tokens']:,}; longest sequence {s['max_length']}"
        )
        if s.get("cache"):
            lines.append(cache_line(s))
        return "\n".join(lines)

    def arrays(self) -> dict[str, np.ndarray]:
        """The arrays a cache entry stores."""
        return {f"{k}_ids": self.ids[k] for k in _PARTS} | {f"{k}_offsets": self.offsets[k] for k in _PARTS}

    def save(self, path: str | Path) -> None:
        """Write as the cache entry (directory) `path`, atomically (trainer/data/cache.py)."""
        write_entry(path, self.arrays(), self.summary)

    @classmethod
    def load(cls, path: str | Path) -> PreferenceDataset:
        """The pairs of the cache entry `path`, their arrays memory-mapped (read-only)."""
        z, summary = read_entry(path, [f"{k}_{a}" for k in _PARTS for a in ("ids", "offsets")])
        return cls({k: z[f"{k}_ids"] for k in _PARTS}, {k: z[f"{k}_offsets"] for k in _PARTS}, summary)


def _stats(ds: PreferenceDataset) -> dict:
    tokens = {f"{k}_tokens": int(len(ds.ids[k])) for k in _PARTS}
    return {"pairs": len(ds), **tokens, "max_length": int(ds.lengths.max()) if len(ds) else 0}


def collate_pairs(pairs: list[dict], pad_token_id: int, pad_to_multiple_of: int | None = None) -> dict:
    """The model's micro batch of k pairs: 2k rows, the k chosen sequences (prompt + answer) then the k rejected
    ones, right-padded; labels (unshifted, as the SFT batches) on answer tokens only. `num_pairs` = k."""
    rows = [(p["prompt_ids"], p[f"{side}_ids"]) for side in ("chosen", "rejected") for p in pairs]
    width = max(len(a) + len(b) for a, b in rows)
    if pad_to_multiple_of:
        width = -(-width // pad_to_multiple_of) * pad_to_multiple_of
    input_ids = np.full((len(rows), width), pad_token_id, dtype=np.int64)
    labels = np.full((len(rows), width), IGNORE_INDEX, dtype=np.int64)
    attention_mask = np.zeros((len(rows), width), dtype=np.int64)
    for r, (prompt, answer) in enumerate(rows):
        p, n = len(prompt), len(prompt) + len(answer)
        input_ids[r, :p], input_ids[r, p:n] = prompt, answer
        labels[r, p:n] = answer
        attention_mask[r, :n] = 1
    labels[:, 0] = IGNORE_INDEX  # no position predicts the first token
    out = {
        k: torch.from_numpy(v)
        for k, v in (("input_ids", input_ids), ("labels", labels), ("attention_mask", attention_mask))
    }
    out["position_ids"] = torch.arange(width).expand(len(rows), width).clone()
    out["num_pairs"] = len(pairs)
    return out


# ---- loading ----------------------------------------------------------------------------------------------
def preference_options(data_format, max_length, max_prompt_length, truncation_mode, skip_bad_examples) -> dict:
    """The tokenisation options (the cache key's part), checked: a file's (`load_preference_dataset`), records'
    (`pairs_dataset`) or a Dataset's (`trainer.data.hf_datasets.tokenize_preference_dataset`)."""
    if data_format not in PREFERENCE_FORMATS:
        raise ValueError(f"data_format={data_format!r}: expected one of {', '.join(PREFERENCE_FORMATS)}")
    for name, value in (("max_length", max_length), ("max_prompt_length", max_prompt_length)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 2):
            raise ValueError(f"{name}={value!r}: expected an int >= 2, or None for no truncation")
    if truncation_mode not in TRUNCATION_MODES:
        raise ValueError(f"truncation_mode={truncation_mode!r}: expected one of {', '.join(TRUNCATION_MODES)}")
    return {
        "kind": _CACHE_VERSION,
        "data_format": data_format,
        "max_length": max_length,
        "max_prompt_length": max_prompt_length,
        "truncation_mode": truncation_mode,
        "skip_bad_examples": skip_bad_examples,
    }


def load_preference_dataset(
    paths,
    tokenizer,
    *,
    data_format: str = "auto",
    max_length: int | None = 1024,
    max_prompt_length: int | None = None,
    truncation_mode: str = "keep_start",
    skip_bad_examples: bool = False,
    cache_dir: str | Path | None = None,
    show_progress: bool = True,
    write_cache: bool = True,
) -> PreferenceDataset:
    """Read, normalise, render, split, truncate and tokenize the pairs of `paths` once (cached under `cache_dir`;
    with write_cache=False a new tokenisation is saved later, by `trainer.data.sft_data.save_to_cache`)."""
    options = preference_options(data_format, max_length, max_prompt_length, truncation_mode, skip_bad_examples)
    files = resolve_data_files(paths)
    formats: dict[str, str] = {}
    items = checked_records(files, data_format, formats, detect_preference_format, PAIR_FORMATS_TEXT)
    return load_cached(
        cache_dir,
        "pairs",
        files,
        tokenizer,
        options,
        PreferenceDataset,
        lambda entry: _build(items, [str(f) for f in files], formats, tokenizer, options, show_progress, entry),
        write=write_cache,
    )


def pairs_dataset(
    records: list[dict],
    source: str,
    tokenizer,
    *,
    max_length: int | None = 1024,
    max_prompt_length: int | None = None,
    truncation_mode: str = "keep_start",
    show_progress: bool = True,
) -> PreferenceDataset:
    """Pairs given as TRL conversational records in memory (the embedded demo's, trainer.data.tasks.preference_pair)
    rather than files; `source` names them in errors ("source:N") and the summary. Not cached."""
    options = preference_options("conversational", max_length, max_prompt_length, truncation_mode, False)
    items = ((f"{source}:{i}", (record, "conversational")) for i, record in enumerate(records, 1))
    return _build(items, [source], {source: "conversational"}, tokenizer, options, show_progress)


def encode_pair(item, tokenizer, options: dict) -> tuple:
    """One item of `checked_records` (a (record, format) pair or a `_Bad`) encoded: ("ok", {"prompt_ids",
    "chosen_ids", "rejected_ids"}, truncated), ("bad", reason, message) for a bad record, or ("drop", reason, message,
    truncated) for a pair left with no answer token on a side. `_build` and the streamed pairs
    (trainer/data/streaming.py) encode with it."""
    try:
        if isinstance(item, _Bad):
            raise item
        ids = tokenize_pair(tokenizer, normalize_pair(*item))
    except _Bad as exc:
        return ("bad", exc.reason, exc.message)
    kept = truncate_pair(
        *ids,
        max_length=options["max_length"],
        max_prompt_length=options["max_prompt_length"],
        truncation_mode=options["truncation_mode"],
    )
    truncated = kept != ids
    if not kept[1] or not kept[2]:
        return (
            "drop",
            "no_targets_after_truncation",
            f"no answer token left after truncation to max_length {options['max_length']} (raise max_length, or "
            "set max_prompt_length)",
            truncated,
        )
    return ("ok", dict(zip(("prompt_ids", "chosen_ids", "rejected_ids"), kept)), truncated)


def _build(
    items, sources: list[str], formats: dict, tokenizer, options: dict, show_progress: bool, entry: Path | None = None
) -> PreferenceDataset:
    """The dataset of `items`, (where, (record, format)) or (where, `_Bad`) as `checked_records` yields them;
    `sources` and `formats` (filled while reading) for the summary. The arrays are written as the pairs come into the
    cache entry `entry`, or without one into a temporary directory, and returned memory-mapped from it, as SFT's
    `_build` does (trainer/data/sft_data.py): memory does not grow with the pairs."""
    skip = options["skip_bad_examples"]
    dropped: Counter = Counter()
    read = truncated = pairs = max_length = 0
    tokens = dict.fromkeys(_PARTS, 0)
    progress = tqdm(desc="tokenizing pairs", unit=" pairs", disable=not show_progress, mininterval=0.5)

    def drop(where: str, reason: str, message: str, bad: bool) -> None:
        if bad and not skip:
            raise DataError(f"{where}: {message}")
        dropped[reason] += 1
        if dropped[reason] <= _MAX_WARNINGS:
            logger.warning("%s %s: %s", "skipping" if bad else "dropping", where, message)

    with building(entry) as (directory, entry):
        arrays = [(f"{k}_ids", np.int32) for k in _PARTS] + [(f"{k}_offsets", np.int64) for k in _PARTS]
        writers = {name: ArrayWriter(directory / f"{name}.npy", dtype) for name, dtype in arrays}
        for k in _PARTS:
            writers[f"{k}_offsets"].append([0])
        try:
            for where, item in items:
                read += 1
                progress.update()
                outcome = encode_pair(item, tokenizer, options)
                if outcome[0] == "bad":
                    drop(where, outcome[1], outcome[2], bad=True)
                    continue
                truncated += outcome[-1]
                if outcome[0] == "drop":
                    drop(where, outcome[1], outcome[2], bad=False)
                    continue
                kept = [outcome[1][f"{k}_ids"] for k in _PARTS]
                pairs += 1
                max_length = max(max_length, len(kept[0]) + max(len(kept[1]), len(kept[2])))
                for k, part in zip(_PARTS, kept):
                    tokens[k] += len(part)
                    writers[f"{k}_ids"].append(part)
                    writers[f"{k}_offsets"].append([tokens[k]])
        finally:
            progress.close()
            for writer in writers.values():
                writer.close()
        if not pairs:
            reasons = ", ".join(f"{k} {v}" for k, v in sorted(dropped.items())) or "the files hold no records"
            raise DataError(
                f"{', '.join(sources)}: no usable pairs ({reasons}) (expected at least one pair with "
                "answer tokens on both sides)"
            )
        summary = {
            "files": sources,
            "formats": formats,
            "options": options,
            "pairs_read": read,
            "dropped": dict(sorted(dropped.items())),
            "truncated": truncated,
            "pairs": pairs,
            **{f"{k}_tokens": tokens[k] for k in _PARTS},
            "max_length": max_length,
        }
        commit(directory, entry, summary)
        return PreferenceDataset.load(entry)
