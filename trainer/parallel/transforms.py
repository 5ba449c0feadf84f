"""Transforms applied to a model from outside, always in this order (torchtitan's parallelize.py):

0. `trainer.model.quant.quantize_base` (load_in_4bit, load_in_8bit): the decoder's linear layers in 4 or 8 bits
   (bitsandbytes, imported only then), before LoRA so that peft wraps them with its 4-bit or 8-bit LoRA layer;
   `trainer.model.lora.apply_lora` (use_peft): inject the LoRA adapter, so that the optimizer sees only the adapter as
   trainable and FSDP2 shards the model with its adapter;
1. `apply_activation_checkpointing`: recompute each decoder block in backward (non-reentrant);
2. `apply_compile`: `torch.compile` each decoder block separately (small graphs, fast compiles, one
   graph reused by every block since they share code and shapes);
3. data parallelism for several processes: `apply_fsdp` (FSDP2 `fully_shard` on each decoder block, then
   the root) or `apply_ddp` (DistributedDataParallel).

`apply_transforms(model, args)` runs 1-2 and FSDP2 (safe on the meta device), `apply_data_parallel` wraps DDP
(after the weights exist: DDP broadcasts rank 0's), `apply_all` both; each is idempotent and returns the model to
train (a DDP wrapper for ddp; FSDP2 shards in place). Our `CausalLM` exposes its blocks as `model.model.layers`;
any other module is compiled whole, checkpointed only if it offers
`set_gradient_checkpointing`/`gradient_checkpointing_enable`, and sharded as one FSDP unit.

FSDP2 without any rank holding the full model (`trainer.build.build_model`): the model is built on the meta
device, the transforms run there, `to_empty` allocates only this rank's shards (FSDP2 splits dim 0 of every parameter as
`torch.chunk` does: ceil(rows / world) rows per rank, the last ranks shorter or empty; `local_shard` gives a
rank its rows), the rotary buffers are recomputed, and the shards are filled from the Hugging Face safetensors
(each rank reads only its rows from the file), from a DCP copy, or by a preset's seeded init (every rank draws
each full weight in turn with the same generator and keeps its rows: bitwise the single-process init, one full
weight at a time). DDP keeps a whole replica per rank, built as for one process.

The process helpers (world, init, local device, `local_shard`, `gather_batches`) are `trainer/dist.py`'s. The
checkpoint helpers at the end (`full_model_state_dict`, `save_sharded`, `load_sharded`,
`load_full_optimizer_state`) are collectives: every rank calls them.

Test: python -m pytest tests/trainer/parallel/test_distributed.py -q   (2 processes on CPU with gloo)
"""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    fully_shard,
    register_fsdp_forward_method,
)
from torch.nn.parallel import DistributedDataParallel

from trainer.coerce import ConfigError
from trainer.dist import local_device, world
from trainer.model.lora import apply_lora, has_adapter
from trainer.model.moe import Experts
from trainer.parallel.deepspeed_engine import read_config, zero_stage


def decoder_blocks(model: nn.Module) -> nn.ModuleList | None:
    """The decoder's layers: those a model names (`decoder_layers`: the transformers path's), else `model.model.layers`
    (ours, and transformers' own models handed to the Trainer); None when there are none."""
    layers = getattr(model, "decoder_layers", None)
    if layers is None:
        layers = getattr(getattr(model, "model", None), "layers", None)
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
    """Compile each decoder block (or the whole module when it has no blocks) in place, once."""
    options = {"backend": backend or "inductor"}
    if mode:
        options["mode"] = mode
    for module in decoder_blocks(model) or (model,):
        if module._compiled_call_impl is None:  # what nn.Module.compile sets
            module.compile(**options)
    return model


