"""The host work of a lone RMSNorm call, pinned: the aten ops and Triton launches that rms_norm and fused_add_rms_norm
dispatch on their CUDA path, forward and backward, counted on a CPU (bench/host.py: fake CUDA, launches recorded, not
run). A change that adds a torch op around the launches fails here; one that removes some updates the counts.

At Llama-3-8B's width (8192 rows of 4096, bf16, an fp32 weight as under autocast, and a bf16 one), as (M, N) and as
(batch, seq, hidden): per lone forward + backward, 5 aten ops for rms_norm (9 before the host-work change) and 8 for
fused_add_rms_norm (17): the outputs' and gradients' allocations, dweight's sum over the partial rows (and its cast
to a 16-bit weight's dtype), and the detach autograd makes saving the output h and unpacking it; no views, no
promote_types. The backward's gradients are captured as the benchmark's backward mode does (torch.autograd.grad), so
no AccumulateGrad op is counted.
"""

from __future__ import annotations

import sys

import pytest
import torch

from bench import host
from bench.bench_rms_norm import host_case
from bench.sm90 import fake_cuda

rms_mod = sys.modules["kernels.rms_norm"]

FWD, BWD = "_rms_norm_fwd_kernel", "_rms_norm_bwd_kernel"
# (op, weight grad) -> (forward's aten ops, backward's), the weight fp32; a 16-bit weight adds dweight's cast
EXPECTED = {
    ("rms_norm", True): ({"aten.empty": 2}, {"aten.empty": 2, "aten.sum": 1}),
    ("rms_norm", False): ({"aten.empty": 2}, {"aten.empty": 1}),
    ("fused_add_rms_norm", True): (
        {"aten.empty": 3, "aten.detach": 1},
        {"aten.empty": 2, "aten.sum": 1, "aten.detach": 1},
    ),
    ("fused_add_rms_norm", False): ({"aten.empty": 3, "aten.detach": 1}, {"aten.empty": 1, "aten.detach": 1}),
}
# The torch API calls from Python (properties such as .shape and .dtype included) are bounded, not pinned: each costs
# far less than an op, and their count moves with torch's internals. Measured when this landed: 18-19 and 13-16
# (rms_norm), 29 and 15-18 (fused_add_rms_norm); before it 26 and 21-24, 43 and 24-27.
MAX_TORCH_CALLS = {"rms_norm": (19, 16), "fused_add_rms_norm": (29, 18)}


@pytest.mark.parametrize("shape", [(8192, 4096), (2, 4096, 4096)], ids=["2d", "3d"])
@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16], ids=["w_fp32", "w_bf16"])
@pytest.mark.parametrize("wgrad", [True, False], ids=["dw", "no_dw"])
@pytest.mark.parametrize("op", ["rms_norm", "fused_add_rms_norm"])
def test_lone_call_dispatches(op, wgrad, w_dtype, shape):
    with fake_cuda():
        forward, backward = host_case(op, shape, w_dtype=w_dtype, wgrad=wgrad)
        outputs, fwd = host.count(forward)
        grads, bwd = host.count(lambda: backward(outputs))
    want_fwd, want_bwd = EXPECTED[op, wgrad]
    if wgrad and w_dtype != torch.float32:
        want_bwd = {**want_bwd, "aten._to_copy": 1}  # the fp32 sum rounded once to the weight's dtype
    assert fwd.aten_ops == want_fwd, fwd.text()
    assert bwd.aten_ops == want_bwd, bwd.text()
    assert fwd.launches == [FWD] and bwd.launches == [BWD]  # one block per row at 4096: no row-dot pass
    assert fwd.torch_calls <= MAX_TORCH_CALLS[op][0], fwd.text()
    assert bwd.torch_calls <= MAX_TORCH_CALLS[op][1], bwd.text()
    # what came back: the outputs in x's shape, each gradient in its input's shape and dtype, dweight in weight's
    assert all(o.shape == shape for o in outputs)
    want = [shape, (shape[-1],)] if wgrad else [shape]  # x's (and the weight's), then the residual's
    assert [g.shape for g in grads] == want + ([shape] if op == "fused_add_rms_norm" else [])
    if wgrad:
        assert grads[1].dtype == w_dtype


def test_fake_cuda_keeps_its_launch_plans_to_itself():
    # plans are cached from the device's SM count: fake CUDA's (an H100's 132) must not outlive it, nor a real one's
    # leak into it
    rms_mod._PLANS[("stale",)] = None
    with fake_cuda():
        assert not rms_mod._PLANS
        forward, backward = host_case("rms_norm")
        with host.record("none"):
            backward(forward())
        assert any(key[-1] == torch.device("cuda", 0) for key in rms_mod._PLANS)  # the backward's: 264 programs
    assert not rms_mod._PLANS
