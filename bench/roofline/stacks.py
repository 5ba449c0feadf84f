"""The four stacks (ours, ours_liger, hf, hf_liger), each built on the meta device with its trainer's default
optimizer (`build`; a model of the transformers path: transformers_stacks.py's three), and one recorded training step
of a stack (`model_step`)."""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import warnings
from collections.abc import Callable

import torch

import kernels
from bench.roofline import tracing
from bench.roofline.recording import autocast_bf16, modelled_ops, recording
from bench.roofline.tracing import EAGER_ATTENTION, Trace
from bench.sm90 import fake_cuda
from trainer.model.causal_lm import HYBRID_TYPES

STACKS = ("ours", "ours_liger", "hf", "hf_liger")
# Our other architectures: hf_liger = transformers after liger-kernel's patches for the model_type (`_with_liger`;
# its fused MoE for qwen3_moe and mixtral, op_models.LigerFusedMoEModel; RMSNorm, RoPE and the fused loss for gpt_oss)
OUR_OTHER_STACKS = ("ours", "hf", "hf_liger")
# Qwen3.5's family (Gated DeltaNet layers): each side also with flash-linear-attention's recurrence (fla-core
# installed: ours calls it, transformers finds it), modelled by op_models.FlaGatedDeltaRuleModel; hf_fla_liger: the
# strongest transformers setup, fla and liger-kernel's patches (its RMSNorm, SwiGLU or fused MoE, fused loss) together
HYBRID_STACKS = ("ours", "ours_fla", "hf", "hf_fla", "hf_fla_liger")
# (ours' stack, transformers' stack) pairs the report divides beyond ours against each baseline
FLA_PAIRS = (("ours_fla", "hf_fla"), ("ours_fla", "hf_fla_liger"))
# Our model's architectures beyond Llama's, at full size. qwen3.5-9b: transformers' Qwen3_5TextConfig defaults
# (transformers 5.24), which its docstring calls "the Qwen3.5-9B style configuration": vocab 248320, hidden 4096,
# intermediate 12288, 32 layers (every fourth gated full attention: 16 heads, 4 key/value heads of 256, a quarter of
# each rotated; the others Gated DeltaNet: 16 key heads and 32 value heads of 128, 4 conv taps), untied embeddings.
# qwen3.5-4b: Qwen/Qwen3.5-4B's text_config as public code reproduces it (its config.json cannot be fetched here; three
# independent copies agree): hidden 2560, intermediate 9216, 32 layers (every fourth gated full attention: 16 heads,
# 4 key/value heads of 256), the Gated DeltaNet heads of transformers' defaults (16 key, 32 value heads of 128), tied
# embeddings; the rest transformers' defaults.
# qwen3-30b-a3b: Qwen/Qwen3-30B-A3B's config.json (48 layers, 32 heads and 4 key/value heads of 128, 128 experts of
# 768, 8 per token, renormalised; vocab 151936, untied).
# qwen3.5-35b-a3b: transformers' Qwen3_5MoeTextConfig defaults ("the Qwen3.5-35B-A3B style configuration"): vocab
# 248320, hidden 2048, 40 layers (every fourth gated full attention: 16 heads, 2 key/value heads of 256; the others
# Gated DeltaNet as 9B's), every layer 256 experts of 512, 8 per token, beside a gated shared expert of 512.
# gpt-oss-20b: openai/gpt-oss-20b's config.json (24 layers alternating sliding (128) and full attention, 64 heads and 8
# key/value heads of 64 with sinks, 32 experts of 2880 with 4 per token, YaRN x32 over 4096, vocab 201088, untied);
# its expert weights in bf16 here (the checkpoint's MXFP4 is dequantized as it loads).
GPT_OSS_20B = {
    "model_type": "gpt_oss",
    "vocab_size": 201088,
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "num_hidden_layers": 24,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "num_local_experts": 32,
    "num_experts_per_tok": 4,
    "sliding_window": 128,
    "attention_bias": True,
    "max_position_embeddings": 131072,
    "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 4096,
    },
    "tie_word_embeddings": False,
}
OUR_MODELS = {
    "gpt-oss-20b": GPT_OSS_20B,
    "qwen3.5-4b": {
        "model_type": "qwen3_5_text",
        "hidden_size": 2560,
        "intermediate_size": 9216,
        "num_hidden_layers": 32,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "tie_word_embeddings": True,
    },
    "qwen3.5-9b": {"model_type": "qwen3_5_text"},
    "qwen3.5-35b-a3b": {"model_type": "qwen3_5_moe_text"},
    "qwen3-30b-a3b": {
        "model_type": "qwen3_moe",
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "moe_intermediate_size": 768,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "max_position_embeddings": 40960,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
        "tie_word_embeddings": False,
    },
}


