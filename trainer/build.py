"""How a model comes to exist and goes to disk: `build_model`, the one path from a model name and the training
arguments to the module the loop trains, with the presets and Hugging Face model directories beside it.

`build_model(name, args)`, used by `python -m trainer.sft`, `trainer.generate`, the Python API and every engine:

    name -> config + tokenizer      a preset, a Hugging Face directory, or a hub id (downloaded once)
         -> CausalLM on meta        with its settings from `args`, given once: kernels or PyTorch (or liger-kernel),
                                    label smoothing, z-loss, NEFTune, the attention backend
         -> transforms on meta      `parallel.apply_transforms`: activation checkpointing, per-block compile, FSDP2
         -> materialised            `to_empty` on this rank's device: under FSDP2 only this rank's shards exist
         -> weights                 each rank reads its rows of the safetensors, or its DCP shards, or draws the
                                    preset's seeded init (bitwise the single-process init)
         -> DDP                     `parallel.apply_data_parallel` with several processes and no FSDP2 (DDP
                                    broadcasts rank 0's weights, so it comes after them)

`load_pretrained(path)` and `build_preset(name)` are `build_model` without training arguments: a bare CausalLM.
`save_pretrained` writes our model as transformers writes its own. The safetensors reading and writing underneath
is `trainer/checkpoint_hf.py`'s; the architecture (`trainer/model/causal_lm.py`) knows nothing of files or processes.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import sys
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from trainer.checkpoint_hf import (
    CheckpointError,
    check_safetensors,
    checkpoint_files,
    load_safetensors,
    open_safetensors,
    read_json,
    save_safetensors,
)
from trainer.coerce import ConfigError
from trainer.data.tokenizer import Tokenizer, byte_level_tokenizer
from trainer.dist import init_distributed, local_device, local_shard
from trainer.model.causal_lm import HYBRID_TYPES, TEXT_MODELS, CausalLM, ModelConfig, ModelError, apply_liger_kernel
from trainer.model.lora import base_name, has_adapter, init_adapter_weights, is_adapter_name
from trainer.model.moe import Mxfp4Part, dequantize_mxfp4, file_parts, mxfp4_shape
from trainer.model.transformers_model import (
    TransformersModel,
    build_transformers_model,
    check_buildable,
    model_path,
)
from trainer.parallel.transforms import (
    DCP_DIR,
    apply_all,
    apply_data_parallel,
    apply_transforms,
    is_fsdp,
    load_sharded,
    uses_fsdp,
)

_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


# ------------------------------------------------------------------------------------------------------------
# build_model
# ------------------------------------------------------------------------------------------------------------
def build_model(
    name: str,
    args=None,
    *,
    dtype=None,
    device=None,
    seed: int | None = None,
    use_kernels: bool | None = None,
    attn_backend: str = "auto",
    model_impl: str = "auto",
) -> tuple[nn.Module, Tokenizer]:
    """(the model to train or run, its tokenizer) for `name`: a preset, a Hugging Face directory, or a hub id.

    `args` (TrainingArguments) gives the model's settings (use_kernels/use_liger_kernel, label_smoothing_factor,
    z_loss, neftune_noise_alpha), the seed of a preset's init, and the transforms (gradient_checkpointing,
    torch_compile, dist_config); without `args` the result is a bare CausalLM (`use_kernels` picks its ops then).
    `dtype` (default: the checkpoint's, else fp32), `device` (default: this process's device; the CPU for FSDP2's
    offload_params) and `seed` override what `args` would give. With several processes (a launcher's environment) it
    joins the process group and, under dist_config fsdp2, no rank ever holds the whole model: each reads only its
    rows of the safetensors, or its shards of the DCP copy at dist_config.dcp_path (a `dcp/` directory or a
    checkpoint holding one; the architecture still comes from `name`). A model directory of a type our model does
    not cover (or any, with `model_impl="transformers"`) is built by transformers and wrapped
    (trainer/model/transformers_model.py: `model_path` decides)."""
    path = locate(name)
    if path is not None and model_path(model_type_of(path), model_impl) == "transformers":
        return _build_transformers(path, args, dtype=dtype, device=device, attn_backend=attn_backend), load_tokenizer(
            path
        )
    config, tokenizer = preset_config(name) if path is None else (read_config(path), load_tokenizer(path))
    model = _build(
        config, path, args, dtype=dtype, device=device, seed=seed, use_kernels=use_kernels, attn_backend=attn_backend
    )
    causal_lm(model).name_or_path = name  # as transformers' model.name_or_path; a LoRA adapter records it
    return model, tokenizer


def _build_transformers(path: Path, args, *, dtype, device, attn_backend) -> nn.Module:
    """`build_model` on the transformers path (trainer/model/transformers_model.py): transformers builds and loads the
    model from its own modeling code; DDP over it with several processes."""
    if args is not None:
        init_distributed()
    config = _config_json(path)
    dtype = _resolve_dtype(dtype) or _resolve_dtype(config.get("dtype") or config.get("torch_dtype")) or torch.float32
    model = build_transformers_model(
        path, args, dtype=dtype, device=device or local_device(), attn_backend=attn_backend
    )
    if args is not None:
        model = apply_all(model, args)  # 4-bit weights -> LoRA -> checkpointing -> DDP, as on our path
    return model


def model_type_of(path: Path) -> str | None:
    """config.json's model_type in the model directory `path` (a one-line ModelError when it cannot be read)."""
    return _config_json(path).get("model_type")


def _config_json(path: str | Path) -> dict:
    """`path`/config.json as a dict; a missing or unreadable file is one ModelError line."""
    file = Path(path) / "config.json"
    if not file.is_file():
        raise ModelError(f"{file}: not found (a Hugging Face model directory needs config.json)")
    try:
        return read_json(file)
    except CheckpointError as exc:
        raise ModelError(str(exc)) from None


def _build(
    config: ModelConfig, path: Path | None, args, *, dtype, device, seed, use_kernels, attn_backend
) -> nn.Module:
    """`build_model` from the config on: the weights come from `path` (a Hugging Face directory), or from the
    seeded init when it is None, or from dist_config.dcp_path under FSDP2."""
    if args is not None:
        init_distributed()  # several processes under torchrun/accelerate; a no-op for one
        if seed is None:
            seed = args.seed
    sharded = args is not None and uses_fsdp(args)
    dcp = dcp_source(args) if sharded else None
    if device is None:
        # offload_params keeps the shards in host memory (FSDP2 moves them to the device for compute)
        device = torch.device("cpu") if sharded and args.dist_config.get("offload_params") else local_device()
    settings = model_settings(args) if args is not None else {"use_kernels": use_kernels is None or use_kernels}
    model = empty_model(
        config,
        dtype=checkpoint_dtype(config, dtype),
        device=device,
        transform=(lambda m: apply_transforms(m, args)) if args is not None else None,
        **settings,
    )
    ours = causal_lm(model)
    if dcp is not None:
        load_sharded(model, None, dcp)
    else:
        targets = _weight_targets(ours, args)
        if path is None:
            # the adapter's layers are init_adapter_weights' (below)
            ours.init_weights(seed or 0, local_shard=targets, skip=lambda name: is_adapter_name(name + "."))
        else:
            load_state_dict_into(ours, path, local_shard=targets)
        if has_adapter(ours):  # LoRA (use_peft), injected on meta by apply_transforms: A from args.seed, B = 0
            init_adapter_weights(ours, args.seed, local_shard=local_shard)
    ours.attn_backend = attn_backend
    if args is not None:
        model = apply_data_parallel(model, args)
    return model


def _weight_targets(model: CausalLM, args):
    """What the loaders copy each parameter's full tensor into: `trainer.dist.local_shard` (this rank's rows), and
    for a 4-bit or 8-bit layer's weight (load_in_4bit, load_in_8bit) the target that quantizes it as it is copied
    (`trainer.model.quant.quantizing_targets`), so no full-precision weight is kept."""
    if args is None or not (args.load_in_4bit or args.load_in_8bit):
        return local_shard
    from trainer.model.quant import quantizing_targets  # bitsandbytes: imported only for 4-bit weights

    targets = quantizing_targets(model)
    return lambda param: (targets[id(param)], None) if id(param) in targets else local_shard(param)


def model_settings(args) -> dict:
    """TrainingArguments' model settings as CausalLM's constructor arguments (and its attributes of the same names):
    its ops (ours, PyTorch's with use_kernels=False, or liger-kernel's, which win), label smoothing, z-loss,
    NEFTune, the tiled MLP and the MoE load-balancing loss's weight. The one place they are read: `build_model`
    gives them to the CausalLM it builds, and the Trainer to a model it is handed whose settings differ
    (`apply_model_settings`)."""
    return {
        "use_kernels": args.use_kernels and not args.use_liger_kernel,
        "use_liger_kernel": args.use_liger_kernel,
        "label_smoothing": args.label_smoothing_factor,
        "z_loss": args.z_loss,
        "neftune_noise_alpha": args.neftune_noise_alpha,
        "tiled_mlp": args.tiled_mlp,
        "router_aux_loss_coef": args.router_aux_loss_coef,
    }


def apply_model_settings(ours: CausalLM, settings: dict) -> None:
    """`model_settings` onto a CausalLM built with others (by hand, or from other arguments)."""
    ours.use_kernels = settings["use_kernels"]
    if settings["use_liger_kernel"]:
        apply_liger_kernel(ours)
    ours.label_smoothing = settings["label_smoothing"]
    ours.z_loss = settings["z_loss"]
    ours.neftune_noise_alpha = settings["neftune_noise_alpha"]
    ours.tiled_mlp = settings["tiled_mlp"]
    ours.router_aux_loss_coef = settings["router_aux_loss_coef"]


def causal_lm(model: nn.Module) -> CausalLM | None:
    """Our CausalLM wherever it sits: the module itself (FSDP2 shards in place) or inside a wrapper
    (torch.compile's `_orig_mod`, DDP's `module`, peft's `base_model.model`); None when there is none."""
    return next((m for m in model.modules() if isinstance(m, CausalLM)), None)


def locate(name: str) -> Path | None:
    """None for a preset; else the model directory `name` names, downloaded from the hub when it is a hub id
    (owner/name) that is not a local path. Anything else is a one-line ConfigError."""
    if is_preset(name):
        return None
    check_model_name(name)
    path = Path(name)
    return path if path.exists() else _download(name)


def read_model_files(name: str, model_impl: str = "auto") -> tuple[ModelConfig | None, Tokenizer]:
    """(config, tokenizer) of `name` (a preset, a Hugging Face directory, or a hub id, downloaded once), with every
    file of a model directory read and checked before anything is built: config.json, the tokenizer files, and each
    safetensors file's header against the config's parameters (a complete file, the keys and shapes; no tensor data
    is read, so it costs milliseconds at any model size). A damaged file is one line naming it (ModelError,
    TokenizerError): the same readers `build_model` uses, here run first so that `python -m trainer.sft` stops
    before its summary, the build or any write."""
    path = locate(name)
    if path is None:
        return preset_config(name)
    model_type = model_type_of(path)
    if model_path(model_type, model_impl) == "transformers":
        check_buildable(path, model_type)
        # transformers reads its own checkpoint (some types' keys are converted as they load): the files' headers
        try:
            for file in checkpoint_files(path):
                with open_safetensors(file):
                    pass
        except CheckpointError as exc:
            raise ModelError(str(exc)) from None
        return None, load_tokenizer(path)
    config, tokenizer = read_config(path), load_tokenizer(path)
    parts, skipped = _checkpoint_keys(config, path)
    with torch.device("meta"):  # a tied head appears once
        shapes = {
            k: mxfp4_shape(tuple(p.shape), i.kind) if isinstance(i, Mxfp4Part) else tuple(p[i].shape)
            for n, p in CausalLM(config).named_parameters()
            for k, i in parts(n)
        }
    try:
        check_safetensors(path, shapes, ignore=skipped)
    except CheckpointError as exc:
        raise ModelError(str(exc)) from None
    return config, tokenizer


def check_model_name(name: str) -> None:
    """A preset, an existing path, or something shaped like a hub id (owner/name); else a one-line ConfigError."""
    if not (is_preset(name) or Path(name).exists() or (name.count("/") == 1 and not name.startswith((".", "/")))):
        raise ConfigError(f"model: {name!r} is not a preset, a directory, or a hub id (owner/name)")


def _download(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ConfigError(
            f"model: {repo_id!r} is not a local directory, and huggingface_hub is not installed to "
            "download it (pip install huggingface_hub)"
        ) from None
    try:
        return Path(snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.jinja", "tokenizer*"]))
    except Exception as exc:
        raise ConfigError(
            f"model: could not download {repo_id!r} from the hub ({type(exc).__name__}); "
            "without a network, pass a local directory"
        ) from None


def dcp_source(args) -> Path | None:
    """dist_config.dcp_path as the DCP directory to read (a checkpoint's `dcp/` inside it), or None."""
    dcp = args.dist_config.get("dcp_path")
    if not dcp:
        return None
    dcp = Path(dcp) / DCP_DIR if (Path(dcp) / DCP_DIR).is_dir() else Path(dcp)
    if not (dcp / ".metadata").is_file():
        raise ConfigError(f"dist_config.dcp_path: {dcp} is not a torch.distributed.checkpoint directory (no .metadata)")
    return dcp


# ------------------------------------------------------------------------------------------------------------
# Hugging Face checkpoints
# ------------------------------------------------------------------------------------------------------------
def _resolve_dtype(value) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        return value
    if isinstance(value, str) and value.removeprefix("torch.") in _DTYPES:
        return _DTYPES[value.removeprefix("torch.")]
    raise ModelError(f"dtype {value!r} is not supported (supported: {', '.join(_DTYPES)})")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def read_config(path: str | Path) -> ModelConfig:
    """ModelConfig from `path`/config.json."""
    return ModelConfig.from_hf(_config_json(path), source=str(Path(path) / "config.json"))


def _checkpoint_keys(config: ModelConfig, path: str | Path):
    """(our parameter name -> its tensors in the files at `path` as `file_parts` gives them, which of the files' keys
    loading skips). Skipped: the
    rotary buffer older Llama checkpoints store (ours is recomputed), lm_head.weight when the config ties it to the
    embedding (a tied checkpoint may or may not hold it), and what transformers' AutoModelForCausalLM skips too:
    Qwen3.5's multi-token-prediction head (mtp.), and in a multimodal checkpoint (TEXT_MODELS: its config.json's
    model_type says so, whatever `config` was read from) the vision tower, the text model's keys being under
    model.language_model. A gpt_oss checkpoint whose config.json says `quantization_config` mxfp4 (the released ones)
    holds its expert weights MXFP4-packed: their parts are `Mxfp4Part`s (dequantized as they load)."""
    tied = config.tie_word_embeddings
    has_config = (Path(path) / "config.json").is_file()
    multimodal = has_config and model_type_of(path) in TEXT_MODELS
    quant = (_config_json(path).get("quantization_config") or {}) if has_config else {}
    mxfp4 = config.model_type == "gpt_oss" and quant.get("quant_method") == "mxfp4"
    others = ("mtp.", "model.visual.") if multimodal else ("mtp.",) if config.model_type in HYBRID_TYPES else ()

    def key(name: str) -> str:
        return "model.language_model." + name[len("model.") :] if multimodal and name.startswith("model.") else name

    def parts(name: str) -> list[tuple[str, tuple]]:
        return [(key(file_key), index) for file_key, index in file_parts(config, name, mxfp4)]

    def skipped(name: str) -> bool:
        return name.endswith("rotary_emb.inv_freq") or (tied and name == "lm_head.weight") or name.startswith(others)

    return parts, skipped


def load_pretrained(path: str | Path, dtype=None, device=None, use_kernels: bool = True) -> CausalLM:
    """Load a Hugging Face model directory (config.json + model.safetensors or shards with an index).

    Built on the meta device, cast to `dtype` there (default: the config's dtype, else fp32), materialised
    on `device` (default cpu) without initialisation, then each checkpoint tensor is read once into place.
    A tied checkpoint may or may not contain lm_head.weight; it is skipped either way.
    """
    return _build(
        read_config(path),
        Path(path),
        None,
        dtype=dtype,
        device=device or "cpu",
        seed=None,
        use_kernels=use_kernels,
        attn_backend="auto",
    )


def checkpoint_dtype(config: ModelConfig, dtype=None) -> torch.dtype:
    """The dtype to load in: `dtype` if given, else the checkpoint's (config.dtype), else fp32."""
    return _resolve_dtype(dtype) or _resolve_dtype(config.dtype) or torch.float32


def empty_model(config: ModelConfig, *, dtype=torch.float32, device="cpu", transform=None, **settings) -> CausalLM:
    """A CausalLM of `config` on `device` with uninitialised weights (load or init them) and its rotary buffers
    computed; `settings` are its constructor's (`use_kernels`, `label_smoothing`, ...: `model_settings`). Built on
    the meta device and cast there, so that no memory is written twice; `transform(model)` (FSDP2's sharding) runs
    while it is still on meta, so that `to_empty` allocates only what the transformed model keeps: a rank's
    shards."""
    with torch.device("meta"):
        model = CausalLM(config, **settings)
    model.to(dtype=dtype)
    if transform is not None:
        model = transform(model)
    model.to_empty(device=torch.device(device))
    model.tie_weights()  # to_empty may make new, separate Parameters
    model.model.rotary_emb.reset_buffers()  # non-persistent: to_empty left garbage
    return model


def _sharded_transformers_copy(model: TransformersModel, args) -> TransformersModel:
    """`frozen_copy` of a TransformersModel sharded by FSDP2: its `meta_copy` (our kernels and head as the model's
    probes proved them) through the same transforms (LoRA left out), given storage, then each rank copies its own
    shards and the (unsharded) buffers."""
    state = model.state_dict()
    device = next(iter(state.values())).device
    ref = apply_transforms(model.meta_copy(), dataclasses.replace(args, use_peft=False))
    ref.to_empty(device=device)
    ref.hf.tie_weights()  # to_empty gives each parameter its own storage: tied ones are tied again
    for name, tensor in ref.state_dict().items():
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        source = state[name]
        local.copy_(source.to_local() if isinstance(source, DTensor) else source)
    buffers = dict(model.named_buffers())
    for name, buffer in ref.named_buffers():  # rotary frequencies (non-persistent: not in the state dict)
        buffer.copy_(buffers[name])
    return ref


@torch.no_grad()
def frozen_copy(model: nn.Module, args) -> nn.Module:
    """A frozen copy of `model` (a reference model: eval mode, no gradients). A model sharded by FSDP2, which
    cannot be deep-copied, is copied sharded alike: an empty CausalLM of its config through the same transforms
    (`args`, LoRA left out), then each rank copies its own shards, so no rank holds more than its rows and nothing
    is communicated."""
    if not is_fsdp(model):
        ref = copy.deepcopy(model)
    elif isinstance(model, TransformersModel) and not has_adapter(model.adapter_root):
        ref = _sharded_transformers_copy(model, args)
    else:
        ours = causal_lm(model)
        if ours is None or has_adapter(ours):
            raise TypeError(f"frozen_copy: a {type(model).__name__} sharded by FSDP2 (a CausalLM without LoRA only)")
        state = model.state_dict()
        ref = empty_model(
            ours.config,
            dtype=next(iter(state.values())).dtype,
            device=next(iter(state.values())).device,
            transform=lambda m: apply_transforms(m, dataclasses.replace(args, use_peft=False)),
            **model_settings(args),
        )
        for name, tensor in ref.state_dict().items():
            local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
            source = state[name]
            local.copy_(source.to_local() if isinstance(source, DTensor) else source)
        ref.attn_backend = ours.attn_backend
    ref.eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


@torch.no_grad()
def load_state_dict_into(model: CausalLM, path: str | Path, local_shard=local_shard) -> None:
    """Copy the weights of a model directory (ours or transformers') into `model` in place, keeping its dtype
    and device: resuming, or taking the best checkpoint at the end. Problems are listed in one ModelError.

    Sharded by FSDP2 (DTensor parameters), each rank reads only the rows of each tensor it holds
    (`trainer.dist.local_shard`)."""
    parts, skipped = _checkpoint_keys(model.config, path)
    targets, rows, mxfp4_loads = {}, {}, {}
    for param_name, param in model.named_parameters():  # a tied head appears once, as embed_tokens
        name = base_name(param_name)  # under a LoRA adapter: the checkpoint's name; None for the adapter's weights
        if name is None:
            continue
        local, span = local_shard(param)
        for file_key, index in parts(name):
            if isinstance(index, Mxfp4Part):  # half of a packed expert weight: dequantized once both are read
                # the full shape: a sharded parameter's own, else its target's (4-bit experts' codes are packed)
                full = tuple(param.shape) if span is not None else tuple(local.shape)
                packed = mxfp4_loads.setdefault(name, _Mxfp4Load(local, full, span))
                targets[file_key] = packed.half(index.kind)
                if span is not None:
                    rows[file_key] = (mxfp4_shape(tuple(param.shape), index.kind), *span)
            elif not index:  # the whole parameter (this rank's rows of it)
                targets[file_key] = local
                if span is not None:
                    rows[file_key] = (tuple(param.shape), *span)
            elif span is None:
                targets[file_key] = local[index]
            elif span[0] <= index[0] < span[1]:  # an expert's slice of a parameter sharded by experts: held here
                targets[file_key] = local[(index[0] - span[0], *index[1:])]
            else:  # another rank's expert: checked in the files, not read
                targets[file_key] = torch.empty(param.shape, device="meta")[index]
    try:
        load_safetensors(Path(path), targets, ignore=skipped, rows=rows)
    except CheckpointError as exc:
        raise ModelError(str(exc)) from None


class _Mxfp4Load:
    """One MXFP4-packed expert weight as `load_safetensors` reads it: its blocks and scales (each handed over through a
    `half`, in whichever order the files hold them; this process's rows of experts when sharded), dequantized into
    `target` expert by expert once both are in (one expert's fp32 values at a time), then let go."""

    def __init__(self, target: torch.Tensor, full_shape: tuple, span):
        self.target, self.parts = target, {}
        experts = full_shape[0] if span is None else span[1] - span[0]
        self.shapes = {kind: (experts, *mxfp4_shape(full_shape, kind)[1:]) for kind in ("blocks", "scales")}

    def half(self, kind: str):
        return _Mxfp4Half(self, kind)

    def put(self, kind: str, tensor: torch.Tensor) -> None:
        self.parts[kind] = tensor
        if len(self.parts) == 2:
            blocks, scales = self.parts.pop("blocks"), self.parts.pop("scales")
            for e in range(blocks.shape[0]):
                self.target[e].copy_(dequantize_mxfp4(blocks[e : e + 1], scales[e : e + 1], self.target.dtype)[0])


class _Mxfp4Half:
    """What `load_safetensors` copies a blocks or scales tensor into (its shape and `copy_`)."""

    def __init__(self, load: _Mxfp4Load, kind: str):
        self.load, self.kind = load, kind
        self.shape = torch.Size(load.shapes[kind])
        self.is_meta = load.target.is_meta

    def copy_(self, tensor: torch.Tensor) -> None:
        self.load.put(self.kind, tensor)


def save_pretrained(
    model: CausalLM | TransformersModel, path: str | Path, max_shard_size: int | str = "5GB", tokenizer=None, dtype=None
) -> None:
    """Write config.json, model.safetensors (or shards + index when over max_shard_size) and the tokenizer
    files; a tied lm_head is written once, as embed_tokens (Hugging Face omits lm_head.weight too). A model of the
    transformers path is written by transformers (`TransformersModel.save_pretrained`), in its own dtype."""
    if isinstance(model, TransformersModel):
        model.save_pretrained(path, tokenizer=tokenizer, max_shard_size=max_shard_size)
        return
    dtype = _resolve_dtype(dtype) or model.model.embed_tokens.weight.dtype
    tensors = {  # a tied head appears once, as embed_tokens; an expert tensor as one weight per expert
        file_key: param[index]
        for name, param in model.named_parameters()
        for file_key, index in file_parts(model.config, name)
    }
    path = Path(path)
    try:
        save_safetensors(tensors, path, max_shard_size=max_shard_size, dtype=dtype)
    except CheckpointError as exc:
        raise ModelError(str(exc)) from None
    config = dataclasses.replace(model.config, dtype=_dtype_name(dtype))
    (path / "config.json").write_text(json.dumps(config.to_hf(), indent=2) + "\n")
    if tokenizer is not None:
        tokenizer.save_pretrained(path)


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer files of a model directory (trainer.data.tokenizer.Tokenizer.from_pretrained)."""
    return Tokenizer.from_pretrained(path)


def tokenizer_of(name: str) -> Tokenizer:
    """The tokenizer of `name` (a preset, a model or tokenizer directory, or a hub id, downloaded once), without the
    model."""
    path = locate(name)
    return preset_config(name)[1] if path is None else load_tokenizer(path)


def resolve_tokenizer(processing_class, model=None):
    """The tokenizer a trainer's `processing_class` gives: a `Tokenizer` as it is; a name or path (`tokenizer_of`);
    a transformers tokenizer read into ours (`Tokenizer.from_transformers`); None: the tokenizer of `model` when that
    is a name or path (as TRL loads the model's own), else None. Another transformers object (a multimodal processor)
    is a one-line ConfigError; any other object passes as it is (the Trainer reads only its pad_token_id)."""
    if processing_class is None:
        return tokenizer_of(str(model)) if isinstance(model, (str, os.PathLike)) else None
    if isinstance(processing_class, (str, os.PathLike)):
        return tokenizer_of(str(processing_class))
    module = sys.modules.get("transformers")
    if module is not None and isinstance(processing_class, module.PreTrainedTokenizerBase):
        return Tokenizer.from_transformers(processing_class)
    if type(processing_class).__module__.split(".")[0] == "transformers":
        raise ConfigError(
            f"processing_class: a transformers {type(processing_class).__name__} (expected a tokenizer: a "
            "trainer.Tokenizer, a tokenizer directory or model name, or a transformers tokenizer)"
        )
    return processing_class


# ------------------------------------------------------------------------------------------------------------
# Presets
# ------------------------------------------------------------------------------------------------------------
PRESETS = {
    # 0.77M parameters: byte-level vocab (259 ids) rounded up to 320, tied embeddings, GQA 4:2, head_dim 32.
    # Sized for the CPU demo (trainer/configs/demo.yaml): a step costs a third of hidden 256's, and the steps that
    # buys matter more than width for learning the embedded tasks (measured; README).
    "tiny": {
        "model_type": "llama",
        "vocab_size": 320,
        "hidden_size": 128,
        "intermediate_size": 344,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "initializer_range": 0.02,
        "bos_token_id": None,
        "eos_token_id": 258,
        "pad_token_id": 256,
    },
}


def is_preset(name: str) -> bool:
    return name in PRESETS


def build_preset(name: str, seed: int = 0, use_kernels: bool = True):
    """(CausalLM, Tokenizer) for a named preset: fp32 on cpu, deterministic Hugging Face-style init from `seed`,
    with the embedded byte-level tokenizer."""
    config, tokenizer = preset_config(name)
    model = _build(
        config, None, None, dtype=None, device="cpu", seed=seed, use_kernels=use_kernels, attn_backend="auto"
    )
    return model, tokenizer


def preset_config(name: str):
    """(ModelConfig, Tokenizer) of a named preset, without building the model."""
    if name not in PRESETS:
        raise ModelError(f"preset {name!r} is unknown (presets: {', '.join(PRESETS)})")
    config = ModelConfig.from_hf(PRESETS[name], source=f"preset {name!r}")
    return config, byte_level_tokenizer(model_max_length=config.max_position_embeddings)
