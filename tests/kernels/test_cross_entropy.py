"""Tests for kernels/cross_entropy.py (Triton interpreter on CPU; the gpu-marked test needs CUDA).

Tolerance model (tests/tolerance.py): fp32 against the fp32 reference with rtol 1e-5 (losses) and
atol 1e-6 * max|grad| (gradients). bf16/fp16: our error against the fp32 reference of the same
low-precision logits is at most 2x PyTorch's own error running the op in that dtype (F.cross_entropy
+ logsumexp for the z-loss, autograd for the gradients), plus one bf16 ulp because the interpreter's
fp32->bf16 stores truncate instead of rounding (DESIGN.md).
Shapes are small (the interpreter costs tens of ms per program here) but awkward: vocab 5003, 30% of the
targets ignored at random, 2-D and 3-D inputs.
"""

from __future__ import annotations

import importlib
import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import kernels
from kernels import cross_entropy, cross_entropy_ref
from tests.tolerance import assert_lowp_close, poisoned_like

# `kernels.cross_entropy` is the function (the package exports it); the module is in sys.modules.
ce_mod = importlib.import_module("kernels.cross_entropy")

V = 5003
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def make_inputs(lead, vocab=V, dtype=torch.float32, ignore_frac=0.3, seed=0, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(*lead, vocab, generator=g) * scale).to(dtype)
    target = torch.randint(0, vocab, lead, generator=g)
    target[torch.rand(lead, generator=g) < ignore_frac] = -100
    return logits, target


def run(fn, logits, target, upstream, **kw):
    """Loss and d(sum(loss * upstream))/dlogits for fn, on a fresh leaf copy of logits."""
    x = logits.detach().clone().requires_grad_()
    loss = fn(x, target, **kw)
    (loss * upstream).sum().backward()
    return loss.detach(), x.grad


def torch_lowp(
    logits,
    target,
    *,
    label_smoothing=0.0,
    ignore_index=-100,
    reduction="mean",
    z_loss=0.0,
    num_items=None,
    softcap=None,
):
    """The same loss from PyTorch's own ops in the logits' dtype (softcapped as transformers' Gemma 2 does): the
    low-precision baseline."""
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    flat, t = logits.reshape(-1, logits.shape[-1]), target.reshape(-1)
    rows = F.cross_entropy(flat, t, ignore_index=ignore_index, label_smoothing=label_smoothing, reduction="none")
    if z_loss:
        lse = torch.logsumexp(flat, dim=-1)
        rows = rows + z_loss * lse * lse * (t != ignore_index)
    if reduction == "none":
        return rows.reshape(target.shape)
    if reduction == "sum":
        return rows.sum()
    denom = num_items if num_items is not None else (t != ignore_index).sum().clamp(min=1)
    return rows.sum() / denom


def upstream_for(case, target, dtype):
    if case["reduction"] == "none":
        return (torch.arange(target.numel(), dtype=torch.float32).reshape(target.shape) % 5 - 1.5).to(dtype)
    return torch.tensor(case["up"], dtype=dtype)


CASES = [
    dict(lead=(16,), reduction="mean", label_smoothing=0.0, z_loss=0.0, up=1.0),  # up == 1: the skipped backward pass
    dict(lead=(2, 7), reduction="sum", label_smoothing=0.1, z_loss=0.0, up=2.5),
    dict(lead=(13,), reduction="none", label_smoothing=0.1, z_loss=1e-3, up=None),
    dict(lead=(3, 5), reduction="mean", label_smoothing=0.0, z_loss=1e-3, up=0.5, num_items=torch.tensor(50)),
    # Gemma 2's final softcapping; a cap of 5 puts the logits (std 2) on both sides of the kernel's tanh branches
    dict(lead=(2, 7), reduction="sum", label_smoothing=0.1, z_loss=1e-3, up=2.5, softcap=5.0),
    dict(lead=(11,), reduction="none", label_smoothing=0.0, z_loss=0.0, up=None, softcap=30.0),
]


