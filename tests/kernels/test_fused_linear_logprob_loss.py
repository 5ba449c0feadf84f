"""Tests for kernels/fused_linear_logprob_loss.py (Triton interpreter on CPU).

The loss callable here is a sequence-coupled toy (a per-token term and the square of each sequence's sum of
log-probs), so that a chunk must hold whole sequences for the gradient to be right. Tolerance model as
tests/kernels/test_fused_linear_logprob.py: fp32 against the fp32 reference with rtol 1e-5 and atol 1e-5 * max|ref|;
bf16/fp16 at most 2x PyTorch's own error in that dtype plus one ulp for bf16 (interpreter stores truncate) and one
more with a temperature (hidden / T is rounded once more). Forced small chunks make every case cross chunk borders.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from triton.runtime.jit import KernelInterface

from kernels import (
    fused_linear_logprob,
    fused_linear_logprob_loss,
    fused_linear_logprob_loss_ref,
    fused_linear_logprob_ref,
)
from tests.kernels.test_cross_entropy import AllocationRecorder
from tests.kernels.test_fused_linear_cross_entropy import LiveStorageBytes, addmm__flop
from tests.tolerance import assert_lowp_close

fl_mod = importlib.import_module("kernels.fused_linear_cross_entropy")
lp_mod = importlib.import_module("kernels.fused_linear_logprob")
lp_loss_mod = importlib.import_module("kernels.fused_linear_logprob_loss")

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def make_batch(n_seqs, seq_len, hdim, vocab, dtype=torch.float32, bias=False, seed=0):
    """A padded batch: per sequence a prompt of 1-3 rows, a completion of its own length (one of none), padding."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n_seqs, seq_len, hdim, generator=g).to(dtype)
    weight = (torch.randn(vocab, hdim, generator=g) * 2.0 / hdim**0.5).to(dtype)
    b = (torch.randn(vocab, generator=g) * 0.5).to(dtype) if bias else None
    target = torch.full((n_seqs, seq_len), -100)
    for s in range(n_seqs):
        start = 1 + s % 3
        length = 0 if s == 2 else max(1, seq_len - start - (s * 2) % 5)
        target[s, start : start + length] = torch.randint(0, vocab, (length,), generator=g)
    return hidden, weight, b, target


def toy_loss(coef):
    """A loss of whole sequences: sum_t c_t (exp(logp_t) - 0.5 logp_t) + 0.05 sum_s (sum_t logp_st)^2 + 0 * H."""

    def loss_fn(logps, entropies, seqs):
        c = coef[seqs]
        per_token = (c * (logps.exp() - 0.5 * logps) * (logps != 0)).sum()
        coupled = 0.05 * (logps.sum(1) ** 2).sum()
        return per_token + coupled + (0.0 if entropies is None else 0.0 * entropies.sum())

    return loss_fn


def run(fn, hidden, weight, bias, target, loss_fn, upstream=1.5, **kw):
    """(loss, logps, entropies, grad_hidden, grad_weight, grad_bias) of loss * upstream."""
    h = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    b = None if bias is None else bias.detach().clone().requires_grad_()
    loss, out = fn(h, w, target, loss_fn, b, return_entropy=True, **kw)
    (loss * upstream).backward()
    return loss.detach(), out.logps, out.entropies, h.grad, w.grad, None if b is None else b.grad


