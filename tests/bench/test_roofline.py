"""bench.roofline: the aten op accounting (FLOPs against FlopCounterMode, bytes of known ops, peak memory of a known
sequence), the cost models of the modelled ops, and the four stacks at a tiny size (meta tensors: seconds).

Ours are recorded through the benches' exact byte models (`traffic_parts`), which tests/bench/test_byte_models.py
checks against bench/traffic.py's meter; here, that the roofline records exactly those. liger's cross-entropy (inside
its fused loss) and RoPE are checked against the meter here, running liger's kernels under the interpreter at small
shapes (issued bytes: what the kernels ask for). liger's RMSNorm and SwiGLU kernels call libdevice, which the
interpreter lacks, so they cannot be metered: their rows use the models of ours (RMSNorm: the same passes over x, dy
and dx; SwiGLU: reads gate and up, writes the product; backward reads dout, gate, up and writes both gradients in
place), read from liger's source.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

import kernels
from bench import roofline as rf
from bench import traffic
from bench.bench_train import model_config
from bench.sm90 import fake_cuda

ROOT = Path(__file__).resolve().parents[2]


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
    # what was live at the peak, by where it was allocated (a bare trace: phase "forward", no module)
    assert trace.at_peak == {"forward:-": 5 << 20} and trace.phase_peaks == {"forward": 5 << 20}


def test_swiglu_rope_and_fused_add_norm_models():
    """The models of SwiGLU, RoPE and the fused add + RMSNorm: shapes of outputs and gradients, and bytes."""
    from bench import bench_rms_norm

    trace = rf.Trace()
    gate, up = _meta(2, 8, 32, dtype=torch.bfloat16, grad=True), _meta(2, 8, 32, dtype=torch.bfloat16, grad=True)
    q, k = _meta(2, 4, 8, 16, dtype=torch.bfloat16, grad=True), _meta(2, 2, 8, 16, dtype=torch.bfloat16, grad=True)
    cos, sin = _meta(1, 8, 16), _meta(1, 8, 16)  # (B, H, T, D) q and k; fp32 cos/sin shared by the batch
    x, res, w = _meta(2, 8, 32, grad=True), _meta(2, 8, 32, grad=True), _meta(32, grad=True)
    with rf.recording(trace):
        out = rf._modelled_apply("SwiGLUFunction").__func__(gate, up)
        qr, kr = rf._modelled_apply("RoPEFunction").__func__(q, k, cos, sin)
        normed, total = rf._modelled_apply("FusedAddRMSNormFunction").__func__(x, res, w, 1e-5)
        trace.phase = "backward"
        torch.autograd.backward(
            [out, qr, kr, normed, total], [torch.empty_like(t) for t in (out, qr, kr, normed, total)]
        )
    assert out.shape == gate.shape and qr.shape == q.shape and kr.shape == k.shape and total.shape == x.shape
    assert gate.grad.shape == gate.shape and q.grad.shape == q.shape and w.grad.shape == w.shape
    by_name = {op.name: op for op in trace.ops}
    e = 2 * 8 * 32 * 2
    assert by_name["SwiGLUFunction"].bytes == 3 * e and by_name["SwiGLUFunction.backward"].bytes == 5 * e
    qk = (2 * 4 * 8 * 16 + 2 * 2 * 8 * 16) * 2
    assert by_name["RoPEFunction"].bytes == 2 * qk + 2 * 8 * 16 * 4  # cos and sin read once (bench/bench_rope.py)
    assert by_name["RoPEFunction"].category == "rope"
    # reads x, residual and the weight, writes normed, the sum and rstd (bench/bench_rms_norm.py's model)
    assert by_name["FusedAddRMSNormFunction:_rms_norm_fwd_kernel"].bytes == 4 * 2 * 8 * 32 * 4 + 32 * 4 + 16 * 4
    assert x.grad.shape == res.grad.shape == x.shape
    backward = sum(op.bytes for op in trace.ops if op.name.startswith("FusedAddRMSNormFunction.backward:"))
    assert backward == sum(
        bench_rms_norm.traffic_model(
            "backward", 16, 32, 4, 4, num_programs=2 * rf.H100_SMS, weight_once=True, residual_size=4
        )
    )


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
    assert {
        "RMSNormFunction:_rms_norm_fwd_kernel",
        "RoPEFunction",
        "flce:aten.mm",
        "flce:_cross_entropy_fwd_kernel",
        "fused_adamw:_adamw_kernel",
    } <= rows["ours", 0.0]["names"]
    assert {"LigerRopeFunction", "LigerSiLUMulFunction", "liger_flce.logits", "_fused_adamw_"} <= rows["hf_liger", 0.0][
        "names"
    ]
    assert {
        "LigerRMSNormFunction:_rms_norm_fwd_kernel",
        "LigerRopeFunction",
        "LigerSiLUMulFunction",
        "liger_flce.logits",
    } <= rows["ours_liger", 0.0]["names"]
    assert "_log_softmax" in rows["hf", 0.0]["names"]
    # Same architecture: the same matmul FLOPs (HF's rotary embedding adds one small matmul: 0.2% here), except
    # that our loss skips the ignored rows.
    assert rows["ours", 0.0]["flops"] == pytest.approx(rows["hf", 0.0]["flops"], rel=1e-2)
    assert rows["hf", 0.0]["flops"] == rows["hf_liger", 0.0]["flops"]
    assert rows["ours", 0.5]["flops"] < rows["ours", 0.0]["flops"]
    assert rows["hf", 0.5]["flops"] == rows["hf", 0.0]["flops"]
    # our residual adds are fused into the norms (kernels.fused_add_rms_norm); unfused, ours_liger makes HF's adds
    assert (
        rows["ours", 0.0]["ms_residual_adds"] == 0
        and "FusedAddRMSNormFunction:_rms_norm_fwd_kernel" in rows["ours", 0.0]["names"]
    )
    assert rows["ours_liger", 0.0]["ms_residual_adds"] == pytest.approx(rows["hf", 0.0]["ms_residual_adds"])
    for row in rows.values():
        assert row["ms_step"] == pytest.approx(sum(row[f"ms_{c}"] for c in rf.CATEGORIES))
        assert row["launches"] > 0 and row["peak_memory_gb"] > 0
        assert sum(row["peak_breakdown_gb"].values()) == pytest.approx(row["peak_memory_gb"])
        assert max(row["peak_by_phase_gb"].values()) == pytest.approx(row["peak_memory_gb"])
        assert row["peak_breakdown_gb"]["setup"] == pytest.approx(row["peak_by_phase_gb"]["setup"])


def _kernel(t: traffic.Traffic, name: str):
    return t.by_kernel()[name]


def test_our_ops_are_recorded_by_the_benches_byte_models():
    """One model per op: the roofline records ours through the benches' `traffic_parts` (which
    tests/bench/test_byte_models.py checks against the meter), all of it but the fused loss's host-side ops."""
    from bench import bench_fused_linear_cross_entropy as bench_flce
    from bench import bench_rms_norm

    m, n, h, v = 64, 48, 32, 700
    x, w = _meta(m, n, grad=True), _meta(n, grad=True)
    hidden, weight = _meta(m, h, dtype=torch.bfloat16, grad=True), _meta(v, h, grad=True)
    target = torch.randint(0, v, (m,))
    target[::4] = -100
    trace = rf.Trace()
    with rf.recording(trace):
        y = rf._modelled_apply("RMSNormFunction").__func__(x, w, 1e-5, 0.0, None)
        loss = rf._modelled_apply("FusedLinearCrossEntropyFunction").__func__(
            hidden, weight, target, None, 0.0, -100, "mean", 0.0, None, torch.float32
        )
        trace.phase = "backward"
        torch.autograd.backward([y, loss], [torch.empty_like(y), torch.empty_like(loss)])

    def recorded(prefix):
        return sum(op.bytes for op in trace.ops if op.name.split(":")[0] == prefix)

    assert recorded("RMSNormFunction") == sum(bench_rms_norm.traffic_model("forward", m, n, 4, 4, weight_once=True))
    assert recorded("RMSNormFunction.backward") == sum(
        bench_rms_norm.traffic_model("backward", m, n, 4, 4, num_programs=2 * rf.H100_SMS, weight_once=True)
    )
    kept = int((target != -100).sum())
    host = {
        k: r + wr
        for k, (r, wr) in bench_flce.traffic_parts("forward", m, h, v, 2, m - kept, w=4).items()
        if k in rf._FLCE_HOST
    }
    assert recorded("flce") == sum(bench_flce.traffic_model("forward", m, h, v, 2, m - kept, w=4)) - sum(host.values())
    assert recorded("flce.backward") == sum(bench_flce.traffic_model("backward", m, h, v, 2, m - kept, w=4))
    matmul_flops = sum(op.flops for op in trace.ops if op.name.startswith("flce:aten."))
    assert matmul_flops == 3 * 2 * kept * h * v  # logits, grad_hidden, grad_weight over the kept rows


