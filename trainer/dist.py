"""The ground floor for processes: who this process is, which device it drives, which rows of a sharded
parameter it holds, and gathering batches from every rank. It imports no other module of the trainer, and the
architecture (`trainer/model/causal_lm.py`) never imports it: the sharded model build (`trainer.sft`), the loop and the
transforms (`trainer/parallel/transforms.py`) stand on it.

Several processes come from a launcher (torchrun, accelerate launch) that sets RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR and MASTER_PORT; `init_distributed()` reads them (nccl on CUDA, gloo on CPU). `gather_batches` is a
collective: every rank calls it.

Test: python -m pytest tests/trainer/parallel/test_distributed.py -q   (2 processes on CPU with gloo)
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import traceback

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset


def world() -> tuple[int, int]:
    """(rank, world_size) of the default process group, (0, 1) without one."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


# ---- process group ----------------------------------------------------------------------------------------------
def init_distributed() -> tuple[int, int]:
    """Join the default process group a launcher describes in the environment; (rank, world_size).

    A no-op returning (0, 1) when WORLD_SIZE is unset or 1, and (rank, world_size) of the existing group when
    one is already initialised (so that calling it from the CLI and again from Trainer is harmless)."""
    if not torch.distributed.is_available():
        return 0, 1
    if torch.distributed.is_initialized():
        return world()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return 0, 1
    missing = [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(
            f"WORLD_SIZE={world_size} but {', '.join(missing)} not set: launch with torchrun or "
            "accelerate launch, which set them"
        )
    torch.distributed.init_process_group(backend=_backend_on_local_device())
    return world()


def init_single_process_group() -> None:
    """A process group of this one process, for an engine that needs one without a launcher (DeepSpeed, which would
    otherwise look for MPI to find its peers). An in-memory store: no port to pick. LOCAL_RANK, which only
    launchers set and DeepSpeed reads, is 0."""
    os.environ.setdefault("LOCAL_RANK", "0")
    torch.distributed.init_process_group(
        _backend_on_local_device(), store=torch.distributed.HashStore(), rank=0, world_size=1
    )


def _backend_on_local_device() -> str:
    """The process group's backend, with CUDA's current device set to this process's: nccl for the CUDA tensors and
    gloo beside it for the few CPU-side collectives (object gathers in DCP planning), which nccl cannot carry; gloo
    alone without CUDA."""
    if not torch.cuda.is_available():
        return "gloo"
    torch.cuda.set_device(local_device())
    return "cuda:nccl,cpu:gloo"


def local_device() -> torch.device:
    """This process's device: cuda:LOCAL_RANK where CUDA exists, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def end_on_error(exc: BaseException) -> int:
    """Report an exception raised on this rank and leave the process group, so the job ends instead of hanging.

    The other ranks are blocked in (or will reach) a collective with this one: with gloo they fail at once
    when its connections close; with nccl torchrun's agent sees this process exit non-zero and stops the rest.
    With several processes the process ends here (exit code 1); with one, the exit code 1 is returned."""
    rank, world_size = world()
    prefix = f"[rank {rank}/{world_size}] " if world_size > 1 else ""
    print(f"{prefix}error: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
    traceback.print_exception(exc, file=sys.stderr)
    sys.stderr.flush()
    if world_size > 1:
        # Leaving the group closes this rank's connections: gloo peers blocked on it fail at once (measured:
        # the 2-process failure test ends in ~1 s after the error). nccl peers stay blocked on the GPU until
        # torchrun, seeing this exit code, terminates them (SIGTERM, then SIGKILL after its 30 s grace).
        # Leaving can itself block, and so can the interpreter's shutdown after it (seen on gloo: 3 of 8 runs of
        # the 2-process failure test hung there after both ranks had reported): it gets _LEAVE_S in a daemon
        # thread, then the process ends at once with exit code 1 (no atexit handlers: the error is reported, and
        # a checkpoint on disk is complete or absent by construction).
        leave = threading.Thread(target=_leave_group, daemon=True)
        leave.start()
        leave.join(_LEAVE_S)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    return 1


_LEAVE_S = 10.0


def _leave_group() -> None:
    with contextlib.suppress(Exception):
        torch.distributed.destroy_process_group()


def local_shard(param: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int] | None]:
    """(the tensor this rank holds, its rows start:stop of dim 0 in the full parameter) for a DTensor parameter
    (FSDP2 shards dim 0 unevenly as torch.chunk does; the local tensor has no padding, an empty one has no rows);
    (param, None) for a plain tensor. Writing into the returned tensor writes the parameter."""
    if not isinstance(param, DTensor):
        return param, None
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    local = param.to_local()
    if tuple(shape[1:]) != tuple(param.shape[1:]) or any(offset[1:]) or tuple(local.shape) != tuple(shape):
        raise ValueError(
            f"a parameter of shape {tuple(param.shape)} placed as {param.placements} is not split "
            "along dim 0 only (FSDP2 without tensor parallelism)"
        )
    return local, (offset[0], offset[0] + shape[0])


# ---- evaluation with several processes -----------------------------------------------------------------------------
def gather_batches(batches: list[torch.Tensor], pad) -> list[list[torch.Tensor]]:
    """Every rank's list of batch tensors (B_i, T_i, ...), on every rank: [rank 0's, rank 1's, ...]; a collective.

    Each rank concatenates its batches padded with `pad` to the longest T of all ranks and to the most rows of
    any rank, the padded tensors are all-gathered, and each rank's batches are cut back out at their own shapes
    (shapes and dtype travel first, as objects), so what comes back is exactly what every rank had."""
    _, world_size = world()
    meta = [tuple(tuple(b.shape) for b in batches), str(batches[0].dtype) if batches else None]
    metas: list = [None] * world_size
    torch.distributed.all_gather_object(metas, meta)
    shapes = [m[0] for m in metas]
    dtype = next((getattr(torch, m[1].removeprefix("torch.")) for m in metas if m[1]), None)
    if dtype is None:
        return [[] for _ in range(world_size)]
    all_shapes = [s for rank_shapes in shapes for s in rank_shapes]
    trailing = all_shapes[0][1:]
    if any(s[2:] != trailing[1:] for s in all_shapes) or any(len(s) != len(trailing) + 1 for s in all_shapes):
        raise ValueError("gather_batches: the batches differ in more than their first two dimensions")
    width = max(s[1] for s in all_shapes) if len(trailing) else None
    rows = max(sum(s[0] for s in rank_shapes) for rank_shapes in shapes)
    # CPU tensors go through gloo, which init_distributed sets up beside nccl; a group without it gathers on the device.
    device = torch.device("cpu") if "gloo" in str(torch.distributed.get_backend()) else local_device()
    buffer = torch.full((rows, *(() if width is None else (width, *trailing[1:]))), pad, dtype=dtype, device=device)
    start = 0
    for b in batches:
        index = (slice(start, start + b.shape[0]),) + ((slice(0, b.shape[1]),) if width is not None else ())
        buffer[index] = b.to(device)
        start += b.shape[0]
    gathered = [torch.empty_like(buffer) for _ in range(world_size)]
    torch.distributed.all_gather(gathered, buffer)
    out = []
    for tensor, rank_shapes in zip(gathered, shapes):
        mine, start = [], 0
        for s in rank_shapes:
            index = (slice(start, start + s[0]),) + ((slice(0, s[1]),) if width is not None else ())
            mine.append(tensor[index].cpu())
            start += s[0]
        out.append(mine)
    return out
