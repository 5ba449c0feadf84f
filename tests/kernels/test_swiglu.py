"""SwiGLU (silu(gate) * up) and GeGLU (gelu_tanh(gate) * up, the same kernels with the activation switched): the Triton
kernels (through the interpreter on CPU) against the fp32 references and PyTorch.

Tolerance model (tests/tolerance.py):
- fp32: elementwise math of a few operations: |ours - ref| <= 8 eps32 |ref|max for out, dgate and dup.
- bf16/fp16: our error against the fp32 reference <= 2x PyTorch's own error running F.silu(gate) * up (F.gelu(gate,
  approximate="tanh") * up) and its autograd in that dtype, + 1 bf16 ulp of |ref|max because the interpreter
  truncates fp32->bf16 stores.
"""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels.geglu import geglu, geglu_linear, geglu_linear_ref, geglu_ref
from kernels.swiglu import (
    SwiGLUFunction,
    swiglu,
    swiglu_bwd,
    swiglu_bwd_act,
    swiglu_fwd,
    swiglu_linear,
    swiglu_linear_ref,
    swiglu_ref,
)
from tests.tolerance import assert_lowp_close, fwd_bwd, max_abs_err, poisoned_like

swiglu_mod = importlib.import_module("kernels.swiglu")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
EPS32 = torch.finfo(torch.float32).eps


@pytest.fixture(autouse=True)
def _triton_backend():
    with kernels.backend("triton"):
        yield


def _make(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    # gate spans silu's curved region and both tails (sigmoid saturates past |g| ~ 10)
    gate = (torch.randn(shape, generator=g) * 4).to(dtype)
    up = torch.randn(shape, generator=g).to(dtype)
    dout = torch.randn(shape, generator=g).to(dtype)
    return gate, up, dout


def _assert_fp32_close(ours, ref, name):
    assert ours.shape == ref.shape and ours.dtype == ref.dtype, (
        f"{name}: {ours.shape}/{ours.dtype} vs {ref.shape}/{ref.dtype}"
    )
    bound = 8 * EPS32 * ref.abs().max().item()
    err = max_abs_err(ours, ref)
    assert err <= bound, f"{name}: fp32 error {err:.3e} > {bound:.3e}"


# (op, its reference, PyTorch's own composition in the inputs' dtype)
OPS = {
    "swiglu": (swiglu, swiglu_ref, lambda a, b: F.silu(a) * b),
    "geglu": (geglu, geglu_ref, lambda a, b: F.gelu(a, approximate="tanh") * b),
}


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1,), (1823, 781), (3, 7, 1001)], ids=str)
def test_matches_reference_and_torch(shape, dtype, op):
    fn, ref, composed = OPS[op]
    gate, up, dout = _make(shape, dtype)
    ours = fwd_bwd(fn, gate, up, dout)
    assert all(t.dtype == dtype and t.shape == gate.shape for t in ours)
    ref32 = fwd_bwd(ref, gate.float(), up.float(), dout.float())
    torch_lowp = fwd_bwd(composed, gate, up, dout)
    for o, r, t, name in zip(ours, ref32, torch_lowp, ("out", "dgate", "dup")):
        if dtype == torch.float32:
            _assert_fp32_close(o, r, name)
            _assert_fp32_close(o, t, f"{name} vs F.silu * up")
        else:
            assert_lowp_close(o, r, t.float(), dtype, name=name, extra_ulps=1 if dtype == torch.bfloat16 else 0)


def test_geglu_is_the_tanh_gelu_not_the_exact_one():
    """transformers' gelu_pytorch_tanh (Gemma): the tanh approximation, which differs from erf's GELU by ~1e-3 at
    g = 1.5, far beyond fp32 rounding; gradients as autograd's through F.gelu(approximate="tanh")."""
    gate = torch.tensor([-3.0, -1.5, -0.1, 0.0, 0.1, 1.5, 3.0, 9.0])
    up, dout = torch.ones(8), torch.ones(8)
    out, dgate, dup = fwd_bwd(geglu, gate, up, dout)
    # float64 autograd as the truth: fp32 torch's own backward cancels in 1 + tanh at g = -3 (1e-5 relative)
    exact = fwd_bwd(lambda a, b: F.gelu(a, approximate="tanh") * b, gate.double(), up.double(), dout.double())
    for o, t in zip((out, dgate, dup), exact):
        torch.testing.assert_close(o.double(), t, rtol=1e-6, atol=1e-8)
    assert (out - F.gelu(gate)).abs().max() > 1e-4


def test_gradient_formula_is_not_silu_alone():
    """dgate needs silu's derivative s (1 + g (1 - s)), not s: at g = 2 the two differ by 21%."""
    gate = torch.full((5,), 2.0)
    up, dout = torch.ones(5), torch.ones(5)
    _, dgate, dup = fwd_bwd(swiglu, gate, up, dout)
    s = torch.sigmoid(gate)
    _assert_fp32_close(dgate, s * (1 + gate * (1 - s)), "dgate")
    _assert_fp32_close(dup, gate * s, "dup")


