"""Tests for kernels/neftune.py: NEFTune noise, Triton path (interpreter on CPU) and PyTorch reference.

The two paths draw different random numbers, so they are checked against the semantics, not each other:
- bounds: |noise| <= alpha / sqrt(L * d) per sequence / packed document (x1 + 1e-6 for the fp32
  rounding of the magnitude), and the largest |noise| of every sequence reaches 0.95 of its own bound
  (hundreds of U(-1, 1) draws: missing 0.95 has probability < 1e-4, and the seeds are fixed), which
  tells L from T;
- distribution on 8192 draws of u = noise / bound: mean 0 and variance 1/3 within 5 standard errors,
  8-bin histogram within 5 binomial standard errors, streams uncorrelated, values not repeated;
- exactness: padding unchanged, gradient the identity, training=False / alpha=0 return the input;
- low precision: y = x + noise is computed in fp32 and rounded once, so y matches the fp32 result on the
  same seed within the tolerance model of tests/tolerance.py (Triton bf16: one extra ulp for the
  interpreter's truncating stores);
- determinism: the same generator seed gives identical outputs on each path.
Run: python -m pytest tests/kernels/test_neftune.py -q
"""

from __future__ import annotations

import math

import pytest
import torch

import kernels
from kernels.neftune import NEFTuneFunction, neftune_fwd, neftune_noise, neftune_noise_ref
from tests.tolerance import assert_lowp_close, poisoned_like

PATHS = ["triton", "reference"]
ALPHA = 5.0


def run(path, embeds, alpha=ALPHA, **kw):
    with kernels.backend(path):
        return neftune_noise(embeds, alpha, **kw)


def gen(seed):
    return torch.Generator().manual_seed(seed)


def packed_position_ids(rows):
    """rows: per row, a list of document lengths -> (B, T) positions restarting at 0 for each document."""
    return torch.stack([torch.cat([torch.arange(n) for n in docs]) for docs in rows])


def check_segment(noise, length, d, where):
    """noise: the values of one sequence/document (length * d of them) -> within and reaching its bound."""
    bound = ALPHA / math.sqrt(length * d)
    top = noise.abs().max().item()
    assert top <= bound * (1 + 1e-6), f"{where}: max |noise| {top:.6g} > bound {bound:.6g} (L={length})"
    assert top >= 0.95 * bound, f"{where}: max |noise| {top:.6g} < 0.95 x bound {bound:.6g}: wrong L={length}?"


