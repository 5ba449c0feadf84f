"""kernels: fused Triton kernels for LLM training, each with a plain-PyTorch reference beside it.

Importable on its own (it never imports `trainer`). Dispatch, the same for every op: CUDA tensors run
Triton, CPU tensors run the reference unless Triton is forced (see `kernels._dispatch`).

Note: the functions below shadow their modules as package attributes (`kernels.rms_norm` is the function);
reach a module with `from kernels.rms_norm import ...` or `importlib.import_module("kernels.rms_norm")`.
"""

# first: importing _names checks that no other `kernels` or `trainer` package shares our names (one line if one does)
from . import _names  # noqa: F401
from ._dispatch import HAS_TRITON, backend, current_backend, use_triton
from .adamw import FusedAdamW, adamw_step_ref
from .causal_conv1d import causal_conv1d, causal_conv1d_ref
from .cross_entropy import cross_entropy, cross_entropy_ref, softcapped
from .dequantize_4bit import NestedAbsmax, dequantize_4bit, dequantize_4bit_ref
from .fused_linear_cross_entropy import fused_linear_cross_entropy, fused_linear_cross_entropy_ref
from .fused_linear_logprob import TokenLogprobs, fused_linear_logprob, fused_linear_logprob_ref
from .fused_linear_logprob_loss import fused_linear_logprob_loss, fused_linear_logprob_loss_ref
from .fused_linear_preference import (
    PreferenceLogps,
    fused_linear_preference,
    fused_linear_preference_ref,
    preference_loss,
)
from .fused_linear_preference_loss import fused_linear_preference_loss, fused_linear_preference_loss_ref
from .gated_delta_rule import chunk_gated_delta_rule, chunk_gated_delta_rule_ref, gated_delta_rule_ref
from .gated_rms_norm import gated_rms_norm, gated_rms_norm_ref
from .geglu import geglu, geglu_linear, geglu_linear_ref, geglu_ref
from .lora import LoRAProjection, lora_mlp, lora_mlp_ref, lora_projections, lora_projections_ref
from .moe import moe_experts, moe_experts_ref
from .neftune import NEFTuneFunction, neftune_noise, neftune_noise_ref
from .rms_norm import fused_add_rms_norm, fused_add_rms_norm_ref, rms_norm, rms_norm_ref
from .rope import rope, rope_ref
from .swiglu import swiglu, swiglu_linear, swiglu_linear_ref, swiglu_ref

__all__ = ["HAS_TRITON", "backend", "current_backend", "use_triton"]
__all__ += ["NEFTuneFunction", "neftune_noise", "neftune_noise_ref"]
__all__ += ["rms_norm", "rms_norm_ref", "fused_add_rms_norm", "fused_add_rms_norm_ref"]
__all__ += ["rope", "rope_ref"]
__all__ += ["swiglu", "swiglu_ref", "swiglu_linear", "swiglu_linear_ref"]
__all__ += ["geglu", "geglu_ref", "geglu_linear", "geglu_linear_ref"]
__all__ += ["FusedAdamW", "adamw_step_ref"]
__all__ += ["cross_entropy", "cross_entropy_ref", "fused_linear_cross_entropy", "fused_linear_cross_entropy_ref"]
__all__ += ["softcapped"]
__all__ += ["PreferenceLogps", "fused_linear_preference", "fused_linear_preference_ref", "preference_loss"]
__all__ += ["fused_linear_preference_loss", "fused_linear_preference_loss_ref"]
__all__ += ["TokenLogprobs", "fused_linear_logprob", "fused_linear_logprob_ref"]
__all__ += ["fused_linear_logprob_loss", "fused_linear_logprob_loss_ref"]
__all__ += ["NestedAbsmax", "dequantize_4bit", "dequantize_4bit_ref"]
__all__ += ["gated_delta_rule_ref", "chunk_gated_delta_rule_ref", "causal_conv1d_ref"]
__all__ += ["gated_rms_norm", "gated_rms_norm_ref", "causal_conv1d", "chunk_gated_delta_rule"]
__all__ += ["LoRAProjection", "lora_projections", "lora_projections_ref", "lora_mlp", "lora_mlp_ref"]
__all__ += ["moe_experts", "moe_experts_ref"]
