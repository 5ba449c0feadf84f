"""RMSNorm: the Triton kernels (through the interpreter on CPU) against the fp32 reference, PyTorch and HF.

Tolerance model (tests/tolerance.py):
- fp32: |ours - ref| <= 8 eps32 |ref|max for y and dx (row reductions of width <= 4113); dweight, a
  reduction over rows, gets an extra sqrt(rows).
- bf16/fp16: our error against the fp32 reference <= 2x PyTorch's own error running F.rms_norm in that
  dtype, + 1 bf16 ulp of |ref|max because the interpreter truncates fp32->bf16 stores (DESIGN.md).
- HF LlamaRMSNorm rounds twice in bf16 (normalised x, then x * weight) where we round once, so against it
  we assert we are no further from fp32 than 2x HF is (+1 interpreter ulp) and within 3 ulp of HF per
  element; Gemma's HF norm rounds once, like us, so it must agree to 1 ulp per element.
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

import kernels
from kernels.nn import RMSNorm
from kernels.rms_norm import (
    RMSNormFunction,
    bwd_launch_config,
    launch_config,
    rms_norm,
    rms_norm_bwd,
    rms_norm_fwd,
    rms_norm_ref,
)
from tests.tolerance import PoisonedTorch, assert_lowp_close, eps, fwd_bwd, max_abs_err

# `kernels.rms_norm` the attribute is the function; the module itself is reached through sys.modules.
rms_mod = importlib.import_module("kernels.rms_norm")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
EPS32 = torch.finfo(torch.float32).eps


@pytest.fixture(autouse=True)
def _triton_backend():
    with kernels.backend("triton"):
        yield


def _make(shape, dtype, offset, *, w_dtype=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = shape[-1]
    x = torch.randn(shape, generator=g).to(dtype)
    # Weights near their trained scale: around 1 for plain RMSNorm, around 0 with Gemma's offset.
    w = (torch.randn(n, generator=g) * 0.2 + (0.0 if offset else 1.0)).to(w_dtype or dtype)
    dy = torch.randn(shape, generator=g).to(dtype)
    return x, w, dy


def _assert_fp32_close(ours, ref, name, rows=1):
    assert ours.shape == ref.shape and ours.dtype == ref.dtype, (
        f"{name}: {ours.shape}/{ours.dtype} vs {ref.shape}/{ref.dtype}"
    )
    bound = 8 * EPS32 * math.sqrt(rows) * ref.abs().max().item()
    err = max_abs_err(ours, ref)
    assert err <= bound, f"{name}: fp32 error {err:.3e} > {bound:.3e}"


def _assert_ulps(ours, other, dtype, ulps, name):
    """Elementwise |ours - other| <= ulps * eps(dtype) * max(|ours|, |other|)."""
    diff = (ours.double() - other.double()).abs()
    bound = ulps * eps(dtype) * torch.maximum(ours.double().abs(), other.double().abs())
    worst = (diff - bound).max().item()
    assert worst <= 0, f"{name}: {int((diff > bound).sum())} elements beyond {ulps} ulp (worst excess {worst:.3e})"


def count_launches(monkeypatch, kernel_name):
    """The grids of every launch of kernels.rms_norm's `kernel_name` from now on (the list fills as they run)."""
    grids, kernel = [], getattr(rms_mod, kernel_name)

    class _Counting:
        def __getitem__(self, grid):
            grids.append(grid)
            return kernel[grid]

    monkeypatch.setattr(rms_mod, kernel_name, _Counting())
    return grids


def _autograd_nodes(t):
    """Names of the autograd nodes behind t, outermost first (a view follows the Function)."""
    names, node = [], t.grad_fn
    while node is not None:
        names.append((type(node).__name__, node))
        node = node.next_functions[0][0] if node.next_functions else None
    return names


