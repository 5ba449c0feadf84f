"""The gated delta rule's references (kernels/gated_delta_rule.py, issue 45 item 3): the chunked form equals the
token-by-token recurrence in fp64 (outputs, final states and every gradient), for chunk sizes that do and do not
divide the length; a packed row (cu_seqlens) gives each sequence's outputs, states and gradients as if it ran alone;
transformers' own fp32 recurrence (Qwen3.5's fallback, `torch_recurrent_gated_delta_rule`) agrees to fp32 rounding;
lower-precision inputs compute in fp32 and come back in their dtype; bad shapes are one line.
Shapes are small and odd: 2 query/key heads serving 4 value heads, K = 8, V = 6, lengths 37 and 1."""

from __future__ import annotations

import pytest
import torch

from kernels.gated_delta_rule import chunk_gated_delta_rule_ref, gated_delta_rule_ref

B, HK, HV, K, V = 2, 2, 4, 8, 6


def inputs(T: int, batch: int = B, dtype=torch.float64, seed: int = 0, grad: bool = False):
    """q, k, v, g (log decay <= 0), beta in (0, 1), an initial state: what a Gated DeltaNet layer feeds the rule."""
    gen = torch.Generator().manual_seed(seed)
    out = (
        torch.randn(batch, T, HK, K, generator=gen),
        torch.randn(batch, T, HK, K, generator=gen),
        torch.randn(batch, T, HV, V, generator=gen),
        -torch.rand(batch, T, HV, generator=gen) * 0.7,
        torch.rand(batch, T, HV, generator=gen),
        torch.randn(batch, HV, K, V, generator=gen),
    )
    return tuple(t.to(dtype).requires_grad_(grad) for t in out)


def _grads(fn, tensors, seed=1, **kw):
    """(o, final state, gradients of every input) under a random weighting of o and the final state."""
    o, S = fn(*tensors[:5], initial_state=tensors[5], output_final_state=True, **kw)
    gen = torch.Generator().manual_seed(seed)
    loss = (o * torch.randn(o.shape, generator=gen, dtype=o.dtype)).sum() + (
        S * torch.randn(S.shape, generator=gen, dtype=S.dtype)
    ).sum()
    return o, S, torch.autograd.grad(loss, tensors)


@pytest.mark.parametrize("chunk_size", [1, 5, 16, 37, 64])
@pytest.mark.parametrize("use_qk_l2norm", [False, True])
def test_the_chunked_rule_is_the_token_by_token_rule_in_fp64(chunk_size, use_qk_l2norm):
    tensors = inputs(37, grad=True)
    o1, S1, g1 = _grads(gated_delta_rule_ref, tensors, use_qk_l2norm=use_qk_l2norm)
    o2, S2, g2 = _grads(chunk_gated_delta_rule_ref, tensors, use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size)
    assert o1.dtype == S1.dtype == torch.float64 and o1.shape == (B, 37, HV, V) and S1.shape == (B, HV, K, V)
    torch.testing.assert_close(o2, o1, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(S2, S1, rtol=1e-12, atol=1e-12)
    for name, a, b in zip(("q", "k", "v", "g", "beta", "initial_state"), g2, g1):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=lambda m, n=name: f"d{n}: {m}")


