"""Our kernels inside a model we did not write (the transformers path, trainer/model/transformers_model.py): a registry
of swaps, each matching modules by structure (their parameters, children and forward's signature), proving on the
module itself (an fp32 copy, random weights and inputs, rtol 1e-5) that our kernel computes what it computes, and
only then rebinding it on the instance. A module that matches no swap, or fails its proof, stays as it is and is
named in the run's first line (`TransformersModel.kernel_report`).

The registry (`SWAPS`, in the order the report lists them):
- RMSNorm (`swap_norms`): one 1-D `weight`, an epsilon, a forward of the rows alone; `kernels.rms_norm` with offset 0
  (Llama's `weight * x`, OLMo 2's) or 1 (Gemma's `(1 + weight) * x`). A call whose input and weight dtypes differ
  (bf16 activations over fp32 master weights under autocast) runs ours where a second probe shows the module keeps
  the input's dtype with fp32 math there (Gemma's norms, as our kernel does), else the module's own forward (Llama's
  promotes to the weight's dtype).
- SwiGLU and GeGLU (`swap_mlps`): `gate_proj`/`up_proj`/`down_proj`, or a fused `gate_up_proj` (gate first) and
  `down_proj`, linear layers without biases; `down(act(gate(x)) * up(x))` for act silu or the tanh GELU through
  `causal_lm.swiglu_down` (the projections called as modules, so LoRA and 4-bit layers put there later run as
  themselves).
- RoPE (`swap_rope`): attention modules whose forward calls their modeling module's `apply_rotary_pos_emb`, where
  that function is proven to be the half-split rotation (full or partial rotary: the first rotary_dim channels) for
  the module's head_dim: `kernels.rope`. The function is module-level in transformers' code, so it is replaced once
  per modeling module by a dispatcher that runs ours only inside our models' attention modules (hooks count them in
  and out, activation checkpointing's recompute included) and transformers' own everywhere else.
- The fused residual add + RMSNorm (`swap_residual_norms`): a decoder layer with `self_attn`, `mlp` and the
  `input_layernorm` / `post_attention_layernorm` that `swap_norms` proved, whose forward is proven, on its own call
  in a forward of the model, to be the pre-norm block x + attn(norm1(x)) -> h, h + mlp(norm2(h)): the middle add
  and norm in one pass (`kernels.fused_add_rms_norm`). Gemma 2/3's sandwich norms and OLMo 2's post-norms compute
  otherwise and keep their forward. Training and evaluation forwards only: a call with a KV cache runs the layer's.
A new swap goes here: a structural match, a proof, a kernel forward, a label, and a test that the swapped module
computes what it computed (tests/trainer/model/test_transformers_path.py).
"""

from __future__ import annotations

import copy
import functools
import inspect
import sys
import threading
import types

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

import kernels
from trainer.model.causal_lm import ModelError, over_token_tiles, swiglu_down

NORM_EPS_NAMES = ("variance_epsilon", "eps", "epsilon")
NORM_PROBE_ROWS = 4
PROBE_TOKENS = 8  # the tokens of the forward whose layer calls the fused residual add + norm is proven on


def _takes_rows_only(module: nn.Module) -> bool:
    """Whether the module's forward takes one argument (the rows): a gated norm's `gate` or an MLP's extra inputs
    would reach our kernel, which computes without them."""
    params = list(inspect.signature(type(module).forward).parameters.values())[1:]  # past self
    return len(params) == 1 and params[0].kind in (params[0].POSITIONAL_ONLY, params[0].POSITIONAL_OR_KEYWORD)


def _norm_eps(module: nn.Module) -> float | None:
    """The epsilon of a module shaped like an RMSNorm (exactly one parameter, a 1-D `weight`, a forward of the rows
    alone), else None."""
    params = dict(module.named_parameters(recurse=False))
    if list(params) != ["weight"] or params["weight"].dim() != 1 or list(module.children()):
        return None
    if not _takes_rows_only(module):
        return None
    return next((getattr(module, n) for n in NORM_EPS_NAMES if isinstance(getattr(module, n, None), float)), None)


