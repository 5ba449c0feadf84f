"""Drop-in `nn.Module`s over the `kernels` functionals.

Each module's parameter names, shapes and `state_dict` equal those of the plain module it replaces, so a
Hugging Face checkpoint loads into it (and back out of it) without a key remap. Dispatch (Triton on CUDA,
reference on CPU) happens in the functional, not here.
"""

from __future__ import annotations

import numbers

import torch
from torch import nn

from .rms_norm import rms_norm

__all__ = ["RMSNorm"]


class RMSNorm(nn.Module):
    """y = x * rsqrt(mean(x^2, -1) + eps) * (offset + weight).

    Replaces HF `LlamaRMSNorm` / `torch.nn.RMSNorm` (offset=0, weight initialised to ones) and Gemma's
    norm (offset=1, weight initialised to zeros, so both start as the identity scale). The math runs in
    fp32 and the output is in the input's dtype; see `kernels.rms_norm` for the one rounding difference
    from `LlamaRMSNorm` in bf16/fp16.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, offset: float = 0.0):
        super().__init__()
        if isinstance(hidden_size, bool) or not isinstance(hidden_size, numbers.Integral) or hidden_size < 1:
            raise ValueError(f"RMSNorm: hidden_size must be a positive int, got {hidden_size!r}")
        if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not eps >= 0:
            raise ValueError(f"RMSNorm: eps must be a real number >= 0, got {eps!r}")
        if isinstance(offset, bool) or not isinstance(offset, numbers.Real):
            raise ValueError(f"RMSNorm: offset must be a real number (0.0 for Llama, 1.0 for Gemma), got {offset!r}")
        self.hidden_size = int(hidden_size)
        self.eps = float(eps)
        self.offset = float(offset)
        self.weight = nn.Parameter(torch.empty(self.hidden_size))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # Ones for plain RMSNorm, zeros when the offset already supplies the unit scale (Gemma's 1 + weight).
        with torch.no_grad():
            self.weight.fill_(1.0 if self.offset == 0.0 else 0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.offset)

    def extra_repr(self) -> str:
        extra = f", offset={self.offset}" if self.offset != 0.0 else ""
        return f"{self.hidden_size}, eps={self.eps}{extra}"
