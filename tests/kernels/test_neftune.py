"""Tests for kernels/neftune.py: NEFTune noise, Triton path (interpreter on CPU) and PyTorch reference.

The two paths draw different random numbers, so they are checked against the semantics, not each other:
- bounds: |noise| <= alpha / sqrt(L * d) per sequence / packed document (x1 + 1e-6 for the fp32
  rounding of the magnitude), and the largest |noise| of every sequence reaches 0.95 of its own bound
  (hundreds of U(-1, 1) draws: missing 0.95 has probability < 1e-4, and the seeds are fixed), which
  tells L from T;
- distribution on 8192 draws of u = noise / bound: mean 0 and variance 1/3 within 5 standard errors,
  8-bin histogram within 5 binomial standard errors, values not repeated;
- exactness: padding unchanged, gradient the identity, training=False / alpha=0 return the input;
- low precision: y = x + noise is computed in fp32 and rounded once, so y matches the fp32 result of the
  same noise within the tolerance model of tests/tolerance.py (Triton bf16: one extra ulp for the
  interpreter's truncating stores);
- determinism: the same generator seed gives identical outputs on each path.
The kernel's own random numbers are pinned down by `philox_u` below, a NumPy Philox4x32-10 and the kernel's mapping
of (seed, row, column, d) to u (kernels/neftune.py, "Random numbers"): the kernel must reproduce it bit for bit in fp32
and fp16 on awkward widths, whatever its blocks (shrunk in one test), and in its int64 variant. On that stream: the
distribution per dtype (mean, variance, a Kolmogorov-Smirnov bound by the DKW inequality), and independence of the
values that share a Philox call (the 16-bit halves of one word, the words of one call: correlations, a joint
histogram's chi-square) and of neighbouring calls.
Run: python -m pytest tests/kernels/test_neftune.py -q
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import kernels
import kernels.neftune as neftune_module
from kernels.neftune import NEFTuneFunction, _row_scale, neftune_fwd, neftune_noise, neftune_noise_ref
from tests.tolerance import assert_lowp_close, poisoned_like

PATHS = ["triton", "reference"]
ALPHA = 5.0


_M32 = np.uint64(0xFFFFFFFF)


def philox4x32_10(seed: int, counter: np.ndarray) -> np.ndarray:
    """Philox4x32-10 (Salmon et al. 2011; Triton's tl.randint4x): counter (...,) < 2^64 in words 0-1, words 2-3 zero,
    key = the seed's two 32-bit halves -> (..., 4) uint64 holding the four 32-bit output words."""
    c0, c1 = counter & _M32, counter >> np.uint64(32)
    c2 = c3 = np.zeros_like(c0)
    k0, k1 = np.uint64(seed & 0xFFFFFFFF), np.uint64(seed >> 32)
    a, b = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
    for _ in range(10):
        pa, pb = a * c0, b * c2  # < 2^64: exact in uint64
        c0, c1, c2, c3 = (pb >> np.uint64(32)) ^ c1 ^ k0, pb & _M32, (pa >> np.uint64(32)) ^ c3 ^ k1, pa & _M32
        k0, k1 = (k0 + np.uint64(0x9E3779B9)) & _M32, (k1 + np.uint64(0xBB67AE85)) & _M32
    return np.stack([c0, c1, c2, c3], axis=-1)


def philox_u(seed: int, n_rows: int, d: int, halves: bool) -> torch.Tensor:
    """The kernel's u in [-1, 1) at every (row, column), float64 (n_rows, d): group g of row r is Philox counter
    r * ceil(d / P) + g; fp32 (P = 4): column 4g + w takes word w's top 24 bits k, u = k 2^-23 - 1; bf16/fp16 (P = 8,
    halves): column 8g + 2w + h takes word w's 16-bit half h (0 = low), u = k 2^-15 - 1."""
    per = 8 if halves else 4
    groups = -(-d // per)
    counter = np.arange(n_rows, dtype=np.uint64)[:, None] * np.uint64(groups) + np.arange(groups, dtype=np.uint64)
    words = philox4x32_10(seed, counter)  # (n_rows, groups, 4)
    if halves:
        k = np.stack([words & np.uint64(0xFFFF), words >> np.uint64(16)], axis=-1)  # (n_rows, groups, 4, 2)
        u = k.reshape(n_rows, groups * 8).astype(np.float64) * 2.0**-15 - 1.0
    else:
        u = (words >> np.uint64(8)).reshape(n_rows, groups * 4).astype(np.float64) * 2.0**-23 - 1.0
    return torch.from_numpy(u[:, :d])


def kernel_noise(x: torch.Tensor, seed: int) -> torch.Tensor:
    """neftune_fwd's u on x's shape and dtype, read off the kernel with zeros in and magnitude 1: exact in fp32 and
    fp16 (fp16 rounds u: 11 bits, all 16 where |u| < 2^-4), the bf16 rounding of u in bf16."""
    d = x.shape[-1]
    return neftune_fwd(torch.zeros_like(x), torch.tensor([seed], dtype=torch.int64), 1.0).reshape(-1, d)


def seed_of(generator: torch.Generator) -> int:
    """The Philox seed neftune_noise draws from a CPU generator (kernels.neftune._draw_seed)."""
    return torch.randint(0, 2**62, (1,), dtype=torch.int64, generator=generator).item()


def chi2_bound(dof: int, p: float = 1e-6) -> float:
    """P(chi2_dof >= bound) <= p (Laurent and Massart 2000: P(X - k >= 2 sqrt(k t) + 2t) <= exp(-t))."""
    t = math.log(1 / p)
    return dof + 2 * math.sqrt(dof * t) + 2 * t


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
    # (the kernel's words and halves of one Philox call: test_values_of_one_philox_call_are_independent)
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
    B, T, d = 3, 7, 781  # awkward: d is odd, neither a multiple of 4 nor of 8
    mask = torch.ones(B, T)
    mask[2, 5:] = 0
    x = torch.randn(B, T, d).to(dtype)
    y = run(path, x, attention_mask=mask, generator=gen(11))
    assert y.dtype == dtype and y.shape == x.shape
    if path == "reference":
        # torch.rand draws the same fp32 noise whatever the dtype: read it off an fp32 run on zeros
        noise32 = run(path, torch.zeros(B, T, d), attention_mask=mask, generator=gen(11)).double()  # (B, T, d)
    else:
        # the kernel's noise in this dtype (16-bit uniforms in bf16/fp16), exactly, from the Philox reference
        u = philox_u(seed_of(gen(11)), B * T, d, halves=dtype != torch.float32).view(B, T, d)
        noise32 = u * _row_scale((B, T, d), ALPHA, mask, None).view(B, T, 1).double()
    ref32 = (x.double() + noise32).float()  # (B, T, d)
    extra = 1 if (path == "triton" and dtype == torch.bfloat16) else 0
    assert_lowp_close(y, ref32, ref32.to(dtype), dtype, name=f"{path} y", extra_ulps=extra)
    assert torch.equal(y[2, 5:], x[2, 5:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_launcher_writes_every_element_and_follows_strides(dtype):
    base = torch.randn(3, 7, 800).to(dtype)
    x = base[:, :, :781]  # (3, 7, 781), row stride 800
    seed = torch.tensor([1234], dtype=torch.int64)
    out = poisoned_like(x.contiguous())  # NaNs: every element must be overwritten
    y = neftune_fwd(x, seed, 0.01, out=out)
    assert y is out and not torch.isnan(y).any()
    assert torch.equal(y, neftune_fwd(x.contiguous(), seed, 0.01)), "strided input changed the noise"
    # + the rounding of x + noise to the dtype (a whole ulp: the interpreter truncates bf16), |x| < 8
    slack = 8 * torch.finfo(dtype).eps * (1 if dtype == torch.float32 else 2)
    assert ((y.float() - x.float()).abs().max() <= 0.01 * (1 + 1e-6) + slack).item()
    row_scale = torch.rand(21)  # (21,)
    row_scale[::3] = 0
    z = neftune_fwd(x, seed, 0.0, row_scale, out=poisoned_like(out))  # (3, 7, 781)
    per_row = (z.float() - x.float()).reshape(21, 781).abs().amax(dim=1)  # (21,)
    assert torch.all(per_row <= row_scale * (1 + 1e-6) + slack) and torch.all(per_row[::3] == 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_noise_is_independent_of_batch_size(dtype):
    # The counter is (row, column group): row r gets the same noise in a batch of 2 and of 5 (same seed and L).
    small = run("triton", torch.zeros(2, 4, 36, dtype=dtype), generator=gen(12))
    large = run("triton", torch.zeros(5, 4, 36, dtype=dtype), generator=gen(12))
    assert torch.equal(small, large[:2])


# (rows, d): one row and every width 1..9 (a ragged last group in fp32 and bf16/fp16), odd 781, and 4100 (two column
# programs: 4100 > 4096 columns)
WIDTHS = [(1, d) for d in range(1, 10)] + [(3, 781), (2, 4100)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows, d", WIDTHS)
def test_noise_is_philox_of_seed_row_and_column(dtype, rows, d):
    seed = 0x2F0E_1D2C_3B4A_5968  # both key words nonzero
    got = kernel_noise(torch.empty(rows, d, dtype=dtype), seed)  # (rows, d)
    u = philox_u(seed, rows, d, halves=dtype != torch.float32).float()  # exact in fp32
    if dtype == torch.bfloat16:
        # the interpreter truncates fp32 -> bf16 stores (tests/tolerance.py); a GPU rounds to nearest
        truncated = (u.view(torch.int32) & ~0xFFFF).view(torch.float32).to(dtype)
        assert torch.all((got == u.to(dtype)) | (got == truncated))
    else:
        assert torch.equal(got, u.to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_noise_does_not_depend_on_the_blocks(dtype, monkeypatch):
    # Shrunk tiles (256 elements, at most 32 columns: 2-D grids of many row and column programs) draw what the
    # default ones (whole rows of 781) do.
    x = torch.randn(5, 781).to(dtype)
    seed = torch.tensor([77], dtype=torch.int64)
    row_scale = torch.rand(5)
    default = neftune_fwd(x, seed, 0.0, row_scale)
    monkeypatch.setattr(neftune_module, "_TILE", 256)
    monkeypatch.setattr(neftune_module, "_MAX_COLS", 32)
    assert torch.equal(neftune_fwd(x, seed, 0.0, row_scale), default)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_int64_variant_draws_the_same_noise(dtype):
    # WIDE (int64 rows, counters, offsets: tensors past 2^31 elements) computes the same counters as int32
    x = torch.randn(3, 4, 781).to(dtype)
    seed = torch.tensor([2**61 + 12345], dtype=torch.int64)
    for row_scale in (None, torch.rand(12)):
        narrow = neftune_fwd(x, seed, 0.05, row_scale, wide=False)
        assert torch.equal(neftune_fwd(x, seed, 0.05, row_scale, wide=True), narrow)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_noise_distribution_per_dtype(dtype):
    # 64 x 1024 draws of the kernel's u: 24-bit (fp32) or 16-bit (fp16 is exact to 2^-11, fine enough here)
    n_rows, d = 64, 1024
    u = kernel_noise(torch.empty(n_rows, d, dtype=dtype), 2024).double().reshape(-1)  # (65536,)
    n = u.numel()
    assert u.min() >= -1 and u.max() <= (1 - 2**-23 if dtype == torch.float32 else 1)  # fp16 rounds 1 - 2^-15 up
    assert abs(u.mean().item()) <= 5 * math.sqrt(1 / 3 / n)
    assert abs(u.var().item() - 1 / 3) <= 5 * math.sqrt(4 / 45 / n)
    # Kolmogorov-Smirnov against U(-1, 1): DKW bounds the distance at p = 1e-6, plus fp16's rounding of u (2^-11)
    sorted_u = u.sort().values
    cdf = (sorted_u + 1) / 2
    ranks = torch.arange(1, n + 1, dtype=torch.float64)
    ks = torch.maximum(ranks / n - cdf, cdf - (ranks - 1) / n).max().item()
    assert ks <= math.sqrt(math.log(2 / 1e-6) / (2 * n)) + 2**-11, f"KS distance {ks:.4f}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_values_of_one_philox_call_are_independent(dtype):
    # fp32: a call's four words fill four adjacent columns; fp16: its eight 16-bit halves fill eight (8g + 2w + h).
    # Pairs of them must be uncorrelated (5 standard errors), the low and high halves of one word (and two words of
    # one call) jointly uniform (8 x 8 histogram of their top 3 bits, chi-square at p = 1e-6), and neighbouring calls
    # uncorrelated too.
    per = 4 if dtype == torch.float32 else 8
    n_rows, d = 64, 1024
    u = kernel_noise(torch.empty(n_rows, d, dtype=dtype), 99).double()  # (64, 1024)
    calls = u.reshape(-1, per)  # (calls, per): one Philox call's values per row (d = 1024 is a multiple of per)
    n = calls.shape[0]
    corr = torch.corrcoef(calls.T)  # (per, per)
    off = corr - torch.eye(per, dtype=torch.float64)
    assert off.abs().max().item() <= 5 / math.sqrt(n), f"values of one call correlate:\n{corr}"
    neighbour = torch.corrcoef(torch.stack([calls[:-1].reshape(-1), calls[1:].reshape(-1)]))[0, 1].item()
    assert abs(neighbour) <= 5 / math.sqrt(n * per), f"adjacent calls correlate: {neighbour:.4f}"
    bins = ((calls + 1) * 4).floor().long().clamp(0, 7)  # (n, per): top 3 bits
    pairs = [(0, 1), (0, 2)] if per == 8 else [(0, 1), (1, 3)]  # fp16: low/high half of word 0, words 0 and 1
    for a, b in pairs:
        counts = torch.bincount(bins[:, a] * 8 + bins[:, b], minlength=64).double()
        expected = n / 64
        chi2 = ((counts - expected) ** 2 / expected).sum().item()
        assert chi2 <= chi2_bound(63), f"values {a} and {b} of a call: chi-square {chi2:.1f}"


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


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cuda_noise_is_philox_of_seed_row_and_column(dtype):
    # The compiled kernel (join, reshape and bit placement as the GPU lowers them) draws the reference's numbers:
    # bit for bit in fp32 and fp16, rounded to nearest in bf16; int64 variant included.
    rows, d = 37, 4100
    seed = 0x2F0E_1D2C_3B4A_5968
    u = philox_u(seed, rows, d, halves=dtype != torch.float32).float()
    zeros = torch.zeros(rows, d, dtype=dtype, device="cuda")
    seed_t = torch.tensor([seed], dtype=torch.int64, device="cuda")
    for wide in (False, True):
        got = neftune_fwd(zeros, seed_t, 1.0, wide=wide).cpu()
        assert torch.equal(got, u.to(dtype)), f"wide={wide}"


def test_bench_neftune_runs(tmp_path, monkeypatch):
    from bench import bench_neftune, common

    monkeypatch.setattr(common, "RESULTS", tmp_path)
    rows = bench_neftune.main(["--quick", "--shapes", "2x8x64", "--compile-backend", "aot_eager"])
    assert {r["impl"] for r in rows} == {"hf_eager", "hf_compile", "ours", "ours_mask"}
    assert all(r["ms"] > 0 and r["shape"] == "2x8x64" for r in rows)
    assert (tmp_path / "neftune.jsonl").read_text().count("\n") == 4
    assert (tmp_path / "neftune.md").exists()
