"""Optimizers, parameter groups and learning-rate schedules for the training loop.

Parameter groups
----------------
`param_groups(model, weight_decay)` puts every trainable parameter in one of two groups: decayed, or not
decayed. No decay for any parameter with fewer than two dimensions (biases, norm weights, scalars) and for
every parameter owned directly by a module whose class name contains "Norm" (LayerNorm, RMSNorm,
LlamaRMSNorm, our kernels' RMSNorm, and FSDP2's wrapped versions of them). Hugging Face instead excludes
parameters by name pattern ("bias", "norm", ...) and `nn.LayerNorm` instances; for Llama-family models the
two rules select the same parameters, ours also covers 1-D parameters with other names. Names are kept in
torch's own `param_names` group key, so `optimizer.state_dict()` carries them.

Optimizers
----------
`build_optimizer(model_or_params, args)` reads `optim`, `learning_rate`, `weight_decay`, `adam_beta1/2`,
`adam_epsilon` and `optim_args` of a `TrainingArguments`, which validated them when it was built (they are not
checked a second time here; `optim_args` is already a typed dict):
  adamw_fused        kernels.FusedAdamW (our AdamW: Triton, or the CUDA op for bf16 parameters; on CPU torch's fused
                     CPU AdamW for fp32, the reference otherwise)   optim_args: state_dtype (float32 | bfloat16:
                     the moments in bf16, 4 bytes per parameter instead of 8)
  adamw_torch        torch.optim.AdamW (foreach)          optim_args: amsgrad
  adamw_torch_fused  torch.optim.AdamW(fused=True)        optim_args: amsgrad (works on CPU in torch 2.13)
  sgd                torch.optim.SGD                      optim_args: momentum, dampening, nesterov
  adamw_bnb_8bit     bitsandbytes.optim.AdamW8bit, as transformers builds the name (bitsandbytes' AdamW with
  adamw_8bit         optim_bits=8; adamw_8bit is transformers' alias): 8-bit moments quantised blockwise (blocks of
                     256 values, one fp32 absmax each per moment: 2.03 bytes per parameter, bench.roofline's
                     ADAMW_STATE_BYTES_PER_PARAM) for tensors of at least 4096 elements (bitsandbytes' min_8bit_size);
                     smaller tensors, and the weight of every nn.Embedding in the model (transformers' override, on a
                     manager of the optimizer's own, see _bnb_adamw_8bit), keep fp32 moments    optim_args: none
                     (transformers passes it none)
  paged_adamw_8bit   bitsandbytes.optim.PagedAdamW8bit: the same, with the state of tensors of at least 1e5
                     elements in CUDA unified memory, which the driver pages out to the host when the GPU runs short
                     (and back before each step). On CPU there is nothing to page: bitsandbytes keeps the state in
                     ordinary memory (the same values as adamw_bnb_8bit) and the Trainer says so in one line
                     (bitsandbytes' own UserWarning is quieted). A resumed run's state is loaded into ordinary device
                     memory (bitsandbytes' load_state_dict moves it to the parameters' device, as under transformers).
The 8-bit AdamWs need bitsandbytes (`pip install 'kernelwright[qlora]'`), checked by TrainingArguments; FSDP2 is refused
there (its DTensor parameters reach bitsandbytes' update ops beside plain state tensors, which DTensor rejects). Under
DeepSpeed they step its flat fp32 partitions as its client optimizer, so blocks span parameters and no embedding keeps
fp32 state (as under transformers + DeepSpeed). transformers' other bitsandbytes names (paged_adamw_32bit, lion_*,
paged_lion_*, ademamix*, paged_ademamix*, rmsprop_bnb*) and torchao's adamw_torch_8bit/4bit are not offered.
Unlike Hugging Face, `optim_args` keys an optimizer does not take are an error, not ignored.
`optim_config` (seed 001) with a registered name above is the same as optim + optim_args (trainer.config.args folds it);
with 'module:attribute' it is the user's class or factory, called as fn(param_groups, lr=learning_rate, **options)
(lr only where its signature takes it; each group carries its weight_decay); it must return a torch Optimizer.

Schedules
---------
`build_scheduler(name, optimizer, num_warmup_steps, num_training_steps, **kwargs)` returns a `LambdaLR`
whose factor f(step) multiplies each group's initial lr, with exactly Hugging Face's formulas
(`transformers.optimization`). With w = warmup steps, T = training steps, p = (s - w) / max(1, T - w):
  warmup (all but constant/wsd)  s / max(1, w)                                        for s < w
  linear                 max(0, (T - s) / max(1, T - w))
  cosine                 max(0, (1 + cos(2 pi num_cycles p)) / 2)                    num_cycles = 0.5
  cosine_with_restarts   0 if p >= 1 else max(0, (1 + cos(pi ((num_cycles p) mod 1))) / 2)   num_cycles = 1
  polynomial             ((lr0 - lr_end) (1 - (s - w) / (T - w))^power + lr_end) / lr0, lr_end/lr0 after T
                         (lr_end = 1e-7 must be below the initial lr, power = 1)
  constant               1 (no warmup)
  constant_with_warmup   1 after warmup
  inverse_sqrt           1 / sqrt((s + timescale - w) / timescale), timescale = w or 10000
  warmup_stable_decay    warmup (linear | cosine | 1-sqrt) from min_lr_ratio to 1, 1 for num_stable_steps
                         (default T - w - num_decay_steps), decay (linear | cosine | 1-sqrt, default cosine)
                         to min_lr_ratio over num_decay_steps, then min_lr_ratio
  cosine_with_min_lr     cosine rescaled to [min_lr_rate, 1]; min_lr_rate = min_lr / lr0 when min_lr is given
Differences: kwargs are validated (unknown names and bad values are `ConfigError`s); warmup_stable_decay whose
warmup + decay exceed T without num_stable_steps is an error (HF gives a negative stable phase); polynomial
with T == w avoids HF's division by zero. The factors are `functools.partial`s of module-level functions, so a
scheduler's `state_dict()` holds only plain numbers (last_epoch, base_lrs) and resumes by `load_state_dict`
into a scheduler built with the same arguments.

`build_lr_scheduler(optimizer, args, num_training_steps)` is what the loop calls: `build_scheduler` with args'
schedule and warmup, or lr_scheduler_config's 'module:attribute' called as fn(optimizer, **options), plus
num_training_steps / num_warmup_steps where its signature names them; it must return an LRScheduler that steps
once per optimizer step (not ReduceLROnPlateau). Checkpoints save its state_dict like any other.

Test: `python -m pytest tests/trainer/loop/test_optim.py -q` (curves checked against formulas written in the test
and against `transformers.get_scheduler`); `tests/trainer/loop/test_optim_8bit.py` (the 8-bit AdamWs against the
optimizer transformers builds for each name, bit for bit, and through the Trainer with a resume).
"""

