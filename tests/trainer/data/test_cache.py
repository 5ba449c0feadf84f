"""The shared data cache (trainer/data/cache.py, issue 32 item 4): where its root is, one tokenisation for every run
and rank (a second load from elsewhere reads it; of two processes loading at once one tokenises, the other waits and
reads), entries memory-mapped (RSS does not grow with the dataset), and a failed load leaves the cache as it was."""

import json
import multiprocessing
import os
import sys
import tempfile
import time
import tracemalloc

import numpy as np
import pytest

from trainer.coerce import ConfigError
from trainer.data import cache
from trainer.data.batching import BatchLoader
from trainer.data.cache import CACHE_ENV, LOAD_KEYS, ArrayWriter, cache_root, check_cache_root
from trainer.data.sft_data import DataError, TokenizedDataset, load_sft_dataset
from trainer.data.tokenizer import Tokenizer, byte_level_tokenizer

RECORD = {"messages": [{"role": "user", "content": "reverse: abc"}, {"role": "assistant", "content": "cba"}]}
OTHER = {"messages": [{"role": "user", "content": "sort: cab"}, {"role": "assistant", "content": "abc"}]}
NO_ANSWER = {"messages": [{"role": "user", "content": "hello"}]}  # dropped: nothing to train on


class CountingTokenizer(Tokenizer):
    """Counts its tokenisations; `delay` seconds each, so that two processes overlap."""

    calls = 0
    delay = 0.0

    def encode_with_offsets(self, text):
        CountingTokenizer.calls += 1
        time.sleep(CountingTokenizer.delay)
        return super().encode_with_offsets(text)


def counting_tok():
    base = byte_level_tokenizer()
    return CountingTokenizer(
        base.backend, eos_token=base.eos_token, pad_token=base.pad_token, chat_template=base.chat_template
    )


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def entries(root):
    return sorted(p for p in root.iterdir() if p.is_dir())