# ZeRO-3 hooks every module to gather its weights, so peft's layers run there (trainer/model/fused_lora.py), and
# peft's experts' layer forms its delta over the weight itself: not over 4-bit codes.
ZERO3_4BIT_EXPERTS = (
    "load_in_4bit: the 4-bit experts of a mixture-of-experts model train on one process, under DDP, FSDP2 "
    "or ZeRO-2, not under DeepSpeed ZeRO-3 (peft's layers run there and cannot add an adapter to 4-bit "
    "experts); use dist_config fsdp2 or ZeRO stage 2, or drop load_in_4bit"
)


def apply_transforms(model: nn.Module, args) -> nn.Module:
    """4-bit weights -> LoRA -> checkpointing -> per-block compile -> FSDP2, as `args` asks; safe on the meta device
    (`build_model` runs it there, before the weights exist) and idempotent (a model that has had a transform does
    not get it twice)."""
    if args.load_in_4bit or args.load_in_8bit:
        from trainer.model.quant import quantize_base  # bitsandbytes takes seconds to import: only when asked for

        if args.load_in_4bit and uses_zero3(args) and any(type(m) is Experts for m in model.modules()):
            raise ConfigError(ZERO3_4BIT_EXPERTS)  # the CLI says it before the build (trainer/cli_args.py)

        model = quantize_base(model, args)
    model = apply_lora(model, args)
    if args.gradient_checkpointing:
        apply_activation_checkpointing(model, args.gradient_checkpointing_kwargs)
    if args.torch_compile:
        apply_compile(model, args.torch_compile_backend, args.torch_compile_mode)
    if uses_fsdp(args) and not is_fsdp(model):
        if args.fp16:
            # The loss scaler checks each rank's own gradient shards for inf/NaN: ranks could disagree and
            # some skip the step while others take it, and the shards would drift apart.
            raise ConfigError(
                "fp16=True with dist_config name fsdp2 is not supported (its loss scaler sees only "
                "this rank's gradient shards); use --bf16, or dist_config name ddp"
            )
        model = apply_fsdp(model, args.dist_config, args.mixed_precision)
    return model


def apply_data_parallel(model: nn.Module, args) -> nn.Module:
    """DDP around `model` with several processes and dist_config ddp or none (Hugging Face's default); `model` itself
    otherwise (FSDP2 shards in place; under dist_config deepspeed `deepspeed.initialize` wraps it with the optimizer,
    trainer/parallel/deepspeed_engine.py), or when it is already wrapped. After the weights exist: DDP broadcasts rank
    0's at construction."""
    _, world_size = world()
    name = (args.dist_config or {"name": "ddp"})["name"]
    if world_size > 1 and name == "ddp" and not isinstance(model, DistributedDataParallel):
        model = apply_ddp(model)
    return model


def apply_all(model: nn.Module, args) -> nn.Module:
    """`apply_transforms` then `apply_data_parallel`: the model to train (maybe a DDP wrapper). Idempotent, so the
    Trainer applies it to whatever model it is given, built by `trainer.build.build_model` (transformed already)
    or by hand."""
    return apply_data_parallel(apply_transforms(model, args), args)


def uses_fsdp(args) -> bool:
    """Whether `args` shard the model with FSDP2 in this process group (several processes, dist_config fsdp2)."""
    return world()[1] > 1 and (args.dist_config or {}).get("name") == "fsdp2"


def uses_deepspeed(args) -> bool:
    """Whether `args` run the model through DeepSpeed's engine (dist_config name deepspeed, or --deepspeed), with
    any number of processes (trainer/parallel/deepspeed_engine.py); the transforms above still apply first."""
    return (args.dist_config or {}).get("name") == "deepspeed"


def uses_zero3(args) -> bool:
    """Whether `args` run the model through DeepSpeed ZeRO-3 (its config file's zero_optimization.stage)."""
    return uses_deepspeed(args) and zero_stage(read_config(args.dist_config["config_file"])) == 3


