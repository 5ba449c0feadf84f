"""Hugging Face `datasets` objects as training data: raw rows tokenized as files are, tokenized columns checked.

Two ways in, both to a `TokenizedDataset` (trainer/data/sft_data.py), both reporting a bad row in one line that names
its index, as `dataset[N]` reads it (0-based), and its split when known: "split 'train' row 3: ..." where a file
says "file:line: ...".

- `tokenize_sft_dataset(dataset, processing_class, ...)`: a raw `datasets.Dataset` (or a list of records) in any SFT
  format the files take (messages, sharegpt, alpaca, prompt_completion, text), with the same detection, masking,
  truncation, drops and errors as `load_sft_dataset`: a row of a Dataset is the dict a JSONL line decodes to (an
  absent column is null, as in Parquet), and it goes through the same code. Not cached.
- `tokenize_preference_dataset(dataset, processing_class, ...)`: preference pairs (TRL's standard and conversational
  formats, LlamaFactory's sharegpt and alpaca pairs) through `load_preference_dataset`'s code, in the same way.
- `tokenized_splits(dataset, name, tokenize, ...)`: what SFTTrainer and PreferenceTrainer do first with what they are
  given: raw parts tokenized (a DatasetDict as train_dataset: its 'train' split; for evaluation: split by split),
  errors named by the argument ("train_dataset split 'train' row 3: ..."), the rest passed on.
- `trainer_dataset(dataset, name)`: what `Trainer(train_dataset=..., eval_dataset=...)` does with what it is given.
  A tokenized `datasets.Dataset` (column `input_ids`, and `labels`, or TRL's 0/1 `completion_mask` /
  `assistant_masks`) is converted once, every row checked (on whole Arrow columns where they are lists of integers),
  before anything trains; an eval `DatasetDict` split by split. A raw one is a one-line error saying to tokenize it
  with `tokenize_sft_dataset`; a `DatasetDict` as train_dataset and an `IterableDataset` (streaming) are one-line
  errors too (a stream trains through trainer/data/streaming.py; an eval set that is one is read whole first, by
  `eval_whole`). Anything else (a TokenizedDataset, a list of examples) passes as it is.

Labels from TRL's columns, as SFTTrainer builds them: a `labels` column is used as it is (-100: no loss); without one,
a token is a target where every mask column present is 1 (`labels = input_ids` where `assistant_masks` and
`completion_mask` are 1, -100 elsewhere), and with no mask either every token is a target. One difference: TRL applies
`completion_mask` only under `completion_only_loss`, whose default (None) turns it on for prompt-completion datasets
only; here a `completion_mask` column always applies (it was written to be applied). `attention_mask` is checked: all
ones (unpadded rows, as the batching pads them itself) and as long as `input_ids`.

`datasets` itself is never imported here: an object of its types exists only once the caller has imported it.
The command's `--dataset_name` (trainer/data/hf_sources.py: load_dataset's sources, mixtures) tokenizes its splits
through the same code.
"""

from __future__ import annotations

import sys

import numpy as np

from trainer.data.preference_data import (
    PAIR_FORMATS_TEXT,
    PreferenceDataset,
    detect_preference_format,
    preference_options,
)
from trainer.data.preference_data import _build as _build_pairs
from trainer.data.sft_data import (
    _SFT_FORMATS_TEXT,
    IGNORE_INDEX,
    DataError,
    TokenizedDataset,
    _build,
    _keep_chat_template,
    checked_options,
    checked_source,
    detect_format,
)

TOKENIZED_COLUMNS = ("input_ids", "labels", "completion_mask", "assistant_masks", "attention_mask")
_MASKS = ("assistant_masks", "completion_mask")  # TRL's names; 1 = a target
_HOW_TO_TOKENIZE = (
    "tokenize it first: `from trainer import tokenize_sft_dataset`; tokenize_sft_dataset(dataset, processing_class) "
    "returns what Trainer trains on"
)