@pytest.mark.parametrize("path", PATHS)
def test_distribution_without_mask(path):
    B, T, d = 4, 16, 128
    noise = run(path, torch.zeros(B, T, d), generator=gen(0))  # (B, T, d): zeros in, so out is the noise
    bound = ALPHA / math.sqrt(T * d)  # Hugging Face: L = T, the padded length
    check_segment(noise, T, d, "batch")
    u = (noise / bound).double().reshape(-1)  # (8192,) ~ U(-1, 1)
    n = u.numel()
    assert abs(u.mean().item()) <= 5 * math.sqrt(1 / 3 / n)
    assert abs(u.var().item() - 1 / 3) <= 5 * math.sqrt(4 / 45 / n)  # var(u^2) = 1/5 - 1/9
    frac = torch.histc(u, bins=8, min=-1, max=1) / n  # (8,)
    assert (frac - 1 / 8).abs().max().item() <= 5 * math.sqrt((1 / 8) * (7 / 8) / n)
    # The kernel's four Philox outputs feed four column quarters: they must not be copies of one another.
    q = u.view(B * T, 4, d // 4)
    for j in range(1, 4):
        corr = torch.corrcoef(torch.stack([q[:, 0].reshape(-1), q[:, j].reshape(-1)]))[0, 1].item()
        assert abs(corr) <= 5 / math.sqrt(n / 4), f"quarters 0 and {j} correlate: {corr:.3f}"
    # Reused Philox counters would repeat whole blocks of values; fp32 rounding allows a few ties.
    assert torch.unique(noise).numel() >= 0.99 * n


@pytest.mark.parametrize("path", PATHS)
def test_no_mask_magnitude_matches_hugging_face(path):
    from transformers.integrations.neftune import neftune_post_forward_hook

    module = torch.nn.Module()
    module.neftune_noise_alpha = ALPHA
    B, T, d = 2, 8, 96
    torch.manual_seed(1)
    hf = neftune_post_forward_hook(module, None, torch.zeros(B, T, d))  # (B, T, d)
    ours = run(path, torch.zeros(B, T, d), generator=gen(1))  # (B, T, d)
    check_segment(hf, T, d, "hugging face")
    check_segment(ours, T, d, path)


@pytest.mark.parametrize("path", PATHS)
def test_mask_uses_each_sequence_length_and_spares_padding(path):
    B, T, d = 4, 12, 64
    mask = torch.zeros(B, T, dtype=torch.long)
    mask[0] = 1  # full row
    mask[1, :5] = 1  # right padding
    mask[2, 9:] = 1  # left padding
    # row 3: all padding
    noise = run(path, torch.zeros(B, T, d), attention_mask=mask, generator=gen(2))  # (B, T, d)
    for b in range(3):
        real = mask[b].bool()
        check_segment(noise[b, real], int(real.sum()), d, f"row {b}")
    x = torch.randn(B, T, d)
    y = run(path, x, attention_mask=mask.bool(), generator=gen(3))  # (B, T, d); bool masks work too
    pad = mask == 0
    assert torch.equal(y[pad], x[pad]), "padding must get no noise"
    assert (y[~pad] != x[~pad]).float().mean() > 0.99


@pytest.mark.parametrize("path", PATHS)
def test_packed_rows_use_each_document_length(path):
    d = 64
    docs = [[5, 3, 4], [12], [1, 11]]
    pos = packed_position_ids(docs)  # (3, 12)
    noise = run(path, torch.zeros(3, 12, d), position_ids=pos, generator=gen(4))  # (3, 12, d)
    for b, row in enumerate(docs):
        start = 0
        for n in row:
            if n * d >= 128:  # enough draws to reach 0.95 of the bound
                check_segment(noise[b, start : start + n], n, d, f"row {b} doc at {start}")
            else:
                assert noise[b, start : start + n].abs().max() <= ALPHA / math.sqrt(n * d) * (1 + 1e-6)
            start += n


@pytest.mark.parametrize("path", PATHS)
def test_packed_rows_with_mask_and_broadcast_positions(path):
    d = 64
    # Row 0: docs of 5 and 4 tokens, then 3 padding tokens whose positions restart (their own "document").
    # Row 1: docs of 2 and 7 tokens, then 3 padding tokens whose positions continue the last document:
    # the mask must keep them out of its length (7, not 10).
    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1, 2], [0, 1, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9]])  # (2, 12)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[:, 9:] = 0
    x = torch.randn(2, 12, d)
    zeros = torch.zeros(2, 12, d)
    noise = run(path, zeros, attention_mask=mask, position_ids=pos, generator=gen(5))  # (2, 12, d)
    check_segment(noise[0, :5], 5, d, "row 0 doc 0")
    check_segment(noise[0, 5:9], 4, d, "row 0 doc 1")
    check_segment(noise[1, :2], 2, d, "row 1 doc 0")
    check_segment(noise[1, 2:9], 7, d, "row 1 doc 1")
    y = run(path, x, attention_mask=mask, position_ids=pos, generator=gen(5))  # (2, 12, d)
    assert torch.equal(y[:, 9:], x[:, 9:])
    # (1, T) position ids apply to every row.
    same = packed_position_ids([[6, 6]])  # (1, 12)
    noise = run(path, torch.zeros(2, 12, d), position_ids=same, generator=gen(6))  # (2, 12, d)
    for b in range(2):
        check_segment(noise[b, :6], 6, d, f"row {b} doc 0")
        check_segment(noise[b, 6:], 6, d, f"row {b} doc 1")


@pytest.mark.parametrize("path", PATHS)
def test_eval_and_zero_alpha_return_the_input(path):
    x = torch.randn(2, 5, 32, requires_grad=True)
    assert run(path, x, training=False) is x
    assert run(path, x, alpha=0, attention_mask=torch.ones(2, 5)) is x
    assert run(path, x, alpha=0.0, training=True) is x
    empty = torch.zeros(2, 0, 32)
    assert run(path, empty) is empty


