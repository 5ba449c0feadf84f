"""Tiny random checkpoints of transformers' causal-LM model types, written by transformers itself (its config class's
defaults, shrunk): what the transformers-path tests train. Each is a few hundred thousand parameters."""

from __future__ import annotations

from pathlib import Path

import torch

from trainer.data.tokenizer import byte_level_tokenizer

VOCAB = 320  # the byte-level tokenizer's 259 ids and room
# Shrunk sizes, applied to whichever of these keys the model type's config has.
SIZES = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    # mixture of experts
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
    # multi-head latent attention (DeepSeek-V3)
    kv_lora_rank=16,
    q_lora_rank=32,
    qk_rope_head_dim=16,  # DeepSeek-V3 takes head_dim from it
    qk_nope_head_dim=16,
    v_head_dim=16,
    # linear attention (Qwen3-Next, Qwen3.5)
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    # windows
    sliding_window=8,
)
# per type: what its attention needs (DeepSeek-V3's latent attention has as many key/value heads as query heads)
TYPE_SIZES = {"deepseek_v3": dict(num_key_value_heads=4)}
# the token ids the byte-level tokenizer uses (pad 256, bos/eos 258), inside the shrunk vocabulary
IDS = dict(pad_token_id=256, bos_token_id=258, eos_token_id=258)
# transformers' causal-LM types the tests train: each block kind (sliding window, softcapping, logits scaling, MoE,
# MLA, hybrid linear attention, short convolutions, NoPE layers, fused gate_up, partial rotary)
TYPES = (
    "gemma",
    "gemma2",
    "gemma3_text",
    "phi3",
    "olmo2",
    "olmo3",
    "granite",
    "smollm3",
    "glm4",
    "cohere2",
    "starcoder2",
    "exaone4",
    "qwen2_moe",
    "qwen3_moe",
    "mixtral",
    "gpt_oss",
    "deepseek_v3",
    "qwen3_next",
    "qwen3_5_text",
    "lfm2",
)


def tiny_config(model_type: str, **overrides):
    """The config class's defaults for `model_type`, shrunk (SIZES where it has the key), float32."""
    from transformers import AutoConfig

    default = AutoConfig.for_model(model_type)
    sizes = {k: v for k, v in {**SIZES, **TYPE_SIZES.get(model_type, {})}.items() if hasattr(default, k)} | IDS
    sizes = {k: v for k, v in sizes.items() if k not in overrides}
    if hasattr(default, "layer_types"):
        sizes["layer_types"] = None  # recomputed from num_hidden_layers by the config class
    return AutoConfig.for_model(model_type, **sizes, **overrides, dtype="float32")


def write_tiny(model_type: str, directory: Path, seed: int = 0, **overrides) -> Path:
    """A tiny random `model_type` checkpoint in `directory` (transformers' save_pretrained) with our byte-level
    tokenizer beside it; returns the directory."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides))
    model.save_pretrained(directory)
    byte_level_tokenizer().save_pretrained(directory)
    return Path(directory)
