"""Training arguments: one dataclass, the single source of truth for a run, and its entry points.

What it holds and how it is read
--------------------------------
`TrainingArguments` carries every setting of a run with Hugging Face `TrainingArguments` names, defaults and
meaning (transformers 5.23 is the oracle; fields that 5.x removed but the seeds document, e.g. `warmup_ratio`,
`logging_dir`, `group_by_length`, `save_safetensors`, keep their 4.x meaning). `__post_init__` coerces
values (so `"2e-5"` from YAML becomes a float), folds aliases, derives defaults the way Hugging Face does and
validates; every user error is a `ConfigError` whose one-line message names the argument and what is
allowed. Calling `__post_init__` on its own output changes nothing, so `to_dict()` -> `from_dict()` and
`to_json_file()` -> `from_json_file()` are exact round-trips (the loop saves `training_args.json` in every
checkpoint).

The arguments live in three modules, one job each (coerce <- arg_parser <- args; none imports a later one):
  trainer/coerce.py      ConfigError and value coercion ("2e-5" -> 2e-05, "true" -> True), choose/check helpers
  trainer/config/arg_parser.py  the CLI/YAML parser over argument dataclasses: aliases, the rejection table, --help,
                         close-match hints
  trainer/config/args.py        this dataclass and every check of its values (validation happens here, once; the
                         optimizer and schedule builders in trainer.loop.optim trust it), and the entry points below

`parse_args(argv, extra_dataclasses)` is our `HfArgumentParser`: it reads an optional YAML/JSON config file
given first, then `--name value` flags (flags win), spreads the values over `TrainingArguments` and the CLI's
own dataclasses, and returns one instance of each. `format_help()` prints every argument grouped by theme
with its default and one line of meaning, taken from the fields' metadata (`group`, `help`, `choices`).

The CLI's dataclasses keep their help in the same metadata keys; a field without a default is required.
`parse_dict(mapping, extra_dataclasses)` does the same from one mapping. User errors raise `ConfigError`
(the CLI prints its one line without a traceback); `--help` prints and raises SystemExit(0).

    args, data_args = parse_args(["run.yaml", "--learning_rate", "2e-5"], [DataArguments])
    args.resolve_world(world_size)        # gradient_accumulation_steps from global_batch_size
    max_steps = args.get_max_steps(len(train_loader))
    warmup = args.get_warmup_steps(max_steps); steps = args.resolve_steps(max_steps)

The newer trainer's names (seed 001) are accepted: `micro_batch_size` (= per_device_train_batch_size),
`global_batch_size` (accumulation derived by `resolve_world(world_size)`), `cutoff_len`,
`enable_activation_checkpointing` (= gradient_checkpointing), `batching_strategy`, `dist_config`, `optim_config`,
`lr_scheduler_config`.
`train_shuffle` (default True) is ours: it carries transformers 5's `train_sampling_strategy="sequential"`.
`pad_to_multiple_of` (TRL's SFTConfig name) and `max_tokens` (the token budget of the dynamic batching strategies)
are batching options the loop's loader reads, so they are saved in training_args.json like every other setting.
Names users bring from TRL and LlamaFactory are resolved by the parser (not constructor arguments):
`max_seq_length` / `max_length` (= cutoff_len), and the booleans of `arg_parser.BOOLEAN_ALIASES`, `packing`
(= batching_strategy padding_free) and `assistant_only_loss` (false = the CLI's train_on_prompt).

Test: `python -m pytest tests/trainer/config/test_args.py -q`.

Deliberate differences from Hugging Face
----------------------------------------
- `optim` defaults to `adamw_fused` (our AdamW, `kernels.FusedAdamW`: Triton, the CUDA op for bf16 parameters); only
  `adamw_fused`, `adamw_torch`, `adamw_torch_fused`, `sgd` and bitsandbytes' 8-bit AdamW under transformers' names
  (`adamw_bnb_8bit`, its alias `adamw_8bit`, `paged_adamw_8bit`) exist. transformers' other bitsandbytes names
  (`paged_adamw_32bit`, `lion_8bit`, `lion_32bit`, `paged_lion_*`, `ademamix*`, `paged_ademamix*`, `rmsprop_bnb*`) are
  not offered. An 8-bit AdamW without bitsandbytes installed is an error here, at argument time (HF fails when the
  optimizer is built), and so is one with FSDP2 (bitsandbytes' update ops take no DTensor parameters).
  `optim_args` is validated per optimizer (HF ignores unknown keys for AdamW, and passes bitsandbytes' AdamW none, so
  none are accepted for it) and stored as a typed dict; `lr_scheduler_kwargs` keys are validated per schedule.
- `report_to` accepts `none`, `all`, or any of `jsonl` (ours), `tensorboard`, `wandb`, `mlflow`, `swanlab`,
  `trackio` (trainer/loop/loggers.py); a service whose package is not installed is an error here, at argument time
  (HF fails later, when the callback is built). `all` = jsonl + every installed one, as HF's "all". Other HF
  integrations (comet_ml, neptune, ...) are rejected. DeepSpeed, the Hub (`push_to_hub`, `hub_*`), TPUs
  and the other HF options we do not implement are rejected with a message, never silently ignored.
- `optim_config` / `lr_scheduler_config` (seed 001's plugin configs, `{name: ..., ...options}`): a registered
  name is the same as `optim` + `optim_args` / `lr_scheduler_type` + `lr_scheduler_kwargs` (those are set from
  it, so training_args.json shows both); `module:attribute` names your own optimizer class/factory, called
  as `fn(param_groups, lr=learning_rate, **options)` (lr only where it takes one; each group carries its
  weight_decay), or schedule, called as `fn(optimizer, **options)` plus `num_training_steps` and
  `num_warmup_steps` where its signature names them. Unknown names list the registered ones; a module that
  does not import, or an HF argument that says something else beside the config, is a one-line error.
- Dict-valued fields (`optim_args`, `lr_scheduler_kwargs`, `gradient_checkpointing_kwargs`) are normalised to
  dicts (`{}` when unset) instead of HF's `None`/string.
- `warmup_steps` follows transformers 5.23 (float: >= 1 is a step count truncated with `int()` as HF does,
  a value in (0, 1) is a ratio of the total steps, rounded up); `warmup_ratio` (4.x) is used only when
  `warmup_steps` is 0. `constant` with a warmup is an error here (HF silently ignores the warmup).
- `get_max_steps` uses the seeds' formula, ceil(epochs * floor(micro batches / accumulation)); where
  transformers 5.23 takes an extra step for a trailing partial accumulation, our loop folds those micro batches
  into the epoch's last window (token-normalised, so exact), so epochs and max_steps always agree.
- Extra checks HF does not make: `save_strategy="best"` and `load_best_model_at_end` need an eval strategy;
  `save_strategy="best"` needs `metric_for_best_model`; `dataloader_persistent_workers` needs workers;
  negative steps, rates and sizes are errors; `max_steps` is -1 or positive.
- No side effects at construction: HF enables TF32 and checks bf16 support on the GPU inside
  `__post_init__`; here the loop does that, so arguments can be built and validated on any machine.
- No files read at construction: HF reads `--deepspeed ds.json` (and the world size) in `__post_init__`; here the
  arguments hold its path, and the JSON is read and checked against them (every contradiction, one line) by
  `trainer.cli_args.check_run` for the command line (world size from the launcher's WORLD_SIZE) and at `Trainer`
  construction (the real world size), before anything is built.
- `output_dir` defaults to HF's `"trainer_output"`; `run_name` defaults to `output_dir` and `logging_dir`
  to `output_dir/runs/<date>_<host>` (4.x behaviour), `disable_tqdm` is a plain bool (default False).
- `resume_from_checkpoint` is normalised to None (do not resume), `"auto"` (True/"true" too: the newest
  checkpoint in output_dir) or a path.
- `use_kernels=True` (default) runs our kernels; `use_liger_kernel=True` takes precedence and uses
  liger-kernel's (see `kernel_provider`). `gradient_checkpointing` keeps the 4.x name; transformers 5's
  `activation_checkpointing(_kwargs)` are aliases. `train_sampling_strategy` maps onto `group_by_length`
  and `train_shuffle` ("batch_rebalance" is unsupported). The old `evaluation_strategy` is an alias.
- `--fsdp "full_shard auto_wrap"` / `--fsdp_config` become `dist_config={"name": "fsdp2", ...}`; FSDP1-only
  options and fsdp_config keys we cannot honour are errors. `dist_config.mixed_precision` left unset follows
  `--bf16`/`--fp16` (the seed defaults it to bf16); contradicting them is an error.
- `global_batch_size` wins over `gradient_accumulation_steps`: the loop calls `resolve_world(world_size)`,
  which sets the accumulation; until then the given accumulation is kept (so round-trips stay exact).
"""

import dataclasses
import datetime
import difflib
import importlib
import importlib.util
import inspect
import json
import math
import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import InitVar, dataclass, field
from typing import Any

import torch

from trainer.coerce import (
    FALSE_WORDS,
    TRUE_WORDS,
    ConfigError,
    check,
    check_keys,
    choose,
    coerce,
    load_mapping,
    read_config_file,
    to_bool,
)
from trainer.config.arg_parser import (
    SIMPLE_ALIASES,
    field_default,
    help_text,
    parse_argv,
    parse_mapping,
    show_value,
)