def test_saves_inputs_not_the_activation():
    gate, up, _ = _make((37, 100), torch.bfloat16)
    gate.requires_grad_()
    up.requires_grad_()
    out = swiglu(gate, up)
    assert type(out.grad_fn).__name__ == "SwiGLUFunctionBackward"
    saved = out.grad_fn.saved_tensors
    assert len(saved) == 2
    assert saved[0].data_ptr() == gate.data_ptr() and saved[1].data_ptr() == up.data_ptr()


def test_launchers_write_every_element_and_leave_inputs_intact(monkeypatch):
    gate, up, dout = _make(
        (3, 70001), torch.float16
    )  # 210003 elements: four programs under the interpreter, one ragged
    gate0, up0 = gate.clone(), up.clone()
    monkeypatch.setattr(swiglu_mod.torch, "empty_like", poisoned_like)
    out = swiglu_fwd(gate, up)
    dgate, dup = swiglu_bwd(dout, gate, up)
    monkeypatch.undo()
    for t, name in ((out, "out"), (dgate, "dgate"), (dup, "dup")):
        assert torch.isfinite(t).all(), f"{name} has unwritten (NaN) elements"
    assert torch.equal(gate, gate0) and torch.equal(up, up0)
    ref32 = fwd_bwd(swiglu_ref, gate.float(), up.float(), dout.float())
    lowp = fwd_bwd(lambda a, b: F.silu(a) * b, gate, up, dout)
    for o, r, t, name in zip((out, dgate, dup), ref32, lowp, ("out", "dgate", "dup")):
        assert_lowp_close(o, r, t.float(), torch.float16, name=name)


def test_broadcast_and_noncontiguous():
    """.sum().backward() hands back a stride-0 dout; transposed gate/up have non-unit strides."""
    gate, up, _ = _make((781, 5), torch.float32)
    gt, ut = gate.t().requires_grad_(), up.t().requires_grad_()  # (5, 781), column stride 5
    swiglu(gt, ut).sum().backward()
    g32, u32 = gt.detach().clone().requires_grad_(), ut.detach().clone().requires_grad_()
    swiglu_ref(g32, u32).sum().backward()
    _assert_fp32_close(gt.grad, g32.grad, "dgate")
    _assert_fp32_close(ut.grad, u32.grad, "dup")


def test_only_needed_gradients_and_empty():
    gate, up, dout = _make((4, 9), torch.float32)
    gate.requires_grad_()
    (dgate,) = torch.autograd.grad(SwiGLUFunction.apply(gate, up), [gate], dout)
    _assert_fp32_close(dgate, fwd_bwd(swiglu_ref, gate, up, dout)[1], "dgate")
    empty = torch.empty(0, 8)
    assert swiglu(empty, empty).shape == (0, 8)


def test_dispatch_and_bad_args():
    gate, up, _ = _make((4, 9), torch.bfloat16)
    with kernels.backend("reference"):
        out = swiglu(gate, up)
    assert out.grad_fn is None or type(out.grad_fn).__name__ != "SwiGLUFunctionBackward"
    assert torch.equal(out, swiglu_ref(gate, up))
    with pytest.raises(ValueError, match="share shape"):
        swiglu(gate, up[:, :3])
    with pytest.raises(ValueError, match="share shape"):
        swiglu(gate, up.float())
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        swiglu(gate.to(torch.int32), up)


# ---- swiglu_linear: F.linear(swiglu(gate, up), weight) without keeping act -------------------------------------


def _linear_case(shape, h, dtype, seed=0):
    gate, up, _ = _make(shape, dtype, seed)
    g = torch.Generator().manual_seed(seed + 1)
    weight = (torch.randn(h, shape[-1], generator=g) / shape[-1] ** 0.5).to(dtype)
    dout = torch.randn(*shape[:-1], h, generator=g).to(dtype)
    return gate, up, weight, dout


def _grads(fn, tensors, dout, needs=(True, True, True)):
    leaves = [t.detach().clone().requires_grad_(n) for t, n in zip(tensors, needs)]
    out = fn(*leaves)
    out.backward(dout)
    return [out.detach(), *(t.grad for t in leaves)]


LINEAR_OPS = {"swiglu": (swiglu_linear, swiglu, swiglu_linear_ref), "geglu": (geglu_linear, geglu, geglu_linear_ref)}


