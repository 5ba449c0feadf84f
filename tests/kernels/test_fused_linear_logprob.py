"""Tests for kernels/fused_linear_logprob.py (Triton interpreter on CPU).

Tolerance model (tests/tolerance.py): fp32 against the fp32 reference (materialised logits / T, log_softmax, gather)
with atol 2e-5 * max|ref| on log-probs and entropies and 1e-5 * max|grad| on gradients (chunked matmuls sum in
another order). bf16/fp16: our error against the fp32 reference of the same low-precision inputs is at most 2x
PyTorch's own error running the reference in that dtype (F.linear in bf16/fp16), plus one ulp for the interpreter's
truncating fp32->bf16 stores (DESIGN.md); with a temperature, hidden / T is rounded to the low-precision dtype once
more than PyTorch's logits / T (the module docstring), so those cases allow 2 ulps. Forced small chunks and
vocabulary tiles make every case cross chunk and tile borders.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import kernels
from kernels import TokenLogprobs, fused_linear_logprob, fused_linear_logprob_ref
from tests.kernels.test_cross_entropy import AllocationRecorder
from tests.kernels.test_fused_linear_cross_entropy import addmm__flop
from tests.tolerance import PoisonedTorch, assert_lowp_close

fl_mod = importlib.import_module("kernels.fused_linear_cross_entropy")
lp_mod = importlib.import_module("kernels.fused_linear_logprob")

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def make_inputs(n_rows, hdim, vocab, dtype=torch.float32, bias=False, ignored=(), seed=0):
    """Random LM-head inputs; the rows in `ignored` (prompt or padding) get ignore_index."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n_rows, hdim, generator=g).to(dtype)
    weight = (torch.randn(vocab, hdim, generator=g) * 2.0 / hdim**0.5).to(dtype)
    b = (torch.randn(vocab, generator=g) * 0.5).to(dtype) if bias else None
    target = torch.randint(0, vocab, (n_rows,), generator=g)
    target[list(ignored)] = -100
    return hidden, weight, b, target


def run(fn, hidden, weight, bias, target, upstream, **kw):
    """(logps, entropies, grad_hidden, grad_weight, grad_bias) of sum(logps * upstream)."""
    h = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    b = None if bias is None else bias.detach().clone().requires_grad_()
    out = fn(h, w, target, b, return_entropy=True, **kw)
    (out.logps * upstream).sum().backward()
    return out.logps.detach(), out.entropies, h.grad, w.grad, None if b is None else b.grad


NAMES = ("logps", "entropies", "grad_hidden", "grad_weight", "grad_bias")

CASES = [
    dict(n=37, hdim=24, vocab=503, bias=True, chunk=5, temperature=1.0),  # odd shapes, prompt rows skipped
    dict(n=37, hdim=24, vocab=503, bias=False, chunk=4, temperature=0.7),
    dict(n=20, hdim=48, vocab=1001, bias=True, chunk=None, temperature=1.3),  # one chunk (the library's rule)
    dict(n=37, hdim=24, vocab=503, bias=True, chunk=4, temperature=0.7, softcap=2.0),  # Gemma 2's capped logits
]
IGNORED = (0, 1, 2, 3, 17, 18, 30)  # a prompt, padding in the middle and near the end


