"""bench.roofline: the aten op accounting (FLOPs against FlopCounterMode, bytes of known ops, peak memory of a known
sequence), the cost models of the modelled ops, and the four stacks at a tiny size (meta tensors: seconds)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

import kernels
from bench import roofline as rf
from bench.bench_train import model_config
from bench.sm90 import fake_cuda


def _record(fn):
    """Run fn under the aten recorder alone (no fake CUDA, no models) and return its trace."""
    trace = rf.Trace()
    with rf._Recorder(trace):
        fn()
    return trace


def _meta(*shape, dtype=torch.float32, grad=False):
    return torch.empty(shape, dtype=dtype, device="meta", requires_grad=grad)


def test_aten_flops_equal_flop_counter_mode():
    a, b, c = _meta(64, 48, grad=True), _meta(48, 80, grad=True), _meta(3, 16, 24)
    d, bias = _meta(3, 24, 8), _meta(80)

    def step():
        y = torch.addmm(bias, a, b) @ _meta(80, 8)
        torch.bmm(c, d)
        y.sum().backward()

    with FlopCounterMode(display=False) as counter:
        step()
    trace = _record(step)
    assert counter.get_total_flops() > 0
    assert sum(op.flops for op in trace.ops) == counter.get_total_flops()


def test_bytes_of_known_ops():
    x32, x16 = _meta(64, 32), _meta(64, 32, dtype=torch.bfloat16)
    n = 64 * 32
    trace = _record(lambda: x32 + x16)
    assert [(op.name, op.bytes, op.launches) for op in trace.ops] == [("add", n * 4 + n * 2 + n * 4, 1)]
    assert _record(lambda: x32.add_(x16)).ops[0].bytes == n * 4 + n * 2 + n * 4  # in place: read and written
    assert _record(lambda: x32.copy_(x16)).ops[0].bytes == n * 2 + n * 4  # the destination is not read
    assert _record(lambda: (x32.t(), x32.view(-1), torch.empty(5, device="meta"))).ops == []  # views, allocations
    assert _record(lambda: x32.float()).ops == []  # no copy, no traffic
    assert _record(lambda: x32.to(torch.bfloat16)).ops[0].bytes == n * 4 + n * 2
    row = _meta(1, 32).expand(64, 32)  # stride 0: one row read
    assert _record(lambda: row * x32).ops[0].bytes == 32 * 4 + n * 4 + n * 4
    a, b = _meta(16, 8, dtype=torch.bfloat16), _meta(8, 4, dtype=torch.bfloat16)
    op = _record(lambda: a @ b).ops[0]
    assert (op.name, op.bytes, op.flops) == ("mm", (16 * 8 + 8 * 4 + 16 * 4) * 2, 2 * 16 * 8 * 4)
    table, ids = _meta(1000, 32), torch.empty(7, dtype=torch.int64, device="meta")
    assert _record(lambda: F.embedding(ids, table)).ops[0].bytes == 7 * 8 + 2 * 7 * 32 * 4  # only the rows read


def test_host_ops_are_not_gpu_work():
    assert _record(lambda: torch.ones(8) * 2).ops == []


def test_peak_memory_of_a_known_sequence():
    trace = rf.Trace()
    with rf._Recorder(trace):
        a = torch.empty(1 << 20, dtype=torch.uint8, device="meta")
        b = torch.empty(2 << 20, dtype=torch.uint8, device="meta")
        view = b[:10]  # same storage: counted once
        del a
        c = torch.empty(3 << 20, dtype=torch.uint8, device="meta")
        assert trace.live == 5 << 20
        del b, view
        assert trace.live == 3 << 20
        del c
    assert trace.peak == 5 << 20 and trace.live == 0


def test_swiglu_rope_and_fused_add_norm_models_before_their_kernels_land():
    """The models keyed by the names of the kernels being written: shapes of outputs and gradients, and bytes."""
    trace = rf.Trace()
    gate, up = _meta(2, 8, 32, dtype=torch.bfloat16, grad=True), _meta(2, 8, 32, dtype=torch.bfloat16, grad=True)
    q, k = _meta(2, 8, 4, 16, dtype=torch.bfloat16, grad=True), _meta(2, 8, 2, 16, dtype=torch.bfloat16, grad=True)
    cos, sin = _meta(2, 8, 16, dtype=torch.bfloat16), _meta(2, 8, 16, dtype=torch.bfloat16)
    x, res, w = _meta(2, 8, 32, grad=True), _meta(2, 8, 32, grad=True), _meta(32, grad=True)
    with rf.recording(trace):
        out = rf._modelled_apply("SwiGLUFunction").__func__(gate, up)
        qr, kr = rf._modelled_apply("RoPEFunction").__func__(q, k, cos, sin)
        normed, total = rf._modelled_apply("FusedAddRMSNormFunction").__func__(x, res, w, 1e-5)
        trace.phase = "backward"
        torch.autograd.backward([out, qr, kr, normed, total], [torch.empty_like(t) for t in (out, qr, kr, normed, total)])
    assert out.shape == gate.shape and qr.shape == q.shape and kr.shape == k.shape and total.shape == x.shape
    assert gate.grad.shape == gate.shape and q.grad.shape == q.shape and w.grad.shape == w.shape
    by_name = {op.name: op for op in trace.ops}
    e = 2 * 8 * 32 * 2
    assert by_name["SwiGLUFunction"].bytes == 3 * e and by_name["SwiGLUFunction.backward"].bytes == 5 * e
    qk = (2 * 8 * 4 * 16 + 2 * 8 * 2 * 16) * 2
    assert by_name["RoPEFunction"].bytes == 2 * qk + 2 * 2 * 8 * 16 * 2  # cos and sin once per (b, t)
    assert by_name["RoPEFunction"].category == "rope"
    # reads x, residual and the weight, writes normed, the sum and rstd
    assert by_name["FusedAddRMSNormFunction"].bytes == 4 * 2 * 8 * 32 * 4 + 32 * 4 + 16 * 4


def test_an_unmodelled_triton_launch_raises():
    with fake_cuda(), rf.modelled_ops(), pytest.raises(RuntimeError, match="unmodelled Triton launch"):
        logits = torch.empty(4, 64, dtype=torch.bfloat16, device="cuda")
        kernels.cross_entropy(logits, torch.zeros(4, dtype=torch.int64, device="cuda"))


def test_four_stacks_at_a_tiny_size():
    config, dev = model_config("tiny"), rf.DEVICES["h100"]
    rows = {}
    for ignored in (0.0, 0.5):
        for stack in rf.STACKS:
            trace = rf.model_step(stack, config, 2, 32, ignored)
            names = {op.name for op in trace.ops}
            assert {"flash_attention", "flash_attention.backward"} <= names
            assert {op.phase for op in trace.ops} == {"forward", "backward", "optimizer"}
            rows[stack, ignored] = rf.summarise(trace, dev) | {"names": names}
    assert {"RMSNormFunction", "flce.logits", "fused_adamw (Triton)"} <= rows["ours", 0.0]["names"]
    assert {"LigerRopeFunction", "LigerSiLUMulFunction", "liger_flce.logits", "_fused_adamw_"} <= rows["hf_liger", 0.0]["names"]
    assert {"LigerRMSNormFunction", "LigerSiLUMulFunction", "liger_flce.logits"} <= rows["ours_liger", 0.0]["names"]
    assert "_log_softmax" in rows["hf", 0.0]["names"]
    # Same architecture: the same matmul FLOPs (HF's rotary embedding adds one small matmul: 0.2% here), except
    # that our loss skips the ignored rows.
    assert rows["ours", 0.0]["flops"] == pytest.approx(rows["hf", 0.0]["flops"], rel=1e-2)
    assert rows["hf", 0.0]["flops"] == rows["hf_liger", 0.0]["flops"]
    assert rows["ours", 0.5]["flops"] < rows["ours", 0.0]["flops"]
    assert rows["hf", 0.5]["flops"] == rows["hf", 0.0]["flops"]
    for row in rows.values():
        assert row["ms_step"] == pytest.approx(sum(row[f"ms_{c}"] for c in rf.CATEGORIES))
        assert row["launches"] > 0 and row["peak_memory_gb"] > 0
