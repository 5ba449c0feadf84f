"""The tolerance model every kernel test uses.

fp32: a fixed (atol, rtol) per op, stated in the test.
bf16/fp16: our error against an fp32 reference is at most 2x PyTorch's own error when it runs the same
op in that dtype (the "torch low-precision" baseline), plus `extra_ulps` units in the last place of the
largest reference value. Under the Triton interpreter fp32->bf16 stores truncate instead of rounding
to nearest (DESIGN.md), so bf16 tests pass extra_ulps=1 and say so.
"""

from __future__ import annotations

import torch


def eps(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps


def max_abs_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def assert_lowp_close(ours, ref32, torch_lowp, dtype, *, name="output", extra_ulps=0, floor=0.0):
    """Assert |ours - ref32|max <= 2 |torch_lowp - ref32|max + extra_ulps * eps(dtype) * |ref32|max + floor."""
    assert ours.shape == ref32.shape, f"{name}: shape {tuple(ours.shape)} != {tuple(ref32.shape)}"
    assert torch.isfinite(ours.float()).all(), f"{name}: non-finite values"
    ours_err = max_abs_err(ours, ref32)
    torch_err = max_abs_err(torch_lowp, ref32)
    scale = ref32.double().abs().max().item() if ref32.numel() else 0.0
    bound = 2.0 * torch_err + extra_ulps * eps(dtype) * scale + floor
    assert ours_err <= bound, (
        f"{name} ({dtype}): our max error {ours_err:.3e} > bound {bound:.3e} "
        f"(torch {dtype} error {torch_err:.3e}, |ref| max {scale:.3e})"
    )


def poisoned_like(t: torch.Tensor) -> torch.Tensor:
    """A tensor of NaNs (or the dtype's max for ints) to pass as an output buffer: every element must be written."""
    if t.dtype.is_floating_point:
        return torch.full_like(t, float("nan"))
    return torch.full_like(t, torch.iinfo(t.dtype).max)


def fwd_bwd(fn, a: torch.Tensor, b: torch.Tensor, grad_out: torch.Tensor):
    """(fn(a, b), d/da, d/db) for the upstream gradient grad_out, on fresh leaf copies of a and b."""
    a = a.detach().clone().requires_grad_()
    b = b.detach().clone().requires_grad_()
    out = fn(a, b)
    da, db = torch.autograd.grad(out, [a, b], grad_out)
    return out.detach(), da, db


class PoisonedTorch:
    """Stands in for `torch` inside a kernel module (monkeypatch its `torch`): every floating torch.empty comes back
    full of NaN, so an output element a launcher forgets to write shows up."""

    def __init__(self):
        self.calls = 0

    def __getattr__(self, name):
        return getattr(torch, name)

    def empty(self, *args, **kwargs):
        self.calls += 1
        t = torch.empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.dtype.is_floating_point else t
