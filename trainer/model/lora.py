"""LoRA fine-tuning through peft: the adapter config built from the arguments, its injection and initialisation,
the adapter files in peft's layout, and merging.

LoRA (Hu et al. 2021) freezes a linear layer's weight W (out x in) and trains a rank-r update beside it:

    y = x W^T + s * dropout(x) A^T B^T      A: r x in, B: out x r, s = lora_alpha / r (use_rslora: / sqrt(r))

A starts as peft draws it (kaiming-uniform with a = sqrt(5), i.e. U(-1/sqrt(in), 1/sqrt(in))) and B at zero, so
training starts exactly from the base model; DoRA (use_dora) adds a trained magnitude per output row. Forward and
backward cost the base matmul plus two thin ones; the optimizer holds state for A and B (and modules_to_save) only.

How it is applied: `apply_lora(model, args)` is the first transform of `trainer.parallel.transforms.apply_all` (LoRA ->
activation checkpointing -> compile -> FSDP2/DDP), so it runs before the optimizer is built (it sees requires_grad
only on the adapter) and before sharding. It calls peft's `inject_adapter_in_model`, not `get_peft_model`: the
adapter layers go into our CausalLM in place and the model stays a CausalLM, so every later transform and check
(per-block FSDP2 units, checkpointing, per-block compile, saving, `decode_step` for generation) works unchanged,
while `get_peft_model`'s PeftModel wrapper would have to be unwrapped in each (and its CAUSAL_LM flavour calls
transformers-only methods). A PeftModel built by hand through the Python API trains too: the Trainer finds our
CausalLM inside it, and saving writes its adapter the same way.

Names: peft moves an adapted layer's weight to `<layer>.base_layer.weight`, beside `<layer>.lora_A.default.weight`
and `<layer>.lora_B.default.weight`; a module to save keeps its original at `<m>.original_module.*` beside the
trained copy `<m>.modules_to_save.default.*`. `base_name` maps a parameter name back to the checkpoint's (None for
adapter weights), so base weights load by name into a LoRA model, FSDP2 shards included.

Files (peft's layout): `adapter_config.json` (`LoraConfig.save_pretrained`, base_model_name_or_path = the model
argument) and `adapter_model.safetensors` with peft's keys, `base_model.model.<name without the adapter name>`;
`peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), directory)` loads them.

Deliberate differences from peft:
- `all-linear` leaves lm_head out as peft does for transformers models (peft cannot tell our model's head), and on a
  mixture of experts takes what peft's takes there (`_peft_moe_names`: experts and router too); lm_head
  (and embed_tokens) cannot be a target or a module to save: the fused loss reads lm_head.weight directly, and
  tied models share it with embed_tokens.
- A is drawn from a generator seeded with `seed`, layer by layer in the model's order (peft: the global RNG), so a
  model built on the meta device and sharded by FSDP2 starts bitwise equal to the one-process model.

Test: python -m pytest tests/trainer/model/test_lora.py -q
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from trainer.checkpoint_hf import CheckpointError, open_safetensors
from trainer.coerce import ConfigError
from trainer.config.args import TrainingArguments
from trainer.model.fused_lora import ADAPTER  # peft's name for the one adapter a model carries

ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # peft's keys in adapter_model.safetensors start with the PeftModel's path
# Layers the loss or the tied embedding reads by weight, bypassing a LoRA wrapper (see the module docstring).
_NOT_ADAPTABLE = ("lm_head", "embed_tokens")


def import_peft():
    """The peft module, or a one-line ConfigError saying how to install it."""
    try:
        import peft
    except ImportError:
        raise ConfigError("use_peft: peft is not installed (pip install 'kernelwright[lora]')") from None
    return peft


# ---- names ----------------------------------------------------------------------------------------------------
def is_adapter_name(name: str) -> bool:
    """Whether a parameter name is an adapter weight (LoRA A/B, DoRA magnitude, a module-to-save copy)."""
    return ".lora_" in name or ".modules_to_save." in name


def base_name(name: str) -> str | None:
    """The checkpoint name of a base parameter under peft's renaming (`q_proj.base_layer.weight` -> `q_proj.weight`),
    the name itself without peft, None for an adapter weight."""
    if is_adapter_name(name):
        return None
    # nested wrappers nest the segment (peft's target_parameters on two tensors of one module: experts.base_layer.
    # base_layer.gate_up_proj), and str.replace does not see a match that overlaps the one before it
    return ".".join(part for part in name.split(".") if part not in ("base_layer", "original_module"))


def peft_key(name: str) -> str:
    """The key peft writes in adapter_model.safetensors for one of our adapter parameters: the adapter name
    dropped (`lora_A.default.weight` -> `lora_A.weight`, `norm.modules_to_save.default.weight` -> `norm.weight`),
    the PeftModel's prefix added."""
    name = name.replace(f".modules_to_save.{ADAPTER}.", ".").replace(f".{ADAPTER}.", ".")
    return PEFT_PREFIX + name