@pytest.mark.parametrize("path", PATHS)
def test_determinism(path):
    x = torch.randn(2, 6, 100)
    mask = torch.ones(2, 6)
    a = run(path, x, attention_mask=mask, generator=gen(7))
    b = run(path, x, attention_mask=mask, generator=gen(7))
    c = run(path, x, attention_mask=mask, generator=gen(8))
    assert torch.equal(a, b)
    assert (a != c).float().mean() > 0.99
    g = gen(7)
    first, second = run(path, x, generator=g), run(path, x, generator=g)
    assert (first != second).float().mean() > 0.99, "a generator's state must advance between calls"
    torch.manual_seed(9)
    d1 = run(path, x)
    torch.manual_seed(9)
    d2 = run(path, x)
    assert torch.equal(d1, d2), "generator=None must follow the global seed"


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gradient_is_identity_and_nothing_saved(path, dtype):
    x = torch.randn(3, 7, 781, dtype=dtype, requires_grad=True)
    mask = torch.ones(3, 7)
    mask[1, 3:] = 0
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = run(path, x, attention_mask=mask, generator=gen(10))  # (3, 7, 781)
    assert saved == [], "the noise (or anything else) must not be saved for backward"
    grad = torch.randn_like(y)
    y.backward(grad)
    assert torch.equal(x.grad, grad)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dtypes_compute_in_fp32_and_round_once(path, dtype):
    B, T, d = 3, 7, 781  # awkward: d is odd, so the last column quarter is ragged
    mask = torch.ones(B, T)
    mask[2, 5:] = 0
    noise32 = run(path, torch.zeros(B, T, d), attention_mask=mask, generator=gen(11))  # (B, T, d) fp32
    x = torch.randn(B, T, d).to(dtype)
    y = run(path, x, attention_mask=mask, generator=gen(11))  # same seed: same fp32 noise
    assert y.dtype == dtype and y.shape == x.shape
    ref32 = x.float() + noise32  # (B, T, d)
    extra = 1 if (path == "triton" and dtype == torch.bfloat16) else 0
    assert_lowp_close(y, ref32, ref32.to(dtype), dtype, name=f"{path} y", extra_ulps=extra)
    assert torch.equal(y[2, 5:], x[2, 5:])


def test_launcher_writes_every_element_and_follows_strides():
    base = torch.randn(3, 7, 800)
    x = base[:, :, :781]  # (3, 7, 781), row stride 800
    seed = torch.tensor([1234], dtype=torch.int64)
    out = poisoned_like(x.contiguous())  # NaNs: every element must be overwritten
    y = neftune_fwd(x, seed, 0.01, out=out)
    assert y is out and not torch.isnan(y).any()
    assert torch.equal(y, neftune_fwd(x.contiguous(), seed, 0.01)), "strided input changed the noise"
    assert (y - x).abs().max() <= 0.01 * (1 + 1e-6) + 1e-6  # + the fp32 rounding of x + noise, |x| < 8
    row_scale = torch.rand(21)  # (21,)
    row_scale[::3] = 0
    z = neftune_fwd(x, seed, 0.0, row_scale, out=poisoned_like(out))  # (3, 7, 781)
    per_row = (z - x).reshape(21, 781).abs().amax(dim=1)  # (21,)
    assert torch.all(per_row <= row_scale * (1 + 1e-6) + 1e-6) and torch.all(per_row[::3] == 0)


def test_noise_is_independent_of_batch_size():
    # The counter is (row, column): row r gets the same noise in a batch of 2 and of 5 (same seed and L).
    small = run("triton", torch.zeros(2, 4, 36), generator=gen(12))
    large = run("triton", torch.zeros(5, 4, 36), generator=gen(12))
    assert torch.equal(small, large[:2])


def test_custom_op_registration():
    # The triton_op torch.compile traces on a GPU; the full opcheck (aot dispatch too) runs in the gpu test,
    # because tracing its body here would run the interpreter on fake tensors.
    x = torch.randn(2, 3, 40)
    seed = torch.tensor([5], dtype=torch.int64)
    checks = ("test_schema", "test_autograd_registration", "test_faketensor")
    torch.library.opcheck(torch.ops.kernelwright.neftune_fwd, (x, seed, 0.1, None), test_utils=checks)
    torch.library.opcheck(torch.ops.kernelwright.neftune_fwd, (x, seed, 0.1, torch.rand(6)), test_utils=checks)


