"""fused_add_rms_norm: (rms_norm(x + residual), x + residual) in one pass, through the Triton interpreter on CPU,
against the fp32 reference and PyTorch, every output and every gradient (x, residual, weight), with gradients
arriving at both outputs (d_normed and d_h_out).

Tolerance model (tests/tolerance.py, as tests/kernels/test_rms_norm.py):
- fp32: |ours - ref| <= 8 eps32 |ref|max for normed, h, dx and dresidual; dweight (a sum over rows) gets sqrt(rows).
- bf16/fp16: our error against the fp32 reference <= 2x PyTorch's own (x + residual in that dtype, then F.rms_norm
  in that dtype) + 1 bf16 ulp of |ref|max, as the interpreter truncates fp32->bf16 casts (DESIGN.md).
- h is x + residual rounded once to its dtype, as torch's add: equal to torch's in fp32 and fp16, within 1 ulp in
  bf16 (the interpreter's truncation); normed is computed from that rounded h, so it equals rms_norm(h) bitwise.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels.rms_norm import (
    FusedAddRMSNormFunction,
    fused_add_rms_norm,
    fused_add_rms_norm_bwd,
    fused_add_rms_norm_fwd,
    fused_add_rms_norm_ref,
    launch_config,
    rms_norm,
)
from tests.kernels.test_rms_norm import _assert_fp32_close, _assert_ulps, count_launches
from tests.tolerance import assert_lowp_close

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
NAMES = ("normed", "h", "dx", "dresidual", "dweight")


@pytest.fixture(autouse=True)
def _triton_backend():
    with kernels.backend("triton"):
        yield


def _make(shape, dtype, offset=0.0, *, res_dtype=None, w_dtype=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = shape[-1]
    x = torch.randn(shape, generator=g).to(dtype)
    residual = (2 * torch.randn(shape, generator=g)).to(res_dtype or dtype)  # the stream: larger than the update
    w = (torch.randn(n, generator=g) * 0.2 + (0.0 if offset else 1.0)).to(w_dtype or dtype)
    out_dtype = torch.promote_types(x.dtype, residual.dtype)
    dnormed = torch.randn(shape, generator=g).to(out_dtype)
    dh = torch.randn(shape, generator=g).to(out_dtype)
    return x, residual, w, dnormed, dh


def _run(fn, x, residual, w, dnormed, dh):
    """(normed, h, dx, dresidual, dweight) of fn(x, residual, w) -> (normed, h) with gradients dnormed and dh."""
    x, residual, w = (t.detach().clone().requires_grad_() for t in (x, residual, w))
    normed, h = fn(x, residual, w)
    grads = torch.autograd.grad([normed, h], [x, residual, w], [dnormed, dh])
    return normed.detach(), h.detach(), *grads


def _torch_lowp(offset, eps=1e-6):
    """PyTorch in the inputs' dtypes: the add, then F.rms_norm (the low-precision baseline of the tolerance model)."""

    def fn(x, residual, w):
        h = x + residual
        return F.rms_norm(h, (h.shape[-1],), (offset + w).to(h.dtype), eps), h

    return fn


def _check(ours, x, residual, w, dnormed, dh, offset, rows):
    ref32 = _run(
        lambda a, b, c: fused_add_rms_norm_ref(a, b, c, 1e-6, offset),
        x.float(),
        residual.float(),
        w.float(),
        dnormed.float(),
        dh.float(),
    )
    lowp = _run(_torch_lowp(offset), x, residual, w, dnormed, dh)
    for o, r, t, name in zip(ours, ref32, lowp, NAMES):
        want_dtype = {"dx": x.dtype, "dresidual": residual.dtype, "dweight": w.dtype}.get(
            name, torch.promote_types(x.dtype, residual.dtype)
        )
        assert o.dtype == want_dtype, f"{name}: {o.dtype}, want {want_dtype}"
        if o.dtype == torch.float32:
            _assert_fp32_close(o, r, name, rows=rows if name == "dweight" else 1)
        else:
            assert_lowp_close(o, r, t.float(), o.dtype, name=name, extra_ulps=1 if o.dtype == torch.bfloat16 else 0)