@pytest.mark.parametrize("op", LINEAR_OPS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,h", [((1, 1), 1), ((1823, 781), 33), ((3, 7, 1001), 64)], ids=str)
def test_swiglu_linear_is_bit_for_bit_the_composition(shape, h, dtype, op):
    """out and every gradient equal F.linear(swiglu(gate, up), weight)'s bit for bit (the same kernels' arithmetic,
    the matmuls autograd's mm backward runs); and close to the fp32 reference. The same for geglu_linear."""
    linear, glu, linear_ref = LINEAR_OPS[op]
    gate, up, weight, dout = _linear_case(shape, h, dtype)
    ours = _grads(linear, (gate, up, weight), dout)
    plain = _grads(lambda a, b, w: F.linear(glu(a, b), w), (gate, up, weight), dout)
    for o, p, name in zip(ours, plain, ("out", "dgate", "dup", "dweight")):
        assert o.dtype == p.dtype and torch.equal(o, p), name
    if dtype == torch.float32:
        ref = _grads(linear_ref, (gate.double(), up.double(), weight.double()), dout.double())
        for o, r, name in zip(ours, ref, ("out", "dgate", "dup", "dweight")):
            k = shape[-1] if name in ("out", "dgate", "dup") else gate.numel() // shape[-1]
            bound = 8 * EPS32 * k**0.5 * r.abs().max().item()  # a k-term dot product
            assert max_abs_err(o, r.float()) <= bound, name


def test_swiglu_linear_keeps_no_activation():
    gate, up, weight, _ = _linear_case((37, 100), 16, torch.bfloat16)
    gate.requires_grad_()
    up.requires_grad_()
    weight.requires_grad_()
    out = swiglu_linear(gate, up, weight)
    assert type(out.grad_fn).__name__ == "SwiGLULinearFunctionBackward"
    saved = out.grad_fn.saved_tensors
    assert [t.data_ptr() for t in saved] == [gate.data_ptr(), up.data_ptr(), weight.data_ptr()]


@pytest.mark.parametrize(
    "needs", [(True, True, False), (True, False, True), (False, False, True), (False, True, False)]
)
def test_swiglu_linear_only_needed_gradients(needs):
    gate, up, weight, dout = _linear_case((5, 70), 9, torch.float16)
    ours = _grads(swiglu_linear, (gate, up, weight), dout, needs)
    plain = _grads(lambda a, b, w: F.linear(swiglu(a, b), w), (gate, up, weight), dout, needs)
    for o, p, need in zip(ours[1:], plain[1:], needs):
        assert (o is None) == (not need) and (o is None or torch.equal(o, p))
    assert torch.equal(ours[0], plain[0])


def test_swiglu_linear_under_autocast_casts_the_weight_as_f_linear_does():
    gate, up, weight, dout = _linear_case((6, 50), 12, torch.bfloat16)
    weight = weight.float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = _grads(swiglu_linear, (gate, up, weight), dout)
        plain = _grads(lambda a, b, w: F.linear(swiglu(a, b), w), (gate, up, weight), dout)
    assert ours[0].dtype == torch.bfloat16 and ours[3].dtype == torch.float32
    for o, p in zip(ours, plain):
        assert torch.equal(o, p)


def test_swiglu_linear_falls_back_where_it_cannot_run():
    """The reference backend, or a gate in another dtype than the matmul's: F.linear(swiglu(gate, up), weight)."""
    gate, up, weight, _ = _linear_case((4, 9), 3, torch.bfloat16)
    with kernels.backend("reference"):
        out = swiglu_linear(gate.requires_grad_(), up, weight)
    assert type(out.grad_fn).__name__ != "SwiGLULinearFunctionBackward"
    assert torch.equal(out, swiglu_linear_ref(gate, up, weight))
    with pytest.raises(RuntimeError):  # F.linear's own error for mixed dtypes
        swiglu_linear(gate, up, weight.float())


@pytest.mark.parametrize("act", ("silu", "gelu_tanh"))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_backward_writing_act_equals_forward_and_backward(dtype, act):
    """swiglu_bwd_act: dgate and dup as swiglu_bwd's, act as swiglu_fwd's, bit for bit, act over dout, every element
    written (210003 elements: several interpreter programs, one ragged); for either activation."""
    gate, up, dout = _make((3, 70001), dtype)
    gate0, up0 = gate.clone(), up.clone()
    dgate, dup = swiglu_bwd(dout, gate, up, act)
    dgate2, dup2, act_out = swiglu_bwd_act(dout, gate, up, act)
    assert act_out.data_ptr() == dout.data_ptr()
    assert torch.equal(dgate, dgate2) and torch.equal(dup, dup2)
    assert torch.equal(act_out, swiglu_fwd(gate, up, act))
    assert torch.equal(gate, gate0) and torch.equal(up, up0)
    with pytest.raises(ValueError, match="gate's dtype"):
        swiglu_bwd_act(dout.float() if dtype != torch.float32 else dout.half(), gate, up)


@pytest.mark.parametrize("act", ("silu", "gelu_tanh"))
def test_bench_runs_for_either_activation(act, tmp_path, monkeypatch):
    import bench.bench_swiglu as bench_swiglu
    import bench.common as common

    monkeypatch.setattr(common, "RESULTS", tmp_path)
    rows = bench_swiglu.main(["--quick", "--act", act, "--providers", "ours", "torch", "--compile-backend", "eager"])
    assert {(r["provider"], r["act"], r["op"]) for r in rows} == {
        (p, act, "swiglu" if act == "silu" else "geglu") for p in ("ours", "torch")
    }
    assert all(r["perf_figure"] is False and r["ms"] > 0 for r in rows)