def check(outs, refs, lows, dtype, ulps):
    for name, o, r, lp in zip(NAMES, outs, refs, lows):
        if r is None:
            assert o is None, name
            continue
        want = torch.float32 if name in ("logps", "entropies") else dtype
        assert o.dtype == want and o.shape == r.shape, name
        if dtype == torch.float32:
            atol = (2e-5 if name in ("logps", "entropies") else 1e-5) * r.abs().max().item()
            torch.testing.assert_close(o, r, rtol=1e-5, atol=atol, msg=name)
        else:
            assert_lowp_close(o, r, lp, dtype, name=name, extra_ulps=ulps)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_matches_reference(case, dtype, monkeypatch):
    c = CASES[case]
    if c["chunk"] is not None:
        monkeypatch.setattr(lp_mod, "ENTROPY_BLOCK_ELEMENTS", 2 * c["vocab"] + 1)  # entropy blocks of 2 rows
        monkeypatch.setattr(fl_mod, "_chunk_rows", lambda n, h, v: c["chunk"])
        monkeypatch.setattr(fl_mod, "_vocab_tile", lambda n, h, v: (c["chunk"], 200))  # a bf16/fp16 weight's pass
    ignored = [i for i in IGNORED if i < c["n"]]
    hidden, weight, bias, target = make_inputs(c["n"], c["hdim"], c["vocab"], dtype, c["bias"], ignored, seed=case)
    upstream = torch.linspace(-1.5, 2.0, c["n"])  # the loss's dL/dlogps, both signs
    kw = dict(temperature=c["temperature"], softcap=c.get("softcap"))
    ours = run(fused_linear_logprob, hidden, weight, bias, target, upstream, **kw)
    f32 = (hidden.float(), weight.float(), None if bias is None else bias.float(), target)
    refs = run(fused_linear_logprob_ref, *f32, upstream, **kw)
    lows = run(fused_linear_logprob_ref, hidden, weight, bias, target, upstream, **kw)
    # the reference itself against a direct float64 computation
    logits = torch.nn.functional.linear(*(t.double() if t is not None else None for t in f32[:3]))
    if c.get("softcap"):  # capped before the temperature, as transformers' Gemma 2 logits reach TRL
        logits = torch.tanh(logits / c["softcap"]) * c["softcap"]
    logits = logits / c["temperature"]
    logp = logits.log_softmax(-1)
    kept = target != -100
    direct = torch.where(kept, logp.gather(1, target.clamp(min=0).unsqueeze(1)).squeeze(1), 0.0)
    torch.testing.assert_close(refs[0].double(), direct, rtol=1e-6, atol=1e-5)
    entropy = torch.where(kept, -(logp.exp() * logp).sum(-1), 0.0)
    torch.testing.assert_close(refs[1].double(), entropy, rtol=1e-5, atol=1e-5)
    for o in ours[:2]:  # ignored rows are exact zeros, their hidden rows get no gradient
        assert torch.equal(o[~kept], torch.zeros(len(ignored)))
    assert torch.equal(ours[2][~kept].float(), torch.zeros(len(ignored), c["hdim"]))
    ulps = (1 if dtype == torch.bfloat16 else 0) + (1 if c["temperature"] != 1.0 and dtype != torch.float32 else 0)
    check(ours, refs, lows, dtype, ulps)


@pytest.mark.parametrize("where", ("cpu_target", "device_target"))
def test_leading_shape_and_a_target_on_the_device(where, monkeypatch):
    # (B, T) inputs keep their shape; a target "on the device" (no host-side skipping: every row runs the matmuls,
    # ignored ones still give exact zeros) agrees with the skipping path
    monkeypatch.setattr(fl_mod, "_chunk_rows", lambda n, h, v: 4)
    hidden, weight, bias, target = make_inputs(12, 16, 257, bias=True, ignored=(0, 1, 5, 6, 11), seed=3)
    if where == "device_target":
        monkeypatch.setattr(fl_mod, "_skip_ignored", lambda hidden, target, ignore_index: (None, hidden, target))
    up = torch.linspace(-1, 1, 12).reshape(3, 4)
    ours = run(fused_linear_logprob, hidden.reshape(3, 4, 16), weight, bias, target.reshape(3, 4), up)
    refs = run(fused_linear_logprob_ref, hidden.reshape(3, 4, 16), weight, bias, target.reshape(3, 4), up)
    assert ours[0].shape == ours[1].shape == (3, 4)
    for name, o, r in zip(NAMES, ours, refs):
        torch.testing.assert_close(o, r, rtol=1e-5, atol=2e-5 * r.abs().max().item(), msg=name)
    assert torch.equal(ours[1].reshape(-1)[[0, 1, 5, 6, 11]], torch.zeros(5))


def test_all_rows_ignored():
    hidden, weight, bias, target = make_inputs(6, 16, 101, bias=True, ignored=range(6), seed=4)
    logps, entropies, gh, gw, gb = run(fused_linear_logprob, hidden, weight, bias, target, torch.ones(6))
    for t in (logps, entropies, gh, gw, gb):
        assert torch.equal(t, torch.zeros_like(t))