@torch.no_grad()
def norm_offset(module: nn.Module, eps: float) -> float | None:
    """0.0 or 1.0: the offset with which `kernels.rms_norm` computes what `module` computes (probed on an fp32 copy,
    random rows, a random weight, rtol 1e-5), or None when neither does."""
    probe = copy.deepcopy(module).float().cpu()
    g = torch.Generator().manual_seed(0)
    probe.weight.copy_(torch.randn(probe.weight.shape, generator=g) * 0.5)
    x = torch.randn(NORM_PROBE_ROWS, probe.weight.numel(), generator=g) * 3.0
    try:
        out = probe(x)
    except Exception:  # a forward that takes more than the rows (a gated norm's gate): not ours
        return None
    if not torch.is_tensor(out) or out.shape != x.shape:
        return None
    for offset in (0.0, 1.0):
        ours = kernels.rms_norm_ref(x, probe.weight, eps, offset)
        if torch.allclose(out.float(), ours, rtol=1e-5, atol=1e-6):
            return offset
    return None


@torch.no_grad()
def norm_keeps_input_dtype(module: nn.Module, eps: float, offset: float) -> bool:
    """Whether `module`, given bf16 rows and an fp32 weight (bf16 autocast over fp32 master weights), returns what
    `kernels.rms_norm` returns there: bf16 rows from fp32 math (Gemma's norms cast back to the input's dtype), to one
    bf16 rounding; False for a norm that promotes to the weight's dtype (Llama's `weight * x.to(input_dtype)`)."""
    probe = copy.deepcopy(module).float().cpu()
    g = torch.Generator().manual_seed(1)
    probe.weight.copy_(torch.randn(probe.weight.shape, generator=g) * 0.5)
    x = (torch.randn(NORM_PROBE_ROWS, probe.weight.numel(), generator=g) * 3.0).bfloat16()
    try:
        out = probe(x)
    except Exception:
        return False
    ours = kernels.rms_norm_ref(x, probe.weight, eps, offset)  # (rows, C) bf16
    return out.dtype == ours.dtype and torch.allclose(out.float(), ours.float(), rtol=2**-7, atol=1e-6)


def _kernel_norm_forward(self, x):
    if x.dtype != self.weight.dtype and not self.kernel_mixed:  # transformers would promote: its own forward does
        return type(self).forward(self, x)
    return kernels.rms_norm(x, self.weight, self.kernel_eps, self.kernel_offset)


def model_class(module: nn.Module) -> type:
    """The module's class as its modeling code defines it: FSDP2's `fully_shard` puts a subclass (FSDP<Name>) in its
    place on the units it shards (a twin's decoder layers, say)."""
    cls = type(module)
    return cls.__bases__[-1] if issubclass(cls, FSDPModule) else cls


def _swap(
    model: nn.Module, settings, prove, forward, left_when, label, twin: nn.Module | None
) -> tuple[dict[str, int], set[str]]:
    """Rebind `forward` on every module whose class, with `settings(module)` (None: not a candidate), `prove` passes
    (once per class and settings: a dict of attributes the kernel forward reads, or None); weights untouched. With a
    `twin` (`swap_kernels`, already swapped itself), the verdict is what its swaps proved on its module of that class
    and settings (none: left as it is). ({label(class name,
    attributes): count}, the names of classes left as they are: failed candidates, and others `left_when(name)`
    picks)."""
    swapped: dict[str, int] = {}
    verdicts: dict[tuple, dict | None] = {}
    left: set[str] = set()
    stand_ins = _stand_ins(twin, settings)
    for module in model.modules():
        cls = model_class(module)
        key = settings(module)
        if key is None:
            if left_when(cls.__name__):
                left.add(cls.__name__)
            continue
        if (cls, key) not in verdicts:
            # with a twin: what its own swaps proved on its module of this class and settings (`kernel_swap`)
            verdicts[cls, key] = (
                prove(module, key) if twin is None else getattr(stand_ins(module, key), "kernel_swap", None)
            )
        attrs = verdicts[cls, key]
        name = cls.__name__
        if attrs is None:
            left.add(name)
            continue
        for attr, value in attrs.items():
            setattr(module, attr, value)
        module.kernel_swap = attrs  # what was proven, for a model this one is the twin of
        module.forward = types.MethodType(forward, module)
        key = label(name, attrs)
        swapped[key] = swapped.get(key, 0) + 1
    return swapped, left


def _stand_ins(twin: nn.Module | None, settings):
    """(module, key) -> the twin's module of module's class and settings, whose proof stands for it; a ModelError
    where the twin has none (nothing proves the module then)."""
    found = {}
    for module in () if twin is None else twin.modules():
        key = settings(module)
        if key is not None:
            found.setdefault((model_class(module), key), module)

    def stand_in(module, key):
        cls = model_class(module)
        if (cls, key) not in found:
            raise ModelError(
                f"{cls.__name__} ({key!r}): the twin {type(twin).__name__} has none of its class and settings, so no "
                "probe proves it"
            )
        return found[cls, key]

    return stand_in