def test_function_is_used_on_the_triton_path():
    x = torch.randn(2, 3, 8, requires_grad=True)
    assert type(run("triton", x, generator=gen(0)).grad_fn).__name__ == f"{NEFTuneFunction.__name__}Backward"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"alpha": -1.0}, "alpha must be a finite number >= 0"),
        ({"alpha": float("nan")}, "alpha must be"),
        ({"alpha": float("inf")}, "alpha must be"),
        ({"alpha": "5"}, "alpha must be"),
        ({"alpha": True}, "alpha must be"),
        ({"embeds": torch.zeros(4, 8)}, "embeds must be a \\(batch, seq, hidden\\)"),
        ({"embeds": torch.zeros(2, 4, 8, dtype=torch.int32)}, "embeds must be"),
        ({"attention_mask": torch.ones(2, 5)}, "attention_mask must be a \\(batch, seq\\) = \\(2, 4\\)"),
        ({"position_ids": torch.zeros(2, 4)}, "position_ids must be an integer"),
        ({"position_ids": torch.zeros(3, 4, dtype=torch.long)}, "position_ids must be"),
        ({"generator": 0}, "generator must be a torch.Generator"),
        ({"training": "yes"}, "training must be True or False"),
    ],
)
@pytest.mark.parametrize("fn", [neftune_noise, neftune_noise_ref])
def test_bad_input_errors(fn, kwargs, match):
    args = {"embeds": torch.zeros(2, 4, 8), "alpha": ALPHA, **kwargs}
    with pytest.raises(ValueError, match=match):
        fn(**args)


def test_compile_fullgraph_cpu_takes_the_reference():
    d = 48
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]])  # (2, 10)
    mask = torch.ones(2, 10)
    mask[1, 6:] = 0

    def step(e, m, p):
        return neftune_noise(e, ALPHA, attention_mask=m, position_ids=p) * 1.0

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    x = torch.zeros(2, 10, d, requires_grad=True)
    torch.manual_seed(13)
    y = compiled(x, mask, pos)  # (2, 10, d)
    check_segment(y[0, :4], 4, d, "row 0 doc 0")
    check_segment(y[0, 4:], 6, d, "row 0 doc 1")
    check_segment(y[1, :6], 6, d, "row 1")
    assert torch.equal(y[1, 6:], x[1, 6:])
    grad = torch.randn_like(y)
    y.backward(grad)
    assert torch.equal(x.grad, grad)


@pytest.mark.gpu
def test_triton_on_cuda_with_compile_fullgraph():
    B, T, d = 4, 256, 1024
    mask = torch.ones(B, T, device="cuda")
    mask[1, 100:] = 0
    x = torch.randn(B, T, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    zeros = torch.zeros(B, T, d, device="cuda")
    g = torch.Generator(device="cuda")
    a = neftune_noise(zeros, ALPHA, attention_mask=mask, generator=g.manual_seed(0))
    b = neftune_noise(zeros, ALPHA, attention_mask=mask, generator=g.manual_seed(0))
    assert torch.equal(a, b)
    check_segment(a[1, :100].cpu(), 100, d, "cuda row 1")
    cpu_gen = neftune_noise(zeros, ALPHA, generator=gen(0))  # CPU generator, CUDA embeds
    check_segment(cpu_gen.cpu(), T, d, "cuda, cpu generator")

    seed = torch.tensor([5], dtype=torch.int64, device="cuda")
    for row_scale in (None, torch.rand(B * T, device="cuda")):
        torch.library.opcheck(torch.ops.kernelwright.neftune_fwd, (x.detach(), seed, 0.1, row_scale))

    def step(e, m):
        return neftune_noise(e, ALPHA, attention_mask=m)

    compiled = torch.compile(step, fullgraph=True)
    torch.manual_seed(0)
    noise = compiled(zeros, mask)  # (B, T, d) fp32: zeros in, so out is the noise
    check_segment(noise[0].cpu(), T, d, "compiled row 0")
    check_segment(noise[1, :100].cpu(), 100, d, "compiled row 1")
    y = compiled(x, mask)  # (B, T, d) bf16
    assert torch.equal(y[1, 100:], x[1, 100:])
    grad = torch.randn_like(y)
    y.backward(grad)
    assert torch.equal(x.grad, grad)


def test_bench_neftune_runs(tmp_path, monkeypatch):
    from bench import bench_neftune, common

    monkeypatch.setattr(common, "RESULTS", tmp_path)
    rows = bench_neftune.main(["--quick", "--shapes", "2x8x64", "--compile-backend", "aot_eager"])
    assert {r["impl"] for r in rows} == {"hf_eager", "hf_compile", "ours", "ours_mask"}
    assert all(r["ms"] > 0 and r["shape"] == "2x8x64" for r in rows)
    assert (tmp_path / "neftune.jsonl").read_text().count("\n") == 4
    assert (tmp_path / "neftune.md").exists()