def test_torch_path_is_the_reference():
    hidden, weight, bias, target = make_inputs(9, 16, 101, bias=True, ignored=(0, 4), seed=5)
    with kernels.backend("reference"):
        ours = fused_linear_logprob(hidden, weight, target, bias, temperature=0.9, return_entropy=True)
    ref = fused_linear_logprob_ref(hidden, weight, target, bias, temperature=0.9, return_entropy=True)
    assert isinstance(ours, TokenLogprobs)
    assert torch.equal(ours.logps, ref.logps) and torch.equal(ours.entropies, ref.entropies)


def test_no_grad_pass_is_the_forward_alone(monkeypatch):
    # the old policy's and the reference's log-probs: nothing saved, no weight gradient, the same values
    monkeypatch.setattr(fl_mod, "_chunk_rows", lambda n, h, v: 4)
    hidden, weight, bias, target = make_inputs(10, 32, 513, torch.bfloat16, bias=True, ignored=(0, 1), seed=6)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with_grad = fused_linear_logprob(h, w, target, bias, return_entropy=True)
    with torch.no_grad(), AllocationRecorder(min_numel=1) as rec:
        old = fused_linear_logprob(h, w, target, bias, return_entropy=True)
    assert old.logps.grad_fn is None and not old.logps.requires_grad
    assert (513, 32) not in [shape for shape, _ in rec.allocs]  # no weight gradient
    assert (4, 513) in [shape for shape, _ in rec.allocs]  # the chunk logits
    assert not with_grad.entropies.requires_grad  # entropies are detached (module docstring)
    assert torch.equal(with_grad.logps.detach(), old.logps) and torch.equal(with_grad.entropies, old.entropies)


def test_every_output_element_is_written(monkeypatch):
    # every float buffer the two modules allocate starts as NaN: finite results prove each element was written
    monkeypatch.setattr(fl_mod, "_chunk_rows", lambda n, h, v: 4)
    monkeypatch.setattr(fl_mod, "_vocab_tile", lambda n, h, v: (4, 200))
    monkeypatch.setattr(lp_mod, "ENTROPY_BLOCK_ELEMENTS", 3 * 513)
    poisoned = PoisonedTorch()
    monkeypatch.setattr(fl_mod, "torch", poisoned)
    monkeypatch.setattr(lp_mod, "torch", poisoned)
    hidden, weight, bias, target = make_inputs(10, 32, 513, torch.bfloat16, bias=True, ignored=(0, 1, 7), seed=10)
    outs = run(fused_linear_logprob, hidden, weight, bias, target, torch.linspace(-1, 2, 10), temperature=0.8)
    assert poisoned.calls > 0 and all(torch.isfinite(o.float()).all() for o in outs)