def swap_norms(model: nn.Module, twin: nn.Module | None = None) -> tuple[dict[str, int], set[str]]:
    """Point every RMSNorm that `norm_offset` proves at `kernels.rms_norm` (its forward rebound on the instance, its
    weight untouched): ({"RMSNorm: ClassName, offset 1": count}, the names of norm-like classes left as they are)."""

    def prove(module, eps):
        offset = norm_offset(module, eps)
        if offset is None:
            return None
        mixed = norm_keeps_input_dtype(module, eps, offset)
        return {"kernel_eps": eps, "kernel_offset": offset, "kernel_mixed": mixed}

    def label(name, attrs):
        return f"RMSNorm: {name}" + (", offset 1" if attrs["kernel_offset"] else "")

    return _swap(model, _norm_eps, prove, _kernel_norm_forward, lambda name: "Norm" in name, label, twin)


MLP_LIKE = ("MLP", "Mlp", "Experts", "MoeBlock", "MoE", "Moe")  # class-name endings named in the report when left
GATED_NAMES = {"silu": "SwiGLU", "gelu_tanh": "GeGLU"}  # causal_lm.GATED_MLPS' activations, as the report names them


def _no_bias_linear(module: nn.Module | None) -> bool:
    return isinstance(module, nn.Linear) and module.bias is None


def _gated_layout(module: nn.Module) -> str | None:
    """ "split" (gate_proj, up_proj and down_proj: Llama's and Gemma's layout) or "fused" (gate_up_proj, whose output's
    first half is the gate, and down_proj: Phi-3/4's, GLM-4's), each a linear layer without bias, and a forward of
    the rows alone; else None."""
    if not _takes_rows_only(module) or not _no_bias_linear(getattr(module, "down_proj", None)):
        return None
    if all(_no_bias_linear(getattr(module, n, None)) for n in ("gate_proj", "up_proj")):
        return "split"
    gate_up = getattr(module, "gate_up_proj", None)
    if _no_bias_linear(gate_up) and gate_up.out_features % 2 == 0:
        return "fused"
    return None


