"""DeepSpeed as the second distributed engine: the user's ZeRO config (stages 0-3, CPU offload, bf16/fp16,
optimizer and scheduler sections or none) runs through DeepSpeed's own engine (`deepspeed.initialize`).

`--deepspeed PATH` (Hugging Face's name) and `dist_config: {name: deepspeed, config_file: PATH}` are the same
thing. This module owns everything DeepSpeed:
- `read_config`: the JSON as the user has it; a missing file, invalid JSON (file:line:column) or an unknown ZeRO
  stage is one ConfigError line (exit 2 from the CLI), raised by `check_args` before any expensive work: in
  `trainer.cli_args.check_run` for the command line, at `Trainer` construction from Python.
- `fill_config`: "auto" values filled from our arguments exactly as transformers' `HfTrainerDeepSpeedConfig`
  does (`trainer_config_process` + `trainer_config_finalize`); a value that is not "auto" and differs from the
  argument is a contradiction, reported in one line naming both (all of them, joined with "; "). The batch keys
  (train_micro_batch_size_per_gpu, gradient_accumulation_steps, train_batch_size) are filled when absent too
  (a deliberate difference: transformers leaves them out and DeepSpeed stops with an assertion).
- `DeepSpeedRun`: the loop's engine (the methods of PyTorch's, trainer/loop/engine.py, which picks one of the two):
  `backward`, `step`, `save_checkpoint`, `load_checkpoint` and `full_state_dict` (ZeRO-3 gathered on rank 0, for
  the consolidated Hugging Face export); `full_weights` holds the whole weights for a generation (GRPO's; ZeRO-3
  gathered once); `frozen` runs a frozen model (DPO's reference) in the policy's dtype,
  partitioned like the policy under ZeRO-3.

Exactness. The loop keeps its own loss normalisation (each micro loss is divided by the window's supervised
targets over all ranks / world_size, trainer/loop/trainer.py): `engine.backward(loss, scale_wrt_gas=False)` turns off
DeepSpeed's division by gradient_accumulation_steps, and DeepSpeed's gradient average over the data-parallel ranks
is the same average DDP/FSDP2 take. The loop marks the accumulation boundary itself
(`set_gradient_accumulation_boundary`), so the last window of an epoch, which takes the leftover micro batches
(trainer/loop/trainer.py), reduces and steps exactly once like the others.

Optimizer. Without an optimizer section in the config the loop's own optimizer (`--optim`, FusedAdamW by
default) is DeepSpeed's client optimizer (`zero_allow_untested_optimizer`, as Hugging Face sets it); with
`offload_optimizer` it then steps on the CPU over DeepSpeed's fp32 partitions (`zero_force_ds_cpu_optimizer:
false`, which DeepSpeed requires to accept a client optimizer there; DeepSpeedCPUAdam would need a C++ op built
on first use). With an optimizer section DeepSpeed builds its own (on CPU or with offload that is an op built on
first use, minutes on two cores). Without a scheduler section our schedule (`--lr_scheduler_type`) is built over
the engine's optimizer; either way DeepSpeed steps the scheduler with each applied update.

Skipped steps. ZeRO (stages 1-3) and fp16/bf16 check the gradients before the update and skip a non-finite one
(fp16: an overflow that lowers the loss scale); `step` reports whether the update was applied. Under stage 0 in
fp32 DeepSpeed checks nothing and a non-finite update reaches the weights (the loop still counts it).

Checkpoints. DeepSpeed's own checkpoint (each rank's ZeRO partitions of the model and optimizer, the client
scheduler) sits in `checkpoint-N/deepspeed/` beside our trainer state, RNG and data position; it resumes on the
same number of processes only (ZeRO partitions are per rank).

On a CPU (tests): DeepSpeed's CPU accelerator and gloo. Its TorchBackend builds a shared-memory all-reduce op on
first use (57 s on two cores, measured) that only `inference_all_reduce` uses, which training never calls: it is
marked incompatible here so that no op is built.

Test: python -m pytest tests/trainer/parallel/test_deepspeed.py -q   (1 and 2 processes on CPU with gloo)
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import json
import math
from pathlib import Path

import torch

from trainer.checkpoint_hf import CheckpointError, read_json
from trainer.coerce import ConfigError
from trainer.dist import init_single_process_group

DEEPSPEED_MISSING = "DeepSpeed is not installed (pip install 'kernelwright[deepspeed]')"
CHECKPOINT_DIR = "deepspeed"  # DeepSpeed's own checkpoint inside checkpoint-N/
_TAG = "state"  # DeepSpeed's tag (sub-directory) for the one state each checkpoint-N/ holds
_STAGES = (0, 1, 2, 3)


def is_installed() -> bool:
    return importlib.util.find_spec("deepspeed") is not None


def import_deepspeed():
    """`deepspeed`, with its shared-memory inference op marked unbuildable (see the module docstring)."""
    try:
        import deepspeed
    except ImportError:
        raise ConfigError(f"dist_config name deepspeed: {DEEPSPEED_MISSING}") from None
    if deepspeed.get_accelerator().device_name() == "cpu":
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    return deepspeed


# ---- the config ------------------------------------------------------------------------------------------------
def read_config(path: str | Path) -> dict:
    """The user's DeepSpeed JSON as a dict; one ConfigError line for a missing file, invalid JSON or stage."""
    path = Path(path)
    try:
        config = read_json(path)
    except CheckpointError as exc:  # a missing file, invalid JSON (file:line:col) or not an object
        raise ConfigError(f"deepspeed: {exc}") from None
    zero = config.get("zero_optimization", {})
    if not isinstance(zero, dict):
        raise ConfigError(f"deepspeed: {path}: zero_optimization must be an object")
    stage = zero.get("stage", 0)
    if stage not in _STAGES or isinstance(stage, bool):
        raise ConfigError(f"deepspeed: {path}: zero_optimization.stage={stage!r}; expected one of 0, 1, 2, 3")
    return config