def peft_root(model: nn.Module) -> nn.Module:
    """The module the adapter goes into, whose parameter names peft's files carry: the module a model names as its
    `adapter_root` (the transformers path's TransformersModel: its transformers model, so its adapter files are those
    peft writes over `AutoModelForCausalLM`), else `model` itself (our CausalLM names its parameters as the
    checkpoint does)."""
    root = getattr(model, "adapter_root", None)
    return model if root is None else root


def has_adapter(model: nn.Module) -> bool:
    """Whether `model` carries a peft adapter (injected by `apply_lora`, `load_adapter` or peft itself)."""
    return bool(getattr(peft_root(model), "peft_config", None))


@contextlib.contextmanager
def adapters_disabled(model: nn.Module):
    """The base model for the block: every adapter layer of `model` computes its base layer only (peft's
    enable_adapters(False)), as peft's `disable_adapter()` context does for a PeftModel; a model without an adapter
    is left as it is. Preference training's reference, with no second copy of the weights."""
    if not has_adapter(model):
        yield model
        return
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    trainable = [p for p in model.parameters() if p.requires_grad]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield model
    finally:
        for layer in layers:
            layer.enable_adapters(True)
        for p in trainable:  # enable_adapters sets requires_grad as peft sees fit; the run's choice stands
            p.requires_grad_(True)


# ---- the config -----------------------------------------------------------------------------------------------
def _matches(module_name: str, target: str) -> bool:
    return module_name == target or module_name.endswith("." + target)  # peft's target_modules rule


def resolve_target_modules(model: nn.Module, names: list[str] | None) -> list[str]:
    """The linear layers to adapt, checked: `names` (each must match a linear layer, by peft's suffix rule),
    every linear layer but lm_head for all-linear, or peft's default for the architecture when None."""
    linear = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    if names is None:
        defaults = import_peft().utils.constants.TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        if model_type not in defaults:
            raise ConfigError(
                f"lora_target_modules: peft has no default for model_type {model_type!r}; name the "
                "layers (e.g. q_proj v_proj) or give all-linear"
            )
        return list(defaults[model_type])
    if names == ["all-linear"]:
        leaves = dict.fromkeys(n.rsplit(".", 1)[-1] for n in linear)
        adds = [name for name in _peft_moe_names(model) if name not in leaves and name not in _NOT_ADAPTABLE]
        return [leaf for leaf in leaves if leaf not in _NOT_ADAPTABLE] + adds
    leaves = ", ".join(dict.fromkeys(n.rsplit(".", 1)[-1] for n in linear if not n.endswith(_NOT_ADAPTABLE)))
    for name in names:
        if name.rsplit(".", 1)[-1] in _NOT_ADAPTABLE:
            raise ConfigError(
                f"lora_target_modules: {name!r} cannot take an adapter here (the fused loss reads "
                f"lm_head.weight directly, and tied models share it with embed_tokens); adapt: {leaves}"
            )
        if not any(_matches(n, name) for n in linear):
            raise ConfigError(
                f"lora_target_modules: {name!r} matches no linear layer of the model; its linear "
                f"layers are {leaves} (or give all-linear)"
            )
    return list(names)


def _peft_moe_names(model: nn.Module) -> list[str]:
    """What peft's all-linear adds on a mixture of experts whose transformers 5 layout fused transformers 4's
    per-expert linears (qwen3_moe, qwen3_next, mixtral, ...): those linears' and the router's old names, which its
    injection then turns into target_parameters (the expert tensors, gate_up_proj at twice the rank, and the router's
    `gate.weight`) and nothing else: a dense or shared-expert MLP's gate_proj / up_proj / down_proj, named alike, are
    left without an adapter (peft's rule, kept so that peft loads the adapter over transformers' model: it converts
    the names again as it loads). Read from peft's own tables (none before peft 0.19: nothing added)."""
    try:
        from peft.utils import transformers_weight_conversion as conversion

        base = conversion._MODEL_TO_CONVERSION_PATTERN.get(getattr(model.config, "model_type", None))
        names = conversion._MOE_TARGET_MODULE_MAPPING.get(base, {})
    except (ImportError, AttributeError):
        return []
    return list(names)