def check_case(case, dtype, seed=0):
    logits, target = make_inputs(case["lead"], dtype=dtype, seed=seed)
    kw = {k: case[k] for k in ("reduction", "label_smoothing", "z_loss", "softcap") if k in case}
    if "num_items" in case:
        kw["num_items"] = case["num_items"]
    up = upstream_for(case, target, dtype)
    loss, grad = run(cross_entropy, logits, target, up, **kw)
    ref_loss, ref_grad = run(cross_entropy_ref, logits.float(), target, up.float(), **kw)
    # The reference agrees with PyTorch's own op in fp32 (z-loss added by hand).
    torch_loss, torch_grad = run(torch_lowp, logits.float(), target, up.float(), **kw)
    torch.testing.assert_close(ref_loss, torch_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ref_grad, torch_grad, rtol=1e-4, atol=1e-7)
    assert loss.dtype == dtype and grad.dtype == dtype and loss.shape == ref_loss.shape
    if dtype == torch.float32:
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(grad, ref_grad, rtol=0, atol=1e-6 * ref_grad.abs().max().item())
    else:
        low_loss, low_grad = run(torch_lowp, logits, target, up, **kw)
        ulps = 1 if dtype == torch.bfloat16 else 0  # interpreter bf16 stores truncate
        assert_lowp_close(loss, ref_loss, low_loss, dtype, name="loss", extra_ulps=ulps)
        assert_lowp_close(grad, ref_grad, low_grad, dtype, name="grad", extra_ulps=ulps)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_matches_reference_and_torch(case, dtype):
    check_case(CASES[case], dtype)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_online_lse_across_tiles(monkeypatch, dtype):
    # The GPU config streams V = 128256 in 16 tiles; force 1024-wide tiles (5 for V = 5003, a ragged last one).
    monkeypatch.setattr(ce_mod, "_fwd_config", lambda n_cols, on_cuda, variant: (1024, 4))
    check_case(dict(lead=(9,), reduction="none", label_smoothing=0.1, z_loss=1e-3, up=None), dtype, seed=1)
    check_case(dict(lead=(5,), reduction="none", label_smoothing=0.1, z_loss=0.0, up=None, softcap=3.0), dtype, seed=4)


@pytest.mark.parametrize("variant", ce_mod.FWD_VARIANTS)
def test_every_forward_variant_matches_reference(monkeypatch, variant):
    # 1024-wide tiles (5 for V = 5003) so every loop runs several times; 9 rows for the persistent variant's
    # 4 interpreter programs, so some programs take three rows. 3-D strided logits, ignored rows, smoothing,
    # z-loss and a per-row gradient scale all go through each variant.
    monkeypatch.setattr(ce_mod, "_fwd_config", lambda n_cols, on_cuda, variant: (1024, 4))
    case = dict(lead=(3, 3), reduction="none", label_smoothing=0.1, z_loss=1e-3, up=None)
    with ce_mod.fwd_variant(variant):
        check_case(case, torch.bfloat16, seed=2)
        full, labels = make_inputs((3, 4), seed=3)
        loss, grad = run(cross_entropy, full[:, :-1], labels[:, 1:], 1.0, label_smoothing=0.1)
    ref_loss, ref_grad = run(cross_entropy_ref, full[:, :-1], labels[:, 1:], 1.0, label_smoothing=0.1)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, ref_grad, rtol=0, atol=1e-6 * ref_grad.abs().max().item())


def test_forward_variant_gpu_configs_and_bad_name():
    assert ce_mod._fwd_config(128256, True, "default") == (8192, 16)
    assert ce_mod._fwd_config(128256, True, "block16384") == (16384, 32)
    for variant in ce_mod.FWD_VARIANTS:  # the interpreter: one 8192-wide tile at most, 4 warps
        assert ce_mod._fwd_config(128256, False, variant) == (8192, 4)
        assert ce_mod._fwd_config(5003, False, variant) == (8192, 4)
    assert ce_mod._fwd_grid(100, torch.device("cpu"), "default") == 100
    assert ce_mod._fwd_grid(100, torch.device("cpu"), "persistent") == 4
    with pytest.raises(ValueError, match="'fastest' is not one of default, block16384, evict"):
        with ce_mod.fwd_variant("fastest"):
            pass


