"""The experts of a Mixture-of-Experts block (Qwen3-MoE, Mixtral, gpt-oss, Qwen3.5-MoE): every token's k routed
experts, each a gated MLP, weighted by the router and summed back into the token's row.

Math (x: (T, H) tokens; e = top_k_index[t, j], w = top_k_weights[t, j] for each of a token's k slots)
    gate, up = x_t W_gate[e] (+ b_gate[e]),  x_t W_up[e] (+ b_up[e])          (each (I,))
    h        = act(gate, up)                                                 act: see ACTS
    y_tj     = h W_down[e] (+ b_down[e])                                     ((H,))
    out_t    = sum_j w_tj y_tj
The parameters stay in the layout transformers 5 stores (so checkpoints load and save as they are):
    transposed=False (Qwen3-MoE, Mixtral, Qwen3.5-MoE): gate_up_proj (E, 2I, H), down_proj (E, H, I), no biases
    transposed=True  (gpt-oss):                         gate_up_proj (E, H, 2I), down_proj (E, I, H), biases
    interleaved=False: gate = columns [0, I), up = [I, 2I) of the 2I axis; interleaved=True (gpt-oss): gate = even
    columns, up = odd columns
These are transformers' `use_experts_implementation(is_transposed=..., is_concatenated=not interleaved)`.

ACTS
    "silu"    act = silu(gate) * up                                          (SwiGLU: Qwen3-MoE, Mixtral)
    "gpt_oss" g = min(gate, limit), u = clamp(up, -limit, limit),
              act = (u + 1) * g * sigmoid(alpha g)                           (alpha 1.702, limit 7: gradients are
                                                                              zero where a value was clamped)

`moe_experts_ref` is the golden: transformers' eager expert loop (one matmul per expert that has tokens, the
weighting in the router weights' dtype, `index_add_` back in x's dtype), differentiable by autograd in every input,
the router weights included.

Test:  python -m pytest tests/kernels/test_moe.py -q
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ACTS = ("silu", "gpt_oss")
GPT_OSS_ALPHA = 1.702
GPT_OSS_LIMIT = 7.0


def _check_args(x, top_k_index, top_k_weights, gate_up_proj, down_proj, gate_up_bias, down_bias, transposed, act):
    if act not in ACTS:
        raise ValueError(f"moe_experts: act={act!r} is not one of {', '.join(ACTS)}")
    if x.dim() != 2 or top_k_index.dim() != 2 or top_k_weights.shape != top_k_index.shape:
        raise ValueError(
            f"moe_experts: x must be (T, H) and top_k_index/top_k_weights (T, k) alike, got {tuple(x.shape)}, "
            f"{tuple(top_k_index.shape)}, {tuple(top_k_weights.shape)}"
        )
    if top_k_index.shape[0] != x.shape[0]:
        raise ValueError(f"moe_experts: {x.shape[0]} tokens but top_k_index has {top_k_index.shape[0]} rows")
    e, two_i, h = gate_up_proj.shape if not transposed else (gate_up_proj.shape[0], *gate_up_proj.shape[:0:-1])
    want_down = (e, h, two_i // 2) if not transposed else (e, two_i // 2, h)
    if h != x.shape[1] or two_i % 2 or tuple(down_proj.shape) != want_down:
        raise ValueError(
            f"moe_experts: gate_up_proj {tuple(gate_up_proj.shape)} and down_proj {tuple(down_proj.shape)} do not "
            f"fit hidden size {x.shape[1]} (transposed={transposed})"
        )
    if gate_up_bias is not None and tuple(gate_up_bias.shape) != (e, two_i):
        raise ValueError(f"moe_experts: gate_up_bias must be ({e}, {two_i}), got {tuple(gate_up_bias.shape)}")
    if down_bias is not None and tuple(down_bias.shape) != (e, h):
        raise ValueError(f"moe_experts: down_bias must be ({e}, {h}), got {tuple(down_bias.shape)}")


def split_gate_up(gate_up: torch.Tensor, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate and up halves of a (..., 2I) projection: even/odd columns if interleaved, else first/second half."""
    if interleaved:
        return gate_up[..., ::2], gate_up[..., 1::2]
    return gate_up.chunk(2, dim=-1)


def expert_act(
    gate: torch.Tensor, up: torch.Tensor, act: str, alpha: float = GPT_OSS_ALPHA, limit: float = GPT_OSS_LIMIT
) -> torch.Tensor:
    """The expert's gated activation, as transformers computes it (in the inputs' dtype)."""
    if act == "silu":
        return F.silu(gate) * up
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def moe_experts_ref(
    x: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    *,
    transposed: bool = False,
    interleaved: bool = False,
    act: str = "silu",
    alpha: float = GPT_OSS_ALPHA,
    limit: float = GPT_OSS_LIMIT,
) -> torch.Tensor:
    """transformers' eager expert loop: for each expert with tokens, its rows through the gated MLP, weighted, and
    `index_add_`-ed back in x's dtype. Differentiable in x, the router weights, the weights and the biases."""
    _check_args(x, top_k_index, top_k_weights, gate_up_proj, down_proj, gate_up_bias, down_bias, transposed, act)
    out = torch.zeros_like(x)
    num_experts = gate_up_proj.shape[0]
    with torch.no_grad():
        hit = torch.bincount(top_k_index.reshape(-1), minlength=num_experts).nonzero().flatten().tolist()
    for e in hit:
        token_idx, slot = torch.where(top_k_index == e)
        rows = x[token_idx]
        w1 = gate_up_proj[e] if transposed else gate_up_proj[e].t()  # (H, 2I)
        gate_up = rows @ w1
        if gate_up_bias is not None:
            gate_up = gate_up + gate_up_bias[e]
        h = expert_act(*split_gate_up(gate_up, interleaved), act, alpha, limit)
        w2 = down_proj[e] if transposed else down_proj[e].t()  # (I, H)
        y = h @ w2
        if down_bias is not None:
            y = y + down_bias[e]
        y = y * top_k_weights[token_idx, slot, None]
        out = out.index_add(0, token_idx, y.to(x.dtype))
    return out


def moe_experts(
    x: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    *,
    transposed: bool = False,
    interleaved: bool = False,
    act: str = "silu",
    alpha: float = GPT_OSS_ALPHA,
    limit: float = GPT_OSS_LIMIT,
) -> torch.Tensor:
    """The routed experts' output (T, H) in x's dtype (see the module docstring for the math and layouts)."""
    return moe_experts_ref(
        x,
        top_k_index,
        top_k_weights,
        gate_up_proj,
        down_proj,
        gate_up_bias,
        down_bias,
        transposed=transposed,
        interleaved=interleaved,
        act=act,
        alpha=alpha,
        limit=limit,
    )
