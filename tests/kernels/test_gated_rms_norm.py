"""The gated RMSNorm of Gated DeltaNet layers (rmsnorm(x) * weight * silu(gate)): the Triton kernels (through the
interpreter on CPU) against the fp64 reference and transformers' Qwen3_5RMSNormGated.

Tolerance model (tests/tolerance.py):
- fp32: a row reduction and a few elementwise operations: y, dx, dgate within 1e-5 of |ref|max, dweight (a sum over
  rows) within 1e-5 of its |ref|max.
- bf16/fp16: our error against the fp32 reference <= 2x PyTorch's own error running the same math eagerly in that
  dtype (transformers' casts: `gated_rms_norm_plain`), + 1 ulp of |ref|max (the interpreter truncates fp32 stores).
"""

from __future__ import annotations

import importlib

import pytest
import torch

import kernels
from kernels.gated_rms_norm import GatedRMSNormFunction, gated_rms_norm, gated_rms_norm_bwd, gated_rms_norm_ref
from tests.tolerance import PoisonedTorch, assert_lowp_close
from trainer.model.gated_deltanet import gated_rms_norm_plain

module = importlib.import_module("kernels.gated_rms_norm")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(2, 3, 4, 128), (37, 100), (1, 3), (5, 3, 257)]  # Qwen3.5's heads; ragged rows and columns; one row


@pytest.fixture(autouse=True)
def _triton_backend():
    with kernels.backend("triton"):
        yield


def _inputs(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, z, dy = (torch.randn(shape, generator=g).to(dtype) for _ in range(3))
    w = (1 + 0.3 * torch.randn(shape[-1], generator=g)).to(dtype)
    return x, z, w, dy


def _run(fn, x, z, w, dy):
    x, z, w = (t.detach().clone().requires_grad_() for t in (x, z, w))
    y = fn(x, z, w, 1e-6)
    return (y.detach(), *torch.autograd.grad(y, [x, z, w], dy))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_values_and_gradients_match_the_reference(shape, dtype):
    x, z, w, dy = _inputs(shape, dtype)
    ours = _run(gated_rms_norm, x, z, w, dy)
    ref = _run(gated_rms_norm_ref, *(t.double() for t in (x, z, w, dy)))
    names = ("y", "dx", "dgate", "dweight")
    for name, o, r in zip(names, ours, ref):
        assert o.dtype == dtype and o.shape == r.shape, name
        if dtype == torch.float32:
            torch.testing.assert_close(o.double(), r, atol=1e-5 * r.abs().max().item(), rtol=0, msg=name)
    if dtype != torch.float32:
        eager = _run(gated_rms_norm_plain, x, z, w, dy)  # transformers' casts in this dtype
        for name, o, r, e in zip(names, ours, ref, eager):
            assert_lowp_close(o, r.float(), e, dtype, name=name, extra_ulps=1)


def test_transformers_qwen3_5_gated_norm_agrees_in_fp32():
    modeling = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    norm = modeling.Qwen3_5RMSNormGated(128, eps=1e-6)
    x, z, w, dy = _inputs((3, 7, 4, 128), torch.float32, seed=2)
    with torch.no_grad():
        norm.weight.copy_(w)
    x, z = x.requires_grad_(), z.requires_grad_()
    y = norm(x, z)
    theirs = (y.detach(), *torch.autograd.grad(y, [x, z, norm.weight], dy))
    ours = _run(gated_rms_norm, x, z, w, dy)
    for name, o, t in zip(("y", "dx", "dgate", "dweight"), ours, theirs):
        torch.testing.assert_close(o, t, atol=2e-6 * t.abs().max().item(), rtol=0, msg=name)


@pytest.mark.parametrize("programs", [1, 3, 64])
def test_dweight_sums_every_programs_rows(programs):
    x, z, w, dy = _inputs((50, 64), torch.float32, seed=3)
    from kernels.gated_rms_norm import gated_rms_norm_fwd

    _, rstd = gated_rms_norm_fwd(x, z, w, 1e-6)
    dx, dz, dw = gated_rms_norm_bwd(dy, x, z, w, rstd, num_programs=programs)
    ref = _run(gated_rms_norm_ref, *(t.double() for t in (x, z, w, dy)))
    torch.testing.assert_close(dw.double(), ref[3], atol=1e-5 * ref[3].abs().max().item(), rtol=0)
    assert gated_rms_norm_bwd(dy, x, z, w, rstd, compute_dw=False)[2] is None


def test_every_output_element_is_written(monkeypatch):
    # outputs allocated full of NaN: an element a launch forgets shows up
    poisoned = PoisonedTorch()
    monkeypatch.setattr(module, "torch", poisoned)
    x, z, w, dy = _inputs((37, 100), torch.bfloat16)
    ours = _run(gated_rms_norm, x, z, w, dy)
    assert poisoned.calls and all(torch.isfinite(t.float()).all() for t in ours)


def test_strided_rows_and_a_broadcast_gradient():
    # x and the gate as the layer hands them (views of wider projections), dy of y.sum()'s backward (stride 0)
    g = torch.Generator().manual_seed(4)
    wide = torch.randn(6, 2, 256, generator=g)
    x, z = wide[..., :100], wide[..., 128:228]  # row stride 256, unit column stride
    w = torch.randn(100, generator=g)
    dy = torch.ones(6, 2, 100)
    ours = _run(gated_rms_norm, x, z, w, dy.expand(6, 2, 100))
    ref = _run(gated_rms_norm_ref, x.double(), z.double(), w.double(), dy.double())
    for o, r in zip(ours, ref):
        torch.testing.assert_close(o.double(), r, atol=1e-5 * r.abs().max().item(), rtol=0)


def test_the_function_takes_rows_and_hands_back_no_weight_gradient_unasked():
    x, z, w, dy = _inputs((9, 16), torch.float32, seed=5)
    x, z = x.requires_grad_(), z.requires_grad_()
    y = GatedRMSNormFunction.apply(x, z, w, 1e-6)  # w takes no gradient
    dx, dz = torch.autograd.grad(y, [x, z], dy)
    ref = _run(gated_rms_norm_ref, *(t.double() for t in (x, z, w, dy)))
    torch.testing.assert_close(dz.double(), ref[2], atol=1e-5 * ref[2].abs().max().item(), rtol=0)


@pytest.mark.parametrize(
    "change, error, message",
    [
        (dict(gate=torch.zeros(3, 5)), ValueError, "x and gate must share a shape"),
        (dict(weight=torch.zeros(3)), ValueError, r"weight must have shape \(4,\)"),
        (dict(x=torch.zeros(3, 4, dtype=torch.int32)), TypeError, "x must be a float32, bfloat16 or float16"),
        (dict(eps=-1.0), ValueError, "eps must be a real number >= 0"),
    ],
)
def test_bad_arguments_are_one_line(change, error, message):
    args = dict(x=torch.zeros(3, 4), gate=torch.zeros(3, 4), weight=torch.ones(4), eps=1e-6) | change
    with pytest.raises(error, match="^gated_rms_norm: " + message):
        gated_rms_norm(**args)


def test_rows_wider_than_the_kernel_are_one_line():
    n = module.MAX_N + 1
    with pytest.raises(ValueError, match=f"^gated_rms_norm: rows of {n} channels are wider than"):
        gated_rms_norm(torch.zeros(1, n), torch.zeros(1, n), torch.ones(n))
