"""Mixture-of-Experts blocks in our model's terms (issue 46): the decoder layer's `mlp` of Qwen3-MoE, Mixtral,
gpt-oss, Qwen3-Next and Qwen3.5-MoE, with transformers 5's parameter names and in-memory shapes, so that peft's
`target_parameters` and transformers' own state dicts name the same tensors:

    mlp.gate.weight              (E, H)      the router (`TopKRouter`): kept in full precision (a plain Parameter, not
                                             an nn.Linear: no LoRA or 4-bit layer ever wraps it)
    mlp.experts.gate_up_proj     (E, 2I, H)  each expert's gate rows then up rows
    mlp.experts.down_proj        (E, H, I)
qwen3_next, qwen3_5_moe_text (transformers' Qwen3NextSparseMoeBlock) add a shared expert every token runs through:
    mlp.shared_expert.{gate,up,down}_proj  a SwiGLU MLP of shared_expert_intermediate_size (the model's MLP class)
    mlp.shared_expert_gate       (1, H)      an nn.Linear: its output scaled by sigmoid(x w^T) before the add
gpt_oss (transformers' GptOssMLP):
    mlp.router.weight, .bias     (E, H), (E,)  the router, biased (plain Parameters too)
    mlp.experts.gate_up_proj     (E, H, 2I)  transposed, gate and up interleaved (even / odd columns), with
    mlp.experts.gate_up_proj_bias (E, 2I)    biases; the activation transformers' clamped SwiGLU (limit
    mlp.experts.down_proj        (E, I, H)   `swiglu_limit`, alpha `swiglu_alpha`: kernels/moe.py's "gpt_oss"), the
    mlp.experts.down_proj_bias   (E, H)      down bias weighted by the router like the rest of the expert's output

On disk transformers 5.24 writes (and the released checkpoints hold) one 2-D weight per expert for qwen3_moe and
mixtral; `file_parts` says which file tensor is which slice of our 3-D parameters (trainer/build.py reads and writes
through it). gpt_oss's files hold the 3-D tensors under their in-memory names, and OpenAI's released checkpoints the
expert weights MXFP4-packed (`*_blocks`, `*_scales`; `dequantize_mxfp4`, applied as they load: our weights are then
bf16, or the load dtype, and are written back unpacked).

Routing, exactly as each family computes it (logits in the activations' dtype):
    qwen3_moe  p = softmax(logits) in fp32, the top k of p, renormalised to sum 1 if norm_topk_prob, cast back
               (qwen3_next alike; qwen3_5_moe_text always renormalises: ModelConfig sets its norm_topk_prob)
    mixtral    p = softmax(logits) in fp32, the top k of p, always renormalised, kept in fp32
    gpt_oss    logits = x W^T + b; the top k of the logits, softmax over those k alone in the logits' dtype
The experts run through `kernels.moe_experts` (kernels/moe.py) with our kernels, its reference otherwise (the layout
options of each family set once, in `Experts.__init__`).

The load-balancing loss (`load_balancing_loss`) is transformers' `load_balancing_loss_func` over every MoE layer's
router logits (gpt_oss: the biased logits, all E of them, as transformers records them): each layer hands on three
sums (`RouterStats`: its top-k assignments per expert, its routing probabilities per expert, its token count, padding
left out) instead of its logits, and the loss is formed from their totals, the same numbers in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

import kernels
from kernels.moe import moe_experts_ref
from trainer.model import fused_lora

MOE_TYPES = ("qwen3_moe", "mixtral", "gpt_oss", "qwen3_next", "qwen3_5_moe_text")
# the types whose MoE block adds a gated shared expert (transformers' Qwen3NextSparseMoeBlock)
SHARED_EXPERT_TYPES = ("qwen3_next", "qwen3_5_moe_text")
# the per-expert tensors on disk: (the block's prefix under the layer, gate, up, down file names)
_FILE_NAMES = {
    "qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
    "mixtral": ("block_sparse_moe", "w1", "w3", "w2"),
    "qwen3_next": ("mlp", "gate_proj", "up_proj", "down_proj"),
    "qwen3_5_moe_text": ("mlp", "gate_proj", "up_proj", "down_proj"),
}


class RouterStats(NamedTuple):
    """One MoE layer's share of the load-balancing loss: top-k assignments per expert (no gradient), routing
    probabilities summed per expert (fp32, with gradient), and the tokens counted (fp32; padding left out)."""

    assignments: torch.Tensor  # (E,)
    probs: torch.Tensor  # (E,)
    tokens: torch.Tensor  # ()


class TopKRouter(nn.Module):
    def __init__(self, hidden: int, num_experts: int, top_k: int, kind: str, norm_topk_prob: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        # gpt_oss's router has a bias (a plain Parameter too)
        self.bias = nn.Parameter(torch.empty(num_experts)) if kind == "gpt_oss" else None
        self.top_k, self.kind, self.norm_topk_prob = top_k, kind, norm_topk_prob

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (N, H) -> router logits (N, E) in x's dtype, each token's top-k weights (N, k) and experts (N, k)."""
        logits = F.linear(x, self.weight, self.bias)
        if self.kind == "gpt_oss":  # the top k of the logits, softmax over those k alone, in the logits' dtype
            top, index = torch.topk(logits, self.top_k, dim=-1)
            return logits, torch.softmax(top, dim=-1, dtype=top.dtype), index
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top, index = torch.topk(probs, self.top_k, dim=-1)
        if self.kind == "mixtral" or self.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        if self.kind != "mixtral":
            top = top.to(logits.dtype)
        return logits, top, index


