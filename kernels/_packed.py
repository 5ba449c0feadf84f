"""Packed rows, shared by the ops that restart at sequence boundaries (kernels/causal_conv1d.py,
kernels/gated_delta_rule.py): `cu_seqlens` holds the (N + 1,) offsets of N sequences packed into one row (B = 1), as
flash-attention's varlen functions and fla take them.
"""

from __future__ import annotations

import torch


def sequence_spans(op: str, B: int, T: int, cu_seqlens: torch.Tensor | None) -> list[tuple[int, int]]:
    """[(start, end)] of each sequence in a row of T tokens: [(0, T)] without `cu_seqlens`, else its consecutive
    offsets after checking they rise from 0 to T over one packed row (a one-line ValueError naming `op` otherwise)."""
    if cu_seqlens is None:
        return [(0, T)]
    ends = cu_seqlens.tolist() if cu_seqlens.dim() == 1 else None
    if B != 1 or not ends or ends[0] != 0 or ends[-1] != T or any(b < a for a, b in zip(ends, ends[1:])):
        shown = ends if ends is not None else f"a tensor of shape {tuple(cu_seqlens.shape)}"
        raise ValueError(
            f"{op}: cu_seqlens must rise from 0 to T = {T} over one packed row (B = 1), got {shown} with B = {B}"
        )
    return list(zip(ends, ends[1:]))