NAMES = ("loss", "logps", "entropies", "grad_hidden", "grad_weight", "grad_bias")
CASES = [
    dict(n_seqs=5, seq_len=9, hdim=24, vocab=503, bias=True, chunk=6, temperature=1.0),
    dict(n_seqs=4, seq_len=7, hdim=32, vocab=257, bias=False, chunk=3, temperature=0.7),  # sequences > a chunk
    dict(n_seqs=3, seq_len=8, hdim=16, vocab=1001, bias=True, chunk=None, temperature=1.2),  # the library's rule
    dict(n_seqs=4, seq_len=7, hdim=32, vocab=257, bias=True, chunk=3, temperature=0.7, softcap=2.0),  # Gemma 2's cap
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_matches_reference(case, dtype, monkeypatch):
    c = CASES[case]
    if c["chunk"] is not None:
        monkeypatch.setattr(fl_mod, "_chunk_rows", lambda n, h, v: c["chunk"])
    hidden, weight, bias, target = make_batch(c["n_seqs"], c["seq_len"], c["hdim"], c["vocab"], dtype, c["bias"], case)
    loss_fn = toy_loss(
        torch.linspace(-1.0, 2.0, c["seq_len"]).expand(c["n_seqs"], -1) + torch.arange(c["n_seqs"])[:, None]
    )
    kw = dict(temperature=c["temperature"], softcap=c.get("softcap"))
    ours = run(fused_linear_logprob_loss, hidden, weight, bias, target, loss_fn, **kw)
    f32 = (hidden.float(), weight.float(), None if bias is None else bias.float(), target)
    refs = run(fused_linear_logprob_loss_ref, *f32, loss_fn, **kw)
    lows = run(fused_linear_logprob_loss_ref, hidden, weight, bias, target, loss_fn, **kw)
    # the log-probs and entropies are fused_linear_logprob's (up to the matmuls' row blocking: other chunks)
    plain = fused_linear_logprob(hidden, weight, target, bias, return_entropy=True, **kw)
    for o, p in zip(ours[1:3], plain):
        torch.testing.assert_close(o, p, rtol=1e-5, atol=1e-5 * p.abs().max().item())
    ulps = (1 if dtype == torch.bfloat16 else 0) + (1 if c["temperature"] != 1.0 and dtype != torch.float32 else 0)
    for name, o, r, lp in zip(NAMES, ours, refs, lows):
        if r is None:
            assert o is None, name
            continue
        if dtype == torch.float32:
            torch.testing.assert_close(o, r, rtol=1e-5, atol=1e-5 * r.abs().max().item(), msg=name)
        else:
            assert_lowp_close(o, r, lp, dtype, name=name, extra_ulps=ulps)


def test_target_on_the_device_and_all_rows_ignored(monkeypatch):
    monkeypatch.setattr(fl_mod, "_chunk_rows", lambda n, h, v: 5)
    hidden, weight, bias, target = make_batch(4, 6, 16, 301, bias=True, seed=3)
    loss_fn = toy_loss(torch.ones(4, 6))
    skipped = run(fused_linear_logprob_loss, hidden, weight, bias, target, loss_fn)
    monkeypatch.setattr(fl_mod, "_target_on_host", lambda target: False, raising=False)
    monkeypatch.setattr(lp_loss_mod, "_target_on_host", lambda target: False)  # every row kept, as on a GPU
    kept = run(fused_linear_logprob_loss, hidden, weight, bias, target, loss_fn)
    for name, a, b in zip(NAMES, skipped, kept):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item(), msg=name)
    none = run(fused_linear_logprob_loss, hidden, weight, bias, torch.full_like(target, -100), loss_fn)
    for t in none:
        assert torch.equal(t, torch.zeros_like(t))


def test_no_tokens_by_vocab_tensor_exists(monkeypatch):
    monkeypatch.setattr(fl_mod, "_chunk_rows", lambda n, h, v: 6)
    hidden, weight, bias, target = make_batch(6, 8, 16, 1001, torch.bfloat16, bias=True, seed=4)
    h, w, b = (t.clone().requires_grad_() for t in (hidden, weight, bias))
    with AllocationRecorder(min_numel=1) as rec:
        loss, _ = fused_linear_logprob_loss(h, w, target, toy_loss(torch.ones(6, 8)), b, return_entropy=True)
        loss.backward()
    longest = int((target != -100).sum(1).max())  # a chunk is at least one whole sequence
    sizes = [torch.Size(s).numel() for s, _ in rec.allocs]
    assert max(sizes) <= max(max(6, longest) * 1001, 1001 * 16) < 48 * 1001


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_policy_step_is_6khv_matmul_flops(dtype, monkeypatch):
    # the loss's gradient formed in the forward: 3 matmuls per chunk (6 K H V) for an fp32 and a bf16 weight alike,
    # nothing in backward; fused_linear_logprob + autograd costs 8 K H V (10 K H V with a bf16 weight)
    monkeypatch.setattr(fl_mod, "_chunk_rows", lambda n, h, v: 5)
    hidden, weight, _, target = make_batch(4, 8, 32, 300, dtype, seed=5)
    k = int((target != -100).sum())
    assert 0 < k < target.numel()
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    mapping = {torch.ops.aten.addmm_: addmm__flop}
    with FlopCounterMode(display=False, custom_mapping=mapping) as fwd:
        loss, _ = fused_linear_logprob_loss(h, w, target, toy_loss(torch.ones(4, 8)), return_entropy=True)
    with FlopCounterMode(display=False, custom_mapping=mapping) as bwd:
        loss.backward()
    assert fwd.get_total_flops() == 6 * k * 32 * 300
    assert bwd.get_total_flops() == 0