EVAL_STRATEGIES = ("no", "steps", "epoch")
LOGGING_STRATEGIES = ("no", "steps", "epoch")
SAVE_STRATEGIES = ("no", "steps", "epoch", "best")
# bitsandbytes' 8-bit AdamW under transformers' names (adamw_8bit is transformers' alias of adamw_bnb_8bit); the
# optional package is checked here, at argument time (trainer.loop.optim imports it when it builds the optimizer)
BNB_OPTIMIZERS = ("adamw_bnb_8bit", "adamw_8bit", "paged_adamw_8bit")
BITSANDBYTES_INSTALL = "pip install 'kernelwright[qlora]'"
OPTIMIZERS = ("adamw_fused", "adamw_torch", "adamw_torch_fused", "sgd", *BNB_OPTIMIZERS)
SCHEDULERS = (
    "linear",
    "cosine",
    "cosine_with_restarts",
    "polynomial",
    "constant",
    "constant_with_warmup",
    "inverse_sqrt",
    "warmup_stable_decay",
    "cosine_with_min_lr",
)
# The package each report_to name needs (the pip name is the same; trainer.loop.loggers imports them); jsonl needs
# none.
LOGGER_PACKAGES = {
    "tensorboard": "tensorboard",
    "wandb": "wandb",
    "mlflow": "mlflow",
    "swanlab": "swanlab",
    "trackio": "trackio",
}
REPORTERS = ("jsonl", *LOGGER_PACKAGES)  # jsonl needs no package; the services are optional dependencies
# a streamed dataset's examples planned together: enough for best-fit-decreasing to pack rows nearly full
PACKING_BUFFER = 1000
BATCHING_STRATEGIES = ("normal", "padding_free", "dynamic_batching", "dynamic_padding_free")
TOKEN_BUDGET_STRATEGIES = ("dynamic_batching", "dynamic_padding_free")  # the ones max_tokens applies to
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
TOKENS_SEEN_MODES = ("no", "all", "non_padding")
WSD_SHAPES = ("linear", "cosine", "1-sqrt")
MIXED_PRECISIONS = ("bf16", "fp16", "fp32")

QUANT_TYPES = ("nf4", "fp4")  # bnb_4bit_quant_type (trainer/model/quant.py)
QUANT_COMPUTE_DTYPES = ("float32", "bfloat16", "float16")
QUANT_STORAGES = ("uint8", "bfloat16", "float16", "float32")
ADAMW_STATE_DTYPES = ("float32", "bfloat16")  # adamw_fused's optim_args state_dtype
# Keys each optimizer accepts in `optim_args`, with their types (everything else is set by its own flag).
OPTIM_ARGS: dict[str, dict[str, Any]] = {
    "adamw_fused": {"state_dtype": str},  # the moments' storage: float32 (default) or bfloat16 (kernels.FusedAdamW)
    "adamw_torch": {"amsgrad": bool},
    "adamw_torch_fused": {"amsgrad": bool},
    "sgd": {"momentum": float, "dampening": float, "nesterov": bool},
    # transformers passes bitsandbytes' AdamW no optim_args (lr, betas, eps, weight decay come from their flags)
    **{name: {} for name in BNB_OPTIMIZERS},
}

# Keys each schedule accepts in `lr_scheduler_kwargs` (Hugging Face's names), with their types.
SCHEDULER_KWARGS: dict[str, dict[str, Any]] = {
    "linear": {},
    "cosine": {"num_cycles": float},
    "cosine_with_restarts": {"num_cycles": int},
    "polynomial": {"lr_end": float, "power": float},
    "constant": {},
    "constant_with_warmup": {},
    "inverse_sqrt": {"timescale": int | None},
    "warmup_stable_decay": {
        "num_decay_steps": int,
        "num_stable_steps": int | None,
        "warmup_type": str,
        "decay_type": str,
        "min_lr_ratio": float,
        "num_cycles": float,
    },
    "cosine_with_min_lr": {"num_cycles": float, "min_lr": float | None, "min_lr_rate": float | None},
}

# dist_config schema per backend; values are the defaults filled in when a key is absent.
DIST_DEFAULTS: dict[str, dict[str, Any]] = {
    "fsdp2": {
        "name": "fsdp2",
        "mixed_precision": None,
        "reshard_after_forward": True,
        "offload_params": False,
        "pin_memory": True,
        "dcp_path": None,
    },
    "ddp": {"name": "ddp"},
    "deepspeed": {"name": "deepspeed", "config_file": None},
}
_DIST_TYPES = {
    "name": str,
    "mixed_precision": str | None,
    "reshard_after_forward": bool,
    "offload_params": bool,
    "pin_memory": bool,
    "dcp_path": str | None,
    "config_file": str | None,
}

GROUPS = (
    "output",
    "control",
    "batching",
    "evaluation",
    "optimizer",
    "schedule",
    "logging",
    "checkpoints",
    "data",
    "precision",
    "performance",
    "distributed",
    "extras",
    "lora",
    "quantization",
)
LORA_FINETUNING_TYPES = ("lora", "full")  # LlamaFactory's finetuning_type values we implement (freeze, oft: not)


def _arg(default: Any, group: str, help: str, choices: Sequence[str] | None = None) -> Any:
    metadata = {"group": group, "help": help}
    if choices is not None:
        metadata["choices"] = tuple(choices)
    return field(default=default, metadata=metadata)


# ---------------------------------------------------------------------------------------------------------
# optim_args and lr_scheduler_kwargs: parsed and validated here so that a bad value fails at startup, and
# reused by trainer.loop.optim when the optimizer and schedule are built.
# ---------------------------------------------------------------------------------------------------------


def parse_optim_args(
    optim: str, optim_args: str | Mapping[str, Any] | None, what: str = "optim_args"
) -> dict[str, Any]:
    """`optim_args` ("k=v,k=v" as in HF, a JSON object, or a dict) as a typed dict validated for `optim`; `what`
    names the argument in errors (optim_config when the options come from there)."""
    schema = OPTIM_ARGS[choose("optim", optim, OPTIMIZERS, _why_unsupported(optim, "optimizer"))]
    if optim_args is None:
        return {}
    if isinstance(optim_args, str):
        text = optim_args.strip()
        if text.startswith("{"):
            raw = load_mapping(what, text)
        else:
            raw = {}
            for item in filter(None, text.replace(" ", "").split(",")):
                key, sep, value = item.partition("=")
                if not sep or not key:
                    raise ConfigError(f"{what}={optim_args!r}: expected 'key=value,key=value'")
                raw[key] = value
    elif isinstance(optim_args, Mapping):
        raw = dict(optim_args)
    else:
        raise ConfigError(f"{what}={optim_args!r}: expected 'key=value,...', a JSON object or a dict")
    check_keys(what, raw, schema, f"optim={optim!r}")
    out = {k: coerce(f"{what}.{k}", v, schema[k]) for k, v in raw.items()}
    if "state_dtype" in out:
        out["state_dtype"] = choose(f"{what}.state_dtype", out["state_dtype"], ADAMW_STATE_DTYPES)
    if optim == "sgd":
        for key in ("momentum", "dampening"):
            check(out.get(key, 0.0) >= 0, f"{what}.{key}", out.get(key), "must be >= 0")
        if out.get("nesterov"):
            check(
                out.get("momentum", 0.0) > 0 and out.get("dampening", 0.0) == 0,
                f"{what}.nesterov",
                True,
                "needs momentum > 0 and dampening = 0",
            )
    return out


def check_scheduler_kwargs(
    name: str, kwargs: Mapping[str, Any] | None, what: str = "lr_scheduler_kwargs"
) -> dict[str, Any]:
    """`lr_scheduler_kwargs` validated (names, types, values) for schedule `name`; returns a typed copy. `what`
    names the argument in errors (lr_scheduler_config when the options come from there)."""
    name = choose("lr_scheduler_type", name, SCHEDULERS)
    schema = SCHEDULER_KWARGS[name]
    kwargs = dict(kwargs or {})
    check_keys(what, kwargs, schema, f"lr_scheduler_type={name!r}")
    out = {k: coerce(f"{what}.{k}", v, schema[k]) for k, v in kwargs.items()}
    if name == "warmup_stable_decay":
        if "num_decay_steps" not in out:
            raise ConfigError(f"{what}: warmup_stable_decay needs num_decay_steps")
        check(out["num_decay_steps"] >= 0, f"{what}.num_decay_steps", out["num_decay_steps"], ">= 0")
        if out.get("num_stable_steps") is not None:
            stable = out["num_stable_steps"]
            check(stable >= 0, f"{what}.num_stable_steps", stable, ">= 0")
        for key in ("warmup_type", "decay_type"):
            if key in out:
                choose(f"{what}.{key}", out[key], WSD_SHAPES)
        if "min_lr_ratio" in out:
            check(0 <= out["min_lr_ratio"] <= 1, f"{what}.min_lr_ratio", out["min_lr_ratio"], "in [0, 1]")
    if name == "cosine_with_min_lr":
        given = [k for k in ("min_lr", "min_lr_rate") if out.get(k) is not None]
        if len(given) != 1:
            raise ConfigError(f"{what}: cosine_with_min_lr needs exactly one of min_lr or min_lr_rate")
        check(out[given[0]] >= 0, f"{what}.{given[0]}", out[given[0]], "must be >= 0")
    if name == "inverse_sqrt" and out.get("timescale") is not None:
        check(out["timescale"] > 0, f"{what}.timescale", out["timescale"], "must be > 0")
    if name == "polynomial" and "power" in out:
        check(out["power"] > 0, f"{what}.power", out["power"], "must be > 0")
    if "num_cycles" in out:
        check(out["num_cycles"] > 0, f"{what}.num_cycles", out["num_cycles"], "must be > 0")
    return out


# ---------------------------------------------------------------------------------------------------------
# optim_config / lr_scheduler_config (seed 001's plugin configs): {name: <registered name or module:attribute>,
# ...options}. Resolved here, at argument time, so an unknown name or a module that does not import fails before
# any expensive work; trainer.loop.optim builds them.
# ---------------------------------------------------------------------------------------------------------