def _check_all(ours, ref32, torch_lowp, dtype, rows):
    for o, r, t, name in zip(ours, ref32, torch_lowp, ("y", "dx", "dweight")):
        n = rows if name == "dweight" else 1
        if dtype == torch.float32:
            _assert_fp32_close(o, r, name, rows=n)
        else:
            # +1 ulp: the interpreter's fp32->bf16 stores truncate.
            assert_lowp_close(o, r, t.float(), dtype, name=name, extra_ulps=1 if dtype == torch.bfloat16 else 0)


@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1000,), (3, 7, 781), (37, 1000)], ids=str)
def test_matches_reference_and_torch(shape, dtype, offset):
    x, w, dy = _make(shape, dtype, offset)
    n = shape[-1]
    ours = fwd_bwd(lambda a, b: rms_norm(a, b, 1e-6, offset), x, w, dy)
    assert ours[0].dtype == dtype and ours[1].dtype == dtype and ours[2].dtype == dtype
    ref32 = fwd_bwd(lambda a, b: rms_norm_ref(a, b, 1e-6, offset), x.float(), w.float(), dy.float())
    torch_lowp = fwd_bwd(lambda a, b: F.rms_norm(a, (n,), offset + b, 1e-6), x, w, dy)
    rows = x.numel() // n
    _check_all(ours, ref32, torch_lowp, dtype, rows)
    if dtype == torch.float32:
        # PyTorch's own op in fp32 is a second, independent oracle.
        for o, t, name in zip(ours, torch_lowp, ("y", "dx", "dweight")):
            _assert_fp32_close(o, t, f"{name} vs F.rms_norm", rows=rows if name == "dweight" else 1)


# Two of the four (dtype, offset) pairs: each costs ~2 s of interpreter time and the loop code is the same.
@pytest.mark.parametrize("dtype, offset", [(torch.float32, 0.0), (torch.bfloat16, 1.0)], ids=str)
def test_multi_block_loop_path(dtype, offset):
    """Hidden 4096+17 with max_block=1024 runs the column loops (5 blocks, last one ragged)."""
    shape = (2, 5, 4096 + 17)
    n = shape[-1]
    assert launch_config(10, n, max_block=1024)[2] is False
    assert launch_config(10, n)[2] is True
    x, w, dy = _make(shape, dtype, offset, seed=1)

    def looped(a, b):
        return RMSNormFunction.apply(a.reshape(-1, n), b, 1e-6, offset, 1024).view(shape)

    ours = fwd_bwd(looped, x, w, dy)
    one_block = fwd_bwd(lambda a, b: rms_norm(a, b, 1e-6, offset), x, w, dy)
    ref32 = fwd_bwd(lambda a, b: rms_norm_ref(a, b, 1e-6, offset), x.float(), w.float(), dy.float())
    torch_lowp = fwd_bwd(lambda a, b: F.rms_norm(a, (n,), offset + b, 1e-6), x, w, dy)
    _check_all(ours, ref32, torch_lowp, dtype, rows=10)
    _check_all(one_block, ref32, torch_lowp, dtype, rows=10)


# Around both width switches of the backward: 8191 (one 8192-wide block), 8193 (one 16384-wide block, masked),
# 16384 (one block, no column predicate in 16 bits), 16385 (the column loop after the row-dot pass).
@pytest.mark.parametrize("n", [8191, 8193, 16384, 16385])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_wide_rows_backward(monkeypatch, dtype, n):
    """Hidden around 8192 and 16384: the forward keeps rows up to 16384 in registers, and so does the backward in every
    dtype (one 16384-wide block of 32 warps above 8192; bf16 and fp16 keep x and dy as loaded across the reduction and
    upcast them again, fp32 reloads the weight every row), spill-free on sm_90 (tests/kernels/test_sm90_compile.py).
    Wider rows loop over column blocks after a row-dot pass."""
    shape = (3, n)
    x, w, dy = _make(shape, dtype, 0.0, seed=2)
    rowdot_launches = count_launches(monkeypatch, "_rms_norm_bwd_rowdot_kernel")
    ours = fwd_bwd(lambda a, b: rms_norm(a, b), x, w, dy)
    assert len(rowdot_launches) == (1 if n > 16384 else 0)
    fp32 = dtype == torch.float32
    expected = {
        8191: (1, 8192, True, 16, 2, False, False),
        8193: (1, 16384, True, 32, 1, False, fp32),
        16384: (1, 16384, True, 32, 1, False, True) if fp32 else (1, 16384, True, 32, 2, True, False),
        16385: (1, 8192, False, 16, 2, False, False) if fp32 else (1, 16384, False, 32, 2, False, False),
    }[n]
    assert tuple(bwd_launch_config(3, n, dtype)) == expected
    ref32 = fwd_bwd(lambda a, b: rms_norm_ref(a, b), x.float(), w.float(), dy.float())
    torch_lowp = fwd_bwd(lambda a, b: F.rms_norm(a, (n,), b, 1e-6), x, w, dy)
    _check_all(ours, ref32, torch_lowp, dtype, rows=3)


