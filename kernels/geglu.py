"""GeGLU's gating: out = gelu_tanh(gate) * up (Gemma's MLP between its projections; transformers' `gelu_pytorch_tanh`,
torch's F.gelu(approximate="tanh")), fused forward and backward in Triton.

Math (elementwise; g = gate, u = up; fp32 whatever the storage dtype), with k = sqrt(2 / pi), c = 0.044715: the tanh
GELU 0.5 g (1 + tanh(z)), z = k (g + c g^3), is g s with s = sigmoid(2 z) (1 + tanh(z) = 2 sigmoid(2 z)), which has
no 1 + tanh(z) to cancel where g << 0 (computed that way it lost 1e-4 relative at g = -3)
    forward   out   = g s u                                             (one rounding: the cast to gate's dtype)
    backward  dup   = dout g s
              dgate = dout u (s + 2 g s (1 - s) k (1 + 3 c g^2))     (1 - s = sigmoid(-2 z), no cancellation)
The kernels are SwiGLU's (kernels/swiglu.py, its launch,
bytes moved, the recomputation of the activation in backward and `geglu_linear`'s act-free weight gradient) with the
activation switched (ACT 1): this file is GeGLU's public face and its reference.

Transformers' GemmaMLP computes act_fn(gate) * up in the activation dtype (two roundings in bf16); we round once.

Test:  python -m pytest tests/kernels/test_swiglu.py -q   (both activations; CPU: Triton interpreter)
Bench: python bench/bench_swiglu.py --act gelu_tanh       (GPU; --quick for a CPU smoke run)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._dispatch import use_triton
from .swiglu import SwiGLUFunction, _check_args, glu_linear


def geglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) * up, any shape, fp32 math, output in gate's dtype; CUDA tensors run the Triton kernels, CPU
    tensors the reference (see `kernels._dispatch`)."""
    _check_args(gate, up, "geglu")
    if not use_triton(gate, up):
        return geglu_ref(gate, up)
    return SwiGLUFunction.apply(gate, up, "gelu_tanh")


def geglu_linear(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear(geglu(gate, up), weight) (no bias), values and gradients bit for bit, without keeping the
    (..., intermediate) product for backward (as `kernels.swiglu_linear`)."""
    _check_args(gate, up, "geglu")
    return glu_linear(gate, up, weight, "gelu_tanh", geglu)


def geglu_linear_ref(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Plain PyTorch F.linear(geglu_ref(gate, up), weight); autograd-differentiable."""
    return F.linear(geglu_ref(gate, up), weight)


def geglu_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Plain PyTorch gelu(gate, approximate="tanh") * up: fp32 math (fp64 for fp64 inputs), one cast back;
    autograd-differentiable."""
    compute = torch.promote_types(gate.dtype, torch.float32)
    return (F.gelu(gate.to(compute), approximate="tanh") * up.to(compute)).to(gate.dtype)