import math
from collections.abc import Iterable
from functools import partial
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR, LRScheduler, ReduceLROnPlateau

from kernels import FusedAdamW
from trainer.config.args import (
    BITSANDBYTES_INSTALL,
    BNB_OPTIMIZERS,
    OPTIMIZERS,
    SCHEDULERS,
    ConfigError,
    TrainingArguments,
    accepts_keyword,
    check_scheduler_kwargs,
    resolve_callable,
)

PAGED_ON_CPU = (
    "optim=paged_adamw_8bit on CPU: no paging (bitsandbytes pages optimizer state through CUDA unified memory only); "
    "the 8-bit state is ordinary host memory, as adamw_bnb_8bit's"
)


def _no_decay(param: torch.Tensor, in_norm: bool) -> bool:
    return param.ndim < 2 or in_norm


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Trainable parameters split into a decayed group and a weight_decay=0 group (see the module docstring);
    each group is {"params", "param_names", "weight_decay"}, empty groups are left out."""
    norm_owned = {
        id(p) for module in model.modules() if "Norm" in type(module).__name__ for p in module.parameters(recurse=False)
    }
    decay: dict[str, list] = {"params": [], "param_names": []}
    no_decay: dict[str, list] = {"params": [], "param_names": []}
    for name, param in model.named_parameters():  # named_parameters skips tied duplicates
        if not param.requires_grad:
            continue
        group = no_decay if _no_decay(param, id(param) in norm_owned) else decay
        group["params"].append(param)
        group["param_names"].append(name)
    groups = [
        {**group, "weight_decay": wd}
        for group, wd in ((decay, float(weight_decay)), (no_decay, 0.0))
        if group["params"]
    ]
    if not groups:
        raise ConfigError(f"{type(model).__name__} has no trainable parameters (all have requires_grad=False)")
    return groups


def _groups_from(model_or_params: Any, weight_decay: float) -> list[dict[str, Any]]:
    if isinstance(model_or_params, torch.nn.Module):
        return param_groups(model_or_params, weight_decay)
    items = list(model_or_params)
    if not items:
        raise ConfigError("no parameters to optimize")
    if all(isinstance(item, dict) for item in items):
        return [dict(item) for item in items]  # caller-made groups are used as given
    named = all(isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], torch.Tensor) for item in items)
    if not named and not all(isinstance(item, torch.Tensor) for item in items):
        raise TypeError("build_optimizer takes a module, parameters, (name, parameter) pairs or param-group dicts")
    pairs = items if named else [(None, p) for p in items]
    groups = []
    for keep_decay, wd in ((True, float(weight_decay)), (False, 0.0)):
        chosen = [(n, p) for n, p in pairs if p.requires_grad and (not _no_decay(p, False)) == keep_decay]
        if chosen:
            group: dict[str, Any] = {"params": [p for _, p in chosen], "weight_decay": wd}
            if named:
                group["param_names"] = [n for n, _ in chosen]
            groups.append(group)
    if not groups:
        raise ConfigError("no trainable parameters to optimize (all have requires_grad=False)")
    return groups


def build_optimizer(model_or_params: torch.nn.Module | Iterable, args: TrainingArguments) -> torch.optim.Optimizer:
    """The optimizer named by `args.optim` over `model_or_params` (a module: `param_groups`; parameters or
    (name, parameter) pairs: the ndim rule alone; dicts: used as given), with `args`' hyperparameters (validated
    by TrainingArguments)."""
    groups = _groups_from(model_or_params, args.weight_decay)
    lr, wd = float(args.learning_rate), float(args.weight_decay)
    config = args.optim_config or {}
    if config and config["name"] not in OPTIMIZERS:  # 'module:attribute' (a registered name set args.optim)
        return _user_optimizer(config["name"], groups, lr, {k: v for k, v in config.items() if k != "name"})
    optim_args = args.optim_args
    if args.optim == "sgd":
        return torch.optim.SGD(groups, lr=lr, weight_decay=wd, **optim_args)
    betas, eps = (float(args.adam_beta1), float(args.adam_beta2)), float(args.adam_epsilon)
    if args.optim == "adamw_torch":
        return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, weight_decay=wd, **optim_args)
    if args.optim == "adamw_torch_fused":
        return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, weight_decay=wd, fused=True, **optim_args)
    if args.optim in BNB_OPTIMIZERS:
        modules = list(model_or_params.modules()) if isinstance(model_or_params, torch.nn.Module) else []
        return _bnb_adamw_8bit(args.optim, groups, modules, lr=lr, betas=betas, eps=eps, weight_decay=wd)
    state_dtype = getattr(torch, optim_args.get("state_dtype", "float32"))  # validated: float32 or bfloat16
    return FusedAdamW(groups, lr=lr, betas=betas, eps=eps, weight_decay=wd, state_dtype=state_dtype)


def _bnb_adamw_8bit(optim: str, groups: list[dict[str, Any]], modules: list, **hyper: Any) -> torch.optim.Optimizer:
    """bitsandbytes' AdamW8bit (PagedAdamW8bit for paged_adamw_8bit) as transformers builds it: its AdamW with
    optim_bits=8 and is_paged, lr, betas and eps from the flags, each group's weight decay; and, as transformers'
    Trainer.create_optimizer does, 32-bit state for the weight of every nn.Embedding among `modules`. transformers
    registers that override with bitsandbytes' process-wide GlobalOptimManager, which keeps every module it is given
    alive and matches later optimizers' parameters by (group, index) and id(); here each optimizer gets a manager of
    its own (`mng`, the attribute bitsandbytes 0.50 reads the overrides from), so nothing outlives the optimizer."""
    try:
        from bitsandbytes.optim import AdamW8bit, GlobalOptimManager, PagedAdamW8bit
    except ImportError:
        raise ConfigError(f"optim={optim}: bitsandbytes is not installed ({BITSANDBYTES_INSTALL})") from None
    optimizer = (PagedAdamW8bit if optim == "paged_adamw_8bit" else AdamW8bit)(groups, **hyper)
    manager = GlobalOptimManager.__new__(GlobalOptimManager)  # its __init__ refuses: get_instance's singleton
    manager.initialize()
    for module in modules:
        if isinstance(module, torch.nn.Embedding):
            manager.register_module_override(module, "weight", {"optim_bits": 32})
    optimizer.mng = manager
    if optim == "paged_adamw_8bit" and all(p.device.type == "cpu" for g in groups for p in g["params"]):
        # bitsandbytes falls back to plain memory on the CPU and says so with a UserWarning at the first step, in the
        # middle of the progress bar; its once-per-optimizer flag quiets it and the Trainer says PAGED_ON_CPU instead
        optimizer._cpu_paged_warned = True
    return optimizer


def _user_optimizer(
    spec: str, groups: list[dict[str, Any]], lr: float, options: dict[str, Any]
) -> torch.optim.Optimizer:
    """optim_config's class or factory, called as fn(param_groups, lr=learning_rate (where it takes lr), **options);
    each group carries its weight_decay (0 for biases and norms)."""
    fn = resolve_callable("optim_config", spec)
    optimizer = fn(groups, **({"lr": lr} if accepts_keyword(fn, "lr") else {}), **options)
    if not isinstance(optimizer, torch.optim.Optimizer):
        kind = type(optimizer).__name__
        raise ConfigError(f"optim_config.name={spec!r} returned a {kind}, not a torch.optim.Optimizer")
    return optimizer


# ---------------------------------------------------------------------------------------------------------
# Schedule factors. Each takes the step count `s` (LambdaLR's last_epoch) and returns the lr multiplier.
# ---------------------------------------------------------------------------------------------------------


def _warmup(s: int, w: int) -> float:
    return float(s) / float(max(1, w))


def _linear(s: int, *, w: int, t: int) -> float:
    if s < w:
        return _warmup(s, w)
    return max(0.0, float(t - s) / float(max(1, t - w)))


def _cosine(s: int, *, w: int, t: int, num_cycles: float, min_lr_rate: float = 0.0) -> float:
    if s < w:
        return _warmup(s, w)
    progress = float(s - w) / float(max(1, t - w))
    factor = 0.5 * (1.0 + math.cos(math.pi * float(num_cycles) * 2.0 * progress))
    return max(0.0, factor * (1.0 - min_lr_rate) + min_lr_rate)


def _cosine_restarts(s: int, *, w: int, t: int, num_cycles: int) -> float:
    if s < w:
        return _warmup(s, w)
    progress = float(s - w) / float(max(1, t - w))
    if progress >= 1.0:
        return 0.0
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * ((float(num_cycles) * progress) % 1.0))))


def _polynomial(s: int, *, w: int, t: int, lr_init: float, lr_end: float, power: float) -> float:
    if s < w:
        return _warmup(s, w)
    if s > t:
        return lr_end / lr_init
    remaining = 1.0 - (s - w) / max(1, t - w)
    return ((lr_init - lr_end) * remaining**power + lr_end) / lr_init


def _constant(s: int) -> float:
    return 1.0


def _constant_with_warmup(s: int, *, w: int) -> float:
    return float(s) / float(max(1.0, w)) if s < w else 1.0


def _inverse_sqrt(s: int, *, w: int, timescale: int) -> float:
    if s < w:
        return _warmup(s, w)
    return 1.0 / math.sqrt((s + timescale - w) / timescale)


def _shape(kind: str, progress: float, rising: bool, num_cycles: float) -> float:
    """warmup_stable_decay's ramps: rising from 0 to 1 during warmup, falling from 1 to 0 during decay."""
    if kind == "linear":
        return progress if rising else 1.0 - progress
    if kind == "cosine":
        if rising:
            return 0.5 * (1.0 - math.cos(math.pi * progress))
        return 0.5 * (1.0 + math.cos(math.pi * float(num_cycles) * 2.0 * progress))
    return 1.0 - math.sqrt(1.0 - progress) if rising else 1.0 - math.sqrt(progress)  # 1-sqrt