def zero_stage(config: dict) -> int:
    return config.get("zero_optimization", {}).get("stage", 0)


def _node(config: dict, key: str):
    """(the dict holding the last part of a dotted key, that part); (None, part) when a parent is missing."""
    *parents, leaf = key.split(".")
    for p in parents:
        config = config.get(p)
        if not isinstance(config, dict):
            return None, leaf
    return config, leaf


def fill_config(
    config: dict,
    args,
    *,
    world_size: int,
    max_steps: int | None = None,
    hidden_size: int | None = None,
    source: str = "deepspeed config",
) -> dict:
    """A copy of `config` with "auto" filled from `args` as transformers' HfTrainerDeepSpeedConfig does; raises one
    ConfigError line listing every value that contradicts an argument. `max_steps` and `hidden_size` (known once
    the data and the model are) fill the scheduler's steps and the bucket sizes; without them those stay as given."""
    config = copy.deepcopy(config)
    mismatches = []

    def fill(key, value, arg, must_match=True, absent=False):
        node, leaf = _node(config, key)
        if node is None or (leaf not in node and not absent):
            return
        if node.get(leaf, "auto") == "auto":
            node[leaf] = value
        elif must_match and node[leaf] != value:
            mismatches.append(f"{key}={json.dumps(node[leaf])} contradicts {arg}={value!r}")

    micro, accum = args.per_device_train_batch_size, args.gradient_accumulation_steps
    # the batch keys DeepSpeed needs are filled from the arguments when absent too, as when "auto" (transformers
    # leaves them out, and DeepSpeed stops with an assertion that names no argument)
    fill("train_micro_batch_size_per_gpu", micro, "per_device_train_batch_size", absent=True)
    fill("gradient_accumulation_steps", accum, "gradient_accumulation_steps", absent=True)
    fill(
        "train_batch_size",
        world_size * micro * accum,
        f"processes x per_device_train_batch_size x gradient_accumulation_steps = {world_size} x {micro} x {accum}",
        absent=True,
    )
    fill("gradient_clipping", args.max_grad_norm, "max_grad_norm")
    fill("optimizer.params.lr", args.learning_rate, "learning_rate")
    fill("optimizer.params.betas", [args.adam_beta1, args.adam_beta2], "[adam_beta1, adam_beta2]")
    fill("optimizer.params.eps", args.adam_epsilon, "adam_epsilon")
    fill("optimizer.params.weight_decay", args.weight_decay, "weight_decay")
    fill("scheduler.params.warmup_min_lr", 0, "", must_match=False)
    fill("scheduler.params.warmup_max_lr", args.learning_rate, "learning_rate")
    fill("fp16.enabled", bool(args.fp16 or args.fp16_full_eval), "fp16|fp16_full_eval")
    fill("bf16.enabled", bool(args.bf16 or args.bf16_full_eval), "bf16|bf16_full_eval")
    if max_steps is not None:
        fill("scheduler.params.total_num_steps", max_steps, "max_steps (calculated)")
        # deepspeed>=0.19.6 refuses warmup_num_steps <= 0 (transformers keeps it at least 1 too)
        fill("scheduler.params.warmup_num_steps", max(1, args.get_warmup_steps(max_steps)), "warmup_steps")
    if hidden_size is not None:
        fill("zero_optimization.reduce_bucket_size", hidden_size * hidden_size, "", must_match=False)
        if zero_stage(config) == 3:
            fill(
                "zero_optimization.stage3_prefetch_bucket_size",
                int(0.9 * hidden_size * hidden_size),
                "",
                must_match=False,
            )
            fill("zero_optimization.stage3_param_persistence_threshold", 10 * hidden_size, "", must_match=False)
    if mismatches:
        raise ConfigError(
            f"deepspeed: {source}: " + "; ".join(mismatches) + ' (set them to "auto" to follow the arguments)'
        )
    if "optimizer" not in config:  # our optimizer as DeepSpeed's client optimizer (see the module docstring)
        config.setdefault("zero_allow_untested_optimizer", True)
        config.setdefault("zero_force_ds_cpu_optimizer", False)
    return config


