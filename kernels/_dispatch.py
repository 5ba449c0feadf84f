"""One dispatch rule for every op in `kernels`.

- CUDA tensors run the Triton kernel (or the CUDA extension where it is built and faster).
- CPU tensors run the plain-PyTorch reference, unless Triton is forced: `TRITON_INTERPRET=1` in the
  environment (read by Triton when `@triton.jit` decorates, so it must be set before `kernels` is
  imported; the tests do this in `tests/conftest.py`), or `KERNELS_BACKEND=triton`, or the
  `kernels.backend("triton")` context manager.
- `KERNELS_BACKEND=reference` (or `kernels.backend("reference")`) forces the reference everywhere.
- Inside `torch.compile` on CPU the reference is taken: the Triton interpreter cannot be traced.

Triton is optional (a CPU-only install never needs it, and CUDA builds of torch bring their own): without it
`import kernels` works and CPU tensors run the reference; forcing Triton, or a CUDA tensor reaching an op,
raises a one-line RuntimeError saying how to install it (`TRITON_MISSING`).
"""

from __future__ import annotations

import contextlib
import os

import torch

try:  # triton ships for Linux only; kernels still import (and run their references) without it
    import triton  # noqa: F401
    import triton.language as tl  # noqa: F401

    HAS_TRITON = True
except Exception:  # pragma: no cover - exercised on machines without triton
    HAS_TRITON = False

_BACKENDS = ("auto", "triton", "reference")
TRITON_MISSING = "triton is not installed: pip install triton (or the project's extra: pip install -e '.[triton]')"


# Module globals, not thread-locals or os.environ lookups, so that torch.compile can trace `use_triton` (it
# guards on globals; it cannot read a threading.local). KERNELS_BACKEND is read once, at import, and checked when
# first used (`current_backend`), so that importing kernels never fails and a CLI can report a bad value in one line.
_ENV_BACKEND = os.environ.get("KERNELS_BACKEND", "auto").strip().lower() or "auto"
_override: str | None = None


def current_backend() -> str:
    """The backend in force: the innermost `backend(...)` context, else `KERNELS_BACKEND`, else 'auto'."""
    name = _override or _ENV_BACKEND
    if name not in _BACKENDS:
        raise ValueError(f"KERNELS_BACKEND={name!r} is not one of {', '.join(_BACKENDS)}")
    return name


@contextlib.contextmanager
def backend(name: str):
    """Force a backend for the ops called inside: 'auto' (the dispatch rule), 'triton' or 'reference'."""
    global _override
    if name not in _BACKENDS:
        raise ValueError(f"backend {name!r} is not one of {', '.join(_BACKENDS)}")
    previous = _override
    _override = name
    try:
        yield
    finally:
        _override = previous


_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"  # Triton reads it once too, when kernels decorate


def interpreter_on() -> bool:
    return _INTERPRET


def num_sms(device_index: int) -> int:
    """The CUDA device's streaming multiprocessor count: a launch grid's size (a CUDA attribute query, not a
    host-device sync). Constant at trace time under torch.compile, as `torch.compiler.assume_constant_result`
    would make it."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


# What `torch.compiler.assume_constant_result(num_sms)` does, without that call's import of torch._dynamo (about 3 s
# of `import kernels` on a CPU, where the op never runs): the decorator sets only this attribute
# (torch/_dynamo/decorators.py), and tests/kernels/test_dispatch.py fails if it ever sets something else.
num_sms._dynamo_marked_constant = True


def use_triton(*tensors: torch.Tensor) -> bool:
    """True where the op should launch its Triton kernel for these tensors, False for the reference."""
    name = current_backend()
    if name == "reference":
        return False
    on_cuda = all(t.is_cuda for t in tensors if t is not None)
    if on_cuda:
        if not HAS_TRITON:
            raise RuntimeError(
                f"kernels: CUDA tensors run the Triton kernels, but {TRITON_MISSING}; "
                "or run the reference with KERNELS_BACKEND=reference"
            )
        return True
    if torch.compiler.is_compiling():
        return False  # the interpreter cannot be traced; compiled CPU code takes the reference
    if name == "triton" or interpreter_on():
        if not HAS_TRITON:
            raise RuntimeError(
                f"kernels: the Triton backend was forced (KERNELS_BACKEND=triton or TRITON_INTERPRET=1) "
                f"but {TRITON_MISSING}"
            )
        if not interpreter_on():
            raise RuntimeError(
                "kernels: Triton on CPU tensors needs the interpreter: set TRITON_INTERPRET=1 before importing kernels"
            )
        return True
    return False
