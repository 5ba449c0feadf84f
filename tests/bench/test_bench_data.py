"""bench/bench_data.py: the synthetic set's shape, and the whole bench end to end at 200 conversations (TRL skipped;
with TRL in the slow test), its rows holding the figures of one run and its targets computed from them."""

from __future__ import annotations

import json

import numpy as np
import pytest

from bench import bench_data


def test_the_set_is_seeded_and_shaped_like_sharegpt():
    words = bench_data.vocabulary(0)
    assert len(set(words)) == bench_data.VOCAB_WORDS
    a, b = bench_data.conversations(2000, 0, words), bench_data.conversations(2000, 0, words)
    assert a == b and a != bench_data.conversations(2000, 1, words)
    exchanges = [sum(m["role"] == "assistant" for m in r["messages"]) for r in a]
    assert np.median(exchanges) == 2 and 1 <= min(exchanges) and max(exchanges) <= 40 and max(exchanges) >= 8
    answers = [len(m["content"].split()) for r in a for m in r["messages"] if m["role"] == "assistant"]
    assert 40 <= np.median(answers) <= 80 and min(answers) >= 2 and max(answers) <= 600 and max(answers) >= 300
    for r in a:  # system first when there is one, then user / assistant alternating
        roles = [m["role"] for m in r["messages"] if m["role"] != "system"]
        assert roles == ["user", "assistant"] * (len(roles) // 2) and all(m["content"] for m in r["messages"])
    assert bench_data.shard_counts(25) == [3] * 5 + [2] * 5
    assert len(bench_data.shard_counts(1_000_000)) == 100 and sum(bench_data.shard_counts(1_000_000)) == 1_000_000


def _rows(out, *extra):
    bench_data.main(["--conversations", "200", "--out", str(out), "--work", str(out / "work"), *extra])
    rows = [json.loads(line) for line in (out / "data.jsonl").read_text().splitlines()]
    assert len({r["run"] for r in rows}) == 1 and all(r["git_sha"] and r["cpu_cores"] for r in rows)
    return {r["phase"] if r["phase"] != "target" else r["target"]: r for r in rows}


@pytest.mark.slow  # minutes on a 2-core CPU
def test_end_to_end_without_trl(tmp_path):
    rows = _rows(tmp_path, "--skip-trl")
    one, two, warm = rows["ours_1proc"], rows["ours_2proc"], rows["ours_warm"]
    full, tenth = rows["stream_full"], rows["stream_tenth"]
    assert one["examples"] == two["examples"] == warm["examples"] == full["examples"] == 200
    assert one["tokens"] == two["tokens"] == warm["tokens"] == full["tokens"] > 200 * 100
    assert tenth["conversations"] == tenth["examples"] == 20 and 0 < tenth["tokens"] < one["tokens"]
    assert not one["cache_hit"] and not two["cache_hit"] and warm["cache_hit"]
    assert one["tokens_per_s"] > 0 and warm["tokens_per_s"] is None and one["cache_bytes_on_disk"] >= 8 * one["tokens"]
    assert 0 < one["prepare_s"] <= one["first_batch_s"] and warm["first_batch_s"] < one["first_batch_s"]
    assert one["peak_rss_mb"] >= one["rss_before_mb"] > 0 and full["peak_rss_mb"] > 0
    assert "trl" not in rows and "ours_over_trl_throughput" not in rows
    assert rows["num_proc_2_speedup"]["ratio"] == pytest.approx(one["prepare_s"] / two["prepare_s"], rel=1e-3)
    assert rows["warm_over_cold"]["ratio"] == pytest.approx(warm["first_batch_s"] / one["prepare_s"], rel=1e-3)
    ratio = rows["stream_rss_full_over_tenth"]["ratio"]
    assert ratio == pytest.approx(full["peak_rss_mb"] / tenth["peak_rss_mb"], rel=1e-3)
    assert rows["stream_rss_full_over_tenth"]["met"] == (ratio <= 1.2)
    page = (tmp_path / "data.md").read_text()
    assert "200 conversations" in page and "| ours_2proc | 200 |" in page and "streaming peak RSS" in page


@pytest.mark.slow  # 25-40 s on 2 shared cores
def test_skip_stream_runs_ours_alone(tmp_path):
    rows = _rows(tmp_path, "--skip-trl", "--skip-stream", "--note", "beside the test suite")
    assert set(rows) == {"ours_1proc", "ours_2proc", "ours_warm", "num_proc_2_speedup", "warm_over_cold"}
    assert rows["ours_1proc"]["tokens"] == rows["ours_warm"]["tokens"] > 200 * 100
    assert "Note: beside the test suite" in (tmp_path / "data.md").read_text()


@pytest.mark.slow
def test_end_to_end_with_trl_equal_tokens(tmp_path):
    rows = _rows(tmp_path)
    trl, one = rows["trl"], rows["ours_1proc"]
    assert trl["compared"] == 200 and trl["compared_ids_differ"] == 0 and trl["compared_labels_differ"] == 0
    assert trl["examples"] == 200 and trl["tokens"] == one["tokens"] and 0 < trl["read_s"] < trl["prepare_s"]
    ratio = rows["ours_over_trl_throughput"]["ratio"]
    assert ratio == pytest.approx(one["tokens_per_s"] / trl["tokens_per_s"], rel=1e-3)
