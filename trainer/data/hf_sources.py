"""`--dataset_name`: SFT data as `datasets.load_dataset` reads it, with TRL's script names, and mixtures of sources.

A source is one `--dataset_name` value (TRL's `ScriptArguments` names, LlamaFactory's for mixtures):

- a directory written by `Dataset.save_to_disk` / `DatasetDict.save_to_disk`, read with `datasets.load_from_disk`
  (a single Dataset saved without splits is the training split);
- one of `datasets`' builders (`json`, `parquet`, `csv`, `text`, `arrow`, ...) with `--data_files` (one source only:
  `load_dataset("json", data_files=...)`), or a directory of data files;
- a Hub id (`owner/name`), with `--dataset_config` (load_dataset's `name`), read from the Hub or, under
  `HF_HUB_OFFLINE=1` / `HF_DATASETS_OFFLINE=1`, from the local cache. Without a network the id fails in one line
  (exit 2) before anything is built: offline, `datasets` answers at once; online, `check_sources` first opens a
  connection to the Hub's host with a 3 s timeout.

`--dataset_train_split` (default `train`) is the training data; `--dataset_test_split` (default: none, where TRL's is
`test`, used only when it evaluates) the eval data, as `--eval_data` gives it. An unknown split names the splits
there are. Each split's rows go through `tokenize_sft_dataset`'s code, the files' (trainer/data/sft_data.py): the
same format detection, masking, truncation and drops, and a bad row is named as `source:split[i]`
("data/chat:train[17]: missing field 'messages'"), the way a file's is `file:line`. A split whose columns name no
format, or lack one the forced `--data_format` needs, is one line before any row is read.

Several sources form a mixture (`--mix_strategy`, LlamaFactory's names and meaning): `concat` (the default: one
after the other), `interleave_under` (alternate, stop when the first source runs out: `datasets.interleave_datasets`
with stopping_strategy "first_exhausted") or `interleave_over` (until every source has been seen whole, the shorter
ones repeated: "all_exhausted"); `--interleave_probs` samples the sources with those probabilities, seeded with
`data_seed` (else `seed`). The mixture is made of the tokenised examples that are kept (an example dropped for
having no target is not drawn), so every source is tokenised and cached on its own. The eval splits are
concatenated.

Caching: each split's tokens are cached as a file's are, in `<cache_dir>/data-<key>/`, the key made from a digest
of the rows (`dataset_digest`: the Arrow IPC stream of the rows in order, so any change to the content changes it),
the tokenizer and the options; `num_proc` changes nothing in the tokens and is not part of it.

`datasets` is imported when a source is loaded, never at import time.
"""

from __future__ import annotations

import glob
import hashlib
import importlib.util
import io
import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import numpy as np

from trainer.data.preference_data import (
    PAIR_FORMATS_TEXT,
    PreferenceDataset,
    detect_preference_format,
    preference_options,
)
from trainer.data.preference_data import _build as _build_pairs
from trainer.data.sft_data import (
    DataError,
    TokenizedDataset,
    _build,
    _keep_chat_template,
    checked_options,
    checked_source,
    detect_format,
    load_cached,
)

MIX_STRATEGIES = ("concat", "interleave_under", "interleave_over")
# The builders of datasets read tables from --data_files; the other packaged ones (imagefolder, webdataset, ...)
# hold no SFT records.
FILE_BUILDERS = ("json", "parquet", "csv", "text", "arrow", "pandas")
# The columns each format needs, the first the one auto-detection looks for (sft_data.detect_format).
FORMAT_COLUMNS = {
    "messages": ("messages",),
    "sharegpt": ("conversations",),
    "alpaca": ("instruction", "output"),
    "prompt_completion": ("prompt", "completion"),
    "text": ("text",),
}
_OFFLINE_HELP = (
    "give a local directory (Dataset.save_to_disk, or of data files), a builder with --data_files "
    "(json, parquet, csv, text), or --data FILE"
)


def _truthy(name: str) -> bool:
    return os.environ.get(name, "").strip().upper() in ("1", "ON", "YES", "TRUE")


def offline() -> bool:
    """The Hub is off limits: HF_HUB_OFFLINE or HF_DATASETS_OFFLINE set (huggingface_hub's and datasets' flags)."""
    return _truthy("HF_HUB_OFFLINE") or _truthy("HF_DATASETS_OFFLINE")


