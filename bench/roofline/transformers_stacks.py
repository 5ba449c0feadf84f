"""The step roofline's stacks for a model of the transformers path (issue 44): Gemma-3-4B's text model, which our own
model does not cover, so that our trainer fine-tunes it through trainer.model.transformers_model:
    ours      TransformersModel over transformers.Gemma3ForCausalLM (sdpa) with our kernels where its probes prove
              them (RMSNorm with offset 1, GeGLU through kernels.geglu_linear, the fused linear cross-entropy) +
              kernels.FusedAdamW; the labels on the device, as our Trainer moves them for this path
              (TransformersModel.takes_host_labels is False: the fused loss cannot skip the ignored rows)
    hf        Gemma3ForCausalLM (sdpa) + torch.optim.AdamW(fused=True), the HF Trainer's loss call (labels and
              num_items_in_batch on the device), as stacks.py's hf
    hf_liger  the same after liger_kernel's apply_liger_kernel_to_gemma3_text(model=...) (liger-kernel 0.8.5: its RoPE,
              RMSNorm with offset 1 (casting mode gemma, not in place) on all six norms of a layer and the final one,
              GeGLU MLP (LigerGELUMulFunction) and fused linear cross-entropy (its own causal forward))
No ours_liger: on the transformers path our trainer refuses liger-kernel (`check_transformers_path`).

The twin. TransformersModel decides what runs our kernels by probing the model (forwards of CPU copies of its norms and
MLPs, one forward of the whole model for the head), which cannot run on the meta device where the full-size model is
built. So a twin of the same architecture (the same config but its sizes: `twin_config`) is built on the CPU and probed
as our Trainer would probe the real model, and its verdicts (which classes swap, with which offset, activation and
layout; the head's logit scale and softcap) are applied to the full-size meta model
(`TransformersModel(hf, twin=...)`, trainer/model/kernel_swaps.py's `swap_kernels`).

Under bf16 autocast over fp32 parameters (how both trainers run, stacks.py), a swapped norm whose input is bf16 (the
output of a linear layer: Gemma 3's q_norm, k_norm, post_attention_layernorm and post_feedforward_layernorm) while its
weight is fp32 runs transformers' forward (`_kernel_norm_forward`: a call whose dtypes differ keeps transformers' code);
the recorded ours stack runs exactly that, so only input_layernorm, pre_feedforward_layernorm and the final norm run
our kernel.

Attention: every stack runs transformers' sdpa attention, modelled as flash attention (recording.py); the sliding
layers (5 of every 6, window 1024) as flash attention's local window (`FlashAttentionModel` with the module's
`sliding_window`: each query attends at most the window's keys), the same for all three stacks. transformers builds the
sliding layers' (B, 1, T, T) boolean mask (recorded); SDPA handed a mask would run its memory-efficient kernel over the
whole T x T on a GPU, which this does not model (the flash-attention path, FA2's window, is what it models).
"""

from __future__ import annotations

import contextlib
import functools
import json

import torch

from bench.roofline.stacks import Built, hf_loss, optimizer_for

# Gemma-3-4B's text model. google/gemma-3-4b-it's (and -pt's) config.json sets, in text_config: hidden_size 2560,
# intermediate_size 10240, num_hidden_layers 34, sliding_window 1024 and rope_scaling {"rope_type": "linear",
# "factor": 8.0} (the global layers'); everything else is transformers.Gemma3TextConfig's default (transformers 5.24),
# which that file leaves to it: vocab_size 262208, num_attention_heads 8, num_key_value_heads 4, head_dim 256,
# hidden_activation gelu_pytorch_tanh, query_pre_attn_scalar 256, rms_norm_eps 1e-6, rope_theta 1e6 (global layers)
# and rope_local_base_freq 1e4 (sliding layers), sliding_window_pattern 6 (5 local : 1 global), max_position_embeddings
# 131072, no final or attention logit softcapping, tie_word_embeddings True. 3.88e9 parameters.
TRANSFORMERS_MODELS = {
    "gemma-3-4b": {
        "model_type": "gemma3_text",
        "vocab_size": 262208,
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "num_hidden_layers": 34,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": 256,
        "rms_norm_eps": 1e-6,
        "sliding_window": 1024,
        "sliding_window_pattern": 6,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "max_position_embeddings": 131072,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "tie_word_embeddings": True,
        "initializer_range": 0.02,
    },
}
TRANSFORMERS_STACKS = ("ours", "hf", "hf_liger")
# What the md of a transformers-path model says about its stacks (report.render)
REPORT_NOTE = (
    "Stacks (the transformers path, bench/roofline/transformers_stacks.py): **ours** = our trainer's "
    "TransformersModel over transformers' Gemma3ForCausalLM (sdpa) with our kernels where its probes prove them "
    "(probed on a small CPU twin of the same architecture, applied to the full-size model) + FusedAdamW, the labels"
    " on the device as our Trainer moves them on this path (so the fused loss does not skip the ignored rows); "
    "**hf** = Gemma3ForCausalLM (sdpa) + torch's fused AdamW, the HF Trainer's loss call; **hf_liger** = hf after "
    "liger-kernel's apply_liger_kernel_to_gemma3_text. No ours_liger: the transformers path refuses liger-kernel. "
    "Under bf16 autocast over fp32 weights, 4 of the 6 norms of each layer (q_norm, k_norm, "
    "post_attention_layernorm, post_feedforward_layernorm: bf16 input, fp32 weight) keep transformers' forward in "
    "ours, as the swap's dtype guard makes them on a GPU. Attention: transformers' sdpa in every stack, modelled as"
    " flash attention, the sliding layers (5 of every 6) with their 1024-token window as flash attention's local "
    "window, the same for all stacks (SDPA handed transformers' explicit sliding mask would run its memory-"
    "efficient kernel over the whole T x T on a GPU: not modelled)."
)
# The twin's sizes (`twin_config`): small enough to probe in well under a second on a CPU; six layers keep Gemma 3's
# one global layer among five sliding ones.
TWIN_SIZES = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "sliding_window": 4,
}
TWIN_LAYERS = 6


