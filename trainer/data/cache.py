"""The tokenised-data cache: one root per machine, shared by every run, content-addressed, memory-mapped.

Where: `--data_cache_dir` when given, else `$KERNELWRIGHT_DATA_CACHE`, else `$XDG_CACHE_HOME/kernelwright/data`
(`~/.cache/kernelwright/data` without XDG_CACHE_HOME, as huggingface_hub places its cache). A run with another
output_dir reads what an earlier one tokenised: the entry's name is a digest of what decides the tokens
(`trainer.data.sft_data._cache_key`), never of where a run writes.

Layout: `<root>/<name>-<key>/` holds one `<array>.npy` per array and `summary.json`. An entry is written into a
temporary directory in the same root and renamed into place (atomic: a reader sees it whole or not at all), under an
exclusive `fcntl.flock` on `<root>/<name>-<key>.lock`, so that of several runs or ranks that miss the same entry at
once one tokenises and writes while the others wait, then read it. Reads map the arrays (`numpy.load(mmap_mode='r')`,
read-only): ranks on one node share the page cache, and a process's RSS grows with the pages it touches, not with
the dataset. Nothing writes into the arrays (the batch collators copy rows into new arrays).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from trainer.coerce import ConfigError

CACHE_ENV = "KERNELWRIGHT_DATA_CACHE"
SUMMARY_FILE = "summary.json"
# Keys of a dataset's summary that describe this load, not the entry: never written into it.
LOAD_KEYS = ("cache", "cache_hit", "cache_bytes")


def cache_root(data_cache_dir: str | os.PathLike | None = None) -> Path:
    """The cache root: `data_cache_dir` when given, else $KERNELWRIGHT_DATA_CACHE, else the user's cache directory
    ($XDG_CACHE_HOME, default ~/.cache) + kernelwright/data."""
    if data_cache_dir:
        return Path(data_cache_dir).expanduser()
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
    return Path(xdg).expanduser() / "kernelwright" / "data"


def check_cache_root(root: str | os.PathLike) -> None:
    """A one-line ConfigError unless `root` is (or can be created as) a directory this process can write."""
    root = Path(root)
    existing = root
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"data_cache_dir: {existing} is a file, not a directory (data cache {root})")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(
            f"data_cache_dir: {root} cannot be written (no write permission on {existing}); pass --data_cache_dir "
            f"or set {CACHE_ENV} to a directory you can write"
        )


@contextmanager
def entry_lock(entry: Path):
    """Hold the exclusive lock of `entry` (a file beside it; the kernel drops it when the process dies)."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    with open(entry.with_name(entry.name + ".lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def write_entry(entry: str | os.PathLike, arrays: dict[str, np.ndarray], summary: dict) -> None:
    """Write `arrays` (one .npy each) and `summary` as the directory `entry`, atomically; an entry already there (an
    unreadable one being replaced) is moved aside first and removed after."""
    entry = Path(entry)
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = entry.with_name(f".{entry.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # a killed earlier try of this process id
    tmp.mkdir()
    try:
        for name, array in arrays.items():
            np.save(tmp / f"{name}.npy", np.ascontiguousarray(array), allow_pickle=False)
        kept = {k: v for k, v in summary.items() if k not in LOAD_KEYS}
        (tmp / SUMMARY_FILE).write_text(json.dumps(kept))
        old = None
        if entry.exists():
            old = entry.with_name(f".{entry.name}.{os.getpid()}.old")
            os.rename(entry, old)
        os.rename(tmp, entry)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def read_entry(entry: str | os.PathLike, names) -> tuple[dict[str, np.ndarray], dict]:
    """The arrays `names` of `entry`, memory-mapped read-only, and its summary. OSError/ValueError when the entry is
    missing, incomplete or damaged."""
    entry = Path(entry)
    summary = json.loads((entry / SUMMARY_FILE).read_text())
    arrays = {}
    for name in names:
        path = entry / f"{name}.npy"
        try:
            arrays[name] = np.load(path, mmap_mode="r", allow_pickle=False)
        except ValueError:  # numpy cannot map an empty array: read it (nothing to share)
            arrays[name] = np.load(path, allow_pickle=False)
    return arrays, summary


def entry_bytes(arrays) -> int:
    """The bytes of an entry's arrays (what the summary line reports)."""
    return int(sum(a.nbytes for a in arrays))