def resolve_callable(what: str, spec: str) -> Any:
    """The class or function named by `spec` ('package.module:attribute', the attribute may be dotted)."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ConfigError(f"{what}.name={spec!r}: expected a registered name or 'module:attribute'")
    try:
        obj = importlib.import_module(module_name)
    except Exception as e:  # the user's module: any error while importing it is theirs to see, in one line
        first_line = (str(e).splitlines() or [""])[0]
        why = f"{type(e).__name__}: {first_line}"
        raise ConfigError(f"{what}.name={spec!r}: cannot import {module_name!r} ({why})") from None
    for part in attribute.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"{what}.name={spec!r}: {module_name!r} has no attribute {attribute!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"{what}.name={spec!r}: {attribute!r} is not a class or function")
    return obj


def accepts_keyword(fn: Any, name: str) -> bool:
    """Whether calling `fn` (a function or a class) accepts keyword argument `name` (named, or through **kwargs)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # builtins without a signature
        return False
    return any((p.name == name and p.kind != p.POSITIONAL_ONLY) or p.kind == p.VAR_KEYWORD for p in params)


def _plugin(what: str, value: Any, registered: Sequence[str], kind: str) -> tuple[str, dict[str, Any]]:
    """(name, other keys) of a plugin config; the name is registered or a 'module:attribute' that resolves."""
    cfg = load_mapping(what, value)
    choices = f"registered {kind}s: {', '.join(registered)}; or 'module:attribute' for your own"
    if not isinstance(cfg.get("name"), str):
        raise ConfigError(f"{what}: 'name' is required ({choices})")
    name = cfg.pop("name")
    if name not in registered:
        if ":" not in name:
            close = difflib.get_close_matches(name, registered, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{what}.name={name!r} is not a registered {kind}{hint}; {choices}")
        resolve_callable(what, name)
    return name, cfg


def optimizer_steps(batches_per_rank: int, accumulation: int) -> int:
    """Optimizer steps in an epoch of `batches_per_rank` micro batches per rank: floor(batches / accumulation),
    at least 1 (the leftovers join the epoch's last step). The one statement of the rule (args, batching)."""
    return max(batches_per_rank // accumulation, 1)


@dataclass
class TrainingArguments:
    """Every setting of a training run (Hugging Face names and defaults); see the module docstring."""

    # --- output ---
    output_dir: str = _arg("trainer_output", "output", "Directory for checkpoints, logs and the final model.")
    overwrite_output_dir: bool = _arg(
        False, "output", "Write into an output_dir that already holds checkpoints instead of stopping."
    )
    run_name: str | None = _arg(None, "output", "Name of the run in logs; defaults to output_dir.")

    # --- control ---
    do_train: bool = _arg(False, "control", "Run training (read by the CLI, not by the loop).")
    do_eval: bool = _arg(False, "control", "Evaluate on the eval set; set automatically when eval_strategy != 'no'.")
    num_train_epochs: float = _arg(
        3.0, "control", "Epochs to train; a fraction stops part-way through the last one. Unused if max_steps > 0."
    )
    max_steps: int = _arg(-1, "control", "Total optimizer steps; -1 derives them from num_train_epochs.")
    resume_from_checkpoint: str | bool | None = _arg(
        None, "control", "Checkpoint directory to resume from; 'auto' or a bare flag takes the newest in output_dir."
    )

    # --- batching ---
    per_device_train_batch_size: int = _arg(
        8, "batching", "Sequences per device per micro-step (alias: micro_batch_size)."
    )
    per_device_eval_batch_size: int = _arg(8, "batching", "Sequences per device per evaluation step.")
    gradient_accumulation_steps: int = _arg(
        1, "batching", "Micro-steps accumulated per optimizer step; derived when global_batch_size is set."
    )
    global_batch_size: int | None = _arg(
        None, "batching", "Sequences per optimizer step over all devices; accumulation = global / (world * micro)."
    )
    max_grad_norm: float = _arg(1.0, "batching", "Clip the global gradient norm to this value; 0 disables clipping.")
    eval_accumulation_steps: int | None = _arg(
        None, "batching", "Eval steps whose outputs stay on the device before moving to the CPU; None keeps all."
    )

    # --- evaluation ---
    eval_strategy: str = _arg("no", "evaluation", "When to evaluate during training.", EVAL_STRATEGIES)
    eval_steps: float | None = _arg(
        None, "evaluation", "Steps between evaluations (a value < 1 is a ratio of max_steps); default logging_steps."
    )
    eval_delay: float = _arg(0, "evaluation", "Epochs or steps (per eval_strategy) to wait before the first eval.")
    eval_on_start: bool = _arg(False, "evaluation", "Evaluate once before the first training step (sanity check).")
    prediction_loss_only: bool = _arg(False, "evaluation", "Evaluation returns only the loss, no predictions.")

    # --- optimizer ---
    learning_rate: float = _arg(5e-5, "optimizer", "Peak learning rate (after warmup).")
    weight_decay: float = _arg(0.0, "optimizer", "Decoupled weight decay; never applied to biases and norm weights.")
    adam_beta1: float = _arg(0.9, "optimizer", "AdamW beta1 (first-moment decay).")
    adam_beta2: float = _arg(0.999, "optimizer", "AdamW beta2 (second-moment decay).")
    adam_epsilon: float = _arg(1e-8, "optimizer", "AdamW epsilon added to the denominator.")
    optim: str = _arg(
        "adamw_fused",
        "optimizer",
        "Optimizer; adamw_fused is our fused AdamW (kernels.FusedAdamW), the *8bit ones bitsandbytes' 8-bit AdamW.",
        OPTIMIZERS,
    )
    optim_args: str | dict | None = _arg(
        None, "optimizer", "Extra optimizer options, 'k=v,k=v' or JSON (sgd: momentum, dampening, nesterov)."
    )
    optim_config: dict | str | None = _arg(
        None,
        "optimizer",
        "{name: a registered optimizer or 'module:attribute', ...its options} (instead of "
        "optim/optim_args); a class is called as cls(param_groups, lr=learning_rate, **options).",
    )

    # --- schedule ---
    lr_scheduler_type: str = _arg("linear", "schedule", "Learning-rate schedule.", SCHEDULERS)
    lr_scheduler_kwargs: dict | str | None = _arg(
        None, "schedule", 'Schedule options as a dict or JSON, e.g. {"num_cycles": 2} (HF names).'
    )
    lr_scheduler_config: dict | str | None = _arg(
        None,
        "schedule",
        "{name: a registered schedule or 'module:attribute', ...its options} (instead of "
        "lr_scheduler_type/kwargs); a factory is called as fn(optimizer, **options).",
    )
    warmup_ratio: float = _arg(0.0, "schedule", "Warmup as a fraction of total steps; used when warmup_steps is 0.")
    warmup_steps: float = _arg(
        0, "schedule", "Linear warmup steps (>= 1) or a ratio of total steps (< 1); overrides warmup_ratio."
    )

    # --- logging ---
    logging_dir: str | None = _arg(
        None, "logging", "Directory for jsonl/TensorBoard logs; default output_dir/runs/<date_host>."
    )
    logging_strategy: str = _arg("steps", "logging", "When to log training metrics.", LOGGING_STRATEGIES)
    logging_steps: float = _arg(500, "logging", "Steps between logs (a value < 1 is a ratio of max_steps).")
    logging_first_step: bool = _arg(False, "logging", "Also log the first optimizer step.")
    logging_nan_inf_filter: bool = _arg(True, "logging", "Leave NaN/Inf losses out of the logged running loss.")
    report_to: str | list[str] | None = _arg(
        "none", "logging", "Loggers: none, all, or some of jsonl, tensorboard, wandb, mlflow, swanlab, trackio."
    )
    disable_tqdm: bool = _arg(False, "logging", "Hide the progress bar.")
    include_tokens_per_second: bool = _arg(False, "logging", "Log training tokens per second per device.")
    include_num_input_tokens_seen: str | bool = _arg(
        "no", "logging", "Track input tokens seen: no, all or non_padding (true = all).", TOKENS_SEEN_MODES
    )

    # --- checkpoints ---
    save_strategy: str = _arg("steps", "checkpoints", "When to save a checkpoint.", SAVE_STRATEGIES)
    save_steps: float = _arg(500, "checkpoints", "Steps between checkpoints (a value < 1 is a ratio of max_steps).")
    save_total_limit: int | None = _arg(
        None, "checkpoints", "Keep at most this many checkpoints (the best one is always kept)."
    )
    save_safetensors: bool = _arg(True, "checkpoints", "Save weights as safetensors (else torch.save).")
    save_only_model: bool = _arg(
        False, "checkpoints", "Save only the weights, not optimizer/scheduler/RNG state (cannot resume)."
    )
    load_best_model_at_end: bool = _arg(
        False, "checkpoints", "Load the best checkpoint (by metric_for_best_model) when training ends."
    )
    metric_for_best_model: str | None = _arg(
        None, "checkpoints", "Eval metric that ranks checkpoints; 'loss' when load_best_model_at_end."
    )
    greater_is_better: bool | None = _arg(
        None, "checkpoints", "Whether a larger metric is better; False for names ending in 'loss'."
    )

    # --- data ---
    seed: int = _arg(42, "data", "Random seed set at the start of training.")
    data_seed: int | None = _arg(None, "data", "Seed for data shuffling; defaults to seed.")
    dataloader_num_workers: int = _arg(0, "data", "DataLoader worker processes (0 loads in the main process).")
    dataloader_drop_last: bool = _arg(False, "data", "Drop the last incomplete batch.")
    dataloader_pin_memory: bool = _arg(True, "data", "Pin host memory for faster host-to-device copies.")
    dataloader_persistent_workers: bool = _arg(False, "data", "Keep DataLoader workers alive between epochs.")
    dataloader_prefetch_factor: int | None = _arg(
        None, "data", "Batches each worker loads ahead (needs dataloader_num_workers > 0)."
    )
    group_by_length: bool = _arg(False, "data", "Batch sequences of similar length together to reduce padding.")
    train_shuffle: bool = _arg(True, "data", "Shuffle the training set each epoch (False = sequential order).")
    length_column_name: str = _arg("length", "data", "Column with precomputed lengths for group_by_length.")
    remove_unused_columns: bool = _arg(True, "data", "Drop dataset columns the model's forward does not take.")
    cutoff_len: int = _arg(2048, "data", "Maximum sequence length in tokens; longer examples are truncated.")
    batching_strategy: str = _arg(
        "normal", "data", "How examples become batches (padding_free packs them without padding).", BATCHING_STRATEGIES
    )
    pad_to_multiple_of: int | None = _arg(
        None, "data", "Pad micro batches to a multiple of this (8/64 help torch.compile)."
    )
    max_tokens: int | None = _arg(None, "data", "Token budget per micro batch for the dynamic batching strategies.")
    packing_buffer: int = _arg(
        PACKING_BUFFER,
        "data",
        "A streamed dataset's examples planned into batches together (packed best-fit-decreasing, shuffled) "
        "(axolotl: pretrain_multipack_buffer_size).",
    )

    # --- precision ---
    bf16: bool = _arg(False, "precision", "bfloat16 mixed-precision training.")
    fp16: bool = _arg(False, "precision", "float16 mixed-precision training with loss scaling.")
    tf32: bool | None = _arg(None, "precision", "TF32 matmuls on Ampere+ GPUs; None leaves PyTorch's setting.")
    bf16_full_eval: bool = _arg(False, "precision", "Evaluate with the model entirely in bfloat16.")
    fp16_full_eval: bool = _arg(False, "precision", "Evaluate with the model entirely in float16.")

    # --- performance ---
    torch_compile: bool = _arg(False, "performance", "Compile each decoder block with torch.compile.")
    torch_compile_backend: str | None = _arg(
        None, "performance", "torch.compile backend (default inductor); setting it turns torch_compile on."
    )
    torch_compile_mode: str | None = _arg(
        None, "performance", "torch.compile mode; setting it turns torch_compile on.", COMPILE_MODES
    )
    gradient_checkpointing: bool = _arg(
        False, "performance", "Recompute activations in backward to save memory (alias: activation_checkpointing)."
    )
    gradient_checkpointing_kwargs: dict | str | None = _arg(
        None, "performance", 'Options for activation checkpointing as a dict or JSON, e.g. {"use_reentrant": false}.'
    )
    activation_offloading: bool = _arg(
        False,
        "performance",
        "Keep the activations saved for backward in CPU memory until backward needs them (TRL's name).",
    )
    tiled_mlp: bool = _arg(
        False,
        "performance",
        "Run each MLP over the sequence in tiles of hidden_size tokens, recomputed in backward (axolotl's name).",
    )
    torch_empty_cache_steps: int | None = _arg(
        None, "performance", "Empty the device cache every this many steps (lower peak memory, ~10% slower)."
    )
    auto_find_batch_size: bool = _arg(
        False, "performance", "Halve the batch size and retry when the device runs out of memory."
    )
    use_kernels: bool = _arg(True, "performance", "Use kernelwright's Triton kernels (False: plain PyTorch).")
    use_liger_kernel: bool = _arg(
        False, "performance", "Use liger-kernel's kernels instead of ours (must be installed)."
    )

    # --- distributed ---
    dist_config: dict | str | None = _arg(
        None,
        "distributed",
        "Distributed backend: {name: fsdp2|ddp, mixed_precision, reshard_after_forward, offload_params, "
        "pin_memory, dcp_path} or {name: deepspeed, config_file: ds.json} as dict, JSON or a .json/.yaml path.",
    )

    # --- extras ---
    label_smoothing_factor: float = _arg(0.0, "extras", "Label smoothing in the cross-entropy (0 disables).")
    neftune_noise_alpha: float | None = _arg(
        None, "extras", "NEFTune: add uniform noise of this scale to the embeddings while training."
    )
    average_tokens_across_devices: bool = _arg(
        True, "extras", "Normalise the loss by the token count summed over all devices."
    )
    full_determinism: bool = _arg(False, "extras", "Deterministic algorithms everywhere (slower; for debugging).")
    max_nonfinite_steps: int = _arg(10, "extras", "Stop after this many consecutive steps with a non-finite loss.")
    z_loss: float = _arg(0.0, "extras", "Weight of the z-loss (logsumexp^2) that keeps logits small.")
    router_aux_loss_coef: float | None = _arg(
        None,
        "extras",
        "Mixture-of-experts models: the load-balancing loss's weight, added to the training loss (0 turns it off; "
        "TRL's name). Unset: the model config's output_router_logits and router_aux_loss_coef decide, as in "
        "transformers (TRL turns it on with the config's coefficient).",
    )

    # --- lora (TRL's ModelConfig names and defaults; trainer/model/lora.py) ---
    use_peft: bool = _arg(
        False, "lora", "Train a LoRA adapter through peft instead of every weight (pip install 'kernelwright[lora]')."
    )
    lora_r: int = _arg(16, "lora", "LoRA rank r of the update B A (B: out x r, A: r x in).")
    lora_alpha: int = _arg(32, "lora", "LoRA scale numerator: the update is lora_alpha / r * B A.")
    lora_dropout: float = _arg(0.05, "lora", "Dropout on the input of the LoRA branch while training.")
    lora_target_modules: list[str] | None = _arg(
        None,
        "lora",
        "Linear layers that get an adapter, by name (q_proj v_proj ...) or all-linear (every linear "
        "layer but lm_head); default: peft's choice for the architecture (q_proj v_proj).",
    )
    lora_target_parameters: list[str] | None = _arg(
        None,
        "lora",
        "Parameters (not linear layers) that get an adapter, by name: a mixture of experts' fused expert tensors "
        "(e.g. mlp.experts.gate_up_proj mlp.experts.down_proj; peft's target_parameters, TRL's name).",
    )
    lora_modules_to_save: list[str] | None = _arg(
        None, "lora", "Modules trained in full and saved with the adapter, by name (e.g. norm)."
    )
    use_rslora: bool = _arg(False, "lora", "Rank-stabilised LoRA: scale by lora_alpha / sqrt(r) instead of / r.")
    use_dora: bool = _arg(False, "lora", "DoRA: weight-decomposed LoRA (a trained magnitude per output row).")

    # --- quantization (QLoRA: transformers' BitsAndBytesConfig / TRL's ModelConfig names; trainer/model/quant.py) ---
    load_in_4bit: bool = _arg(
        False,
        "quantization",
        "QLoRA: the base model's linear layers in 4 bits through bitsandbytes, an adapter trained over them (needs "
        "--use_peft; pip install 'kernelwright[qlora]').",
    )
    bnb_4bit_quant_type: str = _arg("nf4", "quantization", "4-bit data type: nf4 or fp4.", QUANT_TYPES)
    bnb_4bit_compute_dtype: str | None = _arg(
        None,
        "quantization",
        "dtype of the 4-bit layers' matmuls (default: the model's dtype, as TRL passes it).",
        QUANT_COMPUTE_DTYPES,
    )
    bnb_4bit_use_double_quant: bool = _arg(
        False, "quantization", "Quantize the 4-bit blocks' absmax scales too (0.516 instead of 0.5625 bytes a weight)."
    )
    bnb_4bit_quant_storage: str | None = _arg(
        None, "quantization", "dtype the 4-bit codes are packed in (default uint8).", QUANT_STORAGES
    )
    load_in_8bit: bool = _arg(
        False,
        "quantization",
        "LLM.int8: the base model's linear layers in 8 bits through bitsandbytes (int8 per row, outlier input "
        "features in 16 bits), an adapter trained over them (needs --use_peft; pip install 'kernelwright[qlora]').",
    )
    llm_int8_threshold: float = _arg(
        6.0,
        "quantization",
        "LLM.int8's outlier threshold: input features with a value above it are multiplied in 16 bits "
        "(transformers' BitsAndBytesConfig default).",
    )

    # --- input-only aliases (folded into the fields above; not stored) ---
    evaluation_strategy: InitVar[str | None] = None
    micro_batch_size: InitVar[int | None] = None
    enable_activation_checkpointing: InitVar[bool | None] = None
    activation_checkpointing: InitVar[bool | None] = None
    activation_checkpointing_kwargs: InitVar[dict | str | None] = None
    train_sampling_strategy: InitVar[str | None] = None
    fsdp: InitVar[str | bool | list[str] | None] = None
    fsdp_config: InitVar[dict | str | None] = None
    deepspeed: InitVar[str | None] = None
    local_rank: InitVar[int | None] = None
    finetuning_type: InitVar[str | None] = None
    quantization_bit: InitVar[int | None] = None
    quantization_method: InitVar[str | None] = None

    def __post_init__(
        self,
        evaluation_strategy,
        micro_batch_size,
        enable_activation_checkpointing,
        activation_checkpointing,
        activation_checkpointing_kwargs,
        train_sampling_strategy,
        fsdp,
        fsdp_config,
        deepspeed,
        local_rank,
        finetuning_type,
        quantization_bit,
        quantization_method,
    ):
        for f in dataclasses.fields(self):
            setattr(self, f.name, coerce(f.name, getattr(self, f.name), f.type, f.metadata.get("choices")))
        self._fold_aliases(
            {
                "evaluation_strategy": evaluation_strategy,
                "micro_batch_size": micro_batch_size,
                "enable_activation_checkpointing": enable_activation_checkpointing,
                "activation_checkpointing": activation_checkpointing,
                "activation_checkpointing_kwargs": activation_checkpointing_kwargs,
            }
        )
        self._fold_sampling(train_sampling_strategy)
        self._fold_fsdp(fsdp, fsdp_config)
        self._fold_deepspeed(deepspeed)
        self._check_local_rank(local_rank)
        self._fold_finetuning_type(finetuning_type)
        self._fold_quantization(quantization_bit, quantization_method)
        self._normalise()
        self._derive()
        self._validate()

    # -- construction steps -------------------------------------------------------------------------------

    def _fold_aliases(self, given: Mapping[str, Any]) -> None:
        for alias, value in given.items():
            if value is None:
                continue
            target = SIMPLE_ALIASES[alias]
            f = _field(type(self), target)
            value = coerce(alias, value, f.type)
            current = getattr(self, target)
            if current != field_default(f) and current != value:
                raise ConfigError(
                    f"{alias} is an alias of {target}; they were given different values ({value!r} and {current!r})"
                )
            setattr(self, target, value)

    def _fold_sampling(self, strategy: Any) -> None:
        if strategy is None:
            return
        strategy = choose("train_sampling_strategy", strategy, ("random", "sequential", "group_by_length"))
        wanted = {"random": (False, True), "sequential": (False, False), "group_by_length": (True, True)}[strategy]
        current = (self.group_by_length, self.train_shuffle)
        if current not in ((False, True), wanted):
            raise ConfigError(
                f"train_sampling_strategy={strategy!r} contradicts group_by_length={current[0]} / "
                f"train_shuffle={current[1]}; give one of them"
            )
        self.group_by_length, self.train_shuffle = wanted

    def _fold_fsdp(self, fsdp: Any, fsdp_config: Any) -> None:
        """Hugging Face's `--fsdp` options and `--fsdp_config` become `dist_config` with name fsdp2."""
        fsdp = coerce("fsdp", fsdp, str | bool | list[str] | None)
        if isinstance(fsdp, (str, list)):  # "full_shard auto_wrap", ["full_shard", "offload"], ["true"], ""
            words = [w for item in ([fsdp] if isinstance(fsdp, str) else fsdp) for w in item.split()]
            if len(words) == 1 and words[0].lower() in TRUE_WORDS + FALSE_WORDS:
                fsdp = to_bool(words[0])
            else:
                fsdp = words or False
        if fsdp_config is not None and not fsdp:
            raise ConfigError("fsdp_config is read only together with --fsdp (e.g. --fsdp full_shard)")
        if not fsdp:
            return
        if self.dist_config is not None:
            raise ConfigError("fsdp and dist_config both given; use dist_config alone")
        cfg: dict[str, Any] = {"name": "fsdp2"}
        for option in [] if fsdp is True else fsdp:
            if option == "full_shard":
                cfg["reshard_after_forward"] = True
            elif option == "shard_grad_op":
                cfg["reshard_after_forward"] = False
            elif option == "offload":
                cfg["offload_params"] = True
            elif option == "auto_wrap":
                pass  # we always wrap each decoder block, which is what auto_wrap asks for
            elif option in ("hybrid_shard", "hybrid_shard_zero2", "no_shard"):
                raise ConfigError(
                    f"fsdp={option!r} is FSDP1-only; kernelwright uses FSDP2: full_shard, shard_grad_op, offload"
                )
            else:
                choose("fsdp", option, ("full_shard", "shard_grad_op", "offload", "auto_wrap"))
        hf_config = load_mapping("fsdp_config", fsdp_config) if fsdp_config is not None else {}
        for key, value in hf_config.items():
            key = key.removeprefix("fsdp_")
            if key == "version":
                check(coerce("fsdp_config.version", value, int) == 2, "fsdp_config.version", value, "only 2 (FSDP2)")
            elif key in ("cpu_offload", "offload_params"):
                cfg["offload_params"] = coerce(f"fsdp_config.{key}", value, bool)
            elif key == "activation_checkpointing":
                if coerce("fsdp_config.activation_checkpointing", value, bool):
                    self.gradient_checkpointing = True
            elif key == "auto_wrap_policy":
                check(
                    value == "TRANSFORMER_BASED_WRAP",
                    "fsdp_config.auto_wrap_policy",
                    value,
                    "only TRANSFORMER_BASED_WRAP (each decoder block is wrapped)",
                )
            elif key in ("reshard_after_forward", "pin_memory", "dcp_path", "mixed_precision"):
                cfg[key] = value
            else:
                accepted = (
                    "version, reshard_after_forward, cpu_offload, activation_checkpointing, auto_wrap_policy, "
                    "pin_memory, dcp_path, mixed_precision"
                )
                raise ConfigError(f"fsdp_config: key {key!r} is not supported; accepted keys: {accepted}")
        self.dist_config = cfg

    def _fold_deepspeed(self, deepspeed: Any) -> None:
        """Hugging Face's `--deepspeed ds.json` is dist_config {name: deepspeed, config_file: ds.json}."""
        if deepspeed is None:
            return
        path = coerce("deepspeed", deepspeed, str)
        if self.dist_config is not None:
            raise ConfigError(
                f"deepspeed and dist_config both given (--fsdp sets dist_config too); use one: "
                f"--deepspeed {path} is dist_config {{name: deepspeed, config_file: {path}}}"
            )
        self.dist_config = {"name": "deepspeed", "config_file": path}

    @staticmethod
    def _check_local_rank(local_rank: Any) -> None:
        """The deepspeed launcher passes --local_rank=N to each process and sets LOCAL_RANK=N beside it, which is
        what the process group reads (trainer/dist.py); the flag is accepted only when it says the same."""
        if local_rank is None:
            return
        local_rank = coerce("local_rank", local_rank, int)
        env = os.environ.get("LOCAL_RANK")
        if env is None or int(env) != local_rank:
            raise ConfigError(
                f"local_rank={local_rank}: only a launcher sets it, with LOCAL_RANK={local_rank} in the "
                f"environment (LOCAL_RANK is {env}); launch with torchrun or deepspeed"
            )

    def _fold_finetuning_type(self, finetuning_type: Any) -> None:
        """LlamaFactory's `finetuning_type`: lora sets use_peft, full leaves it off; freeze and oft are refused."""
        if finetuning_type is None:
            return
        kind = choose("finetuning_type", finetuning_type, LORA_FINETUNING_TYPES)
        if self.use_peft and kind == "full":
            raise ConfigError("finetuning_type='full' contradicts use_peft=True; give one of them")
        self.use_peft = kind == "lora"

    def _fold_quantization(self, bits: Any, method: Any) -> None:
        """LlamaFactory's `quantization_bit: 4` is load_in_4bit, `8` load_in_8bit; its `quantization_method` must be
        bnb, the one backend here."""
        if method is not None:
            choose("quantization_method", method, ("bnb",), " is not supported: bitsandbytes (bnb) is the one backend")
        if bits is None:
            return
        bits = coerce("quantization_bit", bits, int)
        if bits not in (4, 8):
            raise ConfigError(f"quantization_bit={bits!r}{_QUANT_BITS_WHY}")
        if bits == 4:
            self.load_in_4bit = True
        else:
            self.load_in_8bit = True

    def _normalise(self) -> None:
        self.output_dir = os.path.expanduser(self.output_dir)
        if self.run_name is None:
            self.run_name = self.output_dir
        if self.logging_dir is None:
            stamp = datetime.datetime.now().strftime("%b%d_%H-%M-%S")
            self.logging_dir = os.path.join(self.output_dir, "runs", f"{stamp}_{socket.gethostname()}")
        self.logging_dir = os.path.expanduser(self.logging_dir)

        rc = self.resume_from_checkpoint
        if rc is False or (isinstance(rc, str) and not rc.strip()):
            self.resume_from_checkpoint = None
        elif rc is True or (isinstance(rc, str) and rc.strip().lower() == "auto"):
            self.resume_from_checkpoint = "auto"

        if isinstance(self.include_num_input_tokens_seen, bool):
            self.include_num_input_tokens_seen = "all" if self.include_num_input_tokens_seen else "no"

        self.report_to = _normalise_report_to(self.report_to)
        self.optim = choose("optim", self.optim, OPTIMIZERS, _why_unsupported(self.optim, "optimizer"))
        self.optim_args = parse_optim_args(self.optim, self.optim_args)
        why = _why_unsupported(self.lr_scheduler_type, "schedule")
        self.lr_scheduler_type = choose("lr_scheduler_type", self.lr_scheduler_type, SCHEDULERS, why)
        self.lr_scheduler_kwargs = check_scheduler_kwargs(
            self.lr_scheduler_type, load_mapping("lr_scheduler_kwargs", self.lr_scheduler_kwargs or {})
        )
        self._fold_optim_config()
        self._fold_lr_scheduler_config()
        self.gradient_checkpointing_kwargs = load_mapping(
            "gradient_checkpointing_kwargs", self.gradient_checkpointing_kwargs or {}
        )
        if self.dist_config is not None:
            self.dist_config = _normalise_dist_config(load_mapping("dist_config", self.dist_config))

        for name in ("lora_target_modules", "lora_target_parameters", "lora_modules_to_save"):
            setattr(self, name, _module_names(name, getattr(self, name)))

        for name in ("logging_steps", "eval_steps", "save_steps"):
            setattr(self, name, _interval(name, getattr(self, name)))
        if self.warmup_steps >= 1 and float(self.warmup_steps).is_integer():
            self.warmup_steps = int(self.warmup_steps)

    def _fold_optim_config(self) -> None:
        """optim_config with a registered name is optim + optim_args written the seed's way (they are set from it,
        so both stay true in training_args.json); with 'module:attribute' it names the user's optimizer class or
        factory. Either way a different optim or optim_args given beside it is refused, not silently overridden."""
        if self.optim_config is None:
            return
        name, options = _plugin("optim_config", self.optim_config, OPTIMIZERS, "optimizer")
        if name in OPTIMIZERS:
            options = parse_optim_args(name, options, "optim_config")
            if self.optim not in (name, field_default(_field(type(self), "optim"))):
                raise ConfigError(
                    f"optim_config.name={name!r} and optim={self.optim!r} both choose the optimizer; give one"
                )
            if self.optim_args and self.optim_args != options:
                raise ConfigError(
                    "optim_config and optim_args both set the optimizer's options; give them in optim_config"
                )
            self.optim, self.optim_args = name, options
        else:
            for key, instead in (
                ("params", "the trainer passes the parameter groups"),
                ("lr", "set learning_rate, which the schedule and the logs read"),
                ("weight_decay", "set weight_decay, which each parameter group carries"),
            ):
                if key in options:
                    raise ConfigError(f"optim_config.{key}: {instead}")
            if self.optim != field_default(_field(type(self), "optim")) or self.optim_args:
                raise ConfigError(f"optim_config.name={name!r} chooses the optimizer; drop optim/optim_args")
        self.optim_config = {"name": name, **options}

    def _fold_lr_scheduler_config(self) -> None:
        """lr_scheduler_config, as `_fold_optim_config`: a registered name sets lr_scheduler_type/kwargs; a
        'module:attribute' factory or class is called with the optimizer, its options, and num_training_steps /
        num_warmup_steps where its signature takes them (a warmup it cannot take is refused)."""
        if self.lr_scheduler_config is None:
            return
        what = "lr_scheduler_config"
        name, options = _plugin(what, self.lr_scheduler_config, SCHEDULERS, "schedule")
        if name in SCHEDULERS:
            options = check_scheduler_kwargs(name, options, what)
            if self.lr_scheduler_type not in (name, field_default(_field(type(self), "lr_scheduler_type"))):
                raise ConfigError(
                    f"{what}.name={name!r} and lr_scheduler_type={self.lr_scheduler_type!r} both choose the schedule; "
                    "give one"
                )
            if self.lr_scheduler_kwargs and self.lr_scheduler_kwargs != options:
                raise ConfigError(
                    f"{what} and lr_scheduler_kwargs both set the schedule's options; give them in {what}"
                )
            self.lr_scheduler_type, self.lr_scheduler_kwargs = name, options
        else:
            for key, instead in (
                ("optimizer", "the trainer passes the optimizer"),
                ("num_training_steps", "the trainer passes it (max_steps or the epochs' steps)"),
                ("num_warmup_steps", "set warmup_steps or warmup_ratio"),
            ):
                if key in options:
                    raise ConfigError(f"{what}.{key}: {instead}")
            if (
                self.lr_scheduler_type != field_default(_field(type(self), "lr_scheduler_type"))
                or self.lr_scheduler_kwargs
            ):
                raise ConfigError(
                    f"{what}.name={name!r} chooses the schedule; drop lr_scheduler_type/lr_scheduler_kwargs"
                )
            warmup = self.warmup_steps or self.warmup_ratio
            if warmup and not accepts_keyword(resolve_callable(what, name), "num_warmup_steps"):
                raise ConfigError(
                    f"{what}.name={name!r} takes no num_warmup_steps, so warmup_steps/warmup_ratio={warmup!r} would be "
                    "ignored; set them to 0"
                )
        self.lr_scheduler_config = {"name": name, **options}

    def _derive(self) -> None:
        """Defaults that depend on other arguments, as Hugging Face derives them."""
        if self.eval_strategy != "no":
            self.do_eval = True
        if self.eval_strategy == "steps" and not self.eval_steps:
            if not self.logging_steps:
                raise ConfigError("eval_strategy='steps' needs eval_steps > 0 (or logging_steps > 0 to default to)")
            self.eval_steps = self.logging_steps
        if self.load_best_model_at_end and self.metric_for_best_model is None:
            self.metric_for_best_model = "loss"
        if self.greater_is_better is None and self.metric_for_best_model is not None:
            self.greater_is_better = not self.metric_for_best_model.endswith("loss")
        if self.torch_compile_mode is not None or self.torch_compile_backend is not None:
            self.torch_compile = True
        if self.torch_compile and self.torch_compile_backend is None:
            self.torch_compile_backend = "inductor"

    def _validate(self) -> None:
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            value = getattr(self, f.name)
            if choices is not None and value is not None:
                choose(f.name, value, choices)

        if self.bf16 and self.fp16:
            raise ConfigError("bf16 and fp16 are both set; choose at most one mixed precision")
        if self.activation_offloading and (self.dist_config or {}).get("name") == "deepspeed":
            raise ConfigError(
                "activation_offloading with DeepSpeed is not supported: DeepSpeed keeps its own copies; use its "
                "activation_checkpointing.cpu_checkpointing in the DeepSpeed JSON, or dist_config fsdp2/ddp"
            )
        if self.bf16_full_eval and self.fp16_full_eval:
            raise ConfigError("bf16_full_eval and fp16_full_eval are both set; choose at most one")
        self._validate_bnb_optimizer()

        for name in (
            "per_device_train_batch_size",
            "per_device_eval_batch_size",
            "gradient_accumulation_steps",
            "max_nonfinite_steps",
        ):
            check(getattr(self, name) >= 1, name, getattr(self, name), "must be a positive integer")
        # numpy's generators (the data order) take no negative seed
        check(self.seed >= 0, "seed", self.seed, "must be an integer >= 0")
        check(
            self.data_seed is None or self.data_seed >= 0,
            "data_seed",
            self.data_seed,
            "must be an integer >= 0 or unset",
        )
        # torch.compile would name a wrong backend only at the first step; the message lists the usual ones
        if self.torch_compile and self.torch_compile_backend not in torch._dynamo.list_backends(exclude_tags=()):
            choose("torch_compile_backend", self.torch_compile_backend, torch._dynamo.list_backends())
        # a 1-token example has nothing to predict (the first token is never a target): the data pipeline's rule
        check(self.cutoff_len >= 2, "cutoff_len", self.cutoff_len, "must be an integer >= 2")
        for name in (
            "eval_accumulation_steps",
            "save_total_limit",
            "torch_empty_cache_steps",
            "dataloader_prefetch_factor",
            "global_batch_size",
            "pad_to_multiple_of",
            "max_tokens",
        ):
            value = getattr(self, name)
            check(value is None or value >= 1, name, value, "must be a positive integer or unset")
        # the batching options each strategy takes (trainer/data/batching.py), refused here rather than when the loop
        # makes its loader
        if self.group_by_length and self.batching_strategy != "normal":
            raise ConfigError(
                f"group_by_length applies to batching_strategy='normal' (got {self.batching_strategy!r}; "
                "the other strategies already avoid padding): drop one of them"
            )
        if self.max_tokens is not None and self.batching_strategy not in TOKEN_BUDGET_STRATEGIES:
            raise ConfigError(
                f"max_tokens applies to batching_strategy {' or '.join(TOKEN_BUDGET_STRATEGIES)} (got "
                f"{self.batching_strategy!r}; it batches per_device_train_batch_size examples)"
            )
        if self.global_batch_size is not None:
            per_step = self.per_device_train_batch_size * self.gradient_accumulation_steps
            check(
                self.global_batch_size % per_step == 0,
                "global_batch_size",
                self.global_batch_size,
                f"must be a multiple of micro_batch_size x gradient_accumulation_steps = {per_step}",
            )

        for name in (
            "learning_rate",
            "weight_decay",
            "adam_epsilon",
            "max_grad_norm",
            "eval_delay",
            "z_loss",
            "warmup_steps",
        ):
            check(getattr(self, name) >= 0, name, getattr(self, name), "must be >= 0")
        for name in ("adam_beta1", "adam_beta2"):
            check(0 <= getattr(self, name) < 1, name, getattr(self, name), "must be in [0, 1)")
        check(0 <= self.warmup_ratio <= 1, "warmup_ratio", self.warmup_ratio, "must be in [0, 1]")
        smoothing = self.label_smoothing_factor
        check(0 <= smoothing < 1, "label_smoothing_factor", smoothing, "must be in [0, 1)")
        check(
            self.neftune_noise_alpha is None or self.neftune_noise_alpha > 0,
            "neftune_noise_alpha",
            self.neftune_noise_alpha,
            "must be > 0 or unset",
        )
        check(
            self.router_aux_loss_coef is None or self.router_aux_loss_coef >= 0,
            "router_aux_loss_coef",
            self.router_aux_loss_coef,
            "must be >= 0 (0 turns the router loss off) or unset",
        )
        steps = self.max_steps
        check(steps == -1 or steps > 0, "max_steps", steps, "must be -1 or a positive integer")
        if self.max_steps == -1:
            epochs = self.num_train_epochs
            check(epochs > 0, "num_train_epochs", epochs, "must be > 0 when max_steps is -1")
        check(self.dataloader_num_workers >= 0, "dataloader_num_workers", self.dataloader_num_workers, "must be >= 0")
        if self.dataloader_num_workers == 0:
            check(
                self.dataloader_prefetch_factor is None,
                "dataloader_prefetch_factor",
                self.dataloader_prefetch_factor,
                "needs dataloader_num_workers > 0",
            )
            check(
                not self.dataloader_persistent_workers,
                "dataloader_persistent_workers",
                True,
                "needs dataloader_num_workers > 0",
            )

        if self.logging_strategy == "steps":
            logging = self.logging_steps
            check(logging > 0, "logging_steps", logging, "must be > 0 when logging_strategy='steps'")
        if self.save_strategy == "steps":
            check(self.save_steps > 0, "save_steps", self.save_steps, "must be > 0 when save_strategy='steps'")
        self._validate_best_model()
        self._validate_lora()
        self._validate_quantization()

        if self.lr_scheduler_type == "constant" and (self.warmup_steps > 0 or self.warmup_ratio > 0):
            raise ConfigError(
                "lr_scheduler_type='constant' has no warmup; "
                "use constant_with_warmup or set warmup_steps/warmup_ratio to 0"
            )
        if self.lr_scheduler_type == "polynomial":
            lr_end = self.lr_scheduler_kwargs.get("lr_end", 1e-7)
            check(
                lr_end < self.learning_rate,
                "lr_scheduler_kwargs.lr_end",
                lr_end,
                f"must be smaller than learning_rate={self.learning_rate!r}",
            )
        if self.dist_config is not None:
            mp = self.dist_config.get("mixed_precision")
            if (mp == "fp16" and self.bf16) or (mp == "bf16" and self.fp16):
                raise ConfigError(
                    f"dist_config.mixed_precision={mp!r} contradicts --{'bf16' if self.bf16 else 'fp16'}; "
                    "leave it unset to follow the precision flags"
                )

    def _validate_bnb_optimizer(self) -> None:
        """bitsandbytes' 8-bit AdamW: the package is installed (found, not imported: the import takes seconds), and
        the parameters are plain tensors (FSDP2's DTensors reach bitsandbytes' update ops mixed with plain state
        tensors, which DTensor refuses: measured with bitsandbytes 0.50.2 and torch 2.13)."""
        if self.optim not in BNB_OPTIMIZERS:
            return
        if importlib.util.find_spec("bitsandbytes") is None:
            raise ConfigError(f"optim={self.optim}: bitsandbytes is not installed ({BITSANDBYTES_INSTALL})")
        if (self.dist_config or {}).get("name") == "fsdp2":
            raise ConfigError(
                f"optim={self.optim} with dist_config fsdp2 (--fsdp) is not supported: bitsandbytes' 8-bit AdamW "
                "steps plain tensors, not FSDP2's sharded DTensor parameters; use DDP or DeepSpeed, or --optim "
                "adamw_fused with --optim_args state_dtype=bfloat16 (4 bytes of state per parameter)"
            )

    def _validate_best_model(self) -> None:
        """Hugging Face's rules for load_best_model_at_end, plus: evaluation must be on."""
        if self.save_strategy == "best":
            if self.metric_for_best_model is None:
                raise ConfigError("save_strategy='best' needs metric_for_best_model (e.g. loss)")
            check(self.eval_strategy != "no", "eval_strategy", "no", "must be steps or epoch when save_strategy='best'")
        if not self.load_best_model_at_end:
            return
        check(self.eval_strategy != "no", "eval_strategy", "no", "must be steps or epoch with load_best_model_at_end")
        if self.save_strategy == "best":
            return
        if self.save_strategy != self.eval_strategy:
            raise ConfigError(
                f"load_best_model_at_end needs save_strategy == eval_strategy (or save_strategy='best'); "
                f"got save_strategy={self.save_strategy!r}, eval_strategy={self.eval_strategy!r}"
            )
        save, ev = self.save_steps, self.eval_steps
        if self.eval_strategy == "steps" and save % ev != 0:
            if (save < 1) != (ev < 1):
                raise ConfigError(
                    f"load_best_model_at_end: save_steps={save!r} and eval_steps={ev!r} mix a ratio and a step "
                    "count, so save_steps cannot be checked to be a multiple of eval_steps"
                )
            # Ratios compared in millionths so that 0.3 / 0.1 is an exact multiple despite float rounding.
            if save >= 1 or round(save * 1_000_000) % round(ev * 1_000_000) != 0:
                raise ConfigError(
                    f"load_best_model_at_end: save_steps={save!r} must be a multiple of eval_steps={ev!r}"
                )

    def _validate_lora(self) -> None:
        check(self.lora_r >= 1, "lora_r", self.lora_r, "must be a positive integer")
        check(self.lora_alpha > 0, "lora_alpha", self.lora_alpha, "must be > 0")
        check(0 <= self.lora_dropout < 1, "lora_dropout", self.lora_dropout, "must be in [0, 1)")
        if not self.use_peft:  # a LoRA setting without LoRA would be ignored: refuse it
            given = [
                f.name
                for f in dataclasses.fields(self)
                if f.metadata.get("group") == "lora"
                and f.name != "use_peft"
                and getattr(self, f.name) != field_default(f)
            ]
            if given:
                raise ConfigError(
                    f"{given[0]}={getattr(self, given[0])!r} is a LoRA setting, but use_peft is off; "
                    "add --use_peft (LlamaFactory: finetuning_type: lora)"
                )
        if self.use_peft and self.lora_target_parameters and self.lora_dropout:
            # peft's LoRA on a stacked tensor adds its delta to the weight, which no dropout on the input can reach
            raise ConfigError(
                f"lora_dropout={self.lora_dropout!r}: peft's LoRA on lora_target_parameters (stacked expert tensors) "
                "takes no dropout; set --lora_dropout 0"
            )

    def _validate_quantization(self) -> None:
        # a setting of the other width, or of none, would be ignored: refuse it
        for flag, prefix, what in (("load_in_4bit", "bnb_4bit_", "a 4-bit"), ("load_in_8bit", "llm_int8_", "an 8-bit")):
            given = [
                f.name
                for f in dataclasses.fields(self)
                if f.name.startswith(prefix) and getattr(self, f.name) != field_default(f)
            ]
            if given and not getattr(self, flag):
                raise ConfigError(f"{given[0]}={getattr(self, given[0])!r} is {what} setting; add --{flag}")
        if self.load_in_4bit and self.load_in_8bit:
            raise ConfigError("load_in_4bit and load_in_8bit: the base weights are stored in one width; give one")
        if self.load_in_8bit:
            self._validate_8bit()
        if not self.load_in_4bit:
            return
        if not self.use_peft:
            raise ConfigError(
                "load_in_4bit: 4-bit weights cannot be trained; add --use_peft (QLoRA trains a LoRA adapter over them)"
            )
        name = (self.dist_config or {}).get("name")
        if name == "fsdp2" and self.dist_config.get("dcp_path"):
            raise ConfigError(
                "load_in_4bit with dist_config.dcp_path is not supported: the 4-bit layers quantize full-precision "
                "weights as they are read; give --model the Hugging Face directory (or the preset) instead"
            )
        if name == "fsdp2" and self.bnb_4bit_quant_storage not in (None, "uint8"):
            raise ConfigError(
                f"bnb_4bit_quant_storage={self.bnb_4bit_quant_storage!r} with dist_config fsdp2 is not supported: "
                "FSDP2's mixed precision casts floating-point parameters, which would rewrite 4-bit codes packed in a "
                "float dtype; keep the default uint8 (FSDP2 shards each parameter alone: no common dtype is needed)"
            )
        if name == "deepspeed" and self.bnb_4bit_quant_storage not in (None, "uint8"):
            raise ConfigError(
                f"bnb_4bit_quant_storage={self.bnb_4bit_quant_storage!r} with deepspeed is not supported: DeepSpeed "
                "casts floating-point parameters to its precision, which would rewrite 4-bit codes packed in a float "
                "dtype; keep the default uint8"
            )
        if importlib.util.find_spec("bitsandbytes") is None:
            raise ConfigError(f"load_in_4bit: bitsandbytes is not installed ({BITSANDBYTES_INSTALL})")

    def _validate_8bit(self) -> None:
        if not self.use_peft:
            raise ConfigError(
                "load_in_8bit: 8-bit weights cannot be trained; add --use_peft (a LoRA adapter trains over them)"
            )
        if self.llm_int8_threshold < 0:
            raise ConfigError(f"llm_int8_threshold={self.llm_int8_threshold}: must be >= 0 (0: no outlier features)")
        name = (self.dist_config or {}).get("name")
        if name in ("fsdp2", "deepspeed"):
            raise ConfigError(
                f"load_in_8bit with {'dist_config fsdp2' if name == 'fsdp2' else 'deepspeed'} is not supported: "
                "bitsandbytes' 8-bit layer keeps each row's scale on the weight parameter, which FSDP2 and DeepSpeed "
                "ZeRO-3 replace by their shards; use DDP, or --load_in_4bit (which FSDP2 and DeepSpeed take)"
            )
        if importlib.util.find_spec("bitsandbytes") is None:
            raise ConfigError(f"load_in_8bit: bitsandbytes is not installed ({BITSANDBYTES_INSTALL})")

    # -- helpers for the loop --------------------------------------------------------------------------------

    def get_warmup_steps(self, num_training_steps: int) -> int:
        """Warmup steps for a run of `num_training_steps`: warmup_steps if > 0 (HF: int() when >= 1, ceil of the
        ratio when < 1), else ceil(warmup_ratio * num_training_steps)."""
        if self.warmup_steps >= 1:
            return int(self.warmup_steps)
        if self.warmup_steps > 0:
            return math.ceil(num_training_steps * self.warmup_steps)
        return math.ceil(num_training_steps * self.warmup_ratio)

    def resolve_steps(self, max_steps: int) -> dict[str, int | None]:
        """logging/eval/save steps as absolute step counts (HF: a ratio r < 1 becomes ceil(r * max_steps))."""
        check(max_steps >= 1, "max_steps", max_steps, "must be a positive integer to resolve step ratios")
        out: dict[str, int | None] = {}
        for name in ("logging_steps", "eval_steps", "save_steps"):
            value = getattr(self, name)
            if value is None:
                out[name] = None
            elif value < 1:
                out[name] = math.ceil(max_steps * value)
            else:
                out[name] = int(value)
        return out

    def steps_per_epoch(self, batches_per_epoch: int) -> int:
        """Optimizer steps in one epoch: floor(micro batches per rank / accumulation), at least 1. The loop folds
        the leftover micro batches into the epoch's last window, so no data is dropped."""
        return optimizer_steps(batches_per_epoch, self.gradient_accumulation_steps)

    def get_max_steps(self, batches_per_epoch: int | None) -> int:
        """Total optimizer steps: max_steps if set, else ceil(epochs * floor(batches_per_epoch / accumulation)),
        the seeds' formula `ceil(epochs * floor(N / (per_device_bs * accum * devices)))`. `batches_per_epoch`
        is the per-rank micro-batch count; None (a stream) requires max_steps."""
        if self.max_steps > 0:
            return self.max_steps
        if batches_per_epoch is None:
            raise ConfigError("max_steps: must be set (> 0) when the training data has no length (a stream)")
        return math.ceil(self.num_train_epochs * self.steps_per_epoch(batches_per_epoch))

    def resolve_world(self, world_size: int) -> int:
        """Set and return gradient_accumulation_steps for `world_size` data-parallel ranks: global_batch_size /
        (world_size * micro_batch_size) when global_batch_size is set, else the given accumulation. The one place
        the accumulation is derived, once the world is known: by the CLI before its summary shows it
        (trainer.cli; the Trainer's call is then a no-op), by `Trainer.train` at its start; only
        `halve_micro_batch` (auto_find_batch_size's retry) changes the accumulation after, through it."""
        check(isinstance(world_size, int) and world_size >= 1, "world_size", world_size, "must be a positive integer")
        if self.global_batch_size is None:
            return self.gradient_accumulation_steps
        per_step = world_size * self.per_device_train_batch_size
        if self.global_batch_size % per_step != 0:
            raise ConfigError(
                f"global_batch_size={self.global_batch_size} is not divisible by world_size ({world_size}) x "
                f"micro_batch_size ({self.per_device_train_batch_size}) = {per_step}"
            )
        self.gradient_accumulation_steps = self.global_batch_size // per_step
        return self.gradient_accumulation_steps

    def halve_micro_batch(self, world_size: int) -> tuple[int, int]:
        """auto_find_batch_size's retry after running out of memory: half the micro batch and, through
        `resolve_world`, the accumulation that keeps the global batch (twice the given one without
        global_batch_size). Returns (per_device_train_batch_size, gradient_accumulation_steps)."""
        self.per_device_train_batch_size //= 2
        if self.global_batch_size is None:
            self.gradient_accumulation_steps *= 2
        return self.per_device_train_batch_size, self.resolve_world(world_size)

    def total_train_batch_size(self, world_size: int) -> int:
        """Sequences per optimizer step over all ranks: micro_batch_size * accumulation * world_size."""
        return self.per_device_train_batch_size * self.gradient_accumulation_steps * world_size

    @property
    def mixed_precision(self) -> str:
        """'bf16', 'fp16' or 'no' (as Hugging Face's attribute of the same name)."""
        return "bf16" if self.bf16 else "fp16" if self.fp16 else "no"

    @property
    def kernel_provider(self) -> str:
        """Which fused kernels the model uses: 'liger' (use_liger_kernel wins), 'kernelwright' or 'torch'."""
        return "liger" if self.use_liger_kernel else "kernelwright" if self.use_kernels else "torch"

    # -- serialisation ---------------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Every field with its resolved value (JSON-ready; aliases are not stored)."""
        return {f.name: _copy(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def to_json_file(self, path: str | os.PathLike) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=2)
            f.write("\n")

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "TrainingArguments":
        """Build from a mapping, accepting aliases; unknown or unsupported keys are ConfigErrors."""
        return parse_mapping(values, (cls,))[0]

    @classmethod
    def from_json_file(cls, path: str | os.PathLike) -> "TrainingArguments":
        data = read_config_file(os.fspath(path), "training arguments")
        if not isinstance(data, dict):
            raise ConfigError(f"training arguments: {path} does not hold a JSON object")
        return cls.from_dict(data)

    def summary(self) -> str:
        """The resolved arguments grouped by theme, one per line; '*' marks values changed from the default."""
        defaults = _defaults(type(self))
        derived = {  # defaults that follow output_dir
            "run_name": lambda v: v == self.output_dir,
            "logging_dir": lambda v: os.path.dirname(v) == os.path.join(self.output_dir, "runs"),
        }
        width = max(len(f.name) for f in dataclasses.fields(self))
        lines = ["Training arguments (* = changed from the default)"]
        for group in GROUPS:
            rows = [f for f in dataclasses.fields(self) if f.metadata.get("group") == group]
            if not rows:
                continue
            lines.append(f"[{group}]")
            for f in rows:
                value = getattr(self, f.name)
                unchanged = derived[f.name](value) if f.name in derived else value == defaults[f.name]
                lines.append(f" {' ' if unchanged else '*'} {f.name:<{width}} = {show_value(value)}")
        return "\n".join(lines)


def _normalise_report_to(value: Any) -> list[str]:
    """report_to as a list of logger names; a service whose package is not installed is an error here, before
    any expensive work. 'all' (as in transformers) is every logger that is installed, jsonl first."""
    items = [value] if isinstance(value, str) else list(value or [])
    items = [w for item in items for w in str(item).replace(",", " ").split()]
    if items in ([], ["none"]):
        return []
    if items == ["all"]:
        return [name for name in REPORTERS if _logger_installed(name)]
    out: list[str] = []
    for item in items:
        if item in ("all", "none"):
            raise ConfigError(f"report_to={value!r}: 'all' and 'none' cannot be combined with other loggers")
        if item not in REPORTERS:
            close = difflib.get_close_matches(item, REPORTERS, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(
                f"report_to={item!r} is not supported{hint}; expected none, all or some of {', '.join(REPORTERS)}"
            )
        if not _logger_installed(item):
            package = LOGGER_PACKAGES[item]
            raise ConfigError(f"report_to={item}: {package} is not installed (pip install {package})")
        if item not in out:
            out.append(item)
    return out


def _logger_installed(name: str) -> bool:
    return name not in LOGGER_PACKAGES or importlib.util.find_spec(LOGGER_PACKAGES[name]) is not None


def _normalise_dist_config(cfg: dict) -> dict:
    if "name" not in cfg:
        raise ConfigError("dist_config: 'name' is required (fsdp2, ddp or deepspeed)")
    name = cfg["name"]
    if name == "deepspeed" and not cfg.get("config_file"):
        raise ConfigError(
            "dist_config name deepspeed: 'config_file' is required (the DeepSpeed JSON, e.g. ds_z3_config.json)"
        )
    name = choose("dist_config.name", name, tuple(DIST_DEFAULTS))
    defaults = DIST_DEFAULTS[name]
    check_keys("dist_config", cfg, defaults, f"name={name!r}")
    out = dict(defaults)
    for key, value in cfg.items():
        out[key] = coerce(f"dist_config.{key}", value, _DIST_TYPES[key])
    if out.get("mixed_precision") is not None:
        choose("dist_config.mixed_precision", out["mixed_precision"], MIXED_PRECISIONS)
    return out


def _module_names(name: str, value: list[str] | None) -> list[str] | None:
    """Module names as a list: LlamaFactory's comma-separated strings split ("q_proj,v_proj"), its `all` spelled as
    TRL's/peft's `all-linear`; None (or nothing) stays None."""
    names = [part.strip() for item in value or () for part in item.split(",") if part.strip()]
    if not names:
        return None
    names = ["all-linear" if n == "all" else n for n in names]
    if "all-linear" in names and len(names) > 1:
        raise ConfigError(f"{name}={names!r}: all-linear already takes every linear layer; give it alone")
    return names


def _interval(name: str, value: float | None) -> float | int | None:
    """A logging/eval/save step count: an integer when >= 1 (HF rejects fractions there), a ratio when < 1."""
    if value is None:
        return None
    check(value >= 0, name, value, "must be >= 0 (an integer, or a ratio of max_steps below 1)")
    if value >= 1:
        check(
            float(value).is_integer(), name, value, "must be an integer when >= 1 (below 1 it is a ratio of max_steps)"
        )
        return int(value)
    return value


_QUANT_BITS_WHY = " is not supported: 4 (QLoRA, NF4/FP4) or 8 (LLM.int8) are"


def _why_unsupported(value: Any, what: str) -> str:
    return f" is not a supported {what}" if isinstance(value, str) else ""


def _copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value


def _field(cls: type, name: str) -> dataclasses.Field:
    return cls.__dataclass_fields__[name]


_DEFAULTS_CACHE: dict[type, dict[str, Any]] = {}


def _defaults(cls: type) -> dict[str, Any]:
    """The resolved value of every field of a default-constructed instance (what 'unchanged' means)."""
    if cls not in _DEFAULTS_CACHE:
        instance = cls()
        _DEFAULTS_CACHE[cls] = {f.name: getattr(instance, f.name) for f in dataclasses.fields(cls)}
    return _DEFAULTS_CACHE[cls]


def parse_dict(values: Mapping[str, Any], extra_dataclasses: Sequence[type] = ()) -> tuple:
    """(TrainingArguments, *extras) from one mapping whose keys may belong to any of the dataclasses."""
    return parse_mapping(values, (TrainingArguments, *extra_dataclasses))


def parse_args(
    argv: Sequence[str] | None = None,
    extra_dataclasses: Sequence[type] = (),
    *,
    prog: str = "python -m trainer.sft",
) -> tuple:
    """(TrainingArguments, *extras) from `[config.yaml|json] --name value ...` (flags win over the file).

    `--help` prints `format_help` and raises SystemExit(0); any user error raises ConfigError (one line)."""
    return parse_argv(argv, (TrainingArguments, *extra_dataclasses), prog)


def format_help(extra_dataclasses: Sequence[type] = (), prog: str = "python -m trainer.sft") -> str:
    """Every argument grouped by theme, with its default and one line of meaning."""
    return help_text((TrainingArguments, *extra_dataclasses), prog)


__all__ = [
    "ConfigError",
    "TrainingArguments",
    "parse_args",
    "parse_dict",
    "format_help",
    "parse_optim_args",
    "check_scheduler_kwargs",
    "OPTIMIZERS",
    "BNB_OPTIMIZERS",
    "SCHEDULERS",
    "OPTIM_ARGS",
    "SCHEDULER_KWARGS",
]