def test_liger_cross_entropy_and_rope_models_equal_the_meter():
    from liger_kernel.ops.rope import LigerRopeFunction
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    n, h, v = 16, 64, 500  # liger's chunks: next_pow2(n / ceil(v / h)) = 2 rows, 8 of them
    hidden, weight = torch.randn(n, h, requires_grad=True), torch.randn(v, h, requires_grad=True)
    with traffic.measure() as t:
        liger_fused_linear_cross_entropy(hidden, weight, torch.randint(0, v, (n,)))
    k = _kernel(t, "liger_cross_entropy_kernel")
    assert k.read + k.write == 8 * rf.liger_cross_entropy_bytes(2, v, 4)
    b, T, heads, kv_heads, d = 2, 8, 4, 2, 16
    q = torch.randn(b, T, heads, d, dtype=torch.bfloat16).transpose(1, 2)  # HF's (B, H, T, D) view
    k_ = torch.randn(b, T, kv_heads, d, dtype=torch.bfloat16).transpose(1, 2)
    cos, sin = torch.randn(1, T, d), torch.randn(1, T, d)
    with traffic.measure() as t:
        LigerRopeFunction.apply(q, k_, cos, sin)
    k = _kernel(t, "_triton_rope")
    assert k.read + k.write == rf.liger_rope_bytes(q.numel(), k_.numel(), 2, b * T, d // 2, 4)


@pytest.mark.parametrize(
    "tokens, hidden, inter, experts, k, empty",
    [(24, 32, 16, 4, 2, False), (100, 48, 24, 3, 2, True), (40, 32, 16, 5, 1, False)],
    ids=["even", "empty-expert-several-tiles", "k1"],
)
def test_liger_fused_moe_model_equals_the_meter(tokens, hidden, inter, experts, k, empty):
    """liger's fused MoE (LigerFusedMoEFunction, what LigerExperts runs) under the interpreter: every kernel's and
    torch op's issued bytes, forward and backward, equal `liger_fused_moe_parts` for the routed counts (uneven loads,
    an expert with no rows and experts over one 64-row tile, k = 1); the pinned configs' column blocks span these
    widths, the roofline's ideal tiling. Its output equals the per-token loop."""
    from liger_kernel.ops import fused_moe_kernels
    from liger_kernel.ops.fused_moe import LigerFusedMoEFunction

    from bench.roofline.op_models import liger_fused_moe_parts

    assert fused_moe_kernels._AUTOTUNE_DISABLED  # tests/conftest.py pins liger's configs
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=gen, requires_grad=True)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen, requires_grad=True)
    down = torch.randn(experts, hidden, inter, generator=gen, requires_grad=True)
    logits = torch.randn(tokens, experts, generator=gen)
    if empty:
        logits[:, 0] = -1e9
    weights, index = logits.softmax(-1).topk(k)
    weights.requires_grad_()
    index32 = index.to(torch.int32)  # LigerExperts' cast, outside the Function
    with traffic.measure(torch_ops=True) as forward:
        out = LigerFusedMoEFunction.apply(x, gate_up, down, index32, weights)
    dout = torch.randn(out.shape, generator=gen)
    with traffic.measure(torch_ops=True) as backward:
        out.backward(dout)
    counts = torch.bincount(index.flatten(), minlength=experts).tolist()
    if empty:  # the routing as the case says: expert 0 without rows, another over one 64-row tile
        assert counts[0] == 0 and max(counts) > 64
    for mode, t in (("forward", forward), ("backward", backward)):
        metered: dict[str, tuple[int, int]] = {}
        for launch in t.launches:
            read, write = metered.get(launch.kernel, (0, 0))
            metered[launch.kernel] = (read + launch.read, write + launch.write)
        assert metered == liger_fused_moe_parts(mode, counts, tokens, k, hidden, inter, 4, 4, 4), mode
    expected = torch.zeros(tokens, hidden)
    for t in range(tokens):
        for j in range(k):
            gate, up = (gate_up[index[t, j]] @ x[t]).detach().chunk(2)
            expected[t] += weights[t, j].detach() * (down[index[t, j]].detach() @ (F.silu(gate) * up))
    torch.testing.assert_close(out.detach(), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("lora", [False, True], ids=["experts", "experts-lora"])
def test_our_moe_models_keep_what_our_functions_keep(monkeypatch, lora):
    """The roofline's memory of our grouped GEMMs: MoEExpertsModel (MoEExpertsLoRAModel) saves, beyond the Function's
    own inputs, tensors of the shapes and dtypes kernels/moe.py's Function saves for backward (the pre-activation
    gate_up (N, 2I); with LoRA also x A^T and h A^T (N, r)), called with the same arguments on the meta device."""
    from bench.roofline import tracing
    from bench.roofline.op_models import MODELS
    from kernels import moe

    tokens, hidden, inter, experts, k, rank = 12, 16, 8, 4, 2, 3
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=gen, requires_grad=True)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen, requires_grad=not lora)
    down = torch.randn(experts, hidden, inter, generator=gen, requires_grad=not lora)
    weights, index = torch.randn(tokens, experts, generator=gen).softmax(-1).topk(k)
    loras = {}
    if lora:
        loras = {
            "gate_up_lora": moe.ExpertLoRA(
                torch.randn(rank * experts, hidden, requires_grad=True), torch.randn(2 * inter, rank * experts), 2.0
            ),
            "down_lora": moe.ExpertLoRA(
                torch.randn(rank * experts, inter, requires_grad=True), torch.randn(hidden, rank * experts), 2.0
            ),
        }
    function = moe.MoEExpertsLoRAFunction if lora else moe.MoEExpertsFunction
    calls = []
    original = function.apply
    monkeypatch.setattr(function, "apply", lambda *args: calls.append(args) or original(*args))
    out = moe.moe_experts(x, index, weights, gate_up, down, **loras)
    (args,) = calls
    inputs = {id(a) for a in args if isinstance(a, torch.Tensor)}
    real = [(t.shape, t.dtype) for t in out.grad_fn.saved_tensors if t is not None and id(t) not in inputs]
    assert len(real) == (3 if lora else 1) and all(shape[0] == tokens * k for shape, _ in real)

    def meta(a):
        return a.detach().to("meta").requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a

    monkeypatch.setattr(tracing, "_TRACE", tracing.Trace())
    modelled = tracing.apply_model(MODELS[function.__name__](), *map(meta, args))
    shapes = {(a.shape, a.dtype) for a in args if isinstance(a, torch.Tensor)}
    saved = [(t.shape, t.dtype) for t in modelled.grad_fn.saved_tensors if t is not None]
    assert saved[-len(real) :] == real and set(saved[: -len(real)]) <= shapes  # the Function's inputs, then its own


