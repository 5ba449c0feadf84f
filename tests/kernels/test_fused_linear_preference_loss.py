"""Tests for kernels/fused_linear_preference_loss.py (Triton interpreter on CPU).

Tolerance model (tests/tolerance.py): fp32 against the fp32 reference (`fused_linear_preference_loss_ref`:
materialised logits, fp32 log_softmax, `preference_loss`) with rtol 1e-5 on the loss, logps and metrics and
atol 1e-5 * max|grad| on every gradient (chunked matmuls sum in another order). bf16: our error against the fp32
reference of the same bf16 inputs is at most 2x PyTorch's own error running the reference in bf16, plus one ulp for
the interpreter's truncating fp32->bf16 stores (DESIGN.md). Half of the rows are ignored (prompt and padding);
forced small chunks make every case cross chunk borders, and a pair longer than the chunk is a chunk of its own.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from kernels import fused_linear_preference_loss, fused_linear_preference_loss_ref
from tests.kernels.test_cross_entropy import AllocationRecorder
from tests.kernels.test_fused_linear_cross_entropy import addmm__flop
from tests.tolerance import assert_lowp_close

fl_mod = importlib.import_module("kernels.fused_linear_cross_entropy")
loss_mod = importlib.import_module("kernels.fused_linear_preference_loss")

V = 5003  # not a multiple of any block or tile


def make_pairs(n_pairs, seq_len, hdim, vocab=V, dtype=torch.float32, bias=False, seed=0):
    """[chosen; rejected] sequences of seq_len rows: the first half a prompt (ignored), then an answer of its own
    length (sequence 1: one token), then padding (ignored)."""
    g = torch.Generator().manual_seed(seed)
    n_seqs = 2 * n_pairs
    hidden = torch.randn(n_seqs, seq_len, hdim, generator=g).to(dtype)
    weight = (torch.randn(vocab, hdim, generator=g) * 2.0 / hdim**0.5).to(dtype)
    b = (torch.randn(vocab, generator=g) * 0.5).to(dtype) if bias else None
    target = torch.full((n_seqs, seq_len), -100)
    prompt = seq_len // 2
    for s in range(n_seqs):
        length = 1 if s == 1 else max(1, seq_len - prompt - (s * 3) % 4)
        target[s, prompt : prompt + length] = torch.randint(0, vocab, (length,), generator=g)
    return hidden, weight, b, target


def ref_logps(n_pairs, seed=1):
    return torch.randn(2 * n_pairs, generator=torch.Generator().manual_seed(seed)) * 2.0 - 12.0


def run(fn, hidden, weight, bias, target, ref, up=1.0, **options):
    """(loss, metrics, grad_hidden, grad_weight, grad_bias) of fn with the upstream gradient `up`."""
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    b = None if bias is None else bias.clone().requires_grad_()
    loss, metrics = fn(h, w, target, b, ref, **options)
    (loss * up).backward()
    return loss.detach(), metrics, h.grad, w.grad, None if b is None else b.grad


LOSSES = [
    dict(loss_type="sigmoid"),
    dict(loss_type="sigmoid", label_smoothing=0.1, rpo_alpha=0.5),
    dict(loss_type="ipo"),
    dict(loss_type="hinge"),
    dict(loss_type="robust", label_smoothing=0.2),
    dict(loss_type="apo_zero"),
    dict(loss_type="orpo"),
    dict(loss_type="simpo", label_smoothing=0.1, cpo_alpha=0.5),
    dict(loss_type="sigmoid", reference_free=True),
    dict(loss_type="sigmoid", rpo_alpha=0.5, softcap=2.0),  # Gemma 2's capped logits (metrics from kernel row sums)
]


def _options(case):
    options = {k: v for k, v in case.items() if k != "reference_free"}
    options["beta"] = 2.0 if case["loss_type"] == "simpo" else 0.3
    return options, case["loss_type"] in ("orpo", "simpo") or case.get("reference_free", False)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("case", range(len(LOSSES)), ids=lambda i: "-".join(f"{k}={v}" for k, v in LOSSES[i].items()))
def test_matches_reference(case, dtype, monkeypatch):
    # 5 pairs of 11 rows (answers of 1 to 5 rows), H 48, V 5003, chunks of at most 7 rows: 1 to 2 pairs per chunk
    monkeypatch.setattr(fl_mod, "_chunk_rows", lambda n, h, v: 7)
    options, no_ref = _options(LOSSES[case])
    hidden, weight, bias, target = make_pairs(5, 11, 48, dtype=dtype, bias=True, seed=case)
    assert (target == -100).float().mean() >= 0.5
    ref = None if no_ref else ref_logps(5, seed=case)
    up = 1.7  # the loss's upstream gradient (an accumulation scale, say)
    ours = run(fused_linear_preference_loss, hidden, weight, bias, target, ref, up, **options)
    f32 = run(
        fused_linear_preference_loss_ref, hidden.float(), weight.float(), bias.float(), target, ref, up, **options
    )
    low = run(fused_linear_preference_loss_ref, hidden, weight, bias, target, ref, up, **options)
    assert sorted(ours[1]) == sorted(f32[1])
    assert ours[0].dtype == torch.float32
    for name in ("loss", *sorted(ours[1])):
        o, r, lp = (ours[0], f32[0], low[0]) if name == "loss" else (ours[1][name], f32[1][name], low[1][name])
        if dtype == torch.float32:
            torch.testing.assert_close(o, r, rtol=1e-5, atol=1e-5, msg=name)
        else:
            assert_lowp_close(o, r, lp, dtype, name=name, extra_ulps=1, floor=1e-6)
    for name, o, r, lp in zip(("grad_hidden", "grad_weight", "grad_bias"), ours[2:], f32[2:], low[2:]):
        assert o.dtype == dtype and o.shape == r.shape, name
        if dtype == torch.float32:
            torch.testing.assert_close(o, r, rtol=1e-5, atol=1e-5 * r.abs().max().item(), msg=name)
        else:
            assert_lowp_close(o, r, lp, dtype, name=name, extra_ulps=1)
    assert (ours[2].reshape(-1, 48)[(target == -100).reshape(-1)] == 0).all()  # ignored rows: no gradient


def test_target_on_the_device_keeps_every_row_and_matches(monkeypatch):
    # a target on the accelerator: no host plan of the answer rows, every row of each pair kept (ignored ones give
    # nothing); the same results as the host plan
    monkeypatch.setattr(fl_mod, "_chunk_rows", lambda n, h, v: 30)
    hidden, weight, bias, target = make_pairs(4, 9, 32, vocab=701, bias=True, seed=3)
    ref = ref_logps(4)
    host = run(fused_linear_preference_loss, hidden, weight, bias, target, ref, rpo_alpha=0.2)
    calls = []

    def on_device(t):
        calls.append(t.shape)
        return False

    monkeypatch.setattr(loss_mod, "_target_on_host", on_device)
    device = run(fused_linear_preference_loss, hidden, weight, bias, target, ref, rpo_alpha=0.2)
    assert calls
    torch.testing.assert_close(device[0], host[0], rtol=1e-6, atol=0)
    for name in host[1]:
        torch.testing.assert_close(device[1][name], host[1][name], rtol=1e-6, atol=1e-6, msg=name)
    for o, r in zip(device[2:], host[2:]):
        torch.testing.assert_close(o, r, rtol=1e-5, atol=1e-6 * r.abs().max().item())


def test_fp32_weight_under_autocast_and_frozen_weight(monkeypatch):
    # the trainer's case: fp32 master weight under bf16 autocast (fp32 gradients); and a frozen LM head (LoRA): no
    # weight gradient formed
    monkeypatch.setattr(fl_mod, "_chunk_rows", lambda n, h, v: 8)
    hidden, weight, bias, target = make_pairs(3, 10, 48, vocab=601, seed=8)
    ref = ref_logps(3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = run(fused_linear_preference_loss, hidden, weight, None, target, ref)
        low = run(fused_linear_preference_loss_ref, hidden, weight, None, target, ref)
    f32 = run(fused_linear_preference_loss_ref, hidden, weight, None, target, ref)
    for name, o, r, lp in zip(
        ("loss", "grad_hidden", "grad_weight"), (ours[0], *ours[2:4]), (f32[0], *f32[2:4]), (low[0], *low[2:4])
    ):
        assert o.dtype == torch.float32, name
        assert_lowp_close(o, r, lp, torch.bfloat16, name=name, extra_ulps=1)
    h = hidden.clone().requires_grad_()
    with AllocationRecorder(min_numel=1) as rec:
        loss, _ = fused_linear_preference_loss(h, weight, target, None, ref)
        loss.backward()
    assert (601, 48) not in [shape for shape, _ in rec.allocs]  # no weight gradient for a frozen weight
    torch.testing.assert_close(h.grad, f32[2], rtol=1e-5, atol=1e-5 * f32[2].abs().max().item())


def test_no_tokens_by_vocab_tensor_exists(monkeypatch):
    # 8 pairs of 12 rows, chunks of <= 9 rows (one pair with up to 12 answer rows is a chunk of its own)
    monkeypatch.setattr(fl_mod, "_chunk_rows", lambda n, h, v: 9)
    hidden, weight, bias, target = make_pairs(8, 12, 16, dtype=torch.bfloat16, bias=True, seed=7)
    longest = int(((target != -100).sum(1)[:8] + (target != -100).sum(1)[8:]).max())
    with AllocationRecorder(min_numel=1) as rec:
        run(fused_linear_preference_loss, hidden, weight, bias, target, ref_logps(8))
    sizes = [torch.Size(s).numel() for s, _ in rec.allocs]
    assert max(sizes) <= max(max(9, longest) * V, V * 16) < 16 * 12 * V / 4  # a chunk's logits, or the weight's grad


@pytest.mark.parametrize("case", [dict(loss_type="sigmoid", rpo_alpha=0.5), dict(loss_type="simpo")], ids=str)
def test_no_host_sync(case, monkeypatch):
    """Forward and backward read no tensor's value into Python (item, tolist, bool, int, float, index): the chunk
    plan of whole pairs is formed from the host target with numpy (`.numpy()` cannot take a device tensor), and
    every batch constant (the pair count, the chosen answer tokens) stays a tensor."""
    monkeypatch.setattr(fl_mod, "_chunk_rows", lambda n, h, v: 7)
    hidden, weight, bias, target = make_pairs(4, 8, 32, vocab=513, dtype=torch.bfloat16, bias=True, seed=6)
    h, w, b = (t.clone().requires_grad_() for t in (hidden, weight, bias))
    ref = None if case["loss_type"] == "simpo" else ref_logps(4)
    options = {**case, "beta": 2.0 if case["loss_type"] == "simpo" else 0.3}

    def host_sync(*args, **kwargs):
        raise AssertionError("host synchronisation inside fused_linear_preference_loss")

    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, host_sync)
    loss, metrics = fused_linear_preference_loss(h, w, target, b, ref, **options)
    (loss * 3).backward()
    monkeypatch.undo()
    assert torch.isfinite(loss) and all(torch.isfinite(v).all() for v in metrics.values())
    assert all(torch.isfinite(t.grad.float()).all() and t.grad.abs().sum() > 0 for t in (h, w, b))


def test_evaluation_under_no_grad_is_the_forward_alone(monkeypatch):
    monkeypatch.setattr(fl_mod, "_chunk_rows", lambda n, h, v: 6)
    hidden, weight, bias, target = make_pairs(3, 8, 32, vocab=513, bias=True, seed=4)
    ref = ref_logps(3)
    with_grad = run(fused_linear_preference_loss, hidden, weight, bias, target, ref, loss_type="ipo")
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        loss, metrics = fused_linear_preference_loss(hidden, weight, target, bias, ref, loss_type="ipo")
    k = int((target != -100).sum())
    assert counter.get_total_flops() == 2 * k * 32 * 513 + 4 * target.numel() * 32  # logits + mean-logit matmul
    torch.testing.assert_close(loss, with_grad[0], rtol=1e-6, atol=0)
    for name in metrics:
        torch.testing.assert_close(metrics[name], with_grad[1][name], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_matmul_flops_are_the_answer_share_of_eager(dtype, monkeypatch):
    # The target: the policy step's matmul FLOPs <= (answer rows / all rows) x eager's. Counted by
    # FlopCounterMode: eager (materialised logits through autograd) 6 N H V; ours 6 K H V for the logits,
    # grad_hidden and grad_weight plus the mean-logit matmul (K, H) x (H, 2), 4 K H (a 2 / (3 V) share: eager takes
    # that mean with N V additions, which the counter does not count). bench/bench_fused_linear_preference.py's
    # loss_matmul_flops is the same formula.
    import bench.bench_fused_linear_preference as bench_pref

    monkeypatch.setattr(fl_mod, "_chunk_rows", lambda n, h, v: 7)
    n_pairs, seq_len, hdim, vocab = 4, 10, 32, 300
    hidden, weight, _, target = make_pairs(n_pairs, seq_len, hdim, vocab=vocab, dtype=dtype, seed=9)
    n, k = target.numel(), int((target != -100).sum())
    assert k <= n // 2
    ref = ref_logps(n_pairs)
    flops = {}
    for name, fn in (("ours", fused_linear_preference_loss), ("eager", fused_linear_preference_loss_ref)):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        with FlopCounterMode(display=False, custom_mapping={torch.ops.aten.addmm_: addmm__flop}) as counter:
            fn(h, w, target, None, ref)[0].backward()
        flops[name] = counter.get_total_flops()
    assert flops["eager"] == 6 * n * hdim * vocab
    assert flops["ours"] == 6 * k * hdim * vocab + 4 * k * hdim
    assert flops["ours"] == bench_pref.loss_matmul_flops(2 * n_pairs, seq_len, hdim, vocab, n - k)
    assert flops["ours"] <= (k / n) * flops["eager"] * (1 + 1 / vocab)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(hidden=torch.zeros(3, 4, 8)), "S = 2P"),
        (dict(ref=torch.zeros(3)), "ref_logps shape"),
        (dict(loss_type="kto"), "loss_type='kto'"),
        (dict(target=torch.zeros(4, 5)), "target must be"),
    ],
)
def test_bad_arguments_raise_clear_errors(change, match):
    hidden, weight, target = torch.zeros(4, 4, 8), torch.zeros(10, 8), torch.zeros(4, 4, dtype=torch.long)
    args = dict(hidden=hidden, weight=weight, target=target, ref=torch.zeros(4), loss_type="sigmoid") | change
    with pytest.raises(ValueError, match=match):
        fused_linear_preference_loss(
            args["hidden"], args["weight"], args["target"], None, args["ref"], loss_type=args["loss_type"]
        )
