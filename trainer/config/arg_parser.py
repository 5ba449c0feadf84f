"""The CLI/YAML parser: `[config.yaml|json] --name value ...` or one mapping -> instances of argument dataclasses.

It reads any dataclass whose fields carry `metadata={"group", "help", "choices"}` (`trainer.config.args._arg` writes
them; a field without a default is required). `trainer.config.args` binds it to `TrainingArguments` (its `parse_args`,
`parse_dict`, `format_help` put `TrainingArguments` first and the CLI's own dataclasses after it); this module
does not import `trainer.config.args`, so the dataclass can use the name tables below.

Rules: a config file may come first, flags after it win; `--name value`, `--name=value`, bare booleans,
`--no_<bool>`, several values for a list; repeating a flag keeps the last value (argparse's rule). Names users
bring from elsewhere are resolved here: `SIMPLE_ALIASES` (renames), `BOOLEAN_ALIASES` (TRL booleans that set
another argument), `REJECTED` / `REJECTED_PREFIXES` (Hugging Face options we refuse, with the reason); any
other unknown name is a ConfigError with close-match suggestions. `help_text` prints every argument grouped by
theme (in the order the fields declare their groups) with its default and one line of meaning.

Test: `python -m pytest tests/trainer/config/test_args.py -q`.
"""

import dataclasses
import difflib
import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import InitVar, dataclass
from typing import Any

from trainer.coerce import (
    ConfigError,
    annotation_base,
    annotation_members,
    choose,
    coerce,
    describe_type,
    read_config_file,
)

# Pure renames, resolved to the canonical name by the parser (so flags still win over a file).
SIMPLE_ALIASES = {
    "evaluation_strategy": "eval_strategy",
    "micro_batch_size": "per_device_train_batch_size",
    "enable_activation_checkpointing": "gradient_checkpointing",
    "activation_checkpointing": "gradient_checkpointing",
    "activation_checkpointing_kwargs": "gradient_checkpointing_kwargs",
    # TRL's SFTConfig (max_seq_length before TRL 0.20, max_length since) and LlamaFactory's cutoff_len
    "max_seq_length": "cutoff_len",
    "max_length": "cutoff_len",
    # LlamaFactory's name for TRL's dataset_num_proc (the sft command's: tokenise in several processes)
    "preprocessing_num_workers": "dataset_num_proc",
    # LlamaFactory's LoRA names (its finetuning_type: lora is TrainingArguments' finetuning_type alias)
    "lora_rank": "lora_r",
    "lora_target": "lora_target_modules",
    "additional_target": "lora_modules_to_save",
    # LlamaFactory's preference names (stage: dpo)
    "pref_beta": "beta",
    "pref_loss": "loss_type",
    "pref_ftx": "rpo_alpha",
    # LlamaFactory's name for the MoE load-balancing loss's weight (it turns the loss on, as TRL's name does)
    "moe_aux_loss_coef": "router_aux_loss_coef",
    # TRL's ModelConfig and LlamaFactory's quantization names
    "use_bnb_nested_quant": "bnb_4bit_use_double_quant",
    "double_quantization": "bnb_4bit_use_double_quant",
    "quantization_type": "bnb_4bit_quant_type",
}
# Booleans from TRL that set another argument (of any of the parser's dataclasses): name -> (target, value when
# true, value when false), resolved by the parser like SIMPLE_ALIASES. TRL's packing=True packs examples into rows
# without padding, with position ids restarting per example: our padding_free. Its assistant_only_loss=False
# trains conversational data on every token: our train_on_prompt.
BOOLEAN_ALIASES: dict[str, tuple[str, Any, Any]] = {
    "packing": ("batching_strategy", "padding_free", "normal"),
    "assistant_only_loss": ("train_on_prompt", False, True),
}
ALIAS_HELP = {
    "train_sampling_strategy": "transformers 5 sampler name: random | sequential | group_by_length "
    "(sets group_by_length / train_shuffle)",
    "fsdp": "Hugging Face FSDP options, e.g. 'full_shard auto_wrap' or 'shard_grad_op offload' "
    "(sets dist_config name fsdp2)",
    "fsdp_config": "Hugging Face fsdp_config (dict, JSON or a .json/.yaml path) read with --fsdp",
    "local_rank": "set by the deepspeed launcher (--local_rank=N); must equal the LOCAL_RANK it sets beside it",
    "deepspeed": "a DeepSpeed JSON config (ZeRO stage 0-3, offload, bf16/fp16, 'auto' values filled from these "
    "arguments); sets dist_config {name: deepspeed, config_file: PATH}",
    "finetuning_type": "LlamaFactory's: lora (sets use_peft) | full",
    "quantization_bit": "LlamaFactory's: 4 (sets load_in_4bit) or 8 (load_in_8bit)",
    "quantization_method": "LlamaFactory's: bnb (bitsandbytes, the one backend)",
}

