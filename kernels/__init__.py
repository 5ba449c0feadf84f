"""kernels: fused Triton kernels for LLM training, each with a plain-PyTorch reference beside it.

Importable on its own (it never imports `trainer`). Dispatch, the same for every op: CUDA tensors run
Triton, CPU tensors run the reference unless Triton is forced (see `kernels._dispatch`).
"""

from ._dispatch import HAS_TRITON, backend, current_backend, use_triton

__all__ = ["HAS_TRITON", "backend", "current_backend", "use_triton"]

from .rms_norm import rms_norm; __all__ += ["rms_norm"]  # noqa: E402,E702  (modules: kernels.nn.RMSNorm)