def test_no_host_sync(monkeypatch):
    monkeypatch.setattr(fl_mod, "_chunk_rows", lambda n, h, v: 4)
    hidden, weight, bias, target = make_inputs(10, 32, 513, torch.bfloat16, bias=True, ignored=(0, 1), seed=11)
    h, w, b = (t.clone().requires_grad_() for t in (hidden, weight, bias))

    def host_sync(*args, **kwargs):
        raise AssertionError("host synchronisation inside fused_linear_logprob")

    for name in ("item", "tolist", "__bool__", "__int__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, host_sync)
    out = fused_linear_logprob(h, w, target, b, temperature=0.7, return_entropy=True)
    (out.logps * torch.linspace(-1, 1, 10)).sum().backward()
    monkeypatch.undo()
    assert all(torch.isfinite(t.grad.float()).all() for t in (h, w, b))


def test_no_tokens_by_vocab_tensor_exists(monkeypatch):
    # 24 rows, V = 1001, H = 16, chunks of 6 rows, vocabulary tiles of 6 x 200: nothing near rows x V elements
    monkeypatch.setattr(fl_mod, "_chunk_rows", lambda n, h, v: 6)
    monkeypatch.setattr(fl_mod, "_vocab_tile", lambda n, h, v: (6, 200))
    monkeypatch.setattr(lp_mod, "ENTROPY_BLOCK_ELEMENTS", 4 * 1001)  # fp32 entropy temporaries of 4 rows
    hidden, weight, bias, target = make_inputs(24, 16, 1001, torch.bfloat16, bias=True, ignored=(0, 1), seed=7)
    h, w, b = (t.clone().requires_grad_() for t in (hidden, weight, bias))
    with AllocationRecorder(min_numel=1) as rec:
        out = fused_linear_logprob(h, w, target, b, return_entropy=True, temperature=0.8)
        (out.logps * torch.linspace(-1, 1, 24)).sum().backward()
    sizes = [torch.Size(s).numel() for s, _ in rec.allocs]
    assert max(sizes) <= max(6 * 1001, 1001 * 16) < 24 * 1001


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_matmul_flops_count_completion_rows_only(dtype, monkeypatch):
    # K completion rows of N: forward 2 K H V (the logits once; entropies add no matmul); backward 6 K H V with an
    # fp32 weight (the logits recomputed, grad_hidden, grad_weight) and 8 K H V with a bf16 weight (its
    # vocabulary pass recomputes the logits once more): a policy step is 8 K H V (10 K H V), not 6 K H V (module
    # docstring). The prompt and padding rows cost nothing.
    monkeypatch.setattr(fl_mod, "_chunk_rows", lambda n, h, v: 5)
    monkeypatch.setattr(fl_mod, "_vocab_tile", lambda n, h, v: (5, 128))
    n, hdim, vocab = 24, 32, 300
    ignored = (0, 1, 2, 3, 4, 5, 12, 13, 14, 23)
    hidden, weight, _, target = make_inputs(n, hdim, vocab, dtype, ignored=ignored, seed=9)
    k = n - len(ignored)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    mapping = {torch.ops.aten.addmm_: addmm__flop}
    with FlopCounterMode(display=False, custom_mapping=mapping) as fwd:
        logps = fused_linear_logprob(h, w, target, return_entropy=True).logps
    with FlopCounterMode(display=False, custom_mapping=mapping) as bwd:
        logps.backward(torch.ones(n))
    with torch.no_grad(), FlopCounterMode(display=False, custom_mapping=mapping) as old:
        fused_linear_logprob(h, w, target)
    khv = k * hdim * vocab
    assert fwd.get_total_flops() == 2 * khv
    assert bwd.get_total_flops() == (6 if dtype == torch.float32 else 8) * khv
    assert old.get_total_flops() == 2 * khv


def test_fp32_weight_under_autocast(monkeypatch):
    # the trainer's case: fp32 master weight, bf16 autocast: bf16 matmuls, fp32 log-probs and fp32 gradients
    monkeypatch.setattr(fl_mod, "_chunk_rows", lambda n, h, v: 4)
    hidden, weight, bias, target = make_inputs(11, 48, 601, bias=True, ignored=(0, 5), seed=8)
    up = torch.linspace(-2, 1, 11)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = run(fused_linear_logprob, hidden, weight, bias, target, up)
        low = run(fused_linear_logprob_ref, hidden, weight, bias, target, up)
    ref = run(fused_linear_logprob_ref, hidden, weight, bias, target, up)
    for name, o, r, lp in zip(NAMES, ours, ref, low):
        assert o.dtype == torch.float32, name
        assert_lowp_close(o, r, lp, torch.bfloat16, name=name, extra_ulps=1)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(temperature=0.0), "temperature"),
        (dict(target=torch.zeros(3, dtype=torch.int64)), "target must be"),
        (dict(weight=torch.zeros(5, 7)), "weight \\(V, H\\)"),
        (dict(bias=torch.zeros(4)), "bias must be"),
        (dict(hidden=torch.zeros(4, 8, dtype=torch.float64)), "one floating dtype"),
    ],
)
def test_bad_arguments_raise_clear_errors(change, match):
    args = dict(hidden=torch.zeros(4, 8), weight=torch.zeros(5, 8), target=torch.zeros(4, dtype=torch.int64))
    kw = {"temperature": change.pop("temperature")} if "temperature" in change else {}
    bias = change.pop("bias", None)
    args.update(change)
    with pytest.raises(ValueError, match=match):
        fused_linear_logprob(args["hidden"], args["weight"], args["target"], bias, **kw)