def _wsd(
    s: int,
    *,
    w: int,
    stable: int,
    decay: int,
    warmup_type: str,
    decay_type: str,
    min_lr_ratio: float,
    num_cycles: float,
) -> float:
    if s < w:
        factor = _shape(warmup_type, float(s) / float(max(1, w)), True, num_cycles)
        return max(0.0, factor * (1.0 - min_lr_ratio) + min_lr_ratio)
    if s < w + stable:
        return 1.0
    if s < w + stable + decay:
        factor = _shape(decay_type, float(s - w - stable) / float(max(1, decay)), False, num_cycles)
        return max(0.0, factor * (1.0 - min_lr_ratio) + min_lr_ratio)
    return min_lr_ratio


def build_scheduler(
    name: str,
    optimizer: torch.optim.Optimizer,
    num_warmup_steps: int,
    num_training_steps: int,
    **kwargs: Any,
) -> LambdaLR:
    """A LambdaLR for schedule `name` (a `lr_scheduler_type`) with Hugging Face's formulas; `kwargs` are the
    schedule's `lr_scheduler_kwargs` (see the module docstring), checked here: a direct caller's only check."""
    kw = check_scheduler_kwargs(name, kwargs)
    _check_lr_end(name, kw, optimizer)
    return _lambda_schedule(kw, name, optimizer, num_warmup_steps, num_training_steps)