def _assert_h_is_torchs_add(h, x, residual):
    want = x + residual
    if h.dtype == torch.bfloat16:
        _assert_ulps(h, want, torch.bfloat16, 1, "h vs x + residual")  # the interpreter truncates
    else:
        assert torch.equal(h, want), "h differs from torch's x + residual"


@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1000,), (3, 7, 781), (37, 1000)], ids=str)
def test_matches_reference_and_torch(shape, dtype, offset):
    x, residual, w, dnormed, dh = _make(shape, dtype, offset)
    ours = _run(lambda a, b, c: fused_add_rms_norm(a, b, c, 1e-6, offset), x, residual, w, dnormed, dh)
    _check(ours, x, residual, w, dnormed, dh, offset, rows=x.numel() // shape[-1])
    _assert_h_is_torchs_add(ours[1], x, residual)
    # normed is the norm of the rounded h: exactly our rms_norm of it
    assert torch.equal(ours[0], rms_norm(ours[1], w, 1e-6, offset))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("max_block", [None, 1024], ids=["one_block", "column_loop"])
def test_wide_rows_both_algorithms(dtype, max_block):
    """Hidden 8192 + 24: the backward's one 16384-wide block in every dtype (fp32 reloading the weight every row, fp16
    and bf16 upcasting x and dy twice, all with d_h_out); with max_block 1024 both loop, and so does the forward,
    which writes h in its first pass and reads it back in the second (9 column blocks, the last ragged)."""
    shape = (3, 8192 + 24)
    n = shape[-1]
    assert launch_config(3, n)[2] is True and launch_config(3, n, max_block=1024)[2] is False
    x, residual, w, dnormed, dh = _make(shape, dtype, 0.0, seed=1)

    def fn(a, b, c):
        y, h = FusedAddRMSNormFunction.apply(a.reshape(-1, n), b.reshape(-1, n), c, 1e-6, 0.0, max_block)
        return y.view(shape), h.view(shape)

    ours = _run(fn, x, residual, w, dnormed, dh)
    _check(ours, x, residual, w, dnormed, dh, 0.0, rows=3)
    _assert_h_is_torchs_add(ours[1], x, residual)


def test_mixed_dtypes_bf16_update_fp32_stream(monkeypatch):
    """The model under autocast: a bf16 attention/MLP output added to the fp32 residual stream, fp32 weight. h and
    normed
    are fp32 (as torch promotes), dx comes back in bf16 and dresidual in fp32, both from one launch."""
    shape = (3, 7, 781)
    x, residual, w, dnormed, dh = _make(shape, torch.bfloat16, res_dtype=torch.float32, w_dtype=torch.float32)
    launches = count_launches(monkeypatch, "_rms_norm_bwd_kernel")
    ours = _run(lambda a, b, c: fused_add_rms_norm(a, b, c), x, residual, w, dnormed, dh)
    assert len(launches) == 1
    _check(ours, x, residual, w, dnormed, dh, 0.0, rows=21)
    _assert_h_is_torchs_add(ours[1], x, residual)
    # one fp32 gradient, rounded once to each input's dtype (<= 1 bf16 ulp apart: the interpreter truncates)
    _assert_ulps(ours[2], ours[3].to(torch.bfloat16), torch.bfloat16, 1, "dx vs dresidual")


def test_one_gradient_for_both_inputs():
    x, residual, w, dnormed, dh = _make((37, 1000), torch.float32)
    x, residual, w = (t.requires_grad_() for t in (x, residual, w))
    normed, h = fused_add_rms_norm(x, residual, w)
    dx, dres = torch.autograd.grad([normed, h], [x, residual], [dnormed, dh])
    # one buffer, as d(x + residual) hands the one gradient to both
    assert dx.untyped_storage().data_ptr() == dres.untyped_storage().data_ptr() and torch.equal(dx, dres)


def test_gradients_accumulate_into_two_leaves():
    """x and residual both leaves, their gradients accumulated over two backward passes (gradient accumulation): the
    one gradient reaches both, but their .grad must not share memory. Before the host-work change the two were views
    of one buffer (one per reshape's backward node), AccumulateGrad kept both, and its in-place sum on the second pass
    added each gradient into both: x.grad and residual.grad came out wrong. Now autograd gets the one tensor twice and
    copies it for the second leaf."""
    x, residual, w, dnormed, dh = _make((5, 781), torch.float32)

    def accumulate(fn):
        leaves = [t.clone().requires_grad_() for t in (x, residual, w)]
        for _ in range(2):
            torch.autograd.backward(list(fn(*leaves)), [dnormed, dh])
        return [t.grad for t in leaves]

    got, want = accumulate(fused_add_rms_norm), accumulate(fused_add_rms_norm_ref)
    assert got[0].untyped_storage().data_ptr() != got[1].untyped_storage().data_ptr()
    for o, r, name in zip(got, want, NAMES[2:]):
        _assert_fp32_close(o, r, name, rows=10 if name == "dweight" else 1)


@pytest.mark.parametrize("shape, transposed", [((3, 5, 64), False), ((64,), False), ((3, 5, 64), True)], ids=str)
def test_any_rank_equals_the_2d_launchers(shape, transposed):
    """Inputs of any rank are read where they lie when contiguous (no view op) and reshaped otherwise: bit for bit what
    the (M, N) launchers give on the rows copied contiguous, outputs and gradients in x's shape."""
    n = shape[-1]
    x, residual, w, dnormed, dh = _make(shape, torch.bfloat16, w_dtype=torch.float32)
    if transposed:
        x, residual = (t.transpose(0, 1).contiguous().transpose(0, 1) for t in (x, residual))
    got = _run(lambda a, b, c: fused_add_rms_norm(a, b, c), x, residual, w, dnormed, dh)
    rows = [t.reshape(-1, n).contiguous() for t in (x, residual, dnormed, dh)]
    normed, h, rstd = fused_add_rms_norm_fwd(rows[0], rows[1], w, 1e-6, 0.0)
    dx, dres, dw = fused_add_rms_norm_bwd(rows[2], rows[3], h, w, rstd, 0.0, x.dtype, residual.dtype)
    for o, want in zip(got, (normed, h, dx, dres)):
        assert o.shape == shape and o.is_contiguous() and torch.equal(o, want.view(shape))
    assert torch.equal(got[4], dw)


def test_unused_outputs():
    """An unused h (autograd hands back None: no zero tensor is read) and an unused normed (d_h = d_h_out)."""
    x, residual, w, dnormed, dh = _make((5, 781), torch.float32)
    ref = _run(lambda a, b, c: fused_add_rms_norm_ref(a, b, c), x, residual, w, dnormed, torch.zeros_like(dh))
    xg, rg, wg = (t.clone().requires_grad_() for t in (x, residual, w))
    normed, _ = fused_add_rms_norm(xg, rg, wg)
    dx, dres, dw = torch.autograd.grad(normed, [xg, rg, wg], dnormed)
    for o, r, name in zip((dx, dres, dw), ref[2:], NAMES[2:]):
        _assert_fp32_close(o, r, name, rows=5 if name == "dweight" else 1)
    _, h = fused_add_rms_norm(xg, rg, wg)
    dx, dres, dw = torch.autograd.grad(h, [xg, rg, wg], dh, allow_unused=True)
    assert torch.equal(dx, dh) and torch.equal(dres, dh) and torch.equal(dw, torch.zeros_like(w))


def test_frozen_weight_and_empty_input():
    x, residual, w, dnormed, dh = _make((37, 1000), torch.bfloat16)
    xg, rg = x.clone().requires_grad_(), residual.clone().requires_grad_()
    normed, h = fused_add_rms_norm(xg, rg, w)  # the weight needs no gradient: no dweight partials
    dx, dres = torch.autograd.grad([normed, h], [xg, rg], [dnormed, dh])
    ref = _run(
        lambda a, b, c: fused_add_rms_norm_ref(a, b, c),
        x.float(),
        residual.float(),
        w.float(),
        dnormed.float(),
        dh.float(),
    )
    lowp = _run(_torch_lowp(0.0), x, residual, w, dnormed, dh)
    assert_lowp_close(dx, ref[2], lowp[2].float(), torch.bfloat16, name="dx", extra_ulps=1)

    empty, er = torch.empty(0, 3, 64, requires_grad=True), torch.empty(0, 3, 64, requires_grad=True)
    we = torch.ones(64, requires_grad=True)
    ye, he = fused_add_rms_norm(empty, er, we)
    assert ye.shape == he.shape == (0, 3, 64)
    grads = torch.autograd.grad([ye, he], [empty, er, we], [torch.empty(0, 3, 64)] * 2)
    assert grads[0].shape == (0, 3, 64) and torch.equal(grads[2], torch.zeros(64))


def test_no_host_sync(monkeypatch):
    x, residual, w, dnormed, dh = _make((3, 7, 781), torch.bfloat16)
    x, residual, w = (t.requires_grad_() for t in (x, residual, w))

    def boom(*args, **kwargs):
        raise AssertionError("host synchronisation inside fused_add_rms_norm")

    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "numpy", "cpu"):
        monkeypatch.setattr(torch.Tensor, name, boom)
    normed, h = fused_add_rms_norm(x, residual, w)
    grads = torch.autograd.grad([normed, h], [x, residual, w], [dnormed, dh])
    monkeypatch.undo()
    assert all(torch.isfinite(g.float()).all() for g in grads)