@dataclasses.dataclass
class Built:
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    loss: Callable  # (input_ids on the device, labels on the host) -> loss
    patches: tuple = ()  # the (module, name, wrap) patches the loss call runs under (`_patched`)


def optimizer_for(family: str, params) -> torch.optim.Optimizer:
    """Each trainer's default optimizer: our FusedAdamW ("ours"), torch's fused AdamW ("hf")."""
    hyper = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    if family == "ours":
        return kernels.FusedAdamW(params, **hyper)
    return torch.optim.AdamW(params, **hyper, fused=True)


def _ours(config: dict, liger: bool) -> Built:
    from trainer.model.causal_lm import CausalLM, ModelConfig, apply_liger_kernel

    with torch.device("meta"):
        model = CausalLM(ModelConfig.from_hf(config), use_kernels=True)
    if liger:
        apply_liger_kernel(model)
    opt = optimizer_for("ours", model.parameters())

    def loss(ids, labels):
        # our model takes host labels (takes_host_labels); num_items = the window's target count, as our Trainer
        return model(input_ids=ids, labels=labels, num_items=int((labels[:, 1:] != -100).sum())).loss

    return Built(model, opt, loss)


_LIGER_PATCHED = ("apply_rotary_pos_emb", "LlamaRMSNorm", "LlamaMLP")


