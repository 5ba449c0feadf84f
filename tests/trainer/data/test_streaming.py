"""Streamed SFT data (issue 32 item 5): a stream tokenises as files do and, in one buffer, batches as the in-memory
loader does; its global micro batches do not depend on the number of processes; a loader restored from its state
anywhere (mid-buffer, at a pass end, with a mixture) yields exactly the rest, on the same or another number of
processes; the Trainer resumed from a checkpoint equals the unbroken run bit for bit; bad input is one line."""

import json

import pytest
import torch

from tests.trainer.data.test_hf_datasets import small_model
from trainer.checkpoint_hf import CheckpointError
from trainer.coerce import ConfigError
from trainer.config.args import TrainingArguments
from trainer.data.batching import BatchLoader
from trainer.data.sft_data import DataError, load_sft_dataset
from trainer.data.streaming import SFTStream, StreamLoader
from trainer.data.tasks import generate_tasks
from trainer.data.tokenizer import byte_level_tokenizer
from trainer.loop.trainer import Trainer

datasets = pytest.importorskip("datasets")  # an optional extra (kernelwright[datasets])

STRATEGIES = ["normal", "padding_free", "dynamic_batching", "dynamic_padding_free"]


@pytest.fixture(scope="module")
def tok():
    return byte_level_tokenizer()


def records(n: int, seed: int = 0) -> list[dict]:
    return generate_tasks(n, seed=seed)


def write_shards(directory, recs, shards: int) -> list[str]:
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for s in range(shards):
        path = directory / f"part-{s}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in recs[s::shards]))
        paths.append(str(path))
    return paths


def loader(stream, rank=0, world_size=1, strategy="normal", buffer=16, micro=2, length=1000, **kw) -> StreamLoader:
    return StreamLoader(
        stream,
        micro_batches_per_rank=length,
        batching_strategy=strategy,
        micro_batch_size=micro,
        max_tokens=kw.pop("max_tokens", 256 if strategy.startswith("dynamic") else None),
        seed=3,
        rank=rank,
        world_size=world_size,
        packing_buffer=buffer,
        **kw,
    )


def take(iterator, n: int) -> list[dict]:
    return [next(iterator) for _ in range(n)]


def same(a: list[dict], b: list[dict]) -> bool:
    keys = ("input_ids", "labels", "position_ids", "attention_mask")
    return len(a) == len(b) and all(
        x["num_items"] == y["num_items"] and all(torch.equal(x[k], y[k]) for k in keys) for x, y in zip(a, b)
    )


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_one_buffer_batches_as_the_in_memory_loader_does_the_file(tmp_path, tok, strategy):
    """Three passes over a stream that fits in one buffer: the in-memory loader's three epochs (pass p's buffer is
    planned as epoch p)."""
    recs = records(40)
    (path,) = write_shards(tmp_path, recs, 1)
    in_memory = load_sft_dataset([path], tok, cutoff_len=64, show_progress=False)
    stream = SFTStream([recs], tok, cutoff_len=64)
    kw = dict(micro_batch_size=2, max_tokens=256 if strategy.startswith("dynamic") else None, seed=3)
    planner, want = BatchLoader(in_memory, batching_strategy=strategy, **kw), []
    for epoch in range(3):
        planner.set_epoch(epoch)
        want += list(planner)
    got = take(iter(loader(stream, strategy=strategy, buffer=len(recs))), len(want))
    assert same(got, want)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_global_micro_batches_do_not_depend_on_the_number_of_processes(tok, strategy):
    stream = SFTStream([records(30)], tok, cutoff_len=64)  # buffers of 7: several per pass, passes end mid-buffer
    one = take(iter(loader(stream, strategy=strategy, buffer=7)), 24)
    ranks = [iter(loader(stream, rank=r, world_size=2, strategy=strategy, buffer=7)) for r in range(2)]
    two = [next(ranks[i % 2]) for i in range(24)]
    assert same(two, one)