def check_target_parameters(model: nn.Module, names: list[str] | None) -> list[str] | None:
    """`names`, each checked to match one of the model's stacked weight tensors (3-D or more: a mixture of experts'
    fused expert tensors, which peft's target_parameters adapt; peft's suffix rule over parameter names)."""
    if not names:
        return None
    # a parameter's full shape where peft reads it (`ds_shape`: partitioned by ZeRO-3, or 4-bit experts' packed codes)
    candidates = [n for n, p in model.named_parameters() if len(getattr(p, "ds_shape", p.shape)) >= 3]
    leaves = ", ".join(dict.fromkeys(".".join(n.split(".")[-3:]) for n in candidates)) or "none"
    for name in names:
        if not any(_matches(n, name) for n in candidates):
            raise ConfigError(
                f"lora_target_parameters: {name!r} matches no stacked expert tensor (linear layers take "
                f"lora_target_modules); the model's are: {leaves}"
            )
    return list(names)


def check_modules_to_save(model: nn.Module, names: list[str] | None) -> list[str] | None:
    """`names`, each checked to match a module of the model (and not lm_head/embed_tokens)."""
    for name in names or ():
        if name.rsplit(".", 1)[-1] in _NOT_ADAPTABLE:
            raise ConfigError(
                f"lora_modules_to_save: {name!r} is not supported (the fused loss reads lm_head.weight "
                "directly, and tied models share it with embed_tokens)"
            )
        if not any(_matches(n, name) for n, _ in model.named_modules()):
            raise ConfigError(f"lora_modules_to_save: {name!r} matches no module of the model")
    return names


def lora_config(model: nn.Module, args):
    """peft's LoraConfig from the arguments (TRL's names), targets resolved against `model`."""
    peft = import_peft()
    targets = resolve_target_modules(model, args.lora_target_modules)
    moe_names = _peft_moe_names(model)
    converted = [name for name in targets if name.rsplit(".", 1)[-1] in moe_names]
    if converted and args.lora_dropout:
        # peft makes these target_parameters (the expert tensors, the router), whose LoRA takes no dropout
        model_type = getattr(model.config, "model_type", None)
        raise ConfigError(
            f"lora_dropout={args.lora_dropout!r}: on a {model_type}, peft turns the targets {', '.join(converted)} "
            "into its experts' and router's target_parameters (as all-linear there does), which take no dropout; set "
            "--lora_dropout 0, or name other layers in --lora_target_modules"
        )
    return peft.LoraConfig(
        task_type="CAUSAL_LM",
        r=args.lora_r,
        lora_alpha=args.lora_alpha,
        lora_dropout=args.lora_dropout,
        target_modules=targets,
        target_parameters=check_target_parameters(model, args.lora_target_parameters),
        modules_to_save=check_modules_to_save(model, args.lora_modules_to_save),
        use_rslora=args.use_rslora,
        use_dora=args.use_dora,
    )


# ---- applying and initialising --------------------------------------------------------------------------------
def apply_lora(model: nn.Module, args) -> nn.Module:
    """Inject a LoRA adapter as `args` ask (use_peft), in place; only the adapter then requires grad. Returns the
    model (unchanged without use_peft). On the meta device (the FSDP2 build) the adapter weights are left for
    `init_adapter_weights` after materialisation; otherwise they are initialised here from args.seed."""
    if not args.use_peft:
        return model
    root = peft_root(model)
    if has_adapter(root):  # `build_model` injected it (transforms are idempotent), or the user's peft did
        _check_same_adapter(root, args)
        return model
    on_meta = any(p.is_meta for p in root.parameters())
    if args.use_dora and on_meta:
        raise ConfigError(
            "use_dora: DoRA computes its magnitudes from the base weights when it is applied, which a "
            "model built sharded (dist_config fsdp2) does not have yet; use dist_config ddp, or LoRA"
        )
    peft = import_peft()
    config = lora_config(root, args)
    with torch.random.fork_rng(devices=[]):  # peft's own draws of A must not move the run's random stream (NEFTune)
        peft.inject_adapter_in_model(config, root, adapter_name=ADAPTER)
    if not on_meta:
        init_adapter_weights(root, args.seed)
    return model