def test_the_recurrence_is_its_definition_on_one_token():
    """One token from a state S: S' = e^g S + k (beta (v - e^g S^T k))^T, o = S'^T q / sqrt(K)."""
    q, k, v, g, beta, S = inputs(1, batch=1)
    o, S1 = gated_delta_rule_ref(q, k, v, g, beta, initial_state=S, output_final_state=True)
    kk = k[0, 0].repeat_interleave(HV // HK, dim=0)  # (HV, K)
    qq = q[0, 0].repeat_interleave(HV // HK, dim=0) / K**0.5
    decayed = S[0] * g[0, 0].exp()[:, None, None]  # (HV, K, V)
    delta = beta[0, 0][:, None] * (v[0, 0] - torch.einsum("hkv,hk->hv", decayed, kk))
    expected = decayed + kk[:, :, None] * delta[:, None, :]
    torch.testing.assert_close(S1[0], expected, rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(o[0, 0], torch.einsum("hkv,hk->hv", expected, qq), rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("fn", [gated_delta_rule_ref, chunk_gated_delta_rule_ref], ids=["tokens", "chunks"])
def test_a_packed_row_gives_each_sequence_as_if_alone(fn):
    """Sequences of 5, 1, 0 (empty) and 11 tokens packed into one row: with cu_seqlens the state restarts at every
    boundary (each from its own initial state), so outputs, final states and gradients are those of each sequence
    run alone; without cu_seqlens the later sequences would read the earlier ones' state."""
    lengths = [5, 1, 0, 11]
    kw = dict(chunk_size=4) if fn is chunk_gated_delta_rule_ref else {}
    packed = inputs(sum(lengths), batch=1, grad=True)
    states = torch.randn(len(lengths), HV, K, V, dtype=torch.float64, requires_grad=True)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    o, S = fn(*packed[:5], initial_state=states, output_final_state=True, cu_seqlens=cu, **kw)
    assert o.shape == (1, sum(lengths), HV, V) and S.shape == (len(lengths), HV, K, V)
    weights = torch.randn(o.shape, dtype=o.dtype)
    grads = torch.autograd.grad((o * weights).sum() + S.sum(), [*packed[:5], states])
    for i, (start, end) in enumerate(zip(cu.tolist(), cu.tolist()[1:])):
        alone = [t[:, start:end].detach().requires_grad_() for t in packed[:5]]
        state = states[i : i + 1].detach().requires_grad_()
        o1, S1 = fn(*alone, initial_state=state, output_final_state=True, **kw)
        torch.testing.assert_close(o[:, start:end], o1, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(S[i : i + 1], S1, rtol=1e-12, atol=1e-12)
        loss = (o1 * weights[:, start:end]).sum() + S1.sum()
        mine = torch.autograd.grad(loss, [*alone, state], allow_unused=True, materialize_grads=True)  # empty: zeros
        for a, b in zip(mine[:5], grads[:5]):
            torch.testing.assert_close(b[:, start:end], a, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(grads[5][i : i + 1], mine[5], rtol=1e-10, atol=1e-10)
    unpacked, _ = fn(*packed[:5], initial_state=states[:1], **kw)
    assert not torch.allclose(unpacked[:, 6:], o[:, 6:])  # one row: the second and later sequences differ


def test_transformers_recurrence_agrees_to_fp32_rounding():
    """Qwen3.5's own fallback (transformers' torch_recurrent_gated_delta_rule, fp32, q and k l2-normalised in the
    kernel, grouped value heads) against ours in fp64."""
    modeling = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    q, k, v, g, beta, S = inputs(37)
    o, final = gated_delta_rule_ref(q, k, v, g, beta, initial_state=S, output_final_state=True, use_qk_l2norm=True)
    f32 = [t.float() for t in (q, k, v, g, beta)]
    theirs, their_final = modeling.torch_recurrent_gated_delta_rule(
        *f32, initial_state=S.float(), output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    torch.testing.assert_close(theirs.double(), o, rtol=0, atol=2e-6 * o.abs().max().item())
    torch.testing.assert_close(their_final.double(), final, rtol=0, atol=2e-6 * final.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_lower_precision_inputs_compute_in_fp32(dtype):
    """Inputs of any float dtype: the math in fp32 (the same as fp32 inputs rounded to that dtype), o in the inputs'
    dtype, the final state fp32."""
    tensors = [t.to(dtype) for t in inputs(37, dtype=torch.float32)]
    kw = dict(output_final_state=True, use_qk_l2norm=True)  # normalised keys, as the models run it: a stable state
    o, S = chunk_gated_delta_rule_ref(*tensors[:5], initial_state=tensors[5], chunk_size=16, **kw)
    o32, S32 = gated_delta_rule_ref(*[t.float() for t in tensors[:5]], initial_state=tensors[5].float(), **kw)
    assert o.dtype == dtype and S.dtype == torch.float32
    torch.testing.assert_close(
        o, o32.to(dtype), rtol=0, atol=1e-5 if dtype == torch.float32 else 2e-2 * o32.abs().max().item()
    )
    torch.testing.assert_close(S, S32, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(v=torch.zeros(B, 37, 3, V)), "v's 3 heads must be a multiple of q's and k's 2"),
        (dict(g=torch.zeros(B, 37, HK)), "g must be (B, T, Hv)"),
        (
            dict(cu_seqlens=torch.tensor([0, 10, 37])),
            "cu_seqlens must rise from 0 to T = 37 over one packed row (B = 1)",
        ),
        (dict(initial_state=torch.zeros(1, HV, K, V)), "initial_state must be (sequences, Hv, K, V)"),
        (dict(k=torch.zeros(B, 37, HK, K + 1)), "q and k must be (B, T, Hk, K) alike"),
    ],
)
def test_bad_shapes_are_one_line(change, message):
    q, k, v, g, beta, _ = inputs(37, dtype=torch.float32)
    args = dict(q=q, k=k, v=v, g=g, beta=beta) | change
    for fn in (gated_delta_rule_ref, chunk_gated_delta_rule_ref):
        with pytest.raises(ValueError, match="^gated_delta_rule: " + message.replace("(", r"\(").replace(")", r"\)")):
            fn(**args)


def test_the_op_runs_the_chunked_reference_on_cpu_tensors():
    """`chunk_gated_delta_rule` (what the model calls) is the chunked reference off CUDA, whatever is installed."""
    from kernels.gated_delta_rule import chunk_gated_delta_rule, fla_status

    tensors = inputs(20, dtype=torch.float32)
    ours = chunk_gated_delta_rule(*tensors[:5], initial_state=tensors[5], output_final_state=True, use_qk_l2norm=True)
    ref = chunk_gated_delta_rule_ref(
        *tensors[:5], initial_state=tensors[5], output_final_state=True, use_qk_l2norm=True
    )
    assert all(torch.equal(a, b) for a, b in zip(ours, ref))
    assert fla_status().startswith(("flash-linear-attention's", "the chunked reference in PyTorch (fla-core"))


@pytest.mark.gpu
def test_flash_linear_attention_equals_the_reference_on_a_gpu():
    """fla's chunk_gated_delta_rule (where fla-core is installed) against the fp64 reference: a packed row of
    sequences of 70, 1 and 129 tokens (chunks of 64 crossed), 2 query/key heads serving 4 value heads of 64 x 64,
    initial states, q/k l2-normalised in the kernel; outputs, final states and every gradient within 2e-3 of their
    largest value (fla's fp32 chunks run tf32 matmuls on Hopper)."""
    pytest.importorskip("fla")
    from kernels.gated_delta_rule import chunk_gated_delta_rule

    gen = torch.Generator().manual_seed(0)
    T, hk, hv, dk, dv = 200, 2, 4, 64, 64
    cu = torch.tensor([0, 70, 71, 200])
    host = (
        torch.randn(1, T, hk, dk, generator=gen),
        torch.randn(1, T, hk, dk, generator=gen),
        torch.randn(1, T, hv, dv, generator=gen),
        -torch.rand(1, T, hv, generator=gen) * 0.7,
        torch.rand(1, T, hv, generator=gen),
        torch.randn(3, hv, dk, dv, generator=gen),
    )
    runs = []
    for device, dtype, fn in (("cuda", torch.float32, chunk_gated_delta_rule), ("cpu", torch.float64, None)):
        tensors = tuple(t.to(device, dtype).requires_grad_() for t in host)
        fn = fn or chunk_gated_delta_rule_ref
        o, S = fn(*tensors[:5], initial_state=tensors[5], output_final_state=True, cu_seqlens=cu, use_qk_l2norm=True)
        weights = torch.Generator().manual_seed(1)
        loss = (o * torch.randn(o.shape, generator=weights).to(device, dtype)).sum() + (
            S * torch.randn(S.shape, generator=weights).to(device, dtype)
        ).sum()
        runs.append([o, S, *torch.autograd.grad(loss, tensors)])
    for name, got, want in zip(("o", "S", "dq", "dk", "dv", "dg", "dbeta", "dS0"), *runs):
        got = got.detach().double().cpu()
        torch.testing.assert_close(got, want.detach(), atol=2e-3 * want.abs().max().item(), rtol=0, msg=name)