def _gate_up(module: nn.Module, layout: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The MLP's gate and up projections of x (the fused layout's halves are views of one output)."""
    if layout == "split":
        return module.gate_proj(x), module.up_proj(x)
    gate, up = module.gate_up_proj(x).chunk(2, dim=-1)
    return gate, up


@torch.no_grad()
def gated_mlp_act(module: nn.Module, layout: str | None = None) -> str | None:
    """The activation ("silu": SwiGLU, "gelu_tanh": GeGLU) with which `module` computes down(act(gate(x)) * up(x)) in
    its layout, probed on an fp32 copy with random weights and rows (rtol 1e-5), or None when neither does."""
    layout = layout or _gated_layout(module)
    if layout is None:
        return None
    probe = copy.deepcopy(module).float().cpu()
    g = torch.Generator().manual_seed(0)
    for p in probe.parameters():
        p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    x = torch.randn(NORM_PROBE_ROWS, probe.down_proj.out_features, generator=g)
    try:
        out = probe(x)
    except Exception:  # a forward that takes more than the rows: not ours
        return None
    if not torch.is_tensor(out):
        return None
    gate, up = _gate_up(probe, layout, x)
    refs = {"silu": kernels.swiglu_linear_ref, "gelu_tanh": kernels.geglu_linear_ref}
    for act, ref in refs.items():
        expected = ref(gate, up, probe.down_proj.weight)
        if out.shape == expected.shape and torch.allclose(out, expected, rtol=1e-5, atol=1e-6):
            return act
    return None


def _kernel_mlp_forward(self, x):
    """Our gated MLP, over the tokens in tiles of `tile_tokens` when the tiled MLP set it (`over_token_tiles`)."""
    return over_token_tiles(functools.partial(_gated_mlp, self), x, self.tile_tokens)


def _gated_mlp(module, x):
    gate, up = _gate_up(module, module.kernel_layout, x)
    return swiglu_down(module.down_proj, gate, up, module.kernel_act)


def swap_mlps(model: nn.Module, twin: nn.Module | None = None) -> tuple[dict[str, int], set[str]]:
    """Point every gated MLP that `gated_mlp_act` proves at our SwiGLU or GeGLU (`swiglu_down`: forward rebound on
    the instance, the projections called as modules, so a LoRA or 4-bit layer put there later runs as itself; the
    fused layout's gate and up halves are copied contiguous for the kernels): ({"SwiGLU: ClassName": count}, the names
    of MLP-like classes left as they are)."""

    def prove(module, layout):
        act = gated_mlp_act(module, layout)
        return None if act is None else {"kernel_act": act, "kernel_layout": layout, "tile_tokens": None}

    def label(name, attrs):
        fused = ", fused gate_up" if attrs["kernel_layout"] == "fused" else ""
        return f"{GATED_NAMES[attrs['kernel_act']]}: {name}{fused}"

    return _swap(model, _gated_layout, prove, _kernel_mlp_forward, lambda name: name.endswith(MLP_LIKE), label, twin)


ROPE_FUNCTION = "apply_rotary_pos_emb"  # the name transformers' modeling modules give their rotation
_IN_OUR_ATTENTION = threading.local()  # .depth: our attention modules running on this thread (forward or recompute)


def _rope_ours(q, k, cos, sin):
    """transformers' half-split rotation of the first cos.shape[-1] channels of q (B, Hq, T, D) and k (B, Hkv, T, D),
    the rest passed through (partial rotary: Phi-4-mini 0.75, Qwen3.5 0.25), with `kernels.rope`."""
    r = cos.shape[-1]
    if r == q.shape[-1]:
        return kernels.rope(q, k, cos, sin)
    q_rot, k_rot = kernels.rope(q[..., :r], k[..., :r], cos, sin)
    return torch.cat([q_rot, q[..., r:]], dim=-1), torch.cat([k_rot, k[..., r:]], dim=-1)


@torch.no_grad()
def rope_matches(function, head_dim: int, rotary_dim: int) -> bool:
    """Whether transformers' `function(q, k, cos, sin)` computes `_rope_ours` for heads of head_dim channels of which
    the first rotary_dim rotate: probed in fp32 with random q, k and random cos and sin rows (not the rotary
    module's cat(f, f) ones: a function that reads half of them, or interleaves them as GLM-4's does, fails)."""
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        return False
    g = torch.Generator().manual_seed(0)
    cpu = dict(generator=g, device="cpu")  # whatever device context the caller is in (a model built on meta)
    q, k = torch.randn(2, 3, 5, head_dim, **cpu), torch.randn(2, 1, 5, head_dim, **cpu)
    cos, sin = torch.rand(2, 5, rotary_dim, **cpu) * 2 - 1, torch.rand(2, 5, rotary_dim, **cpu) * 2 - 1
    try:
        theirs = function(q, k, cos, sin)
    except Exception:
        return False
    ours = kernels.rope_ref(q[..., :rotary_dim], k[..., :rotary_dim], cos, sin)
    ours = (torch.cat([ours[0], q[..., rotary_dim:]], -1), torch.cat([ours[1], k[..., rotary_dim:]], -1))
    return all(
        torch.is_tensor(t) and t.shape == o.shape and torch.allclose(t, o, rtol=1e-5, atol=1e-6)
        for t, o in zip(theirs, ours)
    )


def _rope_dispatcher(original):
    """What a modeling module's `apply_rotary_pos_emb` becomes (once per module, for the process): ours for a call
    made inside one of our attention modules (a forward pre-hook counts them in, a forward hook out, so activation
    checkpointing's recompute is inside too) with the plain (q, k, cos, sin) arguments and a proven
    (head_dim, rotary_dim); transformers' own function for every other call (another model of the same type built
    without our kernels, say)."""

    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        if (
            getattr(_IN_OUR_ATTENTION, "depth", 0)
            and not args
            and not kwargs
            and q.shape[-1] == k.shape[-1]
            and (q.shape[-1], cos.shape[-1]) in apply_rotary_pos_emb.proven
        ):
            return _rope_ours(q, k, cos, sin)
        return original(q, k, cos, sin, *args, **kwargs)

    apply_rotary_pos_emb.original = original
    apply_rotary_pos_emb.proven = set()
    return apply_rotary_pos_emb


def _enter_our_attention(module, args):
    _IN_OUR_ATTENTION.depth = getattr(_IN_OUR_ATTENTION, "depth", 0) + 1


def _leave_our_attention(module, args, output):
    _IN_OUR_ATTENTION.depth -= 1


def _rotary_dim(model: nn.Module, head_dim: int) -> int:
    """The rotated channels: twice the rotary embedding's inv_freq length (partial rotary), else head_dim."""
    for module in model.modules():
        inv_freq = getattr(module, "inv_freq", None)
        if torch.is_tensor(inv_freq) and inv_freq.dim() == 1:
            return 2 * inv_freq.numel()
    return head_dim


