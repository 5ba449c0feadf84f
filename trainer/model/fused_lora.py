"""When the decoder's LoRA layers run fused: peft's adapter layers read as `kernels.LoRAProjection`s, for
`kernels.lora_projections` (q/k/v, and o_proj alone) and `kernels.lora_mlp` (gate/up/down around SwiGLU).

With `use_kernels` and a LoRA adapter, `Attention` and `MLP` ask `find(x, layers)` at each call and take the fused op
when it answers: the layers of one input that peft adapted are its LoRA layers with the one adapter active and
unmerged (plain LoRA: no DoRA or other variant, no adapter bias) over a plain `nn.Linear` or our 4-bit `Linear4bit`;
the layers it did not adapt (q/v targets leave k) join as their frozen base alone; nothing hooked (DeepSpeed ZeRO-3
hooks every module to gather its weights: it keeps peft's layers), the bases frozen, the dtypes those the op
reproduces (below), grad enabled and not under torch.compile. Otherwise (evaluation, DPO's reference with the adapter
disabled, a merged adapter, compiled blocks) peft's layers run as they are: the values and gradients are the same
either way, bit for bit (tests/trainer/model/test_fused_lora.py: fp32, bf16, autocast, 4-bit, dropout); only what
backward keeps differs (kernels/lora.py).

Dtypes, as peft's layers compute them: matmuls in the autocast dtype when autocast is on, else in the input's dtype
(then the base weight and adapter must be in it too); peft's Linear casts the adapter's input to lora_A's dtype, its
bitsandbytes layer casts it only without CUDA's autocast (it asks `torch.is_autocast_enabled()`); our Linear4bit
returns its input's dtype, and its compute dtype must be the matmul dtype (or fp32 under autocast, which autocast
then casts as it would).

The MoE experts (`find_experts`): peft's `target_parameters` wraps our `Experts` in one ParamWrapper per adapted
tensor (nested: `mlp.experts.base_layer...`), which forms each tensor's whole (E, out, in) delta every forward and
adds it to the weight. Under the same conditions (one active, unmerged, plain adapter; nothing hooked) the experts
run instead with the factors themselves (`kernels.moe.ExpertLoRA`): rank-r GEMMs on the routed rows, the delta never
formed, with or without use_kernels (the reference adds x A_e^T B_e^T per expert). Values and gradients equal
peft's to rounding (only the order of the sums differs: tests/trainer/model/test_moe_model.py).

`CausalLM.fused_lora = False` keeps peft's layers everywhere (the benchmark and the tests compare the two).
"""

from __future__ import annotations

import dataclasses
import sys

import torch
from torch import nn

from kernels.lora import LoRAProjection
from kernels.moe import ExpertLoRA

ADAPTER = "default"  # peft's name for the one adapter a model carries (trainer/model/lora.py imports it from here)


def _hooked(m: nn.Module) -> bool:
    return any((m._forward_hooks, m._forward_pre_hooks, m._backward_hooks, m._backward_pre_hooks))


def _projection(layer: nn.Module, dtype: torch.dtype, autocast: bool):
    """(LoRAProjection, dropout, lora_dtype) for one of peft's LoRA layers, or for a frozen linear layer peft did not
    target (its base alone: no adapter, dropout and lora_dtype None); None when it cannot run fused."""
    if not hasattr(layer, "lora_A"):
        base = _base(layer, dtype, autocast)
        return None if base is None else (base, None, None)
    base_layer = getattr(layer, "base_layer", None)
    if base_layer is None or not _plain_adapter(layer):
        return None
    A, B, dropout = layer.lora_A[ADAPTER], layer.lora_B[ADAPTER], layer.lora_dropout[ADAPTER]
    if type(dropout) not in (nn.Dropout, nn.Identity):
        return None
    base = _base(base_layer, dtype, autocast)
    if base is None or (not autocast and (A.weight.dtype != dtype or B.weight.dtype != dtype)):
        return None
    if base.dequantize is None:  # peft's Linear casts the adapter's input to lora_A's dtype
        lora_dtype = A.weight.dtype if getattr(layer, "cast_input_dtype_enabled", True) else None
    else:  # its bitsandbytes layer, unless torch.is_autocast_enabled(), which asks about CUDA's autocast only
        lora_dtype = None if torch.is_autocast_enabled("cuda") else A.weight.dtype
    p = dropout.p if isinstance(dropout, nn.Dropout) and dropout.training else 0.0
    projection = dataclasses.replace(base, lora_A=A.weight, lora_B=B.weight, scaling=layer.scaling[ADAPTER])
    return projection, p, lora_dtype