@pytest.mark.parametrize("strategy", ["normal", "dynamic_padding_free"])
@pytest.mark.parametrize("stop", [1, 3, 4, 9, 13])
def test_a_restored_loader_yields_exactly_the_rest(tok, strategy, stop):
    stream = SFTStream([records(30)], tok, cutoff_len=64)
    unbroken = take(iter(loader(stream, strategy=strategy, buffer=7)), 20)
    first = loader(stream, strategy=strategy, buffer=7)
    assert same(take(iter(first), stop), unbroken[:stop])
    state = json.loads(json.dumps(first.state_dict()))  # as data_state.json holds it
    again = loader(stream, strategy=strategy, buffer=7)
    again.load_state_dict(state)
    assert same(take(iter(again), 20 - stop), unbroken[stop:])


@pytest.mark.parametrize("saved, resumed", [(1, 2), (2, 1), (2, 2)])
def test_a_resume_under_another_number_of_processes_takes_the_same_batches(tok, saved, resumed):
    """Saved at a step boundary (4 global micro batches a step: 1 x 4 or 2 x 2), resumed under the other layout."""
    stream = SFTStream([records(30)], tok, cutoff_len=64)
    unbroken = take(iter(loader(stream, strategy="padding_free", buffer=7)), 24)
    ranks = [loader(stream, rank=r, world_size=saved, strategy="padding_free", buffer=7) for r in range(saved)]
    iters = [iter(ld) for ld in ranks]
    for _ in range(3):  # three steps
        for it in iters:
            take(it, 4 // saved)
    state = json.loads(json.dumps(ranks[0].state_dict()))
    after = [loader(stream, rank=r, world_size=resumed, strategy="padding_free", buffer=7) for r in range(resumed)]
    for ld in after:
        ld.load_state_dict(state)
    iters = [iter(ld) for ld in after]
    rest = [next(iters[i % resumed]) for i in range(12)]
    assert same(rest, unbroken[12:])


def test_hf_iterable_shards_resume_from_their_own_state(tmp_path, tok):
    recs = records(45)
    paths = write_shards(tmp_path / "json", recs, 3)

    def stream():
        source = datasets.load_dataset("json", data_files=paths, split="train", streaming=True)
        return SFTStream([source], tok, cutoff_len=64, names=["shards"])

    unbroken = take(iter(loader(stream(), buffer=10)), 30)  # 45 examples, 2 per micro batch: a pass and more
    first = loader(stream(), buffer=10)
    take(iter(first), 13)
    state = json.loads(json.dumps(first.state_dict()))
    assert state["buffer_start"]["sources"][0]["state"] is not None  # the source's own state, not a count
    again = loader(stream(), buffer=10)
    again.load_state_dict(state)
    assert same(take(iter(again), 17), unbroken[13:])
    # the same records read from a list (reopened by count) give the same examples
    assert same(
        take(
            iter(
                loader(
                    SFTStream(
                        [list(datasets.concatenate_datasets([datasets.Dataset.from_json(p) for p in paths]))],
                        tok,
                        cutoff_len=64,
                        names=["shards"],
                    ),
                    buffer=10,
                )
            ),
            30,
        ),
        unbroken,
    )


@pytest.mark.parametrize(
    "strategy, probs",
    [("concat", None), ("interleave_under", None), ("interleave_over", [0.7, 0.3]), ("interleave_under", [0.5, 0.5])],
)
def test_a_weighted_mixture_resumes_exactly(tmp_path, tok, strategy, probs):
    a, b = records(20, seed=1), records(9, seed=2)
    parquet = tmp_path / "b.parquet"
    datasets.Dataset.from_list(b).to_parquet(str(parquet))

    def stream():
        second = datasets.load_dataset("parquet", data_files=str(parquet), split="train", streaming=True)
        return SFTStream([a, second], tok, cutoff_len=64, mix_strategy=strategy, interleave_probs=probs, seed=5)

    unbroken = take(iter(loader(stream(), buffer=6)), 40)
    for stop in (5, 17):
        first = loader(stream(), buffer=6)
        take(iter(first), stop)
        again = loader(stream(), buffer=6)
        again.load_state_dict(json.loads(json.dumps(first.state_dict())))
        assert same(take(iter(again), 40 - stop), unbroken[stop:])


def test_tokenized_rows_stream_as_they_are(tok):
    recs = records(12)
    stream = SFTStream([recs], tok, cutoff_len=64)
    examples = [ex for _, ex in zip(range(12), _examples(stream))]
    rows = [{"input_ids": ids.tolist(), "labels": labels.tolist()} for ids, labels in examples]
    tokens = datasets.Dataset.from_list(rows).to_iterable_dataset(num_shards=3)
    want = take(iter(loader(stream, buffer=12)), 6)
    got = take(iter(loader(SFTStream([tokens]), buffer=12)), 6)
    assert same(got, want)


def _examples(stream):
    reader = stream.examples(stream.start())
    while (ex := reader.next()) is not None:
        yield ex


def run(out, train_dataset, tok, resume=None, **kw):
    args = TrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=6,
        learning_rate=1e-2,
        logging_steps=1,
        save_steps=3,
        report_to=[],
        disable_tqdm=True,
        seed=7,
        optim="adamw_torch",
        packing_buffer=5,
        batching_strategy="padding_free",
        **kw,
    )
    trainer = Trainer(model=small_model(), args=args, train_dataset=train_dataset, processing_class=tok)
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def test_the_trainer_resumed_from_a_checkpoint_equals_the_unbroken_run(tmp_path, tok):
    recs = records(13)  # 13 examples in buffers of 5, 4 a step: the run reads the stream almost twice
    unbroken = run(tmp_path / "a", SFTStream([recs], tok, cutoff_len=64), tok)
    resumed = run(tmp_path / "b", SFTStream([recs], tok, cutoff_len=64), tok, resume=str(tmp_path / "a/checkpoint-3"))
    want = [h["loss"] for h in unbroken.state.log_history if "loss" in h]
    got = [h["loss"] for h in resumed.state.log_history if "loss" in h]
    assert len(want) == 6 and got == want  # the resumed history holds the first three from the checkpoint
    for (name, p), q in zip(unbroken.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(p, q), name
    state = json.loads((tmp_path / "a/checkpoint-3/data_state.json").read_text())
    assert state["streaming"] and state["consumed"] == 6  # 3 steps x 2 micro batches


def test_bad_streams_are_one_line(tmp_path, tok):
    raw = datasets.Dataset.from_list(records(4)).to_iterable_dataset()
    args = TrainingArguments(output_dir=str(tmp_path / "out"), report_to=[], disable_tqdm=True)
    trainer = Trainer(model=small_model(), args=args, train_dataset=SFTStream([records(4)], tok))
    with pytest.raises(ConfigError, match=r"^max_steps: must be set \(> 0\) when the training data"):
        trainer.train()
    with pytest.raises(DataError, match=r"^train_dataset: raw rows \(columns \['messages'\]\) and no processing_class"):
        Trainer(model=small_model(), args=args, train_dataset=raw)
    with pytest.raises(DataError, match=r"^stream: cannot tell the data format from the columns \['x'\]"):
        SFTStream([[{"x": 1}]], tok)
    with pytest.raises(DataError, match=r"^stream: no rows"):
        SFTStream([[]], tok)
    with pytest.raises(DataError, match=r"^interleave_probs=\[0.5\]: expected one probability >= 0 per source"):
        SFTStream([records(2), records(2)], tok, mix_strategy="interleave_under", interleave_probs=[0.5])
    stream = SFTStream([[{"messages": [{"role": "user", "content": "hi"}]}] * 3], tok)  # nothing to train on
    with pytest.raises(DataError, match=r"a whole pass over the stream gave no usable example"):
        next(iter(loader(stream)))
    bad = SFTStream([records(3) + [{"messages": "oops"}]], tok)
    with pytest.raises(DataError, match=r"^stream\[3\]: "):
        take(iter(loader(bad, buffer=4)), 2)
    older = {k: v for k, v in loader(SFTStream([records(4)], tok)).state_dict().items() if k != "plan_key"}
    with pytest.raises(CheckpointError, match=r"^cannot resume the data loader: .*\(plan_key was None, is 'buffer"):
        loader(SFTStream([records(4)], tok)).load_state_dict(older)  # a stream planned before PLAN_KEY