# model_type -> transformers' config and causal-LM classes
HF_CLASSES = {"gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM")}


def is_transformers_model(config: dict) -> bool:
    return config.get("model_type") in HF_CLASSES


def hf_model(config: dict, device="meta") -> torch.nn.Module:
    """transformers' causal LM of `config` (sdpa attention), on `device`."""
    import transformers

    config_cls, model_cls = (getattr(transformers, name) for name in HF_CLASSES[config["model_type"]])
    cfg = config_cls(**{k: v for k, v in config.items() if k != "model_type"}, attn_implementation="sdpa")
    with torch.device(device):
        return model_cls(cfg)


def twin_config(config: dict) -> dict:
    """`config` at the twin's sizes (TWIN_SIZES, at most TWIN_LAYERS layers); every other setting as it is."""
    return {**config, **TWIN_SIZES, "num_hidden_layers": min(config["num_hidden_layers"], TWIN_LAYERS)}


@functools.lru_cache(maxsize=4)
def _twin(key: str):
    from trainer.model.transformers_model import TransformersModel

    with torch.random.fork_rng():
        torch.manual_seed(0)
        return TransformersModel(hf_model(twin_config(json.loads(key)), device="cpu"))


def twin(config: dict):
    """The probed CPU twin of `config`'s model: TransformersModel (use_kernels on) at `twin_config`'s sizes."""
    return _twin(json.dumps(config, sort_keys=True))


@contextlib.contextmanager
def _packed_sequences_on_meta():
    """transformers' check for packed sequences (`masking_utils.find_packed_sequence_indices`, run without a cache
    and an attention mask: ours passes use_cache=False) ends in a host sync, `bool((mask[:, -1] == 0).all())`, that
    meta tensors cannot answer: its ops are recorded as they run and the answer is the one the data gives here (one
    sequence per row: None)."""
    from transformers import masking_utils

    original = masking_utils.find_packed_sequence_indices

    def find(position_ids):
        if not position_ids.is_meta:
            return original(position_ids)
        try:
            return original(position_ids)
        except RuntimeError as exc:
            if "meta tensors" not in str(exc):
                raise
            return None

    masking_utils.find_packed_sequence_indices = find
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original


def _ours(config: dict) -> Built:
    from trainer.model.transformers_model import TransformersModel

    probed, hf = twin(config), hf_model(config)
    # Wrapped with torch functions' modes off (no tensor is made there): under bench.sm90's fake CUDA, where model_step
    # builds, a meta tensor says it is on cuda:0, and TransformersModel's head probe, which skips meta models, would
    # run on it.
    with torch._C.DisableTorchFunction():
        model = TransformersModel(hf, twin=probed)
    opt = optimizer_for("ours", model.parameters())

    def loss(ids, labels):
        # TransformersModel.takes_host_labels is False: our Trainer moves the labels to the device; num_items = the
        # window's target count, a host int (Trainer._loss_normaliser)
        dev_labels = torch.empty(labels.shape, dtype=labels.dtype, device="cuda")
        with _packed_sequences_on_meta():
            return model(input_ids=ids, labels=dev_labels, num_items=int((labels[:, 1:] != -100).sum())).loss

    return Built(model, opt, loss)


# What liger-kernel 0.8.5's apply_liger_kernel_to_gemma3_text sets on transformers' module, globally (the instance's
# norms, MLPs and forward are patched on the instance)
_LIGER_PATCHED = ("apply_rotary_pos_emb", "Gemma3RMSNorm", "Gemma3MLP")


def _hf(config: dict, liger: bool) -> Built:
    from transformers.models.gemma3 import modeling_gemma3

    model = hf_model(config)
    if liger:
        from liger_kernel.transformers import apply_liger_kernel_to_gemma3_text

        saved = {k: getattr(modeling_gemma3, k) for k in _LIGER_PATCHED}
        try:
            apply_liger_kernel_to_gemma3_text(model=model)
            rope = modeling_gemma3.apply_rotary_pos_emb
        finally:  # liger patches the module globally: the stacks built later must stay transformers'
            for k, v in saved.items():
                setattr(modeling_gemma3, k, v)
        model._roofline_rope = rope  # ... but this model's attention keeps liger's RoPE for its run (`loss`)
    return Built(model, optimizer_for("hf", model.parameters()), hf_loss(model, modeling_gemma3, liger))


def build(stack: str, config: dict) -> Built:
    return {
        "ours": lambda: _ours(config),
        "hf": lambda: _hf(config, False),
        "hf_liger": lambda: _hf(config, True),
    }[stack]()