def check_args(args, world_size: int) -> None:
    """Everything about the DeepSpeed config that the arguments and the number of processes decide, checked before
    anything is built (`trainer.cli_args.check_run`, `Trainer.__init__`): the file reads, its stage is known, nothing
    contradicts an argument, and DeepSpeed is installed."""
    path = args.dist_config["config_file"]
    if args.auto_find_batch_size:
        # the engine is built once, for one micro batch; a retry with half of it would need another engine
        raise ConfigError(
            "auto_find_batch_size=True with deepspeed is not supported; set per_device_train_batch_size "
            '(and the config\'s train_micro_batch_size_per_gpu, or "auto")'
        )
    resolved = copy.copy(args)
    resolved.resolve_world(world_size)  # gradient_accumulation_steps from global_batch_size, as the loop will
    fill_config(read_config(path), resolved, world_size=world_size, source=str(path))
    if not is_installed():
        raise ConfigError(f"deepspeed: {DEEPSPEED_MISSING}")


# ---- the engine --------------------------------------------------------------------------------------------------
class DeepSpeedRun:
    """The training loop's engine over one DeepSpeed engine (`self.engine`, an nn.Module wrapping the model), with
    the methods of PyTorch's (trainer/loop/engine.py says what each does).

    `initialize` fills the config, builds the optimizer and scheduler as the config asks (see the module
    docstring) and calls `deepspeed.initialize`; `self.optimizer` / `self.scheduler` are the engine's."""

    scaler = None  # DeepSpeed scales fp16 losses itself
    same_world_only = "DeepSpeed's ZeRO partitions"  # each rank's, in CHECKPOINT_DIR

    def __init__(self, engine, optimizer, scheduler, config: dict, *, fp16: bool = False):
        self.engine, self.optimizer, self.scheduler, self.config = engine, optimizer, scheduler, config
        self.fp16 = fp16  # an update skipped with a finite loss is the loss scaler's overflow

    @property
    def model(self):
        """What the loop calls: the engine, around the model."""
        return self.engine

    @classmethod
    def initialize(cls, model, args, *, world_size: int, max_steps: int, make_optimizer, make_scheduler):
        deepspeed = import_deepspeed()
        if not torch.distributed.is_initialized():
            init_single_process_group()
        config_file = args.dist_config["config_file"]
        hidden = getattr(getattr(model, "config", None), "hidden_size", None)
        config = fill_config(
            read_config(config_file),
            args,
            world_size=world_size,
            max_steps=max_steps,
            hidden_size=hidden,
            source=str(config_file),
        )
        optimizer = None if "optimizer" in config else make_optimizer(model)
        scheduler = None if "scheduler" in config else make_scheduler
        params = [p for p in model.parameters() if p.requires_grad]
        engine, optimizer, _, scheduler = deepspeed.initialize(
            model=model, model_parameters=params, optimizer=optimizer, lr_scheduler=scheduler, config=config
        )
        return cls(engine, optimizer, scheduler, config, fp16=bool(args.fp16))

    @property
    def stage(self) -> int:
        return self.engine.zero_optimization_stage()

    def backward(self, loss: torch.Tensor, last: bool) -> None:
        """Backward of one micro batch, gradients accumulated (ZeRO-2/3 reduce-scatter them as they come); `last`
        marks the window's last micro batch, whose `step` updates the weights."""
        self.engine.set_gradient_accumulation_boundary(last)
        self.engine.backward(loss, scale_wrt_gas=False)  # the loop's normalisation stays exact (module docstring)
        if not last:
            self.engine.step()  # off the boundary DeepSpeed only counts the micro step

    def step(self, host_sync, before_update) -> tuple[float, float | None, bool, bool, bool]:
        """`before_update()`, then DeepSpeed's step: clip, update and step the scheduler (unless it skips a non-finite
        or overflowing update), zero the gradients; then the host sync of the loss and the gradient norm before
        clipping (None where DeepSpeed computes none: stage 0 without clipping). Returns (loss, grad_norm, stepped,
        finite, overflow) as PyTorch's engine does. Under stage 0 in fp32 DeepSpeed checks nothing: a non-finite
        update reaches the weights, and is counted as non-finite all the same."""
        before_update()
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        if norm is not None and not isinstance(norm, torch.Tensor):
            norm = torch.tensor(float(norm), dtype=torch.float64)
        applied = self.engine.was_step_applied()
        loss, grad_norm = host_sync(norm)
        loss_finite = math.isfinite(loss)
        overflow = loss_finite and not applied and self.fp16  # its loss scaler skipped the update, lowered the scale
        finite = loss_finite and (applied or overflow)
        return loss, grad_norm, applied and loss_finite, finite, overflow

    def save_checkpoint(self, directory: Path) -> None:
        """DeepSpeed's checkpoint of the engine (model, optimizer, scheduler) into `directory`/deepspeed (every rank
        writes its partitions; a collective)."""
        self.engine.save_checkpoint(str(directory / CHECKPOINT_DIR), tag=_TAG)

    def load_checkpoint(self, directory: Path, *, weights_only: bool = False) -> None:
        """DeepSpeed's checkpoint in `directory`/deepspeed into the engine: model, optimizer and scheduler, or the
        model only."""
        directory = directory / CHECKPOINT_DIR
        if not (directory / _TAG).is_dir():
            raise CheckpointError(f"{directory}: no DeepSpeed checkpoint (no {_TAG}/ directory)")
        loaded, _ = self.engine.load_checkpoint(
            str(directory),
            tag=_TAG,
            load_optimizer_states=not weights_only,
            load_lr_scheduler_states=not weights_only,
            load_module_only=weights_only,
        )
        if loaded is None:
            raise CheckpointError(f"{directory}: DeepSpeed could not load its checkpoint")

    def frozen(self, model):
        """A DeepSpeed engine (inference only: no optimizer, no gradients) running the frozen `model` (a DPO
        reference) as this engine runs the policy, as TRL's `prepare_deepspeed` does: this engine's config less the
        optimizer and scheduler sections, so the same dtype (bf16/fp16 as configured); under ZeRO-3 its
        parameters partitioned over the ranks like the policy's and gathered module by module in each forward,
        under stages 0-2 (where the policy's parameters are whole on every rank too) stage 0. A collective: every
        rank calls it at the same point."""
        deepspeed = import_deepspeed()
        config = {k: v for k, v in self.config.items() if k not in ("optimizer", "scheduler")}
        zero = self.config.get("zero_optimization", {})
        if self.stage == 3:
            config["zero_optimization"] = {k: v for k, v in zero.items() if k != "offload_optimizer"}
        else:
            config["zero_optimization"] = {"stage": 0}
        engine, *_ = deepspeed.initialize(model=model, config=config)
        engine.eval()
        return engine

    @contextlib.contextmanager
    def full_weights(self):
        """The model (the engine's module) holding its whole weights for the duration, to generate with: itself under
        stages 0-2 (whole on every rank); under ZeRO-3 its partitions gathered at once (`GatheredParameters`) and
        ZeRO-3's per-module hooks taken off meanwhile (they would release the gathered weights after each module and
        gather them again in the next decoding step: a collective per step, which ranks whose completions end early
        would leave the others waiting in), then registered again, as TRL's unwrap_model_for_generation does. A
        collective: every rank enters it together."""
        module = self.engine.module
        if self.stage != 3:
            yield module
            return
        deepspeed = import_deepspeed()
        offload = self.engine.optimizer.parameter_offload  # ZeRO-3's hooks and their coordinator
        with deepspeed.zero.GatheredParameters(list(module.parameters())):
            for param in module.parameters():
                param.ds_active_sub_modules.clear()
            for hook in offload.forward_hooks + offload.backward_hooks:
                hook.remove()
            offload.forward_hooks, offload.backward_hooks = [], []
            try:
                yield module
            finally:
                offload._register_deepspeed_module(offload.module)  # also invalidates the coordinator's trace

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The whole model's state_dict on rank 0's CPU (None elsewhere); a collective under ZeRO-3, which gathers
        each partitioned parameter in turn. In the parameters' dtype (the 16-bit one under fp16/bf16)."""
        if self.stage == 3:
            return self.engine._zero3_consolidated_16bit_state_dict()
        if torch.distributed.get_rank() != 0:
            return None
        return {k: v.detach().cpu() for k, v in self.engine.module.state_dict().items()}