def test_all_ignored_gives_zero_not_nan():
    logits, _ = make_inputs((6,), dtype=torch.bfloat16)
    target = torch.full((6,), -100)
    for reduction in ("mean", "sum", "none"):
        up = torch.ones(6, dtype=torch.bfloat16) if reduction == "none" else torch.tensor(3.0, dtype=torch.bfloat16)
        loss, grad = run(cross_entropy, logits, target, up, reduction=reduction, label_smoothing=0.1, z_loss=1e-3)
        assert torch.equal(loss.float(), torch.zeros_like(loss.float())), reduction
        assert torch.equal(grad.float(), torch.zeros_like(grad.float())), reduction


def test_custom_ignore_index_inside_vocab():
    logits, target = make_inputs((10,), vocab=777, seed=3)
    target[target == -100] = 5  # class 5 is the ignored one now
    loss, grad = run(cross_entropy, logits, target, 1.0, ignore_index=5)
    ref_loss, ref_grad = run(F.cross_entropy, logits, target, 1.0, ignore_index=5)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-7)


def test_confident_target_gradient_stays_accurate_in_bf16():
    # Target logit 30 above the rest: p_y = 1 - 4.7e-10 and dloss/dx_y = p_y - 1 is tiny; the naive
    # fp32 1/d - 1 rounds it to 0. Compare against float64.
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(6, V, generator=g)
    target = torch.randint(0, V, (6,), generator=g)
    logits[torch.arange(6), target] = logits.max(dim=1).values + 30.0
    logits = logits.to(torch.bfloat16)
    loss, grad = run(cross_entropy, logits, target, 1.0, reduction="none")
    ref_loss, ref_grad = run(F.cross_entropy, logits.double(), target, 1.0, reduction="none")
    rows = torch.arange(6)
    gy, ref_gy = grad[rows, target].double(), ref_grad[rows, target]
    assert (ref_gy < 0).all() and (ref_gy.abs() < 1e-8).all()
    # one ulp for rounding the fp32 result + one for the interpreter's truncating store
    assert ((gy - ref_gy).abs() / ref_gy.abs()).max() <= 2 * 2.0**-8
    assert ((loss.double() - ref_loss).abs() / ref_loss).max() <= 2.0**-8
    others = grad.double().clone()
    others[rows, target] = 0
    ref_others = ref_grad.clone()
    ref_others[rows, target] = 0
    assert ((others - ref_others).abs() <= 2 * 2.0**-8 * ref_others.abs()).all()


def test_losses_accumulate_in_fp32():
    # A 5003-term bf16 sum would be off by many ulps; ours must be within half an ulp of the fp32 value.
    logits, target = make_inputs((16,), dtype=torch.bfloat16, seed=4, ignore_frac=0.0)
    for kw in (dict(reduction="none", label_smoothing=0.1, z_loss=1e-3), dict(reduction="mean", label_smoothing=0.1)):
        with torch.no_grad():
            ours = cross_entropy(logits, target, **kw).double()
            ref = cross_entropy_ref(logits.float(), target, **kw).double()
        ulp = 2.0 ** (torch.floor(torch.log2(ref.abs())) - 7)
        assert ((ours - ref).abs() <= 0.5 * ulp + 1e-5 * ref.abs()).all(), kw


def test_every_output_element_is_written():
    logits, target = make_inputs((9,), dtype=torch.bfloat16, seed=5)
    grad = poisoned_like(logits)
    loss_rows = torch.full((9,), float("nan"))
    out_rows, lse, out_grad = ce_mod.cross_entropy_fwd(
        logits,
        target,
        label_smoothing=0.1,
        z_loss=1e-3,
        grad_scale=torch.tensor(0.5),
        grad_out=grad,
        loss_out=loss_rows,
    )
    assert out_grad is grad and out_rows is loss_rows
    assert torch.isfinite(grad.float()).all() and torch.isfinite(loss_rows).all() and torch.isfinite(lse).all()
    assert (grad[target == -100] == 0).all()