_HUB = "pushing to the Hugging Face Hub is not supported; upload output_dir yourself (huggingface-cli upload)"
_DIST = "launch with torchrun; distributed settings live in --dist_config"
_UNIMPLEMENTED = "a Hugging Face TrainingArguments option that kernelwright does not implement"
REJECTED: dict[str, str] = {
    "push_to_hub": _HUB,
    "use_cpu": "the device follows the environment (CUDA when available); hide GPUs with CUDA_VISIBLE_DEVICES=",
    "no_cuda": "the device follows the environment (CUDA when available); hide GPUs with CUDA_VISIBLE_DEVICES=",
    "optim_target_modules": "GaLore/APOLLO optimizers are not supported",
    "liger_kernel_config": "use_liger_kernel applies liger-kernel's defaults; a per-op config is not supported",
    "half_precision_backend": "mixed precision always uses torch.autocast",
    "fp16_opt_level": "Apex AMP is not supported; fp16 uses torch.autocast with a GradScaler",
    "per_gpu_train_batch_size": "renamed per_device_train_batch_size (or micro_batch_size)",
    "per_gpu_eval_batch_size": "renamed per_device_eval_batch_size",
    "adafactor": "Adafactor is not supported; choose --optim adamw_fused, adamw_torch, adamw_torch_fused or sgd",
    "sharded_ddp": 'use --dist_config \'{"name": "fsdp2"}\' for sharded data parallelism',
    "fsdp_min_num_params": "kernelwright wraps each decoder block; size-based wrapping is not supported",
    "fsdp_transformer_layer_cls_to_wrap": "kernelwright always wraps each decoder block; drop this option",
    **{
        name: _UNIMPLEMENTED
        for name in (
            "do_predict",
            "log_level",
            "log_level_replica",
            "log_on_each_node",
            "save_on_each_node",
            "label_names",
            "include_for_metrics",
            "include_inputs_for_metrics",
            "eval_do_concat_batches",
            "eval_use_gather_object",
            "batch_eval_metrics",
            "ignore_data_skip",
            "restore_callback_states_from_checkpoint",
            "skip_memory_metrics",
            "debug",
            "past_index",
            "jit_mode_eval",
            "torchdynamo",
            "ray_scope",
            "accelerator_config",
            "parallelism_config",
            "use_cache",
            "project",
            "trackio_space_id",
            "trackio_bucket_id",
            "trackio_static_space_id",
            "dataloader_multiprocessing_context",
            "dataloader_in_order",
            "enable_jit_checkpoint",
            "use_mps_device",
            "use_ipex",
            "use_legacy_prediction_loop",
            "mp_parameters",
        )
    },
}
REJECTED_PREFIXES = {
    "hub_": _HUB,
    "push_to_hub_": _HUB,
    "tpu_": "TPUs are not supported (CUDA GPUs and CPU only)",
    "ddp_": _DIST,
}


def show_value(value: Any) -> str:
    """A value as --help and the summary print it: dicts and lists as JSON."""
    return json.dumps(value) if isinstance(value, (dict, list)) else str(value)


def field_default(f: dataclasses.Field) -> Any:
    """A field's default (its factory's value), or dataclasses.MISSING for a required field."""
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


@dataclass(frozen=True)
class _Spec:
    name: str
    owner: type
    type: Any
    default: Any
    help: str
    group: str
    choices: tuple[str, ...] | None
    required: bool


def field_specs(classes: Sequence[type]) -> dict[str, _Spec]:
    specs: dict[str, _Spec] = {}
    for cls in classes:
        if not dataclasses.is_dataclass(cls):
            raise TypeError(f"{cls!r} is not a dataclass")
        for f in cls.__dataclass_fields__.values():
            is_initvar = isinstance(f.type, InitVar)
            if not (is_initvar or f in dataclasses.fields(cls)):
                continue  # ClassVar pseudo-fields
            if is_initvar and f.name in SIMPLE_ALIASES:
                continue  # renames are resolved by name before values are spread
            if f.name in specs or f.name in SIMPLE_ALIASES:
                raise TypeError(f"argument {f.name!r} of {cls.__name__} is already an argument of the trainer")
            default = field_default(f)
            specs[f.name] = _Spec(
                name=f.name,
                owner=cls,
                type=f.type.type if is_initvar else f.type,
                default=default,
                help=ALIAS_HELP.get(f.name, "") if is_initvar else f.metadata.get("help", ""),
                group="aliases" if is_initvar else f.metadata.get("group", cls.__name__),
                choices=f.metadata.get("choices"),
                required=default is dataclasses.MISSING,
            )
    return specs