def hf_kind(obj) -> str | None:
    """The `datasets` class `obj` is an instance of ("Dataset", "DatasetDict", "IterableDataset",
    "IterableDatasetDict"), or None for anything else."""
    module = sys.modules.get("datasets")
    if module is None:
        return None
    for name in ("IterableDatasetDict", "DatasetDict", "IterableDataset", "Dataset"):
        cls = getattr(module, name, None)
        if cls is not None and isinstance(obj, cls):
            return name
    return None


def eval_whole(dataset):
    """An eval set given as an `IterableDataset` (streaming), read whole into a `datasets.Dataset` with its features
    and split, so each trainer evaluates on it as on that Dataset: Hugging Face's Trainer evaluates on every row of an
    IterableDataset too, reading it again at each evaluation; here it is read once, when given. A dict (or an
    `IterableDatasetDict`) of eval sets split by split; anything else as it is."""
    if isinstance(dataset, dict) and any(hf_kind(part) == "IterableDataset" for part in dataset.values()):
        return {key: eval_whole(part) for key, part in dataset.items()}
    if hf_kind(dataset) != "IterableDataset":
        return dataset
    rows = list(dataset.with_format(None))
    return sys.modules["datasets"].Dataset.from_list(rows, features=dataset.features, split=dataset.split)


def _split(dataset, split) -> str | None:
    if split is None:
        split = getattr(dataset, "split", None)  # a NamedSplit from load_dataset(...)[name]; None from from_list
    return str(split) if split is not None else None


def _where(i: int, split: str | None) -> str:
    return f"split {split!r} row {i}" if split else f"row {i}"


def _one_split(dataset, name: str) -> None:
    kind = hf_kind(dataset)
    if kind in ("DatasetDict", "IterableDatasetDict"):
        raise DataError(
            f"{name}: a {kind} of splits {', '.join(map(repr, dataset))} (expected one split, e.g. dataset['train'])"
        )
    if kind == "IterableDataset":
        raise DataError(
            f"{name}: an IterableDataset (streaming) here (expected a datasets.Dataset; a stream trains through "
            "trainer.SFTStream(dataset, processing_class) as the train_dataset, with max_steps)"
        )


def _rows(dataset):
    """The rows of a `datasets.Dataset` as plain Python values (whatever format was set on it), or of a list."""
    if hasattr(dataset, "with_format"):
        dataset = dataset.with_format(None)
    return iter(dataset)


# ---- raw rows -> tokens -----------------------------------------------------------------------------------
def tokenize_sft_dataset(
    dataset,
    processing_class,
    *,
    split: str | None = None,
    data_format: str = "auto",
    cutoff_len: int | None = 2048,
    train_on_prompt: bool = False,
    mask_history: bool = False,
    skip_bad_examples: bool = False,
    show_progress: bool = True,
    num_proc: int | None = None,
) -> TokenizedDataset:
    """Tokenize a raw `datasets.Dataset` (or a list of record dicts) with `processing_class` (our `Tokenizer`), exactly
    as `load_sft_dataset` tokenizes a file of the same records: the format is detected from the first valid row (or
    forced with `data_format`), and the options mean what they mean there. A bad row is a `DataError` naming it
    ("row N", or "split 'S' row N"; `split` defaults to the Dataset's own), or is skipped and counted with
    `skip_bad_examples`. `num_proc` > 1 tokenises in that many processes, with the same result. The arrays are
    memory-mapped from files in a temporary directory ($TMPDIR), removed once mapped (`sft_data._build`)."""
    options = checked_options(data_format, cutoff_len, train_on_prompt, mask_history, skip_bad_examples)
    source, items, formats = _checked_rows(dataset, "tokenize_sft_dataset", split, data_format, detect_format)
    ds = _build(items, [source], formats, processing_class, options, show_progress, num_proc)
    ds.summary["from_dataset"] = True  # for summary_text
    _keep_chat_template(processing_class, ds)
    return ds