class Experts(nn.Module):
    def __init__(
        self,
        hidden: int,
        inner: int,
        num_experts: int,
        kind: str = "qwen3_moe",
        limit: float = 7.0,
        alpha: float = 1.702,
    ):
        super().__init__()
        gpt = kind == "gpt_oss"  # transposed, gate/up interleaved, biased, the clamped SwiGLU (kernels/moe.py)
        e, two_i = num_experts, 2 * inner
        self.full_shapes = {
            "gate_up_proj": (e, hidden, two_i) if gpt else (e, two_i, hidden),
            "down_proj": (e, inner, hidden) if gpt else (e, hidden, inner),
        }
        self.gate_up_proj = nn.Parameter(torch.empty(self.full_shapes["gate_up_proj"]))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(e, two_i)) if gpt else None
        self.down_proj = nn.Parameter(torch.empty(self.full_shapes["down_proj"]))
        self.down_proj_bias = nn.Parameter(torch.empty(e, hidden)) if gpt else None
        self.layout = dict(transposed=True, interleaved=True, act="gpt_oss", alpha=alpha, limit=limit) if gpt else {}
        self.is_transposed = gpt  # peft's target_parameters reads it (as on transformers' GptOssExperts): (E, in, out)
        self.impl = "kernels"

    def copy_settings(self, other: Experts) -> None:
        """This module's shapes, layout, impl and biases those of `other`: for a twin built without __init__ (the 4-bit
        experts, their dequantized plain copy: trainer/model/quant.py), which sets its own expert tensors."""
        self.full_shapes, self.layout, self.impl = dict(other.full_shapes), other.layout, other.impl
        self.is_transposed = other.is_transposed
        self.gate_up_proj_bias, self.down_proj_bias = other.gate_up_proj_bias, other.down_proj_bias  # as they are

    def forward(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, loras=None) -> torch.Tensor:
        """`loras`: {parameter name: kernels.moe.ExpertLoRA} of peft's adapter on gate_up_proj and/or down_proj,
        run as rank-r GEMMs on the routed rows (SparseMoeBlock finds them)."""
        return self.run(x, index, weights, self.gate_up_proj, self.down_proj, loras)

    def run(self, x, index, weights, gate_up, down, loras=None) -> torch.Tensor:
        """The experts' math on these weights (ours, or the 4-bit experts' dequantized ones: trainer/model/quant.py),
        their biases (gpt_oss) and layout (`layout`, set in __init__)."""
        loras = loras or {}
        lora = dict(gate_up_lora=loras.get("gate_up_proj"), down_lora=loras.get("down_proj"))
        biases = (self.gate_up_proj_bias, self.down_proj_bias)  # None but for gpt_oss
        if self.impl != "kernels":
            return moe_experts_ref(x, index, weights, gate_up, down, *biases, **self.layout, **lora)
        if torch.is_autocast_enabled(x.device.type):
            # what autocast does to a matmul's input: the kernels then multiply in the autocast dtype (reading the fp32
            # master weights and casting each tile as they load it), not in fp32
            x = x.to(torch.get_autocast_dtype(x.device.type))
        return kernels.moe_experts(x, index, weights, gate_up, down, *biases, **self.layout, **lora)