def test_no_host_sync_during_forward_and_backward(monkeypatch):
    logits, target = make_inputs((2, 5), dtype=torch.bfloat16, seed=6)
    x = logits.clone().requires_grad_()

    def host_sync(*args, **kwargs):
        raise AssertionError("host synchronisation inside cross_entropy")

    for name in ("item", "tolist", "__bool__", "__int__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, host_sync)
    loss = cross_entropy(x, target, num_items=torch.tensor(7), label_smoothing=0.1)
    (loss * 2).backward()
    loss_none = cross_entropy(x, target, reduction="none")
    loss_none.sum().backward()
    monkeypatch.undo()
    assert torch.isfinite(x.grad.float()).all()


class AllocationRecorder(TorchDispatchMode):
    """Records every floating-point tensor an op creates on fresh storage (views and interpreter copies excluded)."""

    def __init__(self, min_numel):
        super().__init__()
        self.min_numel = min_numel
        self.known: set[int] = set()
        self.allocs: list[tuple[tuple[int, ...], torch.dtype]] = []

    def _ptr(self, t):
        return t.untyped_storage().data_ptr()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        flat = list(args) + list((kwargs or {}).values())
        for a in flat:
            if isinstance(a, torch.Tensor):
                self.known.add(self._ptr(a))
            elif isinstance(a, torch.UntypedStorage):
                self.known.add(a.data_ptr())
        out = func(*args, **(kwargs or {}))
        for o in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(o, torch.Tensor):
                ptr = self._ptr(o)
                if ptr not in self.known and o.dtype.is_floating_point and o.numel() >= self.min_numel:
                    self.allocs.append((tuple(o.shape), o.dtype))
                self.known.add(ptr)
        return out


def test_one_vocab_sized_buffer_and_caller_logits_untouched():
    logits, target = make_inputs((2, 6), dtype=torch.bfloat16, seed=8)
    x = logits.clone().requires_grad_()
    with AllocationRecorder(min_numel=12 * V) as rec:
        loss = cross_entropy(x, target, label_smoothing=0.1)
        loss.backward()
    # the gradient is the only (tokens, vocab) allocation, in the logits' dtype: no fp32 copy
    assert rec.allocs == [((2, 6, V), torch.bfloat16)]
    assert torch.equal(x.detach(), logits), "the caller's logits were modified"
    assert x.grad.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()


def test_second_backward_through_retained_graph_fails_loudly():
    logits, target = make_inputs((4,), vocab=301, seed=9)
    x = logits.clone().requires_grad_()
    loss = cross_entropy(x, target)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_no_grad_path_and_out_of_range_target():
    logits, target = make_inputs((7,), vocab=911, seed=10)
    with torch.no_grad():
        ours = cross_entropy(logits, target, reduction="none", label_smoothing=0.1)
    torch.testing.assert_close(
        ours, F.cross_entropy(logits, target, reduction="none", label_smoothing=0.1), rtol=1e-5, atol=1e-6
    )
    target[2] = 911  # out of range: NaN for that row on the Triton path (no host-side check)
    x = logits.clone().requires_grad_()
    loss = cross_entropy(x, target, reduction="none")
    loss.sum().backward()
    assert torch.isnan(loss[2]) and torch.isnan(x.grad[2]).all()
    assert torch.isfinite(loss[[0, 1, 3, 4, 5, 6]]).all() and torch.isfinite(x.grad[[0, 1, 3, 4, 5, 6]]).all()


def test_reference_path_by_backend_switch():
    logits, target = make_inputs((3, 4), vocab=97, seed=11)
    with kernels.backend("reference"):
        loss, grad = run(cross_entropy, logits, target, 1.0, z_loss=1e-2)
    ref_loss, ref_grad = run(cross_entropy_ref, logits, target, 1.0, z_loss=1e-2)
    assert torch.equal(loss, ref_loss) and torch.equal(grad, ref_grad)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(reduction="avg"), "reduction='avg' is not one of"),
        (dict(label_smoothing=1.5), "label_smoothing=1.5 must be a float in"),
        (dict(z_loss=-1.0), "z_loss=-1.0 must be"),
        (dict(num_items=10, reduction="sum"), "num_items is only valid with reduction='mean'"),
        (dict(num_items=0), "num_items=0 must be a positive int"),
        (dict(ignore_index=1.5), "ignore_index=1.5 must be an int"),
        (dict(softcap=0.0), "softcap=0.0 must be None or a number > 0"),
    ],
)
def test_bad_arguments_raise_clear_errors(kwargs, match):
    logits, target = make_inputs((3,), vocab=11)
    with pytest.raises(ValueError, match=match):
        cross_entropy(logits, target, **kwargs)