def test_fp32_weight_under_autocast(monkeypatch):
    # the trainer's case: fp32 master weight, bf16 autocast: bf16 matmuls, an fp32 loss and fp32 gradients
    monkeypatch.setattr(fl_mod, "_chunk_rows", lambda n, h, v: 6)
    hidden, weight, bias, target = make_batch(4, 7, 48, 601, bias=True, seed=6)
    loss_fn = toy_loss(torch.linspace(-1, 1, 28).reshape(4, 7))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = run(fused_linear_logprob_loss, hidden, weight, bias, target, loss_fn, temperature=0.9)
        low = run(fused_linear_logprob_loss_ref, hidden, weight, bias, target, loss_fn, temperature=0.9)
    ref = run(fused_linear_logprob_loss_ref, hidden, weight, bias, target, loss_fn, temperature=0.9)
    for name, o, r, lp in zip(NAMES, ours, ref, low):
        assert o.dtype == torch.float32, name
        assert_lowp_close(o, r, lp, torch.bfloat16, name=name, extra_ulps=2)


def test_no_host_sync(monkeypatch):
    monkeypatch.setattr(fl_mod, "_chunk_rows", lambda n, h, v: 6)
    hidden, weight, bias, target = make_batch(4, 7, 32, 513, torch.bfloat16, bias=True, seed=7)
    h, w, b = (t.clone().requires_grad_() for t in (hidden, weight, bias))
    loss_fn = toy_loss(torch.ones(4, 7))

    def host_sync(*args, **kwargs):
        raise AssertionError("host synchronisation inside fused_linear_logprob_loss")

    for name in ("item", "tolist", "__bool__", "__int__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, host_sync)
    loss, _ = fused_linear_logprob_loss(h, w, target, loss_fn, b, temperature=0.7, return_entropy=True)
    loss.backward()
    monkeypatch.undo()
    assert all(torch.isfinite(t.grad.float()).all() for t in (h, w, b))


@pytest.mark.parametrize("op", ("logprob", "loss"))
def test_peak_extra_memory_at_llama_3_2_1b_head(op, monkeypatch):
    # A GRPO micro batch: 16 completions of 512 tokens after 512-token prompts (targets on the host), H 2048,
    # V 128256, bf16 weight, entropies asked for. Launchers as a GPU runs them, on meta tensors (as the preference
    # test). Bound: one chunk of bf16 logits (C = 2048: 0.525 GB), the entropies' two fp32 blocks (2 x 64 MiB), the
    # fp32 grad_hidden and gathered rows of the K kept rows (6 K H bytes), O(N) vectors. Measured here: the loss op
    # 0.760 GB, fused_linear_logprob 0.692 GB (its forward's peak: logits, entropy blocks, gathered rows), eager
    # (the reference's fp32 logits through autograd) 33.6 GB. The entropy blocks once held three temporaries, not
    # two (linalg.vecdot's product; the previous block's x alive while the next was made): 0.89 GB.
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(KernelInterface, "__getitem__", lambda self, grid: lambda *args, **kwargs: None)
    n_seqs, seq_len, hdim, vocab = 16, 1024, 2048, 128256
    n, k = n_seqs * seq_len, n_seqs * seq_len // 2
    target = torch.randint(0, vocab, (n_seqs, seq_len))
    target[:, : seq_len // 2] = -100
    hidden = torch.empty(n_seqs, seq_len, hdim, dtype=torch.bfloat16, device="meta")
    weight = torch.empty(vocab, hdim, dtype=torch.bfloat16, device="meta")
    with LiveStorageBytes() as ours:
        if op == "loss":
            loss_fn = toy_loss(torch.ones(n_seqs, seq_len, device="meta"))
            loss, logps, ents, saved, plan = lp_loss_mod.fused_linear_logprob_loss_fwd(
                hidden, weight, target, None, loss_fn, need_entropy=True
            )
            grads = fl_mod.fused_linear_cross_entropy_bwd(torch.ones((), device="meta"), saved, plan)
            outs = (loss, logps, ents)
        else:
            logps, ents, saved, plan = lp_mod.fused_linear_logprob_fwd(
                hidden.reshape(n, hdim), weight, target.reshape(-1), need_entropy=True, need_hidden=True,
                need_weight=True,
            )  # fmt: skip
            grads = lp_mod.fused_linear_logprob_bwd(torch.ones(n, device="meta"), saved, plan)
            outs = (logps, ents)
        del saved
    assert grads[1].shape == (vocab, hdim)
    peak = ours.peak_excluding(*outs, *grads)
    chunk = fl_mod._chunk_rows(k, hdim, vocab)
    assert chunk == 2048
    bound = 2 * chunk * vocab + 2 * 4 * lp_mod.ENTROPY_BLOCK_ELEMENTS + 6 * k * hdim + 64 * n
    if op == "logprob":  # the bf16 weight's vocabulary pass in backward: a tile of logits and its fp32 accumulator
        tile_rows, tile_cols = fl_mod._vocab_tile(k, hdim, vocab)
        bound = max(bound, 2 * chunk * vocab + 6 * k * hdim + 2 * tile_rows * tile_cols + 4 * tile_cols * hdim)
    assert 2 * chunk * vocab < peak <= bound, (peak, bound)
    h, w = hidden.requires_grad_(), weight.clone().requires_grad_()
    with LiveStorageBytes() as eager:
        ref = fused_linear_logprob_ref(h, w, target.to("meta"), return_entropy=True)
        torch.autograd.grad(ref.logps.sum(), [h, w])
    assert peak <= 0.05 * eager.peak_excluding(), (peak, eager.peak_excluding())


@pytest.mark.gpu
@pytest.mark.parametrize("op", ("logprob", "loss"))
def test_gpu_matches_the_reference_without_host_sync(op):
    # the Triton kernels and cuBLAS on a GPU: bf16 inputs, a CPU target (prompt rows skipped on the host), several
    # chunks of the library's rule (C = 2048 rows of 4 x 1024), no host sync; tolerances as on the CPU (1 ulp)
    hidden, weight, bias, target = make_batch(4, 1024, 1024, 32003, torch.bfloat16, bias=True, seed=8)
    target[:, :300] = -100
    hidden, weight, bias = hidden.cuda(), weight.cuda(), bias.cuda()
    coef = torch.linspace(-1.0, 1.0, 4 * 1024, device="cuda").reshape(4, 1024)
    fns = (fused_linear_logprob_loss, fused_linear_logprob_loss_ref)
    if op == "logprob":  # fused_linear_logprob, differentiated through sum(coef * logps)

        def as_loss(fn):
            def loss_and_logps(h, w, t, loss_fn, b, **kw):
                out = fn(h, w, t, b, **kw)
                return (out.logps * coef).sum(), out

            return loss_and_logps

        fns = (as_loss(fused_linear_logprob), as_loss(fused_linear_logprob_ref))
    torch.cuda.set_sync_debug_mode("error")
    try:
        ours = run(fns[0], hidden, weight, bias, target, toy_loss(coef), temperature=0.9)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    refs = run(fns[1], hidden.float(), weight.float(), bias.float(), target.cuda(), toy_loss(coef), temperature=0.9)
    lows = run(fns[1], hidden, weight, bias, target.cuda(), toy_loss(coef), temperature=0.9)
    for name, o, r, lp in zip(NAMES, ours, refs, lows):
        assert_lowp_close(o.float(), r.float(), lp.float(), torch.bfloat16, name=name, extra_ulps=2)
