"""The Trainer's checkpoint files that depend on the model and the engine, and resuming from them.

`trainer/checkpoint.py` knows the directory layout (atomic writes, rotation, RNG, scheduler, data position) and
nothing of models; this module fills the model's part under every engine (one process, DDP, FSDP2) and restores
a run:
- `save_model_files` / `load_model_weights`: our CausalLM in the Hugging Face layout (FSDP2 gathers the full
  weights on rank 0 with a collective; loading, each rank reads only its rows), or, when it carries a LoRA adapter
  (use_peft, or a peft model passed in), only the adapter in peft's layout (`trainer.lora`); any other module as
  `model.safetensors`;
- `restore_checkpoint`: a checkpoint into this run's model, optimizer, scheduler, scaler and loader, after
  `check_resume_across_worlds` has refused a resume under another number of processes that could not go on
  exactly (docs/multi_gpu.md).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_model, save_model

from . import checkpoint as ckpt
from . import parallel
from .batching import same_steps, steps_per_epoch
from .build import empty_model, load_state_dict_into, save_pretrained
from .deepspeed_engine import CHECKPOINT_DIR
from .dist import local_shard
from .lora import has_adapter, load_adapter_weights, save_adapter
from .model import CausalLM


def save_model_files(model, directory: Path, *, rank: int, tokenizer=None, full_state_dict=None) -> None:
    """The model in the Hugging Face layout. Called on every rank: under FSDP2 gathering the full weights is a
    collective; only rank 0 writes. `full_state_dict`: rank 0's full weights, gathered by the caller (DeepSpeed:
    `DeepSpeedRun.full_state_dict`), written instead of the model's own tensors (partitions under ZeRO-3). A model
    carrying a LoRA adapter writes the adapter alone (peft's layout)."""
    model = parallel.unwrap(model)
    ours = _our_model(model)
    if ours is not None and has_adapter(ours):
        state = full_state_dict
        if state is None and parallel.is_fsdp(ours):
            state = parallel.full_model_state_dict(ours)  # the trainable weights
        if rank == 0:
            save_adapter(ours, directory, state)
            if tokenizer is not None:
                tokenizer.save_pretrained(directory)
        return
    if full_state_dict is not None:
        model = _unsharded_cpu_copy(model)
        model.load_state_dict(full_state_dict)
    elif parallel.is_fsdp(model):
        model = _gathered_copy(model, rank)  # None on ranks other than 0
    if rank != 0:
        return
    if isinstance(model, CausalLM):
        save_pretrained(model, directory, tokenizer=tokenizer)
        return
    save_model(model, str(Path(directory) / "model.safetensors"))
    if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(directory)


def load_model_weights(model, directory: Path) -> None:
    """The weights saved in `directory` into `model`, in this run's layout (a collective under FSDP2); for a model
    carrying a LoRA adapter, the adapter saved there (each rank its rows under FSDP2)."""
    model = parallel.unwrap(model)
    ours = _our_model(model)
    if ours is not None and has_adapter(ours) and not (directory / ckpt.DCP_DIR).is_dir():
        load_adapter_weights(ours, directory, local_shard=local_shard)
        return
    if parallel.is_fsdp(model):
        if (directory / ckpt.DCP_DIR).is_dir():
            parallel.load_sharded(model, None, directory / ckpt.DCP_DIR)
            return
        if not isinstance(model, CausalLM):
            raise TypeError(f"loading a {type(model).__name__} sharded with FSDP2 from a Hugging Face directory is "
                            "not supported (CausalLM only)")
    if isinstance(model, CausalLM):  # sharded by FSDP2, each rank reads only its rows of each tensor
        load_state_dict_into(model, directory, local_shard=local_shard)
        return
    load_model(model, str(Path(directory) / "model.safetensors"))


def restore_checkpoint(resume: Path, *, model, optimizer, scheduler, scaler, loader, args, rank: int,
                       world_size: int, micro: int, accum: int, windows_per_epoch: int, deepspeed=None) -> dict:
    """Everything a checkpoint holds into this run: model and optimizer (in this run's layout), scheduler, scaler,
    RNG and the loader's position. Returns the saved trainer state (a dict), `saved_world` (how many processes
    saved it) and `rng_reseeded` (True when the per-rank RNG could not carry over). Under DeepSpeed
    (`deepspeed`, a DeepSpeedRun) its own checkpoint restores model, optimizer and scheduler, on the same number
    of processes only."""
    saved_world = ckpt.saved_world_size(resume)
    if deepspeed is not None:
        if saved_world != world_size:
            raise ckpt.CheckpointError(f"resume_from_checkpoint: {resume} was saved by {saved_world} process(es), this "
                                       f"run has {world_size}: DeepSpeed's ZeRO partitions resume on {saved_world} only")
        restored = ckpt.load_training_state(resume, rank=rank, world_size=world_size, seed=args.seed)
        deepspeed.load_checkpoint(resume / CHECKPOINT_DIR)
        if restored["data_state"] is not None:
            loader.load_state_dict(restored["data_state"])
        return {"trainer_state": restored["trainer_state"], "saved_world": saved_world, "rng_reseeded": False}
    if saved_world and saved_world != world_size:
        check_resume_across_worlds(resume, saved_world, args, world_size=world_size, loader=loader, micro=micro,
                                   accum=accum, windows_per_epoch=windows_per_epoch)
    restored = ckpt.load_training_state(resume, scheduler=scheduler, scaler=scaler, rank=rank,
                                        world_size=world_size, seed=args.seed)
    load_model_and_optimizer(resume, model, optimizer, rank=rank)
    if restored["data_state"] is not None:
        loader.load_state_dict(restored["data_state"])
    return {"trainer_state": restored["trainer_state"], "saved_world": saved_world,
            "rng_reseeded": restored["rng_reseeded"]}


def load_model_and_optimizer(resume: Path, model, optimizer, *, rank: int) -> None:
    """Model and optimizer state from a checkpoint saved under any number of processes, in this run's layout."""
    directory, optimizer_file = resume / ckpt.DCP_DIR, resume / "optimizer.pt"
    if directory.is_dir():  # saved under FSDP2: DCP reshards to this run's shards, or to whole tensors
        parallel.load_sharded(model, optimizer, directory)
        return
    if not optimizer_file.is_file():
        raise ckpt.CheckpointError(f"{optimizer_file}: missing (was the checkpoint saved with save_only_model?)")
    load_model_weights(model, resume)
    if parallel.is_fsdp(model):  # saved by one process or DDP: rank 0 reads the whole state, each rank keeps its rows
        state = torch.load(optimizer_file, map_location="cpu", weights_only=True) if rank == 0 else {}
        parallel.load_full_optimizer_state(model, optimizer, state)
    else:
        optimizer.load_state_dict(torch.load(optimizer_file, map_location="cpu", weights_only=True))


def check_resume_across_worlds(resume: Path, saved_world: int, args, *, world_size: int, loader, micro: int,
                               accum: int, windows_per_epoch: int) -> None:
    """Refuse, in one line naming the argument, a resume under another number of processes that could not go on
    exactly as the saved run would have: each optimizer step must take the same examples. The loader plans one
    global list of micro batches and deals it round-robin, and each step takes the next processes x accumulation
    of them, so that holds when the micro batch and the global batch stay the same, the plan does not depend
    on the number of processes (group_by_length does), and an epoch splits into as many steps as before."""
    saved = json.loads((resume / "training_args.json").read_text())
    saved_micro, saved_accum = int(saved["per_device_train_batch_size"]), int(saved["gradient_accumulation_steps"])
    where = f"resume_from_checkpoint: {resume} was saved by {saved_world} process(es), this run has {world_size}"
    if saved_micro != micro:
        raise ckpt.CheckpointError(f"{where}: per_device_train_batch_size must stay {saved_micro} (got {micro}); "
                                   "change gradient_accumulation_steps to keep the global batch instead")
    saved_global, this_global = saved_micro * saved_world * saved_accum, micro * world_size * accum
    if saved_global != this_global:
        fits = saved_global % (micro * world_size) == 0
        hint = (f"set gradient_accumulation_steps={saved_global // (micro * world_size)} (or global_batch_size="
                f"{saved_global})" if fits else f"{saved_global} is not a multiple of {micro * world_size}")
        raise ckpt.CheckpointError(
            f"{where}: the global batch (per_device_train_batch_size x processes x gradient_accumulation_steps) "
            f"was {saved_micro} x {saved_world} x {saved_accum} = {saved_global}, is {this_global}; {hint}")
    if args.group_by_length:
        raise ckpt.CheckpointError(f"{where}: group_by_length=True sorts lengths in groups that depend on the "
                                   f"number of processes; resume with {saved_world}")
    n, drop = len(loader.global_batches(loader.epoch)), args.dataloader_drop_last
    if not same_steps(n, drop, (saved_world, saved_accum), (world_size, accum)):
        raise ckpt.CheckpointError(
            f"{where}: an epoch of {n} micro batches makes {steps_per_epoch(n, saved_world, saved_accum, drop)} "
            f"optimizer steps then, {windows_per_epoch} now (dataloader_drop_last={drop}), and its last step would "
            f"take other examples; resume with {saved_world}")


def _our_model(model) -> CausalLM | None:
    """Our CausalLM in `model`: the model itself, or inside a wrapper (peft's PeftModel: `base_model.model`)."""
    return next((m for m in model.modules() if isinstance(m, CausalLM)), None)


def _gathered_copy(model, rank: int):
    """Rank 0: an unsharded CPU copy of an FSDP2 model holding the full weights; other ranks: None."""
    state = parallel.full_model_state_dict(model)  # a collective; the full tensors land on rank 0 only
    if rank != 0:
        return None
    copy = _unsharded_cpu_copy(model)
    copy.load_state_dict(state)
    return copy


def _unsharded_cpu_copy(model):
    """An uninitialised CPU CausalLM with `model`'s config and parameter dtype, to hold full FSDP2 weights."""
    if not isinstance(model, CausalLM):
        raise TypeError(f"saving a {type(model).__name__} sharded with FSDP2 is not supported (CausalLM only)")
    dtype = next(iter(model.state_dict().values())).dtype
    return empty_model(model.config, dtype=dtype, device="cpu", use_kernels=False)