def split_names(values) -> list[str]:
    """`values` (a string or a list of them) as a flat list: each entry may hold several, comma-separated
    (LlamaFactory's `dataset: a,b`)."""
    if isinstance(values, str):
        values = [values]
    return [part.strip() for value in values or () for part in str(value).split(",") if part.strip()]


def is_saved_dataset(path: Path) -> bool:
    """A directory `save_to_disk` wrote: a DatasetDict's (dataset_dict.json) or a Dataset's (state.json)."""
    return path.is_dir() and ((path / "dataset_dict.json").is_file() or (path / "state.json").is_file())


def source_kind(name: str) -> str:
    """How `name` is read: "saved" (load_from_disk), "directory" (load_dataset of its data files), "builder"
    (needs --data_files) or "hub"."""
    path = Path(name)
    if is_saved_dataset(path):
        return "saved"
    if path.is_dir():
        return "directory"
    if name in FILE_BUILDERS:
        return "builder"
    return "hub"


def _hub_reachable(timeout: float = 3.0) -> bool:
    """Whether a TCP connection to the Hub's host (HF_ENDPOINT, default huggingface.co) opens within `timeout`."""
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=timeout).close()
    except OSError:
        return False
    return True


def check_sources(
    names: list[str], data_files: list[str] | None, mix_strategy: str, interleave_probs, config: str | None = None
) -> None:
    """The checks that need no data read (the CLI's check_run): the files a builder reads exist, several sources
    come with a mixture that fits them, and a Hub id has a network (or the offline flags, which read the cache)."""
    if importlib.util.find_spec("datasets") is None:
        raise DataError("dataset_name: reading it needs the datasets package: pip install datasets (or --data FILE)")
    if not names:
        raise DataError("dataset_name: empty (expected a Hub id, a directory or a builder such as json)")
    if data_files and len(names) != 1:
        raise DataError(
            f"data_files: given with {len(names)} dataset_name values; data_files belong to one source (a builder "
            "such as json, or a directory); save the others with Dataset.save_to_disk, or give them as --data files"
        )
    if interleave_probs is not None:
        if mix_strategy == "concat":
            raise DataError("interleave_probs: set, but mix_strategy is concat; set mix_strategy interleave_under/over")
        if len(interleave_probs) != len(names):
            raise DataError(
                f"interleave_probs: {len(interleave_probs)} values for {len(names)} datasets (expected one per "
                "dataset_name)"
            )
        if any(p < 0 for p in interleave_probs) or not np.isclose(sum(interleave_probs), 1.0):
            raise DataError(f"interleave_probs: {interleave_probs} (expected probabilities >= 0 that sum to 1)")
    for name in names:
        kind = source_kind(name)
        if kind == "saved" and (data_files or config):
            option = "data_files" if data_files else "dataset_config"
            raise DataError(f"{option}: {name} is a saved dataset (save_to_disk), which takes no {option}")
        if kind == "builder":
            if not data_files:
                raise DataError(
                    f"dataset_name={name!r}: the {name} builder reads --data_files (e.g. --dataset_name {name} "
                    "--data_files train.jsonl)"
                )
            for pattern in data_files:  # a path or a glob pattern, relative to the working directory; or a URL
                if "://" not in pattern and not glob.glob(pattern, recursive=True):
                    raise DataError(f"data_files: {pattern}: no such file")
        if kind == "hub" and not offline() and not _hub_reachable():
            raise DataError(
                f"dataset_name={name!r}: not a local directory or a builder ({', '.join(FILE_BUILDERS)}), so a Hub "
                "id, and the Hub cannot be reached (no network); set HF_HUB_OFFLINE=1 to read it from the local "
                f"cache, or {_OFFLINE_HELP}"
            )


def _reason(exc: BaseException) -> str:
    """The first line of what `datasets` said, with the error under a DatasetGenerationError (a bad file)."""
    while exc.__cause__ is not None and type(exc).__name__ in ("DatasetGenerationError", "DatasetBuildError"):
        exc = exc.__cause__
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) < 400 else text[:400] + "..."


