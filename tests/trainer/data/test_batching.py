"""Batching strategies: shapes and padding, packed rows that never predict across documents, every example once
per epoch, determinism, exact mid-epoch resume (also under a new world size), rank sharding, group_by_length,
which layouts (world size x accumulation) give every optimizer step the same micro batches.

Example i of the synthetic dataset holds the token i + 1 everywhere (0 is the pad id), so every batch can be
decoded back into (example index, its input_ids, its labels) and checked against the dataset."""

import numpy as np
import pytest
import torch

from trainer.checkpoint_hf import CheckpointError
from trainer.coerce import ConfigError
from trainer.data.batching import BATCHING_STRATEGIES, BatchLoader, best_fit_decreasing, same_steps, steps_per_epoch
from trainer.data.sft_data import TokenizedDataset

IGN = -100


def make_dataset(n=60, seed=0, max_len=24):
    rng = np.random.default_rng(seed)
    examples = []
    for i in range(n):
        length = int(rng.integers(1, max_len + 1))
        ids = [i + 1] * length
        prompt = int(rng.integers(0, length))  # a masked prompt of random length, sometimes the whole example
        examples.append((ids, [IGN] * max(prompt, 1) + ids[max(prompt, 1) :]))
    return TokenizedDataset.from_examples(examples)


DS = make_dataset()


def loader(strategy, ds=DS, **kw):
    kw.setdefault("micro_batch_size", 4)
    if strategy in ("dynamic_batching", "dynamic_padding_free"):
        kw.setdefault("max_tokens", 64)
    return BatchLoader(ds, batching_strategy=strategy, **kw)


def documents(batch):
    """[(example index, input_ids, labels)] in a batch (padding batches included), checking the common format."""
    ids, labels, pos, mask = (batch[k] for k in ("input_ids", "labels", "position_ids", "attention_mask"))
    for t in (ids, labels, pos, mask):
        assert t.dtype == torch.long and t.shape == ids.shape and t.dim() == 2
    assert batch["num_items"] == int((labels[:, 1:] != IGN).sum())
    assert torch.all(ids[mask == 0] == 0) and torch.all(labels[mask == 0] == IGN)
    docs = []
    for r in range(ids.shape[0]):
        starts = [t for t in range(ids.shape[1]) if pos[r, t] == 0 and mask[r, t] == 1]
        ends = starts[1:] + [int(mask[r].sum())]
        for a, b in zip(starts, ends):
            assert pos[r, a:b].tolist() == list(range(b - a))
            docs.append((int(ids[r, a]) - 1, ids[r, a:b].tolist(), labels[r, a:b].tolist()))
    return docs


def check_docs_match_dataset(docs, ds=DS):
    for i, ids, labels in docs:
        assert ids == ds[i]["input_ids"].tolist()
        want = ds[i]["labels"].tolist()
        assert labels == [IGN] + want[1:]


def epoch_examples(ld):
    seen = []
    for batch in ld:
        docs = documents(batch)
        check_docs_match_dataset(docs)
        seen += [d[0] for d in docs]
    return seen


