"""Gated DeltaNet's short causal convolution with its SiLU (kernels/causal_conv1d.py): the Triton kernels (through the
interpreter on CPU) against the fp64 reference, packed rows restarting at every sequence, and transformers' own
convolution.

Tolerance model (tests/tolerance.py):
- fp32: W products and an activation per element: y and dx within 1e-5 of |ref|max, dweight and dbias (sums over
  tokens) within 1e-5 of theirs.
- bf16/fp16: our error against the fp32 reference <= 2x PyTorch's own error running the reference's math in that
  dtype (F.conv1d and F.silu on bf16 tensors), + 1 ulp of |ref|max (the interpreter truncates fp32 stores).
"""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels.causal_conv1d import causal_conv1d, causal_conv1d_bwd, causal_conv1d_ref
from tests.tolerance import PoisonedTorch, assert_lowp_close

module = importlib.import_module("kernels.causal_conv1d")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(autouse=True)
def _triton_backend():
    with kernels.backend("triton"):
        yield


def _inputs(B, T, D, W, dtype, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, dy = (torch.randn(B, T, D, generator=g).to(dtype) for _ in range(2))
    w = (0.5 * torch.randn(D, W, generator=g)).to(dtype)
    b = (0.1 * torch.randn(D, generator=g)).to(dtype) if bias else None
    return x, w, b, dy


def _run(fn, x, w, b, dy, activation="silu", cu_seqlens=None):
    leaves = [t.detach().clone().requires_grad_() for t in (x, w, b) if t is not None]
    x, w, b = leaves[0], leaves[1], (leaves[2] if len(leaves) == 3 else None)
    y = fn(x, w, b, activation, cu_seqlens)
    return (y.detach(), *torch.autograd.grad(y, leaves, dy))


def _lowp_reference(x, w, b, activation, cu_seqlens):
    """The reference's convolution in x's own dtype (PyTorch's error in that dtype, for the bound)."""
    B, T, D = x.shape
    W = w.shape[1]
    out = []
    ends = [0, T] if cu_seqlens is None else cu_seqlens.tolist()
    for start, end in zip(ends, ends[1:]):
        if end == start:  # an empty sequence
            continue
        part = F.pad(x[:, start:end].transpose(1, 2), (W - 1, 0))
        y = F.conv1d(part, w[:, None, :], b, groups=D).transpose(1, 2)
        out.append(F.silu(y) if activation == "silu" else y)
    return torch.cat(out, dim=1)


CASES = [  # B, T, D, W, bias, activation, cu_seqlens
    (2, 37, 200, 4, False, "silu", None),  # Qwen3.5's layout: no bias, SiLU; ragged tokens and channels
    (1, 50, 130, 4, True, None, [0, 7, 9, 50]),  # packed sequences, one of 2 tokens (shorter than the taps)
    (1, 40, 64, 3, True, "silu", [0, 0, 17, 40]),  # an empty sequence; 3 taps
    (3, 5, 33, 2, False, "silu", None),  # rows shorter than a tile
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_values_and_gradients_match_the_reference(case, dtype):
    B, T, D, W, bias, activation, cu = case
    cu = None if cu is None else torch.tensor(cu)
    x, w, b, dy = _inputs(B, T, D, W, dtype, bias)
    ours = _run(causal_conv1d, x, w, b, dy, activation, cu)
    ref = _run(causal_conv1d_ref, *(None if t is None else t.double() for t in (x, w, b, dy)), activation, cu)
    names = ("y", "dx", "dweight", "dbias")
    for name, o, r in zip(names, ours, ref):
        assert o.dtype == dtype and o.shape == r.shape, name
        if dtype == torch.float32:
            torch.testing.assert_close(o.double(), r, atol=1e-5 * r.abs().max().item(), rtol=0, msg=name)
    if dtype != torch.float32:
        eager = _run(_lowp_reference, x, w, b, dy, activation, cu)
        for name, o, r, e in zip(names, ours, ref, eager):
            assert_lowp_close(o, r.float(), e, dtype, name=name, extra_ulps=1)


def test_a_packed_row_gives_each_sequence_as_if_alone():
    x, w, b, dy = _inputs(1, 45, 96, 4, torch.float32, True, seed=1)
    cu = torch.tensor([0, 12, 13, 45])
    packed = _run(causal_conv1d, x, w, b, dy, "silu", cu)
    for start, end in zip(cu.tolist(), cu.tolist()[1:]):
        alone = _run(causal_conv1d, x[:, start:end], w, b, dy[:, start:end], "silu")
        torch.testing.assert_close(packed[0][:, start:end], alone[0], atol=1e-6, rtol=0)
        torch.testing.assert_close(packed[1][:, start:end], alone[1], atol=1e-6, rtol=0)


def test_the_layers_own_conv1d_agrees_in_fp32():
    """transformers' fallback for a Gated DeltaNet: the layer's nn.Conv1d (padded by W - 1), cut to T, then SiLU."""
    x, w, _, _ = _inputs(2, 30, 64, 4, torch.float32, False, seed=2)
    conv = torch.nn.Conv1d(64, 64, 4, groups=64, bias=False, padding=3)
    with torch.no_grad():
        conv.weight.copy_(w[:, None, :])
    expected = F.silu(conv(x.transpose(1, 2))[..., :30]).transpose(1, 2)
    torch.testing.assert_close(causal_conv1d(x, w), expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("programs", [1, 2, 7])
def test_dweight_sums_every_programs_tokens(programs):
    x, w, b, dy = _inputs(2, 70, 40, 4, torch.float32, True, seed=3)
    from kernels.causal_conv1d import token_starts

    starts = token_starts(2, 70, None, x.device)
    _, dw, db = causal_conv1d_bwd(dy.reshape(140, 40), x.reshape(140, 40), w, b, starts, True, programs)
    ref = _run(causal_conv1d_ref, *(t.double() for t in (x, w, b, dy)))
    torch.testing.assert_close(dw.double(), ref[2], atol=1e-5 * ref[2].abs().max().item(), rtol=0)
    torch.testing.assert_close(db.double(), ref[3], atol=1e-5 * ref[3].abs().max().item(), rtol=0)


def test_every_output_element_is_written(monkeypatch):
    poisoned = PoisonedTorch()  # outputs allocated full of NaN: an element a launch forgets shows up
    monkeypatch.setattr(module, "torch", poisoned)
    x, w, b, dy = _inputs(2, 37, 200, 4, torch.bfloat16, True)
    ours = _run(causal_conv1d, x, w, b, dy)
    assert poisoned.calls and all(torch.isfinite(t.float()).all() for t in ours)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(weight=torch.zeros(5, 4)), r"x must be \(B, T, D\) and weight \(D, W\) for the same D"),
        (dict(bias=torch.zeros(3)), r"bias must be \(8,\) or None"),
        (dict(activation="gelu"), r"activation must be one of \(None, 'silu'\)"),
        (dict(cu_seqlens=torch.tensor([0, 3])), "cu_seqlens must rise from 0 to T = 6"),
        (dict(weight=torch.zeros(8, 9)), "the Triton kernels take float32/bfloat16/float16 x and up to 8 taps"),
    ],
)
def test_bad_arguments_are_one_line(change, message):
    args = dict(x=torch.zeros(1, 6, 8), weight=torch.zeros(8, 4), bias=None, activation="silu") | change
    with pytest.raises(ValueError, match="^causal_conv1d: " + message):
        causal_conv1d(**args)