def _resolve_name(name: str, specs: Mapping[str, _Spec], where: str) -> str:
    """The canonical argument name for `name`, or a ConfigError (unsupported, or unknown with suggestions)."""
    if name in specs:
        return name
    if name in SIMPLE_ALIASES and SIMPLE_ALIASES[name] in specs:
        return SIMPLE_ALIASES[name]
    reason = REJECTED.get(name) or next((r for p, r in REJECTED_PREFIXES.items() if name.startswith(p)), None)
    if reason is not None:
        raise ConfigError(f"{where}: {name} is not supported by kernelwright: {reason}")
    candidates = list(specs) + [a for a, t in SIMPLE_ALIASES.items() if t in specs]
    candidates += [a for a, (t, _, _) in BOOLEAN_ALIASES.items() if t in specs]
    close = difflib.get_close_matches(name, candidates, n=3, cutoff=0.6)
    hint = f"; did you mean {' or '.join(close)}?" if close else "; see --help for the arguments"
    raise ConfigError(f"{where}: unknown argument {name}{hint}")


def resolve_item(name: str, value: Any, specs: Mapping[str, _Spec], where: str) -> tuple[str, Any]:
    """(canonical name, value) for one given argument: renames resolved, boolean aliases mapped to their value."""
    if name in BOOLEAN_ALIASES and name not in specs and BOOLEAN_ALIASES[name][0] in specs:
        target, when_true, when_false = BOOLEAN_ALIASES[name]
        return target, when_true if coerce(name, value, bool) else when_false
    return _resolve_name(name, specs, where), value


def _is_alias(name: str) -> bool:
    return name in SIMPLE_ALIASES or name in BOOLEAN_ALIASES


def _takes_bool(spec: _Spec) -> bool:
    return any(annotation_base(m) is bool for m in annotation_members(spec.type)[0])


def _takes_list(spec: _Spec) -> bool:
    return any(annotation_base(m) is list for m in annotation_members(spec.type)[0])


class _HelpRequested(Exception):
    pass


def _flag_value(flag: str, values: list[str], specs: Mapping[str, _Spec]) -> tuple[str, Any]:
    """(canonical name, raw value) of `--flag values...`: bare booleans, `--no_<bool>`, lists, one value."""
    negated = flag.startswith("no_") and flag not in specs and flag[3:] in specs and _takes_bool(specs[flag[3:]])
    name = flag[3:] if negated else _resolve_name(flag, specs, f"--{flag}")
    spec = specs[name]
    if negated:
        if values:
            raise ConfigError(f"--{flag} takes no value (it sets {name} to false)")
        return name, False
    if not values:
        if not _takes_bool(spec):
            raise ConfigError(f"--{flag} expects a value ({describe_type(spec.type)})")
        return name, True
    if _takes_list(spec):
        return name, values
    if len(values) > 1:
        raise ConfigError(f"--{flag} takes one value, got {len(values)}: {' '.join(values)}")
    return name, values[0]


def _parse_flags(tokens: Sequence[str], specs: Mapping[str, _Spec]) -> dict[str, Any]:
    """`--name value`, `--name=value`, bare booleans, `--no_<bool>`, several values for lists; raw strings out."""
    out: dict[str, Any] = {}
    via_alias: dict[str, bool] = {}
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if token in ("-h", "--help"):
            raise _HelpRequested
        if not token.startswith("--") or token == "--":
            raise ConfigError(
                f"unexpected argument {token!r}: arguments are --name value (a config file may only come first)"
            )
        body, has_inline, inline = token[2:].partition("=")
        flag = body.replace("-", "_")
        j = i + 1
        while j < len(tokens) and not tokens[j].startswith("--") and tokens[j] != "-h":
            j += 1
        values = [inline] if has_inline else list(tokens[i + 1 : j])
        i = i + 1 if has_inline else j

        if flag in BOOLEAN_ALIASES and flag not in specs:
            if len(values) > 1:
                raise ConfigError(f"--{flag} takes one value, got {len(values)}: {' '.join(values)}")
            name, raw = resolve_item(flag, values[0] if values else True, specs, f"--{flag}")
        else:
            name, raw = _flag_value(flag, values, specs)
        # Repeating a flag keeps the last value (argparse's rule); an alias and its target together is an error.
        if via_alias.setdefault(name, _is_alias(flag)) != _is_alias(flag):
            raise ConfigError(f"--{flag} and --{name} set the same argument; give one of them")
        out[name] = raw
    return out


def _file_values(path: str, specs: Mapping[str, _Spec]) -> dict[str, Any]:
    if not path.endswith((".yaml", ".yml", ".json")):
        raise ConfigError(f"config file {path!r}: expected a .yaml, .yml or .json file")
    data = read_config_file(path)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: expected a mapping of argument names to values")
    out: dict[str, Any] = {}
    for key, value in data.items():
        name, value = resolve_item(str(key), value, specs, f"key {key!r} in {path}")
        if name in out:
            raise ConfigError(f"{path}: {name} given twice (once through an alias)")
        out[name] = value
    return out