# ---- formats ------------------------------------------------------------------------------------------------
def test_normal_pads_to_longest_rounded_up():
    ld = loader("normal", pad_to_multiple_of=8)
    assert len(ld) == 15
    for batch in ld:
        ids, mask = batch["input_ids"], batch["attention_mask"]
        longest = int(mask.sum(1).max())
        assert ids.shape == (4, -(-longest // 8) * 8)
        assert torch.equal(batch["position_ids"], torch.arange(ids.shape[1]).expand_as(ids))
        assert all(mask[r, : int(mask[r].sum())].all() for r in range(4))  # right padding
        docs = documents(batch)
        assert len(docs) == 4
        check_docs_match_dataset(docs)


@pytest.mark.parametrize("strategy", ["padding_free", "dynamic_padding_free"])
def test_packed_rows_restart_positions_and_never_predict_across_documents(strategy):
    ld = loader(strategy)
    for batch in ld:
        ids, labels, pos = batch["input_ids"], batch["labels"], batch["position_ids"]
        assert ids.shape[0] == 1 and torch.all(batch["attention_mask"] == 1)  # no padding at all
        if strategy == "dynamic_padding_free":
            assert ids.shape[1] <= 64
        assert torch.all(labels[pos == 0] == IGN)  # each document's first token is not a target
        # The model's target for position t is labels[t + 1]: both must lie in the same document.
        t = torch.nonzero(labels[0, 1:] != IGN).flatten()
        assert torch.all(pos[0, t + 1] == pos[0, t] + 1)
        check_docs_match_dataset(documents(batch))


def test_packed_rows_with_pad_to_multiple_of():
    for batch in loader("padding_free", pad_to_multiple_of=64):
        n = int(batch["attention_mask"].sum())
        assert batch["input_ids"].shape[1] % 64 == 0
        pad_pos = batch["position_ids"][0, n:]
        assert torch.equal(pad_pos, torch.arange(len(pad_pos)))  # the padding is a document of its own
        check_docs_match_dataset(documents(batch))


def test_dynamic_batching_respects_the_budget_and_pads_less():
    dyn = loader("dynamic_batching", max_tokens=96, pad_to_multiple_of=8)
    pads_dyn = real = 0
    for batch in dyn:
        b, t = batch["input_ids"].shape
        assert b * t <= 96 and t % 8 == 0
        pads_dyn += int((batch["attention_mask"] == 0).sum())
        real += int(batch["attention_mask"].sum())
    assert real == int(DS.lengths.sum())
    # Same mean examples per batch with a plain shuffled sampler: many more pad tokens.
    mbs = round(len(DS) / len(dyn))
    normal = loader("normal", micro_batch_size=mbs, pad_to_multiple_of=8)
    pads_normal = sum(int((b["attention_mask"] == 0).sum()) for b in normal)
    assert pads_dyn * 2 < pads_normal  # measured 209 vs 609


def test_best_fit_decreasing_matches_a_plain_implementation():
    rng = np.random.default_rng(1)
    for _ in range(20):
        capacity = int(rng.integers(8, 64))
        items = sorted(rng.integers(1, capacity + 1, size=int(rng.integers(1, 80))).tolist(), reverse=True)
        bins = best_fit_decreasing(items, capacity)
        assert sorted(i for b in bins for i in b) == list(range(len(items)))
        loads = sorted(sum(items[i] for i in b) for b in bins)
        assert max(loads) <= capacity
        ref = []  # the textbook O(n * bins) version; equal-room ties may differ, the loads may not
        for x in items:
            fits = [k for k, load in enumerate(ref) if load + x <= capacity]
            if fits:
                k = min(fits, key=lambda k: capacity - ref[k])
                ref[k] += x
            else:
                ref.append(x)
        assert loads == sorted(ref)
    with pytest.raises(ValueError, match="does not fit"):
        best_fit_decreasing([9], 8)


# ---- epochs, determinism, resume -----------------------------------------------------------------------------
@pytest.mark.parametrize("strategy", BATCHING_STRATEGIES)
def test_every_example_once_per_epoch_and_deterministic(strategy):
    ld = loader(strategy, seed=5)
    first = epoch_examples(ld)
    assert sorted(first) == list(range(len(DS)))
    assert ld.epoch == 1
    second = epoch_examples(ld)  # the next `for` runs the next epoch, reshuffled
    assert sorted(second) == list(range(len(DS))) and second != first
    assert epoch_examples(loader(strategy, seed=5)) == first
    assert epoch_examples(loader(strategy, seed=6)) != first
    assert len(ld) == sum(1 for _ in ld)


@pytest.mark.parametrize("strategy", BATCHING_STRATEGIES)
@pytest.mark.parametrize("world_size", [1, 3])
def test_resume_mid_epoch_yields_exactly_the_remaining_batches(strategy, world_size):
    def run(ld, n):
        it = iter(ld)
        return [next(it) for _ in range(n)]

    for rank in range(world_size):
        ref = loader(strategy, seed=2, rank=rank, world_size=world_size)
        full = [documents(b) for b in ref] + [documents(b) for b in ref]  # two epochs
        ld = loader(strategy, seed=2, rank=rank, world_size=world_size)
        k = len(ld) // 2
        head = run(ld, k)
        state = ld.state_dict()
        resumed = loader(strategy, seed=2, rank=rank, world_size=world_size)
        resumed.load_state_dict(state)
        rest = [documents(b) for b in resumed] + [documents(b) for b in resumed]
        assert [documents(b) for b in head] + rest == full[:k] + full[k:]
        assert len(rest) == len(full) - k


def test_state_at_the_end_of_an_epoch_resumes_with_the_next():
    ld = loader("normal")
    it = iter(ld)
    for _ in range(len(ld)):
        next(it)  # all of epoch 0 handed out, the generator not yet exhausted
    resumed = loader("normal")
    resumed.load_state_dict(ld.state_dict())
    ref = loader("normal")
    ref.set_epoch(1)
    assert [documents(b) for b in resumed] == [documents(b) for b in ref]
    assert resumed.epoch == 2


def test_resume_under_a_different_world_size_consumes_each_example_once():
    ld = [loader("normal", seed=1, rank=r, world_size=2) for r in range(2)]
    its = [iter(x) for x in ld]
    seen = [d[0] for _ in range(3) for it in its for d in documents(next(it))]  # 3 steps on 2 ranks
    state = ld[0].state_dict()
    assert state == ld[1].state_dict() and state["consumed"] == 6
    for rank in range(3):
        ld3 = loader("normal", seed=1, rank=rank, world_size=3)
        ld3.load_state_dict(state)
        seen += [d[0] for b in ld3 if b["num_items"] for d in documents(b)]
    assert sorted(seen) == list(range(len(DS)))


def test_load_state_dict_refuses_a_different_plan():
    """A CheckpointError (one line, exit 2 from the CLI; was a ValueError traceback, issue 21 item 10) saying how to
    resume."""
    state = loader("normal", seed=1).state_dict()
    with pytest.raises(
        CheckpointError,
        match=r"seed was 1, is 2\); resume with the data and batching arguments the "
        r"checkpoint was saved with \(its training_args.json\)",
    ):
        loader("normal", seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="batching_strategy was 'normal', is 'padding_free'"):
        loader("padding_free", seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="lengths_sha256"):
        loader("normal", ds=make_dataset(seed=9), seed=1).load_state_dict(state)


# ---- data parallel ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("strategy", BATCHING_STRATEGIES)
def test_ranks_get_disjoint_complete_equal_shares(strategy):
    ws = 4
    loaders = [loader(strategy, seed=3, rank=r, world_size=ws) for r in range(ws)]
    per_rank = [[documents(b) + [("num_items", b["num_items"])] for b in ld] for ld in loaders]
    assert len({len(p) for p in per_rank}) == 1 and len(per_rank[0]) == len(loaders[0])
    seen, padding = [], 0
    for step in zip(*per_rank):
        step_examples = [d[0] for batch in step for d in batch[:-1] if batch[-1][1] > 0]
        assert len(step_examples) == len(set(step_examples))  # disjoint within a global step
        seen += step_examples
        padding += sum(1 for batch in step if batch[-1][1] == 0)
    n_global = len(loaders[0].global_batches(0))
    assert sorted(seen) == list(range(len(DS)))  # complete: tail padding only repeats with labels masked
    assert padding == -n_global % ws
    # drop_last: the tail that does not fill a step is left out, nothing repeats.
    dropped = [loader(strategy, seed=3, rank=r, world_size=ws, drop_last=True) for r in range(ws)]
    got = [d[0] for ld in dropped for b in ld for d in documents(b)]
    assert len(got) == len(set(got)) and len(dropped[0]) == n_global // ws


def test_padding_batches_have_no_targets():
    ws = 7  # 60 examples / 4 = 15 micro batches -> 6 padding ones
    batches = [b for r in range(ws) for b in loader("normal", rank=r, world_size=ws)]
    pads = [b for b in batches if b["num_items"] == 0]
    assert len(pads) == 6 and all(torch.all(b["labels"] == IGN) for b in pads)


def test_rank_arguments_are_checked():
    with pytest.raises(ValueError, match="rank=2, world_size=2"):
        loader("normal", rank=2, world_size=2)
    with pytest.raises(
        ConfigError, match="dataloader_drop_last: 3 examples give no full micro batch of 1 per rank with world_size=4"
    ):
        BatchLoader(make_dataset(n=3), micro_batch_size=1, world_size=4, drop_last=True)


# ---- group_by_length, eval order, options -------------------------------------------------------------------
def test_group_by_length_sorts_megabatches_longest_first_and_pads_less():
    ds = make_dataset(n=400, seed=4, max_len=64)
    ld = BatchLoader(ds, micro_batch_size=2, group_by_length=True, seed=0)
    batches = ld.global_batches(0)
    assert ds.lengths[batches[0]].max() == ds.lengths.max()
    lengths = [ds.lengths[b].max() for b in batches[1:]]
    mega = 2 * 50  # 400 // (2 * 4) = 50 micro batches per megabatch
    # Inside a megabatch the batches come in decreasing length (the first megabatch lost its head to the swap).
    for start in range(mega // 2, len(lengths), mega // 2):
        chunk = lengths[start : start + mega // 2 - 1]
        assert chunk == sorted(chunk, reverse=True)
    pads = lambda ld: sum(int((b["attention_mask"] == 0).sum()) for b in ld)  # noqa: E731
    assert pads(ld) * 5 < pads(BatchLoader(ds, micro_batch_size=2, seed=0))
    again = BatchLoader(ds, micro_batch_size=2, group_by_length=True, seed=0)
    assert all(np.array_equal(a, b) for a, b in zip(again.global_batches(0), batches))
    assert sorted(np.concatenate(batches).tolist()) == list(range(400))
    with pytest.raises(ValueError, match="group_by_length applies to batching_strategy='normal'"):
        BatchLoader(ds, batching_strategy="padding_free", group_by_length=True)


def test_eval_loader_keeps_dataset_order():
    assert epoch_examples(loader("normal", shuffle=False)) == list(range(len(DS)))
    assert epoch_examples(loader("padding_free", shuffle=False)) == list(range(len(DS)))
    # Token-budget strategies read the examples in length order when not shuffling; still each exactly once.
    once = epoch_examples(loader("dynamic_padding_free", shuffle=False))
    assert sorted(once) == list(range(len(DS))) and once == epoch_examples(
        loader("dynamic_padding_free", shuffle=False)
    )


def test_normal_drop_last_and_small_last_batch():
    assert [b["input_ids"].shape[0] for b in loader("normal", micro_batch_size=7)][-1] == 60 % 7
    dropped = loader("normal", micro_batch_size=7, drop_last=True)
    assert len(dropped) == 8 and all(b["input_ids"].shape[0] == 7 for b in dropped)


def test_option_errors_name_the_argument():
    with pytest.raises(ConfigError, match="max_tokens=10: expected an int >= the longest example"):
        loader("dynamic_padding_free", max_tokens=10)
    with pytest.raises(ValueError, match="max_tokens applies to"):
        loader("normal", max_tokens=64)
    with pytest.raises(ValueError, match="batching_strategy='packed'"):
        loader("packed")
    # Without max_tokens the budget is what a normal micro batch of the longest examples holds.
    assert BatchLoader(DS, batching_strategy="dynamic_batching", micro_batch_size=4).max_tokens == 4 * 24


def test_works_on_a_plain_list_of_examples():
    data = [{"input_ids": [5, 6, 7], "labels": [IGN, 6, 7]}, {"input_ids": [8, 9], "labels": [IGN, IGN]}]
    (batch,) = list(BatchLoader(data, micro_batch_size=2, shuffle=False))
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 9, 0]] and batch["num_items"] == 2


@pytest.mark.parametrize("drop_last", [False, True])
def test_same_steps_says_exactly_when_two_layouts_give_each_step_the_same_batches(drop_last):
    """Brute force over epochs of 1-30 micro batches and layouts with equal world_size x accumulation: deal the plan
    to every rank, cut each rank's share into steps as the Trainer does (`accum` per step, at least one step, the
    leftovers in the last), and compare the real (non-filler) micro batches of each step."""

    def steps(n, world_size, accum):
        ranks = [
            BatchLoader(
                [{"input_ids": [1], "labels": [1]}] * n,
                micro_batch_size=1,
                shuffle=False,
                drop_last=drop_last,
                rank=r,
                world_size=world_size,
            )._deal(0, 0)
            for r in range(world_size)
        ]
        per_rank, count = len(ranks[0]), steps_per_epoch(n, world_size, accum, drop_last)
        assert count == max(per_rank // accum, 1)
        return [
            sorted(
                int(b[0])
                for share in ranks
                for b, filler in share[k * accum : (k + 1) * accum if k < count - 1 else per_rank]
                if not filler
            )
            for k in range(count)
        ]

    layouts = [(1, 4), (2, 2), (4, 1), (1, 6), (2, 3), (3, 2), (6, 1)]
    verdicts = []
    for n in range(6 if drop_last else 1, 31):
        for a in layouts:
            for b in layouts:
                if a[0] * a[1] == b[0] * b[1]:
                    same = steps(n, *a) == steps(n, *b)
                    assert same_steps(n, drop_last, a, b) == same, (n, a, b)
                    verdicts.append(same)
    assert any(verdicts) and not all(verdicts)  # both answers occur