@pytest.mark.parametrize(
    "args, match",
    [
        (
            (torch.ones(4, 8, dtype=torch.int32), torch.ones(4, 8), torch.ones(8)),
            "fused_add_rms_norm: x must be a float32",
        ),
        ((torch.ones(4, 8), torch.ones(4, 8, dtype=torch.float64), torch.ones(8)), "residual must be a float32"),
        ((torch.ones(4, 8), torch.ones(4, 7), torch.ones(8)), r"residual must have x's shape \(4, 8\)"),
        ((torch.ones(4, 8), torch.ones(1, 8), torch.ones(8)), r"residual must have x's shape \(4, 8\)"),
        ((torch.ones(4, 8), torch.ones(4, 8), torch.ones(7)), r"weight must have shape \(8,\)"),
        ((torch.ones(4, 8), torch.ones(4, 8), torch.ones(8), -1.0), "eps must be a real number >= 0"),
    ],
)
def test_bad_input_errors(args, match):
    with pytest.raises((TypeError, ValueError), match=match):
        fused_add_rms_norm(*args)


def test_reference_path_and_compile_cpu():
    """Off Triton the reference runs (differentiable, no Function), and torch.compile(fullgraph) traces it."""
    x, residual, w, dnormed, dh = _make((3, 7, 781), torch.bfloat16, 1.0)
    want = _run(lambda a, b, c: fused_add_rms_norm_ref(a, b, c, 1e-6, 1.0), x, residual, w, dnormed, dh)
    with kernels.backend("reference"):
        got = _run(lambda a, b, c: fused_add_rms_norm(a, b, c, 1e-6, 1.0), x, residual, w, dnormed, dh)
    torch._dynamo.reset()
    compiled = torch.compile(
        lambda a, b, c: fused_add_rms_norm(a, b, c, 1e-6, 1.0), fullgraph=True, backend="aot_eager"
    )
    got_compiled = _run(compiled, x, residual, w, dnormed, dh)
    for g, c, r, name in zip(got, got_compiled, want, NAMES):
        assert torch.equal(g, r) and torch.equal(c, r), f"{name} differs from the eager reference"


def test_bench_fused_add_runs(tmp_path, monkeypatch):
    import bench.common
    from bench import bench_rms_norm

    monkeypatch.setattr(bench.common, "RESULTS", tmp_path)
    rows = bench_rms_norm.main(["--quick", "--op", "fused_add_rms_norm", "--compile-backend", "aot_eager"])
    assert {r["op"] for r in rows} == {"fused_add_rms_norm"} and {r["mode"] for r in rows} == {
        "forward",
        "backward",
        "full",
    }
    assert {"ours", "torch", "torch_compile"} <= {r["provider"] for r in rows}
    ours = {r["mode"]: r for r in rows if r["provider"] == "ours"}
    # 8 x 781 bf16: forward reads x and residual (2 + 2 B an element) and the weight once (0.25 B an element over 8
    # rows), writes h and normed (2 + 2); backward reads d_normed, d_h_out, h (6) and the weight, writes d_h and dweight
    assert ours["forward"]["bytes_rw_min"] == "4.25+4" and ours["backward"]["bytes_rw_min"] == "6.25+2.25"
    assert all(r["ms"] > 0 and r["perf_figure"] is False for r in rows)