def test_liger_flce_model_leaves_a_frozen_weight_without_a_gradient_as_liger_does(monkeypatch):
    """LoRA's frozen lm_head: liger's fused loss allocates, fills and scales no (V, H) weight gradient (its
    weight_needs_grad; under the interpreter no op of it writes that many bytes), and the model records none of it:
    its zeroing, addmm and cast per chunk and its scaling are what the trainable weight's step adds."""
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    from bench.roofline import tracing
    from bench.roofline.op_models import MODELS

    n, h, v = 16, 64, 500
    target = torch.randint(0, v, (n,))
    recorded = {}
    for frozen in (False, True):
        hidden = torch.randn(n, h, requires_grad=True)
        weight = torch.randn(v, h, requires_grad=not frozen)
        with traffic.measure(torch_ops=True) as t:
            liger_fused_linear_cross_entropy(hidden, weight, target, reduction="sum").backward()
        assert (max(launch.write for launch in t.launches) >= v * h * 4) is not frozen
        monkeypatch.setattr(tracing, "_TRACE", tracing.Trace())
        meta = [x.detach().to("meta").requires_grad_(x.requires_grad) for x in (hidden, weight)]
        model = MODELS["LigerFusedLinearCrossEntropyFunction"]()
        loss = tracing.apply_model(model, *meta, target, None, None, -100, 0.0, 0.0, "sum")
        loss[0].backward()
        recorded[frozen] = {op.name: op.bytes for op in tracing._TRACE.ops}
    assert "liger_flce.grad_weight" in recorded[False] and "liger_flce.grad_weight" not in recorded[True]
    assert recorded[False]["liger_flce.zero_grads"] - recorded[True]["liger_flce.zero_grads"] == v * h * 4
    assert recorded[False]["liger_flce.element_mul"] - recorded[True]["liger_flce.element_mul"] == 2 * v * h * 4


