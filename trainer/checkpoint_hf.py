"""Hugging Face safetensors checkpoints: read into existing tensors, write (sharded) from a state dict.

Layout (what `transformers` reads and writes): `model.safetensors`, or shards `model-0000k-of-0000n.safetensors`
with `model.safetensors.index.json` = {"metadata": {"total_size": bytes}, "weight_map": {name: shard}};
every file carries the metadata {"format": "pt"}. Sizes are decimal as in Hugging Face ("5GB" = 5e9 bytes;
"5GiB" = 5 * 2**30).

Reading never holds more than one tensor beyond the destination: keys and shapes are checked first from the
headers (no data read; `check_safetensors`, which also refuses a truncated or damaged file in one line naming it),
then each tensor is read once and copied (with its dtype cast) into its destination.
A destination that holds only some rows of a tensor (a rank's FSDP2 shard) gets only those rows read from the
file (`safe_open(...).get_slice(name)[start:stop]`): the whole tensor is never materialised.
Writing casts and writes one shard at a time. safetensors creates its files with mode 0600; they are set to what
`open()` gives every other file of the directory (0666 less the umask, usually 0644) so that a shared model
directory stays readable by the group and others.

This module knows nothing about the model; `trainer.build.load_pretrained` / `save_pretrained` use it.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_SHARD_RE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


class CheckpointError(ValueError):
    """A checkpoint or model directory that cannot be read or written as asked (or resumed from), in one line naming
    the file and the reason. The one class for both layers: these files and trainer/loop/checkpoint.py's directories."""


def read_json(file: Path) -> dict:
    if not file.is_file():
        raise CheckpointError(f"{file}: not found")
    try:
        value = json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{file}:{exc.lineno}:{exc.colno}: invalid JSON ({exc.msg})") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{file}: expected a JSON object")
    return value


NON_FINITE_SUFFIX = "_non_finite"  # beside a key whose number was NaN or infinite: the value it had


