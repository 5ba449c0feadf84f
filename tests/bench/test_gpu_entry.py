"""`python -m bench.gpu` (bench/gpu.py), the GPU machine's entry point, run end to end on a CPU with --quick.

Each part writes its handful of files to --out, and every row and markdown header names the device, driver,
versions, git sha, date and command. The train part (two trainer subprocesses, ~20 s here) is left to
`python -m bench.gpu --part train --quick`; its pieces are tested in test_bench_runner.py.
"""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch

from bench import common, gpu

ENV_KEYS = (
    "device",
    "driver",
    "cuda",
    "date",
    "torch",
    "triton",
    "transformers",
    "peft",
    "liger_kernel",
    "git_sha",
    "command",
    "perf_figure",
)


def rows_of(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def assert_env(row):
    missing = [k for k in ENV_KEYS if row.get(k) in (None, "")]
    assert not missing, f"env fields missing: {missing}"
    assert row["perf_figure"] is torch.cuda.is_available()


def test_kernels_part_writes_rows_targets_and_one_chart(tmp_path):
    results_before = common.RESULTS  # another test's in-process `python -m bench --out` may have moved it
    assert gpu.main(["--part", "kernels", "--quick", "--out", str(tmp_path), "--only", "rms_norm,adamw"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kernels.jsonl", "kernels.log", "kernels.md", "kernels.png"]
    rows = rows_of(tmp_path / "kernels.jsonl")
    assert {r["op"] for r in rows} == {"rms_norm", "fused_add_rms_norm", "adamw"}  # bench_rms_norm runs both ops
    for row in rows:
        assert_env(row)
    text = (tmp_path / "kernels.md").read_text()
    assert "Measured on " in text and "## Targets (H100)" in text and "| rms_norm | forward GB/s |" in text
    assert "## rms_norm: every row" in text and "## adamw: every row" in text
    assert (tmp_path / "kernels.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert common.RESULTS == results_before  # the part's scratch folder is not left behind


def test_kernel_times_reach_the_benchmarks_that_have_them():
    args = gpu.parse_args(["--part", "kernels", "--out", "unused", "--kernel-times"])
    assert gpu.kernel_flags("rope", args) == [*gpu.ANCHORS["rope"], "--kernel-times"]
    assert gpu.kernel_flags("adamw", args) == gpu.ANCHORS["adamw"]  # bench_adamw has no such flag
    for op in gpu.KERNEL_TIMES:  # each of them parses it
        script = (Path(gpu.__file__).parent / f"bench_{op}.py").read_text()
        assert '"--kernel-times"' in script or "provider_parser(" in script, op
    assert gpu.kernel_flags("rope", gpu.parse_args(["--part", "kernels", "--out", "x"])) == gpu.ANCHORS["rope"]


def test_kernels_part_starts_no_benchmark_once_its_budget_is_spent(tmp_path, monkeypatch):
    """The part's clock is injected: each benchmark takes 10 fake seconds, whatever this machine's speed, so with a
    budget of 5 s rms_norm runs and adamw never starts."""
    now = [1000.0]
    run = gpu.kernel_runner.run

    def run_taking_ten_seconds(*args, **kwargs):
        now[0] += 10.0
        return run(*args, **kwargs)

    monkeypatch.setattr(gpu, "time", types.SimpleNamespace(monotonic=lambda: now[0]))
    monkeypatch.setattr(gpu.kernel_runner, "run", run_taking_ten_seconds)
    args = ["--part", "kernels", "--quick", "--out", str(tmp_path), "--only", "rms_norm,adamw", "--budget-s", "5"]
    assert gpu.main(args) == 0
    assert {r["op"] for r in rows_of(tmp_path / "kernels.jsonl")} == {"rms_norm", "fused_add_rms_norm"}
    text = (tmp_path / "kernels.md").read_text()
    assert "Not run: adamw (the part's --budget-s was spent before they started)." in text
    assert "## rms_norm: every row" in text and "## adamw" not in text


def test_memory_part_runs_a_rung_in_a_subprocess(tmp_path):
    assert (
        gpu.main(
            [
                "--part",
                "memory",
                "--quick",
                "--out",
                str(tmp_path),
                "--configs",
                "ours,hf_liger",
                "--ladders",
                "micro_batch",
                "--seq-len",
                "8",
            ]
        )
        == 0
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "memory.log",
        "memory.md",
        "memory.png",
        "train_memory.jsonl",
        "train_memory.md",
    ]
    rows = rows_of(tmp_path / "train_memory.jsonl")
    rung = next(r for r in rows if r["bench"] == "train_memory_rung")
    assert rung["impl"] == "ours" and rung["status"] == "ok" and rung["peak_memory_gb"] > 0
    for row in rows:
        assert_env(row)
    text = (tmp_path / "memory.md").read_text()
    assert "| ours | micro_batch | seq_len 8 | 1 (capped at 1) |" in text  # --seq-len replaced the default 16
    if not torch.cuda.is_available():
        assert "| hf_liger | micro_batch | | | | | | skipped:" in text


def test_tests_part_reports_every_case_and_the_csrc_build(tmp_path):
    assert gpu.main(["--part", "tests", "--quick", "--out", str(tmp_path)]) == 0
    assert {"tests.md", "tests.jsonl", "tests_junit.xml", "pytest.log", "csrc_build.log"} <= {
        p.name for p in tmp_path.iterdir()
    }
    rows = rows_of(tmp_path / "tests.jsonl")
    names = {r["test"] for r in rows}
    assert "tests.test_conftest::test_gpu_session_runs_compiled_kernels_not_the_interpreter" in names
    assert "csrc build" in names
    for row in rows:
        assert_env(row)
    if not torch.cuda.is_available():
        assert {r["outcome"] for r in rows if r["test"] != "csrc build"} == {"skipped"}
        assert "**skipped**" in (tmp_path / "tests.md").read_text()


def test_git_sha_from_the_environment_where_the_tree_has_no_git(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "ROOT", tmp_path)  # a copy of the tree without .git, as on the device machine
    monkeypatch.setenv("GIT_SHA", "abc1234")
    assert common.git_sha() == "abc1234"
    monkeypatch.delenv("GIT_SHA")
    assert common.git_sha() == "unknown"


def test_git_sha_from_the_environment_wins_over_a_stale_git(monkeypatch):
    """The device machine's copy can carry the .git of the session's start: GIT_SHA, set by the run, names the
    commit the tree holds."""
    monkeypatch.setenv("GIT_SHA", "abc1234")
    assert common.git_sha() == "abc1234"
    monkeypatch.delenv("GIT_SHA")
    assert common.git_sha() not in ("abc1234", "unknown")  # this checkout's own HEAD


def test_bad_arguments_are_argparse_errors():
    for argv in (
        ["--part", "kernels", "--out", "x", "--only", "softmax"],
        ["--part", "gpu", "--out", "x"],
        ["--part", "tests", "--out", "x", "--budget-s", "0"],
    ):
        with pytest.raises(SystemExit) as err:
            gpu.parse_args(argv)
        assert err.value.code == 2