_ADAPTER_SETTINGS = {
    "lora_r": "r",
    "lora_alpha": "lora_alpha",
    "lora_dropout": "lora_dropout",
    "use_rslora": "use_rslora",
    "use_dora": "use_dora",
}


def _check_same_adapter(model: nn.Module, args) -> None:
    """The adapter a model already carries is the one `args` ask for; else a one-line ConfigError (a second adapter,
    or arguments that would be ignored)."""
    config = model.peft_config.get(ADAPTER) if isinstance(model.peft_config, dict) else None
    differ = [
        f"{arg}={getattr(args, arg)!r} vs {getattr(config, key, None)!r}"
        for arg, key in _ADAPTER_SETTINGS.items()
        if config is None or getattr(config, key, None) != getattr(args, arg)
    ]
    if differ:
        raise ConfigError(
            f"use_peft: the model already carries a peft adapter that differs from the arguments "
            f"({', '.join(differ)}); pass the bare model, or train the peft model with use_peft off"
        )


def _whole(param: torch.Tensor) -> tuple[torch.Tensor, None]:
    return param, None


@torch.no_grad()
def init_adapter_weights(model: nn.Module, seed: int, local_shard=_whole) -> None:
    """A ~ U(-1/sqrt(in), 1/sqrt(in)) (peft's kaiming-uniform, a = sqrt(5)) drawn layer by layer from a generator
    seeded with `seed`, B = 0, each module-to-save copy = its original. Sharded by FSDP2, pass
    `local_shard=trainer.dist.local_shard`: every rank draws each full A and keeps its rows, as `init_weights` does
    for the base, so the shards equal the one-process init bitwise. DoRA's magnitudes (from the base weights, with
    B = 0) are peft's and stay as they are."""
    gen = torch.Generator().manual_seed(seed)
    params = dict(model.named_parameters())
    for name, param in params.items():
        if ".lora_A." in name:
            bound = 1.0 / math.sqrt(param.shape[1])
            full = torch.empty(param.shape).uniform_(-bound, bound, generator=gen)  # a DTensor's shape is the full one
            local, rows = local_shard(param)
            local.copy_(full if rows is None else full[rows[0] : rows[1]])
        elif ".lora_B." in name:
            local_shard(param)[0].zero_()
        elif f".modules_to_save.{ADAPTER}." in name:
            original = params[name.replace(f".modules_to_save.{ADAPTER}.", ".original_module.")]
            local_shard(param)[0].copy_(local_shard(original)[0])


# ---- files ----------------------------------------------------------------------------------------------------
def save_adapter(model: nn.Module, directory: Path, state: dict[str, torch.Tensor] | None = None) -> None:
    """adapter_config.json + adapter_model.safetensors in peft's layout. `state`: the model's full state_dict when
    it is not `model`'s own (FSDP2 gathers it on rank 0); only the adapter weights are written."""
    config = copy.copy(peft_root(model).peft_config[ADAPTER])
    config.inference_mode = True  # as PeftModel.save_pretrained writes it
    if getattr(model, "name_or_path", None):  # the model argument (trainer.sft sets it); peft's own otherwise
        config.base_model_name_or_path = model.name_or_path
    root = peft_root(model)
    if state is None:
        state = dict(root.named_parameters())
    elif root is not model:  # a full state dict of `model` (FSDP2 gathers it): its names relative to the root
        prefix = next(name for name, m in model.named_modules() if m is root) + "."
        state = {n.removeprefix(prefix): t for n, t in state.items()}
    tensors = {peft_key(n): t.detach().to("cpu").contiguous() for n, t in state.items() if is_adapter_name(n)}
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / ADAPTER_WEIGHTS_FILE), metadata={"format": "pt"})
    config.save_pretrained(str(directory))