def test_the_root_is_the_argument_else_the_environment_else_the_users_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "env"))
    assert cache_root(tmp_path / "flag") == tmp_path / "flag"
    assert cache_root() == tmp_path / "env"
    monkeypatch.delenv(CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "kernelwright" / "data"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "kernelwright" / "data"


def test_the_test_suite_never_uses_the_users_cache(tmp_path):
    """tests/conftest.py points the environment variable at a temporary directory, for every test."""
    assert cache_root().parent == tmp_path.parent  # pytest's temporary tree, beside this test's tmp_path


def test_a_root_that_cannot_be_written_is_one_line(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match=r"^data_cache_dir: .*file is a file, not a directory"):
        check_cache_root(tmp_path / "file" / "cache")
    check_cache_root(tmp_path / "new" / "cache")  # created when first written
    assert not (tmp_path / "new").exists()
    if os.geteuid() != 0:  # root writes anywhere
        (tmp_path / "ro").mkdir(mode=0o500)
        with pytest.raises(ConfigError, match=r"cannot be written \(no write permission on .*ro\)"):
            check_cache_root(tmp_path / "ro" / "cache")


def test_a_second_load_from_another_process_reads_the_entry_memory_mapped(tmp_path):
    """Another run (here a fresh tokenizer and load, as another output_dir's run has) hits: no tokenisation, equal
    arrays, memory-mapped read-only, and the BatchLoader's batches are the same as from the arrays in memory."""
    f = write_jsonl(tmp_path / "d.jsonl", [RECORD, OTHER, RECORD])
    root = tmp_path / "cache"
    CountingTokenizer.calls, CountingTokenizer.delay = 0, 0.0
    first = load_sft_dataset(f, counting_tok(), cache_dir=root, show_progress=False)
    calls = CountingTokenizer.calls
    again = load_sft_dataset(f, counting_tok(), cache_dir=root, show_progress=False)
    assert CountingTokenizer.calls == calls and again.summary["cache_hit"] and not first.summary["cache_hit"]
    assert [p.name for p in entries(root)] == [os.path.basename(first.summary["cache"])]
    for name in ("input_ids", "labels", "offsets"):
        array = getattr(again, name)
        assert isinstance(array, np.memmap) and not array.flags.writeable
        assert isinstance(getattr(first, name), np.memmap)  # the tokenising process reads its entry back, mapped
        assert np.array_equal(array, getattr(first, name))
    assert {k: v for k, v in first.summary.items() if k != "cache_hit"} == {
        k: v for k, v in again.summary.items() if k != "cache_hit"
    }
    size = first.summary["cache_bytes"]
    assert size == again.summary["cache_bytes"] == sum(a.nbytes for a in first.arrays().values())
    assert f"\n  cache miss {size / 1e3:.1f} kB {first.summary['cache']}" in first.summary_text()
    assert f"\n  cache hit {size / 1e3:.1f} kB {first.summary['cache']}" in again.summary_text()
    batches = [list(BatchLoader(ds, micro_batch_size=2, shuffle=False)) for ds in (first, again)]
    for a, b in zip(*batches, strict=True):
        assert all((a[k] == b[k]).all() for k in ("input_ids", "labels", "attention_mask"))


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_loading_a_large_entry_does_not_grow_rss_by_its_size(tmp_path):
    """A 64 MB entry (8M tokens): loading it maps the files; RSS grows by the pages read (one example), not 64 MB."""
    n, length = 8 << 20, 1024
    offsets = np.arange(0, n + 1, length, dtype=np.int64)
    TokenizedDataset(np.ones(n, np.int32), np.full(n, 5, np.int32), offsets, {"examples": n // length}).save(
        tmp_path / "entry"
    )
    before = _rss()
    ds = TokenizedDataset.load(tmp_path / "entry")
    example = ds[len(ds) // 2]
    grown = _rss() - before
    assert int(example["labels"].sum()) == 5 * length and len(ds) == n // length
    assert grown < 8 << 20, f"RSS grew by {grown / 1e6:.1f} MB loading a {2 * n * 4 / 1e6:.0f} MB entry"


def _load_at_once(path, root, barrier, results):
    """One of the processes of the concurrency test: load `path` when every process is ready."""
    CountingTokenizer.calls, CountingTokenizer.delay = 0, 0.05
    tok = counting_tok()
    barrier.wait(timeout=60)  # a peer that died before the barrier breaks it instead of leaving this one waiting
    ds = load_sft_dataset(path, tok, cache_dir=root, show_progress=False)
    results.put((CountingTokenizer.calls, ds.summary["cache_hit"], ds.input_ids.tolist(), ds.labels.tolist()))


def test_processes_loading_the_same_data_at_once_tokenise_it_once(tmp_path):
    """Two processes (spawned, as ranks are) miss the same entry at the same moment: one tokenises and writes it
    under the entry's lock, the other waits and reads it; one entry, equal arrays, no temporary left behind."""
    f = write_jsonl(tmp_path / "d.jsonl", [RECORD] * 6)
    root = tmp_path / "cache"
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_load_at_once, args=(f, root, barrier, results), daemon=True) for _ in range(2)]
    for p in procs:
        p.start()
    got = sorted(results.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    (hit_calls, hit, *hit_arrays), (miss_calls, miss, *miss_arrays) = got
    assert (hit_calls, hit) == (0, True) and miss_calls == 6 and miss is False
    assert hit_arrays == miss_arrays
    assert len(entries(root)) == 1 and not [p for p in root.iterdir() if p.name.startswith(".")]


def test_a_failed_load_leaves_the_cache_as_it_was(tmp_path):
    """A load that fails (a bad record, after another dataset was cached; a write that fails half way) leaves every
    entry as it was and no temporary directory."""
    root = tmp_path / "cache"
    load_sft_dataset(
        write_jsonl(tmp_path / "good.jsonl", [RECORD]), counting_tok(), cache_dir=root, show_progress=False
    )
    before = {p.relative_to(root): p.read_bytes() for p in root.rglob("*") if p.is_file()}
    (tmp_path / "bad.jsonl").write_text(json.dumps(RECORD) + "\n{oops\n")
    with pytest.raises(DataError, match="bad.jsonl:2: invalid JSON"):
        load_sft_dataset(tmp_path / "bad.jsonl", counting_tok(), cache_dir=root, show_progress=False)
    appends = []

    def append_until_full(self, values):  # the disk fills up half way through the arrays
        appends.append(len(values))
        if len(appends) == 4:
            raise OSError("disk full")
        return append(self, values)

    with pytest.MonkeyPatch.context() as mp:
        append = ArrayWriter.append
        mp.setattr(ArrayWriter, "append", append_until_full)
        with pytest.raises(OSError, match="disk full"):
            load_sft_dataset(
                write_jsonl(tmp_path / "other.jsonl", [RECORD] * 2), counting_tok(), cache_dir=root, show_progress=False
            )
    after = {p.relative_to(root): p.read_bytes() for p in root.rglob("*") if p.is_file() and p.suffix != ".lock"}
    assert after == {k: v for k, v in before.items() if k.suffix != ".lock"} and len(entries(root)) == 1


def test_small_write_buffers_give_the_same_dataset(tmp_path, monkeypatch):
    """The arrays are written through buffers of `cache.WRITE_BUFFER` bytes: buffers of a few values give the arrays
    and summary of one buffer for all, with a cache entry and without (a temporary directory, removed once mapped)."""
    f = write_jsonl(tmp_path / "d.jsonl", [RECORD, OTHER, RECORD, NO_ANSWER] * 5)
    monkeypatch.setattr(cache, "WRITE_BUFFER", 1 << 30)
    whole = load_sft_dataset(f, counting_tok(), data_format="auto", cache_dir=tmp_path / "a", show_progress=False)
    monkeypatch.setattr(cache, "WRITE_BUFFER", 8)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    small = load_sft_dataset(f, counting_tok(), cache_dir=tmp_path / "b", show_progress=False)
    uncached = load_sft_dataset(f, counting_tok(), cache_dir=None, show_progress=False)
    assert len(whole) == 15 and (whole.summary["examples_read"], whole.summary["dropped"]) == (20, {"no_targets": 5})
    for ds in (small, uncached):
        for name, array in whole.arrays().items():
            assert isinstance(ds.arrays()[name], np.memmap) and np.array_equal(ds.arrays()[name], array), name
        assert {k: v for k, v in ds.summary.items() if k not in LOAD_KEYS} == {
            k: v for k, v in whole.summary.items() if k not in LOAD_KEYS
        }
    assert list((tmp_path / "tmp").iterdir()) == []  # the uncached arrays live on in the mapping only
    assert uncached[14]["input_ids"].tolist() == whole[14]["input_ids"].tolist()


def _traced_peak(tmp_path, n: int) -> int:
    """The peak of the memory Python and numpy allocate (tracemalloc) while `n` conversations are tokenised anew."""
    record = {"messages": [{"role": "user", "content": "x" * 150}, {"role": "assistant", "content": "y" * 150}]}
    f = write_jsonl(tmp_path / f"{n}.jsonl", [record] * n)
    tok = byte_level_tokenizer()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        ds = load_sft_dataset(f, tok, cache_dir=tmp_path / f"cache-{n}", show_progress=False)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert len(ds) == n and ds.summary["tokens"] == 321 * n
    return peak


def test_a_cold_load_does_not_hold_the_arrays_in_memory(tmp_path, monkeypatch):
    """Tokenising 10x the conversations (321 tokens each: 2.6 kB of arrays, 7.7 MB for 3,000) grows the memory
    allocated at the peak by far less than their arrays: they go to the entry's files as they come, through buffers of
    a fixed size, and the dataset maps the entry (gathering them in memory would add 2x the arrays: ~14 MB)."""
    monkeypatch.setattr(cache, "WRITE_BUFFER", 1 << 16)
    small, large = _traced_peak(tmp_path, 300), _traced_peak(tmp_path, 3000)
    arrays = 2 * 4 * 321 * (3000 - 300)
    assert large - small < arrays / 4, f"peak {small / 1e6:.1f} MB at 300 conversations, {large / 1e6:.1f} MB at 3000"
