"""kernels: fused Triton kernels for LLM training, each with a plain-PyTorch reference beside it.

Importable on its own (it never imports `trainer`). Dispatch, the same for every op: CUDA tensors run
Triton, CPU tensors run the reference unless Triton is forced (see `kernels._dispatch`).
"""

from ._dispatch import HAS_TRITON, backend, current_backend, use_triton

__all__ = ["HAS_TRITON", "backend", "current_backend", "use_triton"]
from .cross_entropy import cross_entropy, cross_entropy_ref; __all__ += ["cross_entropy", "cross_entropy_ref"]  # noqa: E402,E702
from .fused_linear_cross_entropy import fused_linear_cross_entropy, fused_linear_cross_entropy_ref; __all__ += ["fused_linear_cross_entropy", "fused_linear_cross_entropy_ref"]  # noqa: E402,E702