class SparseMoeBlock(nn.Module):
    """The routed experts in place of a decoder layer's MLP; with `shared_expert` (an MLP module: SHARED_EXPERT_TYPES)
    that MLP's output too, each token's gated by sigmoid(shared_expert_gate(x)), added to the experts' output."""

    def __init__(
        self,
        hidden: int,
        inner: int,
        num_experts: int,
        top_k: int,
        kind: str,
        norm_topk_prob: bool,
        limit: float = 7.0,
        alpha: float = 1.702,
        shared_expert: nn.Module | None = None,
    ):
        super().__init__()
        # the router under its checkpoint name (gpt_oss: `router`, else `gate`); `self.gate` reads it either way
        self.router_name = "router" if kind == "gpt_oss" else "gate"
        self.add_module(self.router_name, TopKRouter(hidden, num_experts, top_k, kind, norm_topk_prob))
        self.experts = Experts(hidden, inner, num_experts, kind, limit, alpha)
        if shared_expert is not None:
            self.shared_expert = shared_expert
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)
        # peft's expert adapter as rank-r GEMMs (trainer/model/fused_lora.py, CausalLM.fused_lora)
        self.fused_lora = True

    @property
    def gate(self) -> TopKRouter:
        router = self._modules.get(self.router_name)
        if router is None:  # (before __init__ registers it: add_module asks hasattr)
            raise AttributeError("gate")
        return router

    def forward(self, x: torch.Tensor, token_mask: torch.Tensor | None = None, stats: bool = False):
        """x (B, T, H) -> (the experts' output (B, T, H), this layer's RouterStats when `stats`, else None).
        `token_mask` (B, T): the real tokens (None: all), which alone count in the stats."""
        flat = x.reshape(-1, x.shape[-1])
        logits, weights, index = self.gate(flat)
        found = fused_lora.find_experts(self.experts, Experts) if self.fused_lora else None
        if found is None:  # peft's ParamWrappers as they are (the whole delta formed), or no adapter
            out = self.experts(flat, index, weights)
        else:
            out = found[0](flat, index, weights, found[1])
        if hasattr(self, "shared_expert"):  # in transformers' order: routed + sigmoid(gate) * shared
            out = out + torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        out = out.view(x.shape)
        return out, (router_stats(logits, index.shape[-1], token_mask) if stats else None)  # (k: the router's)


def no_router_message(coef: float, model_type: str) -> str:
    """The one line for router_aux_loss_coef set on a model without routers (our model's, the transformers path's and
    the command's check say it alike)."""
    return (
        f"router_aux_loss_coef={coef:g}: a {model_type} model has no router (not a mixture of experts); leave it unset"
    )


def router_stats(logits: torch.Tensor, top_k: int, token_mask: torch.Tensor | None) -> RouterStats:
    """A layer's sums for the load-balancing loss, as transformers' load_balancing_loss_func forms them: the softmax
    in the logits' dtype, its top-k assignments counted per expert, its probabilities summed in fp32."""
    num_experts = logits.shape[-1]
    probs = torch.softmax(logits, dim=-1)
    selected = torch.topk(probs, top_k, dim=-1).indices  # (N, k)
    if token_mask is None:
        ones = torch.ones(selected.numel(), device=logits.device)
        tokens = torch.full((), float(logits.shape[0]), device=logits.device)
        weighted = probs.float()
    else:
        mask = token_mask.reshape(-1).to(device=logits.device, dtype=torch.float32)  # (N,)
        ones, tokens, weighted = mask.repeat_interleave(top_k), mask.sum(), probs.float() * mask[:, None]
    assignments = torch.zeros(num_experts, device=logits.device).scatter_add_(0, selected.reshape(-1), ones)
    return RouterStats(assignments, weighted.sum(dim=0), tokens)


