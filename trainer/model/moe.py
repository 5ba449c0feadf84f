"""Mixture-of-Experts blocks in our model's terms (issue 46): the decoder layer's `mlp` of Qwen3-MoE and Mixtral, with
transformers 5's parameter names and in-memory shapes, so that peft's `target_parameters` and transformers' own
state dicts name the same tensors:

    mlp.gate.weight              (E, H)      the router (`TopKRouter`): kept in full precision (a plain Parameter, not
                                             an nn.Linear: no LoRA or 4-bit layer ever wraps it)
    mlp.experts.gate_up_proj     (E, 2I, H)  each expert's gate rows then up rows
    mlp.experts.down_proj        (E, H, I)

On disk transformers 5.24 writes (and the released checkpoints hold) one 2-D weight per expert; `file_parts`
says which file tensor is which slice of our 3-D parameters (trainer/build.py reads and writes through it).

Routing, exactly as each family computes it (logits in the activations' dtype):
    qwen3_moe  p = softmax(logits) in fp32, the top k of p, renormalised to sum 1 if norm_topk_prob, cast back
    mixtral    p = softmax(logits) in fp32, the top k of p, always renormalised, kept in fp32
The experts run through `kernels.moe_experts` (kernels/moe.py) with our kernels, its reference otherwise.

The load-balancing loss (`load_balancing_loss`) is transformers' `load_balancing_loss_func` over every MoE layer's
router logits: each layer hands on three sums (`RouterStats`: its top-k assignments per expert, its routing
probabilities per expert, its token count, padding left out) instead of its logits, and the loss is formed from their
totals, the same numbers in the same order.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

import kernels
from kernels.moe import moe_experts_ref
from trainer.model import fused_lora

MOE_TYPES = ("qwen3_moe", "mixtral")
# the per-expert tensors on disk: (the block's prefix under the layer, gate, up, down file names)
_FILE_NAMES = {
    "qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
    "mixtral": ("block_sparse_moe", "w1", "w3", "w2"),
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
        self.top_k, self.kind, self.norm_topk_prob = top_k, kind, norm_topk_prob

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (N, H) -> router logits (N, E) in x's dtype, each token's top-k weights (N, k) and experts (N, k)."""
        logits = F.linear(x, self.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top, index = torch.topk(probs, self.top_k, dim=-1)
        if self.kind == "mixtral" or self.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        if self.kind == "qwen3_moe":
            top = top.to(logits.dtype)
        return logits, top, index


class Experts(nn.Module):
    def __init__(self, hidden: int, inner: int, num_experts: int):
        super().__init__()
        self.full_shapes = {"gate_up_proj": (num_experts, 2 * inner, hidden), "down_proj": (num_experts, hidden, inner)}
        self.gate_up_proj = nn.Parameter(torch.empty(self.full_shapes["gate_up_proj"]))
        self.down_proj = nn.Parameter(torch.empty(self.full_shapes["down_proj"]))
        self.impl = "kernels"

    def forward(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, loras=None) -> torch.Tensor:
        """`loras`: {parameter name: kernels.moe.ExpertLoRA} of peft's adapter on gate_up_proj and/or down_proj,
        run as rank-r GEMMs on the routed rows (SparseMoeBlock finds them)."""
        return self.run(x, index, weights, self.gate_up_proj, self.down_proj, loras)

    def run(self, x, index, weights, gate_up, down, loras=None) -> torch.Tensor:
        """The experts' math on these weights (ours, or the 4-bit experts' dequantized ones: trainer/model/quant.py)."""
        loras = loras or {}
        lora = dict(gate_up_lora=loras.get("gate_up_proj"), down_lora=loras.get("down_proj"))
        if self.impl != "kernels":
            return moe_experts_ref(x, index, weights, gate_up, down, **lora)
        if torch.is_autocast_enabled(x.device.type):
            # what autocast does to a matmul's input: the kernels then multiply in the autocast dtype (reading the fp32
            # master weights and casting each tile as they load it), not in fp32
            x = x.to(torch.get_autocast_dtype(x.device.type))
        return kernels.moe_experts(x, index, weights, gate_up, down, **lora)


class SparseMoeBlock(nn.Module):
    """The routed experts in place of a decoder layer's MLP."""

    def __init__(self, hidden: int, inner: int, num_experts: int, top_k: int, kind: str, norm_topk_prob: bool):
        super().__init__()
        self.gate = TopKRouter(hidden, num_experts, top_k, kind, norm_topk_prob)
        self.experts = Experts(hidden, inner, num_experts)
        self.fused_lora = (
            True  # peft's expert adapter as rank-r GEMMs (trainer/model/fused_lora.py, CausalLM.fused_lora)
        )

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
        out = out.view(x.shape)
        return out, (router_stats(logits, self.gate.top_k, token_mask) if stats else None)


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


def file_parts(config, name: str) -> list[tuple[str, tuple]]:
    """Where our parameter `name` lives in a Hugging Face checkpoint of `config` (a ModelConfig): [(file key, the index
    of our parameter that file tensor holds)], index () for the whole parameter. An expert tensor is one 2-D weight per
    expert on disk (gate_up_proj two: its gate rows and its up rows); Mixtral's block is `block_sparse_moe` there."""
    if config.model_type not in MOE_TYPES:
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