def _build(values: Mapping[str, Any], classes: Sequence[type], specs: Mapping[str, _Spec]) -> tuple:
    """One instance of each of `classes` from resolved raw values. The first class (TrainingArguments) checks its
    own choices in __post_init__, after folding values such as include_num_input_tokens_seen=true into 'all'; the
    others' choices are checked here."""
    per_class: dict[type, dict[str, Any]] = {cls: {} for cls in classes}
    for name, raw in values.items():
        spec = specs[name]
        per_class[spec.owner][name] = coerce(name, raw, spec.type, spec.choices)
    for spec in specs.values():
        if spec.required and spec.name not in per_class[spec.owner]:
            raise ConfigError(f"--{spec.name} is required ({spec.help})" if spec.help else f"--{spec.name} is required")
        value = per_class[spec.owner].get(spec.name)
        if spec.choices is not None and spec.owner is not classes[0] and value is not None:
            choose(spec.name, value, spec.choices)
    out = []
    for cls in classes:
        try:
            out.append(cls(**per_class[cls]))
        except ConfigError:
            raise
        except ValueError as e:  # an extra dataclass's own __post_init__ validation
            raise ConfigError(str(e).strip().splitlines()[0]) from None
    return tuple(out)


def parse_mapping(values: Mapping[str, Any], classes: Sequence[type]) -> tuple:
    """An instance of each of `classes` from one mapping whose keys may belong to any of them."""
    specs = field_specs(classes)
    resolved: dict[str, Any] = {}
    for key, value in values.items():
        name, value = resolve_item(key, value, specs, f"key {key!r}")
        if name in resolved:
            raise ConfigError(f"{name} given twice (once through an alias)")
        resolved[name] = value
    return _build(resolved, classes, specs)


def parse_argv(argv: Sequence[str] | None, classes: Sequence[type], prog: str) -> tuple:
    """An instance of each of `classes` from `[config.yaml|json] --name value ...` (flags win over the file).

    `--help` prints `help_text` and raises SystemExit(0); any user error raises ConfigError (one line)."""
    tokens = list(sys.argv[1:] if argv is None else argv)
    specs = field_specs(classes)
    try:
        values: dict[str, Any] = {}
        if tokens and not tokens[0].startswith("-"):
            values.update(_file_values(tokens.pop(0), specs))
        values.update(_parse_flags(tokens, specs))
    except _HelpRequested:
        print(help_text(classes, prog))
        raise SystemExit(0) from None
    return _build(values, classes, specs)


def _metavar(spec: _Spec) -> str:
    if spec.choices:
        return "{" + ",".join(spec.choices) + "}"
    members, _ = annotation_members(spec.type)
    bases = [annotation_base(m) for m in members]
    if bases == [bool]:
        return "[BOOL]"
    if list in bases:
        return "VALUE [VALUE ...]"
    if dict in bases:
        return "JSON"
    return "|".join({int: "INT", float: "FLOAT", str: "STR", bool: "BOOL"}.get(b, "VALUE") for b in bases)


def help_text(classes: Sequence[type], prog: str) -> str:
    """Every argument of `classes` grouped by theme (groups in the order the fields first name them), with its
    default and one line of meaning."""
    specs = field_specs(classes)
    lines = [
        f"usage: {prog} [config.yaml|config.json] [--name VALUE ...]",
        "",
        "A YAML/JSON config file may come first; flags after it win. Booleans: --bf16, --bf16 false, --no_bf16.",
        "Lists take several values (--report_to jsonl tensorboard); dicts take JSON ('{\"num_cycles\": 2}').",
    ]
    groups = [g for g in dict.fromkeys(s.group for s in specs.values()) if g != "aliases"]
    for group in groups + ["aliases"]:
        rows = [s for s in specs.values() if s.group == group]
        if not rows:
            continue
        lines += ["", f"{group}:"]
        for s in rows:
            default = "required" if s.required else f"default: {show_value(s.default)}"
            lines.append(f"  --{s.name} {_metavar(s)}  ({default})")
            if s.help:
                lines.append(f"      {s.help}")
    lines += ["", "renamed aliases:"]
    lines += [f"  --{a} -> --{t}" for a, t in SIMPLE_ALIASES.items() if t in specs]
    lines += [
        f"  --{a} -> --{t} {show_value(yes)} (false: {show_value(no)})"
        for a, (t, yes, no) in BOOLEAN_ALIASES.items()
        if t in specs
    ]
    lines += [
        "",
        "not supported (rejected with a message): push_to_hub, hub_*, tpu_*, ddp_*, "
        "use_cpu, and other Hugging Face options not listed above.",
    ]
    return "\n".join(lines)
