"""Micro batches from a tokenized dataset: four batching strategies, deterministic, resumable, data-parallel.

A `BatchLoader` yields dicts of torch tensors, each (B, T) int64:
    input_ids       pad_token_id where padded
    labels          unshifted (the model's target for position t is labels[t+1]); -100 = not a target
    position_ids    0.. per row, or restarting at 0 at each document of a packed row
    attention_mask  1 = real token, 0 = padding
and `num_items`, a python int: the targets after the shift, (labels[:, 1:] != -100).sum(); the loss
normaliser (sum it over gradient-accumulation steps and ranks before dividing).

Strategies (`batching_strategy`):
    normal                micro_batch_size examples per micro batch, right-padded to the longest (rounded up to
                          pad_to_multiple_of); `group_by_length` sorts megabatches of ~50 micro batches by length
                          (Hugging Face's LengthGroupedSampler idea), the longest batch first so OOM shows at once.
    padding_free          micro_batch_size examples concatenated into one row (B=1), position_ids restart per
                          document, no padding; each document's first token has label -100, so after the shift
                          no target crosses a document boundary.
    dynamic_batching      a token budget (max_tokens >= B * T, padding included) instead of a count; examples are
                          sorted by length (ties broken randomly per epoch) and cut greedily, so padding is small.
    dynamic_padding_free  documents packed best-fit-decreasing into rows of at most max_tokens (B=1).
The token-budget strategies form their batches from the length-sorted dataset and shuffle the order of the
batches each epoch (as fairseq does): the number of batches is then the same in every epoch, so `len()`, the
trainer's max_steps and a resume position are exact. Only which of several equally long examples lands where
changes between epochs.

Every epoch is planned as one global list of micro batches (shuffled with seed and epoch), dealt round-robin to
the ranks: rank r takes micro batches r, r + world_size, ... so every rank has the same number of steps and
each global step's micro batches are disjoint. The tail that does not fill a step is dropped (drop_last=True) or
filled with copies of the epoch's first micro batches whose labels are all -100 (num_items == 0), so no example
is counted twice. `state_dict()` holds the epoch and the global micro batches consumed; a loader restored from it
yields exactly the remaining ones, even under a different world_size. The plan depends on the world size only
through group_by_length (its megabatches hold micro_batch_size x world_size x 50); `same_steps` says when the
optimizer steps of two (world size, accumulation) layouts take the same micro batches, which a resume under
another number of processes needs.

    loader = BatchLoader(ds, batching_strategy="padding_free", micro_batch_size=8, seed=0, rank=r, world_size=n)
    for batch in loader:                 # one epoch from the current position
        loss = model(**{k: v.to(dev) for k, v in batch.items() if k != "num_items"}, num_items=total_items)
    eval_loader = BatchLoader(val, micro_batch_size=8, shuffle=False)
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from trainer.checkpoint_hf import CheckpointError
from trainer.coerce import ConfigError
from trainer.config.args import BATCHING_STRATEGIES, TOKEN_BUDGET_STRATEGIES, optimizer_steps

IGNORE_INDEX = -100
_PACKED = ("padding_free", "dynamic_padding_free")
# HF's LengthGroupedSampler multiplier: sort within ~50 micro batches, enough to group lengths well while the
# megabatch order stays random.
_MEGABATCH_MULT = 50


def _round_up(n: int, multiple: int | None) -> int:
    return n if not multiple else -(-n // multiple) * multiple


def steps_per_epoch(num_batches: int, world_size: int, accumulation: int, drop_last: bool = False) -> int:
    """Optimizer steps in an epoch of `num_batches` global micro batches (the Trainer's rule): each rank gets
    ceil (floor with drop_last) of num_batches / world_size, every `accumulation` of them make a step, at least one,
    and the leftovers join the epoch's last step."""
    per_rank = num_batches // world_size if drop_last else -(-num_batches // world_size)
    return optimizer_steps(per_rank, accumulation)


def same_steps(num_batches: int, drop_last: bool, a: tuple[int, int], b: tuple[int, int]) -> bool:
    """Whether every optimizer step of an epoch of `num_batches` global micro batches takes the same micro batches
    under (world_size, accumulation) `a` as under `b`: step k takes global micro batches k*W*A .. (k+1)*W*A - 1
    (dealt round-robin, W*A per step), the last step whatever is left (the fillers that even out the ranks carry
    no targets; drop_last drops the tail that does not fill all ranks). So: the same W*A, the same number of steps,
    and with drop_last the same tail dropped."""
    (wa, ka), (wb, kb) = a, b
    if wa * ka != wb * kb or steps_per_epoch(num_batches, wa, ka, drop_last) != steps_per_epoch(
        num_batches, wb, kb, drop_last
    ):
        return False
    return not drop_last or num_batches // wa * wa == num_batches // wb * wb


def best_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Pack items (given in the order to place them, normally decreasing) into bins of `capacity`: each item goes
    to the bin with the least room that still fits it, else a new bin. Returns item positions per bin.

    Bins are found by their remaining room with a segment tree over 0..capacity (counts of bins having exactly
    that much room), so each item costs O(log capacity) instead of a scan over all bins."""
    size = 1 << max(1, capacity.bit_length())
    tree = [0] * (2 * size)
    bins_with_room: dict[int, list[int]] = {}
    bins: list[list[int]] = []
    room: list[int] = []

    def add(r: int, delta: int) -> None:
        i = r + size
        while i:
            tree[i] += delta
            i >>= 1

    def smallest_room_at_least(need: int) -> int:
        i = need + size
        if tree[i]:
            return need
        while i > 1:  # climb until a right sibling holds a bin, then descend to its leftmost leaf
            if not i & 1 and tree[i + 1]:
                i += 1
                break
            i >>= 1
        else:
            return -1
        while i < size:
            i = 2 * i if tree[2 * i] else 2 * i + 1
        return i - size

    for item, length in enumerate(lengths):
        if not 0 < length <= capacity:
            raise ValueError(f"an item of {length} tokens does not fit a bin of {capacity}")
        r = smallest_room_at_least(length)
        if r < 0:
            b = len(bins)
            bins.append([])
            room.append(capacity)
        else:
            b = bins_with_room[r].pop()
            add(r, -1)
        bins[b].append(item)
        room[b] -= length
        if room[b]:
            bins_with_room.setdefault(room[b], []).append(b)
            add(room[b], 1)
    return bins


class BatchLoader:
    """Iterates micro batches of `dataset` (a TokenizedDataset, or any sequence of {"input_ids", "labels"}).

    Each `for batch in loader` runs the rest of the current epoch, then moves to the next; `len(loader)` is the
    micro batches per epoch on this rank. `shuffle=False` (the eval loader) keeps the dataset's order."""

    def __init__(
        self,
        dataset,
        *,
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
    ):
        if batching_strategy not in BATCHING_STRATEGIES:
            raise ValueError(
                f"batching_strategy={batching_strategy!r}: expected one of {', '.join(BATCHING_STRATEGIES)}"
            )
        if not isinstance(micro_batch_size, int) or micro_batch_size < 1:
            raise ValueError(f"micro_batch_size={micro_batch_size!r}: expected an int >= 1")
        if pad_to_multiple_of is not None and (not isinstance(pad_to_multiple_of, int) or pad_to_multiple_of < 1):
            raise ValueError(f"pad_to_multiple_of={pad_to_multiple_of!r}: expected an int >= 1 or None")
        if not isinstance(world_size, int) or world_size < 1 or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"rank={rank!r}, world_size={world_size!r}: expected 0 <= rank < world_size")
        if group_by_length and batching_strategy != "normal":
            raise ValueError(
                f"group_by_length applies to batching_strategy='normal' (got {batching_strategy!r}; "
                "the other strategies already avoid padding)"
            )
        if max_tokens is not None and batching_strategy not in TOKEN_BUDGET_STRATEGIES:
            raise ValueError(
                f"max_tokens applies to {' and '.join(TOKEN_BUDGET_STRATEGIES)} "
                f"(got batching_strategy={batching_strategy!r}; use micro_batch_size)"
            )
        self.dataset = dataset
        lengths = getattr(dataset, "lengths", None)
        if lengths is None:
            lengths = [len(dataset[i]["input_ids"]) for i in range(len(dataset))]
        self.lengths = np.asarray(lengths, dtype=np.int64)
        if len(self.lengths) == 0 or self.lengths.min() < 1:
            raise ValueError("BatchLoader: the dataset is empty or holds an empty example")
        self.strategy = batching_strategy
        self.micro_batch_size = micro_batch_size
        self.pad_token_id = pad_token_id
        self.pad_to_multiple_of = pad_to_multiple_of
        self.shuffle, self.seed, self.group_by_length, self.drop_last = shuffle, seed, group_by_length, drop_last
        self.rank, self.world_size = rank, world_size
        longest = int(self.lengths.max())
        if batching_strategy in TOKEN_BUDGET_STRATEGIES:
            # Default budget: what a normal micro batch of the longest examples would hold.
            max_tokens = (
                max_tokens if max_tokens is not None else micro_batch_size * _round_up(longest, pad_to_multiple_of)
            )
            if not isinstance(max_tokens, int) or max_tokens < longest:
                raise ConfigError(
                    f"max_tokens={max_tokens!r}: expected an int >= the longest example ({longest} "
                    "tokens); set it to at least cutoff_len"
                )
        self.max_tokens = max_tokens
        self.epoch = 0
        self._consumed = 0  # global micro batches of self.epoch already yielded (by all ranks together)
        self._plan_cache: tuple[int, list[np.ndarray]] | None = None
        if len(self) == 0:
            raise ConfigError(
                f"dataloader_drop_last: {len(self.lengths)} examples give no full micro batch of "
                f"{micro_batch_size} per rank with world_size={world_size}, and drop_last drops the "
                f"partial ones, so nothing would train; expected at least "
                f"{micro_batch_size * world_size} examples, a smaller per_device_train_batch_size, or "
                "dataloader_drop_last false"
            )

    @classmethod
    def from_args(
        cls,
        dataset,
        args,
        micro_batch_size: int,
        *,
        train: bool,
        pad_token_id: int = 0,
        rank: int = 0,
        world_size: int = 1,
    ) -> BatchLoader:
        """The loader TrainingArguments `args` ask for: for training, their batching strategy, token budget, shuffle,
        grouping and drop_last; for evaluation, normal batches in the dataset's order. The Trainer's loaders, and the
        CLI's check of the batch plan against the tokenised data before the model is built. Arguments that leave
        nothing to train (dataloader_drop_last with fewer examples than a batch, max_tokens under the longest
        example) are one-line ConfigErrors."""
        return cls(
            dataset,
            batching_strategy=args.batching_strategy if train else "normal",
            micro_batch_size=micro_batch_size,
            max_tokens=args.max_tokens if train else None,
            pad_token_id=pad_token_id,
            pad_to_multiple_of=args.pad_to_multiple_of,
            shuffle=train and args.train_shuffle,
            seed=args.data_seed if args.data_seed is not None else args.seed,
            group_by_length=train and args.group_by_length,
            drop_last=train and args.dataloader_drop_last,
            rank=rank,
            world_size=world_size,
        )

    # ---- planning ---------------------------------------------------------------------------------------------
    def _rng(self, epoch: int) -> np.random.Generator:
        return np.random.default_rng((self.seed, epoch))

    def global_batches(self, epoch: int) -> list[np.ndarray]:
        """The epoch's micro batches across all ranks, as arrays of example indices (before dealing)."""
        if self._plan_cache is not None and self._plan_cache[0] == epoch:
            return self._plan_cache[1]
        rng, n, lengths = self._rng(epoch), len(self.lengths), self.lengths
        if self.strategy in ("normal", "padding_free"):
            order = rng.permutation(n) if self.shuffle else np.arange(n)
            if self.group_by_length:
                order = self._group_by_length(order)
            mbs = self.micro_batch_size
            batches = [order[i : i + mbs] for i in range(0, n, mbs)]
            if self.drop_last and len(batches[-1]) < mbs:
                batches.pop()
            if self.group_by_length and batches:
                first = int(np.argmax([lengths[b].max() for b in batches]))
                batches[0], batches[first] = batches[first], batches[0]
        else:
            ties = rng.random(n) if self.shuffle else np.arange(n)
            if self.strategy == "dynamic_batching":
                order = np.lexsort((ties, lengths))  # ascending, so each new example sets the batch's width
                widths = [_round_up(w, self.pad_to_multiple_of) for w in lengths[order].tolist()]
                batches, start = [], 0
                for k in range(1, n + 1):
                    if k == n or (k + 1 - start) * widths[k] > self.max_tokens:
                        batches.append(order[start:k])
                        start = k
            else:
                order = np.lexsort((ties, -lengths))  # decreasing, as best-fit-decreasing wants
                batches = [order[b] for b in best_fit_decreasing(lengths[order].tolist(), self.max_tokens)]
            if self.shuffle:
                batches = [batches[i] for i in rng.permutation(len(batches))]
        self._plan_cache = (epoch, batches)
        return batches

    def _group_by_length(self, order: np.ndarray) -> np.ndarray:
        per_step = self.micro_batch_size * self.world_size
        # Small datasets still get at least ~4 megabatches, so grouping keeps some randomness (as HF does).
        mega = per_step * max(1, min(_MEGABATCH_MULT, len(order) // (per_step * 4)))
        chunks = [order[i : i + mega] for i in range(0, len(order), mega)]
        return np.concatenate([c[np.argsort(-self.lengths[c], kind="stable")] for c in chunks])

    def _deal(self, epoch: int, consumed: int) -> list[tuple[np.ndarray, bool]]:
        """This rank's remaining (example indices, is_padding) micro batches of `epoch` after `consumed` global ones."""
        plan = self.global_batches(epoch)
        rest = [(b, False) for b in plan[consumed:]]
        if self.drop_last:
            rest = rest[: len(rest) // self.world_size * self.world_size]
        else:
            need = -len(rest) % self.world_size
            rest += [(plan[i % len(plan)], True) for i in range(need)]
        return rest[self.rank :: self.world_size]

    def __len__(self) -> int:
        n = len(self.global_batches(self.epoch))
        return n // self.world_size if self.drop_last else -(-n // self.world_size)

    def global_batch_count(self) -> int:
        """Global micro batches in the current epoch (a resume under another number of processes compares steps)."""
        return len(self.global_batches(self.epoch))

    def epoch_batches(self, epoch: int | None = None) -> list[np.ndarray]:
        """This rank's micro batches of an epoch as example indices (padding batches included), for inspection."""
        return [b for b, _ in self._deal(self.epoch if epoch is None else epoch, 0)]

    # ---- iteration --------------------------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Start `epoch` from its beginning on the next iteration."""
        self.epoch, self._consumed = int(epoch), 0

    def __iter__(self) -> Iterator[dict]:
        if not self._deal(self.epoch, self._consumed):  # the previous epoch was fully yielded
            self.set_epoch(self.epoch + 1)
        epoch, start = self.epoch, self._consumed
        total = len(self.global_batches(epoch))
        for k, (indices, is_padding) in enumerate(self._deal(epoch, start)):
            batch = self.collate(indices, is_padding)
            # Count the batch as consumed before handing it out: a state_dict taken while the trainer holds it
            # must resume after it.
            self._consumed = min(total, start + (k + 1) * self.world_size)
            yield batch
        self.set_epoch(epoch + 1)

    def collate(self, indices: Sequence[int], is_padding: bool = False) -> dict:
        """The micro batch of these examples in this loader's format."""
        examples = [self.dataset[int(i)] for i in indices]
        if self.strategy in _PACKED:
            batch = self._collate_packed(examples)
        else:
            batch = self._collate_padded(examples)
        if is_padding:
            batch["labels"][:] = IGNORE_INDEX
        labels = batch["labels"]
        out = {k: torch.from_numpy(v.astype(np.int64)) for k, v in batch.items()}
        out["num_items"] = int((labels[:, 1:] != IGNORE_INDEX).sum())
        return out

    def _collate_padded(self, examples: list[dict]) -> dict:
        width = _round_up(max(len(ex["input_ids"]) for ex in examples), self.pad_to_multiple_of)
        rows = len(examples)
        input_ids = np.full((rows, width), self.pad_token_id, dtype=np.int64)
        labels = np.full((rows, width), IGNORE_INDEX, dtype=np.int64)
        attention_mask = np.zeros((rows, width), dtype=np.int64)
        for r, ex in enumerate(examples):
            n = len(ex["input_ids"])
            input_ids[r, :n] = ex["input_ids"]
            labels[r, :n] = ex["labels"]
            attention_mask[r, :n] = 1
        labels[:, 0] = IGNORE_INDEX
        position_ids = np.broadcast_to(np.arange(width, dtype=np.int64), (rows, width)).copy()
        return {
            "input_ids": input_ids,
            "labels": labels,
            "position_ids": position_ids,
            "attention_mask": attention_mask,
        }

    def _collate_packed(self, examples: list[dict]) -> dict:
        lengths = [len(ex["input_ids"]) for ex in examples]
        total = sum(lengths)
        width = _round_up(total, self.pad_to_multiple_of)
        input_ids = np.full(width, self.pad_token_id, dtype=np.int64)
        labels = np.full(width, IGNORE_INDEX, dtype=np.int64)
        attention_mask = np.zeros(width, dtype=np.int64)
        position_ids = np.empty(width, dtype=np.int64)
        start = 0
        for ex, n in zip(examples, lengths):
            input_ids[start : start + n] = ex["input_ids"]
            labels[start : start + n] = ex["labels"]
            labels[start] = IGNORE_INDEX  # the previous document's last position must not predict this token
            position_ids[start : start + n] = np.arange(n)
            start += n
        attention_mask[:total] = 1
        # Padding (only with pad_to_multiple_of) is one more document of its own, so positions restart there too.
        position_ids[total:] = np.arange(width - total)
        return {
            k: v[None, :]
            for k, v in (
                ("input_ids", input_ids),
                ("labels", labels),
                ("position_ids", position_ids),
                ("attention_mask", attention_mask),
            )
        }

    # ---- resume -----------------------------------------------------------------------------------------------
    def _config(self) -> dict:
        return {
            "batching_strategy": self.strategy,
            "micro_batch_size": self.micro_batch_size,
            "max_tokens": self.max_tokens,
            "pad_to_multiple_of": self.pad_to_multiple_of,
            "shuffle": self.shuffle,
            "seed": self.seed,
            "group_by_length": self.group_by_length,
            "drop_last": self.drop_last,
            "num_examples": len(self.lengths),
            "lengths_sha256": hashlib.sha256(self.lengths.tobytes()).hexdigest()[:16],
        }

    def state_dict(self) -> dict:
        """Where the iteration stands: the epoch, the global micro batches consumed, and what the plan depends on."""
        return {"epoch": self.epoch, "consumed": self._consumed, "world_size": self.world_size, **self._config()}

    def load_state_dict(self, state: dict) -> None:
        """Resume from `state_dict()`: the next iteration yields exactly the batches that were still to come."""
        mine = self._config()
        diffs = [f"{k} was {state.get(k)!r}, is {v!r}" for k, v in mine.items() if state.get(k) != v]
        if diffs:  # a user's choice of data or arguments, one line (exit 2 from the CLI)
            raise CheckpointError(
                "cannot resume the data loader: the batch plan would differ ("
                + "; ".join(diffs)
                + "); resume with the data and batching arguments the checkpoint was saved with "
                "(its training_args.json), or start again (--overwrite_output_dir)"
            )
        self.epoch, self._consumed = int(state["epoch"]), int(state["consumed"])