def tokenize_preference_dataset(
    dataset,
    processing_class,
    *,
    split: str | None = None,
    data_format: str = "auto",
    max_length: int | None = 1024,
    max_prompt_length: int | None = None,
    truncation_mode: str = "keep_start",
    skip_bad_examples: bool = False,
    show_progress: bool = True,
) -> PreferenceDataset:
    """Tokenize the preference pairs of a raw `datasets.Dataset` (or a list of record dicts) with `processing_class`,
    exactly as `load_preference_dataset` tokenizes a file of the same records: TRL's standard and conversational
    formats (an implicit prompt too) and LlamaFactory's sharegpt and alpaca pairs, detected from the first valid row
    or forced with `data_format`; the options mean what they mean there. A bad pair is a `DataError` naming it
    ("row N", or "split 'S' row N"), or is skipped and counted with `skip_bad_examples`. Not cached."""
    options = preference_options(data_format, max_length, max_prompt_length, truncation_mode, skip_bad_examples)
    source, items, formats = _checked_rows(
        dataset, "tokenize_preference_dataset", split, data_format, detect_preference_format, PAIR_FORMATS_TEXT
    )
    return _build_pairs(items, [source], formats, processing_class, options, show_progress)


def _checked_rows(dataset, name: str, split, data_format: str, detect, expected: str = _SFT_FORMATS_TEXT):
    """(source, items, formats) of a raw Dataset or list of records, as `sft_data.checked_source` makes them of a
    file: the source names the split, each row is located by `_where`. A Dataset whose columns name no format is one
    line naming them (every row of it would fail alike)."""
    _one_split(dataset, name)
    split = _split(dataset, split)
    source = f"dataset split {split!r}" if split else "dataset"
    if hf_kind(dataset) == "Dataset" and data_format == "auto" and detect(dict.fromkeys(dataset.column_names)) is None:
        raise DataError(
            f"{source}: cannot tell the data format from the columns {dataset.column_names} "
            f"(expected {expected}; or set data_format)"
        )
    formats: dict[str, str] = {}
    rows = ((_where(i, split), row) for i, row in enumerate(_rows(dataset)))
    return source, checked_source(source, rows, data_format, formats, detect, expected), formats


# ---- what SFTTrainer and PreferenceTrainer are given -------------------------------------------------------
def tokenized_splits(dataset, name: str, tokenize, token_column: str | None):
    """`dataset`, given to SFTTrainer or PreferenceTrainer as `name`, with its raw parts tokenized by
    `tokenize(rows, split)`, before the Trainer's own conversion (`trainer_dataset`) sees it. Raw: a `datasets.Dataset`
    or a list of record dicts without `token_column` (rows already tokenized; None: any). A DatasetDict as
    train_dataset is its 'train' split; an eval dict or DatasetDict is tokenized split by split (its keys name the
    splits in errors and in the metrics' prefixes). Anything else (an IterableDataset included) passes as it is.
    Errors name the argument ("train_dataset row 3: ..."); `tokenize` None (no processing_class) with raw rows is
    a one-line error."""

    def one(ds, split):
        if not _is_raw(ds, token_column):
            return ds
        if tokenize is None:
            raise DataError(
                f"{name}: raw records need a processing_class to tokenize them (expected a trainer.Tokenizer, a "
                "tokenizer directory, or a transformers tokenizer)"
            )
        try:
            return tokenize(ds, split)
        except DataError as exc:  # named by the argument too, as the Trainer's are: "eval_dataset split 'S' row N: ..."
            message = str(exc)
            rest = message[len("dataset") :] if message.startswith("dataset") else f" {message}"
            raise DataError(f"{name}{rest}") from None

    if name == "train_dataset" and hf_kind(dataset) == "DatasetDict":
        if "train" not in dataset:
            raise DataError(
                f"{name}: a DatasetDict of splits {', '.join(map(repr, dataset))}, none of them 'train' "
                f"(expected one split, e.g. dataset[{next(iter(dataset), 'train')!r}])"
            )
        return one(dataset["train"], "train")
    if name != "train_dataset" and isinstance(dataset, dict):  # a DatasetDict is a dict
        return {key: one(ds, key) for key, ds in dataset.items()}
    return one(dataset, None)