def load_balancing_loss(stats: list[RouterStats]) -> torch.Tensor:
    """transformers' load_balancing_loss_func from every MoE layer's RouterStats: E x sum over experts of (assignments
    / tokens) x (probabilities / tokens), each summed over the layers first (fp32, ())."""
    assignments = sum(s.assignments for s in stats)
    probs = sum(s.probs for s in stats)
    tokens = sum(s.tokens for s in stats)
    return (assignments / tokens * (probs / tokens)).sum() * assignments.shape[0]


def file_parts(config, name: str, mxfp4: bool = False) -> list[tuple[str, tuple | Mxfp4Part]]:
    """Where our parameter `name` lives in a Hugging Face checkpoint of `config` (a ModelConfig): [(file key, the index
    of our parameter that file tensor holds)], index () for the whole parameter. An expert tensor is one 2-D weight per
    expert on disk (gate_up_proj two: its gate rows and its up rows); Mixtral's block is `block_sparse_moe` there.
    gpt_oss's files hold transformers' in-memory names and 3-D tensors; with `mxfp4` (a released checkpoint's
    `quantization_config`) its expert weights are MXFP4-packed: `{name}_blocks` and `{name}_scales` (`Mxfp4Part`)."""
    if config.model_type == "gpt_oss":
        if mxfp4 and name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):
            return [(f"{name}_blocks", Mxfp4Part("blocks")), (f"{name}_scales", Mxfp4Part("scales"))]
        return [(name, ())]
    if config.model_type not in _FILE_NAMES:
        return [(name, ())]
    block, gate, up, down = _FILE_NAMES[config.model_type]
    prefix, sep, leaf = name.rpartition(".mlp.experts.")
    if not sep:
        return [(name.replace(".mlp.gate.", f".{block}.gate."), ())]
    base, inner = f"{prefix}.{block}.experts", config.expert_size
    if leaf == "down_proj":
        return [(f"{base}.{e}.{down}.weight", (e,)) for e in range(config.num_experts)]
    halves = ((gate, slice(0, inner)), (up, slice(inner, 2 * inner)))
    return [(f"{base}.{e}.{file}.weight", (e, rows)) for e in range(config.num_experts) for file, rows in halves]


# ---- MXFP4: the released gpt-oss checkpoints' expert weights ---------------------------------------------------------
# OCP Microscaling FP4 as OpenAI's checkpoints store it: each row of the weight (a (N, K) matrix per expert, the
# transpose of our (K, N) parameter) in groups of 32 values: 16 bytes of "blocks" (two e2m1 codes per byte, the low
# nibble first) and one byte of "scales", the group's power of two biased by 127 (E8M0). Value = FP4[code] x 2^(s-127).
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


@dataclass(frozen=True)
class Mxfp4Part:
    """A file tensor that is one half of an MXFP4-packed parameter: its "blocks" or its "scales" (`file_parts`)."""

    kind: str


def mxfp4_shape(shape: tuple, kind: str) -> tuple:
    """The file shape of the blocks or scales of our (E, K, N) parameter: (E, N, K / 32, 16) uint8, (E, N, K / 32)."""
    e, k, n = shape
    return (e, n, k // 32, 16) if kind == "blocks" else (e, n, k // 32)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """(E, N, G, 16) uint8 blocks and (E, N, G) uint8 scales -> our (E, G 32, N) parameter in `dtype` (transformers'
    `convert_moe_packed_tensors`, value for value: each code's FP4 value times 2^(scale - 127), computed in fp32, then
    rounded once to `dtype`; every FP4 value times a power of two is exact in bf16 within its exponent range)."""
    e, n, g, b = blocks.shape
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).reshape(e, n, g, 2 * b).long()  # (E, N, G, 32)
    values = torch.ldexp(lut[codes], (scales.to(torch.int32) - 127)[..., None])  # (E, N, G, 32) fp32
    return values.reshape(e, n, g * 2 * b).transpose(1, 2).to(dtype).contiguous()  # (E, K, N)