def test_measured_ratios_stand_beside_the_modelled_ones(tmp_path, monkeypatch):
    from bench import common

    monkeypatch.setattr(common, "RESULTS", tmp_path)
    base = {
        "bench": "train",
        "perf_figure": True,
        "status": "ok",
        "model": "tiny",
        "seq_len": 32,
        "micro_batch": 2,
        "grad_accum": 1,
    }
    rows = [
        base | {"impl": "ours", "step_ms": 90.0, "device": "GPU X"},
        base | {"impl": "hf_liger", "step_ms": 100.0, "device": "GPU X"},
        base | {"impl": "hf", "step_ms": 230.0, "grad_accum": 2, "device": "GPU X"},  # its accumulation differs
        base | {"impl": "hf", "step_ms": 1.0, "perf_figure": False},  # a CPU row: not a measurement
        base | {"impl": "ours", "step_ms": 1.0, "seq_len": 64},  # another shape
    ]
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    measured = rf._measured("tiny", 32, 2)
    assert measured == {
        "ours": {"step_ms": 90.0, "grad_accum": 1, "device": "GPU X"},
        "hf_liger": {"step_ms": 100.0, "grad_accum": 1, "device": "GPU X"},
        "hf": {"step_ms": 230.0, "grad_accum": 2, "device": "GPU X"},
    }
    modelled = [
        {"stack": s, "ignored": i, "ms_step": ms, "peak_memory_gb": 1.0, **{f"ms_{c}": 0.0 for c in rf.CATEGORIES}}
        for i in (0.0, 0.5)
        for s, ms in zip(rf.STACKS, (80.0, 90.0, 100.0, 95.0))
    ]
    for row in modelled:
        row["ms_optimizer"] = 10.0
    assert rf.modelled_step_ms(modelled[2], 2) == 2 * 90.0 + 10.0  # hf: two passes of 90 ms, one step of 10
    for row in modelled:
        row.update(launches=1, bytes=1.0, flops=1.0, launch_overhead_ms=0.0, peak_at="forward:X")
        row.update(peak_by_phase_gb={"setup": 0.5, "forward": 1.0}, peak_breakdown_gb={"setup": 0.5, "forward:X": 0.5})
    args = rf.parse_args(["--model", "tiny", "--seq_len", "32", "--micro_batch", "2"])
    text = rf.render(modelled, rf.DEVICES["h100"], measured, args)
    assert "ours/hf_liger at 0% ignored: measured 0.900" in text and "modelled 0.842" in text
    measured_part = text.split("Measured beside modelled")[1]
    assert "ours/hf at 0%" not in measured_part  # one micro batch against two: no ratio
    assert "- hf at 0% ignored: measured 230.0 ms a step of 2 micro batches on GPU X, modelled 190.0 ms" in text
    assert "- ours at 0% ignored: measured 90.0 ms a step of 1 micro batches on GPU X, modelled 80.0 ms" in text
    assert "| ours | 1.000 | forward:X | setup 0.500, forward:X 0.500 | setup 0.50, forward 1.00 |" in text


