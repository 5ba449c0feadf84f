"""Llama-family causal LMs (Llama 2/3, Mistral, Qwen2/2.5, Qwen3, Qwen3.5's text model, and the Mixture-of-Experts
Qwen3-MoE, Mixtral, gpt-oss, Qwen3-Next and Qwen3.5-MoE) that read and write Hugging Face checkpoints.

One model, ten config dialects. Parameter names are exactly Hugging Face's (`model.embed_tokens.weight`,
`model.layers.{i}.self_attn.q_proj.weight`, ..., `lm_head.weight`), so checkpoints load and save without a
remap and `transformers.AutoModelForCausalLM.from_pretrained` reads what we write.

    x = embed(ids) (+ NEFTune noise in training)
    per layer:  x = x + o_proj(attn(rope(q_norm?(q_proj(n1(x)))), rope(k_norm?(k_proj(..))), v_proj(..)))
                x = x + down_proj(silu(gate_proj(n2(x))) * up_proj(n2(x)))
    logits = lm_head(norm(x))                      n1, n2, norm: RMSNorm  y = w * x / sqrt(mean(x^2) + eps)
Each residual add is done by the norm that reads its sum (`add_rms_norm`): the attention's add by n2, the MLP's by
the next layer's n1 or the final norm, so a layer hands on (x, mlp output) and with `use_kernels` each add and its
norm are one pass (`kernels.fused_add_rms_norm`), as liger's LigerFusedAddRMSNorm does for Hugging Face layers.

Architecture differences (all read from config.json): qwen2 has q/k/v biases; qwen3 RMS-normalises q and k
per head and reads `attention_bias`; llama reads `attention_bias`/`mlp_bias` and `rope_scaling`
("linear", "llama3"); mistral (and qwen with `use_sliding_window`) attends within a sliding window, which is
honoured on every backend (not rejected): query i sees keys i-W+1..i. qwen3_5_text (Qwen3.5, transformers'
Qwen3_5ForCausalLM) is hybrid: `layer_types` makes three of every four layers Gated DeltaNet (`linear_attn`:
trainer/model/gated_deltanet.py, linear attention with a gated delta-rule recurrence, whose documents and padding
`AttentionPlan.recur` keeps apart and whose states the KV cache carries), the fourth gated attention (q_proj gives
each head's query and a gate: o_proj(attn * sigmoid(gate))), with partial rotary (the first quarter of each head
rotates) and zero-centred norms everywhere but the Gated DeltaNet's own (RMSNorm scaling by 1 + weight, all in fp32).
The MoE types' MLPs are routed experts (trainer/model/moe.py; qwen3_moe and qwen3_next per `decoder_sparse_step` /
`mlp_only_layers`). qwen3_next and qwen3_5_moe_text (HYBRID_TYPES too) are Qwen3.5's layers with those experts beside
a gated shared expert; qwen3_next's Gated DeltaNet reads q, k, v, z and b, a from two fused projections.
gpt_oss (transformers' GptOssForCausalLM): sliding (`sliding_window`) and full layers alternating per `layer_types`,
q/k/v/o biases, attention sinks (`self_attn.sinks`: a per-head logit in each softmax's denominator, no value;
trainer/model/attention.py says which backend adds them how), YaRN RoPE (cos and sin scaled by its attention factor),
a biased router (softmax over the top k logits) and biased, transposed, interleaved experts with the clamped SwiGLU.

`use_kernels` is one switch, read at call time: RMSNorm (`kernels.rms_norm`, and with the residual add before it
`kernels.fused_add_rms_norm`), RoPE (`kernels.rope`), SwiGLU
(`kernels.swiglu`, whose output down_proj's backward recomputes instead of keeping: `kernels.swiglu_linear` for a
plain down_proj, `_down_recomputing_act` otherwise), the
loss (`kernels.fused_linear_cross_entropy`: the (tokens, vocab) logits never exist) and NEFTune
(`kernels.neftune_noise`) versus plain PyTorch with Hugging Face semantics. `use_liger_kernel=True` (or
`apply_liger_kernel(model)` later) sets RMSNorm, RoPE, SwiGLU and the fused linear cross-entropy to liger-kernel's
ops instead, the baseline our kernels are measured against. Parameter names and state_dict are the same in every
mode.
Attention backends and packing rules: `trainer/model/attention.py`.

Labels are unshifted (as in Hugging Face): position t is trained to predict labels[t + 1]; -100 = no target.
Packed rows: position_ids restarting (at 0, or any break in +1 steps) start a new document; documents never
attend to each other, and NEFTune scales each document's noise by its own length.

Deliberate differences from transformers:
- position_ids default from attention_mask (cumsum - 1, as HF's generate does), so left-padded rows give the
  same result as unpadded ones; HF's forward uses 0..T-1 regardless of padding.
- The loss is sum / num_items (or / supervised-token count), an exact 0 when nothing is supervised (HF: NaN);
  optional label smoothing and z-loss (z_loss * logsumexp^2 per supervised token).
- RoPE frequencies stay fp32 under `model.to(bfloat16)` (they are recomputed, never rounded).
- attention_dropout must be 0; hidden_act must be silu; rope types other than default/linear/llama3/yarn are refused.
- gpt_oss's RMSNorm multiplies by its weight in fp32 and rounds once (transformers', with the norm weights kept in
  fp32); ours rounds the normalised x to the activations' dtype first, as Llama's: equal in fp32 (and under autocast
  over fp32 weights, how our Trainer runs), one more rounding for a model held in bf16.

Run the tests: python -m pytest tests/trainer/model/test_model.py -q
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field, fields

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import kernels
from kernels.nn import RMSNorm as KernelRMSNorm
from trainer.model import fused_lora
from trainer.model.attention import KVCache, make_plan
from trainer.model.gated_deltanet import CausalConv1d, GatedDeltaNet, GatedRMSNorm
from trainer.model.moe import (
    MOE_TYPES,
    SHARED_EXPERT_TYPES,
    Experts,
    RouterStats,
    SparseMoeBlock,
    TopKRouter,
    load_balancing_loss,
    no_router_message,
)

IGNORE_INDEX = -100
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_5_text", *MOE_TYPES)
# Qwen3.5's family: Gated DeltaNet and gated attention layers (layer_types), partial rotary, zero-centred norms
HYBRID_TYPES = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
}
LINEAR_KEYS = (  # Qwen3.5's Gated DeltaNet sizes (trainer/model/gated_deltanet.py)
    "linear_conv_kernel_dim",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_num_key_heads",
    "linear_num_value_heads",
)
# rope_parameters keys that only position ids of images and video change (Qwen3.5's multimodal RoPE: with text
# positions, equal on its three axes, it is the plain rotation); kept for the round trip
ROPE_PASSTHROUGH = ("mrope_section", "mrope_interleaved")
# other types: full / sliding attention
LAYER_KINDS = {model_type: ("full_attention", "linear_attention") for model_type in HYBRID_TYPES}
# gpt_oss's RoPE when its config.json names none (GptOssConfig's default: the released models' YaRN)
GPT_OSS_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}
# multimodal model types whose text model ours trains, read as transformers' AutoModelForCausalLM reads them (their
# text_config; the vision tower left in the files): a released Qwen3.5 checkpoint is `qwen3_5`
TEXT_MODELS = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
MOE_KEYS = (  # ModelConfig's Mixture-of-Experts fields, as Hugging Face names them (mixtral: `_moe_keys`)
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "norm_topk_prob",
    "decoder_sparse_step",
    "mlp_only_layers",
    "output_router_logits",
    "router_aux_loss_coef",
    "swiglu_limit",
    "swiglu_alpha",
)
# the defaults Qwen3.5's family shares (transformers' Qwen3NextConfig, Qwen3_5TextConfig, Qwen3_5MoeTextConfig)
_HYBRID_DEFAULTS = {
    "max_position_embeddings": 32768,
    "head_dim": 256,
    "partial_rotary_factor": 0.25,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "full_attention_interval": 4,
}
# Hugging Face's defaults where they differ by architecture (used only for keys a config.json omits)
_HF_DEFAULTS = {
    "llama": {"max_position_embeddings": 2048, "num_key_value_heads": None},
    "mistral": {"max_position_embeddings": 4096 * 32, "num_key_value_heads": 8, "sliding_window": 4096},
    "qwen2": {
        "max_position_embeddings": 32768,
        "num_key_value_heads": 32,
        "sliding_window": 4096,
        "max_window_layers": 28,
    },
    "qwen3": {
        "max_position_embeddings": 32768,
        "num_key_value_heads": 32,
        "sliding_window": 4096,
        "max_window_layers": 28,
        "head_dim": 128,
    },
    "qwen3_5_text": {**_HYBRID_DEFAULTS, "num_key_value_heads": 4},
    "qwen3_next": {
        **_HYBRID_DEFAULTS,
        "num_key_value_heads": 2,
        "num_experts": 512,
        "num_experts_per_tok": 10,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
    },
    "qwen3_5_moe_text": {
        **_HYBRID_DEFAULTS,
        "num_key_value_heads": 2,
        "num_experts": 256,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
    },
    "qwen3_moe": {
        "max_position_embeddings": 32768,
        "num_key_value_heads": 4,
        "sliding_window": 4096,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
    },
    "mixtral": {
        "max_position_embeddings": 4096 * 32,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1e6,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
    },
    "gpt_oss": {
        "max_position_embeddings": 131072,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "sliding_window": 128,
        "rms_norm_eps": 1e-5,
        "rope_theta": 150000.0,
        "attention_bias": True,
        "num_local_experts": 128,
        "num_experts_per_tok": 4,
        "swiglu_limit": 7.0,
        "swiglu_alpha": 1.702,
    },
}


class ModelError(ValueError):
    """A model config, input or checkpoint that cannot be used, in one line naming the file/key and why."""


def _whole(param: torch.Tensor) -> tuple[torch.Tensor, None]:
    """The `local_shard` of a model that is not sharded: this process holds all of every parameter
    (`trainer.dist.local_shard` is the one for FSDP2's DTensor parameters)."""
    return param, None


# ------------------------------------------------------------------------------------------------------------
# Config
# ------------------------------------------------------------------------------------------------------------
@dataclass
class ModelConfig:
    """The architecture, with Hugging Face's key names; `from_hf(config.json dict)` / `to_hf()` convert."""

    model_type: str = "llama"
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int | None = 11008  # the dense MLPs' width (None: qwen3_5_moe_text, whose layers all route)
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None  # None: = num_attention_heads (no GQA)
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # {"rope_type": "linear"|"llama3", ...}; the legacy "type" key is accepted
    partial_rotary_factor: float = 1.0  # the first head_dim * factor channels rotate (HYBRID_TYPES: 0.25)
    rope_passthrough: dict | None = None  # ROPE_PASSTHROUGH keys as read (no effect on text)
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # llama, qwen3: bias on q/k/v/o
    mlp_bias: bool = False  # llama only
    sliding_window: int | None = None  # effective window of the sliding layers (qwen: only with use_sliding_window)
    layer_types: list[str] | None = None  # per layer "full_attention" | "sliding_attention" | "linear_attention"
    max_window_layers: int | None = None  # qwen: layers from this index on slide (kept for the round trip)
    initializer_range: float = 0.02
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    dtype: str | None = None  # the checkpoint's dtype ("bfloat16", ...): load_pretrained's default
    text_of: str | None = None  # read from a multimodal config (TEXT_MODELS): its model_type; not written back
    # the Gated DeltaNet layers of HYBRID_TYPES (LINEAR_KEYS)
    linear_conv_kernel_dim: int | None = None
    linear_key_head_dim: int | None = None
    linear_value_head_dim: int | None = None
    linear_num_key_heads: int | None = None
    linear_num_value_heads: int | None = None
    # Mixture-of-Experts types (MOE_TYPES; trainer/model/moe.py)
    num_experts: int | None = None  # experts per MoE layer (qwen3_moe's num_experts, mixtral's num_local_experts)
    num_experts_per_tok: int | None = None  # k: the experts each token is routed to
    moe_intermediate_size: int | None = None  # qwen3_moe: each expert's width (mixtral's is intermediate_size)
    shared_expert_intermediate_size: int | None = None  # SHARED_EXPERT_TYPES: the shared expert's width
    norm_topk_prob: bool = False  # qwen3_moe: renormalise the top-k probabilities (mixtral always does)
    decoder_sparse_step: int = 1  # qwen3_moe: every step-th layer is MoE ...
    mlp_only_layers: list[int] | None = None  # ... but for these, which keep a dense MLP of intermediate_size
    output_router_logits: bool = False  # add router_aux_loss_coef x the load-balancing loss (transformers' switch)
    router_aux_loss_coef: float = 0.001
    swiglu_limit: float = 7.0  # gpt_oss: the experts' clamp of gate (above) and up (both sides)
    swiglu_alpha: float = 1.702  # gpt_oss: the experts' sigmoid gain
    # derived in __post_init__
    qkv_bias: bool = field(init=False, repr=False)
    o_bias: bool = field(init=False, repr=False)
    qk_norm: bool = field(init=False, repr=False)
    layer_windows: tuple = field(init=False, repr=False)  # per layer: window or None
    rotary_dim: int = field(init=False, repr=False)  # the rotated channels of a head
    norm_offset: float = field(init=False, repr=False)  # RMSNorm scales by (offset + weight): 1 in HYBRID_TYPES
    attn_output_gate: bool = field(init=False, repr=False)  # q_proj also gives a gate: out * sigmoid(gate)
    layer_moe: tuple = field(init=False, repr=False)  # per layer: whether its MLP is the routed experts
    expert_size: int | None = field(init=False, repr=False)  # each expert's intermediate width
    attention_sinks: bool = field(init=False, repr=False)  # gpt_oss: a learned per-head logit in each softmax

    def __post_init__(self):
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelError(
                f"model_type {self.model_type!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        for key in _required_keys(self.model_type):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ModelError(f"{key} must be a positive integer, got {value!r}")
        if self.hidden_act != "silu":
            raise ModelError(f"hidden_act {self.hidden_act!r} is not supported (supported: silu)")
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.partial_rotary_factor != 1.0 and self.model_type not in HYBRID_TYPES:
            raise ModelError(f"rope partial_rotary_factor {self.partial_rotary_factor} is not supported (only 1.0)")
        self.rotary_dim = int(self.head_dim * self.partial_rotary_factor)
        if self.rotary_dim % 2 or self.rotary_dim <= 0:
            raise ModelError(
                f"head_dim x partial_rotary_factor must be a positive even number of rotated channels, got "
                f"{self.head_dim} x {self.partial_rotary_factor}"
            )
        self.rope_scaling = _normalise_rope(self.rope_scaling, self.max_position_embeddings)
        if self.model_type == "gpt_oss":
            if self.layer_types is None:  # as GptOssConfig derives them: sliding, full, sliding, ...
                self.layer_types = [
                    "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(self.num_hidden_layers)
                ]
        elif self.model_type in HYBRID_TYPES:
            self.sliding_window = None
            if self.layer_types is None:
                self.layer_types = hybrid_layer_types(self.num_hidden_layers)
        elif self.model_type in ("mistral", *MOE_TYPES):  # every layer slides when a window is set
            self.layer_types = [
                "sliding_attention" if self.sliding_window else "full_attention"
            ] * self.num_hidden_layers
        elif self.model_type == "llama":
            self.sliding_window, self.layer_types = None, ["full_attention"] * self.num_hidden_layers
        elif self.layer_types is None:  # qwen: as Hugging Face derives it
            first = self.max_window_layers if self.max_window_layers is not None else self.num_hidden_layers
            self.layer_types = [
                "sliding_attention" if self.sliding_window is not None and i >= first else "full_attention"
                for i in range(self.num_hidden_layers)
            ]
        kinds = LAYER_KINDS.get(self.model_type, ("full_attention", "sliding_attention"))
        if (
            not isinstance(self.layer_types, (list, tuple))
            or len(self.layer_types) != self.num_hidden_layers
            or set(self.layer_types) - set(kinds)
        ):
            raise ModelError(
                f"layer_types must list {'/'.join(map(repr, kinds))} once per layer ({self.num_hidden_layers}), "
                f"got {self.layer_types!r}"
            )
        self.layer_types = list(self.layer_types)
        if "linear_attention" in self.layer_types:
            for key in LINEAR_KEYS:
                value = getattr(self, key)
                if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                    raise ModelError(f"{key} must be a positive integer for linear_attention layers, got {value!r}")
            if self.linear_num_value_heads % self.linear_num_key_heads:
                raise ModelError(
                    f"linear_num_value_heads {self.linear_num_value_heads} is not a multiple of "
                    f"linear_num_key_heads {self.linear_num_key_heads}"
                )
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ModelError(f"sliding_window must be positive or null, got {self.sliding_window!r}")
        self.layer_windows = tuple(self.sliding_window if t == "sliding_attention" else None for t in self.layer_types)
        own_bias = ("llama", "qwen3", "qwen3_moe", "gpt_oss", *HYBRID_TYPES)  # attention_bias sets q/k/v/o biases
        self.qkv_bias = True if self.model_type == "qwen2" else self.attention_bias and self.model_type in own_bias
        self.o_bias = self.attention_bias if self.model_type in own_bias else False
        self.qk_norm = self.model_type in ("qwen3", "qwen3_moe", *HYBRID_TYPES)
        self.norm_offset = 1.0 if self.model_type in HYBRID_TYPES else 0.0
        self.attn_output_gate = self.model_type in HYBRID_TYPES
        self.attention_sinks = self.model_type == "gpt_oss"
        if self.model_type not in ("llama",):
            self.mlp_bias = False
        self._derive_moe()

    def _derive_moe(self) -> None:
        """Which layers route to experts, and the experts' width (MOE_TYPES)."""
        self.layer_moe, self.expert_size = (False,) * self.num_hidden_layers, None
        if self.model_type not in MOE_TYPES:
            return
        for key in ("num_experts", "num_experts_per_tok"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ModelError(f"{key} must be a positive integer for {self.model_type}, got {value!r}")
        if self.num_experts_per_tok > self.num_experts:
            raise ModelError(f"num_experts_per_tok {self.num_experts_per_tok} exceeds num_experts {self.num_experts}")
        own_width = self.model_type not in ("mixtral", "gpt_oss")  # an expert width of its own, not intermediate_size
        self.expert_size = self.moe_intermediate_size if own_width else self.intermediate_size
        if not isinstance(self.expert_size, int) or self.expert_size <= 0:
            raise ModelError(f"moe_intermediate_size must be a positive integer, got {self.expert_size!r}")
        if self.model_type in SHARED_EXPERT_TYPES:
            width = self.shared_expert_intermediate_size
            if not isinstance(width, int) or isinstance(width, bool) or width <= 0:
                raise ModelError(f"shared_expert_intermediate_size must be a positive integer, got {width!r}")
        if self.model_type == "qwen3_5_moe_text":  # its router renormalises the top k always (no such key)
            self.norm_topk_prob = True
        if not isinstance(self.decoder_sparse_step, int) or self.decoder_sparse_step <= 0:
            raise ModelError(f"decoder_sparse_step must be a positive integer, got {self.decoder_sparse_step!r}")
        dense = set(self.mlp_only_layers or ())
        step = self.decoder_sparse_step if self.model_type in ("qwen3_moe", "qwen3_next") else 1
        self.layer_moe = tuple(i not in dense and (i + 1) % step == 0 for i in range(self.num_hidden_layers))

    @classmethod
    def from_hf(cls, config: dict, source: str = "config.json") -> ModelConfig:
        """Build from a Hugging Face config.json dict (transformers 4.x `rope_scaling`/`rope_theta` or 5.x
        `rope_parameters`); `source` names the file in errors."""
        model_type = config.get("model_type")
        if model_type in TEXT_MODELS:  # its text model, as transformers' AutoModelForCausalLM builds it
            if not isinstance(config.get("text_config"), dict):
                raise ModelError(f"{source}: missing key 'text_config' (a {model_type} config's text model)")
            dtype = config.get("dtype") or config.get("torch_dtype")
            text = {"model_type": TEXT_MODELS[model_type], "dtype": dtype, **config["text_config"]}
            return dataclasses.replace(cls.from_hf(text, source), text_of=model_type)
        try:
            if model_type not in SUPPORTED_MODEL_TYPES:
                raise ModelError(
                    f"model_type {model_type!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
                )
            defaults = _HF_DEFAULTS[model_type]

            def get(key, default=None):  # an absent key takes Hugging Face's default for this architecture
                return config[key] if key in config else defaults.get(key, default)

            def value(key, default):  # keys that cannot be null
                return default if get(key) is None else get(key)

            for key in _required_keys(model_type):
                if key not in config:
                    raise ModelError(f"missing key {key!r}")
            if config.get("attention_dropout", 0.0):
                raise ModelError(f"attention_dropout {config['attention_dropout']} is not supported (only 0.0)")
            rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
            if model_type == "gpt_oss" and not rope:
                rope = dict(GPT_OSS_ROPE)
            theta = rope.pop("rope_theta", None) or config.get("rope_theta") or defaults.get("rope_theta", 10000.0)
            partial = rope.pop("partial_rotary_factor", None) or get("partial_rotary_factor") or 1.0
            passthrough = {k: rope.pop(k) for k in ROPE_PASSTHROUGH if k in rope}
            layer_types = config.get("layer_types")
            if model_type in HYBRID_TYPES and layer_types is None:
                layer_types = hybrid_layer_types(config["num_hidden_layers"], get("full_attention_interval"))
            sliding = get("sliding_window")
            if model_type in ("qwen2", "qwen3", "qwen3_moe") and not config.get("use_sliding_window", False):
                sliding = None
            return cls(
                model_type=model_type,
                vocab_size=config["vocab_size"],
                hidden_size=config["hidden_size"],
                intermediate_size=config.get("intermediate_size"),
                num_hidden_layers=config["num_hidden_layers"],
                num_attention_heads=config["num_attention_heads"],
                num_key_value_heads=get("num_key_value_heads"),
                head_dim=get("head_dim"),
                hidden_act=value("hidden_act", "silu"),
                max_position_embeddings=value("max_position_embeddings", 2048),
                rms_norm_eps=float(value("rms_norm_eps", 1e-6)),
                rope_theta=float(theta),
                rope_scaling=rope or None,
                partial_rotary_factor=float(partial),
                rope_passthrough=passthrough or None,
                tie_word_embeddings=bool(value("tie_word_embeddings", False)),
                attention_bias=bool(value("attention_bias", False)),
                mlp_bias=bool(value("mlp_bias", False)),
                sliding_window=sliding,
                layer_types=layer_types if model_type in ("qwen2", "qwen3", "gpt_oss", *HYBRID_TYPES) else None,
                max_window_layers=get("max_window_layers"),
                initializer_range=float(value("initializer_range", 0.02)),
                bos_token_id=config.get("bos_token_id"),
                eos_token_id=config.get("eos_token_id"),
                pad_token_id=config.get("pad_token_id"),
                dtype=config.get("dtype") or config.get("torch_dtype"),
                **({key: get(key) for key in LINEAR_KEYS} if model_type in HYBRID_TYPES else {}),
                **(_moe_fields(config, get) if model_type in MOE_TYPES else {}),
            )
        except ModelError as exc:
            raise ModelError(f"{source}: {exc}") from None

    def to_hf(self) -> dict:
        """A config.json dict that transformers (4.x and 5.x) loads into the same architecture."""
        out = {"architectures": [_ARCHITECTURES[self.model_type]], "model_type": self.model_type}
        for f in fields(self):
            skip = ("model_type", "rope_scaling", "partial_rotary_factor", "rope_passthrough", "layer_types", "text_of")
            if f.init and f.name not in (*skip, "max_window_layers", "dtype", *LINEAR_KEYS, *MOE_KEYS):
                out[f.name] = getattr(self, f.name)
        if self.intermediate_size is None:
            out.pop("intermediate_size")
        if self.model_type in MOE_TYPES:
            out |= {their: getattr(self, ours) for their, ours in _moe_keys(self.model_type).items()}
            dense_layers = self.model_type in ("qwen3_moe", "qwen3_next")  # mlp_only_layers
            out |= {"mlp_only_layers": list(self.mlp_only_layers or [])} if dense_layers else {}
            out |= {"router_jitter_noise": 0.0} if self.model_type == "mixtral" else {}
        out["attention_dropout"] = 0.0
        out["rope_parameters"] = {"rope_type": "default", **(self.rope_scaling or {}), "rope_theta": self.rope_theta}
        if self.model_type in HYBRID_TYPES:
            out["rope_parameters"]["partial_rotary_factor"] = self.partial_rotary_factor
            out["rope_parameters"] |= self.rope_passthrough or {}
            out["layer_types"] = list(self.layer_types)
            out |= {key: getattr(self, key) for key in LINEAR_KEYS}
        if self.rope_scaling:  # transformers 4.x reads rope_scaling + rope_theta; 5.x rope_parameters
            out["rope_scaling"] = dict(self.rope_scaling)
        if self.model_type == "qwen3_moe":
            out["use_sliding_window"] = self.sliding_window is not None
        if self.model_type == "gpt_oss":
            out["layer_types"] = list(self.layer_types)
        if self.model_type in ("qwen2", "qwen3"):
            out["use_sliding_window"] = self.sliding_window is not None
            out["max_window_layers"] = (
                self.max_window_layers if self.max_window_layers is not None else self.num_hidden_layers
            )
            out["layer_types"] = list(self.layer_types)
        if self.model_type not in ("mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "gpt_oss"):
            out.pop("sliding_window")
        if self.model_type not in ("llama", "qwen3", "qwen3_moe", "gpt_oss", *HYBRID_TYPES):
            out.pop("attention_bias")
        if self.model_type != "llama":
            out.pop("mlp_bias")
        if self.dtype is not None:
            out["dtype"] = out["torch_dtype"] = self.dtype
        out["use_cache"] = True
        return out


def _moe_keys(model_type: str) -> dict[str, str]:
    """config.json's Mixture-of-Experts keys of `model_type` -> ModelConfig's fields (mixtral and gpt_oss name their
    expert count num_local_experts and have neither a separate expert width nor dense layers)."""
    keys = ("num_experts_per_tok", "output_router_logits", "router_aux_loss_coef")
    if model_type == "qwen3_5_moe_text":  # every layer routed, always renormalised, a shared expert
        keys += ("num_experts", "moe_intermediate_size", "shared_expert_intermediate_size")
        return {key: key for key in keys}
    if model_type == "mixtral":
        return {"num_local_experts": "num_experts", **{key: key for key in keys}}
    if model_type == "gpt_oss":  # its experts' clamped SwiGLU too
        return {"num_local_experts": "num_experts", **{key: key for key in (*keys, "swiglu_limit", "swiglu_alpha")}}
    others = ("mlp_only_layers", "swiglu_limit", "swiglu_alpha")
    others += () if model_type in SHARED_EXPERT_TYPES else ("shared_expert_intermediate_size",)
    return {key: key for key in MOE_KEYS if key not in others}


def _moe_fields(config: dict, get) -> dict:
    """ModelConfig's MoE fields from a config.json dict (`get`: a key's value or Hugging Face's default). transformers
    5 writes qwen3_moe's expert count as num_local_experts (its attribute map) and the released checkpoints
    num_experts: either is read."""
    if float(config.get("router_jitter_noise") or 0.0):
        raise ModelError(f"router_jitter_noise {config['router_jitter_noise']} is not supported (only 0.0)")
    out = {ours: get(their) for their, ours in _moe_keys(config["model_type"]).items() if get(their) is not None}
    if "num_local_experts" in config or "num_experts" in config:
        out["num_experts"] = config.get("num_experts", config.get("num_local_experts"))
    if config.get("mlp_only_layers"):
        out["mlp_only_layers"] = list(config["mlp_only_layers"])
    return out


def _required_keys(model_type: str) -> tuple[str, ...]:
    """The config keys every config.json of `model_type` must have (positive integers); qwen3_5_moe_text has no dense
    MLP, so no intermediate_size."""
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    return tuple(k for k in keys if not (k == "intermediate_size" and model_type == "qwen3_5_moe_text"))


def hybrid_layer_types(layers: int, interval: int = 4) -> list[str]:
    """Qwen3.5's layer_types as transformers derives them: every `interval`-th layer attends, the rest are linear."""
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]


def _normalise_rope(scaling: dict | None, max_positions: int) -> dict | None:
    if not scaling:
        return None
    if any(isinstance(v, dict) for v in scaling.values()):
        raise ModelError("per-layer-type rope parameters are not supported (one global rope config only)")
    scaling = dict(scaling)
    kind = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    scaling.pop("rope_theta", None)
    if kind not in ROPE_TYPES:
        raise ModelError(f"rope_scaling type {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
    if scaling.get("partial_rotary_factor", 1.0) != 1.0:
        raise ModelError(f"rope partial_rotary_factor {scaling['partial_rotary_factor']} is not supported (only 1.0)")
    scaling.pop("partial_rotary_factor", None)
    if kind == "default":
        return None
    if kind == "yarn":
        return _normalise_yarn(scaling, max_positions)
    need = ("factor",) if kind == "linear" else ("factor", "low_freq_factor", "high_freq_factor")
    for key in need:
        if not isinstance(scaling.get(key), (int, float)):
            raise ModelError(f"rope_scaling {kind!r} needs a number for {key!r}, got {scaling.get(key)!r}")
    out = {"rope_type": kind, **{k: float(scaling[k]) for k in need}}
    if kind == "llama3":
        out["original_max_position_embeddings"] = int(scaling.get("original_max_position_embeddings") or max_positions)
    return out


def _normalise_yarn(scaling: dict, max_positions: int) -> dict:
    """YaRN's parameters with transformers' defaults made explicit (beta_fast 32, beta_slow 1, truncate true, the
    original context max_position_embeddings); attention_factor, mscale and mscale_all_dim kept where given."""
    if not isinstance(scaling.get("factor"), (int, float)) or isinstance(scaling.get("factor"), bool):
        raise ModelError(f"rope_scaling 'yarn' needs a number for 'factor', got {scaling.get('factor')!r}")
    unknown = set(scaling) - {"factor", "beta_fast", "beta_slow", "truncate", "original_max_position_embeddings"}
    unknown -= {"attention_factor", "mscale", "mscale_all_dim"}
    if unknown:
        raise ModelError(f"rope_scaling 'yarn' key(s) {', '.join(sorted(unknown))} are not supported")
    out = {
        "rope_type": "yarn",
        "factor": float(scaling["factor"]),
        "beta_fast": float(scaling.get("beta_fast") or 32),  # transformers' `or`: 0 and null take the default
        "beta_slow": float(scaling.get("beta_slow") or 1),
        "truncate": bool(scaling.get("truncate", True)),
        "original_max_position_embeddings": int(scaling.get("original_max_position_embeddings") or max_positions),
    }
    out |= {
        k: float(scaling[k]) for k in ("attention_factor", "mscale", "mscale_all_dim") if scaling.get(k) is not None
    }
    return out


def yarn_attention_factor(scaling: dict) -> float:
    """The factor YaRN scales cos and sin by (transformers' `_compute_yarn_parameters`): attention_factor if given,
    else 0.1 ln(factor) + 1 (1 for factor <= 1), or the ratio of the mscale and mscale_all_dim forms of it."""
    factor = scaling["factor"]

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if scaling.get("attention_factor") is not None:
        return scaling["attention_factor"]
    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return float(mscale(factor, scaling["mscale"]) / mscale(factor, scaling["mscale_all_dim"]))
    return mscale(factor)


EXACT_POSITIONS = 2**24  # RoPE's angles are fp32 position x frequency: positions are exact integers up to here


def context_length_warning(config: ModelConfig, length: int, source: str) -> str | None:
    """Whether rows of `length` positions suit the model: None when within max_position_embeddings; a one-line
    warning when beyond it (allowed, as transformers allows it: RoPE computes every position's rotation, no table
    is indexed, but the model never saw positions that far; rope scaling, already counted in
    max_position_embeddings, is how a model declares a longer context); a ModelError when positions past 2^24
    would be rounded in fp32, so that different positions would get the same rotation."""
    if length > EXACT_POSITIONS:
        raise ModelError(
            f"cutoff_len {length:,} exceeds {EXACT_POSITIONS:,} positions: RoPE computes its angles from "
            "fp32 positions, which are exact only up to 2^24, so positions past that would share "
            "rotations; lower cutoff_len"
        )
    limit = config.max_position_embeddings
    if length <= limit:
        return None
    scaling = config.rope_scaling
    rope = f"rope_scaling {scaling['rope_type']} x{scaling['factor']:g}" if scaling else "no rope_scaling"
    return (
        f"warning: cutoff_len {length:,} exceeds max_position_embeddings {limit:,} of {source} ({rope}): RoPE "
        f"rotates any position, so it runs, but the model never saw positions past {limit:,} and examples "
        "longer than that may train poorly; lower cutoff_len, or use a model whose config declares a longer "
        "context"
    )


# ------------------------------------------------------------------------------------------------------------
# Layers
# ------------------------------------------------------------------------------------------------------------
def rms_norm_plain(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    """Hugging Face's RMSNorm: normalise in fp32, cast back to x's dtype, then scale by the weight (Llama's); with an
    offset, scale by (offset + weight) in fp32 and cast once (Qwen3.5's and Gemma's zero-centred norm)."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if offset:
        return (normed * (offset + weight.float())).to(x.dtype)
    return weight * normed.to(x.dtype)


IMPLS = ("torch", "kernels", "liger")  # who computes RMSNorm, RoPE, SwiGLU and the loss; set model-wide


class RMSNorm(KernelRMSNorm):
    """kernels.nn.RMSNorm (Llama's: weight initialised to ones, no offset; with `offset` 1 Qwen3.5's zero-centred
    norm, weight initialised to zeros) with the model-wide choice of who computes it."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__(dim, eps, offset)
        self.impl = "kernels"  # set for the whole model by CausalLM (use_kernels / apply_liger_kernel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.impl == "kernels":
            return super().forward(x)
        if self.impl == "liger":
            from liger_kernel.ops.rms_norm import LigerRMSNormFunction

            casting = "gemma" if self.offset else "llama"  # gemma: all in fp32, one cast (the offset norms' order)
            return LigerRMSNormFunction.apply(x, self.weight, self.eps, self.offset, casting, False)
        return rms_norm_plain(x, self.weight, self.eps, self.offset)


def add_rms_norm(norm: nn.Module, x: torch.Tensor, update: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + update), x + update) (x itself when update is None): Hugging Face's `residual + hidden_states`
    followed by the next norm. With our kernels one pass (`kernels.fused_add_rms_norm`: the sum rounded once to the
    stream's dtype, the norm computed from it); otherwise the add, then the norm (also for a norm a LoRA
    modules_to_save wrapper holds)."""
    if update is None:
        return norm(x), x
    if isinstance(norm, RMSNorm) and norm.impl == "kernels":
        return kernels.fused_add_rms_norm(update, x, norm.weight, norm.eps, norm.offset)
    x = x + update
    return norm(x), x


def rotate_partial(rope_fn, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """`rope_fn(q, k, cos, sin)` (kernels.rope's signature: q (B, Hq, T, D), k (B, Hkv, T, D)) on the first
    cos.shape[-1] channels of each head, the rest passed through (partial rotary: Qwen3.5 0.25, Phi-4-mini 0.75)."""
    r = cos.shape[-1]
    if r == q.shape[-1]:
        return rope_fn(q, k, cos, sin)
    q_rot, k_rot = rope_fn(q[..., :r], k[..., :r], cos, sin)
    return torch.cat([q_rot, q[..., r:]], dim=-1), torch.cat([k_rot, k[..., r:]], dim=-1)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """(rotary_dim / 2,) fp32 inverse frequencies theta^(-2i/D) (D the rotated channels: head_dim, or its
    partial_rotary_factor part), with "linear", "llama3" or "yarn" scaling (YaRN's attention factor scales cos and
    sin: `RotaryEmbedding`)."""
    dim = config.rotary_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))  # (D/2,)
    scaling = config.rope_scaling
    if scaling is None:
        return inv
    factor = scaling["factor"]
    if scaling["rope_type"] == "linear":
        return inv / factor
    if scaling["rope_type"] == "yarn":
        return _yarn_inv_freq(config, scaling)
    # llama3: wavelengths longer than the original context / low_freq_factor are stretched by `factor`,
    # those shorter than context / high_freq_factor kept, the band between blended linearly in 1/wavelength.
    lo, hi, context = (
        scaling["low_freq_factor"],
        scaling["high_freq_factor"],
        scaling["original_max_position_embeddings"],
    )
    wavelen = 2 * math.pi / inv
    stretched = torch.where(wavelen > context / lo, inv / factor, inv)
    blend = (context / wavelen - lo) / (hi - lo)
    middle = (wavelen >= context / hi) & (wavelen <= context / lo)
    return torch.where(middle, (1 - blend) * inv / factor + blend * inv, stretched)


def _yarn_inv_freq(config: ModelConfig, scaling: dict) -> torch.Tensor:
    """YaRN (Peng et al. 2023) as transformers' `_compute_yarn_parameters` computes it, op for op: frequencies of
    fewer than beta_slow rotations over the original context interpolated (divided by factor), those of more than
    beta_fast kept, a linear ramp over the dimensions between (the correction range floored/ceiled if truncate)."""
    dim, base, factor = config.rotary_dim, config.rope_theta, scaling["factor"]
    context = scaling["original_max_position_embeddings"]

    def correction_dim(rotations):
        return (dim * math.log(context / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(scaling["beta_fast"]), correction_dim(scaling["beta_slow"])
    if scaling["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)  # (D/2,)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


class RotaryEmbedding(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)  # (D/2,) fp32
        scaling = config.rope_scaling or {}
        # YaRN scales cos and sin (so every attention logit) by its attention factor; 1 otherwise
        self.attention_scaling = yarn_attention_factor(scaling) if scaling.get("rope_type") == "yarn" else 1.0

    def reset_buffers(self) -> None:
        """Recompute the frequencies on the buffer's device (after `to_empty`, or a dtype cast)."""
        self.inv_freq = rope_inv_freq(self.config).to(self.inv_freq.device)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        if self.inv_freq.dtype != torch.float32:  # model.to(bf16) would round them: recompute in fp32
            self.reset_buffers()
        return self

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq  # (B, T, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (B, T, D)
        if self.attention_scaling != 1.0:
            return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling
        return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (i, i + R/2) of x (B, T, H, D) by the angles in cos/sin (B or 1, T, R): HF's rotate_half, of the
    first R channels when R < D (partial rotary; the rest pass through)."""
    r = cos.shape[-1]
    if r < x.shape[-1]:
        return torch.cat([apply_rope(x[..., :r], cos, sin), x[..., r:]], dim=-1)
    cos, sin = cos[:, :, None].to(x.dtype), sin[:, :, None].to(x.dtype)  # (B or 1, T, 1, D)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        C, H, Hkv, D = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.head_dim, self.window = D, config.layer_windows[layer_idx]
        self.output_gate = config.attn_output_gate  # q_proj gives each head's query, then its gate (Qwen3.5)
        self.q_proj = nn.Linear(C, H * D * (2 if self.output_gate else 1), bias=config.qkv_bias)
        self.k_proj = nn.Linear(C, Hkv * D, bias=config.qkv_bias)
        self.v_proj = nn.Linear(C, Hkv * D, bias=config.qkv_bias)
        self.o_proj = nn.Linear(H * D, C, bias=config.o_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(D, config.rms_norm_eps, config.norm_offset)
            self.k_norm = RMSNorm(D, config.rms_norm_eps, config.norm_offset)
        self.qk_norm = config.qk_norm
        # gpt_oss: each head's learned logit in its softmax's denominator, with no value (trainer/model/attention.py)
        self.sinks = nn.Parameter(torch.empty(H)) if config.attention_sinks else None
        self.impl = "kernels"  # who rotates q and k; set for the whole model by CausalLM
        self.fused_lora = True  # LoRA layers through kernels.lora_projections (CausalLM.fused_lora)

    def forward(self, x, cos, sin, attn) -> torch.Tensor:
        """attn: an AttentionPlan (training/scoring) or a KV-cache slot (decoding)."""
        B, T, _ = x.shape
        q, k, v = _project(self, x, self.q_proj, self.k_proj, self.v_proj)
        if self.output_gate:  # per head [query | gate], as transformers' Qwen3_5Attention splits it
            q, gate = q.view(B, T, -1, 2 * self.head_dim).chunk(2, dim=-1)  # (B, T, H, D) each
        else:
            q = q.view(B, T, -1, self.head_dim)  # (B, T, H, D)
        k = k.view(B, T, -1, self.head_dim)  # (B, T, Hkv, D)
        v = v.view(B, T, -1, self.head_dim)  # (B, T, Hkv, D)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self._rope(q, k, cos, sin)
        out = attn.attend(q, k, v, self.window, self.sinks).reshape(B, T, -1)  # (B, T, H D)
        if self.output_gate:
            out = out * torch.sigmoid(gate.reshape(B, T, -1))
        (out,) = _project(self, out, self.o_proj)
        return out

    def _rope(self, q, k, cos, sin):
        """q (B, T, H, D) and k (B, T, Hkv, D) rotated by cos/sin (B or 1, T, D). The kernels take the (B, H, T, D)
        transposes (transformers' shapes) and their Triton kernels write (B, T, H, D) memory: no copy either way."""
        if self.impl == "torch":
            return apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.impl == "liger":
            from liger_kernel.ops.rope import LigerRopeFunction

            # liger rotates in place, into q_proj's/k_proj's (or q_norm's/k_norm's) output, which no backward saved
            # (a partial rotation's channels copied out first: an in-place write into a view would not be seen).
            def rope_fn(q, k, cos, sin):
                if q.shape[-1] != self.head_dim:
                    q, k = q.contiguous(), k.contiguous()
                return LigerRopeFunction.apply(q, k, cos, sin)

        else:
            rope_fn = kernels.rope  # (B, H, T, D) views
        q_rot, k_rot = rotate_partial(rope_fn, q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        return q_rot.transpose(1, 2), k_rot.transpose(1, 2)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, inner: int | None = None):
        """A SwiGLU MLP of `inner` width (default: intermediate_size; a shared expert's own)."""
        super().__init__()
        hidden, inner, bias = config.hidden_size, inner or config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(hidden, inner, bias=bias)
        self.up_proj = nn.Linear(hidden, inner, bias=bias)
        self.down_proj = nn.Linear(inner, hidden, bias=bias)
        self.impl = "kernels"
        self.fused_lora = True  # LoRA on gate/up/down through kernels.lora_mlp (CausalLM.fused_lora)
        self.tile_tokens: int | None = None  # tiled_mlp: tokens per tile (CausalLM.tiled_mlp sets hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """With `tile_tokens` (tiled_mlp), over the tokens in tiles: each tile's (tokens, intermediate) tensors live
        only while that tile runs, in forward and again in backward (each tile is checkpointed: it keeps only its
        input). Every token's output and input gradient depends on its own row only (equal to untiled within fp32
        rounding: BLAS may block a tile's rows otherwise); the weight gradients are sums over the tiles, equal to the
        untiled ones up to summation order (tests/trainer/model/test_tiled_mlp.py bounds both)."""
        return over_token_tiles(self._untiled, x, self.tile_tokens)

    def _untiled(self, x: torch.Tensor) -> torch.Tensor:
        if self.impl == "liger":
            from liger_kernel.ops.swiglu import LigerSiLUMulFunction

            return self.down_proj(LigerSiLUMulFunction.apply(self.gate_proj(x), self.up_proj(x)))
        if self.impl == "kernels":
            fused = fused_lora.find(x, (self.gate_proj, self.up_proj, self.down_proj)) if self.fused_lora else None
            if fused is not None:  # LoRA layers: one Function keeps x, gate, up and the thin adapter inputs
                (gate, up, down), dropout, lora_dtype = fused
                return kernels.lora_mlp(x, gate, up, down, dropout, lora_dtype)
            return swiglu_down(self.down_proj, self.gate_proj(x), self.up_proj(x))
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def over_token_tiles(fn, x: torch.Tensor, tile_tokens: int | None) -> torch.Tensor:
    """fn(x) for a row-wise fn (an MLP) over x's tokens in tiles of `tile_tokens` (None, or no more tokens: at once),
    each tile checkpointed while grad is on, so that its (tokens, intermediate) tensors live only while it runs, in
    forward and again in backward (`MLP.forward`; the transformers path's swapped MLPs too)."""
    tokens = x.shape[:-1].numel()
    if tile_tokens is None or tokens <= tile_tokens:
        return fn(x)
    tiles = x.reshape(tokens, x.shape[-1]).split(tile_tokens)  # (tile, C) views
    if torch.is_grad_enabled():
        outs = [checkpoint(fn, tile, use_reentrant=False) for tile in tiles]
    else:
        outs = [fn(tile) for tile in tiles]
    return torch.cat(outs).view(*x.shape[:-1], -1)  # (..., C)


# the gated MLPs our kernels compute: the gate's activation -> (the gating op, the same with the down projection)
GATED_MLPS = {
    "silu": (kernels.swiglu, kernels.swiglu_linear),  # SwiGLU: Llama, Qwen, Mistral, Phi-3's fused layout
    "gelu_tanh": (kernels.geglu, kernels.geglu_linear),  # GeGLU: Gemma's gelu_pytorch_tanh
}


def swiglu_down(down: nn.Module, gate: torch.Tensor, up: torch.Tensor, act: str = "silu") -> torch.Tensor:
    """down(silu(gate) * up) through our kernels (one fused pass, 3 bytes per element forward and 5 backward, instead
    of eager's silu, product and their backwards), keeping no (tokens, intermediate) product for down's backward
    where it may be rebuilt: `kernels.swiglu_linear` for a plain down_proj on the GPU (the SwiGLU backward rebuilds
    it), `_down_recomputing_act` for any other down_proj (LoRA-wrapped, 4-bit, hooked, on the CPU); plainly under
    activation checkpointing or torch.compile (`_recompute_allowed`). Our MLP and the transformers path's gated-MLP
    swap both run it; `act` "gelu_tanh" is GeGLU (`GATED_MLPS`)."""
    glu, glu_linear = GATED_MLPS[act]
    if not _recompute_allowed():
        return down(glu(gate, up))
    if _plain_linear(down) and kernels.use_triton(gate, up):
        # act is rebuilt by the gating backward itself (one more write, not another pass over gate and up)
        return glu_linear(gate, up, down.weight)
    return _down_recomputing_act(down, gate, up, glu)


def _project(module: nn.Module, x: torch.Tensor, *layers: nn.Module) -> tuple[torch.Tensor, ...]:
    """Each of `layers` applied to x: as one `kernels.lora_projections` call when `module` runs our kernels with
    `fused_lora` and some of the layers are LoRA layers that can run fused (trainer/model/fused_lora.py), else layer
    by layer."""
    fused = fused_lora.find(x, layers) if module.impl == "kernels" and module.fused_lora else None
    if fused is None:
        return tuple(layer(x) for layer in layers)
    return kernels.lora_projections(x, *fused)


def _recompute_allowed() -> bool:
    """Whether `_down_recomputing_act` may install its saved-tensor hooks: eager autograd with no other hooks, or only
    hooks marked `gives_back_as_saved` (activation offloading's). Under activation checkpointing the checkpoint's own
    hooks decide what is kept, and its recompute must see plain saves; under torch.compile the partitioner decides."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if not torch.is_grad_enabled() or torch.compiler.is_compiling() or top is None:
        return False
    hooks = top(False)
    # hooks that give back every saved tensor as it was (ActivationOffloader's) change nothing here: the recompute's
    # own hooks nest inside them as they would with none
    return hooks is None or getattr(hooks[0], "gives_back_as_saved", False)


def _plain_linear(m: nn.Module) -> bool:
    """Whether m is an nn.Linear without bias or hooks of its own, which `kernels.swiglu_linear` may stand in for
    (FSDP2 shards whole decoder blocks: their Linears stay plain, their weights gathered for the block's forward
    and backward). A LoRA-wrapped or hooked down_proj takes `_down_recomputing_act`."""
    hooks = (m._forward_hooks, m._forward_pre_hooks, m._backward_hooks, m._backward_pre_hooks)
    return type(m) is nn.Linear and m.bias is None and not any(hooks)


_RECOMPUTE = object()  # what down_proj's backward keeps in place of silu(gate) * up


def _down_recomputing_act(down: nn.Module, gate: torch.Tensor, up: torch.Tensor, glu=kernels.swiglu) -> torch.Tensor:
    """down(swiglu(gate, up)) for a down_proj `kernels.swiglu_linear` cannot stand in for (LoRA-wrapped, hooked,
    biased) without keeping swiglu's output for down's backward: it is recomputed there from gate and
    up, which the SwiGLU backward keeps anyway. Saves one (tokens, intermediate) activation per layer (2.1 GB in all
    for Llama-3.2-1B at 4 x 2048 tokens: bench/results/roofline.md) for one more SwiGLU forward pass per layer in
    backward (3 bytes per element: ~1.6% of the modelled step there). The same kernel on the same inputs: the values
    and gradients are bit for bit those without the recompute. Anything else down saves (its cast weight, a LoRA
    adapter's inputs other than act) is kept as it is."""
    act = glu(gate, up)  # (B, T, I)
    # act's storage by its address, not act itself: the hooks may live as long as the graph, and act must not. down
    # saves a view of it (F.linear flattens the leading dims), so views of that storage are what is recomputed.
    act_storage = act.untyped_storage()._cdata

    def pack(t):
        if t.untyped_storage()._cdata != act_storage:
            return t
        return _RECOMPUTE, t.size(), t.stride(), t.storage_offset()

    def unpack(p):
        if not (isinstance(p, tuple) and p[0] is _RECOMPUTE):
            return p
        with torch.no_grad():
            return glu(gate, up).as_strided(*p[1:])  # the same view of a fresh, equal act

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        return down(act)


def gated_deltanet(config: ModelConfig) -> GatedDeltaNet:
    """A Gated DeltaNet layer of `config`'s sizes (the linear_attention layers of HYBRID_TYPES; Qwen3-Next's with its
    two fused projections)."""
    return GatedDeltaNet(
        config.hidden_size,
        config.linear_num_key_heads,
        config.linear_num_value_heads,
        config.linear_key_head_dim,
        config.linear_value_head_dim,
        config.linear_conv_kernel_dim,
        config.rms_norm_eps,
        fused_projections=config.model_type == "qwen3_next",
    )


def sparse_moe_block(config: ModelConfig) -> SparseMoeBlock:
    """The routed experts of `config`'s sizes (the MoE layers of MOE_TYPES), with a shared expert in
    SHARED_EXPERT_TYPES."""
    shared = config.model_type in SHARED_EXPERT_TYPES
    return SparseMoeBlock(
        config.hidden_size,
        config.expert_size,
        config.num_experts,
        config.num_experts_per_tok,
        config.model_type,
        config.norm_topk_prob,
        config.swiglu_limit,
        config.swiglu_alpha,
        MLP(config, config.shared_expert_intermediate_size) if shared else None,
    )


class DecoderLayer(nn.Module):
    """A pre-norm block: its token mixer (`self_attn`, or Qwen3.5's `linear_attn` where layer_types says
    "linear_attention") and its MLP (the routed experts where `layer_moe` says so), each after an RMSNorm, each added
    to the residual stream."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        if config.layer_types[layer_idx] == "linear_attention":
            self.linear_attn = gated_deltanet(config)
        else:
            self.self_attn = Attention(config, layer_idx)
        self.mlp = sparse_moe_block(config) if config.layer_moe[layer_idx] else MLP(config)
        self.router_stats = config.output_router_logits  # MoE layers hand on their load-balancing sums
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_offset)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_offset)

    def forward(self, x, update, cos, sin, attn) -> tuple[torch.Tensor, torch.Tensor, RouterStats | None]:
        """x: the residual stream; update: the previous layer's MLP output, not yet added to it (None in the first
        layer). Returns the stream after the attention's add and this layer's MLP output, which the next layer's input
        norm (or the final norm) adds: each add is fused with the norm that reads its sum; and an MoE layer's
        load-balancing sums where the config asks for that loss (else None). `attn` (a plan, or a cache slot) keeps
        documents and padding apart for either mixer (trainer/model/attention.py)."""
        normed, x = add_rms_norm(self.input_layernorm, x, update)
        if hasattr(self, "linear_attn"):
            mixed = attn.recur(self.linear_attn, normed)
        else:
            mixed = self.self_attn(normed, cos, sin, attn)
        normed, x = add_rms_norm(self.post_attention_layernorm, x, mixed)
        if isinstance(self.mlp, SparseMoeBlock):
            return x, *self.mlp(normed, getattr(attn, "key_valid", None), stats=self.router_stats)
        return x, self.mlp(normed), None


class Backbone(nn.Module):
    """The `model.` prefix of Hugging Face names: embeddings, decoder layers, final norm, rotary buffer."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_offset)
        self.rotary_emb = RotaryEmbedding(config)


class CausalLMOutput(dict):
    """What a causal LM's forward returns, read by attribute (`out.loss`). A dict, as transformers' ModelOutput is,
    so that engines which look for the tensors in a module's output find them: DeepSpeed ZeRO-3 hooks the root
    module's backward through them, and that backward gathers again the LM head's weight the fused loss read
    outside the head's own forward (a dataclass hid them: an untied head's partition reached the backward empty)."""

    def __init__(
        self,
        loss: torch.Tensor | None,  # () fp32, or None without labels
        logits: torch.Tensor | None,  # (B, T, V) in the model dtype; None when the fused loss computed it away
        sequence_logps: kernels.PreferenceLogps | None = None,  # per row of the batch, with sequence_logps=True
        metrics: dict | None = None,  # TRL's preference metrics (0-d tensors), with preference_loss
        aux_loss: torch.Tensor | None = None,  # () fp32: MoE models' load-balancing loss, with output_router_logits
    ):
        super().__init__(loss=loss, logits=logits, sequence_logps=sequence_logps, metrics=metrics, aux_loss=aux_loss)

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

    def __setattr__(self, name, value):
        self[name] = value


# ------------------------------------------------------------------------------------------------------------
# The model
# ------------------------------------------------------------------------------------------------------------
class HostLabels:
    """`labels` for `CausalLM.forward` that stay on the host through FSDP2's root pre-forward.

    On an accelerator that hook moves every tensor among forward's arguments to the device
    (torch.distributed.utils._to_kwargs, as DDP does) and leaves other objects as they are; labels moved there
    would cost the fused loss its skip of the ignored rows (finding them on the device needs a host sync). The
    Trainer hands an FSDP2 model its host labels in this holder; forward takes the tensor out."""

    __slots__ = ("labels",)

    def __init__(self, labels: torch.Tensor):
        self.labels = labels  # (B, T) on the host, as the collator built them


class CausalLM(nn.Module):
    """A Llama-family decoder with an LM head; Hugging Face parameter names and checkpoint format."""

    # forward takes `labels` on the CPU, as the collator built them: the fused loss then finds the rows with a
    # target on the host (no device sync) and skips the ignored rows' matmuls (kernels/fused_linear_cross_entropy.py).
    # Under FSDP2 they come wrapped in `HostLabels`, which its input move leaves alone.
    takes_host_labels = True

    def __init__(
        self,
        config: ModelConfig,
        use_kernels: bool = True,
        label_smoothing: float = 0.0,
        z_loss: float = 0.0,
        neftune_noise_alpha: float | None = None,
        use_liger_kernel: bool = False,
        tiled_mlp: bool = False,
        router_aux_loss_coef: float | None = None,
    ):
        """The training settings are given here, once (`trainer.build.build_model` gives TrainingArguments'):
        `use_kernels` (ours, else plain PyTorch), `use_liger_kernel` (liger-kernel's ops, which win over
        `use_kernels`; as `apply_liger_kernel`), `label_smoothing` (transformers' label_smoothing_factor), `z_loss`
        `neftune_noise_alpha` (noise only while `training`), `tiled_mlp` (each MLP over the tokens in tiles of
        hidden_size tokens, recomputed per tile in backward: `MLP.forward`) and `router_aux_loss_coef` (TRL's: see
        the property)."""
        super().__init__()
        self.config = config
        self.model = Backbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()
        self.use_kernels = use_kernels
        if use_liger_kernel:
            apply_liger_kernel(self)
        self.label_smoothing = label_smoothing
        self.z_loss = z_loss
        self.neftune_noise_alpha = neftune_noise_alpha
        self.tiled_mlp = tiled_mlp
        self._router_loss_of_config = (config.output_router_logits, config.router_aux_loss_coef)
        self.router_aux_loss_coef = router_aux_loss_coef
        self.attn_backend = "auto"  # "auto" | "sdpa" | "flex" | "flash" (trainer/model/attention.py)
        self.name_or_path: str | None = None  # the model argument it was built from (as transformers'); peft records it
        self.gradient_checkpointing = False
        self._checkpoint_kwargs: dict = {}
        # called with each decoder block's index before it runs, in this eager loop (never inside a compiled block):
        # ActivationOffloader.on_block (trainer/model/offload.py)
        self.block_hooks: list = []

    @property
    def use_kernels(self) -> bool:
        return self.impl == "kernels"

    @use_kernels.setter
    def use_kernels(self, value: bool) -> None:
        self._set_impl("kernels" if value else "torch")

    @property
    def use_liger_kernel(self) -> bool:
        return self.impl == "liger"

    @property
    def router_aux_loss_coef(self) -> float | None:
        """TRL's `router_aux_loss_coef` as given: a mixture of experts' load-balancing loss added with this weight
        (0: not added); None: as the config says (`output_router_logits`, its coefficient), transformers' rule. It
        sets the config's two keys, as TRL sets them (so the saved config.json says what trained)."""
        return self._router_aux_loss_coef

    @router_aux_loss_coef.setter
    def router_aux_loss_coef(self, value: float | None) -> None:
        if value and not any(self.config.layer_moe):
            raise ModelError(no_router_message(value, self.config.model_type))
        self._router_aux_loss_coef = value
        enabled, coef = self._router_loss_of_config if value is None else (value != 0, value)
        self.config.output_router_logits, self.config.router_aux_loss_coef = enabled, coef
        for layer in self.model.layers:
            layer.router_stats = enabled

    @property
    def tiled_mlp(self) -> bool:
        return any(isinstance(m, MLP) and m.tile_tokens is not None for m in self.modules())

    @tiled_mlp.setter
    def tiled_mlp(self, value: bool) -> None:
        # tiles of hidden_size tokens (Arctic's TiledMLP rule): a tile's intermediate is about one weight's size
        for module in self.modules():
            if isinstance(module, MLP):
                module.tile_tokens = self.config.hidden_size if value else None

    @property
    def fused_lora(self) -> bool:
        """Whether LoRA layers run through `kernels.lora_projections`/`lora_mlp` with use_kernels and peft's expert
        adapters as rank-r GEMMs (the default; trainer/model/fused_lora.py says when they can), or always as peft's
        layers."""
        return all(m.fused_lora for m in self.modules() if isinstance(m, (MLP, Attention, SparseMoeBlock)))

    @fused_lora.setter
    def fused_lora(self, value: bool) -> None:
        for module in self.modules():
            if isinstance(module, (MLP, Attention, SparseMoeBlock)):
                module.fused_lora = bool(value)

    def _set_impl(self, impl: str) -> None:
        self.impl = impl
        for module in self.modules():
            if isinstance(module, (RMSNorm, MLP, Attention, GatedRMSNorm, GatedDeltaNet, CausalConv1d, Experts)):
                module.impl = impl

    def tie_weights(self) -> None:
        """Make lm_head.weight the very Parameter of embed_tokens when the config ties them."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def set_gradient_checkpointing(self, enabled: bool, **kwargs) -> None:
        """Recompute each decoder layer in backward (torch.utils.checkpoint, use_reentrant=False); kwargs go to
        `checkpoint` (e.g. preserve_rng_state=False)."""
        if kwargs.pop("use_reentrant", False):
            raise ModelError("set_gradient_checkpointing: only use_reentrant=False is supported")
        self.gradient_checkpointing = bool(enabled)
        self._checkpoint_kwargs = kwargs

    @torch.no_grad()
    def init_weights(self, seed: int = 0, local_shard=_whole, skip=None) -> None:
        """Hugging Face's init, deterministic from `seed`: N(0, initializer_range) for linear and embedding weights
        (padding row zeroed) and Gated DeltaNet's convolutions, zeros for biases, ones for norms (zeros for the offset
        norms: (1 + weight) = 1), A_log = log U(0.01, 16) and dt_bias 1 as transformers draws them; rotary buffers
        recomputed. `skip(module_name)`: the
        modules a transform owns and initialises itself (build.py passes LoRA's adapter layers), drawn from nothing,
        so the base weights are those of the model without the transform.

        Sharded by FSDP2 (DTensor parameters), pass `local_shard=trainer.dist.local_shard`: every rank draws each
        full weight in the same order from the same generator and keeps only its own rows, so the shards are
        bitwise those of the single-process init, and no more than one full weight exists at a time. (The
        architecture knows nothing of processes: the sharded build, `trainer.build.build_model`, passes it.)"""
        gen = torch.Generator().manual_seed(seed)
        std = self.config.initializer_range

        def put(param, full):  # this process's rows of a full tensor drawn alike everywhere
            local, rows = local_shard(param)
            local.copy_(full if rows is None else full[rows[0] : rows[1]])

        for name, module in self.named_modules():
            if skip is not None and skip(name):
                continue
            if isinstance(module, (nn.Linear, nn.Embedding, CausalConv1d)):
                if module is self.lm_head and self.config.tie_word_embeddings:
                    continue
                # the full shape: a DTensor's is; a 4-bit layer's weight is packed codes (trainer/model/quant.py)
                shape = (
                    (module.out_features, module.in_features) if isinstance(module, nn.Linear) else module.weight.shape
                )
                full = torch.empty(shape).normal_(0.0, std, generator=gen)
                if isinstance(module, nn.Embedding) and module.padding_idx is not None:
                    full[module.padding_idx].zero_()
                put(module.weight, full)
                del full
                if getattr(module, "bias", None) is not None:
                    local_shard(module.bias)[0].zero_()
            elif isinstance(module, RMSNorm):
                local_shard(module.weight)[0].fill_(0.0 if module.offset else 1.0)  # (offset + weight) = 1
            elif isinstance(module, GatedRMSNorm):
                local_shard(module.weight)[0].fill_(1.0)
            elif isinstance(module, (TopKRouter, Experts)):  # every weight N(0, initializer_range), as transformers
                shapes = getattr(module, "full_shapes", {})  # 4-bit experts' parameters are packed codes
                for param_name, param in module.named_parameters(recurse=False):
                    if isinstance(module, Experts) and param_name.endswith("_bias"):  # gpt_oss's: zeros
                        local_shard(param)[0].zero_()
                    else:  # the gpt_oss router's bias N(0, initializer_range) too
                        shape = shapes.get(param_name, param.shape)
                        put(param, torch.empty(shape).normal_(0.0, std, generator=gen))
            elif isinstance(module, Attention) and module.sinks is not None:  # gpt_oss: N(0, initializer_range)
                put(module.sinks, torch.empty(module.sinks.shape).normal_(0.0, std, generator=gen))
            elif isinstance(module, GatedDeltaNet):  # transformers' init: decays A = U(0.01, 16), dt_bias 1
                local_shard(module.dt_bias)[0].fill_(1.0)
                put(module.A_log, torch.empty(module.A_log.shape).uniform_(0.01, 16, generator=gen).log_())
        self.model.rotary_emb.reset_buffers()

    def decode_cache(self, batch: int, length: int) -> KVCache:
        """An empty KV cache for `batch` rows of up to `length` tokens, for `decode_step`."""
        return KVCache.for_model(self, batch, length)

    def decode_step(self, input_ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """fp32 logits (B, V) of the last position after feeding `input_ids` (B, t) into `cache` (advanced by t).
        One method for the backbone and the head, so that a wrapper can gather the root's weights around both
        (FSDP2 does: where it is applied, `trainer.parallel.transforms.apply_fsdp` registers it as a forward method)."""
        hidden = self.hidden_states(input_ids, cache=cache)  # (B, t, C)
        cache.length += input_ids.shape[1]
        return self.lm_head(hidden[:, -1]).float()  # (B, V)

    def prepare_inputs_for_generation(self, *args, **kwargs):
        """transformers' generation hook, which peft's PeftModelForCausalLM takes from the model it wraps; our
        decoding is `trainer.model.causal_lm.generate` (KV cache, `decode_step`), not transformers' `generate`."""
        raise ModelError(
            "generate: use trainer.model.causal_lm.generate(model, input_ids, max_new_tokens), not transformers' "
            "generate"
        )

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        """Unique parameters (a tied head counts once); with exclude_embeddings the input embedding matrix is left
        out, as `transformers`' `num_parameters(exclude_embeddings=True)` does (an untied lm_head stays in)."""
        embed = self.model.embed_tokens.weight
        return sum(p.numel() for p in self.parameters() if not (exclude_embeddings and p is embed))

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token (forward + backward), PaLM appendix B: 6 N + 12 L H_q T, where N counts every
        matmul parameter (all but the embedding lookup, with the LM head counted once even when tied),
        L the softmax-attention layers, H_q = heads * head_dim, T = seq_len. The attention term counts full
        (non-causal) score and value matmuls, as PaLM does. A Gated DeltaNet layer's recurrence adds 18 Hv K V per
        token, whatever T: its three products with the (K, V) state of each value head (read by k, the rank-one
        write, read by q: 6 Hv K V forward) and twice that backward, counted in the recurrent form (the chunked form
        computes the same with more, denser FLOPs). In a Mixture-of-Experts layer N counts the router and the k experts
        a token is routed to, not the other E - k."""
        c = self.config
        n = self.num_parameters(exclude_embeddings=True) + (
            c.vocab_size * c.hidden_size if c.tie_word_embeddings else 0
        )
        if any(c.layer_moe):  # a token runs through k of each MoE layer's E experts: only theirs count
            expert = 3 * c.hidden_size * c.expert_size
            n -= sum(c.layer_moe) * (c.num_experts - c.num_experts_per_tok) * expert
        linear = c.layer_types.count("linear_attention")
        attention = 12 * (c.num_hidden_layers - linear) * c.num_attention_heads * c.head_dim * seq_len
        recurrence = linear and 18 * linear * c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim
        return 6 * n + attention + recurrence

    def hidden_states(
        self, input_ids, position_ids=None, attention_mask=None, cache: KVCache | None = None, router_stats=None
    ):
        """Final-norm hidden states (B, T, C). With `cache`, decode from cache.length on (left padding: cache.pad).
        `router_stats`: a list that receives the MoE layers' load-balancing sums (RouterStats, with
        output_router_logits)."""
        if input_ids.dim() != 2:
            raise ModelError(f"input_ids must be (batch, seq), got shape {tuple(input_ids.shape)}")
        B, T = input_ids.shape
        if position_ids is not None:
            position_ids = position_ids.expand(B, T)  # (1, T) is shared by every row
        elif attention_mask is not None:
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # (B, T) left padding starts at 0
        x = self.model.embed_tokens(input_ids)  # (B, T, C)
        if self.training and self.neftune_noise_alpha:
            x = self._neftune(x, attention_mask, position_ids)
        if cache is not None:
            rope_pos = cache.positions(T, x.device)  # (1, T), or (B, T) with left-padded rows
            attns = [cache.slot(i) for i in range(len(self.model.layers))]
        else:
            # (1, T) unless given per row: cos/sin (1, T, D) are computed once for the batch, and kernels.rope
            # reads them once per position instead of once per (row, position)
            rope_pos = position_ids if position_ids is not None else torch.arange(T, device=x.device)[None]
            plan = make_plan(
                position_ids,
                attention_mask,
                B,
                T,
                x.device,
                x.dtype,
                set(self.config.layer_windows),
                self.attn_backend,
                recurrent="linear_attention" in self.config.layer_types,
                sinks=self.config.attention_sinks,
            )
            attns = [plan] * len(self.model.layers)
        cos, sin = self.model.rotary_emb(rope_pos)  # (B or 1, T, D) fp32
        update = None  # the last MLP output, added to x by the next norm (DecoderLayer.forward)
        for index, (layer, attn) in enumerate(zip(self.model.layers, attns)):
            for hook in self.block_hooks:
                hook(index)
            if self.gradient_checkpointing and torch.is_grad_enabled():
                x, update, layer_stats = checkpoint(
                    layer, x, update, cos, sin, attn, use_reentrant=False, **self._checkpoint_kwargs
                )
            else:
                x, update, layer_stats = layer(x, update, cos, sin, attn)
            if layer_stats is not None and router_stats is not None:
                router_stats.append(layer_stats)
        return add_rms_norm(self.model.norm, x, update)[0]

    def _neftune(self, x, attention_mask, position_ids):
        # NEFTune (Jain et al. 2023): x + U(-1, 1) * alpha / sqrt(L * d), L = the token's own document length
        # (real tokens only), no noise on padding. Off the kernels, kernels' plain-PyTorch reference.
        fn = kernels.neftune_noise if self.impl == "kernels" else kernels.neftune_noise_ref
        return fn(x, self.neftune_noise_alpha, attention_mask=attention_mask, position_ids=position_ids, training=True)

    def forward(
        self,
        input_ids,
        position_ids=None,
        labels=None,
        attention_mask=None,
        num_items=None,
        inputs_embeds=None,
        output_attentions=None,
        output_hidden_states=None,
        return_dict=None,
        sequence_logps: bool = False,
        preference_loss: dict | None = None,
        head=None,
    ) -> CausalLMOutput:
        """Logits, and with `labels` (unshifted, -100 = no target; a tensor or `HostLabels`) the loss sum / num_items
        (default: mean over supervised tokens; 0 when there are none). With labels and use_kernels the logits are
        never formed. With `sequence_logps` (and labels) no loss: each row's sum of its targets' log-probabilities,
        their count and mean logit (`kernels.fused_linear_preference`: preference training's per-sequence numbers,
        computed in here so that wrappers that gather the weights for forward, FSDP2's, hold the LM head's).
        With `preference_loss` (and labels; the options of `kernels.fused_linear_preference_loss`, `ref_logps`
        among them) the rows are [chosen; rejected] pairs and the output holds the preference loss and TRL's
        metrics, the loss's gradient formed in one pass over the answer rows with use_kernels.
        With `head` (no labels), a function of (final-norm hidden states (B, T, C), the LM head's weight) returning
        (loss or None, metrics): what the head computes is the caller's (GRPO's per-token loss and log-probs,
        trainer/methods/grpo.py), run in here so that wrappers that gather the weights for forward hold the head's.
        The last four are transformers' arguments, which peft's PeftModelForCausalLM (task_type="CAUSAL_LM")
        passes as None; another value would be ignored, so it is refused."""
        if inputs_embeds is not None or output_attentions or output_hidden_states or return_dict is False:
            raise ModelError(
                "forward: inputs_embeds, output_attentions, output_hidden_states and return_dict=False "
                "are not supported (pass input_ids; the output always holds loss and logits)"
            )
        stats: list[RouterStats] = []
        out = head_forward(  # the hidden states held by head_forward alone, which frees them early under autocast
            self.lm_head,
            self.hidden_states(input_ids, position_ids, attention_mask, router_stats=stats),  # (B, T, C)
            labels,
            impl=self.impl,
            label_smoothing=self.label_smoothing,
            z_loss=self.z_loss,
            num_items=num_items,
            sequence_logps=sequence_logps,
            preference_loss=preference_loss,
            head=head,
        )
        if stats:
            out.aux_loss = load_balancing_loss(stats)
            if out.loss is not None and labels is not None:
                out.loss = out.loss + self.config.router_aux_loss_coef * out.aux_loss * _window_share(labels, num_items)
        return out


def _window_share(labels, num_items) -> float:
    """This batch's share of its accumulation window, by supervised targets (1 without `num_items`): the weight of its
    load-balancing loss, so that the aux loss is normalised as the main loss is (each batch's summed token losses /
    the window's targets): a window's aux gradient is the target-weighted mean of its batches', whatever the
    accumulation, and under data parallelism (num_items = the window's targets / world_size, gradients averaged) the
    mean over all ranks' batches. transformers adds router_aux_loss_coef x aux to every batch's loss as it is (its
    Trainer does not divide a loss that takes num_items_in_batch by the accumulation steps), so there each batch's
    aux counts once per batch of the window; with one batch per step the two are equal."""
    if num_items is None:
        return 1.0
    labels = labels.labels if isinstance(labels, HostLabels) else labels
    targets = int((labels[:, 1:] != IGNORE_INDEX).sum())  # on the host: the Trainer's labels are
    return targets / num_items


def head_forward(
    lm_head: nn.Linear,
    hidden: torch.Tensor,
    labels,
    *,
    impl: str = "kernels",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    num_items=None,
    sequence_logps: bool = False,
    preference_loss: dict | None = None,
    head=None,
    softcap: float | None = None,
) -> CausalLMOutput:
    """What `CausalLM.forward` computes from the final-norm hidden states (B, T, C) and the LM head (its docstring:
    the logits, the loss, `sequence_logps`, `preference_loss` or `head`), with `impl`'s ops ("kernels", "eager",
    "liger"): shared by our model and the transformers path's models whose logits are `lm_head(hidden)` alone or
    softcapped, `softcap` tanh(lm_head(hidden) / `softcap`) (Gemma 2's final_logit_softcapping: inside our kernels;
    a `head` callable is given it as a keyword)."""
    if isinstance(labels, HostLabels):
        labels = labels.labels
    if head is not None:
        loss, metrics = head(hidden, lm_head.weight, softcap=softcap)
        return CausalLMOutput(loss, None, metrics=metrics)
    if labels is None:
        return CausalLMOutput(None, kernels.softcapped(lm_head(hidden), softcap))
    if labels.shape != hidden.shape[:-1]:
        raise ModelError(
            f"labels shape {tuple(labels.shape)} != input_ids shape {tuple(hidden.shape[:-1])} (labels are unshifted)"
        )
    # (B*T,) position t predicts t+1; on the labels' device (the host for host labels: see takes_host_labels)
    targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX).reshape(-1)
    if preference_loss is not None:
        fn = kernels.fused_linear_preference_loss if impl == "kernels" else kernels.fused_linear_preference_loss_ref
        loss, metrics = fn(
            hidden,
            lm_head.weight,
            targets.view(labels.shape),
            ignore_index=IGNORE_INDEX,
            softcap=softcap,
            **preference_loss,
        )
        return CausalLMOutput(loss, None, metrics=metrics)
    if sequence_logps:
        fn = kernels.fused_linear_preference if impl == "kernels" else kernels.fused_linear_preference_ref
        if impl != "kernels":
            targets = targets.to(hidden.device, non_blocking=True)
        logps = fn(hidden, lm_head.weight, targets.view(labels.shape), ignore_index=IGNORE_INDEX, softcap=softcap)
        return CausalLMOutput(None, None, logps)
    if num_items is None:
        denom = (targets != IGNORE_INDEX).sum().clamp(min=1)
    elif torch.is_tensor(num_items):
        denom = num_items.clamp(min=1)
    else:
        denom = max(int(num_items), 1)
    flat = hidden.reshape(-1, hidden.shape[-1])  # (B*T, C)
    if impl == "kernels":  # takes host targets and counts as they are
        if torch.is_autocast_enabled(flat.device.type):
            # the loss casts to the autocast dtype anyway (the same rounding); done here, the final norm's fp32
            # output dies before the loss runs instead of after (0.067 GB at Llama-3.2-1B's peak, 4 x 2048)
            flat = flat.to(torch.get_autocast_dtype(flat.device.type))
            del hidden
        # Under autocast the kernel casts its inputs to the autocast dtype (as F.linear would) and returns an
        # fp32 loss, so GradScaler's loss * 65536 cannot overflow.
        loss = kernels.fused_linear_cross_entropy(
            flat,
            lm_head.weight,
            targets,
            ignore_index=IGNORE_INDEX,
            label_smoothing=label_smoothing,
            z_loss=z_loss,
            num_items=denom,
            softcap=softcap,
        )
        return CausalLMOutput(loss, None)
    targets = targets.to(hidden.device, non_blocking=True)
    if torch.is_tensor(denom):
        denom = denom.to(hidden.device, non_blocking=True)
    if impl == "liger":
        if softcap is not None:
            raise ModelError("liger-kernel's head is not given a softcap here: use_liger_kernel with a softcapped head")
        from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

        total = LigerFusedLinearCrossEntropyFunction.apply(
            flat, lm_head.weight, targets, None, None, IGNORE_INDEX, z_loss, label_smoothing, "sum"
        )[0]
        return CausalLMOutput(total / denom, None)
    logits = kernels.softcapped(lm_head(hidden), softcap)  # (B, T, V)
    flat_logits = logits.reshape(-1, logits.shape[-1]).float()  # (B*T, V)
    total = F.cross_entropy(
        flat_logits, targets, ignore_index=IGNORE_INDEX, reduction="sum", label_smoothing=label_smoothing
    )
    if z_loss:
        lse = torch.logsumexp(flat_logits, dim=-1)  # (B*T,)
        total = total + z_loss * (lse.square() * (targets != IGNORE_INDEX)).sum()
    return CausalLMOutput(total / denom, logits)


def apply_liger_kernel(model: CausalLM) -> CausalLM:
    """Run RMSNorm, RoPE, SwiGLU and the fused linear cross-entropy with liger-kernel (the baseline on a GPU);
    `model.use_kernels = ...` switches back. Liger's Triton kernels need CUDA tensors."""
    try:
        import liger_kernel  # noqa: F401
    except ImportError:
        raise ModelError("use_liger_kernel: liger-kernel is not installed (pip install liger-kernel)") from None
    model._set_impl("liger")
    return model


# ------------------------------------------------------------------------------------------------------------
# Decoding
# ------------------------------------------------------------------------------------------------------------
@torch.no_grad()
def generate(
    model: CausalLM,
    input_ids,
    max_new_tokens: int,
    *,
    eos_token_id=None,
    temperature: float = 0.0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
):
    """Greedy (temperature 0) or nucleus-sampled decoding with a KV cache.

    input_ids: a list of ints or a 1-D tensor -> the list of new tokens (eos included when hit); or a
    (B, T) tensor of equal-length, unpadded prompts -> (B, T + n) prompt + new tokens, as transformers'
    `generate` returns (rows that finished early are continued with eos). Stops after max_new_tokens or when
    every row has produced eos (`eos_token_id`: an int or a list of ints). Any model with `decode_cache` and
    `decode_step` decodes here: ours, and the transformers path's (trainer/model/transformers_model.py, transformers'
    own KV cache behind the same two methods), so a seeded generator gives the same tokens on both.
    """
    device = next(model.parameters()).device
    as_list = not torch.is_tensor(input_ids) or input_ids.dim() == 1
    ids = torch.as_tensor(input_ids, dtype=torch.long, device=device)
    ids = ids.view(1, -1) if as_list else ids
    if ids.dim() != 2 or ids.shape[1] == 0:
        raise ModelError(
            f"generate: input_ids must be a non-empty list, 1-D or (batch, seq) tensor, got shape {tuple(ids.shape)}"
        )
    if temperature < 0 or not 0 < top_p <= 1:
        raise ModelError(f"generate: temperature must be >= 0 and top_p in (0, 1], got {temperature}, {top_p}")
    eos = (
        None
        if eos_token_id is None
        else torch.tensor([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id), device=device)
    )
    B, T = ids.shape
    cache = model.decode_cache(B, T + max_new_tokens)
    was_training = model.training
    model.eval()
    try:
        step_input, new, done = ids, [], torch.zeros(B, dtype=torch.bool, device=device)
        for _ in range(max_new_tokens):
            logits = model.decode_step(step_input, cache)  # (B, V)
            token = _pick(logits, temperature, top_p, generator)  # (B,)
            if eos is not None:
                token = torch.where(done, eos[0], token)
                done = done | torch.isin(token, eos)
            new.append(token)
            if eos is not None and bool(done.all()):
                break
            step_input = token[:, None]  # (B, 1)
    finally:
        model.train(was_training)
    out = torch.stack(new, dim=1) if new else ids.new_zeros(B, 0)  # (B, n)
    return out[0].tolist() if as_list else torch.cat([ids, out], dim=1)


def _pick(logits: torch.Tensor, temperature: float, top_p: float, generator) -> torch.Tensor:
    if temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits / temperature, dim=-1)  # (B, V)
    if top_p < 1:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the first token always)
        keep = (sorted_probs.cumsum(-1) - sorted_probs) < top_p
        sorted_probs = sorted_probs * keep
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