def load_source(
    name: str, *, config: str | None = None, data_files=None, show_progress: bool = True, streaming: bool = False
):
    """The `datasets.DatasetDict` (or, from `save_to_disk` of one split, the `Dataset`) that `name` names; every
    failure of `datasets` (a Hub id offline, a missing builder dependency, an unreadable file) is a one-line
    `DataError` naming `name`. datasets' own log lines are silenced meanwhile: the error says what went wrong.
    `streaming`: the `IterableDatasetDict` instead, read lazily (a saved dataset: its splits as IterableDatasets of
    its Arrow shards)."""
    import datasets

    kind = source_kind(name)
    level = datasets.logging.get_verbosity()
    bars = datasets.utils.are_progress_bars_disabled()
    datasets.logging.set_verbosity(logging.CRITICAL)
    if not show_progress:
        datasets.disable_progress_bars()
    try:
        if kind == "saved":
            saved = datasets.load_from_disk(name)
            if not streaming:
                return saved
            if hasattr(saved, "keys"):
                return datasets.IterableDatasetDict({k: v.to_iterable_dataset() for k, v in saved.items()})
            return saved.to_iterable_dataset()
        return datasets.load_dataset(name, config, data_files=data_files, streaming=streaming)
    except ImportError as exc:
        raise DataError(f"dataset_name={name!r}: needs a package that is not installed: {_reason(exc)}") from None
    except Exception as exc:  # datasets' and the Hub's many error types for a source that cannot be read
        where = (
            f"not a local directory or a builder ({', '.join(FILE_BUILDERS)}), so a Hub id, and the Hub is off limits "
            f"(HF_HUB_OFFLINE / HF_DATASETS_OFFLINE) and the local cache does not hold it; {_OFFLINE_HELP}"
            if kind == "hub" and offline()
            else _reason(exc)
        )
        raise DataError(f"dataset_name={name!r}: {where}") from None
    finally:
        datasets.logging.set_verbosity(level)
        if not bars:
            datasets.enable_progress_bars()


def pick_split(loaded, name: str, split: str, train: bool):
    """`loaded[split]`, or an error naming the splits there are; a Dataset saved without splits is the training
    split, whatever its name."""
    if not hasattr(loaded, "keys"):  # one Dataset
        if train:
            return loaded
        raise DataError(
            f"dataset_name={name!r}: a Dataset saved without splits (it is the training data), so no split "
            f"{split!r}; give the eval data as --eval_data or --val_size, or save a DatasetDict"
        )
    if split not in loaded:
        option = "dataset_train_split" if train else "dataset_test_split"
        raise DataError(
            f"dataset_name={name!r}: no split {split!r} (its splits: {', '.join(loaded)}); set --{option} to one"
        )
    return loaded[split]


def check_columns(dataset, source: str, data_format: str) -> None:
    """The split's columns name a format (or hold those `data_format` needs): one line naming the columns if not."""
    columns = list(dataset.column_names)
    fmt = detect_format(dict.fromkeys(columns)) if data_format == "auto" else data_format
    if fmt is None:
        raise DataError(
            f"{source}: no column names a data format (columns: {', '.join(columns)}) (expected messages, "
            "conversations, instruction/output, prompt/completion or text; or set data_format)"
        )
    missing = [c for c in FORMAT_COLUMNS[fmt] if c not in columns]
    if missing:
        raise DataError(
            f"{source}: no column {missing[0]!r} (columns: {', '.join(columns)}) (expected {fmt}: "
            f"{', '.join(FORMAT_COLUMNS[fmt])})"
        )


class _Digest(io.RawIOBase):
    """A writable file that only hashes what is written to it."""

    def __init__(self):
        self.hash = hashlib.sha256()

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        self.hash.update(data)
        return len(data)


def dataset_digest(dataset) -> str:
    """A digest of a `datasets.Dataset`'s rows, in order (its indices mapping applied): the Arrow IPC stream of its
    schema and rows, hashed in batches (one pass, little memory). Any change to the rows or their order changes it,
    which datasets' own `_fingerprint` need not (it can stay when a file changes under it). The same rows read
    alike (the same files or save_to_disk directory) give the same digest; the same rows laid out otherwise in
    Arrow (a select, a take) may give another: a tokenisation more, never a stale cache."""
    import pyarrow as pa  # a dependency of datasets

    digest = _Digest()
    sink, writer = pa.PythonFile(digest, mode="w"), None
    for batch in dataset.with_format("arrow").iter(batch_size=4096):  # (rows, columns) tables, in the rows' order
        writer = writer or pa.ipc.new_stream(sink, batch.schema)
        writer.write_table(batch.combine_chunks())  # one record batch per 4096 rows, however the table is chunked
    if writer is not None:
        writer.close()
    digest.hash.update(repr(dataset.features).encode())  # the columns and their types, rows or not
    return "dataset:" + digest.hash.hexdigest()