def swap_rope(model: nn.Module, twin: nn.Module | None = None) -> tuple[dict[str, int], set[str]]:
    """Our RoPE in every attention module whose forward calls its modeling module's `apply_rotary_pos_emb`, where
    `rope_matches` proves that function for the module's head_dim and the model's rotary dim (the half-split layout,
    full or partial): the module-level function is replaced once by `_rope_dispatcher` and the module counted in
    while it runs. ({"RoPE: ClassName": count}, "rotary embedding (ClassName)" for the attention classes left). The
    proof needs no weights (random tensors through the modeling module's function): `twin` is not needed."""
    swapped: dict[str, int] = {}
    left: set[str] = set()
    verdicts: dict[tuple, bool] = {}
    for module in model.modules():
        cls = type(module)
        modeling = sys.modules.get(cls.__module__)
        function = getattr(modeling, ROPE_FUNCTION, None)
        forward = inspect.unwrap(cls.forward)
        if (
            function is None
            or ROPE_FUNCTION not in getattr(forward, "__code__", types.SimpleNamespace(co_names=())).co_names
        ):
            continue
        head_dim = getattr(module, "head_dim", None)
        if not isinstance(head_dim, int):
            left.add(f"rotary embedding ({cls.__name__})")
            continue
        shape = (head_dim, _rotary_dim(model, head_dim))
        original = getattr(function, "original", function)
        key = (original, shape)
        if key not in verdicts:
            verdicts[key] = rope_matches(original, *shape)
        if not verdicts[key]:
            left.add(f"rotary embedding ({cls.__name__})")
            continue
        if getattr(function, "original", None) is None:
            function = _rope_dispatcher(function)
            setattr(modeling, ROPE_FUNCTION, function)
        function.proven.add(shape)
        module.register_forward_pre_hook(_enter_our_attention)
        module.register_forward_hook(_leave_our_attention, always_call=True)
        name = f"RoPE: {cls.__name__}" + ("" if shape[0] == shape[1] else f", partial {shape[1]}/{shape[0]}")
        swapped[name] = swapped.get(name, 0) + 1
    return swapped, left


BLOCK_NORMS = ("input_layernorm", "post_attention_layernorm")  # a pre-norm block's two norms (transformers' names)
_CACHE_ARGS = ("cache", "past_key_values")


def _prenorm_block(module: nn.Module):
    """The key (the second norm's eps and offset) of a decoder layer shaped like a pre-norm block: `self_attn`, `mlp`
    and both of `BLOCK_NORMS` norms our kernel runs (`swap_norms` proved them), else None."""
    norms = [getattr(module, n, None) for n in BLOCK_NORMS]
    if not all(hasattr(m, "kernel_offset") for m in norms) or not all(
        isinstance(getattr(module, n, None), nn.Module) for n in ("self_attn", "mlp")
    ):
        return None
    return norms[1].kernel_eps, norms[1].kernel_offset


def _kernel_block_forward(self, hidden_states, *args, **kwargs):
    """A pre-norm decoder layer with its middle residual add and norm in one kernel (`_fused_block`), checkpointed as
    transformers' class forward checkpoints it (`GradientCheckpointingLayer`: the recompute runs ours too). Calls
    with more than keywords, or with a KV cache (decoding: the layer's own forward renames and routes the cache), run
    the layer's own forward."""
    if args or kwargs.get("use_cache") or any(kwargs.get(name) is not None for name in _CACHE_ARGS):
        return type(self).forward(self, hidden_states, *args, **kwargs)
    if getattr(self, "gradient_checkpointing", False) and self.training and torch.is_grad_enabled():
        return self._gradient_checkpointing_func(functools.partial(_fused_block, self, **kwargs), hidden_states)
    return _fused_block(self, hidden_states, **kwargs)


def _fused_block(self, hidden_states, **kwargs):
    """x + attn(norm1(x)) -> h and norm2(h) in one pass (`kernels.fused_add_rms_norm`), then h + mlp(norm2(h))."""
    attn = self.self_attn(hidden_states=self.input_layernorm(hidden_states), **kwargs)
    attn = attn[0] if isinstance(attn, tuple) else attn  # (B, T, C)
    norm = self.post_attention_layernorm
    if attn.dtype == hidden_states.dtype and (norm.weight.dtype == attn.dtype or norm.kernel_mixed):
        normed, h = kernels.fused_add_rms_norm(attn, hidden_states, norm.weight, norm.kernel_eps, norm.kernel_offset)
    else:  # the norm's own rules for mixed dtypes
        h = hidden_states + attn
        normed = norm(h)
    return h + self.mlp(normed)


