"""Fused LoRA projections and MLP (kernels/lora.py) against their plain-autograd references (peft's layers written out).

Tolerance: none. The fused Functions run the same matmuls on the same operands as autograd runs the reference's (the
operand order of mm's backward included), dropout is PyTorch's own on the same generator state, and the input
gradient's contributions are summed in the engine's order, so values and every gradient are equal bit for bit, in
fp32, bf16 and fp16, under autocast, with a dequantized base and with dropout. Also: what backward keeps (x once, the
thin xa per projection; the references keep dropped copies and masks), the generator's state after the call, the
arguments refused.
"""

from __future__ import annotations

import pytest
import torch

from kernels.lora import LoRAProjection, lora_mlp, lora_mlp_ref, lora_projections, lora_projections_ref

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def projection(gen, d_in, d_out, r=3, dtype=torch.float32, bias=False, adapter=True, **kw) -> LoRAProjection:
    weight = (torch.randn(d_out, d_in, generator=gen) / d_in**0.5).to(dtype)
    b = torch.randn(d_out, generator=gen).to(dtype) if bias else None
    if not adapter:
        return LoRAProjection(weight, None, None, bias=b, **kw)
    A = (torch.randn(r, d_in, generator=gen) / d_in**0.5).to(dtype).requires_grad_()
    B = (torch.randn(d_out, r, generator=gen) * 0.1).to(dtype).requires_grad_()
    return LoRAProjection(weight, A, B, scaling=8 / r, bias=b, **kw)


def adapters(projs):
    return [t for p in projs if p.lora_A is not None for t in (p.lora_A, p.lora_B)]


def run(fn, x, projs, douts, seed=1234):
    """Outputs, the gradients of x and of every adapter weight, and the generator's next draw."""
    x = x.detach().clone().requires_grad_()
    torch.manual_seed(seed)
    outs = fn(x)
    outs = outs if isinstance(outs, tuple) else (outs,)
    grads = torch.autograd.grad(outs, [x, *adapters(projs)], douts)
    return [o.detach() for o in outs], grads, torch.rand(4)


def assert_equal(fused, ref):
    (outs_f, grads_f, rng_f), (outs_r, grads_r, rng_r) = fused, ref
    for i, (a, b) in enumerate(zip(outs_f + list(grads_f), outs_r + list(grads_r))):
        assert a.dtype == b.dtype and a.shape == b.shape, (i, a.dtype, b.dtype, a.shape, b.shape)
        assert torch.equal(a, b), f"tensor {i}: max diff {(a.double() - b.double()).abs().max():.3e}"
    assert torch.equal(rng_f, rng_r), "dropout drew another number of values"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_projections_equal_the_reference(dtype, dropout):
    gen = torch.Generator().manual_seed(0)
    projs = [
        projection(gen, 29, 13, dtype=dtype, bias=True),
        projection(gen, 29, 7, dtype=dtype, adapter=False),  # a layer peft did not adapt, in the group
        projection(gen, 29, 7, r=5, dtype=dtype),
    ]
    x = torch.randn(2, 37, 29, generator=gen).to(dtype)
    douts = [torch.randn(2, 37, n, generator=gen).to(dtype) for n in (13, 7, 7)]
    ref = run(lambda x: lora_projections_ref(x, projs, dropout), x, projs, douts)
    assert_equal(run(lambda x: lora_projections(x, projs, dropout), x, projs, douts), ref)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_mlp_equals_the_reference(dtype, dropout):
    gen = torch.Generator().manual_seed(1)
    gate, up = projection(gen, 24, 40, dtype=dtype), projection(gen, 24, 40, dtype=dtype, adapter=False)
    down = projection(gen, 40, 24, dtype=dtype)
    x = torch.randn(3, 11, 24, generator=gen).to(dtype)
    dout = [torch.randn(3, 11, 24, generator=gen).to(dtype)]
    projs = (gate, up, down)
    ref = run(lambda x: lora_mlp_ref(x, *projs, dropout), x, projs, dout)
    assert_equal(run(lambda x: lora_mlp(x, *projs, dropout), x, projs, dout), ref)