def _is_raw(dataset, token_column: str | None) -> bool:
    if hf_kind(dataset) == "Dataset":
        columns = dataset.column_names
    elif isinstance(dataset, (list, tuple)) and dataset and isinstance(dataset[0], dict):
        columns = dataset[0]
    else:
        return False
    return token_column is None or token_column not in columns


# ---- tokenized rows, checked ------------------------------------------------------------------------------
def _array(value) -> np.ndarray | None:
    """`value` as a 1-D array, or None where it is not a flat list (a ragged or nested list, a string, None)."""
    if not isinstance(value, (list, tuple, np.ndarray)):
        return None
    try:
        arr = np.asarray(value)
    except ValueError:  # ragged
        return None
    return arr if arr.ndim == 1 else None


def _token_array(value, column: str, where: str) -> np.ndarray:
    arr = _array(value)
    if arr is None:
        raise DataError(f"{where}: {column} is not a flat list (expected a list of integer token ids)")
    if arr.size and arr.dtype.kind not in "iu":
        raise DataError(f"{where}: {column} holds {arr.tolist()[0]!r} (expected a list of integer token ids)")
    return arr.astype(np.int64)


def _tokenized_example(row: dict, where: str) -> tuple[np.ndarray, np.ndarray]:
    ids = _token_array(row["input_ids"], "input_ids", where)
    if ids.size == 0:
        raise DataError(f"{where}: input_ids is empty (expected at least one token)")
    if ids.min() < 0 or ids.max() > np.iinfo(np.int32).max:
        raise DataError(f"{where}: input_ids holds {int(ids.min())} (expected token ids >= 0)")
    arrays = {}
    for column in ("labels", *_MASKS, "attention_mask"):
        if row.get(column) is None:
            continue
        arr = _token_array(row[column], column, where) if column == "labels" else None
        if arr is None:  # a 0/1 mask: booleans are fine
            arr = _array(row[column])
            if arr is None or arr.dtype.kind not in "biu" or not np.isin(arr, (0, 1)).all():
                raise DataError(f"{where}: {column} is not a list of 0s and 1s (expected 1 per token to train on)")
            arr = arr.astype(np.int64)
        if len(arr) != len(ids):
            raise DataError(
                f"{where}: {column} has {len(arr)} values for {len(ids)} input_ids (expected one per token)"
            )
        arrays[column] = arr
    if "attention_mask" in arrays and not arrays["attention_mask"].all():
        raise DataError(
            f"{where}: attention_mask has 0s, a padded row (expected unpadded rows: the batching pads; drop the "
            "padding, or the attention_mask column)"
        )
    if "labels" in arrays:
        labels = arrays["labels"]
        if ((labels < 0) & (labels != IGNORE_INDEX)).any():
            raise DataError(f"{where}: labels holds {int(labels.min())} (expected token ids, or -100 for no loss)")
    else:
        target = np.ones(len(ids), dtype=bool)
        for column in _MASKS:
            if column in arrays:
                target &= arrays[column] == 1
        labels = np.where(target, ids, IGNORE_INDEX)
    labels = labels.copy()
    labels[0] = IGNORE_INDEX  # no position predicts the first token (the batching sets it too)
    return ids, labels


