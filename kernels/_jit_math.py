"""Triton device functions shared by several kernels (imported only where triton is).

`tanh`: Triton 3.9 has no tanh in `tl.math`, and `libdevice.tanh` does not run under the interpreter the CPU tests
use. fp32 tanh(u) = (1 - e) / (1 + e) with e = exp(-2|u|), odd in u; where |u| < 1/4, where 1 - e cancels, its Taylor
series to u^9 instead: within 2.5e-7 relative of fp32 torch.tanh (measured over 2e6 points of [-6.7, 6.7]), and exact
+-1 in the tails (e underflows to 0). Used by the cross-entropy kernels' softcapping (kernels/cross_entropy.py and
kernels/fused_linear_cross_entropy.py's vocabulary pass).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def tanh(u):
    """fp32 tanh (module docstring)."""
    LOG2E: tl.constexpr = 1.4426950408889634
    a = tl.abs(u)
    e = tl.exp2(-2.0 * LOG2E * a)
    u2 = u * u
    series = a * (1.0 + u2 * (-1.0 / 3.0 + u2 * (2.0 / 15.0 + u2 * (-17.0 / 315.0 + u2 * (62.0 / 2835.0)))))
    r = tl.where(a < 0.25, series, (1.0 - e) / (1.0 + e))
    return tl.where(u < 0.0, -r, r)