def _hf_other(config: dict, liger: bool) -> Built:
    """transformers' causal LM of an architecture of ours other than Llama's (sdpa, or eager where its class has no
    sdpa path: gpt_oss, whose sinks SDPA cannot add; AutoConfig's class for the model_type) + torch's fused AdamW,
    the HF Trainer's loss call; with `liger`, after liger-kernel's patches for its model_type (`_with_liger`)."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    config_class = CONFIG_MAPPING[config["model_type"]]
    attention = "sdpa" if getattr(MODEL_FOR_CAUSAL_LM_MAPPING[config_class], "_supports_sdpa", True) else "eager"
    kwargs = {k: v for k, v in config.items() if k != "model_type"}
    cfg = transformers.AutoConfig.for_model(config["model_type"], **kwargs, attn_implementation=attention)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    modeling = sys.modules[type(model).__module__]
    built = Built(model, optimizer_for("hf", model.parameters()), hf_loss(model, modeling, False))
    if liger:
        built = _with_liger(built, modeling)
    return built if attention == "sdpa" else _patched(built, (modeling, "eager_attention_forward", _named_eager))


def _with_liger(built: Built, modeling) -> Built:
    """`built` after liger-kernel's apply_liger_kernel_to_<model_type>(model=...) (`_apply_liger_kernel_to_instance`:
    what transformers' use_liger_kernel=True calls): the instance's norms, MLPs or experts and forward are patched on
    the instance; what liger sets on the modeling module (its RoPE, its classes) is put back after the build, so a
    transformers model built later stays transformers', and bound again for each of this stack's loss calls."""
    from liger_kernel.transformers.monkey_patch import _apply_liger_kernel_to_instance

    before = dict(vars(modeling))
    try:
        _apply_liger_kernel_to_instance(model=built.model)
    finally:
        changed = {k: v for k, v in vars(modeling).items() if before.get(k) is not v}
        for k in changed:
            if k in before:
                setattr(modeling, k, before[k])
            else:
                delattr(modeling, k)
    return _patched(built, *((modeling, k, lambda _, v=v: v) for k, v in changed.items()))


def _named_eager(inner: Callable) -> Callable:
    """transformers' eager_attention_forward named on the trace's module stack while it runs, so that its ops (the
    scores' matmuls, scaling, mask, softmax, the sinks) count as attention (tracing.category)."""

    def eager(*args, **kwargs):
        with tracing._TRACE.inside(EAGER_ATTENTION):
            return inner(*args, **kwargs)

    return eager


@contextlib.contextmanager
def patched(patches: tuple):
    """Each (module, name, wrap) patch in place, module.name = wrap(module.name), restored on exit."""
    with contextlib.ExitStack() as stack:
        for module, name, wrap in patches:
            inner = getattr(module, name)
            stack.callback(setattr, module, name, inner)
            setattr(module, name, wrap(inner))
        yield


def _patched(built: Built, *patches: tuple) -> Built:
    """`built` whose loss call runs with each (module, name, wrap) patch in place (`patched`), restored after the call:
    the autograd graph it made keeps the patched ops for backward; a ladder step, whose checkpointing runs the forward
    again in backward, enters `Built.patches` again there."""

    def loss(ids, labels):
        with patched(patches):
            return built.loss(ids, labels)

    return Built(built.model, built.optimizer, loss, built.patches + patches)


def _hf(config: dict, liger: bool) -> Built:
    if config["model_type"] != "llama":
        return _hf_other(config, liger)
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**config, attn_implementation="sdpa")
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    if liger:
        from liger_kernel.transformers import apply_liger_kernel_to_llama
        from transformers.models.llama import modeling_llama

        saved = {k: getattr(modeling_llama, k) for k in _LIGER_PATCHED}
        try:
            apply_liger_kernel_to_llama(model=model)
            rope = modeling_llama.apply_rotary_pos_emb
        finally:  # liger patches the module globally: HF eager built later must stay eager
            for k, v in saved.items():
                setattr(modeling_llama, k, v)
        # ... but this model's attention must keep liger's RoPE: bind it for the run (hf_liger's `loss` below)
        model._roofline_rope = rope
    from transformers.models.llama import modeling_llama

    return Built(model, optimizer_for("hf", model.parameters()), hf_loss(model, modeling_llama, liger))


def hf_loss(model, modeling, liger: bool) -> Callable:
    """The HF Trainer's loss call on a transformers model (labels and num_items_in_batch on the device); with liger,
    the model's `_roofline_rope` (liger's RoPE, patched globally by liger and restored after the build) bound to its
    modeling module for the call."""

    def loss(ids, labels):
        dev_labels = torch.empty(labels.shape, dtype=labels.dtype, device="cuda")  # the HF Trainer moves them
        n_items = torch.empty((), dtype=torch.int64, device="cuda")  # num_items_in_batch, on the device
        if not liger:
            return model(input_ids=ids, labels=dev_labels, num_items_in_batch=n_items).loss
        saved = modeling.apply_rotary_pos_emb
        modeling.apply_rotary_pos_emb = model._roofline_rope
        try:
            return model(input_ids=ids, labels=dev_labels, num_items_in_batch=n_items).loss
        finally:
            modeling.apply_rotary_pos_emb = saved

    return loss


def stacks_for(config: dict) -> tuple[str, ...]:
    """The stacks of a model: STACKS for ours' Llama architectures, OUR_OTHER_STACKS for ours' others, HYBRID_STACKS
    for Qwen3.5's family, transformers_stacks' for a model of the transformers path (Gemma 3)."""
    from bench.roofline import transformers_stacks

    if transformers_stacks.is_transformers_model(config):
        return transformers_stacks.TRANSFORMERS_STACKS
    if config.get("model_type") in HYBRID_TYPES:
        return HYBRID_STACKS
    return STACKS if config.get("model_type", "llama") == "llama" else OUR_OTHER_STACKS