def tokenized_from_hf(dataset, *, split: str | None = None, name: str = "dataset") -> TokenizedDataset:
    """A tokenized `datasets.Dataset` (input_ids, and labels or TRL's masks; see the module docstring) as a
    `TokenizedDataset`, every row checked: a malformed one is a `DataError` naming it and `name` (the argument it
    came in)."""
    _one_split(dataset, name)
    split = _split(dataset, split)
    columns = list(dataset.column_names)
    if "input_ids" not in columns:
        fmt = detect_format(dict.fromkeys(columns))
        if fmt is not None:
            raise DataError(
                f"{name}: the dataset holds raw {fmt} records (columns {columns}), not tokens; {_HOW_TO_TOKENIZE}"
            )
        raise DataError(
            f"{name}: no input_ids column (columns {columns}) (expected tokenized rows: input_ids, with labels, "
            "completion_mask or assistant_masks; or raw SFT records, for tokenize_sft_dataset)"
        )
    if len(dataset) == 0:
        raise DataError(f"{name}: the dataset has no rows (expected at least one example)")
    dataset = dataset.select_columns([c for c in TOKENIZED_COLUMNS if c in columns])
    fast = _from_arrow(dataset, name, split)
    if fast is not None:
        return fast
    rows = _rows(dataset)
    examples = (_tokenized_example(row, f"{name} {_where(i, split)}") for i, row in enumerate(rows))
    return TokenizedDataset.from_examples(examples)


def _from_arrow(dataset, name: str, split: str | None) -> TokenizedDataset | None:
    """`tokenized_from_hf` on whole Arrow columns (measured here, one thread: 50k rows of 11M tokens with a
    completion_mask in 1.0 s, against 12.9 s row by row), where every column is a list of integers (or booleans, for
    a mask) with no null; None otherwise (the row-by-row path then finds the bad row). The checks are
    `_tokenized_example`'s, vectorised: the first row that fails one is handed to it, which raises its error."""
    import pyarrow as pa  # a dependency of `datasets`, which made this dataset

    table = dataset.with_format("arrow")[:]  # the rows in the dataset's order (after select/shuffle: its indices)
    cols, lengths = {}, None
    # input_ids first (TOKENIZED_COLUMNS' order): `lengths` are its lengths
    for column in (c for c in TOKENIZED_COLUMNS if c in table.column_names):
        arr = table.column(column).combine_chunks()
        value_kinds = [pa.types.is_integer] + ([pa.types.is_boolean] if column not in ("input_ids", "labels") else [])
        if not (pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type)):
            return None
        if not any(is_kind(arr.type.value_type) for is_kind in value_kinds):
            return None
        values = arr.flatten()
        if arr.null_count or values.null_count:
            return None
        cols[column] = values.to_numpy(zero_copy_only=False).astype(np.int64)
        offsets = arr.offsets.to_numpy()
        lens = np.diff(offsets).astype(np.int64)
        if lengths is None:
            lengths = lens
        elif not np.array_equal(lens, lengths):
            return _first_bad(dataset, name, split, np.flatnonzero(lens != lengths))
    ids, row_of = cols["input_ids"], np.repeat(np.arange(len(lengths)), lengths)  # row_of: (tokens,)
    bad = [np.flatnonzero(lengths == 0), row_of[(ids < 0) | (ids > np.iinfo(np.int32).max)]]
    for column in _MASKS:
        if column in cols:
            bad.append(row_of[(cols[column] != 0) & (cols[column] != 1)])
    if "attention_mask" in cols:
        bad.append(row_of[cols["attention_mask"] != 1])
    if "labels" in cols:
        bad.append(row_of[(cols["labels"] < 0) & (cols["labels"] != IGNORE_INDEX)])
    bad_rows = np.concatenate(bad)
    if len(bad_rows):
        return _first_bad(dataset, name, split, bad_rows)
    if "labels" in cols:
        labels = cols["labels"].copy()
    else:
        target = np.ones(len(ids), dtype=bool)
        for column in _MASKS:
            if column in cols:
                target &= cols[column] == 1
        labels = np.where(target, ids, IGNORE_INDEX)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    labels[offsets[:-1]] = IGNORE_INDEX  # no position predicts the first token of an example
    return TokenizedDataset(ids, labels, offsets)


