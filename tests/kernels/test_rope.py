"""RoPE: the Triton kernel (through the interpreter on CPU) against the fp32 reference and transformers'
apply_rotary_pos_emb, forward and both gradients (q, k; cos and sin take none: refused when they require grad).

Tolerance model (tests/tolerance.py):
- fp32: |ours - ref| <= 2 eps32 |ref|max for q_rot, k_rot, dq, dk (each output element is two products and one
  sum, rounded at most three times in fp32); transformers' own fp32 apply_rotary_pos_emb is a second oracle at
  the same bound.
- bf16/fp16: our error against the fp32 reference <= 2x transformers' error running apply_rotary_pos_emb in that
  dtype (cos/sin cast to it, as its rotary module does), + 1 bf16 ulp of |ref|max because the interpreter
  truncates fp32->bf16 stores (DESIGN.md).
Bytes: bench/traffic.py counts the launches' loads and stores; they equal the minimum (read q, k and cos/sin once
per (cos row, position), write the outputs once; backward the same with the gradients).
Shapes are small and odd (T = 7, 33; head_dim 80 pads D/2 = 40 to a 64-wide block), GQA head counts (4/2, 6/3,
5/1); one program covers many positions, so the whole file runs in a few seconds of interpreter time.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

import kernels
from bench import traffic
from kernels.rope import RoPEFunction, launch_config, rope, rope_launch, rope_ref, tile_flags
from tests.tolerance import PoisonedTorch, assert_lowp_close, max_abs_err

rope_mod = importlib.import_module("kernels.rope")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
EPS32 = torch.finfo(torch.float32).eps
# (B, Hq, Hkv, T, D, cos batch): GQA 2:1 with per-row cos; 6:3 with D/2 = 40 (masked columns) and a shared cos
# row; 5:1 with a single position; 4:2 with whole position blocks and power-of-two heads (no masks: EVEN); 6:3 at
# head_dim 1024, where q's heads take two tiles (not ONE_TILE).
SHAPES = [(2, 4, 2, 7, 16, 2), (1, 6, 3, 33, 80, 1), (3, 5, 1, 1, 8, 3), (2, 4, 2, 16, 16, 1), (2, 6, 3, 5, 1024, 2)]


@pytest.fixture(autouse=True)
def _triton_backend():
    with kernels.backend("triton"):
        yield


def _make(B, Hq, Hkv, T, D, Bc, dtype, seed=0):
    """q, k as the model holds them: (B, H, T, D) transposes of (B, T, H, D) projections; cos/sin fp32 angles of
    arbitrary (not halves-duplicated) rows, so a kernel that assumed c1 = c2 would fail; output gradients."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, Hq, D, generator=g).to(dtype).transpose(1, 2)  # (B, Hq, T, D)
    k = torch.randn(B, T, Hkv, D, generator=g).to(dtype).transpose(1, 2)  # (B, Hkv, T, D)
    angles = torch.rand(Bc, T, D, generator=g) * 6.3  # (Bc, T, D)
    dq = torch.randn(B, Hq, T, D, generator=g).to(dtype)
    dk = torch.randn(B, Hkv, T, D, generator=g).to(dtype)
    return q, k, angles.cos(), angles.sin(), dq, dk


def _fwd_bwd(fn, q, k, cos, sin, dq, dk):
    q = q.detach().clone().requires_grad_()
    k = k.detach().clone().requires_grad_()
    q_rot, k_rot = fn(q, k, cos, sin)
    gq, gk = torch.autograd.grad((q_rot, k_rot), (q, k), (dq, dk))
    return q_rot.detach(), k_rot.detach(), gq, gk


def _hf(q, k, cos, sin):
    """transformers' apply_rotary_pos_emb, with cos/sin in q's dtype as its rotary module returns them."""
    return apply_rotary_pos_emb(q, k, cos.to(q.dtype), sin.to(q.dtype))


def _assert_fp32_close(ours, ref, name):
    assert ours.shape == ref.shape and ours.dtype == ref.dtype, (
        f"{name}: {ours.shape}/{ours.dtype} vs {ref.shape}/{ref.dtype}"
    )
    bound = 2 * EPS32 * ref.abs().max().item()
    err = max_abs_err(ours, ref)
    assert err <= bound, f"{name}: fp32 error {err:.3e} > {bound:.3e}"


NAMES = ("q_rot", "k_rot", "dq", "dk")