def test_bad_shapes_and_dtypes_raise_clear_errors():
    logits, target = make_inputs((3,), vocab=11)
    with pytest.raises(ValueError, match="logits must be"):
        cross_entropy(logits, target[:2])
    with pytest.raises(ValueError, match="target dtype"):
        cross_entropy(logits, target.float())


def test_torch_compile_fullgraph_cpu():
    torch._dynamo.reset()
    logits, target = make_inputs((2, 5), vocab=257, seed=12)

    def fn(x, t):
        return cross_entropy(x, t, label_smoothing=0.1, z_loss=1e-3, num_items=torch.tensor(9))

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    loss, grad = run(lambda x, t: compiled(x, t), logits, target, 1.0)
    ref_loss, ref_grad = run(
        lambda x, t: cross_entropy_ref(x, t, label_smoothing=0.1, z_loss=1e-3, num_items=9), logits, target, 1.0
    )
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-7)


@pytest.mark.gpu
def test_gpu_triton_compiles_fullgraph_matches_and_keeps_fp32():
    from torch._dynamo.testing import EagerAndRecordGraphs

    torch._dynamo.reset()
    logits, target = make_inputs((4, 64), vocab=32003, dtype=torch.bfloat16, seed=13)
    logits, target = logits.cuda(), target.cuda()

    def fn(x, t, ls, z):
        return cross_entropy(x, t, label_smoothing=ls, z_loss=z)

    ref_loss, ref_grad = run(
        lambda x, t: cross_entropy_ref(x.float(), t, label_smoothing=0.1, z_loss=1e-4), logits, target, 1.0
    )
    low_loss, low_grad = run(lambda x, t: torch_lowp(x, t, label_smoothing=0.1, z_loss=1e-4), logits, target, 1.0)
    torch.cuda.set_sync_debug_mode("error")
    try:
        eager_loss, eager_grad = run(lambda x, t: fn(x, t, 0.1, 1e-4), logits, target, 1.0)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    recorder = EagerAndRecordGraphs()
    rec_loss, _ = run(
        lambda x, t: torch.compile(fn, backend=recorder, fullgraph=True)(x, t, 0.1, 1e-4), logits, target, 1.0
    )
    # Python floats (label_smoothing, z_loss) must stay constants, not become fp64 graph tensors; the
    # autograd.Function's forward/backward live in subgraphs.
    for gm in recorder.graphs:
        for sub in gm.modules():
            for node in sub.graph.nodes if isinstance(sub, torch.fx.GraphModule) else ():
                val = node.meta.get("example_value")
                assert not (isinstance(val, torch.Tensor) and val.dtype == torch.float64), (
                    f"fp64 tensor in graph: {node}"
                )
    comp_loss, comp_grad = run(lambda x, t: torch.compile(fn, fullgraph=True)(x, t, 0.1, 1e-4), logits, target, 1.0)
    for loss, grad in ((eager_loss, eager_grad), (comp_loss, comp_grad)):
        assert loss.dtype == torch.bfloat16 and grad.dtype == torch.bfloat16
        assert_lowp_close(loss, ref_loss, low_loss, torch.bfloat16, name="loss")
        assert_lowp_close(grad, ref_grad, low_grad, torch.bfloat16, name="grad")
    assert torch.equal(rec_loss, eager_loss)