def test_bwd_launch_config_fallbacks():
    # x and dy of different dtypes, and fp32 with dx written in two dtypes (fused add under autocast): 8192 blocks;
    # fp16 with fused add's d_h_out at exactly 16384: unpipelined, column predicate kept (12 bytes spilled otherwise)
    assert tuple(bwd_launch_config(3, 12288, None)) == (1, 8192, False, 16, 2, False, False)
    assert tuple(bwd_launch_config(3, 12288, torch.float32, two_dx=True)) == (1, 8192, False, 16, 2, False, False)
    assert tuple(bwd_launch_config(3, 16384, torch.float16, has_dh=True)) == (1, 16384, True, 32, 1, False, False)
    assert tuple(bwd_launch_config(3, 16384, torch.bfloat16, has_dh=True)) == (1, 16384, True, 32, 2, True, False)
    assert bwd_launch_config(3, 16384, torch.float32, max_block=1024)[:3] == (4, 1024, False)


@triton.jit
def _upcast_again_kernel(v_ptr, out_ptr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, rms_mod._upcast_again(tl.load(v_ptr + offs)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_upcast_again_is_exact_for_every_bit_pattern(dtype):
    """The backward's second upcast (integer paths, so the compiler keeps 16-bit x and dy live rather than fp32 copies)
    equals torch's conversion bit for bit for all 65536 values but NaNs (signed zeros, subnormals, normals,
    infinities), and NaNs stay NaN (fp16's path multiplies, which on a GPU may canonicalise a NaN's payload)."""
    v = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    out = torch.empty(v.shape, dtype=torch.float32)
    _upcast_again_kernel[(v.numel() // 4096,)](v, out, BLOCK=4096)
    nan = v.isnan()
    assert 0 < int(nan.sum()) < 2048 and out[nan].isnan().all()
    assert torch.equal(out[~nan].view(torch.int32), v[~nan].float().view(torch.int32))


@pytest.mark.parametrize("max_block", [None, 1024])
def test_eps_matters(max_block):
    """eps comparable to mean(x^2), so dropping or misplacing it shows (1e-6 on unit inputs would not)."""
    shape, e = (6, 4096 + 17), 1e-2
    x, w, dy = _make(shape, torch.float32, 0.0)
    x = x * 0.1
    ours = fwd_bwd(lambda a, b: RMSNormFunction.apply(a, b, e, 0.0, max_block), x, w, dy)
    ref = fwd_bwd(lambda a, b: rms_norm_ref(a, b, e), x, w, dy)
    loose = fwd_bwd(lambda a, b: rms_norm_ref(a, b, 0.0), x, w, dy)
    assert max_abs_err(loose[0], ref[0]) > 100 * 8 * EPS32 * ref[0].abs().max().item()
    for o, r, name in zip(ours, ref, ("y", "dx", "dweight")):
        _assert_fp32_close(o, r, name, rows=6 if name == "dweight" else 1)


@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_mixed_dtypes_bf16_x_fp32_weight(offset):
    shape = (3, 7, 781)
    x, w, dy = _make(shape, torch.bfloat16, offset, w_dtype=torch.float32)
    y, dx, dw = fwd_bwd(lambda a, b: rms_norm(a, b, 1e-6, offset), x, w, dy)
    assert (y.dtype, dx.dtype, dw.dtype) == (torch.bfloat16, torch.bfloat16, torch.float32)
    ref32 = fwd_bwd(lambda a, b: rms_norm_ref(a, b, 1e-6, offset), x.float(), w, dy.float())
    # PyTorch in the same mixed dtypes: the reference's autograd on bf16 x with the fp32 weight.
    lowp = fwd_bwd(lambda a, b: rms_norm_ref(a, b, 1e-6, offset), x, w, dy)
    assert_lowp_close(y, ref32[0], lowp[0], torch.bfloat16, name="y", extra_ulps=1)
    assert_lowp_close(dx, ref32[1], lowp[1], torch.bfloat16, name="dx", extra_ulps=1)
    # dweight stays fp32 end to end: only the bf16 rounding of x and dy separates it from fp32 math on them.
    _assert_fp32_close(dw, ref32[2], "dweight", rows=21)


def test_against_hf_llama_and_gemma_semantics():
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    shape, n = (37, 1000), 1000
    for dtype in (torch.float32, torch.bfloat16):
        x, w, dy = _make(shape, dtype, 0.0, seed=2)
        hf = LlamaRMSNorm(n, eps=1e-6).to(dtype)
        tnn = torch.nn.RMSNorm(n, eps=1e-6).to(dtype)

        def run_module(mod):
            with torch.no_grad():
                mod.weight.copy_(w)
            return fwd_bwd(lambda a, b: torch.func.functional_call(mod, {"weight": b}, (a,)), x, w, dy)

        ours = fwd_bwd(lambda a, b: rms_norm(a, b), x, w, dy)
        hf_out, tnn_out = run_module(hf), run_module(tnn)
        if dtype == torch.float32:
            # Same semantics in fp32: the cast HF does before the weight is a no-op.
            for o, h, t, name in zip(ours, hf_out, tnn_out, ("y", "dx", "dweight")):
                rows = 37 if name == "dweight" else 1
                _assert_fp32_close(o, h, f"{name} vs LlamaRMSNorm", rows)
                _assert_fp32_close(o, t, f"{name} vs nn.RMSNorm", rows)
        else:
            ref32 = fwd_bwd(lambda a, b: rms_norm_ref(a, b), x.float(), w.float(), dy.float())
            assert_lowp_close(ours[0], ref32[0], hf_out[0], dtype, name="y vs HF error", extra_ulps=1)
            assert_lowp_close(ours[1], ref32[1], hf_out[1], dtype, name="dx vs HF error", extra_ulps=1)
            # HF rounds twice (<= 1.5 ulp), the interpreter truncates once (<= 1 ulp): within 3 ulp of each other.
            _assert_ulps(ours[0], hf_out[0], dtype, 3, "y vs LlamaRMSNorm")

    # Gemma: (x * rstd) * (1 + w) in fp32, one cast, exactly our math with offset=1.
    x, w, dy = _make(shape, torch.bfloat16, 1.0, seed=3)
    gemma = GemmaRMSNorm(n, eps=1e-6).to(torch.bfloat16)
    with torch.no_grad():
        gemma.weight.copy_(w)
    ours = rms_norm(x, w, 1e-6, 1.0)
    _assert_ulps(ours, gemma(x), torch.bfloat16, 1, "y vs GemmaRMSNorm")


def test_saves_fp32_rstd_per_row():
    x, w, dy = _make((37, 1000), torch.bfloat16, 0.0)
    x.requires_grad_()
    y = rms_norm(x, w)
    node = dict(_autograd_nodes(y))["RMSNormFunctionBackward"]
    saved = [t for t in node.saved_tensors if t.shape == (37,)]
    assert len(saved) == 1 and saved[0].dtype == torch.float32
    ref = torch.rsqrt(x.detach().float().pow(2).mean(-1) + 1e-6)
    _assert_fp32_close(saved[0], ref, "rstd")


@pytest.mark.parametrize("max_block", [None, 1024])
def test_launcher_buffers_fully_written(monkeypatch, max_block):
    shape = (9, 4096 + 17) if max_block else (37, 781)
    x, w, dy = _make(shape, torch.float16, 1.0)
    poisoned = PoisonedTorch()
    monkeypatch.setattr(rms_mod, "torch", poisoned)
    y, rstd = rms_norm_fwd(x, w, 1e-6, 1.0, max_block=max_block)
    dx, dw = rms_norm_bwd(dy, x, w, rstd, 1.0, max_block=max_block)
    monkeypatch.undo()
    # y, rstd, dx, the dweight partials, and (looped path) the per-row c.
    assert poisoned.calls == (5 if max_block else 4)
    for t, name in ((y, "y"), (rstd, "rstd"), (dx, "dx"), (dw, "dweight")):
        assert torch.isfinite(t).all(), f"{name} has unwritten (NaN) elements"
    ref32 = fwd_bwd(lambda a, b: rms_norm_ref(a, b, 1e-6, 1.0), x.float(), w.float(), dy.float())
    lowp = fwd_bwd(lambda a, b: F.rms_norm(a, (shape[-1],), 1.0 + b, 1e-6), x, w, dy)
    _check_all((y, dx, dw), ref32, lowp, torch.float16, rows=shape[0])


@pytest.mark.parametrize("num_programs", [1, 3, 64])
def test_dweight_partials_any_program_count(num_programs):
    x, w, dy = _make((37, 1000), torch.float32, 0.0)
    y, rstd = rms_norm_fwd(x, w, 1e-6, 0.0)
    _, dw = rms_norm_bwd(dy, x, w, rstd, 0.0, num_programs=num_programs)
    ref = fwd_bwd(lambda a, b: rms_norm_ref(a, b), x, w, dy)[2]
    _assert_fp32_close(dw, ref, "dweight", rows=37)


def test_no_host_sync(monkeypatch):
    x, w, dy = _make((3, 7, 781), torch.bfloat16, 0.0)
    x.requires_grad_()
    w.requires_grad_()

    def boom(*args, **kwargs):
        raise AssertionError("host synchronisation inside rms_norm")

    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "numpy", "cpu"):
        monkeypatch.setattr(torch.Tensor, name, boom)
    y = rms_norm(x, w)
    dx, dw = torch.autograd.grad(y, [x, w], dy)
    monkeypatch.undo()
    assert torch.isfinite(dx.float()).all() and torch.isfinite(dw.float()).all()


def test_gradients_not_aliased():
    x, w, dy = _make((37, 1000), torch.float32, 0.0)
    x.requires_grad_()
    w.requires_grad_()
    y = rms_norm(x, w)
    dx, dw = torch.autograd.grad(y, [x, w], dy)
    held = [x, w, dy, y]
    for g in (dx, dw):
        assert all(g.untyped_storage().data_ptr() != t.untyped_storage().data_ptr() for t in held)
    dy_before, x_before = dy.clone(), x.detach().clone()
    dx.add_(1.0)
    assert torch.equal(dy, dy_before) and torch.equal(x.detach(), x_before)


def test_broadcast_and_noncontiguous_grads():
    """y.sum().backward() hands back a stride-0 dy; a transposed x has a non-unit column stride."""
    x, w, _ = _make((781, 5), torch.float32, 0.0)
    xt = x.t().requires_grad_()  # (5, 781), column stride 5
    w = torch.randn(781).requires_grad_()
    rms_norm(xt, w).sum().backward()
    x32, w32 = xt.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    rms_norm_ref(x32, w32).sum().backward()
    _assert_fp32_close(xt.grad, x32.grad, "dx")
    _assert_fp32_close(w.grad, w32.grad, "dweight", rows=5)


def _layout(layout, shape, dtype, seed=0):
    """(x, dy) of `shape` laid out as named: contiguous, transposed leading dims (rows not viewable as (M, N): copied),
    every other column of a wider tensor (rows viewable, columns copied), a row stride wider than the row, a stride-0
    dy (y.sum().backward()'s)."""
    g = torch.Generator().manual_seed(seed)
    n = shape[-1]
    x = torch.randn(shape, generator=g).to(dtype)
    dy = torch.randn(shape, generator=g).to(dtype)
    if layout == "transposed":
        x = x.transpose(0, 1).contiguous().transpose(0, 1)
        dy = dy.transpose(0, 1).contiguous().transpose(0, 1)
    elif layout == "strided_cols":
        x = torch.stack([x, -x], dim=-1).flatten(-2)[..., ::2]
    elif layout == "row_stride":
        x = torch.cat([x, torch.ones(*shape[:-1], 7, dtype=dtype)], dim=-1)[..., :n]
    elif layout == "expanded_dy":
        dy = dy[(0,) * (len(shape) - 1)].expand(shape)
    return x, dy


@pytest.mark.parametrize(
    "shape, layout",
    [
        ((3, 5, 64), "contiguous"),
        ((64,), "contiguous"),
        ((2, 3, 5, 64), "contiguous"),
        ((3, 5, 64), "transposed"),
        ((3, 5, 64), "strided_cols"),
        ((15, 64), "strided_cols"),
        ((15, 64), "row_stride"),
        ((3, 5, 64), "expanded_dy"),
        ((15, 64), "expanded_dy"),
    ],
    ids=str,
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_any_rank_and_layout_equals_the_2d_launchers(shape, layout, dtype):
    """rms_norm reads a 2-D or contiguous x (and dy) where it lies, with no view op, and reshapes only the rest: bit for
    bit what the (M, N) launchers give on the rows copied contiguous (the path every call took before the host-work
    change), y and dx in x's shape, contiguous."""
    n = shape[-1]
    x, dy = _layout(layout, shape, dtype)
    w = torch.randn(n, generator=torch.Generator().manual_seed(1))  # fp32, as under autocast
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = rms_norm(xg, wg, 1e-6, 1.0)
    dx, dw = torch.autograd.grad(y, [xg, wg], dy)
    x2, dy2 = x.reshape(-1, n).contiguous(), dy.reshape(-1, n).contiguous()
    y2, rstd = rms_norm_fwd(x2, w, 1e-6, 1.0)
    dx2, dw2 = rms_norm_bwd(dy2, x2, w, rstd, 1.0)
    for got, want in ((y, y2), (dx, dx2)):
        assert got.shape == shape and got.is_contiguous() and got.dtype == dtype
        assert torch.equal(got, want.view(shape))
    assert torch.equal(dw, dw2)


def test_fp32_accumulation():
    # 4113 ones: a bf16 running sum of squares stalls at 256 (8-bit mantissa); fp32 gets mean 1 exactly.
    n = 4096 + 17
    w = (torch.rand(n, generator=torch.Generator().manual_seed(0)) + 0.5).to(torch.bfloat16)
    x = torch.ones(2, n, dtype=torch.bfloat16)
    for max_block in (None, 1024):
        y, rstd = rms_norm_fwd(x, w, 0.0, 0.0, max_block=max_block)
        assert torch.equal(rstd, torch.ones(2)) and torch.equal(y, w.expand(2, n))
    # fp16 x = 300: x^2 = 90000 overflows fp16 (max 65504) unless squared in fp32.
    x16 = torch.full((4, 64), 300.0, dtype=torch.float16)
    w16 = torch.linspace(0.5, 2.0, 64, dtype=torch.float16)
    y16 = rms_norm(x16, w16, 0.0)
    _assert_ulps(y16, w16.expand(4, 64), torch.float16, 1, "fp16 x=300")
    # dweight over 2048 rows of dy * xh = 1: bf16 partial sums would stall at 256.
    x = torch.ones(2048, 8, dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(8, dtype=torch.bfloat16, requires_grad=True)
    dw = torch.autograd.grad(rms_norm(x, w, 0.0), w, torch.ones(2048, 8, dtype=torch.bfloat16))[0]
    assert torch.equal(dw, torch.full((8,), 2048.0, dtype=torch.bfloat16))


def test_frozen_weight_and_empty_input():
    x, w, dy = _make((37, 1000), torch.float32, 0.0)
    x.requires_grad_()
    y = rms_norm(x, w)  # weight does not require grad: the backward skips the dweight partials
    (dx,) = torch.autograd.grad(y, [x], dy)
    ref = fwd_bwd(lambda a, b: rms_norm_ref(a, b), x, w, dy)[1]
    _assert_fp32_close(dx, ref, "dx")

    empty = torch.empty(0, 3, 64, requires_grad=True)
    we = torch.ones(64, requires_grad=True)
    ye = rms_norm(empty, we)
    assert ye.shape == (0, 3, 64)
    dxe, dwe = torch.autograd.grad(ye, [empty, we], torch.empty(0, 3, 64))
    assert dxe.shape == (0, 3, 64) and torch.equal(dwe, torch.zeros(64))


@pytest.mark.parametrize(
    "args, match",
    [
        ((torch.ones(4, 8, dtype=torch.int32), torch.ones(8)), "x must be a float32, bfloat16 or float16"),
        ((torch.ones(4, 8, dtype=torch.float64), torch.ones(8)), "x must be a float32, bfloat16 or float16"),
        ((torch.ones(4, 8), torch.ones(7)), r"weight must have shape \(8,\)"),
        ((torch.ones(4, 8), torch.ones(8, dtype=torch.int64)), "weight must be a float32"),
        ((torch.ones(4, 8), torch.ones(8), -1.0), "eps must be a real number >= 0"),
        ((torch.ones(4, 8), torch.ones(8), "1e-6"), "eps must be a real number >= 0"),
        ((torch.ones(4, 8), torch.ones(8), 1e-6, "one"), "offset must be a real number"),
        ((torch.ones(4, 0), torch.ones(0)), "hidden size"),
        ((torch.tensor(1.0), torch.ones(1)), "hidden size"),
    ],
)
def test_bad_input_errors(args, match):
    with pytest.raises((TypeError, ValueError), match=match):
        rms_norm(*args)


def test_bad_module_and_launcher_args():
    with pytest.raises(ValueError, match="hidden_size must be a positive int"):
        RMSNorm(0)
    with pytest.raises(ValueError, match="eps must be a real number"):
        RMSNorm(8, eps=-1.0)
    with pytest.raises(ValueError, match="offset must be a real number"):
        RMSNorm(8, offset=None)
    with pytest.raises(ValueError, match="max_block=1000 must be a power of two"):
        launch_config(4, 4096, max_block=1000)


def test_module_matches_hf_state_dict_and_init():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    ours, hf, tnn = RMSNorm(781), LlamaRMSNorm(781), torch.nn.RMSNorm(781, eps=1e-6)
    assert ours.state_dict().keys() == hf.state_dict().keys() == tnn.state_dict().keys() == {"weight"}
    assert torch.equal(ours.weight, torch.ones(781))
    gemma_like = RMSNorm(781, offset=1.0)
    assert torch.equal(gemma_like.weight, torch.zeros(781))
    assert repr(ours) == "RMSNorm(781, eps=1e-06)"
    assert repr(gemma_like) == "RMSNorm(781, eps=1e-06, offset=1.0)"

    with torch.no_grad():
        hf.weight.normal_()
    ours.load_state_dict(hf.state_dict(), strict=True)
    tnn.load_state_dict(ours.state_dict(), strict=True)
    x = torch.randn(3, 7, 781, requires_grad=True)
    y = ours(x)
    _assert_fp32_close(y, hf(x), "module y vs LlamaRMSNorm")
    y.sum().backward()
    assert ours.weight.grad is not None and ours.weight.grad.shape == (781,)


def test_reference_is_differentiable():
    x = torch.randn(3, 17, dtype=torch.float64, requires_grad=True)
    w = torch.randn(17, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: rms_norm_ref(a, b, 1e-6, 1.0), (x, w))
    with kernels.backend("reference"):
        x32 = x.detach().float().requires_grad_()
        y = rms_norm(x32, w.detach().float())
        assert y.grad_fn is not None and "RMSNormFunctionBackward" not in dict(_autograd_nodes(y))


def test_torch_compile_fullgraph_cpu():
    torch._dynamo.reset()
    x, w, dy = _make((3, 7, 781), torch.bfloat16, 1.0)
    module = RMSNorm(781, offset=1.0).to(torch.bfloat16)
    with torch.no_grad():
        module.weight.copy_(w)
    compiled_fn = torch.compile(lambda a, b: rms_norm(a, b, 1e-6, 1.0), fullgraph=True, backend="aot_eager")
    compiled_mod = torch.compile(module, fullgraph=True, backend="aot_eager")
    got = fwd_bwd(compiled_fn, x, w, dy)
    want = fwd_bwd(lambda a, b: rms_norm_ref(a, b, 1e-6, 1.0), x, w, dy)
    for g, r, name in zip(got, want, ("y", "dx", "dweight")):
        assert torch.equal(g, r), f"compiled {name} differs from the eager reference"
    xm = x.clone().requires_grad_()
    ym = compiled_mod(xm)
    assert torch.equal(ym, want[0])
    ym.backward(dy)
    assert torch.equal(xm.grad, want[1]) and torch.equal(module.weight.grad, want[2])


@pytest.mark.gpu
def test_cuda_triton_compiles_fullgraph_without_fp64():
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    x, w, dy = (t.cuda() for t in _make((64, 1000), torch.bfloat16, 1.0, w_dtype=torch.float32))

    def step(fn):
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = fn(xx, ww)
        dx, dw = torch.autograd.grad(y, [xx, ww], dy)
        return y, dx, dw

    compiled = torch.compile(lambda a, b: rms_norm(a, b, 1e-6, 1.0), fullgraph=True)
    got, codes = run_and_get_code(step, compiled)
    source = "\n".join(codes)
    assert "_rms_norm_fwd_kernel" in source and "_rms_norm_bwd_kernel" in source, "compiled graph skipped Triton"
    eager = step(lambda a, b: rms_norm(a, b, 1e-6, 1.0))
    # Bitwise equal to the eager launch, where Triton types Python floats as fp32: had Inductor's fp64
    # float arguments leaked into the row math, rstd (and so y and dx) would differ in the low bits.
    assert torch.equal(got[0], eager[0]) and torch.equal(got[1], eager[1])
    _assert_fp32_close(got[2], eager[2], "dweight", rows=64)
    ref32 = step(lambda a, b: rms_norm_ref(a.float(), b, 1e-6, 1.0))
    assert_lowp_close(got[0], ref32[0], rms_norm_ref(x, w, 1e-6, 1.0), torch.bfloat16, name="y")


def test_bench_rms_norm_runs(tmp_path, monkeypatch):
    import bench.common
    from bench import bench_rms_norm

    monkeypatch.setattr(bench.common, "RESULTS", tmp_path)
    rows = bench_rms_norm.main(["--quick", "--compile-backend", "aot_eager"])
    assert (tmp_path / "rms_norm.jsonl").exists() and (tmp_path / "rms_norm.md").exists()
    providers = {r["provider"] for r in rows}
    assert {"ours", "torch", "torch_compile"} <= providers
    assert {r["mode"] for r in rows} == {"forward", "backward", "full"}
    assert all(r["ms"] > 0 and r["perf_figure"] is False for r in rows)