# ---- data parallelism -------------------------------------------------------------------------------------------
def apply_ddp(model: nn.Module) -> nn.Module:
    """Replicate `model` with DistributedDataParallel on this process's device.

    DDP broadcasts rank 0's parameters at construction, so every replica starts identical. Buffers (RoPE
    frequencies) are computed identically on every rank and never change, so they are not re-broadcast at
    every forward (forward_sync_buffers=False)."""
    device = local_device()
    model.to(device)
    # device_ids=None (allowed for a single-device module): DDP would otherwise move every input to the device, and
    # the loop moves them itself, leaving the labels on the host for the fused loss (CausalLM.takes_host_labels).
    return DistributedDataParallel(model, device_ids=None, forward_sync_buffers=False)


DCP_DIR = "dcp"  # the sharded model + optimizer copy inside a checkpoint (FSDP2): save_sharded writes it
_PARAM_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "no": None}


def apply_fsdp(model: nn.Module, dist_config: dict, precision: str = "no") -> nn.Module:
    """Shard `model` in place with FSDP2: `fully_shard` on each decoder block, then on the root.

    Parameters stay fp32 (sharded DTensors, the optimizer's master weights); `mixed_precision` (bf16|fp16|fp32;
    None follows `precision`, i.e. --bf16/--fp16) is the dtype the gathered parameters compute in, while
    gradients are reduced in fp32 so that summing over many ranks loses nothing. Each block is one
    all-gather/reduce-scatter unit (overlapped with the neighbouring block's compute); the root unit holds
    the embedding, the final norm and the (tied) head."""
    name = dist_config.get("mixed_precision") or precision or "no"
    if name not in _PARAM_DTYPES:
        raise ValueError(f"dist_config.mixed_precision={name!r}: expected one of bf16, fp16, fp32")
    offload = None
    if dist_config.get("offload_params", False):
        if not torch.cuda.is_available():
            raise ValueError(
                "dist_config.offload_params=true needs a CUDA device (FSDP2 offloads parameters from "
                "an accelerator to the CPU); set it to false on a CPU-only machine"
            )
        offload = CPUOffloadPolicy(pin_memory=bool(dist_config.get("pin_memory", True)))
    device = local_device()
    _, world_size = world()
    mesh = init_device_mesh(device.type, (world_size,))
    options = dict(
        mesh=mesh,
        reshard_after_forward=bool(dist_config.get("reshard_after_forward", True)),
        mp_policy=MixedPrecisionPolicy(param_dtype=_PARAM_DTYPES[name], reduce_dtype=torch.float32),
    )
    if offload is not None:
        options["offload_policy"] = offload
    elif not any(p.is_meta for p in model.parameters()):  # on meta, `to_empty` places the shards afterwards
        model.to(device)  # fully_shard keeps each shard where the parameter is
    for block in decoder_blocks(model) or ():
        fully_shard(block, **options)
    fully_shard(model, **options)
    if hasattr(model, "decode_step"):  # generation calls it instead of forward: gather the root's weights there too
        register_fsdp_forward_method(model, "decode_step")
    return model


def is_fsdp(model: nn.Module) -> bool:
    return isinstance(model, FSDPModule)


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside a DDP wrapper (FSDP2 shards in place: the model is its own)."""
    return getattr(model, "module", model)


@contextlib.contextmanager
def gradient_sync(model: nn.Module, enabled: bool):
    """Forward + backward inside reduce gradients across ranks only if `enabled`: the non-final micro steps of an
    accumulation window accumulate locally, and the window's gradient is reduced once, at its last backward."""
    if enabled:
        yield
    elif isinstance(model, DistributedDataParallel):
        with model.no_sync():
            yield
    elif is_fsdp(model):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield


@contextlib.contextmanager
def full_weights(model: nn.Module):
    """Inside: every FSDP2 unit of `model` keeps its whole (unsharded) weights from its first forward to the end, so
    that a generation gathers each unit once, in its prefill, and decodes with no collective after it: ranks whose
    completions end early stop without leaving the others waiting in an all-gather. On exit every unit is resharded
    and reshards after forward as before. Costs the whole model's weights (in the mixed-precision dtype) on each
    rank for the duration; a model that is not FSDP2's is its own whole weights already."""
    if not is_fsdp(model):
        yield model
        return
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    states = [m._get_fsdp_state() for m in units]
    saved = [(s._auto_reshard_after_forward, [g.post_forward_mesh_info for g in s._fsdp_param_groups]) for s in states]
    model.set_reshard_after_forward(False)
    try:
        yield model
    finally:
        for state, (auto, infos) in zip(states, saved):  # set_reshard_after_forward cannot restore the root's
            state._auto_reshard_after_forward = auto  # automatic False, so each group's own value comes back
            for group, info in zip(state._fsdp_param_groups, infos):
                group.post_forward_mesh_info = info
        for unit in units:
            unit.reshard()


# ---- checkpoints with several processes ---------------------------------------------------------------------------
def full_model_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's state_dict on rank 0's CPU (empty on the other ranks); a collective for FSDP2. With a LoRA
    adapter only the trainable weights (the frozen base never changes: gathering it would move the whole model)."""
    return get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=has_adapter(model))
    )


def save_sharded(model: nn.Module, optimizer, directory: Path) -> None:
    """Every rank writes its shards of the model and optimizer state with torch.distributed.checkpoint (DCP).

    DCP stores each DTensor shard with its global offsets, so the copy loads under any world size for the
    model and optimizer alike (the trainer's per-rank RNG files still want the same one for an exact resume). With a
    LoRA adapter the frozen base is left out: the copy holds the adapter and its optimizer state."""
    model_state, optim_state = get_state_dict(
        model, optimizer, options=StateDictOptions(ignore_frozen_params=has_adapter(model))
    )
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(directory))


def load_sharded(model: nn.Module, optimizer, directory: Path) -> None:
    """Read the DCP copy written by `save_sharded` into `model` (and `optimizer` unless None), in place.

    DCP reshards: the shards of this model's layout (any number of ranks), or whole tensors for a model that is
    not sharded (DDP, or one process without a process group)."""

    def read(state):
        with warnings.catch_warnings():  # one process without a process group is meant (it resumes alone)
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
            dcp.load(state, checkpoint_id=str(directory))

    if optimizer is None:
        state = {"model": get_model_state_dict(model)}
        read(state)
        set_model_state_dict(model, state["model"])
        return
    adapter = has_adapter(model)  # the copy holds the adapter only (`save_sharded`); the base is the model's own
    model_state, optim_state = get_state_dict(model, optimizer, options=StateDictOptions(ignore_frozen_params=adapter))
    state = {"model": model_state, "optimizer": optim_state}
    read(state)
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optimizer"],
        options=StateDictOptions(ignore_frozen_params=adapter, strict=not adapter),
    )


def load_full_optimizer_state(model: nn.Module, optimizer, state: dict) -> None:
    """Load a plain optimizer state_dict (`optimizer.pt` of one process or DDP: parameters numbered in the order of
    the optimizer's groups) into the optimizer of an FSDP2 model; rank 0 passes it, the others {}; a collective.
    The numbers are mapped to parameter names through this optimizer's groups, which `build_optimizer` forms in
    the same order for the same model, then each rank keeps its rows of every moment."""
    if state:
        names = {id(p): name for name, p in model.named_parameters()}
        order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
        saved = [i for group in state["param_groups"] for i in group["params"]]
        if len(saved) != len(order):
            raise ValueError(
                f"optimizer.pt holds {len(saved)} parameters, this optimizer {len(order)}: saved for "
                "another model or other parameter groups"
            )
        state = {
            "state": {order[i]: s for i, s in state["state"].items()},
            "param_groups": [{**g, "params": [order[i] for i in g["params"]]} for g in state["param_groups"]],
        }
    set_optimizer_state_dict(
        model, optimizer, state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    )