@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_autocast_over_fp32_weights_and_a_dequantized_base_equal_the_reference(dropout):
    gen = torch.Generator().manual_seed(2)

    # "packed" bases: fp16 storage that dequantize scales back (the 4-bit path's shape: weight -> callable -> dense),
    # returning the input's dtype as bitsandbytes' layers do
    def packed(d_in, d_out, adapter=True):
        p = projection(gen, d_in, d_out, adapter=adapter)
        return LoRAProjection(p.weight.half() * 2, p.lora_A, p.lora_B, p.scaling, None, lambda w: w.float() * 0.5, True)

    projs = (packed(32, 48), packed(32, 48, adapter=False), projection(gen, 48, 32, bias=True))
    x = torch.randn(2, 9, 32, generator=gen)
    dout = [torch.randn(2, 9, 32, generator=gen)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = run(lambda x: lora_mlp_ref(x, *projs, dropout, torch.float32), x, projs, dout)
        fused = run(lambda x: lora_mlp(x, *projs, dropout, torch.float32), x, projs, dout)
    assert_equal(fused, ref)


def saved_bytes(fn, x, weights) -> int:
    """Bytes of the distinct storages autograd keeps for backward, the base and adapter weights excluded."""
    storages, skip = {}, {w.untyped_storage().data_ptr() for w in weights}

    def pack(t):
        if t.untyped_storage().data_ptr() not in skip:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(x)
    return sum(storages.values())


def test_backward_keeps_x_once_and_the_thin_adapter_inputs():
    gen = torch.Generator().manual_seed(3)
    C, inner, r, n = 64, 160, 4, 2 * 50
    projs = [projection(gen, C, C, r=r) for _ in range(3)]
    mlp = (projection(gen, C, inner, r=r), projection(gen, C, inner, r=r), projection(gen, inner, C, r=r))
    x = torch.randn(2, 50, C, generator=gen).requires_grad_()
    x_bytes, xa_bytes = n * C * 4, n * r * 4
    weights = [t for p in projs + list(mlp) for t in (p.weight, p.lora_A, p.lora_B)]
    for dropout in (0.0, 0.1):
        assert saved_bytes(lambda x: lora_projections(x, projs, dropout), x, weights) == x_bytes + 3 * xa_bytes
        kept = saved_bytes(lambda x: lora_mlp(x, *mlp, dropout), x, weights)
        assert kept == x_bytes + 2 * n * inner * 4 + 3 * xa_bytes  # x, gate, up, three xa
    # peft's layers without dropout keep as much (x is lora_A's input); with dropout a dropped copy and a mask of x
    # per projection (a tensor of x's dtype on the CPU, a bool on CUDA), and no x
    assert saved_bytes(lambda x: lora_projections_ref(x, projs, 0.0), x, weights) == x_bytes + 3 * xa_bytes
    assert saved_bytes(lambda x: lora_projections_ref(x, projs, 0.1), x, weights) == 3 * (2 * x_bytes + xa_bytes)


def test_bad_arguments_are_refused():
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(3, 8, generator=gen)
    with pytest.raises(ValueError, match="dropout must be in"):
        lora_projections(x, [projection(gen, 8, 4)], dropout=1.0)
    with pytest.raises(ValueError, match="do not fit an input of width 8"):
        lora_projections(x, [projection(gen, 9, 4)])
    trained_base = projection(gen, 8, 4)
    trained_base.weight.requires_grad_()
    with pytest.raises(ValueError, match="must be frozen"):
        lora_projections(x, [trained_base])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_on_cuda_equals_the_reference_with_cuda_dropout(dtype):
    """On a GPU: PyTorch's CUDA dropout (native_dropout, Philox) replayed from the CUDA generator's state; the matmuls
    cuBLAS's. Bit for bit against the reference on the same device, projections and MLP, with and without dropout."""
    gen = torch.Generator().manual_seed(5)

    def on_cuda(p):
        moved = {
            k: (v.detach().cuda().requires_grad_(v.requires_grad) if torch.is_tensor(v) else v)
            for k, v in vars(p).items()
        }
        return LoRAProjection(**moved)

    projs = [on_cuda(projection(gen, 256, n, dtype=dtype)) for n in (256, 64, 64)]
    mlp = [on_cuda(projection(gen, *shape, dtype=dtype)) for shape in ((256, 704), (256, 704), (704, 256))]
    x = torch.randn(2, 300, 256, generator=gen).to(dtype).cuda()
    douts = [torch.randn(2, 300, n, generator=gen).to(dtype).cuda() for n in (256, 64, 64)]
    for dropout in (0.0, 0.1):
        ref = run(lambda x: lora_projections_ref(x, projs, dropout), x, projs, douts)
        assert_equal(run(lambda x: lora_projections(x, projs, dropout), x, projs, douts), ref)
        ref = run(lambda x: lora_mlp_ref(x, *mlp, dropout), x, mlp, douts[:1])
        assert_equal(run(lambda x: lora_mlp(x, *mlp, dropout), x, mlp, douts[:1]), ref)