def test_a_kernel_landing_under_a_modelled_name_runs_its_model(monkeypatch):
    swiglu_module = importlib.import_module("kernels.swiglu")  # (kernels.swiglu is the function)

    class SwiGLUFunction(torch.autograd.Function):  # stands for the kernel that landed there (any module of kernels)
        @staticmethod
        def forward(ctx, gate, up):
            raise AssertionError("the model runs instead")

    monkeypatch.setattr(swiglu_module, "SwiGLUFunction", SwiGLUFunction)
    gate, up = _meta(4, 8, dtype=torch.bfloat16, grad=True), _meta(4, 8, dtype=torch.bfloat16, grad=True)
    trace = rf.Trace()
    with rf.recording(trace):
        out = SwiGLUFunction.apply(gate, up)
    assert out.shape == (4, 8) and [op.name for op in trace.ops] == ["SwiGLUFunction"]
    assert "apply" not in SwiGLUFunction.__dict__  # restored on the way out


@pytest.mark.slow  # 20-35 s: a subprocess importing bitsandbytes under fake CUDA
def test_bitsandbytes_imports_under_the_fake_cuda_mode():
    """The QLoRA extra installs bitsandbytes, which liger's import of peft pulls in while the roofline's fake CUDA
    mode is on; its import-time `torch.device("cuda", index=0)` must not meet the mode's meta rewrite."""
    pytest.importorskip("bitsandbytes")
    code = (
        "import torch; from bench.sm90 import fake_cuda\n"
        "with fake_cuda():\n"
        "    import bitsandbytes\n"
        "    assert torch.device('cuda', index=0).type == 'cuda'\n"
        "    assert torch.empty(2, device='cuda').is_meta\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]


# ---------------------------------------------------------------------------------------------------------
# A model of the transformers path: Gemma 3 (bench/roofline/transformers_stacks.py)
# ---------------------------------------------------------------------------------------------------------
def _gemma_tiny() -> dict:
    from bench.roofline.transformers_stacks import TRANSFORMERS_MODELS, twin_config

    return twin_config(TRANSFORMERS_MODELS["gemma-3-4b"])  # 6 layers (5 sliding, window 4, and 1 global), hidden 64


def test_gemma_stacks_at_a_tiny_size(monkeypatch):
    """ours (the transformers path with our kernels, as a probed twin proves them), hf and hf_liger of Gemma 3 on meta
    tensors: each records its kernels, the GeGLU activation reaches ours' SwiGLULinearFunction, the sliding layers'
    attention costs less than the global one's, and the step has a positive time and peak memory."""
    from bench.roofline import op_models
    from bench.roofline.stacks import build, stacks_for

    config, dev = _gemma_tiny(), rf.DEVICES["h100"]
    assert stacks_for(config) == ("ours", "hf", "hf_liger") and stacks_for(model_config("tiny")) == rf.STACKS
    acts = []

    class SwiGLULinearSeen(op_models.SwiGLULinearModel):
        def forward(self, ctx, gate, up, weight, *rest):
            acts.append(rest)
            return super().forward(ctx, gate, up, weight, *rest)

    monkeypatch.setitem(rf.MODELS, "SwiGLULinearFunction", SwiGLULinearSeen)
    rows, traces = {}, {}
    for stack in ("ours", "hf", "hf_liger"):
        trace = rf.model_step(stack, config, 2, 32, 0.0)
        traces[stack] = trace
        rows[stack] = rf.summarise(trace, dev) | {"names": {op.name for op in trace.ops}}
    ours = rows["ours"]["names"]
    assert {
        "RMSNormFunction:_rms_norm_fwd_kernel",
        "RMSNormFunction.backward:_rms_norm_bwd_kernel",
        "SwiGLULinearFunction:_swiglu_fwd_kernel",
        "SwiGLULinearFunction.backward:_swiglu_bwd_kernel",
        "flce:aten.mm",
        "flce:_cross_entropy_fwd_kernel",
        "fused_adamw:_adamw_kernel",
    } <= ours
    assert acts == [("gelu_tanh",)] * 6  # GeGLU in every layer's MLP
    forward_norms = [op for op in traces["ours"].ops if op.name == "RMSNormFunction:_rms_norm_fwd_kernel"]
    # every norm of a layer (its four, q's and k's) and the final one run ours: those that take bf16 rows with an fp32
    # weight under autocast too (Gemma's norms keep the input's dtype with fp32 math, as ours: `kernel_mixed`)
    assert len(forward_norms) == 6 * 6 + 1
    assert "_log_softmax" not in ours and "_log_softmax" in rows["hf"]["names"]
    assert not {n for n in rows["hf"]["names"] if "Function" in n or n.startswith(("flce", "liger"))}
    assert {
        "LigerRMSNormFunction:_rms_norm_fwd_kernel",
        "LigerRMSNormFunction:contiguous",  # q_norm and k_norm take (B, H, T, D) views
        "LigerRopeFunction",
        "LigerRopeFunction:contiguous",
        "LigerGELUMulFunction",
        "LigerGELUMulFunction.backward",
        "liger_flce.logits",
        "_fused_adamw_",
    } <= rows["hf_liger"]["names"]
    model = build("ours", config).model
    assert model.fused_head and (model.logit_scale, model.softcap) == (1.0, None)
    assert model.swapped == {
        "RMSNorm: Gemma3RMSNorm, offset 1": 6 * 6 + 1,
        "GeGLU: Gemma3MLP": 6,
        "RoPE: Gemma3Attention": 6,
    }
    # sliding layers (window 4 of 32 tokens) as flash attention's local window: 4^2/2 + 28 * 4 = 120 of 512 pairs
    flash = sorted(op.flops for op in traces["hf"].ops if op.name == "flash_attention")
    b, h, t, d = 2, 2, 32, 32
    assert flash == [4 * b * h * d * 120] * 5 + [4 * b * h * d * t * t / 2]
    for stack, row in rows.items():
        assert row["ms_step"] > 0 and row["launches"] > 0 and row["peak_memory_gb"] > 0, stack
        assert row["ms_step"] == pytest.approx(sum(row[f"ms_{c}"] for c in rf.CATEGORIES))
        assert sum(row["peak_breakdown_gb"].values()) == pytest.approx(row["peak_memory_gb"])
        assert {op.phase for op in traces[stack].ops} == {"forward", "backward", "optimizer"}
    # the same architecture: about the same FLOPs (our fused loss's chunked matmuls against the head's)
    assert rows["ours"]["flops"] == pytest.approx(rows["hf"]["flops"], rel=2e-2)
    assert rows["hf"]["flops"] == rows["hf_liger"]["flops"]


def test_a_twin_gives_the_probes_verdicts():
    """TransformersModel(hf, twin=...) over a model of other sizes swaps what TransformersModel's own probes swap there,
    and computes the same loss; a class the twin lacks is refused."""
    from bench.roofline.transformers_stacks import hf_model, twin
    from trainer.model.causal_lm import ModelError
    from trainer.model.transformers_model import TransformersModel

    config = _gemma_tiny()
    other = {**config, "hidden_size": 48, "intermediate_size": 96, "head_dim": 16, "num_hidden_layers": 3}
    torch.manual_seed(0)
    probed = TransformersModel(hf_model(other, device="cpu"))
    hf = hf_model(other, device="cpu")
    hf.load_state_dict(probed.hf.state_dict())
    given = TransformersModel(hf, twin=twin(config))
    for attr in ("swapped", "left", "logit_scale", "softcap", "plain_head", "fused_head"):
        assert getattr(given, attr) == getattr(probed, attr), attr
    assert given.kernel_report() == probed.kernel_report()
    ids = torch.randint(0, other["vocab_size"], (2, 12))
    assert torch.equal(given(input_ids=ids, labels=ids).loss, probed(input_ids=ids, labels=ids).loss)
    from transformers import LlamaConfig, LlamaForCausalLM

    llama = TransformersModel(LlamaForCausalLM(LlamaConfig(**model_config("tiny"))))
    with pytest.raises(ModelError, match="Gemma3RMSNorm.*the twin LlamaForCausalLM has none of its class"):
        TransformersModel(hf_model(config), twin=llama)


def test_gemma_command_writes_its_own_files(tmp_path, monkeypatch):
    """`python -m bench.roofline --model <a transformers-path model>`: its three stacks, its own results files (the
    Llama runs' roofline.md and .jsonl untouched), the ratios of ours against each other stack."""
    from bench.roofline import transformers_stacks

    monkeypatch.setitem(transformers_stacks.TRANSFORMERS_MODELS, "gemma-3-tiny", _gemma_tiny())
    rows = rf.main(
        ["--model", "gemma-3-tiny", "--seq_len", "32", "--micro_batch", "2", "--ignored", "0"]
        + ["--out", str(tmp_path)]
    )
    assert [r["stack"] for r in rows] == ["ours", "hf", "hf_liger"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "roofline_gemma-3-tiny.jsonl",
        "roofline_gemma-3-tiny.md",
        "roofline_gemma-3-tiny.png",
    ]
    text = (tmp_path / "roofline_gemma-3-tiny.md").read_text()
    assert "| category | ours | hf | hf_liger | ours/hf_liger | ours/hf |" in text
    assert "## Ratios (modelled)" in text and "## Targets" not in text
    assert "0% ignored: ours/hf modelled step time" in text and "](roofline_gemma-3-tiny.png)" in text


QWEN3_5_TINY = {  # Qwen3.5's architecture at a tiny size: one Gated DeltaNet layer, one gated attention layer
    "model_type": "qwen3_5_text",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "layer_types": ["linear_attention", "full_attention"],
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
}


def test_qwen3_5_command_writes_its_own_files_and_records_our_gated_deltanet_kernels(tmp_path, monkeypatch):
    """`python -m bench.roofline --model qwen3.5-9b` at a tiny size: ours and hf, each also with fla, and hf with fla
    and liger-kernel; its own results files; in ours the Gated DeltaNet's conv and gated norm recorded by their
    benches' byte models."""
    from bench.roofline import stacks

    monkeypatch.setitem(stacks.OUR_MODELS, "qwen3.5-tiny", QWEN3_5_TINY)
    from bench.roofline.cli import _full_config

    trace = stacks.model_step("ours", _full_config(QWEN3_5_TINY), 2, 32, 0.0)
    names = {op.name.split(":")[0] for op in trace.ops}
    assert {"CausalConv1dFunction", "CausalConv1dFunction.backward"} <= names
    assert {"GatedRMSNormFunction", "GatedRMSNormFunction.backward"} <= names
    solves = {op.name for op in trace.ops if "solve_triangular" in op.name}
    assert solves and not any(op.name.startswith("fla.") for op in trace.ops)  # the chunked reference, no fla
    linear = _full_config(QWEN3_5_TINY)["layer_types"].count("linear_attention")
    for stack in ("ours_fla", "hf_fla", "hf_fla_liger"):  # fla's recurrence in place of the PyTorch one, per layer
        fla = stacks.model_step(stack, _full_config(QWEN3_5_TINY), 2, 32, 0.0)
        assert not any("solve_triangular" in op.name for op in fla.ops), stack
        assert sum(op.name == "fla.chunk_gated_delta_rule:fwd_h" for op in fla.ops) == linear, stack
        assert sum(op.name == "fla.chunk_gated_delta_rule.backward:bwd_dhu" for op in fla.ops) == linear, stack
    liger = {op.name.split(":")[0] for op in fla.ops}  # liger's norms, SwiGLU and fused loss on top of fla
    assert {"LigerRMSNormFunction", "LigerSiLUMulFunction", "liger_flce.logits"} <= liger
    rows = rf.main(
        ["--model", "qwen3.5-tiny", "--seq_len", "32", "--micro_batch", "2", "--ignored", "0", "--out", str(tmp_path)]
    )
    assert [r["stack"] for r in rows] == ["ours", "ours_fla", "hf", "hf_fla", "hf_fla_liger"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "roofline_qwen3.5-tiny.jsonl",
        "roofline_qwen3.5-tiny.md",
        "roofline_qwen3.5-tiny.png",
    ]
    text = (tmp_path / "roofline_qwen3.5-tiny.md").read_text()
    header = "| ours | ours_fla | hf | hf_fla | hf_fla_liger | ours/hf | ours_fla/hf_fla | ours_fla/hf_fla_liger |"
    assert header in text and "ours_fla/hf_fla_liger modelled step time" in text
    assert "0% ignored: ours/hf modelled step time" in text


QWEN3_MOE_TINY = {
    "model_type": "qwen3_moe",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "moe_intermediate_size": 48,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
}


def test_qwen3_moe_stacks_record_the_same_flops_and_our_grouped_gemms(tmp_path, monkeypatch):
    """`python -m bench.roofline --model qwen3-30b-a3b` at a tiny size: ours records the experts by the grouped GEMMs'
    model, hf its torch._grouped_mm experts (their FLOPs counted: torch's counter has none), hf_liger liger's fused
    MoE by its model, and the three stacks do the same FLOPs at 0% ignored (the same math, each matmul counted once),
    within the routers' and losses' few."""
    from bench.roofline import stacks
    from bench.roofline.cli import _full_config

    monkeypatch.setitem(stacks.OUR_MODELS, "qwen3-moe-tiny", QWEN3_MOE_TINY)
    config = _full_config(QWEN3_MOE_TINY)
    ours, hf, liger = (stacks.model_step(stack, config, 2, 32, 0.0) for stack in ("ours", "hf", "hf_liger"))
    names = {op.name.split(":")[0] for op in ours.ops}
    assert {"MoEExpertsFunction", "MoEExpertsFunction.backward"} <= names
    grouped = [op for op in hf.ops if op.name == "_grouped_mm"]
    assert grouped and all(op.flops > 0 and op.category == "matmuls" for op in grouped)
    liger_names = {op.name.split(":")[0] for op in liger.ops}
    assert {"LigerFusedMoEFunction", "LigerFusedMoEFunction.backward", "LigerRopeFunction"} <= liger_names
    assert not any(op.name == "_grouped_mm" for op in liger.ops)  # liger's fused MoE in place of grouped_mm
    ours_flops, hf_flops, liger_flops = (sum(op.flops for op in t.ops) for t in (ours, hf, liger))
    assert ours_flops == pytest.approx(hf_flops, rel=0.02) and liger_flops == pytest.approx(hf_flops, rel=0.02)
    rows = rf.main(
        ["--model", "qwen3-moe-tiny", "--seq_len", "32", "--micro_batch", "2", "--ignored", "0", "--out", str(tmp_path)]
    )
    assert [r["stack"] for r in rows] == ["ours", "hf", "hf_liger"]
    text = (tmp_path / "roofline_qwen3-moe-tiny.md").read_text()
    assert "grouped_mm experts" in text and "| category | ours | hf | hf_liger | ours/hf_liger | ours/hf |" in text


GPT_OSS_TINY = {
    "model_type": "gpt_oss",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "sliding_window": 8,
}


def test_gpt_oss_stacks_record_our_flex_attention_as_windowed_flash_and_theirs_eager(tmp_path, monkeypatch):
    """`python -m bench.roofline --model gpt-oss-20b` at a tiny size: ours attends through flex (sliding windows and
    sinks), recorded as the flash-attention model with each layer's window (the sliding layer's 8 of 32 keys: fewer
    FLOPs than the full layer's causal half) and the experts by the grouped GEMMs' model; transformers' eager
    attention (it has no SDPA path for gpt_oss) is recorded op by op."""
    from bench.roofline import stacks
    from bench.roofline.cli import _full_config

    monkeypatch.setitem(stacks.OUR_MODELS, "gpt-oss-tiny", GPT_OSS_TINY)
    ours = stacks.model_step("ours", _full_config(GPT_OSS_TINY), 2, 32, 0.0)
    flash = [op for op in ours.ops if op.name == "flash_attention"]
    assert len(flash) == 2 and flash[0].flops < flash[1].flops  # sliding (window 8), then full
    assert any(op.name.startswith("MoEExpertsFunction") for op in ours.ops)
    # the sinks' rescale from flex's log-sum-exp is attention's work, forward and backward (not RoPE's, as ops in an
    # Attention module count): RoPE is the rotation and its table
    assert {op.category for op in ours.ops if op.name in ("sigmoid", "sigmoid_backward")} == {"attention"}
    rope = {op.name for op in ours.ops if op.category == "rope"}
    assert {"RoPEFunction", "RoPEFunction.backward"} <= rope and not rope & {"sub", "sum", "neg", "sigmoid"}
    hf = stacks.model_step("hf", _full_config(GPT_OSS_TINY), 2, 32, 0.0)
    assert not any(op.name.startswith("flash_attention") for op in hf.ops)
    rows = rf.main(
        ["--model", "gpt-oss-tiny", "--seq_len", "32", "--micro_batch", "2", "--ignored", "0", "--out", str(tmp_path)]
    )
    assert [r["stack"] for r in rows] == ["ours", "hf", "hf_liger"]
    assert "eager attention" in (tmp_path / "roofline_gpt-oss-tiny.md").read_text()
    liger = stacks.model_step("hf_liger", _full_config(GPT_OSS_TINY), 2, 32, 0.0)
    names = {op.name.split(":")[0] for op in liger.ops}  # liger's RoPE, norms and loss; its MoE does not cover gpt-oss
    assert {"LigerRopeFunction", "LigerRMSNormFunction", "liger_flce.logits"} <= names
    assert "LigerFusedMoEFunction" not in names and any(op.name == "_grouped_mm" for op in liger.ops)
