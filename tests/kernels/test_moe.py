"""The Mixture-of-Experts experts op (kernels/moe.py): the reference against transformers' own expert modules
(Qwen3-MoE's and Mixtral's concatenated (E, 2I, H) layout with SwiGLU, gpt-oss's transposed, interleaved, biased
layout with its clamped SwiGLU), values and gradients of every input, the router weights included."""

from __future__ import annotations

import pytest
import torch
from transformers import GptOssConfig, Qwen3MoeConfig
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from kernels.moe import moe_experts_ref

T, H, INTER, E = 23, 16, 12, 6


def _routing(k, g, num_experts=E, tokens=T, skip_expert=None):
    """Each token's k distinct experts (uneven loads; `skip_expert` gets none) and its router weights."""
    logits = torch.randn(tokens, num_experts, generator=g)
    if skip_expert is not None:
        logits[:, skip_expert] = -1e9
    index = logits.topk(k, dim=-1).indices
    weights = torch.softmax(torch.randn(tokens, k, generator=g), dim=-1)
    return index, weights


def _hf_experts(kind):
    if kind == "qwen3_moe":
        config = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=INTER, num_experts=E, hidden_act="silu")
        module = Qwen3MoeExperts(config)
    else:
        config = GptOssConfig(hidden_size=H, intermediate_size=INTER, num_local_experts=E)
        module = GptOssExperts(config)
    config._experts_implementation = "eager"
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (3.0 if kind == "gpt_oss" else 0.3))  # reach the clamps
    return module


@pytest.mark.parametrize("kind", ["qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_reference_equals_transformers_experts(kind, k):
    g = torch.Generator().manual_seed(k)
    module = _hf_experts(kind)
    x = torch.randn(T, H, generator=g, requires_grad=True)
    index, weights = _routing(k, g, skip_expert=E - 1)
    weights.requires_grad_()
    dy = torch.randn(T, H, generator=g)
    gpt = kind == "gpt_oss"
    kwargs = dict(transposed=True, interleaved=True, act="gpt_oss") if gpt else {}
    biases = (module.gate_up_proj_bias, module.down_proj_bias) if gpt else (None, None)
    ours = moe_experts_ref(x, index, weights, module.gate_up_proj, module.down_proj, *biases, **kwargs)
    inputs = [x, weights, *module.parameters()]
    grads = torch.autograd.grad(ours, inputs, dy)
    theirs = module(x, index, weights)
    expected = torch.autograd.grad(theirs, inputs, dy)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6 * theirs.abs().max().item())
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6 * want.abs().max().item())
    if gpt:  # the clamps were reached, so their zero gradients were compared
        gate_up = torch.einsum("th,ehi->tei", x.detach(), module.gate_up_proj.detach())
        assert (gate_up[..., ::2] > 7).any() and (gate_up[..., 1::2].abs() > 7).any()


def test_bad_arguments_are_one_line_errors():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, H)
    index, weights = _routing(2, g)
    w1, w2 = torch.randn(E, 2 * INTER, H), torch.randn(E, H, INTER)
    with pytest.raises(ValueError, match="act='gelu' is not one of silu, gpt_oss"):
        moe_experts_ref(x, index, weights, w1, w2, act="gelu")
    with pytest.raises(ValueError, match="do not fit hidden size"):
        moe_experts_ref(x, index, weights, w1, w2.transpose(1, 2))
    with pytest.raises(ValueError, match="tokens but top_k_index has"):
        moe_experts_ref(x[:-1], index, weights, w1, w2)
