"""Streamed training data (`--streaming`, `datasets`' and LlamaFactory's name): examples read and tokenised as
training needs them, batched from a bounded buffer, and resumed exactly, on the same number of processes or another.

    stream = SFTStream([load_dataset("json", data_files=shards, split="train", streaming=True)], tokenizer)
    trainer = Trainer(model=model, args=TrainingArguments(max_steps=1000, ...), train_dataset=stream)

SFT examples stream as `SFTStream`, preference pairs as `PairStream` (PreferenceTrainer makes one of a raw or TRL-
tokenized IterableDataset of pairs; each pair encoded by trainer/data/preference_data.py's `encode_pair`, each buffer
a PreferenceDataset); both are a `Stream`, whose sources, mixing and positions below they share.

The stream (`SFTStream`): one or several sources (`datasets.IterableDataset`s, or any re-iterable of records such as a
list), each row tokenised as a file's record is (trainer/data/sft_data.py: the same format detection, masking,
truncation, drops and one-line errors, naming the row as `source[i]`), or taken as it is when it holds tokens
(`input_ids`, with `labels` or TRL's masks: trainer/data/hf_datasets.py's checks). Several sources mix as
`--dataset_name`'s do (`mix_strategy`: concat, interleave_under, interleave_over; `interleave_probs` seeded with
data_seed), drawn here with a random generator whose state is part of the position, so a mixture resumes exactly
(datasets 5.2's `interleave_datasets(...).load_state_dict` did not: measured, it resumed a JSON source at another
shard). A pass over the stream ends where the mixture says; the next pass reads it again from its start.

Its position between two rows: per source the rows read in this pass and, where the source offers it
(`IterableDataset.state_dict`, datasets >= 2.18), its own state, which reopens it without reading the rows before
(else those rows are read again and skipped); the mixture's generator state; the pass.

The batches (`StreamLoader`): the stream is read in buffers of `packing_buffer` examples; each buffer is planned as
`BatchLoader` plans an epoch of a dataset (the same four strategies, shuffled with (seed, buffer, pass); for the
packing strategies best-fit-decreasing over the buffer, so rows pack as well as the buffer allows), and the plans
of consecutive buffers make one global sequence of micro batches. The first buffer of pass p is planned as epoch p:
a stream that fits in one buffer trains as the same data in memory, epoch after epoch, bit for bit. Rank r of W
takes micro batches r, r + W, ... and optimizer step k takes global micro batches k*W*A .. (k+1)*W*A - 1, as for
in-memory data: with the same micro batch and global batch, every step takes the same examples whatever the number
of processes, and none is taken twice or skipped. Every rank reads and tokenises the whole stream (the plan of a
buffer needs every example's length), so reading is not divided among ranks: that is the price of a plan that does
not depend on their number.

Its state (a checkpoint's data_state.json): the position of the stream at the start of the buffer being consumed,
that buffer's first global micro batch, and the global micro batches consumed. A resume reopens the stream there,
reads and plans that buffer again (the same examples, the same plan) and skips what was consumed: the buffer's
contents are not saved, they are read again. `len()` is the micro batches per rank of the whole run (max_steps x
gradient_accumulation_steps), which is one "epoch" of the Trainer's loop: a stream needs max_steps.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
import logging
from abc import ABC, abstractmethod
from collections.abc import Iterator

import numpy as np

from trainer.checkpoint_hf import CheckpointError
from trainer.coerce import ConfigError
from trainer.config.args import BATCHING_STRATEGIES, PACKING_BUFFER, TOKEN_BUDGET_STRATEGIES
from trainer.data.batching import BatchLoader
from trainer.data.hf_datasets import PAIR_TOKEN_COLUMNS, _tokenized_example, _tokenized_pair, hf_kind, trainer_dataset
from trainer.data.hf_sources import MIX_STRATEGIES, load_source, pick_split, split_names
from trainer.data.preference_data import (
    PAIR_FORMATS_TEXT,
    PreferenceDataset,
    detect_preference_format,
    encode_pair,
    preference_options,
)
from trainer.data.sft_data import (
    IGNORE_INDEX,
    DataError,
    TokenizedDataset,
    _keep_chat_template,
    checked_options,
    checked_source,
    detect_format,
    resolve_data_files,
)
from trainer.data.sft_data import _encode_item as encode_item

logger = logging.getLogger(__name__)

_MAX_WARNINGS = 5  # dropped rows named one by one; the rest counted
# how a buffer's plan is keyed (StreamLoader._plan); saved in the loader's state, so a checkpoint of a stream planned
# otherwise (before 2026-11-27: pass << 32 + buffer) is refused in one line rather than resumed with other batches
PLAN_KEY = "buffer << 32 + pass"


def _initial_state(source):
    """The state a `datasets.IterableDataset` starts from (None for other iterables: they are reopened by count)."""
    return copy.deepcopy(source.state_dict()) if hasattr(source, "state_dict") else None


class _SourceReader:
    """One source read row by row from a position {"rows": rows read this pass, "state": its state_dict or None}."""

    def __init__(self, source, initial_state, start: dict | None):
        self.source = source
        start = start or {"rows": 0, "state": initial_state}
        self._opened_state = start["state"]
        if initial_state is not None:
            source.load_state_dict(copy.deepcopy(start["state"]))
            self._rows = iter(source)
        else:  # reopened from the start, the rows before the position read again and skipped
            self._rows = itertools.islice(iter(source), start["rows"], None)
        self.rows = start["rows"]

    def next(self):
        """The next row, or None at the end of the source."""
        row = next(self._rows, None)
        if row is not None:
            self.rows += 1
        return row

    def position(self) -> dict:
        state = self._opened_state
        if state is not None and self.rows > 0:  # the source's own state is that of its running iteration
            state = self.source.state_dict()
        return {"rows": self.rows, "state": copy.deepcopy(state)}


class Stream(ABC):
    """Rows of one or several sources, mixed, read from a position (see the module docstring). What a row becomes is
    the subclass's: `_format` (a source's format, from its first row), `_example` (a row's example, or None for a
    row dropped) and `dataset` (a buffer's examples as the dataset BatchLoader plans); `max_length` bounds an
    example's tokens (None: unbounded). `SFTStream` streams SFT examples, `PairStream` preference pairs."""

    max_length: int | None = None

    def __init__(
        self, sources, processing_class, *, names, mix_strategy: str, interleave_probs, seed: int, options: dict
    ):
        sources = list(sources) if isinstance(sources, (list, tuple)) else [sources]
        what = type(self).__name__
        if not sources:
            raise DataError(f"{what}: no sources (expected one or more IterableDatasets or lists of records)")
        if mix_strategy not in MIX_STRATEGIES:
            raise DataError(f"mix_strategy={mix_strategy!r}: expected one of {', '.join(MIX_STRATEGIES)}")
        if interleave_probs is not None:
            probs = [float(p) for p in interleave_probs]
            if mix_strategy == "concat" or len(probs) != len(sources) or any(p < 0 for p in probs):
                raise DataError(
                    f"interleave_probs={interleave_probs}: expected one probability >= 0 per source, with "
                    "mix_strategy interleave_under or interleave_over"
                )
            if not np.isclose(sum(probs), 1.0):
                raise DataError(f"interleave_probs={interleave_probs}: expected probabilities that sum to 1")
            interleave_probs = probs
        for source in sources:
            kind = hf_kind(source)
            if kind in ("DatasetDict", "IterableDatasetDict"):
                raise DataError(f"{what}: a {kind} (expected one split, e.g. dataset['train'])")
        self.sources = [s.with_format(None) if hasattr(s, "with_format") else s for s in sources]
        default = ["stream"] if len(sources) == 1 else [f"stream {i}" for i in range(len(sources))]
        self.names = list(names) if names else default
        self.mix_strategy, self.probs, self.seed = mix_strategy, interleave_probs, int(seed)
        self.options = options
        self.tokenizer = processing_class
        self._initial = [_initial_state(s) for s in self.sources]
        self.formats = [self._format(i) for i in range(len(self.sources))]  # from each source's first row
        self.dropped: dict[str, int] = {}
        self.summary = {
            "files": self.names,
            "formats": dict(zip(self.names, self.formats)),
            "options": self.options,
            "streaming": True,
            "mixture": mix_strategy if len(sources) > 1 else None,
        }

    # ---- what the rows are ------------------------------------------------------------------------------------
    def _first_row(self, i: int) -> dict:
        """Source i's first row (a one-line DataError when it has none, or it is not a dict)."""
        first = _SourceReader(self.sources[i], self._initial[i], None).next()
        if first is None:
            raise DataError(f"{self.names[i]}: no rows (expected at least one example)")
        if not isinstance(first, dict):
            raise DataError(f"{self.names[i]}[0]: a row is {type(first).__name__} (expected a dict of columns)")
        return first

    @abstractmethod
    def _format(self, i: int) -> str:
        """Source i's format, read once from its first row."""

    @abstractmethod
    def _example(self, i: int, where: str, row):
        """Source i's row as an example, or None for a row dropped."""

    @abstractmethod
    def dataset(self, examples: list):
        """A buffer's examples as the dataset BatchLoader plans."""

    def _drop(self, where: str, reason: str, message: str) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1
        if self.dropped[reason] <= _MAX_WARNINGS:
            logger.warning("dropping %s: %s", where, message)
        return None

    # ---- reading ------------------------------------------------------------------------------------------------
    def start(self, pass_index: int = 0) -> dict:
        """The position at the start of pass `pass_index`."""
        rng = np.random.default_rng((self.seed, pass_index)).bit_generator.state if self.probs else None
        return {
            "pass": pass_index,
            "sources": [None] * len(self.sources),
            "turn": 0,
            "exhausted": [False] * len(self.sources),
            "rng": rng,
        }

    def examples(self, position: dict) -> _StreamReader:
        """A reader of the examples from `position` (`start()`, or a reader's `position()`)."""
        return _StreamReader(self, position)

    def config(self) -> dict:
        """What the examples depend on, for a resume's check: the sources, formats, options and mixture."""
        tok = self.tokenizer
        vocab = getattr(tok, "vocab_size", None) if tok is not None else None
        return {
            "sources": self.names,
            "formats": self.formats,
            "mix_strategy": self.mix_strategy,
            "interleave_probs": self.probs,
            "data_seed": self.seed,
            "options_sha256": hashlib.sha256(json.dumps(self.options, sort_keys=True).encode()).hexdigest()[:16],
            "tokenizer_vocab_size": vocab,
        }

    def summary_text(self) -> str:
        mixed = f", {self.mix_strategy}" if len(self.sources) > 1 else ""
        formats = ", ".join(f"{n} ({f})" for n, f in zip(self.names, self.formats))
        return f"streamed from {formats}{mixed}: read and tokenised as training goes (length unknown)"


class SFTStream(Stream):
    """SFT examples from streamed sources (see the module docstring). `processing_class` tokenises raw rows (the
    options mean what they mean for `load_sft_dataset`); rows that hold `input_ids` are taken as tokens."""

    def __init__(
        self,
        sources,
        processing_class=None,
        *,
        names: list[str] | None = None,
        mix_strategy: str = "concat",
        interleave_probs=None,
        seed: int = 0,
        data_format: str = "auto",
        cutoff_len: int | None = 2048,
        train_on_prompt: bool = False,
        mask_history: bool = False,
        skip_bad_examples: bool = False,
    ):
        options = checked_options(data_format, cutoff_len, train_on_prompt, mask_history, skip_bad_examples)
        self.max_length = options["cutoff_len"]
        super().__init__(
            sources,
            processing_class,
            names=names,
            mix_strategy=mix_strategy,
            interleave_probs=interleave_probs,
            seed=seed,
            options=options,
        )
        if self.tokenizer is not None:
            _keep_chat_template(self.tokenizer, self)  # conversations without a template: ChatML, saved with the model

    def _format(self, i: int) -> str:
        """The source's format, from its first row: "tokens" (input_ids), or an SFT format (sft_data's detection,
        or data_format when forced). Read once here, so that a stream reopened mid-way decodes its rows alike."""
        first = self._first_row(i)
        if "input_ids" in first:
            return "tokens"
        if self.tokenizer is None:
            raise DataError(
                f"{self.names[i]}: raw rows (columns {sorted(first)}) and no processing_class to tokenise them "
                "(expected rows of input_ids; or SFTStream(dataset, processing_class), which tokenises as it reads)"
            )
        fmt = detect_format(first) if self.options["data_format"] == "auto" else self.options["data_format"]
        if fmt is None:
            raise DataError(
                f"{self.names[i]}: cannot tell the data format from the columns {sorted(first)} (expected "
                "messages, conversations, instruction/output, prompt/completion or text; or set data_format)"
            )
        return fmt

    def _example(self, i: int, where: str, row):
        """The (input_ids, labels) of source i's row, or None for a row dropped (no target; a bad row under
        skip_bad_examples); a bad row is a DataError naming `where`."""
        if self.formats[i] == "tokens":
            ids, labels = _tokenized_example(row, where)
            if (labels[1:] != IGNORE_INDEX).any():
                return ids, labels
            return self._drop(where, "no_targets", "no target token")
        items = checked_source(self.names[i], [(where, row)], self.formats[i], {})
        outcome = encode_item(where, next(items)[1], self.tokenizer, self.options)
        kind = outcome[0]
        if kind == "ok":
            return np.asarray(outcome[1], dtype=np.int64), np.asarray(outcome[2], dtype=np.int64)
        if kind == "fatal":
            raise DataError(outcome[1])
        if kind == "bad" and not self.options["skip_bad_examples"]:
            raise DataError(f"{where}: {outcome[2]}")
        return self._drop(where, outcome[1], outcome[2])

    def dataset(self, examples: list) -> TokenizedDataset:
        return TokenizedDataset.from_examples(examples)


class PairStream(Stream):
    """Preference pairs from streamed sources (see the module docstring): raw pairs tokenised as a file's are
    (trainer/data/preference_data.py: the same formats, truncation, drops and one-line errors, naming the row as
    `source[i]`; the options mean what they mean for `load_preference_dataset`), or rows of TRL's tokenized pair
    columns (prompt_input_ids, chosen_input_ids, rejected_input_ids) taken as they are, as `tokenized_pairs` takes
    a Dataset of them. PreferenceTrainer makes one of a `datasets.IterableDataset` given as its train_dataset."""

    def __init__(
        self,
        sources,
        processing_class=None,
        *,
        names: list[str] | None = None,
        mix_strategy: str = "concat",
        interleave_probs=None,
        seed: int = 0,
        data_format: str = "auto",
        max_length: int | None = 1024,
        max_prompt_length: int | None = None,
        truncation_mode: str = "keep_start",
        skip_bad_examples: bool = False,
    ):
        options = preference_options(data_format, max_length, max_prompt_length, truncation_mode, skip_bad_examples)
        self.max_length = max_length
        super().__init__(
            sources,
            processing_class,
            names=names,
            mix_strategy=mix_strategy,
            interleave_probs=interleave_probs,
            seed=seed,
            options=options,
        )

    def _format(self, i: int) -> str:
        """The source's format, from its first row: "tokens" (TRL's tokenized pair columns), or a pair format
        (preference_data's detection, or data_format when forced)."""
        first = self._first_row(i)
        if "chosen_input_ids" in first:
            return "tokens"
        if self.tokenizer is None:
            raise DataError(
                f"{self.names[i]}: raw pairs (columns {sorted(first)}) and no processing_class to tokenise them "
                f"(expected TRL's tokenized pairs: {', '.join(PAIR_TOKEN_COLUMNS)}; or a processing_class)"
            )
        fmt = detect_preference_format(first) if self.options["data_format"] == "auto" else self.options["data_format"]
        if fmt is None:
            raise DataError(
                f"{self.names[i]}: cannot tell the pair format from the columns {sorted(first)} (expected "
                f"{PAIR_FORMATS_TEXT}; or set data_format)"
            )
        return fmt

    def _example(self, i: int, where: str, row):
        """The {"prompt_ids", "chosen_ids", "rejected_ids"} of source i's row, or None for a pair dropped (no answer
        token left after truncation; a bad pair under skip_bad_examples); a bad pair is a DataError naming `where`."""
        if self.formats[i] == "tokens":
            return _tokenized_pair(row, where)
        items = checked_source(self.names[i], [(where, row)], self.formats[i], {})
        outcome = encode_pair(next(items)[1], self.tokenizer, self.options)
        if outcome[0] == "ok":
            return outcome[1]
        if outcome[0] == "bad" and not self.options["skip_bad_examples"]:
            raise DataError(f"{where}: {outcome[2]}")
        return self._drop(where, outcome[1], outcome[2])

    def dataset(self, examples: list) -> PreferenceDataset:
        return PreferenceDataset.from_pairs(examples)


class _StreamReader:
    """The examples of a `Stream` from a position, in the mixture's order; `position()` between any two."""

    def __init__(self, stream: Stream, position: dict):
        self.stream = stream
        self.pass_index = position["pass"]
        self.turn, self.exhausted = position["turn"], list(position["exhausted"])
        self.rng = None
        if position["rng"] is not None:
            self.rng = np.random.default_rng()
            self.rng.bit_generator.state = copy.deepcopy(position["rng"])
        self.readers = [
            _SourceReader(s, init, start)
            for s, init, start in zip(stream.sources, stream._initial, position["sources"])
        ]
        self.pass_ended = False

    def position(self) -> dict:
        return {
            "pass": self.pass_index,
            "sources": [r.position() for r in self.readers],
            "turn": self.turn,
            "exhausted": list(self.exhausted),
            "rng": copy.deepcopy(self.rng.bit_generator.state) if self.rng is not None else None,
        }

    def _pick(self) -> int:
        n = len(self.readers)
        if self.stream.mix_strategy == "concat":
            return self.turn
        if self.rng is not None:
            return int(self.rng.choice(n, p=self.stream.probs))
        return self.turn % n

    def next(self):
        """The next example, or None at the end of this pass (the reader then stays at its end)."""
        stream, n = self.stream, len(self.readers)
        while not self.pass_ended:
            i = self._pick()
            reader = self.readers[i]
            row = reader.next()
            if row is None:  # source i is at its end
                self.exhausted[i] = True
                if stream.mix_strategy == "concat" and i + 1 < n:
                    self.turn += 1
                    continue
                if stream.mix_strategy == "interleave_over" and not all(self.exhausted):
                    self.readers[i] = _SourceReader(stream.sources[i], stream._initial[i], None)  # seen whole: again
                    continue
                self.pass_ended = True
                return None
            if stream.mix_strategy != "concat" and self.rng is None:
                self.turn += 1
            example = stream._example(i, f"{stream.names[i]}[{reader.rows - 1}]", row)
            if example is not None:
                return example
        return None


class StreamLoader:
    """Micro batches of a `Stream` (see the module docstring): BatchLoader's interface for the Trainer's loop.

    `micro_batches_per_rank` is the run's length in micro batches per rank (max_steps x accumulation). A micro batch
    is `collate(planner, indices)`: by default the buffer's BatchLoader's; a method with batches of its own (pairs)
    sets it, as it sets a BatchLoader's `collate`."""

    def __init__(
        self,
        stream: Stream,
        *,
        micro_batches_per_rank: int,
        batching_strategy: str = "normal",
        micro_batch_size: int = 1,
        max_tokens: int | None = None,
        pad_token_id: int = 0,
        pad_to_multiple_of: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        group_by_length: bool = False,
        drop_last: bool = False,
        rank: int = 0,
        world_size: int = 1,
        packing_buffer: int = PACKING_BUFFER,
    ):
        if batching_strategy not in BATCHING_STRATEGIES:
            raise ValueError(
                f"batching_strategy={batching_strategy!r}: expected one of {', '.join(BATCHING_STRATEGIES)}"
            )
        if batching_strategy in TOKEN_BUDGET_STRATEGIES and max_tokens is None:
            cutoff = stream.max_length
            if cutoff is None:
                raise ConfigError(
                    f"max_tokens: batching_strategy={batching_strategy!r} on a stream needs a token budget (the "
                    "longest example is not known in advance); set max_tokens or cutoff_len"
                )
            max_tokens = micro_batch_size * cutoff
        if not isinstance(packing_buffer, int) or packing_buffer < micro_batch_size:
            raise ConfigError(
                f"packing_buffer={packing_buffer!r}: expected an int >= per_device_train_batch_size "
                f"({micro_batch_size})"
            )
        if not isinstance(micro_batches_per_rank, int) or micro_batches_per_rank < 1:
            raise ConfigError("max_steps: must be set (> 0) when the training data is a stream (its length is unknown)")
        self.stream = stream
        self.length = micro_batches_per_rank
        self.rank, self.world_size = rank, world_size
        self.max_tokens = max_tokens if batching_strategy in TOKEN_BUDGET_STRATEGIES else None
        self.buffer_size = packing_buffer
        self._plan_args = dict(
            batching_strategy=batching_strategy,
            micro_batch_size=micro_batch_size,
            max_tokens=self.max_tokens,
            pad_token_id=pad_token_id,
            pad_to_multiple_of=pad_to_multiple_of,
            shuffle=shuffle,
            seed=seed,
            group_by_length=group_by_length,
            drop_last=drop_last,
        )
        self.set_epoch(0)

    @classmethod
    def from_args(cls, stream, args, micro_batch_size: int, *, pad_token_id: int = 0, rank: int = 0, world_size=1):
        """The loader TrainingArguments `args` ask for (BatchLoader.from_args' arguments, plus max_steps and
        packing_buffer)."""
        max_steps = args.get_max_steps(None)  # a ConfigError naming max_steps when it is not set
        return cls(
            stream,
            micro_batches_per_rank=max_steps * args.gradient_accumulation_steps,
            batching_strategy=args.batching_strategy,
            micro_batch_size=micro_batch_size,
            max_tokens=args.max_tokens,
            pad_token_id=pad_token_id,
            pad_to_multiple_of=args.pad_to_multiple_of,
            shuffle=args.train_shuffle,
            seed=args.data_seed if args.data_seed is not None else args.seed,
            group_by_length=args.group_by_length,
            drop_last=args.dataloader_drop_last,
            rank=rank,
            world_size=world_size,
            packing_buffer=args.packing_buffer,
        )

    def __len__(self) -> int:
        return self.length

    def global_batch_count(self) -> int:
        """Global micro batches in the run (a resume under another number of processes compares step counts)."""
        return self.length * self.world_size

    def set_epoch(self, epoch: int) -> None:
        """Start from the stream's beginning (the loop calls it once, at the start of a run that is not resumed)."""
        self.epoch = int(epoch)
        self._buffer_start = self.stream.start(0)  # the stream's position where the current buffer starts
        self._buffer_index = 0  # buffers of this pass before the current one
        self._buffer_first = 0  # the global index of the current buffer's first micro batch
        self._consumed = 0  # global micro batches consumed by all ranks together

    # ---- planning ---------------------------------------------------------------------------------------------
    def _read_buffer(self, reader: _StreamReader):
        examples = []
        while len(examples) < self.buffer_size and (ex := reader.next()) is not None:
            examples.append(ex)
        return self.stream.dataset(examples) if examples else None

    def _plan(self, buffer, pass_index: int, buffer_index: int) -> tuple[BatchLoader, list]:
        """The buffer's micro batches, as BatchLoader plans an epoch of it, keyed by buffer and pass: the first
        buffer of pass p is planned as epoch p, so a stream that fits in one buffer trains as the same data in memory,
        epoch after epoch (PLAN_KEY, in the checkpoint's state)."""
        args = self._plan_args
        if args["drop_last"] and args["batching_strategy"] not in TOKEN_BUDGET_STRATEGIES:
            if len(buffer) < args["micro_batch_size"]:  # the pass's last examples fill no micro batch: dropped
                return None, []
        planner = BatchLoader(buffer, **args)
        return planner, planner.global_batches((buffer_index << 32) + pass_index)

    def buffers(self) -> Iterator[tuple[BatchLoader, list, int]]:
        """(planner, plan, first global index) of every buffer from the current one on, pass after pass. The loader's
        state moves to each buffer as it starts: while its batches are handed out, `state_dict` names it."""
        reader = self.stream.examples(self._buffer_start)
        while True:
            position = reader.position()
            buffer = self._read_buffer(reader)
            if buffer is not None:
                self._buffer_start = position
                planner, plan = self._plan(buffer, reader.pass_index, self._buffer_index)
                yield planner, plan, self._buffer_first
                self._buffer_first += len(plan)
                self._buffer_index += 1
            if reader.pass_ended:
                if buffer is None and self._buffer_index == 0:
                    raise DataError(
                        f"{', '.join(self.stream.names)}: a whole pass over the stream gave no usable example"
                    )
                reader = self.stream.examples(self.stream.start(reader.pass_index + 1))
                self._buffer_start, self._buffer_index = reader.position(), 0

    # ---- iteration --------------------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[dict]:
        for planner, plan, first in self.buffers():
            for j, indices in enumerate(plan):
                g = first + j
                if g < self._consumed or g % self.world_size != self.rank:
                    continue
                batch = self.collate(planner, indices)
                self._consumed = g - self.rank + self.world_size  # the round's end: all ranks take one each
                yield batch

    def collate(self, planner: BatchLoader, indices) -> dict:
        """The micro batch of the buffer's examples `indices`, as its planner collates them."""
        return planner.collate(indices)

    # ---- resume -----------------------------------------------------------------------------------------------
    def _config(self) -> dict:
        plan = {k: v for k, v in self._plan_args.items() if k != "pad_token_id"}
        return {**plan, "packing_buffer": self.buffer_size, "plan_key": PLAN_KEY, **self.stream.config()}

    def state_dict(self) -> dict:
        return {
            "streaming": True,
            "buffer_start": self._buffer_start,
            "buffer_index": self._buffer_index,
            "buffer_first": self._buffer_first,
            "consumed": self._consumed,
            "world_size": self.world_size,
            **self._config(),
        }

    def load_state_dict(self, state: dict) -> None:
        if not state.get("streaming"):
            raise CheckpointError(
                "cannot resume the data loader: the checkpoint's data was not a stream (drop --streaming, or start "
                "again with --overwrite_output_dir)"
            )
        mine = json.loads(json.dumps(self._config()))
        diffs = [f"{k} was {state.get(k)!r}, is {v!r}" for k, v in mine.items() if state.get(k) != v]
        if diffs:
            raise CheckpointError(
                "cannot resume the data loader: the stream or its batches would differ ("
                + "; ".join(diffs)
                + "); resume with the data and batching arguments the checkpoint was saved with "
                "(its training_args.json), or start again (--overwrite_output_dir)"
            )
        self._buffer_start = state["buffer_start"]
        self._buffer_index = int(state["buffer_index"])
        self._buffer_first, self._consumed = int(state["buffer_first"]), int(state["consumed"])


def is_stream(dataset) -> bool:
    return isinstance(dataset, Stream)


def training_data(dataset, name: str):
    """`Trainer(train_dataset=...)` as the loaders take it: a `datasets.IterableDataset` of tokens as an SFTStream
    (raw rows: a one-line error saying to wrap them in one with the tokenizer); anything else as
    `trainer_dataset` takes it."""
    if hf_kind(dataset) == "IterableDataset":
        return SFTStream([dataset], names=[name])
    return trainer_dataset(dataset, name)


def open_stream(
    stream_class: type[Stream],
    tokenizer,
    *,
    data=None,
    dataset_name=None,
    config: str | None = None,
    data_files=None,
    train_split: str = "train",
    mix_strategy: str = "concat",
    interleave_probs=None,
    seed: int = 0,
    show_progress: bool = True,
    **options,
) -> Stream:
    """The command's `--streaming` training data, as a `stream_class` (SFTStream for stage sft, PairStream for stage
    dpo; `options`: that class's tokenisation options): `--dataset_name` sources as `datasets` streams them (a Hub id,
    a builder with --data_files, a saved dataset's Arrow shards), mixed as asked; or `--data` files, each a source
    (JSONL/JSON/Parquet through datasets' builders), one after the other. Rows are named `source:split[i]` /
    `file[i]` (0-based) in errors. Only the first row of each source is read here."""
    if dataset_name:
        names = split_names(dataset_name)
        sources = [
            pick_split(
                load_source(n, config=config, data_files=data_files, show_progress=show_progress, streaming=True),
                n,
                train_split,
                train=True,
            )
            for n in names
        ]
        names = [f"{n}:{train_split}" for n in names]
    else:
        files = resolve_data_files(data)
        builders = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
        sources = [
            load_source(builders[f.suffix], data_files=[str(f)], show_progress=show_progress, streaming=True)["train"]
            for f in files
        ]
        names, mix_strategy, interleave_probs = [str(f) for f in files], "concat", None
    return stream_class(
        sources,
        tokenizer,
        names=names,
        mix_strategy=mix_strategy,
        interleave_probs=interleave_probs,
        seed=seed,
        **options,
    )