def read_adapter_config(directory: Path):
    """The LoraConfig saved in `directory`, or a one-line ConfigError."""
    peft = import_peft()
    file = Path(directory) / ADAPTER_CONFIG_FILE
    if not file.is_file():
        raise ConfigError(
            f"adapter: {file} not found (an adapter directory holds {ADAPTER_CONFIG_FILE} and {ADAPTER_WEIGHTS_FILE})"
        )
    peft_type = json.loads(file.read_text()).get("peft_type")
    if peft_type != "LORA":
        raise ConfigError(f"adapter: {file} holds a {peft_type} adapter; only LoRA is supported")
    return peft.LoraConfig.from_pretrained(str(directory))


@torch.no_grad()
def load_adapter_weights(model: nn.Module, directory: Path, local_shard=_whole) -> None:
    """adapter_model.safetensors of `directory` into the adapter of `model` (in place; every adapter weight must be
    there, nothing else). Sharded by FSDP2, pass `local_shard=trainer.dist.local_shard`: each rank reads its rows."""
    file = Path(directory) / ADAPTER_WEIGHTS_FILE
    if not file.is_file():
        raise ConfigError(f"adapter: {file} not found")
    targets = {peft_key(n): p for n, p in peft_root(model).named_parameters() if is_adapter_name(n)}
    try:
        opened = open_safetensors(file)
    except CheckpointError as exc:  # a truncated or damaged file
        raise ConfigError(f"adapter: {exc}") from None
    with opened as f:
        keys = set(f.keys())
        missing, unexpected = sorted(set(targets) - keys), sorted(keys - set(targets))
        if missing or unexpected:
            raise ConfigError(
                f"adapter: {file} does not match the model's adapter (missing {missing[:3]}, "
                f"unexpected {unexpected[:3]})"
            )
        for key, param in targets.items():
            local, rows = local_shard(param)
            tensor = f.get_slice(key)
            if rows is not None and rows[1] <= rows[0]:
                continue  # an empty shard (more ranks than rows)
            local.copy_(tensor[rows[0] : rows[1]] if rows is not None else tensor[:])


def trained_over_quantized(directory: Path):
    """The arguments of the run that saved the adapter in `directory` (its training_args.json) when that run trained
    it over 4-bit or 8-bit base weights (load_in_4bit, load_in_8bit), else None: merging and generating then quantize
    the base the same way."""
    file = Path(directory) / "training_args.json"
    saved = json.loads(file.read_text()) if file.is_file() else {}
    if not (saved.get("load_in_4bit") or saved.get("load_in_8bit")):
        return None
    return TrainingArguments.from_json_file(file)


def load_adapter(model: nn.Module, directory: Path) -> nn.Module:
    """`model` (the base) with the adapter saved in `directory` injected and loaded, in place, to generate with; a
    base the adapter was trained over in 4 or 8 bits is quantized the same way first (`trained_over_quantized`)."""
    peft = import_peft()
    run = trained_over_quantized(directory)
    if run is not None:
        from trainer.model.quant import quantize_base  # bitsandbytes: imported only for 4-bit weights

        quantize_base(model, run)
    peft.inject_adapter_in_model(read_adapter_config(directory), peft_root(model), adapter_name=ADAPTER)
    load_adapter_weights(model, directory)
    return model


def merged(model: nn.Module, directory: Path) -> nn.Module:
    """`model` (the base) with the adapter of `directory` merged into its weights (W + s B A) and peft's layers
    removed: a plain model with the base's parameter names (peft's `merge_and_unload`). An adapter trained over 4-bit
    weights (`trained_over_quantized`) is merged into the dequantized 4-bit base, dequantize(Q(W)) + s B A, the function
    it was trained over, written in the base's dtype."""
    peft = import_peft()
    run = trained_over_quantized(directory)
    if run is not None:
        from trainer.model.quant import dequantized, quantize_base  # bitsandbytes: only for 4-bit weights

        model = dequantized(quantize_base(model, run))
    root = peft_root(model)
    tuner = peft.LoraModel(root, read_adapter_config(directory), ADAPTER)
    load_adapter_weights(model, directory)
    tuner.merge_and_unload(safe_merge=True)  # in place; safe_merge: refuses a merge that would produce NaN/inf
    root.__dict__.pop("peft_config", None)  # a plain model now: saved in full, not as an adapter
    return model


def trainable_summary(trainable: int, total: int) -> str:
    """peft's `print_trainable_parameters` line: trainable params: N || all params: M || trainable%: x."""
    return f"trainable params: {trainable:,d} || all params: {total:,d} || trainable%: {100 * trainable / total:.4f}"