def _check_all(ours, ref32, hf_lowp, dtype):
    for o, r, h, name in zip(ours, ref32, hf_lowp, NAMES):
        assert o.dtype == dtype, f"{name}: dtype {o.dtype}"
        if dtype == torch.float32:
            _assert_fp32_close(o, r, name)
            _assert_fp32_close(o, h, f"{name} vs transformers")
        else:
            assert_lowp_close(o, r, h.float(), dtype, name=name, extra_ulps=1 if dtype == torch.bfloat16 else 0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_matches_reference_and_transformers(shape, dtype):
    q, k, cos, sin, dq, dk = _make(*shape, dtype)
    ours = _fwd_bwd(rope, q, k, cos, sin, dq, dk)
    ref32 = _fwd_bwd(rope_ref, q.float(), k.float(), cos, sin, dq.float(), dk.float())
    hf = _fwd_bwd(_hf, q, k, cos, sin, dq, dk)
    _check_all(ours, ref32, hf, dtype)
    # Outputs and gradients live in (B, T, H, D) memory: the layout attention and q_proj's backward read.
    for t, name in zip(ours, NAMES):
        assert t.transpose(1, 2).is_contiguous(), f"{name}: strides {t.stride()} are not (B, T, H, D) memory"


def test_rotary_module_angles_llama3_scaling_and_packed_positions():
    """cos/sin from transformers' own rotary module (llama3 scaling), positions restarting mid-row (packing);
    fp32, and bf16 with the module's bf16 cos/sin."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    )
    position_ids = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 40, 41], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]])
    q, k, _, _, dq, dk = _make(2, 4, 2, 11, 16, 2, torch.float32)
    rotary = LlamaRotaryEmbedding(config)
    cos, sin = rotary(q, position_ids)  # (2, 11, 16) fp32
    ours = _fwd_bwd(rope, q, k, cos, sin, dq, dk)
    hf = _fwd_bwd(apply_rotary_pos_emb, q, k, cos, sin, dq, dk)
    for o, h, name in zip(ours, hf, NAMES):
        _assert_fp32_close(o, h, name)
    # A bf16 model: the rotary module hands cos/sin in bf16; we read them as they are and compute in fp32.
    qb, kb, dqb, dkb = (t.to(torch.bfloat16) for t in (q, k, dq, dk))
    cos_b, sin_b = rotary(qb, position_ids)
    assert cos_b.dtype == torch.bfloat16
    ours = _fwd_bwd(rope, qb, kb, cos_b, sin_b, dqb, dkb)
    ref32 = _fwd_bwd(rope_ref, qb.float(), kb.float(), cos_b.float(), sin_b.float(), dqb.float(), dkb.float())
    hf = _fwd_bwd(apply_rotary_pos_emb, qb, kb, cos_b, sin_b, dqb, dkb)
    for o, r, h, name in zip(ours, ref32, hf, NAMES):
        assert_lowp_close(o, r, h.float(), torch.bfloat16, name=name, extra_ulps=1)


def test_any_input_strides_no_copies_outputs_fully_written(monkeypatch):
    """q and k sliced out of one fused (B, T, Hq + 2 Hkv, D) projection (non-dense strides), a contiguous
    (B, H, T, D) k, cos with a stride-0 batch (expand) and sin also read through a transposed buffer; no input is
    copied (`.contiguous()` would double the bytes) and every output element is written."""
    B, Hq, Hkv, T, D = 2, 4, 2, 9, 16
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(B, T, Hq + 2 * Hkv, D, generator=g)  # (B, T, Hq + 2 Hkv, D)
    q = qkv[:, :, :Hq].transpose(1, 2)  # (B, Hq, T, D), strides of the fused buffer
    k = torch.randn(B, Hkv, T, D, generator=g)  # (B, Hkv, T, D) contiguous
    angles = torch.rand(1, T, D, generator=g) * 6.3
    cos = angles.cos().expand(B, T, D)  # batch stride 0
    sin = angles.sin()[0].t().contiguous().t().expand(B, T, D)  # strides (0, 1, T): column stride T
    dq = torch.randn(B, T, Hq, D, generator=g).transpose(1, 2)
    dk = torch.randn(B, Hkv, T, D, generator=g)
    assert sin.stride() == (0, 1, T) and cos.stride(0) == 0
    ref = _fwd_bwd(rope_ref, q, k, cos, sin, dq, dk)

    def no_copy(self, *args, **kwargs):
        raise AssertionError("kernels.rope copied an input")

    poisoned = PoisonedTorch()
    monkeypatch.setattr(rope_mod, "torch", poisoned)
    monkeypatch.setattr(torch.Tensor, "contiguous", no_copy)
    ours = _fwd_bwd(rope, q, k, cos, sin, dq, dk)
    monkeypatch.undo()
    assert poisoned.calls == 4  # q_rot, k_rot, dq, dk
    for o, r, name in zip(ours, ref, NAMES):
        _assert_fp32_close(o, r, name)


def _rope_minimum(q, k, cos):
    """(read, write) bytes a rotation must move: q and k once each way, cos and sin once per (cos row, position)."""
    qk = (q.numel() + k.numel()) * q.element_size()
    return qk + 2 * cos.numel() * cos.element_size(), qk


@pytest.mark.parametrize(
    "shape, dtype", [((2, 4, 2, 7, 16, 2), torch.bfloat16), ((3, 6, 3, 33, 80, 1), torch.float16)], ids=str
)
def test_measured_bytes_are_the_minimum(shape, dtype):
    """bench/traffic.py counts every lane of every load and store: forward and backward are one launch each and
    move exactly the minimum (issued = distinct: nothing is read twice, cos/sin not once per head; the padded
    columns of head_dim 80 cost nothing)."""
    q, k, cos, sin, dq, dk = _make(*shape, dtype)
    q.requires_grad_()
    k.requires_grad_()
    want_read, want_write = _rope_minimum(q, k, cos)
    with traffic.measure() as fwd:
        q_rot, k_rot = rope(q, k, cos, sin)
    with traffic.measure() as bwd:
        torch.autograd.grad((q_rot, k_rot), (q, k), (dq, dk))
    for t, inputs in ((fwd, (q, k)), (bwd, (dq, dk))):
        assert [launch.kernel for launch in t.launches] == ["_rope_kernel"], t.summary()
        assert (t.read_bytes, t.write_bytes) == (want_read, want_write), t.summary()
        assert (t.distinct_read, t.distinct_write) == (want_read, want_write), t.summary()
        tensors = t.by_tensor()
        for name, x in zip(("q_ptr", "k_ptr"), inputs):
            assert (tensors[name].read, tensors[name].write) == (x.numel() * x.element_size(), 0), t.summary()
        for name, x in (("cos_ptr", cos), ("sin_ptr", sin)):
            assert tensors[name].read == x.numel() * 4, t.summary()


def test_batch_shared_cos_read_once_per_position_when_looping_over_the_batch():
    """cos/sin (1, T, D): one program per position block loops over the batch and reads them once (the launcher's
    choice on the interpreter); one program per (position block, batch), its choice on CUDA, reads them once per
    batch row (issued B times, distinct once: adjacent programs, so L2 serves the repeats on a GPU)."""
    q, k, cos, sin, _, _ = _make(3, 4, 2, 7, 16, 1, torch.bfloat16)
    cos_bytes = cos.numel() * 4
    for batches_per_program, issued in ((3, cos_bytes), (1, 3 * cos_bytes)):
        with traffic.measure() as t:
            rope_launch(q, k, cos, sin, batches_per_program=batches_per_program)
        tensors = t.by_tensor()
        assert (tensors["cos_ptr"].read, tensors["cos_ptr"].distinct_read) == (issued, cos_bytes), t.summary()
        assert (tensors["sin_ptr"].read, tensors["sin_ptr"].distinct_read) == (issued, cos_bytes), t.summary()


def test_batch_shared_cos_same_result_either_grouping():
    """Shared cos/sin: one program per position block looping over the batch (the CPU default), or one per
    (position block, batch); both bitwise equal; per-row cos refuses the batch loop."""
    q, k, cos, sin, _, _ = _make(3, 4, 2, 7, 16, 1, torch.bfloat16, seed=4)
    looped = rope_launch(q, k, cos, sin, batches_per_program=3)
    per_batch = rope_launch(q, k, cos, sin, batches_per_program=1)
    default = rope_launch(q, k, cos, sin)
    for a, b, c in zip(looped, per_batch, default):
        assert torch.equal(a, b) and torch.equal(a, c)
    back = rope_launch(q, k, cos, sin, backward=True, batches_per_program=3)
    back1 = rope_launch(q, k, cos, sin, backward=True, batches_per_program=1)
    assert all(torch.equal(a, b) for a, b in zip(back, back1))
    with pytest.raises(ValueError, match="batches_per_program=3 must be 1, or B=3 with batch-shared"):
        rope_launch(q, k, cos.expand(3, 7, 16).contiguous(), sin.expand(3, 7, 16).contiguous(), batches_per_program=3)


def test_shapes_cover_every_kernel_variant():
    # (ONE_TILE, EVEN): loads of q and k before the stores, with and without masks, and q's heads over several tiles.
    flags = {tile_flags(T, Hq, Hkv, D) for _, Hq, Hkv, T, D, _ in SHAPES}
    assert flags == {(True, True), (True, False), (False, False)}
    assert tile_flags(8192, 32, 8, 128) == (True, True)  # Llama-3-8B's heads at the benchmark's length


def test_launch_config_llama_heads():
    # Llama-3-8B heads: one position's 32 q heads per tile (32 x 64 = 2048 elements per half), k's 8 heads.
    assert launch_config(2048, 32, 8, 128) == (1, 32, 8, 64, 4)
    assert launch_config(33, 6, 3, 80) == (4, 8, 4, 64, 4)


def test_one_output_used_and_frozen_inputs():
    """Only q_rot reaches the loss (k_rot's gradient is autograd's zeros); k frozen: no dk; then q frozen."""
    q, k, cos, sin, dq, _ = _make(2, 4, 2, 7, 16, 2, torch.float32, seed=5)
    qg = q.detach().clone().requires_grad_()
    q_rot, k_rot = rope(qg, k, cos, sin)
    assert k_rot.grad_fn is not None  # one node for both outputs
    (gq,) = torch.autograd.grad(q_rot, qg, dq)
    want = torch.autograd.grad(rope_ref(qg, k, cos, sin)[0], qg, dq)[0]
    _assert_fp32_close(gq, want, "dq")
    kg = k.detach().clone().requires_grad_()
    _, k_rot = rope(q, kg, cos, sin)
    (gk,) = torch.autograd.grad(k_rot.sum(), kg)  # a stride-0 output gradient
    want = torch.autograd.grad(rope_ref(q, kg, cos, sin)[1].sum(), kg)[0]
    _assert_fp32_close(gk, want, "dk")


def test_cos_sin_take_no_gradient():
    q, k, cos, sin, _, _ = _make(1, 2, 1, 5, 8, 1, torch.float32)
    with pytest.raises(ValueError, match="cos and sin take no gradient"):
        rope(q, k, cos.requires_grad_(), sin)
    with torch.no_grad():  # nothing to differentiate: allowed
        rope(q, k, cos, sin)
    q_rot, _ = rope(q.requires_grad_(), k, cos.detach(), sin)
    assert q_rot.grad_fn is not None


@pytest.mark.parametrize(
    "shapes, match",
    [
        (((1, 2, 5, 8), (1, 1, 5, 8), (1, 5, 7), (1, 5, 7)), "cos and sin must both be"),
        (
            ((1, 2, 5, 8), (1, 1, 5, 8), (2, 5, 8), (2, 5, 8)),
            r"cos and sin must both be \(batch 1 or 1, seq 5, head_dim 8\)",
        ),
        (((1, 2, 5, 8), (1, 1, 5, 8), (1, 5, 8), (5, 8)), "cos and sin must both be"),
        (((1, 2, 5, 7), (1, 1, 5, 7), (1, 5, 7), (1, 5, 7)), "head_dim must be even"),
        (((1, 2, 5, 8), (2, 1, 5, 8), (1, 5, 8), (1, 5, 8)), "must match q"),
        (((1, 2, 5, 8), (1, 1, 4, 8), (1, 5, 8), (1, 5, 8)), "must match q"),
        (((2, 5, 8), (1, 1, 5, 8), (1, 5, 8), (1, 5, 8)), r"q must be 4-D \(batch, heads, seq, head_dim\)"),
    ],
)
def test_bad_shapes(shapes, match):
    with pytest.raises(ValueError, match=match):
        rope(*(torch.zeros(s) for s in shapes))


def test_bad_dtypes_and_devices():
    q, k, cos, sin = torch.zeros(1, 2, 5, 8), torch.zeros(1, 1, 5, 8), torch.zeros(1, 5, 8), torch.zeros(1, 5, 8)
    with pytest.raises(TypeError, match="q must be a float32, bfloat16 or float16"):
        rope(q.double(), k, cos, sin)
    with pytest.raises(TypeError, match="q and k must share a dtype"):
        rope(q, k.half(), cos, sin)
    with pytest.raises(TypeError, match="sin must be a floating-point tensor"):
        rope(q, k, cos, sin.long())
    with pytest.raises(ValueError, match="must share a device"):
        rope(q, k, cos.to("meta"), sin)


def test_empty_sequence():
    q, k = torch.zeros(2, 4, 0, 8, requires_grad=True), torch.zeros(2, 2, 0, 8, requires_grad=True)
    q_rot, k_rot = rope(q, k, torch.zeros(2, 0, 8), torch.zeros(2, 0, 8))
    assert q_rot.shape == (2, 4, 0, 8) and k_rot.shape == (2, 2, 0, 8)
    (q_rot.sum() + k_rot.sum()).backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape


def test_reference_is_differentiable_and_reference_backend():
    q = torch.randn(2, 3, 4, 6, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 1, 4, 6, dtype=torch.float64, requires_grad=True)
    angles = torch.rand(1, 4, 6, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda a, b: rope_ref(a, b, angles.cos(), angles.sin()), (q, k))
    with kernels.backend("reference"):
        q_rot, _ = rope(q.detach().float().requires_grad_(), k.detach().float(), angles.cos(), angles.sin())
    assert "RoPEFunctionBackward" not in type(q_rot.grad_fn).__name__


def test_autograd_node_saves_only_cos_and_sin():
    q, k, cos, sin, _, _ = _make(2, 4, 2, 7, 16, 1, torch.bfloat16)
    q_rot, _ = RoPEFunction.apply(q.requires_grad_(), k, cos, sin)
    saved = q_rot.grad_fn.saved_tensors
    assert len(saved) == 2 and all(s.shape == (1, 7, 16) and s.dtype == torch.float32 for s in saved)


def test_torch_compile_fullgraph_cpu():
    torch._dynamo.reset()
    q, k, cos, sin, dq, dk = _make(2, 4, 2, 7, 16, 2, torch.bfloat16)
    compiled = torch.compile(rope, fullgraph=True, backend="aot_eager")
    got = _fwd_bwd(compiled, q, k, cos, sin, dq, dk)
    want = _fwd_bwd(rope_ref, q, k, cos, sin, dq, dk)
    for g, w, name in zip(got, want, NAMES):
        assert torch.equal(g, w), f"compiled {name} differs from the eager reference"


def test_bench_rope_runs(tmp_path, monkeypatch):
    import bench.common
    from bench import bench_rope

    monkeypatch.setattr(bench.common, "RESULTS", tmp_path)
    rows = bench_rope.main(["--quick", "--compile-backend", "aot_eager"])
    assert (tmp_path / "rope.jsonl").exists() and (tmp_path / "rope.md").exists()
    assert {r["provider"] for r in rows} == {"ours", "torch", "torch_compile", "liger"}
    assert {r["mode"] for r in rows} == {"forward", "backward", "full"}
    assert all(r["ms"] > 0 and r["perf_figure"] is False for r in rows)
    ours = [r for r in rows if r["provider"] == "ours"]
    assert all(r["bytes_rw"] == r["bytes_rw_min"] for r in ours)


@pytest.mark.gpu
def test_cuda_matches_reference_and_compiles_fullgraph():
    torch._dynamo.reset()
    q, k, cos, sin, dq, dk = (t.cuda() for t in _make(2, 32, 8, 257, 128, 1, torch.bfloat16))
    eager = _fwd_bwd(rope, q, k, cos, sin, dq, dk)
    ref32 = _fwd_bwd(rope_ref, q.float(), k.float(), cos, sin, dq.float(), dk.float())
    hf = _fwd_bwd(_hf, q, k, cos, sin, dq, dk)
    for o, r, h, name in zip(eager, ref32, hf, NAMES):
        assert_lowp_close(o, r, h.float(), torch.bfloat16, name=name)
    compiled = _fwd_bwd(torch.compile(rope, fullgraph=True), q, k, cos, sin, dq, dk)
    for c, e, name in zip(compiled, eager, NAMES):
        assert torch.equal(c, e), f"compiled {name} differs from eager"