def _base(layer: nn.Module, dtype: torch.dtype, autocast: bool) -> LoRAProjection | None:
    """A plain nn.Linear or our 4-bit Linear4bit as a LoRAProjection without adapter, or None when it cannot run fused:
    hooked, not frozen, partitioned by DeepSpeed, or in dtypes the op does not reproduce (module docstring)."""
    quant = sys.modules.get("trainer.model.quant")  # imported (bitsandbytes) only where 4-bit layers exist
    if type(layer) is not nn.Linear and (quant is None or type(layer) is not quant.Linear4bit):
        return None  # another layer (a benchmark's stand-in, another library's): peft's layers run it as it is
    weight, bias = layer.weight, layer.bias
    if _hooked(layer) or weight.requires_grad or (bias is not None and bias.requires_grad) or hasattr(weight, "ds_id"):
        return None
    if type(layer) is nn.Linear:
        if not autocast and (weight.dtype != dtype or (bias is not None and bias.dtype != dtype)):
            return None
        return LoRAProjection(weight, None, None, bias=bias)
    if layer.compute_dtype not in ((dtype, torch.float32) if autocast else (dtype,)):  # our Linear4bit
        return None
    return LoRAProjection(
        weight, None, None, bias=bias, dequantize=layer.dequantize_weight, base_returns_input_dtype=True
    )


def find(x: torch.Tensor, layers):
    """(projections, dropout, lora_dtype) for `kernels.lora_projections`/`lora_mlp` over `layers` applied to `x`: the
    LoRA layers among them with their adapters, the others (frozen, not targeted by peft) as their base alone; None
    when they must run as they are (one of them cannot run fused, none has an adapter, no grad, compiling)."""
    if not torch.is_grad_enabled() or torch.compiler.is_compiling():
        return None
    kind = x.device.type
    autocast = torch.is_autocast_enabled(kind)
    dtype = torch.get_autocast_dtype(kind) if autocast else x.dtype
    found = [_projection(layer, dtype, autocast) for layer in layers]
    adapted = {(p, lora_dtype) for projection, p, lora_dtype in filter(None, found) if projection.lora_A is not None}
    if None in found or len(adapted) != 1:
        return None  # one adapter config gives every layer the same dropout and dtype; anything else runs as it is
    (dropout, lora_dtype) = adapted.pop()
    return [projection for projection, _, _ in found], dropout, lora_dtype


def _plain_adapter(layer: nn.Module) -> bool:
    """One of peft's LoRA layers with our one adapter active and unmerged, plain (no DoRA, variant or adapter bias),
    nothing hooked: what the fused paths reproduce."""
    lora_A, lora_B = layer.lora_A, layer.lora_B
    if ADAPTER not in lora_A or list(layer.active_adapters) != [ADAPTER]:
        return False
    if layer.disable_adapters or layer.merged or ADAPTER in getattr(layer, "lora_variant", {}):
        return False
    if layer.use_dora.get(ADAPTER) or getattr(layer, "lora_bias", {}).get(ADAPTER):
        return False
    dropout = layer.lora_dropout[ADAPTER]
    return not any(_hooked(m) for m in (layer, lora_A[ADAPTER], lora_B[ADAPTER], dropout))


def find_experts(module: nn.Module, experts_type: type):
    """(our Experts module, {parameter name: ExpertLoRA}) when `module` is peft's ParamWrapper chain around an
    `experts_type` module that can run with the factors (module docstring); (module, {}) for a bare Experts; None
    when peft's wrappers must run as they are (hooked, merged, disabled, another adapter, a variant)."""
    loras = {}
    while not isinstance(module, experts_type):
        name = getattr(module, "parameter_name", None)
        if name is None or not _plain_adapter(module) or type(module.lora_dropout[ADAPTER]) is not nn.Identity:
            return None
        weights = module.lora_A[ADAPTER].weight, module.lora_B[ADAPTER].weight
        loras[name] = ExpertLoRA(*weights, module.scaling[ADAPTER])
        module = module.base_layer
    return None if _hooked(module) else (module, loras)
