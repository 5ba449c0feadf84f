"""The Trainer's checkpoint files that depend on the model and the engine, and resuming from them.

`trainer/loop/checkpoint.py` knows the directory layout (atomic writes, rotation, RNG, scheduler, data position) and
nothing of models; this module fills the model's part under every engine (one process, DDP, FSDP2) and restores
a run:
- `save_model_files` / `load_model_weights`: our CausalLM in the Hugging Face layout (FSDP2 gathers the full
  weights on rank 0 with a collective; loading, each rank reads only its rows), or, when it carries a LoRA adapter
  (use_peft, or a peft model passed in), only the adapter in peft's layout (`trainer.model.lora`); any other module as
  `model.safetensors`;
- `restore_checkpoint`: a checkpoint into this run's engine (model, optimizer, scheduler, scaler) and loader, after
  `check_resume_across_worlds` has refused a resume under another number of processes that could not go on
  exactly (docs/multi_gpu.md).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_model, save_model

from trainer.build import causal_lm, empty_model, load_state_dict_into, save_pretrained
from trainer.data.batching import same_steps, steps_per_epoch
from trainer.dist import local_shard
from trainer.loop import checkpoint as ckpt
from trainer.model.causal_lm import CausalLM
from trainer.model.lora import has_adapter, load_adapter_weights, save_adapter
from trainer.model.transformers_model import TransformersModel
from trainer.parallel import transforms as parallel


def save_model_files(model, directory: Path, *, rank: int, tokenizer=None, full_state_dict=None) -> None:
    """The model in the Hugging Face layout. Called on every rank: under FSDP2 gathering the full weights is a
    collective; only rank 0 writes. `full_state_dict`: rank 0's full weights, gathered by the caller (DeepSpeed:
    `DeepSpeedRun.full_state_dict`), written instead of the model's own tensors (partitions under ZeRO-3). A model
    carrying a LoRA adapter writes the adapter alone (peft's layout)."""
    model = parallel.unwrap(model)
    ours = causal_lm(model)
    adapted = model if ours is None else ours  # the model that carries a LoRA adapter, if any
    if has_adapter(adapted):
        state = full_state_dict
        if state is None and parallel.is_fsdp(adapted):
            state = parallel.full_model_state_dict(adapted)  # the trainable weights
        if rank == 0:
            save_adapter(adapted, directory, state)
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
    if isinstance(model, (CausalLM, TransformersModel)):
        save_pretrained(model, directory, tokenizer=tokenizer)
        return
    save_model(model, str(Path(directory) / "model.safetensors"))
    if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(directory)


def load_model_weights(model, directory: Path) -> None:
    """The weights saved in `directory` into `model`, in this run's layout (a collective under FSDP2); for a model
    carrying a LoRA adapter, the adapter saved there (each rank its rows under FSDP2)."""
    model = parallel.unwrap(model)
    ours = causal_lm(model)
    adapted = model if ours is None else ours
    if has_adapter(adapted) and not (directory / parallel.DCP_DIR).is_dir():
        load_adapter_weights(adapted, directory, local_shard=local_shard)
        return
    if parallel.is_fsdp(model):
        if (directory / parallel.DCP_DIR).is_dir():
            parallel.load_sharded(model, None, directory / parallel.DCP_DIR)
            return
        if not isinstance(model, CausalLM):
            raise TypeError(
                f"loading a {type(model).__name__} sharded with FSDP2 from a Hugging Face directory is "
                "not supported (CausalLM only)"
            )
    if isinstance(model, CausalLM):  # sharded by FSDP2, each rank reads only its rows of each tensor
        load_state_dict_into(model, directory, local_shard=local_shard)
        return
    if isinstance(model, TransformersModel):
        model.load_weights(directory)
        return
    load_model(model, str(Path(directory) / "model.safetensors"))


# A resume with an argument that differs from the checkpoint's training_args.json. transformers' Trainer is the
# reference: it loads the optimizer's and the scheduler's state over the new arguments, so what those hold wins (the
# param groups' lr, betas, eps, weight decay and optim_args; the schedule's base rate; with the RNG streams, the
# seed's effect), and every other argument is read anew (max_steps, epochs, the schedule's type and warmup,
# accumulation, clipping, logging, saving, ...).
_GROUPS = "the optimizer's param groups are restored"
FROM_CHECKPOINT = {
    "learning_rate": "the optimizer's param groups and the schedule's base rate are restored",
    "weight_decay": _GROUPS,
    "adam_beta1": _GROUPS,
    "adam_beta2": _GROUPS,
    "adam_epsilon": _GROUPS,
    "optim_args": _GROUPS,
}
# What the saved state cannot follow: the data plan the saved position counts in (transformers would go on with other
# examples, unsaid), the optimizer whose state is saved, the shape of the saved LoRA adapter (its scale,
# lora_alpha/use_rslora, and its dropout are read anew, as peft does) and the quantized base it was trained over.
# Refused in one line.
REFUSED = {
    "per_device_train_batch_size": "the data position counts micro batches of its size",
    "batching_strategy": "the data position counts its micro batches",
    "max_tokens": "the data position counts micro batches of this budget",
    "pad_to_multiple_of": "the data position counts its micro batches",
    "train_shuffle": "the data position is in its order",
    "group_by_length": "the data position is in its order",
    "dataloader_drop_last": "the data position counts its micro batches",
    "optim": "the saved optimizer state belongs to it",
    "use_peft": "the saved weights and optimizer state are of the full model or of an adapter",
    "lora_r": "the saved adapter and its optimizer state have this rank",
    "lora_target_modules": "the saved adapter is on these layers",
    "lora_target_parameters": "the saved adapter is on these parameters",
    "lora_modules_to_save": "the saved adapter carries these modules",
    "use_dora": "the saved adapter has (or lacks) DoRA's magnitudes",
    # the base the adapter was trained over (trainer/model/quant.py): another would be another function to continue on
    "load_in_4bit": "the saved adapter was trained over these base weights",
    "bnb_4bit_quant_type": "the saved adapter was trained over these base weights",
    "bnb_4bit_use_double_quant": "the saved adapter was trained over these base weights",
    "load_in_8bit": "the saved adapter was trained over these base weights",
    "llm_int8_threshold": "the saved adapter was trained over these base weights",
}
NOT_COMPARED = ("output_dir", "logging_dir", "resume_from_checkpoint", "overwrite_output_dir")


def saved_arguments(resume: Path) -> dict:
    """The checkpoint's training_args.json (its run's resolved arguments); {} when it has none (a checkpoint that a
    hand-made loop saved), so nothing is compared."""
    file = Path(resume) / "training_args.json"
    return json.loads(file.read_text()) if file.is_file() else {}


def _comparable(value):
    return json.loads(json.dumps(value, default=str))


def check_resume_arguments(resume: Path, args, saved: dict | None = None) -> None:
    """A CheckpointError naming the first argument changed from the checkpoint's that the saved state cannot follow
    (`REFUSED`, and the seed that orders the data when data_seed is not set)."""
    saved = saved_arguments(resume) if saved is None else saved
    refused = dict(REFUSED)
    refused["data_seed" if args.data_seed is not None or saved.get("data_seed") is not None else "seed"] = (
        "the data position is in the order it shuffles"
    )
    for name, why in refused.items():
        given = _comparable(getattr(args, name))
        if name in saved and saved[name] != given:
            raise ckpt.CheckpointError(
                f"resume_from_checkpoint: {name} is {given!r} here but {saved[name]!r} in {resume}, and a resume "
                f"cannot change it ({why}); resume with {name}={saved[name]!r}, or start a new run"
            )


def apply_checkpoint_arguments(resume: Path, args, saved: dict, rng_reseeded: bool) -> tuple[dict, list[str]]:
    """After a resume: the arguments whose value came from the checkpoint's state (set on `args`, so that what is
    recorded is what ran) and one line per argument that differs from the checkpoint's, with the value that applies."""
    from_checkpoint = dict(FROM_CHECKPOINT)
    if args.data_seed is not None and not rng_reseeded:  # the seed only seeds the RNG, whose state is restored
        from_checkpoint["seed"] = "the random number generators' state is restored"
    taken, lines = {}, []
    for name, given in args.to_dict().items():
        given = _comparable(given)
        if name in NOT_COMPARED or name not in saved or saved[name] == given:
            continue
        if name in from_checkpoint:
            taken[name] = saved[name]
            setattr(args, name, saved[name])
            lines.append(
                f"resume_from_checkpoint: {name} is {given!r} here but {saved[name]!r} in {resume}: "
                f"{saved[name]!r} applies ({from_checkpoint[name]}, as in transformers; start a new run "
                "to change it)"
            )
        else:
            lines.append(f"resume_from_checkpoint: {name} {given!r} applies (it was {saved[name]!r} in {resume})")
    return taken, lines


def restore_checkpoint(
    resume: Path,
    *,
    engine,
    loader,
    args,
    rank: int,
    world_size: int,
    micro: int,
    accum: int,
    windows_per_epoch: int,
) -> dict:
    """Everything a checkpoint holds into this run: the engine's state (model, optimizer, scheduler, scaler, in this
    run's layout: `engine.load_checkpoint`, trainer/loop/engine.py), RNG and the loader's position. Returns the saved
    trainer state (a dict), `saved_world` (how many processes saved it), `rng_reseeded` (True when the per-rank
    RNG could not carry over) and `method_state` (the method's, or None; the Trainer hands it to the method). A
    resume under another number of processes is refused in one line where the engine's checkpoint cannot follow
    (`engine.same_world_only`: DeepSpeed's) or the run could not go on exactly (`check_resume_across_worlds`).
    Arguments changed from the checkpoint's are refused before anything is loaded when the saved state cannot follow
    them (`check_resume_arguments`, after the checks of a resume under another number of processes, which name the
    batch it needs); `apply_checkpoint_arguments` says, after, which value the others take."""
    saved_world = ckpt.saved_world_size(resume)
    if engine.same_world_only and saved_world != world_size:
        raise ckpt.CheckpointError(
            f"resume_from_checkpoint: {resume} was saved by {saved_world} process(es), this "
            f"run has {world_size}: {engine.same_world_only} resume on {saved_world} only"
        )
    if saved_world and saved_world != world_size:
        check_resume_across_worlds(
            resume,
            saved_world,
            args,
            world_size=world_size,
            loader=loader,
            micro=micro,
            accum=accum,
            windows_per_epoch=windows_per_epoch,
        )
    check_resume_arguments(resume, args)
    engine.load_checkpoint(resume)
    restored = ckpt.load_training_state(resume, rank=rank, world_size=world_size, seed=args.seed)
    _restore_position(resume, loader, restored["data_state"])
    return {
        "trainer_state": restored["trainer_state"],
        "saved_world": saved_world,
        "rng_reseeded": restored["rng_reseeded"],
        "method_state": restored["method_state"],
    }


def _restore_position(resume: Path, loader, data_state: dict | None) -> None:
    if data_state is None:
        return
    try:
        loader.load_state_dict(data_state)
    except ValueError as exc:  # other data, or another plan: one line naming the checkpoint
        raise ckpt.CheckpointError(f"resume_from_checkpoint: {resume}: {exc}") from None


def load_model_and_optimizer(resume: Path, model, optimizer, *, rank: int) -> None:
    """Model and optimizer state from a checkpoint saved under any number of processes, in this run's layout."""
    directory, optimizer_file = resume / parallel.DCP_DIR, resume / "optimizer.pt"
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


def check_resume_across_worlds(
    resume: Path, saved_world: int, args, *, world_size: int, loader, micro: int, accum: int, windows_per_epoch: int
) -> None:
    """Refuse, in one line naming the argument, a resume under another number of processes that could not go on
    exactly as the saved run would have: each optimizer step must take the same examples. The loader plans one
    global list of micro batches and deals it round-robin, and each step takes the next processes x accumulation
    of them, so that holds when the micro batch and the global batch stay the same, the plan does not depend
    on the number of processes (group_by_length does), and an epoch splits into as many steps as before."""
    saved = json.loads((resume / "training_args.json").read_text())
    saved_micro, saved_accum = int(saved["per_device_train_batch_size"]), int(saved["gradient_accumulation_steps"])
    where = f"resume_from_checkpoint: {resume} was saved by {saved_world} process(es), this run has {world_size}"
    if saved_micro != micro:
        raise ckpt.CheckpointError(
            f"{where}: per_device_train_batch_size must stay {saved_micro} (got {micro}); "
            "change gradient_accumulation_steps to keep the global batch instead"
        )
    saved_global, this_global = saved_micro * saved_world * saved_accum, micro * world_size * accum
    if saved_global != this_global:
        fits = saved_global % (micro * world_size) == 0
        hint = (
            f"set gradient_accumulation_steps={saved_global // (micro * world_size)} (or global_batch_size="
            f"{saved_global})"
            if fits
            else f"{saved_global} is not a multiple of {micro * world_size}"
        )
        raise ckpt.CheckpointError(
            f"{where}: the global batch (per_device_train_batch_size x processes x gradient_accumulation_steps) "
            f"was {saved_micro} x {saved_world} x {saved_accum} = {saved_global}, is {this_global}; {hint}"
        )
    if args.group_by_length:
        raise ckpt.CheckpointError(
            f"{where}: group_by_length=True sorts lengths in groups that depend on the "
            f"number of processes; resume with {saved_world}"
        )
    n, drop = loader.global_batch_count(), args.dataloader_drop_last
    if not same_steps(n, drop, (saved_world, saved_accum), (world_size, accum)):
        raise ckpt.CheckpointError(
            f"{where}: an epoch of {n} micro batches makes {steps_per_epoch(n, saved_world, saved_accum, drop)} "
            f"optimizer steps then, {windows_per_epoch} now (dataloader_drop_last={drop}), and its last step would "
            f"take other examples; resume with {saved_world}"
        )


def _gathered_copy(model, rank: int):
    """Rank 0: an unsharded CPU copy of an FSDP2 model holding the full weights; other ranks: None."""
    state = parallel.full_model_state_dict(model)  # a collective; the full tensors land on rank 0 only
    if rank != 0:
        return None
    copy = _unsharded_cpu_copy(model)
    copy.load_state_dict(state)
    return copy


def _unsharded_cpu_copy(model):
    """An uninitialised CPU CausalLM with `model`'s config and parameter dtype, to hold full FSDP2 weights (a
    TransformersModel: `TransformersModel.empty_copy`)."""
    if isinstance(model, TransformersModel):
        return model.empty_copy()
    if not isinstance(model, CausalLM):
        raise TypeError(f"saving a {type(model).__name__} sharded with FSDP2 is not supported (CausalLM only)")
    dtype = next(iter(model.state_dict().values())).dtype
    return empty_model(model.config, dtype=dtype, device="cpu", use_kernels=False)
