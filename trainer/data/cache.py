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
the dataset. Nothing writes into the arrays (the batch collators copy rows into new arrays). The process that
tokenises writes the arrays as it goes (`ArrayWriter`, a bounded buffer each) and then maps the entry as a reader
does, so its memory does not grow with the dataset either.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import tempfile
from contextlib import ExitStack, contextmanager
from pathlib import Path

import numpy as np

from trainer.coerce import ConfigError

CACHE_ENV = "KERNELWRIGHT_DATA_CACHE"
SUMMARY_FILE = "summary.json"
# Keys of a dataset's summary that describe this load, not the entry: never written into it.
LOAD_KEYS = ("cache", "cache_hit", "cache_bytes")
# An `ArrayWriter`'s buffer: what its memory holds of the array it writes, whatever the array's length.
WRITE_BUFFER = 1 << 22


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


@contextmanager
def staged(entry: str | os.PathLike):
    """A new empty directory beside `entry` (the same file system) to write the entry's files into before `commit`
    renames it into place; removed on leaving when not committed (a killed process leaves it behind under a name no
    entry has, which its next try removes)."""
    entry = Path(entry)
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = entry.with_name(f".{entry.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # a killed earlier try of this process id
    tmp.mkdir()
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def commit(tmp: Path, entry: str | os.PathLike, summary: dict) -> None:
    """Write `summary` into `staged`'s directory `tmp`, whose arrays are written, and rename it to `entry`,
    atomically; an entry already there (an unreadable one being replaced) is moved aside first and removed after."""
    entry = Path(entry)
    kept = {k: v for k, v in summary.items() if k not in LOAD_KEYS}
    (tmp / SUMMARY_FILE).write_text(json.dumps(kept))
    old = None
    if entry.exists():
        old = entry.with_name(f".{entry.name}.{os.getpid()}.old")
        os.rename(entry, old)
    os.rename(tmp, entry)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@contextmanager
def building(entry: str | os.PathLike | None):
    """(directory, entry): `staged(entry)`'s directory, for `commit` to rename to `entry`; without `entry`, the same in
    a temporary directory (tempfile's, $TMPDIR) removed on leaving, files and all: an entry read from it (mapped)
    keeps its files' data until its arrays are freed."""
    with ExitStack() as stack:
        if entry is None:
            entry = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kernelwright-data-"))) / "entry"
        yield stack.enter_context(staged(entry)), Path(entry)


def write_entry(entry: str | os.PathLike, arrays: dict[str, np.ndarray], summary: dict) -> None:
    """Write `arrays` (one .npy each) and `summary` as the directory `entry`, atomically (`staged`, `commit`)."""
    with staged(entry) as tmp:
        for name, array in arrays.items():
            np.save(tmp / f"{name}.npy", np.ascontiguousarray(array), allow_pickle=False)
        commit(tmp, entry, summary)


class ArrayWriter:
    """A 1-D array of `dtype` written to the .npy file `path` as it grows, for arrays too big to hold in memory:
    `append` adds values through a buffer of WRITE_BUFFER bytes (this writer's memory, whatever the length),
    `close` writes the header, whose shape holds the length, over the one written at the start (numpy pads a header
    so that its length fits any length in place)."""

    def __init__(self, path: str | os.PathLike, dtype):
        self.dtype = np.dtype(dtype)
        self.length = 0
        self._file = open(path, "wb", buffering=WRITE_BUFFER)
        self._header = self._write_header()

    def _write_header(self) -> int:
        header = {"descr": np.lib.format.dtype_to_descr(self.dtype), "fortran_order": False, "shape": (self.length,)}
        start = self._file.tell()
        np.lib.format.write_array_header_1_0(self._file, header)
        return self._file.tell() - start

    def append(self, values) -> None:
        values = np.ascontiguousarray(values, dtype=self.dtype)
        self._file.write(values.data.cast("B"))
        self.length += len(values)

    def close(self) -> None:
        """Write the header and close the file (again: a no-op)."""
        if self._file.closed:
            return
        try:
            self._file.seek(0)
            if self._write_header() != self._header:
                raise ValueError(f"{self._file.name}: the .npy header of {self.length:,} values does not fit in place")
        finally:
            self._file.close()


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
