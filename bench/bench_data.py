"""The SFT data pipeline on a CPU: our `load_sft_dataset` (one and two processes, cache cold and warm), `--streaming`
(`SFTStream` + `StreamLoader`) and TRL's `SFTTrainer` dataset preparation, on the same synthetic ShareGPT-like set
(issue 32 item 6).

The set: N conversations made here from a seed, written as JSONL shards of {"messages": [{"role", "content"}]}
(writing is not timed; not ShareGPT's {"from": "human"|"gpt", "value"}: TRL 1.16's conversion of it renames the keys
but keeps the roles "human" and "gpt", so a ChatML template renders no answer as the assistant's and
assistant_only_loss fails on every row). Exchanges per conversation and words per message
are drawn from log-normal distributions (heavy-tailed, roughly ShareGPT's shape): a median of 2 exchanges (at most
40), user messages a median of 12 words (1 to 300), answers a median of 60 (2 to 600), a system message in one
conversation of ten. Words are drawn Zipf-like from a fixed vocabulary of pseudo-words, with commas, full stops and
paragraph breaks, so the text is tokenizable and BPE has something to merge. No message is long enough for an answer
to start past cutoff_len (2048), so no example is dropped and every figure counts the same N examples.

The tokenizer: a byte-level BPE trained with the `tokenizers` library on the first shard (vocab 16,384 with the
ChatML special tokens) and a ChatML template whose answers are `{% generation %}` blocks (content + "<|im_end|>\\n").
It is written once with `Tokenizer.save_pretrained`: ours reads it with `Tokenizer.from_pretrained`, TRL's side with
`AutoTokenizer.from_pretrained` (a `PreTrainedTokenizerFast` of the same tokenizer.json). Both sides then supervise
exactly the assistant blocks: ours because the template has them (trainer/data/sft_data.py), TRL's with
`assistant_only_loss=True`, whose `assistant_masks` transformers computes from the same blocks.

Each figure is measured in its own fresh process (`--phase`), started by the parent one after the other, so that peak
RSS (VmHWM at the end of the phase: the main process only, not the num_proc workers) is
that phase's alone (rss_before_mb: the same just before the timed call, imports and tokenizer loaded). Times start
when the data call starts: interpreter start, imports, loading the tokenizer and building a model are excluded.

- ours_1proc: `load_sft_dataset(shards, cache_dir=<fresh>)`, then a `BatchLoader` (normal, 8 examples a micro batch,
  shuffled) and its first micro batch: the time to the first training step, model building excluded. Tokens/s counts
  the dataset's tokens over the `load_sft_dataset` time; the cache size is its entry's bytes on disk.
- ours_2proc: the same with num_proc=2 into another fresh cache; the tokens must be equal bit for bit (sha256 of
  the arrays). Speed-up = ours_1proc time / this one's (target >= 1.7x).
- ours_warm: the same call on ours_1proc's cache root, as a run with another output_dir makes it: the time to the
  dataset and to the first micro batch (target: < 5% of ours_1proc's).
- trl: `load_dataset("json", data_files=shards)` into a fresh HF_DATASETS_CACHE, then `SFTTrainer._prepare_dataset`
  (TRL 1.x's code: apply_chat_template with assistant masks, labels, truncation to max_length, the fully-masked
  filter), one process (dataset_num_proc None); prepare_s counts both, read_s the first alone, and the cache size
  is HF_DATASETS_CACHE's bytes (the Arrow of the JSON and of every `map`'s result). The trainer is built
  first, around a 2-row dataset and a tiny Llama (excluded). Target: ours_1proc tokens/s >= TRL's. On the first 200
  conversations TRL's input_ids and labels are compared with ours.
- stream_full / stream_tenth: `open_stream(SFTStream, tokenizer, data=shards)` (each shard a `datasets` JSON
  stream) and a `StreamLoader` (normal, 8 a micro batch, buffers of 1000) iterated over one pass of all N
  conversations, then of the first tenth of the shards; peak RSS target: RSS(N) <= 1.2 x RSS(N/10). The full pass
  must give the tokens of ours_1proc.

    python -m bench.bench_data                               # N = 1,000,000: rows appended to bench/results/data.jsonl
    python -m bench.bench_data --conversations 2000 --out /tmp/r --skip-trl   # a small run elsewhere
    python -m bench.bench_data --skip-trl --skip-stream      # ours alone: one and two processes, warm cache

Rows: one per phase, then one per target (met or not, with its ratio); bench/results/data.md renders every run.
The phases are single-threaded (two processes for num_proc=2): on a machine shared with other work their times move
by tens of percent (measured at 10,000 conversations under a load average of 6.5 on 2 cores, ours and TRL's were
within 4% of each other), so run it alone. At 10,000 conversations the whole bench took 3 minutes under that load.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import itertools
import json
import math
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from tokenizers import AddedToken, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as Backend

from bench import common
from trainer.data.tokenizer import CHATML_SPECIALS, Tokenizer

CHATML_TRAINING_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\n' }}{% generation %}{{ message['content'] + '<|im_end|>\n' }}{% endgeneration %}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""ChatML with the answers (and their end of turn) as `{% generation %}` blocks: what both sides supervise."""