def build(stack: str, config: dict) -> Built:
    from bench.roofline import transformers_stacks

    if transformers_stacks.is_transformers_model(config):
        return transformers_stacks.build(stack, config)
    return {
        "ours": lambda: _ours(config, False),
        "ours_liger": lambda: _ours(config, True),
        "hf": lambda: _hf(config, False),
        "hf_liger": lambda: _hf(config, True),
        "ours_fla": lambda: _with_fla(_ours(config, False)),
        "hf_fla": lambda: _with_fla(_hf(config, False)),
        "hf_fla_liger": lambda: _with_fla(_hf(config, True)),
    }[stack]()


def _with_fla(built: Built) -> Built:
    """`built` with flash-linear-attention's recurrence (modelled) in place of the chunked reference: what
    kernels.chunk_gated_delta_rule calls where fla-core is installed, and what transformers' Gated DeltaNet calls for
    its torch_chunk_gated_delta_rule when its kernel hub finds fla (its conv stays PyTorch's: causal-conv1d is
    another package)."""
    from bench.roofline.op_models import fla_chunk_gated_delta_rule
    from kernels import gated_delta_rule

    patches = [(gated_delta_rule, "_fla", lambda inner: lambda: fla_chunk_gated_delta_rule)]
    modeling = sys.modules[type(built.model).__module__]
    if hasattr(modeling, "torch_chunk_gated_delta_rule"):  # transformers' (ours calls kernels' op)
        patches.append((modeling, "torch_chunk_gated_delta_rule", lambda inner: fla_chunk_gated_delta_rule))
    return _patched(built, *patches)


def labels_for(batch: int, seq_len: int, ignored: float, seed: int = 0) -> torch.Tensor:
    """(B, T) host labels: random ids (any in-vocabulary value costs the same) with `ignored` of them -100."""
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 1000, (batch, seq_len), generator=gen)
    flat = labels.view(-1)
    flat[torch.randperm(flat.numel(), generator=gen)[: int(ignored * flat.numel())]] = -100
    return labels


@torch.no_grad()
def clip_grad_norm(params, max_norm: float) -> None:
    """torch.nn.utils.clip_grad_norm_ as it runs on CUDA (its foreach path, which it refuses for meta tensors):
    both trainers call it with the default foreach=None, which picks these ops on a GPU."""
    grads = [p.grad for p in params if p.grad is not None]
    total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0)))
    torch._foreach_mul_(grads, (max_norm / (total + 1e-6)).clamp(max=1.0))


def model_step(stack: str, config: dict, batch: int, seq_len: int, ignored: float) -> Trace:
    """Record one training step of `stack` at full size on meta tensors."""
    trace = Trace()
    with fake_cuda(), modelled_ops(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        built = build(stack, config)
        built.model.train()
        params = [p for p in built.model.parameters() if p.requires_grad]
        tracing._TRACE = Trace()  # the optimizer state's creation: one step outside the trace
        for p in params:
            p.grad = torch.empty_like(p)
        built.optimizer.step()
        built.optimizer.zero_grad(set_to_none=True)
        tracing._TRACE = None
    trace.phase = "setup"  # parameters, buffers and optimizer state
    for t in [
        *built.model.parameters(),
        *built.model.buffers(),
        *(v for s in built.optimizer.state.values() for v in s.values()),
    ]:
        trace.track(t)
    ids = torch.empty((batch, seq_len), dtype=torch.int64, device="meta")
    labels = labels_for(batch, seq_len, ignored)
    with recording(trace):
        trace.phase = "forward"
        with autocast_bf16():
            loss = built.loss(ids, labels)
        trace.phase = "backward"
        loss.backward(torch.ones_like(loss))  # bench.sm90's fake CUDA wants the gradient spelled out
        del loss
        trace.phase = "optimizer"
        clip_grad_norm(params, 1.0)
        built.optimizer.step()
    return trace
