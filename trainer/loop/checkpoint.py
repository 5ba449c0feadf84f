"""Training checkpoints: atomic, rotating, exactly resumable.

Layout of `output_dir/checkpoint-<step>/` (Hugging Face's, so tools that read Trainer checkpoints work):
- the model in the Hugging Face safetensors layout (`config.json`, `model.safetensors` or shards + index,
  tokenizer files), loadable by `from_pretrained` as is; a model that is not ours gets its state_dict
  as `model.safetensors`;
- `dcp/` under FSDP2: the model and optimizer shards of every rank (torch.distributed.checkpoint), which
  resume reads instead of the model files and `optimizer.pt` (see `trainer.parallel.transforms.save_sharded`);
- `deepspeed/` under DeepSpeed: its own checkpoint (each rank's ZeRO partitions of model and optimizer, and the
  scheduler), which resume reads instead of the model files, `optimizer.pt` and `scheduler.pt`, on the same
  number of processes only (trainer/parallel/deepspeed_engine.py);
- `optimizer.pt`, `scheduler.pt`, `scaler.pt` (fp16 only), `rng_state.pth` (per rank: `rng_state_<rank>.pth`
  when there are several), `data_state.json` (the loader's position), `method_state.pt` (what a method carries from
  one optimizer step to the next, when it carries anything: GRPO's buffered generation inside its cycle),
  `trainer_state.json`, `training_args.json`.

Resuming under another number of processes (the Trainer checks the conditions, docs/multi_gpu.md):
- exact: the model and optimizer (DCP reshards `dcp/` to any layout, or to whole tensors for one process or
  DDP; `optimizer.pt` of one process or DDP is split into an FSDP2 run's shards), the scheduler and the
  scaler (global, not per rank), and the data position, provided the global batch
  (per_device_train_batch_size x processes x gradient_accumulation_steps) and the micro batch stay the same:
  the loader plans one global list of micro batches and counts how many all ranks consumed together, so each
  optimizer step takes the same examples under any number of processes;
- not exact: the per-rank RNG streams (dropout, NEFTune noise) have no counterpart under another number of
  ranks; they are re-seeded from (seed, global step, rank), with a one-line warning. Without NEFTune our model
  draws no random numbers in training, so the loss curve continues as an uninterrupted run's to fp32 rounding.

Atomicity: everything is written into `checkpoint-<step>.tmp` and renamed into place as the last act, so a
crash while saving never leaves a directory named `checkpoint-<step>` behind; `latest_checkpoint` also
requires `trainer_state.json`, which is written last inside the temporary directory.
Durability: before the rename every file and directory of the checkpoint is fsynced, and after it the parent
directory, so a checkpoint that exists after a power cut holds the bytes that were written (not only after a
killed process, which the page cache already survives).
Integrity: `manifest.json`, written last before the rename, lists every file with its size and CRC-32 (zlib's,
6.4 GB/s measured here on one core: a 2.5 GB checkpoint costs about 0.4 s to check). `verify_checkpoint` compares
the files with it; `resolve_resume` skips a damaged checkpoint for `auto` (one line naming the file) and refuses
one given by path. Checkpoints written before manifests existed have none and are taken as they are.

`torch.load` is only ever called with `weights_only=True`.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import random
import re
import shutil
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import torch

from trainer.checkpoint_hf import CheckpointError, to_json

PREFIX = "checkpoint"
MANIFEST = "manifest.json"  # file -> size and CRC-32, written last before the rename
METHOD_STATE = "method_state.pt"  # a method's state between steps (tensors, alike on every rank: rank 0 writes it)
_CKPT_RE = re.compile(rf"^{PREFIX}-(\d+)$")


class OutOfSpaceError(OSError):
    """A checkpoint does not fit on its device: the message says how much it needs and how much is free."""


# Less than this free after a failed write means the device filled up: torch.save reports a full disk as
# "unexpected pos N vs M", not as ENOSPC (seen on a 200 MB tmpfs).
_FULL_BYTES = 16 << 20


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n} bytes"


def _tree_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file()) if directory.is_dir() else 0


LOCK_FILE = ".run.lock"  # flock-ed by the run that owns output_dir; holds its pid
# What a run writes at the top of output_dir besides checkpoints (model, tokenizer, adapter, results); an overwriting
# run moves the earlier run's aside. The data cache, the lock and metrics.jsonl (the jsonl logger moves it) stay.
RUN_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "model.safetensors.index.json",
    "model-*-of-*.safetensors",
    "adapter_config.json",
    "adapter_model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "training_args.json",
    "final_metrics.json",
    "sft_args.json",
    "loss_curve.png",
)


@contextlib.contextmanager
def hold_output_dir(output_dir: str | Path, rank: int = 0):
    """Own output_dir for the duration: an exclusive flock on output_dir/.run.lock (rank 0 only). The kernel releases
    it on any exit, SIGKILL included, so a stale lock never blocks; a second run is refused with the holder's pid."""
    if rank != 0:
        yield
        return
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    fd = os.open(out / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            raise CheckpointError(
                f"output_dir: {out} is in use by another run (pid {holder}); wait for it to end or "
                "give another --output_dir"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


# safetensors writes through a Rust NamedTempFile (".tmp" + 6 characters) renamed into place: a kill during the final
# save leaves one, as large as the model.
_SAFETENSORS_TMP = re.compile(r"^\.tmp[A-Za-z0-9]{6}$")


def clean_leftovers(output_dir: str | Path) -> list[str]:
    """Remove what interrupted runs leave in output_dir (call it holding the lock: no other run is writing there):
    partial checkpoints (checkpoint-N.tmp), half-deleted ones (checkpoint-N.deleting) and safetensors' temporary
    files. Returns their names."""
    out = Path(output_dir)
    if not out.is_dir():
        return []
    removed = []
    for p in sorted(out.iterdir()):
        if (
            p.is_dir()
            and _CKPT_RE.match(p.name.removesuffix(".tmp").removesuffix(".deleting"))
            and p.suffix in (".tmp", ".deleting")
        ):
            shutil.rmtree(p, ignore_errors=True)
        elif p.is_file() and _SAFETENSORS_TMP.match(p.name):
            p.unlink()
        else:
            continue
        removed.append(p.name)
    return removed


def move_aside_previous_run(output_dir: str | Path) -> Path | None:
    """Move an earlier run's checkpoints and model files into output_dir/overwritten-<time>/ (a rename: no copy),
    so that nothing of it outranks this run's (rotation, "newest", resume auto) and nothing is lost. Returns the
    folder, or None when there was nothing to move."""
    out = Path(output_dir)
    if not out.is_dir():
        return None
    found = sorted(
        {p for p in out.glob(f"{PREFIX}-*") if p.is_dir()}
        | {p for pattern in RUN_FILES for p in out.glob(pattern) if p.is_file()}
    )
    if not found:
        return None
    aside = out / time.strftime("overwritten-%Y%m%d-%H%M%S")
    n = 1
    while aside.exists():
        aside, n = aside.with_name(f"{aside.name.split('.')[0]}.{n}"), n + 1
    aside.mkdir()
    for p in found:
        os.replace(p, aside / p.name)
    _fsync(out)
    return aside


def checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints in output_dir, oldest step first."""
    out = Path(output_dir)
    if not out.is_dir():
        return []
    found = []
    for child in out.iterdir():
        m = _CKPT_RE.match(child.name)
        if m and child.is_dir() and (child / "trainer_state.json").is_file():
            found.append((int(m.group(1)), child))
    return [p for _, p in sorted(found)]


def checkpoint_step(path: str | Path) -> int:
    """The global step a checkpoint-<step> directory was saved at."""
    return int(_CKPT_RE.match(Path(path).name).group(1))


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    found = checkpoints(output_dir)
    return found[-1] if found else None


def resolve_resume(resume_from_checkpoint, output_dir, say=None) -> Path | None:
    """`resume_from_checkpoint` as Hugging Face takes it: a path, or True/"auto" for the newest complete one.

    "auto" skips checkpoints whose files do not match their manifest, newest first, saying so in one line each
    through `say` (default: stderr), and starts from step 0 (None) when there is no complete checkpoint at all;
    a path to a damaged checkpoint is a CheckpointError."""
    if resume_from_checkpoint in (None, False, "", "false", "False"):
        return None
    say = say or (lambda line: print(line, file=sys.stderr))
    if resume_from_checkpoint is True or str(resume_from_checkpoint).lower() in ("true", "auto", "latest"):
        found = checkpoints(output_dir)
        for path in reversed(found):
            problem = verify_checkpoint(path)
            if problem is None:
                return path
            say(f"resume_from_checkpoint auto: skipping {path.name}, it is damaged ({problem})")
        if found:
            raise CheckpointError(
                f"resume_from_checkpoint: every checkpoint in {output_dir} is damaged "
                f"({len(found)} checked); start again with --overwrite_output_dir"
            )
        # A run killed before its first save completed: its resume command starts it again (transformers raises
        # "No valid checkpoint found" here, which left such a run only --overwrite_output_dir).
        say(f"resume_from_checkpoint auto: no complete checkpoint in {output_dir}; starting from step 0")
        return None
    path = Path(resume_from_checkpoint)
    if not (path / "trainer_state.json").is_file():
        raise CheckpointError(f"resume_from_checkpoint: {path} is not a complete checkpoint (no trainer_state.json)")
    problem = verify_checkpoint(path)
    if problem is not None:
        raise CheckpointError(
            f"resume_from_checkpoint: {path} is damaged ({problem}); give an earlier checkpoint, "
            "or --resume_from_checkpoint auto to take the newest intact one"
        )
    return path


def _crc32(file: Path) -> int:
    crc = 0
    with file.open("rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return crc


def _files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST)


def write_manifest(directory: Path) -> None:
    """manifest.json: every file under directory (relative path) with its size and CRC-32."""
    entries = {
        p.relative_to(directory).as_posix(): {"size": p.stat().st_size, "crc32": _crc32(p)} for p in _files(directory)
    }
    (directory / MANIFEST).write_text(json.dumps({"files": entries}, indent=1, sort_keys=True) + "\n")


def verify_checkpoint(path: str | Path) -> str | None:
    """None when every file of the checkpoint matches its manifest (or it predates manifests), else the first
    problem, naming the file: missing, another size, another checksum, or an unreadable manifest."""
    path = Path(path)
    manifest = path / MANIFEST
    if not manifest.is_file():
        return None
    try:
        entries = json.loads(manifest.read_text())["files"]
        items = [(name, int(e["size"]), int(e["crc32"])) for name, e in entries.items()]
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError):
        return f"{manifest}: unreadable"
    for name, size, crc in items:
        file = path / name
        if not file.is_file():
            return f"{file}: missing"
        actual = file.stat().st_size
        if actual != size:
            return f"{file}: {actual} bytes, {size} when saved"
        if _crc32(file) != crc:
            return f"{file}: contents changed since it was saved (CRC-32 mismatch)"
    return None


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(directory: Path) -> None:
    """fsync every file and directory under directory, and directory itself."""
    for p in sorted(directory.rglob("*"), key=lambda q: len(q.parts), reverse=True):
        _fsync(p)
    _fsync(directory)


def rng_state() -> dict:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "cpu": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _rng_file(rank: int, world_size: int) -> str:
    return "rng_state.pth" if world_size == 1 else f"rng_state_{rank}.pth"


def _python_rng_to_tensorable(state: dict) -> dict:
    # torch.load(weights_only=True) accepts tensors, lists, tuples, dicts and primitives, not numpy arrays:
    # store the numpy and python generator states in those terms.
    py_version, py_state, py_gauss = state["python"]
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = state["numpy"]
    out = dict(state)
    out["python"] = [py_version, list(py_state), py_gauss]
    out["numpy"] = [
        np_name,
        torch.from_numpy(np.asarray(np_keys, dtype=np.int64)),
        int(np_pos),
        int(np_has_gauss),
        float(np_gauss),
    ]
    return out


def _python_rng_from_tensorable(state: dict) -> dict:
    out = dict(state)
    version, py_state, gauss = state["python"]
    out["python"] = (version, tuple(py_state), gauss)
    name, keys, pos, has_gauss, gauss_np = state["numpy"]
    out["numpy"] = (name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss_np)
    return out


def save_checkpoint(
    output_dir,
    step: int,
    *,
    save_model,
    save_engine=None,
    data_state: dict | None = None,
    method_state: dict | None = None,
    trainer_state: dict,
    args_dict: dict,
    rank: int = 0,
    world_size: int = 1,
    save_only_model: bool = False,
) -> Path:
    """Write checkpoint-<step> atomically; `save_model(dir)` writes the model files, `save_engine(dir)` the
    engine's state (optimizer, scheduler, scaler; with FSDP2 or DeepSpeed the model's shards too, in `dcp/` or
    `deepspeed/`: trainer/loop/engine.py), and `method_state` (a dict of tensors, when not None) goes to
    method_state.pt, unless save_only_model. Returns the final path.

    With several processes every rank calls this: `save_model` (a collective for a sharded model; it writes on
    rank 0) and `save_engine` (each rank writes its shards; what all ranks hold alike, rank 0 alone) run on all
    ranks, each rank writes its own RNG file, and rank 0 writes the rest and renames the directory into place
    once all ranks are done."""
    out = Path(output_dir)
    final = out / f"{PREFIX}-{step}"
    tmp = out / f"{PREFIX}-{step}.tmp"
    writer = rank == 0
    if writer:
        if tmp.exists():
            shutil.rmtree(tmp)
        out.mkdir(parents=True, exist_ok=True)
        previous = latest_checkpoint(out)
        needed, free = _tree_bytes(previous) if previous else 0, shutil.disk_usage(out).free
        if needed > free:  # the last checkpoint's size is the best estimate of this one's: refuse before writing
            raise OutOfSpaceError(
                errno.ENOSPC,
                f"no space for {final.name}: it needs about {_gb(needed)} (the size of "
                f"{previous.name}) and {out} has {_gb(free)} free",
            )
        tmp.mkdir(parents=True)
    _barrier(world_size)  # the directory exists before any rank writes into it
    try:
        _write_checkpoint(
            tmp,
            final,
            out,
            writer=writer,
            rank=rank,
            world_size=world_size,
            save_model=save_model,
            save_engine=save_engine,
            data_state=data_state,
            method_state=method_state,
            trainer_state=trainer_state,
            args_dict=args_dict,
            save_only_model=save_only_model,
        )
    except Exception as exc:
        written, free = _tree_bytes(tmp), shutil.disk_usage(out).free
        if writer:
            shutil.rmtree(tmp, ignore_errors=True)  # a partial checkpoint must not hold the space it filled
        full = (isinstance(exc, OSError) and exc.errno == errno.ENOSPC) or free < _FULL_BYTES
        if not full:
            raise
        raise OutOfSpaceError(
            errno.ENOSPC,
            f"the device of {out} is out of space: {final.name} needs more than the "
            f"{_gb(written)} written when it filled up ({_gb(free)} free); the partial "
            f"{tmp.name} was removed, earlier checkpoints are untouched",
        ) from None
    _barrier(world_size)  # no rank goes on (and maybe reads it) before the checkpoint is in place
    return final


def _write_checkpoint(
    tmp: Path,
    final: Path,
    out: Path,
    *,
    writer: bool,
    rank: int,
    world_size: int,
    save_model,
    save_engine,
    data_state,
    method_state,
    trainer_state,
    args_dict,
    save_only_model,
) -> None:
    """save_checkpoint's writes into tmp, then the rename to final (rank 0)."""
    save_model(tmp)
    if not save_only_model:
        if save_engine is not None:
            save_engine(tmp)
        if writer and data_state is not None:
            (tmp / "data_state.json").write_text(to_json(data_state, indent=2) + "\n")
        if writer and method_state is not None:
            torch.save(method_state, tmp / METHOD_STATE)
        torch.save(_python_rng_to_tensorable(rng_state()), tmp / _rng_file(rank, world_size))
    _barrier(world_size)  # every rank's files are written
    if writer:
        (tmp / "training_args.json").write_text(to_json(args_dict, indent=2, sort_keys=True, default=str) + "\n")
        # trainer_state.json last: its presence marks the directory complete.
        (tmp / "trainer_state.json").write_text(to_json(trainer_state, indent=2, default=str) + "\n")
        write_manifest(tmp)
        fsync_tree(tmp)  # the bytes reach the disk before the name does: a power cut leaves no half checkpoint
        if final.exists():  # re-saving the same step (e.g. SIGTERM right after a scheduled save)
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync(out)  # the rename itself


def _barrier(world_size: int) -> None:
    if world_size > 1:
        torch.distributed.barrier()


def saved_world_size(path) -> int:
    """How many processes wrote the checkpoint at `path` (one RNG file each); 0 when it holds none."""
    path = Path(path)
    return len(list(path.glob("rng_state_*.pth"))) or (1 if (path / "rng_state.pth").is_file() else 0)


def read_state(path, name: str):
    """The tensors of `path`/`name` (a torch.save file) on the CPU; one CheckpointError line when it is missing."""
    file = Path(path) / name
    if not file.is_file():
        raise CheckpointError(f"{file}: missing (was the checkpoint saved with save_only_model?)")
    return torch.load(file, map_location="cpu", weights_only=True)


def load_training_state(path, *, rank: int = 0, world_size: int = 1, seed: int = 0) -> dict:
    """Restore the RNG from a checkpoint (the engine's state is the engine's: trainer/loop/engine.py); returns
    {'trainer_state', 'data_state', 'method_state', 'rng_reseeded'} (method_state None when the checkpoint has none).

    Saved by another number of processes, each rank's RNG stream has no counterpart: the generators are re-seeded
    from (seed, global step, rank) instead, deterministically, and 'rng_reseeded' is True (the caller says so).
    Whether the rest of such a resume is exact is the caller's to check (Trainer: same global batch)."""
    path = Path(path)
    trainer_state = json.loads((path / "trainer_state.json").read_text())
    saved_world = saved_world_size(path)
    reseeded = bool(saved_world) and saved_world != world_size
    if reseeded:
        reseed(seed, int(trainer_state.get("global_step", 0)), rank)
    else:
        set_rng_state(_python_rng_from_tensorable(read_state(path, _rng_file(rank, world_size))))
    data_file = path / "data_state.json"
    return {
        "trainer_state": trainer_state,
        "data_state": json.loads(data_file.read_text()) if data_file.is_file() else None,
        "method_state": read_state(path, METHOD_STATE) if (path / METHOD_STATE).is_file() else None,
        "rng_reseeded": reseeded,
    }


def reseed(seed: int, step: int, rank: int) -> None:
    """Seed Python, NumPy and torch (CPU and CUDA) from (seed, step, rank): distinct per rank and per resume point."""
    value = int(np.random.SeedSequence([seed, step, rank]).generate_state(1, dtype=np.uint64)[0] >> 1)
    random.seed(value)
    np.random.seed(value % 2**32)
    torch.manual_seed(value)


def rotate_checkpoints(output_dir, save_total_limit: int | None, best_checkpoint: str | None = None) -> list[Path]:
    """Delete the oldest complete checkpoints beyond save_total_limit, never the best one; returns the deleted.

    Hugging Face semantics: the best checkpoint (when tracked) is always kept, so with a limit of 1 and a best
    that is not the newest, two directories remain. Leftover `.tmp` directories from crashed saves are removed.
    """
    out = Path(output_dir)
    for stale in out.glob(f"{PREFIX}-*.tmp"):
        shutil.rmtree(stale, ignore_errors=True)
    if not save_total_limit or save_total_limit <= 0:
        return []
    found = checkpoints(out)
    best = Path(best_checkpoint).resolve() if best_checkpoint else None
    keep_newest = save_total_limit
    if best is not None and save_total_limit > 1 and best not in [p.resolve() for p in found[-keep_newest:]]:
        keep_newest -= 1  # an older best takes one of the slots (with a limit of 1: newest + best)
    keep = set(p.resolve() for p in found[-keep_newest:])
    if best is not None:
        keep.add(best)
    deleted = []
    for p in found:
        if p.resolve() not in keep:
            # Renamed first: a kill during the removal leaves a .deleting directory (cleaned at the next start), never
            # a half-deleted checkpoint-N that still looks complete.
            doomed = p.with_name(p.name + ".deleting")
            os.replace(p, doomed)
            shutil.rmtree(doomed, ignore_errors=True)
            deleted.append(p)
    return deleted