def _finite_only(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            out[key] = _finite_only(item)
            if isinstance(item, float) and not math.isfinite(item):
                out[f"{key}{NON_FINITE_SUFFIX}"] = str(item)  # "nan", "inf" or "-inf"
        return out
    if isinstance(value, (list, tuple)):
        return [_finite_only(item) for item in value]
    return value


def to_json(value, **kwargs) -> str:
    """json.dumps that a strict reader parses: a NaN or infinite number becomes null, with the value it had beside
    it under `<key>_non_finite` ("nan", "inf", "-inf"; in a list, null alone). Python's json writes bare NaN, which
    is not JSON; transformers' trainer_state.json has it after a NaN loss (a deliberate difference)."""
    return json.dumps(_finite_only(value), allow_nan=False, **kwargs)


def parse_size(value: int | str) -> int:
    """Bytes from an int or a string like '500MB', '5GB', '2GiB' (decimal units as in Hugging Face)."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", str(value), flags=re.IGNORECASE)
    if match is None or float(match.group(1)) <= 0:
        raise CheckpointError(
            f"max_shard_size {value!r}: expected a positive number of bytes or a string like '500MB' or '5GB'"
        )
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "").upper()])


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a model directory: the single file, else the shards its index names."""
    if (path / SINGLE_FILE).is_file():
        return [path / SINGLE_FILE]
    if (path / INDEX_FILE).is_file():
        weight_map = read_json(path / INDEX_FILE).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{path / INDEX_FILE}: no 'weight_map' naming the shard of each tensor")
        files = [path / name for name in dict.fromkeys(weight_map.values())]
        for file in files:
            if not file.is_file():
                raise CheckpointError(f"{file}: shard listed in {INDEX_FILE} not found")
        return files
    raise CheckpointError(
        f"{path}: no {SINGLE_FILE} or {INDEX_FILE} (only safetensors checkpoints are read; "
        "convert .bin files with transformers' save_pretrained)"
    )


def _listing(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def read_tensor(f, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
    """Tensor `name` of an open safetensors file `f`, or only its rows start:stop of dim 0 (read from the file
    alone: the other rows are never loaded)."""
    if rows is None:
        return f.get_tensor(name)
    return f.get_slice(name)[rows[0] : rows[1]]


def open_safetensors(file: Path):
    """`safe_open(file)` (CPU, torch); a file that is not a complete safetensors file is one CheckpointError line
    naming it. safetensors checks the header when it opens a file, and that its offsets cover the file exactly, so a
    truncated file (an interrupted download or copy) is refused here, before any tensor is read."""
    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(
            f"{file}: not a complete safetensors file ({exc}); the file is damaged or truncated "
            "(an interrupted download or copy?): download or copy it again"
        ) from None


def check_safetensors(
    path: Path, shapes: dict[str, tuple[int, ...]], ignore: Callable[[str], bool] = lambda k: False
) -> list[Path]:
    """The safetensors files of the checkpoint at `path`, after checking from their headers alone (no tensor data
    read) that each file is complete and that they hold exactly the tensors `shapes` names, with those shapes (keys
    for which `ignore(name)` holds are skipped). Every problem is one CheckpointError line naming the file, or
    listing the missing, unexpected and mismatched keys together."""
    files = checkpoint_files(Path(path))
    seen, unexpected, mismatched = set(), [], []
    for file in files:
        with open_safetensors(file) as f:
            for name in f.keys():
                if ignore(name):
                    continue
                if name not in shapes:
                    unexpected.append(name)
                    continue
                seen.add(name)
                shape = tuple(f.get_slice(name).get_shape())
                if shape != tuple(shapes[name]):
                    mismatched.append(f"{name} {list(shape)} vs model {list(shapes[name])}")
    missing = [name for name in shapes if name not in seen]
    problems = []
    if missing:
        problems.append(f"missing {len(missing)} keys: {_listing(missing)}")
    if unexpected:
        problems.append(f"unexpected {len(unexpected)} keys: {_listing(unexpected)}")
    if mismatched:
        problems.append(f"{len(mismatched)} shape mismatches: {_listing(mismatched)}")
    if problems:
        raise CheckpointError(f"{path}: checkpoint does not match the model config: " + "; ".join(problems))
    return files


def load_safetensors(
    path: Path,
    targets: dict[str, torch.Tensor],
    ignore: Callable[[str], bool] = lambda k: False,
    rows: dict[str, tuple[tuple[int, ...], int, int]] | None = None,
) -> None:
    """Copy every tensor of the checkpoint at `path` into `targets[name]` (cast to the target's dtype/device).

    All problems (damaged files, missing keys, unexpected keys, shape mismatches) are found from the file headers
    before any data is read (`check_safetensors`); keys for which `ignore(name)` holds are skipped.
    `rows[name] = (full_shape, start, stop)` says that `targets[name]` holds only rows start:stop of dim 0 of a
    tensor of full_shape (a sharded parameter): the header must show full_shape, and only those rows are read.
    A target on the meta device is checked in the files and not read (a tensor another process holds).
    """
    rows = rows or {}
    shapes = {name: tuple(rows[name][0]) if name in rows else tuple(t.shape) for name, t in targets.items()}
    files = check_safetensors(path, shapes, ignore)
    with torch.no_grad():
        for file in files:
            with open_safetensors(file) as f:
                for name in f.keys():
                    if ignore(name) or getattr(targets[name], "is_meta", False):
                        continue
                    span = rows[name][1:] if name in rows else None
                    if span is not None and span[1] <= span[0]:
                        continue  # an empty shard (more ranks than rows)
                    targets[name].copy_(read_tensor(f, name, span))


def _new_file_mode() -> int:
    """The permission bits `open(name, "w")` gives a new file: 0o666 less the process umask."""
    umask = os.umask(0)  # reading the umask means setting it; restored at once
    os.umask(umask)
    return 0o666 & ~umask


def save_safetensors(
    tensors: dict[str, torch.Tensor], path: Path, max_shard_size: int | str = "5GB", dtype: torch.dtype | None = None
) -> list[Path]:
    """Write `tensors` (cast to `dtype` when given) as one file or as shards plus an index; return the files.

    Earlier checkpoint files in `path` are removed first: a stale `model.safetensors` would otherwise shadow
    a new sharded index (readers prefer the single file).
    """
    limit = parse_size(max_shard_size)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    for old in [path / SINGLE_FILE, path / INDEX_FILE, *(p for p in path.iterdir() if _SHARD_RE.fullmatch(p.name))]:
        old.unlink(missing_ok=True)

    def nbytes(t: torch.Tensor) -> int:
        return t.numel() * (dtype or t.dtype).itemsize

    shards, current, size = [], [], 0
    for name, t in tensors.items():  # greedy in state-dict order; a tensor over the limit gets its own shard
        if current and size + nbytes(t) > limit:
            shards.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes(t)
    shards.append(current)

    names = (
        [SINGLE_FILE]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    weight_map = {}
    for file_name, shard in zip(names, shards):
        # one shard's cast copies at a time: never a full second copy of the model
        data = {k: tensors[k].detach().to(device="cpu", dtype=dtype or tensors[k].dtype).contiguous() for k in shard}
        save_file(data, str(path / file_name), metadata={"format": "pt"})
        os.chmod(path / file_name, _new_file_mode())
        weight_map.update({k: file_name for k in shard})
        del data
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(nbytes(t) for t in tensors.values())}, "weight_map": weight_map}
        (path / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return [path / n for n in names]