def _first_bad(dataset, name: str, split: str | None, rows: np.ndarray):
    i = int(rows.min())
    _tokenized_example(dataset.with_format(None)[i], f"{name} {_where(i, split)}")  # raises the row's error
    raise AssertionError(f"{name} row {i}: failed a vectorised check but not the row's own")


PAIR_TOKEN_COLUMNS = ("prompt_input_ids", "chosen_input_ids", "rejected_input_ids")  # TRL's DPOTrainer's names


def tokenized_pairs(dataset, name: str):
    """What PreferenceTrainer trains or evaluates on, given tokenized pairs as `name`: a `datasets.Dataset` of TRL's
    columns (`prompt_input_ids`, `chosen_input_ids`, `rejected_input_ids`, as DPOTrainer's tokenize_row writes them)
    as a PreferenceDataset, every row checked (lists of token ids >= 0, a non-empty chosen and rejected), taken as
    they are (no truncation: they were truncated when tokenized); an eval dict split by split; anything else as it
    is. A Dataset without those columns is a one-line error naming its columns."""
    if name != "train_dataset" and isinstance(dataset, dict):
        return {key: _pairs_from_hf(ds, name, key) for key, ds in dataset.items()}
    return _pairs_from_hf(dataset, name, None)


def _pairs_from_hf(dataset, name: str, split: str | None):
    if hf_kind(dataset) != "Dataset":
        return dataset
    split = _split(dataset, split)
    columns = list(dataset.column_names)
    missing = [c for c in PAIR_TOKEN_COLUMNS if c not in columns]
    if missing:
        raise DataError(
            f"{name}: no column {missing[0]!r} (columns {columns}) (expected raw pairs, or TRL's tokenized pairs: "
            f"{', '.join(PAIR_TOKEN_COLUMNS)})"
        )
    rows = _rows(dataset.select_columns(list(PAIR_TOKEN_COLUMNS)))
    pairs = [_tokenized_pair(row, f"{name} {_where(i, split)}") for i, row in enumerate(rows)]
    if not pairs:
        raise DataError(f"{name}: the dataset has no rows (expected at least one pair)")
    return PreferenceDataset.from_pairs(pairs)


def _tokenized_pair(row: dict, where: str) -> dict:
    """A row of TRL's tokenized pair columns as {"prompt_ids", "chosen_ids", "rejected_ids"}, checked (a missing
    column, a bad token list, an empty answer: a `DataError` naming `where`)."""
    pair = {}
    for column in PAIR_TOKEN_COLUMNS:
        if column not in row:
            raise DataError(
                f"{where}: no column {column!r} (expected TRL's tokenized pairs: {', '.join(PAIR_TOKEN_COLUMNS)})"
            )
        ids = _token_array(row[column], column, where)
        if ids.size and ids.min() < 0:
            raise DataError(f"{where}: {column} holds {int(ids.min())} (expected token ids >= 0)")
        if ids.size == 0 and column != "prompt_input_ids":
            raise DataError(f"{where}: {column} is empty (expected at least one token)")
        pair[column.replace("_input_ids", "_ids")] = ids
    return pair


def trainer_dataset(dataset, name: str):
    """What the Trainer trains or evaluates on, given `dataset` as `name` ("train_dataset", "eval_dataset"): a
    `datasets` object converted by `tokenized_from_hf` (a dict of them, eval_dataset's, split by split), anything
    else as it is."""
    if name != "train_dataset" and isinstance(dataset, dict):  # eval_dataset's dict or DatasetDict: split by split
        if not any(hf_kind(ds) for ds in dataset.values()) and hf_kind(dataset) is None:
            return dataset  # a dict of our datasets: the same object
        return {key: _converted(ds, name, key) for key, ds in dataset.items()}
    return _converted(dataset, name, None)


def _converted(dataset, name: str, split: str | None):
    return tokenized_from_hf(dataset, split=split, name=name) if hf_kind(dataset) is not None else dataset