def tokenize_split(
    dataset,
    source: str,
    tokenizer,
    options: dict,
    *,
    cache_dir=None,
    write_cache: bool = True,
    show_progress: bool = True,
    num_proc: int | None = None,
) -> TokenizedDataset:
    """One split's rows tokenised as a file's records are (`source` names it in errors: `source[i]`), cached under
    `cache_dir` by the digest of its rows."""
    check_columns(dataset, source, options["data_format"])
    formats: dict[str, str] = {}

    def build(entry):
        rows = ((f"{source}[{i}]", row) for i, row in enumerate(dataset.with_format(None)))
        items = checked_source(source, rows, options["data_format"], formats)
        return _build(items, [source], formats, tokenizer, options, show_progress, num_proc, entry)

    digests = [dataset_digest(dataset)] if cache_dir is not None else []
    ds = load_cached(cache_dir, "data", digests, tokenizer, options, TokenizedDataset, build, write=write_cache)
    ds.summary["from_dataset"] = True  # for summary_text
    _keep_chat_template(tokenizer, ds)
    return ds


def concat(parts: list[TokenizedDataset]) -> TokenizedDataset:
    """The examples of `parts` one after the other, with their summaries' counts added up."""
    if len(parts) == 1:
        return parts[0]
    lengths = np.concatenate([p.lengths for p in parts])
    out = TokenizedDataset(
        np.concatenate([p.input_ids for p in parts]),
        np.concatenate([p.labels for p in parts]),
        np.concatenate([[0], np.cumsum(lengths)]),
    )
    out.summary = {**_sources_summary(parts), **out.summary}
    return out


def _sources_summary(parts: list[TokenizedDataset]) -> dict:
    """Where `parts` came from and what was read, dropped and truncated, over all of them."""
    dropped: dict[str, int] = {}
    for p in parts:
        for reason, n in p.summary.get("dropped", {}).items():
            dropped[reason] = dropped.get(reason, 0) + n
    return {
        "files": [f for p in parts for f in p.summary.get("files", [])],
        "formats": {k: v for p in parts for k, v in p.summary.get("formats", {}).items()},
        "options": parts[0].summary.get("options"),
        "from_dataset": True,
        "examples_read": sum(p.summary.get("examples_read", len(p)) for p in parts),
        "dropped": dict(sorted(dropped.items())),
        "truncated": sum(p.summary.get("truncated", 0) for p in parts),
    }


def mix(parts: list[TokenizedDataset], strategy: str, probabilities=None, seed: int = 0) -> TokenizedDataset:
    """The mixture of `parts` by `strategy` (MIX_STRATEGIES): the example order `datasets.interleave_datasets` makes
    of datasets as long as the parts (same probabilities, seed and stopping strategy), taken from their examples."""
    if strategy not in MIX_STRATEGIES:
        raise DataError(f"mix_strategy={strategy!r}: expected one of {', '.join(MIX_STRATEGIES)}")
    whole = concat(parts)
    if len(parts) == 1 or strategy == "concat":
        return whole
    import datasets

    starts = np.cumsum([0] + [len(p) for p in parts])
    indices = [datasets.Dataset.from_dict({"i": np.arange(s, s + len(p))}) for s, p in zip(starts, parts)]
    stopping = "first_exhausted" if strategy == "interleave_under" else "all_exhausted"
    order = datasets.interleave_datasets(indices, probabilities=probabilities, seed=seed, stopping_strategy=stopping)
    out = whole.select(np.asarray(order["i"], dtype=np.int64))
    out.summary = {**_sources_summary(parts), "mixture": strategy, **{k: out.summary[k] for k in _STATS}}
    return out


_STATS = ("examples", "tokens", "supervised_tokens", "length")


