"""Gated DeltaNet in our terms (trainer/model/gated_deltanet.py, issue 45): with a transformers Qwen3.5 layer's own
weights (its state dict loaded strictly: the same names and shapes) the output and every gradient equal
transformers' `Qwen3_5GatedDeltaNet` in fp32, padding mask included; a packed row (cu_seqlens) gives each sequence's
output and gradients as if it ran alone, and the causal convolution restarts at every boundary."""

from __future__ import annotations

import pytest
import torch

from kernels.causal_conv1d import causal_conv1d_ref
from tests.trainer.model.tiny_hf import tiny_config
from trainer.model.gated_deltanet import GatedDeltaNet

modeling = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")


def pair(seed: int = 0):
    """A transformers Qwen3.5 linear-attention layer with random weights (A_log and dt_bias too) and ours with its
    state dict."""
    config = tiny_config("qwen3_5_text")
    torch.manual_seed(seed)
    theirs = modeling.Qwen3_5GatedDeltaNet(config, layer_idx=0)
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.randn(p.shape) * 0.3)
    ours = GatedDeltaNet(
        config.hidden_size,
        config.linear_num_key_heads,
        config.linear_num_value_heads,
        config.linear_key_head_dim,
        config.linear_value_head_dim,
        config.linear_conv_kernel_dim,
        config.rms_norm_eps,
    )
    ours.load_state_dict(theirs.state_dict(), strict=True)
    return theirs, ours, config


def test_our_layer_computes_transformers_layer_with_its_weights():
    theirs, ours, config = pair()
    x = torch.randn(2, 23, config.hidden_size, generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 23)
    mask[1, :4] = 0  # a left-padded row
    for attention_mask in (None, mask):
        xs = [x.clone().requires_grad_() for _ in range(2)]
        a = theirs(xs[0], attention_mask=attention_mask)
        b = ours(xs[1], attention_mask=attention_mask)
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
        weights = torch.randn(a.shape, generator=torch.Generator().manual_seed(2))
        (a * weights).sum().backward()
        (b * weights).sum().backward()
        torch.testing.assert_close(xs[1].grad, xs[0].grad, rtol=1e-4, atol=1e-6)
        mine = dict(ours.named_parameters())
        for name, p in theirs.named_parameters():
            # the recurrence's chunked sums in another order: up to 2.1e-6 of a gradient's largest entry (A_log)
            scale = p.grad.abs().max().item()
            torch.testing.assert_close(mine[name].grad, p.grad, rtol=0, atol=1e-5 * scale, msg=lambda m, n=name: n + m)
            p.grad, mine[name].grad = None, None


def test_a_packed_row_gives_each_sequence_as_if_alone():
    """Sequences of 9, 1 and 14 tokens in one row: with cu_seqlens each gets the output and input gradient it gets
    alone (the conv's taps and the recurrent state restart at each boundary); the row read as one sequence differs."""
    _, ours, config = pair()
    lengths = [9, 1, 14]
    cu = torch.tensor([0, 9, 10, 24])
    x = torch.randn(1, sum(lengths), config.hidden_size, generator=torch.Generator().manual_seed(3), requires_grad=True)
    y = ours(x, cu_seqlens=cu)
    weights = torch.randn(y.shape, generator=torch.Generator().manual_seed(4))
    (y * weights).sum().backward()
    for start, end in zip(cu.tolist(), cu.tolist()[1:]):
        alone = x[:, start:end].detach().requires_grad_()
        y1 = ours(alone)
        torch.testing.assert_close(y[:, start:end], y1, rtol=1e-5, atol=1e-6)
        (y1 * weights[:, start:end]).sum().backward()
        torch.testing.assert_close(x.grad[:, start:end], alone.grad, rtol=1e-4, atol=1e-6)
    assert not torch.allclose(ours(x)[:, 9:], y[:, 9:], atol=1e-4)


def test_the_causal_conv_restarts_at_each_boundary():
    """causal_conv1d_ref with cu_seqlens equals the convolution of each sequence alone (zeros before its start), and
    without them equals a left-padded nn.Conv1d over the whole row."""
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(1, 12, 5, generator=g, dtype=torch.float64), torch.randn(5, 4, generator=g, dtype=torch.float64)
    conv = torch.nn.Conv1d(5, 5, 4, groups=5, bias=False, padding=3).double()
    conv.weight.data.copy_(w[:, None, :])
    whole = causal_conv1d_ref(x, w, activation=None)
    torch.testing.assert_close(whole, conv(x.transpose(1, 2))[..., :12].transpose(1, 2))
    cu = torch.tensor([0, 2, 2, 12])
    packed = causal_conv1d_ref(x, w, activation="silu", cu_seqlens=cu)
    for start, end in ((0, 2), (2, 12)):
        torch.testing.assert_close(packed[:, start:end], causal_conv1d_ref(x[:, start:end], w))
    with pytest.raises(ValueError, match=r"^causal_conv1d: cu_seqlens must rise from 0 to T = 12"):
        causal_conv1d_ref(x, w, cu_seqlens=torch.tensor([0, 5]))