def swap_residual_norms(model: nn.Module, twin: nn.Module | None = None) -> tuple[dict[str, int], set[str]]:
    """The fused residual add + RMSNorm in every decoder layer whose forward `_kernel_block_forward` is proven to
    compute: its forward rebound on the instance. The proof runs the model once on random tokens (no cache), taking
    each candidate class's first layer's real arguments, and calls that layer's own forward and ours on them (its
    real weights, in their dtype: an order of operations that differs, Gemma 2's norm of the attention's output or OLMo
    2's post-norms, is off by the size of the activations, rounding by a few units in the last place): relative
    error below 1e-5 in fp32, 1e-2 in 16 bits. ({"fused residual add + RMSNorm: ClassName": count}, those left)."""
    captured: dict[type, tuple] = {}

    def prove(module, key):
        if not captured:
            _capture_layer_calls(model, captured)
        call = captured.get(type(module))
        if call is None:
            return None
        layer, hidden, kwargs = call
        was_training = layer.training
        layer.eval()
        try:
            with torch.no_grad():
                theirs = type(layer).forward(layer, hidden, **kwargs)
                ours = _kernel_block_forward(layer, hidden, **kwargs)
        except Exception:
            return None
        finally:
            layer.train(was_training)
        if not torch.is_tensor(theirs) or not torch.is_tensor(ours) or ours.shape != theirs.shape:
            return None
        tolerance = 1e-5 if theirs.dtype == torch.float32 else 1e-2
        error = (ours.float() - theirs.float()).norm() / theirs.float().norm().clamp(min=1e-12)
        return {} if error <= tolerance else None

    def left_when(name):
        return name.endswith("DecoderLayer")

    swapped, left = _swap(model, _prenorm_block, prove, _kernel_block_forward, left_when, _block_label, twin)
    return swapped, {f"residual add + norm ({name})" for name in left}


def _block_label(name: str, attrs: dict) -> str:
    return f"fused residual add + RMSNorm: {name}"


@torch.no_grad()
def _capture_layer_calls(model: nn.Module, captured: dict) -> None:
    """{layer class: (layer, hidden_states, keyword arguments)} of each pre-norm candidate class's first call in a
    forward of `model` (eval mode, no cache) on PROBE_TOKENS random tokens; nothing where the forward fails (a model on
    the meta device) or a layer takes more than its hidden states positionally."""

    def take(module, args, kwargs):
        if type(module) not in captured and len(args) == 1:
            captured[type(module)] = (module, args[0], dict(kwargs))

    hooks = [
        m.register_forward_pre_hook(take, with_kwargs=True) for m in model.modules() if _prenorm_block(m) is not None
    ]
    embed = model.get_input_embeddings()
    was_training = model.training
    model.eval()
    try:
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, embed.weight.shape[0], (1, PROBE_TOKENS), generator=g).to(embed.weight.device)
        model(input_ids=ids, use_cache=False)
    except Exception:  # no forward here (meta weights): nothing is proven
        captured.clear()
    finally:
        for hook in hooks:
            hook.remove()
        model.train(was_training)


# the registry (module docstring), in the report's order; the fused residual add reads what swap_norms proved
SWAPS = (swap_norms, swap_mlps, swap_rope, swap_residual_norms)


def swap_kernels(model: nn.Module, twin: nn.Module | None = None) -> tuple[dict[str, int], set[str]]:
    """Every swap of `SWAPS` on `model`: ({"Kind: where": count} of what runs ours, the names of what was left).
    `twin`: a model of the same architecture at other sizes, already swapped (its probes ran on its real weights),
    whose verdicts stand for `model`'s modules of the same class and settings (a model built on the meta device, where
    the probes cannot run: bench/roofline's full-size models); a module whose class and settings the twin lacks is a
    ModelError."""
    swapped: dict[str, int] = {}
    left: set[str] = set()
    for swap in SWAPS:
        done, kept = swap(model, twin)
        swapped.update(done)
        left |= kept
    if not any(key.startswith("RoPE: ") for key in swapped) and not any("rotary" in name for name in left):
        if any("Rotary" in type(m).__name__ for m in model.modules()):
            left.add("rotary embedding")  # rotated by a function no swap recognises
    return swapped, left