def test_bench_cross_entropy_runs(tmp_path, monkeypatch):
    import bench.bench_cross_entropy as bench_ce
    import bench.common as common

    monkeypatch.setattr(common, "RESULTS", tmp_path)
    bench_ce.main(["--quick", "--compile-backend", "aot_eager"])
    rows = (tmp_path / "cross_entropy.jsonl").read_text().splitlines()
    assert len(rows) >= 3 and all('"perf_figure": false' in r for r in rows)
    assert math.isfinite(float(__import__("json").loads(rows[0])["ms"]))


def test_strided_3d_logits_are_read_in_place():
    # The causal-LM shift logits[:, :-1] is not viewable as (N, V): the kernel must take its strides
    # (no (N, V) copy) and still match.
    full, labels = make_inputs((2, 6), dtype=torch.bfloat16, seed=14)
    x = full.clone().requires_grad_()
    with AllocationRecorder(min_numel=10 * V) as rec:  # the forward: where a copy would be made
        loss = cross_entropy(x[:, :-1], labels[:, 1:], reduction="none")
    assert rec.allocs == [((2, 5, V), torch.bfloat16)]  # the gradient buffer only
    (loss * torch.arange(10, dtype=torch.bfloat16).reshape(2, 5)).sum().backward()
    y = full.float().clone().requires_grad_()
    ref = cross_entropy_ref(y[:, :-1], labels[:, 1:], reduction="none")
    (ref * torch.arange(10.0).reshape(2, 5)).sum().backward()
    low = full.clone().requires_grad_()
    low_loss = torch_lowp(low[:, :-1], labels[:, 1:], reduction="none")
    (low_loss * torch.arange(10, dtype=torch.bfloat16).reshape(2, 5)).sum().backward()
    assert_lowp_close(loss, ref, low_loss, torch.bfloat16, name="loss", extra_ulps=1)
    assert_lowp_close(x.grad, y.grad, low.grad, torch.bfloat16, name="grad", extra_ulps=1)
    assert (x.grad[:, -1] == 0).all()


def test_autocast_returns_fp32_loss_like_torch():
    logits, target = make_inputs((6,), vocab=1001, dtype=torch.bfloat16, seed=15)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, grad = run(cross_entropy, logits, target, 1.0, label_smoothing=0.1)
        torch_loss, torch_grad = run(F.cross_entropy, logits, target, 1.0, label_smoothing=0.1)
    assert loss.dtype == torch_loss.dtype == torch.float32 and grad.dtype == torch.bfloat16
    torch.testing.assert_close(loss, torch_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, torch_grad, rtol=2**-7, atol=2**-7 * torch_grad.abs().max().item())


def test_bench_every_variant_with_its_byte_model(tmp_path, monkeypatch, capsys):
    import bench.bench_cross_entropy as bench_ce
    import bench.common as common

    monkeypatch.setattr(common, "RESULTS", tmp_path)
    bench_ce.main(["--quick", "--providers", "ours", "--variant", "all"])
    rows = [json.loads(r) for r in (tmp_path / "cross_entropy.jsonl").read_text().splitlines()]
    assert sorted({r["variant"] for r in rows}) == sorted(ce_mod.FWD_VARIANTS)
    full = [r for r in rows if r["mode"] == "full"]
    # every variant moves the same bytes: the exact model at this shape (8 x 1000 bf16, target[::10] -> 1 ignored row);
    # about 2 reads + 1 write per kept logit against the minimum's 1 + 1 (bench_cross_entropy.traffic_parts)
    model = bench_ce.byte_model("full", 8, 1000, 2, n_ignored=1)
    expected = model.columns(8 * 1000, 1.0)
    assert {r["bytes_rw"] for r in full} == {expected["bytes_rw"]} and {r["bytes_rw_min"] for r in full} == {"1.75+2"}
    ratio = (model.read + model.write) / (model.min_read + model.min_write)
    assert 1.4 < ratio < 1.5
    assert all(r["gb_s_ours"] == pytest.approx(ratio * r["gb_s_min"]) for r in full)
    assert f"B/elt r+w ours {expected['bytes_rw']}" in capsys.readouterr().out