VOCAB_WORDS = 30_000  # pseudo-words in the fixed vocabulary
BPE_VOCAB = 16_384
CUTOFF_LEN = 2048
MICRO_BATCH = 8
COMPARE = 200  # conversations whose TRL tokens are compared with ours
SHARD_CONVERSATIONS = 10_000  # at most, per JSONL shard; there are always a multiple of 10 shards
TARGETS = {  # name: (what, threshold, higher is better)
    "num_proc_2_speedup": ("ours num_proc=2 speed-up over one process", 1.7, True),
    "warm_over_cold": ("warm cache to first micro batch / cold preparation", 0.05, False),
    "ours_over_trl_throughput": ("ours one-process tokens/s / TRL's", 1.0, True),
    "stream_rss_full_over_tenth": ("streaming peak RSS at N / at N/10", 1.2, False),
}


# ---- the synthetic set ------------------------------------------------------------------------------------------
def vocabulary(seed: int) -> list[str]:
    """VOCAB_WORDS distinct pseudo-words of 1 to 4 syllables, the most frequent (shortest) first."""
    rng = np.random.default_rng([seed, 1])
    onsets = ["", "b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "st", "tr", "ch"]
    syllables = [o + v for o in onsets for v in ("a", "e", "i", "o", "u", "ai", "ou")]
    words: dict[str, None] = {}
    while len(words) < VOCAB_WORDS:
        n = int(min(4, 1 + rng.poisson(1.2)))
        words["".join(syllables[i] for i in rng.integers(0, len(syllables), n))] = None
    return sorted(words, key=len)


def _lognormal_ints(rng, median: float, sigma: float, low: int, high: int, size: int) -> np.ndarray:
    return np.clip(np.ceil(rng.lognormal(math.log(median), sigma, size)), low, high).astype(np.int64)


def conversations(n: int, seed: int, words: list[str]) -> list[dict]:
    """`n` records of messages drawn with `seed` (the module docstring's distributions)."""
    rng = np.random.default_rng([seed, 2])
    # Every word in four forms: bare, with a comma, ending a sentence, ending a paragraph.
    forms = np.array(words + [w + "," for w in words] + [w + "." for w in words] + [w + ".\n\n" for w in words])
    zipf = 1.0 / np.arange(1, len(words) + 1) ** 1.07
    cdf = np.cumsum(zipf / zipf.sum())
    exchanges = _lognormal_ints(rng, 1.8, 0.8, 1, 40, n)
    system = rng.random(n) < 0.1
    roles: list[str] = []
    for k, s in zip(exchanges, system):
        roles += ["system"] * int(s) + ["user", "assistant"] * int(k)
    roles_arr = np.array(roles)
    lengths = np.where(
        roles_arr == "assistant",
        _lognormal_ints(rng, 60, 0.9, 2, 600, len(roles)),
        np.where(
            roles_arr == "user", _lognormal_ints(rng, 12, 1.0, 1, 300, len(roles)), rng.integers(5, 41, len(roles))
        ),
    )
    total = int(lengths.sum())
    ids = np.searchsorted(cdf, rng.random(total))
    form = np.searchsorted(np.cumsum([0.88, 0.05, 0.06, 0.01]), rng.random(total), side="right").clip(0, 3)
    tokens = forms[ids + form * len(words)].tolist()
    out, at, m = [], 0, 0
    for k, s in zip(exchanges, system):
        turns = []
        for _ in range(int(s) + 2 * int(k)):
            text = " ".join(tokens[at : at + lengths[m]]).rstrip(",\n")
            turns.append({"role": roles[m], "content": text})
            at += int(lengths[m])
            m += 1
        out.append({"messages": turns})
    return out


def shard_counts(n: int) -> list[int]:
    """Conversations per shard: a multiple of 10 shards of at most SHARD_CONVERSATIONS, as equal as they come."""
    shards = 10 * max(1, math.ceil(n / (10 * SHARD_CONVERSATIONS)))
    return [n // shards + (i < n % shards) for i in range(shards)]


def write_shards(directory: Path, n: int, seed: int) -> tuple[list[Path], dict]:
    """The set as JSONL shards in `directory` (reused when a complete earlier run of the same n and seed left them,
    else the directory is made anew), and its statistics."""
    done = directory / "done.json"
    if done.is_file() and json.loads(done.read_text()).get("n") == n and json.loads(done.read_text())["seed"] == seed:
        stats = json.loads(done.read_text())
        return [directory / name for name in stats.pop("shards")], stats
    shutil.rmtree(directory, ignore_errors=True)  # another set's shards, and the tokenizer trained on them
    directory.mkdir(parents=True)
    words = vocabulary(seed)
    paths, messages, exchanges, nbytes = [], 0, [], 0
    for i, count in enumerate(shard_counts(n)):
        records = conversations(count, seed * 100_003 + i, words)
        path = directory / f"shard-{i:05d}.jsonl"
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
        path.write_text(text)
        paths.append(path)
        nbytes += len(text.encode())
        messages += sum(len(r["messages"]) for r in records)
        exchanges += [sum(t["role"] == "assistant" for t in r["messages"]) for r in records]
    stats = {
        "n": n,
        "seed": seed,
        "messages": messages,
        "exchanges_median": float(np.median(exchanges)),
        "exchanges_mean": round(float(np.mean(exchanges)), 2),
        "jsonl_bytes": nbytes,
    }
    done.write_text(json.dumps({**stats, "shards": [p.name for p in paths]}))
    return paths, stats


def train_tokenizer(first_shard: Path, directory: Path) -> Path:
    """A byte-level BPE of BPE_VOCAB ids trained on the first shard's text, with ChatML and its training template,
    saved as a Hugging Face tokenizer directory."""
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB,
        special_tokens=list(CHATML_SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )

    def texts():
        with open(first_shard, encoding="utf-8") as f:
            for line in f:
                yield from (t["content"] for t in json.loads(line)["messages"])

    backend.train_from_iterator(texts(), trainer)
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in CHATML_SPECIALS])
    tok = Tokenizer(
        backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHATML_TRAINING_TEMPLATE,
        model_max_length=CUTOFF_LEN,
    )
    tok.save_pretrained(directory)
    return directory


