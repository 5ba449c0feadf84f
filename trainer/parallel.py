"""Transforms applied to a model from outside, always in this order (torchtitan's parallelize.py):

1. `apply_activation_checkpointing`: recompute each decoder block in backward (non-reentrant);
2. `apply_compile`: `torch.compile` each decoder block separately (small graphs, fast compiles, one
   graph reused by every block since they share code and shapes);
3. data parallelism (FSDP2 / DDP) for several processes.

`apply_all(model, args)` runs the single-process part in that order. Our `CausalLM` exposes its blocks as
`model.model.layers`; any other module is compiled whole and checkpointed only if it offers
`set_gradient_checkpointing`/`gradient_checkpointing_enable`.
"""

from __future__ import annotations

import torch
from torch import nn


def decoder_blocks(model: nn.Module) -> nn.ModuleList | None:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    return layers if isinstance(layers, nn.ModuleList) else None


def apply_activation_checkpointing(model: nn.Module, kwargs: dict | None = None) -> nn.Module:
    kwargs = dict(kwargs or {})
    if kwargs.get("use_reentrant", False):
        raise ValueError("gradient_checkpointing_kwargs: use_reentrant=True is not supported (non-reentrant only)")
    kwargs.pop("use_reentrant", None)
    if hasattr(model, "set_gradient_checkpointing"):
        model.set_gradient_checkpointing(True, **kwargs)
    elif hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False, **kwargs})
    else:
        raise ValueError(f"gradient_checkpointing: {type(model).__name__} has no per-block checkpointing switch")
    return model


def apply_compile(model: nn.Module, backend: str | None = None, mode: str | None = None) -> nn.Module:
    """Compile each decoder block (or the whole module when it has no blocks) in place."""
    options = {"backend": backend or "inductor"}
    if mode:
        options["mode"] = mode
    blocks = decoder_blocks(model)
    if blocks is None:
        model.compile(**options)
        return model
    for block in blocks:
        block.compile(**options)
    return model


def apply_all(model: nn.Module, args) -> nn.Module:
    if args.gradient_checkpointing:
        apply_activation_checkpointing(model, args.gradient_checkpointing_kwargs)
    if args.torch_compile:
        apply_compile(model, args.torch_compile_backend, args.torch_compile_mode)
    return model


def world() -> tuple[int, int]:
    """(rank, world_size) of the default process group, (0, 1) without one."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1
