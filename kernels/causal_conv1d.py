"""The short causal convolution of Gated DeltaNet (and Mamba-style) layers, in plain PyTorch: each of D channels
convolved with its own W taps over the tokens before it (depthwise, left-padded with W - 1 zeros), then an activation:

    y[t, d] = act(bias[d] + sum_{i < W} weight[d, i] x[t - (W - 1) + i, d])      (x before a sequence's start: 0)

x: (B, T, D); weight: (D, W) (nn.Conv1d's (D, 1, W) squeezed, as transformers passes it); bias (D,) or None;
activation "silu" or None. With `cu_seqlens` ((N + 1,) offsets of N sequences packed into one row, B = 1) the
convolution restarts at every boundary: no token reads the sequence before it, so a packed row gives each sequence's
outputs and gradients as if it ran alone (transformers' fallback, and `causal_conv1d_fn` without `seq_idx`, read
across). Computed in fp32 (fp64 for fp64 inputs), returned in x's dtype; differentiable through autograd.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._packed import sequence_spans

ACTIVATIONS = (None, "silu")


def causal_conv1d_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """The causal depthwise convolution (module docstring): (B, T, D) in x's dtype."""
    if x.dim() != 3 or weight.dim() != 2 or weight.shape[0] != x.shape[-1]:
        raise ValueError(
            f"causal_conv1d: x must be (B, T, D) and weight (D, W) for the same D, got x {tuple(x.shape)} and "
            f"weight {tuple(weight.shape)}"
        )
    if activation not in ACTIVATIONS:
        raise ValueError(f"causal_conv1d: activation must be one of {ACTIVATIONS}, got {activation!r}")
    B, T, D = x.shape
    spans = sequence_spans("causal_conv1d", B, T, cu_seqlens)
    compute = torch.promote_types(x.dtype, torch.float32)
    w = weight.to(compute)[:, None, :]  # (D, 1, W)
    width = weight.shape[1]
    outs = []
    for start, end in spans:
        if end == start:  # an empty sequence
            continue
        part = x[:, start:end].to(compute).transpose(1, 2)  # (B, D, t)
        y = F.conv1d(F.pad(part, (width - 1, 0)), w, None if bias is None else bias.to(compute), groups=D)
        outs.append(y.transpose(1, 2))
    y = torch.cat(outs, dim=1) if outs else x.new_zeros(x.shape, dtype=compute)
    return (F.silu(y) if activation == "silu" else y).to(x.dtype)