# ---- the phases, each in its own process ------------------------------------------------------------------------
def _peak_rss_mb() -> float:
    """This process's peak resident set, in MB: VmHWM of /proc/self/status on Linux, the high-water mark of this
    address space. Not getrusage's ru_maxrss: after fork + exec it starts from the parent's RSS at the fork (seen
    here: every phase reported the parent's 258 MB)."""
    status = Path("/proc/self/status")
    if status.is_file():
        line = next(line for line in status.read_text().splitlines() if line.startswith("VmHWM:"))
        return round(int(line.split()[1]) / 1024, 1)  # kB
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 1)  # macOS: bytes


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def _arrays_sha256(ds) -> str:
    h = hashlib.sha256()
    for array in ds.arrays().values():
        h.update(np.ascontiguousarray(array).data)
    return h.hexdigest()


def _first_batch(ds) -> tuple[dict, float]:
    from trainer.data.batching import BatchLoader

    t0 = time.perf_counter()
    batch = next(iter(BatchLoader(ds, micro_batch_size=MICRO_BATCH, seed=0)))
    return batch, time.perf_counter() - t0


def phase_ours(spec: dict) -> dict:
    """ours_1proc, ours_2proc, ours_warm: load_sft_dataset, then the first micro batch."""
    from trainer.data.sft_data import load_sft_dataset

    tok = Tokenizer.from_pretrained(spec["tokenizer"])
    rss_start = _peak_rss_mb()
    t0 = time.perf_counter()
    ds = load_sft_dataset(
        [Path(p) for p in spec["shards"]],
        tok,
        cutoff_len=CUTOFF_LEN,
        cache_dir=spec["cache"],
        show_progress=False,
        num_proc=spec["num_proc"],
    )
    prepare_s = time.perf_counter() - t0
    batch, batch_s = _first_batch(ds)
    peak_rss = _peak_rss_mb()  # before the checks below read anything more
    assert batch["input_ids"].shape[0] == min(MICRO_BATCH, len(ds))
    tokens = int(ds.summary["tokens"])
    return {
        "examples": len(ds),
        "tokens": tokens,
        "supervised_tokens": int(ds.summary["supervised_tokens"]),
        "length_p50": ds.summary["length"]["p50"],
        "length_p99": ds.summary["length"]["p99"],
        "truncated": ds.summary.get("truncated", 0),
        "cache_hit": bool(ds.summary.get("cache_hit")),
        "prepare_s": round(prepare_s, 3),
        "first_batch_s": round(prepare_s + batch_s, 3),
        "tokens_per_s": None if ds.summary.get("cache_hit") else round(tokens / prepare_s, 1),  # read, not tokenised
        "cache_bytes_on_disk": _dir_bytes(spec["cache"]),
        "arrays_sha256": _arrays_sha256(ds),
        "peak_rss_mb": peak_rss,
        "rss_before_mb": rss_start,
    }