def _check_lr_end(name: str, kw: dict[str, Any], optimizer: torch.optim.Optimizer) -> None:
    """polynomial's lr_end below the optimizer's initial lr (as transformers checks it)."""
    if name != "polynomial":
        return
    lr_init, lr_end = optimizer.defaults["lr"], kw.get("lr_end", 1e-7)
    if not lr_init > lr_end:
        raise ConfigError(f"lr_scheduler_kwargs.lr_end={lr_end!r}: must be smaller than the initial lr {lr_init!r}")


def _lambda_schedule(
    kw: dict[str, Any], name: str, optimizer: torch.optim.Optimizer, num_warmup_steps: int, num_training_steps: int
) -> LambdaLR:
    """`build_scheduler` for a validated schedule name and typed `kw` (check_scheduler_kwargs' output)."""
    w, t = int(num_warmup_steps), int(num_training_steps)
    if w < 0:
        raise ConfigError(f"num_warmup_steps={num_warmup_steps!r}: must be >= 0")
    if t < 1 and name != "constant":
        raise ConfigError(f"num_training_steps={num_training_steps!r}: must be >= 1")
    lr_init = optimizer.defaults["lr"]
    if name == "linear":
        fn = partial(_linear, w=w, t=t)
    elif name == "cosine":
        fn = partial(_cosine, w=w, t=t, num_cycles=kw.get("num_cycles", 0.5))
    elif name == "cosine_with_restarts":
        fn = partial(_cosine_restarts, w=w, t=t, num_cycles=kw.get("num_cycles", 1))
    elif name == "polynomial":
        fn = partial(_polynomial, w=w, t=t, lr_init=lr_init, lr_end=kw.get("lr_end", 1e-7), power=kw.get("power", 1.0))
    elif name == "constant":
        fn = _constant
    elif name == "constant_with_warmup":
        fn = partial(_constant_with_warmup, w=w)
    elif name == "inverse_sqrt":
        timescale = kw.get("timescale")
        fn = partial(_inverse_sqrt, w=w, timescale=timescale if timescale is not None else (w or 10_000))
    elif name == "warmup_stable_decay":
        decay = kw["num_decay_steps"]
        stable = kw.get("num_stable_steps")
        if stable is None:
            stable = t - w - decay
            if stable < 0:
                raise ConfigError(
                    f"lr_scheduler_kwargs.num_decay_steps={decay}: warmup ({w}) + decay exceed num_training_steps ({t})"
                )
        fn = partial(
            _wsd,
            w=w,
            stable=stable,
            decay=decay,
            warmup_type=kw.get("warmup_type", "linear"),
            decay_type=kw.get("decay_type", "cosine"),
            min_lr_ratio=kw.get("min_lr_ratio", 0.0),
            num_cycles=kw.get("num_cycles", 0.5),
        )
    else:  # cosine_with_min_lr (check_scheduler_kwargs, here or in TrainingArguments, rejected every other name)
        rate = kw["min_lr"] / lr_init if kw.get("min_lr") is not None else kw["min_lr_rate"]
        fn = partial(_cosine, w=w, t=t, num_cycles=kw.get("num_cycles", 0.5), min_lr_rate=rate)
    return LambdaLR(optimizer, fn)


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, args: TrainingArguments, num_training_steps: int
) -> LRScheduler:
    """The schedule `args` ask for over `num_training_steps`: lr_scheduler_config's 'module:attribute' (called as
    fn(optimizer, **options), plus num_training_steps and num_warmup_steps where its signature takes them), else
    `build_scheduler`'s schedule for lr_scheduler_type and lr_scheduler_kwargs (validated by TrainingArguments,
    not again here) with args' warmup."""
    warmup = args.get_warmup_steps(num_training_steps)
    config = args.lr_scheduler_config or {}
    if not config or config["name"] in SCHEDULERS:  # a registered name set lr_scheduler_type/kwargs
        if optimizer.defaults["lr"] != args.learning_rate:
            # a user's optimizer (Trainer's `optimizers`) with its own lr: TrainingArguments checked lr_end against
            # learning_rate, not against that
            _check_lr_end(args.lr_scheduler_type, args.lr_scheduler_kwargs, optimizer)
        return _lambda_schedule(args.lr_scheduler_kwargs, args.lr_scheduler_type, optimizer, warmup, num_training_steps)
    spec = config["name"]
    fn = resolve_callable("lr_scheduler_config", spec)
    options = {k: v for k, v in config.items() if k != "name"}
    for key, value in (("num_training_steps", num_training_steps), ("num_warmup_steps", warmup)):
        if accepts_keyword(fn, key):
            options[key] = value
    scheduler = fn(optimizer, **options)
    # The loop calls scheduler.step() once per optimizer step with no argument, and saves state_dict() in checkpoints.
    if not isinstance(scheduler, LRScheduler) or isinstance(scheduler, ReduceLROnPlateau):
        raise ConfigError(
            f"lr_scheduler_config.name={spec!r} returned a {type(scheduler).__name__}; expected a "
            "torch.optim.lr_scheduler.LRScheduler that steps once per optimizer step (ReduceLROnPlateau needs a metric)"
        )
    return scheduler


__all__ = ["PAGED_ON_CPU", "param_groups", "build_optimizer", "build_scheduler", "build_lr_scheduler"]