@dataclass
class LoadedSources:
    """What `load_sft_sources` read: the training data (the mixture), the eval data (the test splits, or None), and
    every split tokenised on its own (whose new tokenisations `save_to_cache` writes once the caller may write)."""

    train: TokenizedDataset
    eval: TokenizedDataset | None
    tokenized: list[TokenizedDataset]


def load_sft_sources(
    names,
    tokenizer,
    *,
    config: str | None = None,
    data_files=None,
    train_split: str = "train",
    test_split: str | None = None,
    mix_strategy: str = "concat",
    interleave_probs=None,
    seed: int = 0,
    data_format: str = "auto",
    cutoff_len: int | None = 2048,
    train_on_prompt: bool = False,
    mask_history: bool = False,
    skip_bad_examples: bool = False,
    cache_dir=None,
    write_cache: bool = True,
    show_progress: bool = True,
    num_proc: int | None = None,
) -> LoadedSources:
    """The SFT data of one or several `--dataset_name` sources (see the module docstring), every split read and
    checked (columns, then rows) before anything is returned."""
    options = checked_options(data_format, cutoff_len, train_on_prompt, mask_history, skip_bad_examples)
    names = split_names(names)
    check_sources(names, data_files, mix_strategy, interleave_probs, config)
    loaded = [
        (name, load_source(name, config=config, data_files=data_files, show_progress=show_progress)) for name in names
    ]
    splits = [(name, pick_split(ds, name, train_split, train=True)) for name, ds in loaded]
    if test_split is not None:
        tests = [(name, pick_split(ds, name, test_split, train=False)) for name, ds in loaded]
    kwargs = dict(cache_dir=cache_dir, write_cache=write_cache, show_progress=show_progress, num_proc=num_proc)
    train_parts = [tokenize_split(ds, f"{name}:{train_split}", tokenizer, options, **kwargs) for name, ds in splits]
    eval_parts = []
    if test_split is not None:
        eval_parts = [tokenize_split(ds, f"{name}:{test_split}", tokenizer, options, **kwargs) for name, ds in tests]
    train = mix(train_parts, mix_strategy, interleave_probs, seed)
    return LoadedSources(train, concat(eval_parts) if eval_parts else None, train_parts + eval_parts)


def load_preference_sources(
    names,
    tokenizer,
    *,
    config: str | None = None,
    data_files=None,
    train_split: str = "train",
    test_split: str | None = None,
    data_format: str = "auto",
    max_length: int | None = 1024,
    max_prompt_length: int | None = None,
    truncation_mode: str = "keep_start",
    skip_bad_examples: bool = False,
    cache_dir=None,
    show_progress: bool = True,
) -> tuple[PreferenceDataset, PreferenceDataset | None]:
    """Stage dpo's `--dataset_name`: preference pairs (TRL's and LlamaFactory's formats) from load_dataset's sources,
    every split through the files' code (trainer/data/preference_data.py), a bad pair named `source:split[i]`, cached
    by the digest of its rows as SFT splits are; several sources one after the other (the train pairs, and the test
    splits' when `test_split` is given). Returns (train, eval or None)."""
    options = preference_options(data_format, max_length, max_prompt_length, truncation_mode, skip_bad_examples)
    names = split_names(names)
    loaded = [
        (name, load_source(name, config=config, data_files=data_files, show_progress=show_progress)) for name in names
    ]

    def pairs(split: str, train: bool) -> PreferenceDataset:
        parts = []
        for name, ds in loaded:
            dataset, source = pick_split(ds, name, split, train=train), f"{name}:{split}"

            def build(entry, dataset=dataset, source=source):
                formats: dict[str, str] = {}
                rows = ((f"{source}[{i}]", row) for i, row in enumerate(dataset.with_format(None)))
                items = checked_source(source, rows, data_format, formats, detect_preference_format, PAIR_FORMATS_TEXT)
                return _build_pairs(items, [source], formats, tokenizer, options, show_progress, entry)

            digests = [dataset_digest(dataset)] if cache_dir is not None else []
            parts.append(load_cached(cache_dir, "pairs", digests, tokenizer, options, PreferenceDataset, build))
        if len(parts) == 1:
            return parts[0]
        return PreferenceDataset.from_pairs([pair for part in parts for pair in part])

    return pairs(train_split, True), pairs(test_split, False) if test_split is not None else None