def phase_trl(spec: dict) -> dict:
    """TRL's SFTTrainer preparation of the shards, then the first COMPARE examples against ours."""
    # datasets, pyarrow, transformers and trl are imported here: only this phase needs them, and trl is optional.
    import datasets
    import pyarrow.compute
    import torch
    import transformers
    import trl

    from trainer.data.sft_data import load_sft_dataset

    torch.set_num_threads(1)
    datasets.disable_progress_bars()
    hf_tok = transformers.AutoTokenizer.from_pretrained(spec["tokenizer"])
    config = transformers.LlamaConfig(
        vocab_size=len(hf_tok),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    model = transformers.LlamaForCausalLM(config)
    args = trl.SFTConfig(
        output_dir=spec["work"],
        max_length=CUTOFF_LEN,
        assistant_only_loss=True,
        dataset_num_proc=None,
        report_to=[],
        use_cpu=True,
    )
    with open(spec["shards"][0], encoding="utf-8") as f:  # the constructor's own dataset: 2 rows
        rows = [json.loads(line) for line in itertools.islice(f, 2)]
    trainer = trl.SFTTrainer(
        model=model, args=args, train_dataset=datasets.Dataset.from_list(rows), processing_class=hf_tok
    )
    rss_start = _peak_rss_mb()
    t0 = time.perf_counter()
    raw = datasets.load_dataset("json", data_files=spec["shards"], split="train", cache_dir=spec["hf_cache"])
    read_s = time.perf_counter() - t0
    prepared = trainer._prepare_dataset(raw, hf_tok, args, False, None, "train")
    prepare_s = time.perf_counter() - t0
    peak_rss = _peak_rss_mb()  # before the counting and the comparison below
    tokens = sum(
        pyarrow.compute.sum(pyarrow.compute.list_value_length(batch["input_ids"])).as_py()
        for batch in prepared.with_format("arrow").iter(batch_size=10_000)
    )

    ours = load_sft_dataset(  # ours_1proc's cache entry: read, not tokenised again
        [Path(p) for p in spec["shards"]],
        Tokenizer.from_pretrained(spec["tokenizer"]),
        cutoff_len=CUTOFF_LEN,
        cache_dir=spec["compare_cache"],
        show_progress=False,
    )
    k = min(COMPARE, len(ours), len(prepared))
    ids_differ, labels_differ, first = 0, 0, None
    for i in range(k):
        theirs = prepared[i]
        mine = ours[i]
        ids_equal = list(theirs["input_ids"]) == mine["input_ids"].tolist()
        labels_equal = list(theirs["labels"]) == mine["labels"].tolist()
        ids_differ += not ids_equal
        labels_differ += not labels_equal
        if first is None and not (ids_equal and labels_equal):
            first = _difference(i, theirs, mine)
    return {
        "examples": len(prepared),
        "tokens": tokens,
        "read_s": round(read_s, 3),
        "prepare_s": round(prepare_s, 3),
        "tokens_per_s": round(tokens / prepare_s, 1),
        "cache_bytes_on_disk": _dir_bytes(spec["hf_cache"]),  # the Arrow of the JSON and of every map
        "compared": k,
        "compared_ids_differ": ids_differ,
        "compared_labels_differ": labels_differ,
        "first_difference": first,
        "peak_rss_mb": peak_rss,
        "rss_before_mb": rss_start,
    }


def _difference(i: int, theirs: dict, mine: dict) -> str:
    """Where example i first differs: which array, at which token, TRL's value against ours."""
    for name in ("input_ids", "labels"):
        a, b = list(theirs[name]), mine[name].tolist()
        if a != b:
            at = next((t for t, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            return (
                f"example {i}: {name} differ at token {at} of {len(a)} (TRL) / {len(b)} (ours): "
                f"TRL {a[at : at + 4]}, ours {b[at : at + 4]}"
            )
    return f"example {i}: equal"


def phase_stream(spec: dict) -> dict:
    """One pass of SFTStream + StreamLoader over the shards: micro batches produced, tokens, peak RSS."""
    from trainer.data.streaming import SFTStream, StreamLoader, open_stream

    tok = Tokenizer.from_pretrained(spec["tokenizer"])
    rss_start = _peak_rss_mb()
    t0 = time.perf_counter()
    stream = open_stream(
        SFTStream, tok, data=[Path(p) for p in spec["shards"]], cutoff_len=CUTOFF_LEN, show_progress=False
    )
    # Every conversation is kept (module docstring) and buffers of 1000 hold whole micro batches of 8, so one pass
    # is exactly ceil(N / 8) micro batches; the loader itself would go on into the next pass.
    batches = math.ceil(spec["conversations"] / MICRO_BATCH)
    loader = StreamLoader(stream, micro_batches_per_rank=batches, micro_batch_size=MICRO_BATCH, seed=0)
    examples = tokens = 0
    first_batch_s = None
    for batch in itertools.islice(loader, batches):
        if first_batch_s is None:
            first_batch_s = time.perf_counter() - t0
        examples += batch["input_ids"].shape[0]
        tokens += int(batch["attention_mask"].sum())
    wall = time.perf_counter() - t0
    return {
        "conversations": spec["conversations"],
        "examples": examples,
        "tokens": tokens,
        "micro_batches": batches,
        "first_batch_s": round(first_batch_s, 3),
        "wall_s": round(wall, 3),
        "tokens_per_s": round(tokens / wall, 1),
        "dropped": dict(stream.dropped),
        "peak_rss_mb": _peak_rss_mb(),
        "rss_before_mb": rss_start,
    }


PHASES = {"ours": phase_ours, "trl": phase_trl, "stream": phase_stream}


def run_phase(name: str, spec: dict) -> dict:
    """`name`'s phase in a fresh Python process; its result row."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(common.ROOT), os.environ.get("PYTHONPATH", "")])}
    env["TOKENIZERS_PARALLELISM"] = "false"  # both sides encode one text at a time; no hidden thread pool
    if "hf_cache" in spec:
        env["HF_DATASETS_CACHE"] = spec["hf_cache"]
    out = subprocess.run(
        [sys.executable, "-m", "bench.bench_data", "--phase", name, "--spec", json.dumps(spec)],
        cwd=common.ROOT,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


# ---- the run ----------------------------------------------------------------------------------------------------
def machine_info() -> dict:
    """The columns a data row adds to `common.env_info()`: the CPU model and the data libraries' versions."""
    model = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines() if "model name" in line]
        model = names[0] if names else model
    versions = {}
    for dist in ("tokenizers", "datasets", "trl"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = common.ABSENT
    return {"cpu_model": model, "cpu_cores": os.cpu_count(), "python": platform.python_version(), **versions}


def target_rows(results: dict) -> list[dict]:
    """One row per target whose figures this run has: the ratio, the threshold, met or not."""
    ratios = {
        "num_proc_2_speedup": ("ours_1proc", "ours_2proc", lambda a, b: a["prepare_s"] / b["prepare_s"]),
        "warm_over_cold": ("ours_warm", "ours_1proc", lambda a, b: a["first_batch_s"] / b["prepare_s"]),
        "ours_over_trl_throughput": ("ours_1proc", "trl", lambda a, b: a["tokens_per_s"] / b["tokens_per_s"]),
        "stream_rss_full_over_tenth": ("stream_full", "stream_tenth", lambda a, b: a["peak_rss_mb"] / b["peak_rss_mb"]),
    }
    rows = []
    for name, (a, b, ratio) in ratios.items():
        if a in results and b in results:
            what, threshold, higher = TARGETS[name]
            value = ratio(results[a], results[b])
            met = value >= threshold if higher else value <= threshold
            rows.append(
                {
                    "phase": "target",
                    "target": name,
                    "what": what,
                    "ratio": float(f"{value:.4g}"),
                    "threshold": f"{'>=' if higher else '<='} {threshold}",
                    "met": met,
                }
            )
    return rows


def run(n: int, seed: int, work: Path, skip_trl: bool = False, skip_stream: bool = False, log=print) -> list[dict]:
    """Every phase on N conversations in `work`; the rows (phases, then targets), without the context columns."""
    shards, stats = write_shards(work / "shards", n, seed)
    tokenizer = work / "shards" / "tokenizer"  # trained on these shards: made anew with them
    if not (tokenizer / "tokenizer.json").is_file():
        train_tokenizer(shards[0], tokenizer)
    log(f"data: {n:,} conversations in {len(shards)} shards, {stats['jsonl_bytes'] / 1e6:.1f} MB of JSONL")
    base = {"tokenizer": str(tokenizer), "shards": [str(p) for p in shards]}
    caches = {name: work / f"cache-{name}" for name in ("1proc", "2proc")}
    for path in caches.values():
        shutil.rmtree(path, ignore_errors=True)
    results = {}

    def phase(label: str, kind: str, spec: dict) -> None:
        log(f"{label}: started {time.strftime('%H:%M:%S')}")  # at 1,000,000 conversations a phase takes many minutes
        results[label] = run_phase(kind, {**base, **spec})
        log(f"{label}: " + ", ".join(f"{k} {v}" for k, v in results[label].items() if k != "arrays_sha256"))

    phase("ours_1proc", "ours", {"cache": str(caches["1proc"]), "num_proc": None})
    phase("ours_2proc", "ours", {"cache": str(caches["2proc"]), "num_proc": 2})
    shutil.rmtree(caches["2proc"])
    if results["ours_2proc"]["arrays_sha256"] != results["ours_1proc"]["arrays_sha256"]:
        raise RuntimeError("num_proc=2 tokenised differently from one process")
    phase("ours_warm", "ours", {"cache": str(caches["1proc"]), "num_proc": None})
    if not results["ours_warm"]["cache_hit"]:
        raise RuntimeError("the warm run did not read the cache")
    if not skip_trl:
        hf_cache = work / "hf-cache"
        shutil.rmtree(hf_cache, ignore_errors=True)
        phase(
            "trl",
            "trl",
            {"hf_cache": str(hf_cache), "work": str(work / "trl"), "compare_cache": str(caches["1proc"])},
        )
        shutil.rmtree(hf_cache)
    if not skip_stream:
        tenth = shards[: len(shards) // 10]
        phase("stream_full", "stream", {"conversations": n})
        n_tenth = sum(shard_counts(n)[: len(tenth)])
        phase("stream_tenth", "stream", {"shards": [str(p) for p in tenth], "conversations": n_tenth})
        if results["stream_full"]["tokens"] != results["ours_1proc"]["tokens"]:
            raise RuntimeError("the stream gave other tokens than load_sft_dataset")
    shutil.rmtree(caches["1proc"])
    data = {k: v for k, v in stats.items() if k not in ("n", "seed")}
    rows = [{"phase": label, "conversations": n, "seed": seed, **data, **row} for label, row in results.items()]
    return rows + target_rows(results)


def render(path: Path) -> Path:
    """bench/results/data.md: every run of data.jsonl, newest first: its context, its phases, its targets."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    runs: dict[str, list[dict]] = {}
    for row in rows:
        runs.setdefault(row["run"], []).append(row)
    lines = [
        "# data",
        "",
        "The SFT data pipeline on a CPU (bench/bench_data.py: what each phase times and how). Times exclude "
        "interpreter start, imports, loading the tokenizer and building a model; peak RSS is the phase's main "
        "process (num_proc workers not included).",
    ]
    phase_cols = (
        "phase",
        "conversations",
        "examples",
        "tokens",
        "prepare_s",
        "read_s",
        "first_batch_s",
        "wall_s",
        "tokens_per_s",
        "rss_before_mb",
        "peak_rss_mb",
        "cache_bytes_on_disk",
        "cache_hit",
    )
    for run_rows in reversed(list(runs.values())):
        ctx = run_rows[0]
        lines += [
            "",
            f"## {ctx['date']}: {ctx['conversations']:,} conversations",
            "",
            f"{ctx['cpu_model']} ({ctx['cpu_cores']} cores); python {ctx['python']}, torch {ctx['torch']}, "
            f"tokenizers {ctx['tokenizers']}, datasets {ctx['datasets']}, trl {ctx['trl']}, transformers "
            f"{ctx['transformers']}; git {ctx['git_sha']}; command `{ctx['command']}`",
            *(["", f"Note: {ctx['note']}"] if ctx.get("note") else []),
            "",
            f"Set: {ctx['messages']:,} messages, {ctx['exchanges_median']:g} exchanges median "
            f"({ctx['exchanges_mean']} mean), {ctx['jsonl_bytes'] / 1e6:.1f} MB of JSONL.",
            "",
            "| " + " | ".join(phase_cols) + " |",
            "|" + "---|" * len(phase_cols),
        ]
        for row in run_rows:
            if row["phase"] != "target":
                lines.append("| " + " | ".join(_cell(row.get(c)) for c in phase_cols) + " |")
        trl = next((r for r in run_rows if r["phase"] == "trl"), None)
        if trl is not None:
            same = trl["compared_ids_differ"] == 0 and trl["compared_labels_differ"] == 0
            lines += [
                "",
                f"TRL against ours on the first {trl['compared']} conversations: input_ids differ in "
                f"{trl['compared_ids_differ']}, labels in {trl['compared_labels_differ']}"
                + ("." if same else f"; first: {trl['first_difference']}."),
            ]
        lines += ["", "| target | ratio | threshold | met |", "|---|---|---|---|"]
        for row in run_rows:
            if row["phase"] == "target":
                met = "met" if row["met"] else "NOT met"
                lines.append(f"| {row['what']} | {row['ratio']:.3g} | {row['threshold']} | {met} |")
    out = path.with_suffix(".md")
    out.write_text("\n".join(lines) + "\n")
    return out


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--conversations", type=int, default=1_000_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(common.RESULTS), help="where data.jsonl and data.md are written")
    parser.add_argument("--work", default=None, help="a directory for shards, tokenizer and caches (default: a temp)")
    parser.add_argument("--skip-trl", action="store_true", help="no TRL phase (no trl installed, or a quick run)")
    parser.add_argument("--skip-stream", action="store_true", help="no streaming phases (the longest at 1,000,000)")
    parser.add_argument("--note", default=None, help="what the rendered page says of this run (e.g. what else ran)")
    parser.add_argument("--phase", choices=sorted(PHASES), help=argparse.SUPPRESS)  # a child process's part
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.phase:
        print(json.dumps(PHASES[args.phase](json.loads(args.spec))), flush=True)
        return
    # perf_figure: the CPU is the device this bench measures, so its rows are performance figures (common.env_info
    # flags every CPU row as not one, for the kernels' reference path).
    context = {**common.env_info(), **machine_info(), "perf_figure": True, "note": args.note}
    with tempfile.TemporaryDirectory(prefix="bench_data-") as tmp:
        work = Path(args.work) if args.work else Path(tmp)
        rows = run(
            args.conversations, args.seed, work, args.skip_trl, args.skip_stream, log=lambda s: print(s, flush=True)
        )
    run_id = f"{context['date']} {os.getpid()}"
    rows = [{"bench": "data", "run": run_id, **row, **context} for row in rows]
    common.RESULTS = Path(args.out)
    path = common.write_rows("data", rows, render=render)
    for row in rows:
        if row["phase"] == "target":
            print(f"{row['what']}: {row['ratio']:.3g} ({row['threshold']}): {'met' if row['met'] else 'NOT met'}")
    print(path.with_suffix(".md"))


if __name__ == "__main__":
    main()
