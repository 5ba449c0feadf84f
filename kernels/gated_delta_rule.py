"""The gated delta rule: the recurrence of Gated DeltaNet layers (Qwen3.5, Qwen3-Next), in plain PyTorch.

Per value head, a state S (K x V, fp32) is carried along the tokens t of a sequence:

    S <- exp(g_t) S                                 decay (g_t <= 0, log space)
    S <- S + k_t (beta_t (v_t - S^T k_t))^T         the delta rule: write the part of v_t that S does not predict
    o_t = S^T (scale q_t)                           read (scale: K ** -0.5 unless given)

q, k: (B, T, Hk, K); v: (B, T, Hv, V); g, beta: (B, T, Hv), with Hv a multiple of Hk (each query/key head serves
Hv / Hk consecutive value heads, as transformers' and flash-linear-attention's ops do). `use_qk_l2norm` normalises q
and k per head first (x / sqrt(sum x^2 + 1e-6), fla's l2norm), as Qwen3.5's layers ask.

Two references, each differentiable through autograd and computed in fp32 (fp64 for fp64 inputs), the output cast
back to v's dtype:
- `gated_delta_rule_ref`: token by token, the definition above: the golden every other path is held to.
- `chunk_gated_delta_rule_ref`: the chunked form GPU kernels compute (flash-linear-attention's `chunk_gated_delta_rule`,
  transformers' `torch_chunk_gated_delta_rule`): within a chunk of C tokens the C delta-rule updates are one
  triangular solve (the WY form: with gamma the cumulative log decay inside the chunk and
  A[i, j] = beta_i (k_i . k_j) exp(gamma_i - gamma_j) for j < i, T = (I + A)^-1, u = T (beta v) and
  w = T (beta exp(gamma) k)), computed for every chunk at once; then per chunk, in order, v' = u - w S,
  o = exp(gamma) q S + (q k^T * decay, causal) v', S <- exp(gamma_C) S + (exp(gamma_C - gamma) k)^T v'. Equal to
  the token-by-token rule to rounding, for any chunk size (a last chunk shorter than the rest included).
Both take `cu_seqlens` ((N + 1,) offsets of N sequences packed into one row, B = 1, as fla's varlen ops): the state
restarts at every sequence boundary, so a packed row gives each sequence's outputs (and gradients) as if it ran alone;
`initial_state` (B or N, Hv, K, V) and `output_final_state` (the state after each row or sequence, in the compute
dtype) as fla's.

`chunk_gated_delta_rule` is the op the model calls: on CUDA tensors flash-linear-attention's `chunk_gated_delta_rule`
(Triton, chunked forward and backward, varlen), where `fla-core` is installed (an optional extra, as flash-attn is:
`pip install fla-core`; imported directly, never through transformers' kernel-hub lookup), with the same q, k, v, g
(log decay), beta, scale, initial_state, cu_seqlens and its `use_qk_l2norm_in_kernel`; otherwise the chunked
reference (a GPU without fla runs it in PyTorch, correct and slow: `fla_status()` says which). fla's kernels autotune
on a GPU and do not run under the Triton interpreter, so on this CPU their agreement with the reference is a `gpu`
test (tests/kernels/test_gated_delta_rule.py). Why fla's kernels and no Triton recurrence of ours: the roofline's
bytes-and-FLOPs model of fla's kernels (bench/roofline/op_models.py `FlaGatedDeltaRuleModel`) puts them at 4.9% of a
modelled Qwen3.5-35B-A3B step with them, against about 0.5% for the fewest bytes and FLOPs any recurrence kernel
needs (docs/benchmarks.md): a kernel of ours could gain at most that difference, once a GPU has measured fla's.
"""

from __future__ import annotations

import torch

from ._dispatch import current_backend
from ._packed import sequence_spans

L2NORM_EPS = 1e-6  # fla's l2norm epsilon, inside the square root


def _check(q, k, v, g, beta, cu_seqlens, initial_state) -> tuple[list[tuple[int, int]], int]:
    """(each sequence's (start, end), Hv // Hk) after checking the shapes; a one-line ValueError naming the first
    mismatch."""
    if q.dim() != 4 or k.shape != q.shape or v.dim() != 4 or v.shape[:2] != q.shape[:2]:
        raise ValueError(
            f"gated_delta_rule: q and k must be (B, T, Hk, K) alike and v (B, T, Hv, V), got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    B, T, Hk, _ = q.shape
    Hv = v.shape[2]
    if Hv % Hk:
        raise ValueError(f"gated_delta_rule: v's {Hv} heads must be a multiple of q's and k's {Hk}")
    for name, t in (("g", g), ("beta", beta)):
        if t.shape != (B, T, Hv):
            raise ValueError(f"gated_delta_rule: {name} must be (B, T, Hv) = {(B, T, Hv)}, got {tuple(t.shape)}")
    spans = sequence_spans("gated_delta_rule", B, T, cu_seqlens)
    n = B if cu_seqlens is None else len(spans)
    if initial_state is not None and initial_state.shape != (n, Hv, q.shape[-1], v.shape[-1]):
        raise ValueError(
            f"gated_delta_rule: initial_state must be (sequences, Hv, K, V) = {(n, Hv, q.shape[-1], v.shape[-1])}, "
            f"got {tuple(initial_state.shape)}"
        )
    return spans, Hv // Hk


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def _prepare(q, k, v, g, beta, scale, use_qk_l2norm, group):
    """Each input as (B, H, T, ...) in the compute dtype, q and k per value head, q scaled (and normalised)."""
    compute = torch.promote_types(v.dtype, torch.float32)
    q, k, v, g, beta = (t.transpose(1, 2).to(compute) for t in (q, k, v, g, beta))
    if group > 1:
        q, k = (t.repeat_interleave(group, dim=1) for t in (q, k))
    if use_qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    return q * (q.shape[-1] ** -0.5 if scale is None else scale), k, v, g, beta


def _run(recurrence, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm):
    """Both references' frame: shapes checked, inputs prepared, `recurrence(q, k, v, g, beta, S)` (one sequence,
    (B', H, t, .) each, S (B', H, K, V)) run over each row or packed sequence, outputs stitched back."""
    spans, group = _check(q, k, v, g, beta, cu_seqlens, initial_state)
    out_dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, scale, use_qk_l2norm, group)
    B, H, T, K = k.shape
    if initial_state is None:
        initial_state = torch.zeros(
            B if cu_seqlens is None else len(spans), H, K, v.shape[-1], dtype=v.dtype, device=v.device
        )
    initial_state = initial_state.to(v.dtype)
    outs, states = [], []
    for i, (start, end) in enumerate(spans):
        S0 = initial_state if cu_seqlens is None else initial_state[i : i + 1]
        part = slice(start, end)
        o, S = recurrence(q[:, :, part], k[:, :, part], v[:, :, part], g[:, :, part], beta[:, :, part], S0)
        outs.append(o)
        states.append(S)
    o = torch.cat(outs, dim=2).transpose(1, 2).to(out_dtype)  # (B, T, Hv, V)
    final = torch.cat(states, dim=0) if output_final_state else None  # in the compute dtype
    return o, final


def _token_by_token(q, k, v, g, beta, S):
    outs = []
    for t in range(q.shape[2]):
        S = S * g[:, :, t].exp()[..., None, None]
        predicted = (S * k[:, :, t, :, None]).sum(-2)  # (B, H, V): S^T k_t
        delta = (v[:, :, t] - predicted) * beta[:, :, t, None]
        S = S + k[:, :, t, :, None] * delta[:, :, None, :]
        outs.append((S * q[:, :, t, :, None]).sum(-2))
    o = torch.stack(outs, dim=2) if outs else v.new_zeros(v.shape)
    return o, S


def gated_delta_rule_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule token by token (module docstring): (o (B, T, Hv, V) in v's dtype, the final state
    (rows or sequences, Hv, K, V) in fp32 (fp64 for fp64 inputs), or None)."""
    return _run(_token_by_token, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm)


def _chunked(chunk_size: int):
    def recurrence(q, k, v, g, beta, S):
        """The chunked rule over one sequence ((B, H, T, .) each) from S: every chunk's intra-chunk part (the
        triangular solve, the causal q k^T) batched over the chunks at once, then the state carried chunk by chunk.
        T is padded to whole chunks with tokens that change nothing (k = v = 0, beta = 0, g = 0: no write, no decay)
        and their outputs dropped."""
        B, H, T, K = k.shape
        if T == 0:
            return v.new_zeros(v.shape), S
        C = min(chunk_size, T)
        pad = -T % C
        if pad:
            q, k, v = (torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
            g, beta = (torch.nn.functional.pad(t, (0, pad)) for t in (g, beta))
        n = (T + pad) // C
        q, k, v = (t.reshape(B, H, n, C, t.shape[-1]) for t in (q, k, v))  # (B, H, N, C, .)
        g, beta = g.reshape(B, H, n, C), beta.reshape(B, H, n, C)
        u, w, attn, q_decayed, k_decayed, last = _intra(q, k, v, g, beta)
        outs = []
        for i in range(n):  # the state, chunk by chunk
            v_new = u[:, :, i] - w[:, :, i] @ S  # (B, H, C, V)
            outs.append(q_decayed[:, :, i] @ S + attn[:, :, i] @ v_new)
            S = S * last[:, :, i].exp()[..., None] + k_decayed[:, :, i].transpose(-1, -2) @ v_new
        return torch.cat(outs, dim=2)[:, :, :T], S

    return recurrence


def _intra(q, k, v, g, beta):
    """What every chunk ((B, H, N, C, .) each) needs from itself alone: u and w of the WY form, the causal decayed
    q k^T, q and k scaled by their decays, the chunk's total log decay (B, H, N, 1)."""
    C = q.shape[-2]
    gamma = g.cumsum(-1)  # (B, H, N, C): log decay from the chunk's start through each token
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    # exp(gamma_i - gamma_j) where j <= i, 0 above the diagonal (masked before exp: no overflow)
    decay = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # (B, H, N, C, C)
    k_beta = k * beta[..., None]
    A = (k_beta @ k.transpose(-1, -2) * decay).tril(-1)  # strictly lower
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    rhs = torch.cat([v * beta[..., None], k_beta * gamma.exp()[..., None]], dim=-1)
    solved = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
    u, w = solved.split([v.shape[-1], k.shape[-1]], dim=-1)  # new values, decayed keys that read S
    attn = q @ k.transpose(-1, -2) * decay  # (B, H, N, C, C)
    last = gamma[..., -1:]  # (B, H, N, 1)
    return u, w, attn, q * gamma.exp()[..., None], k * (last - gamma).exp()[..., None], last


def chunk_gated_delta_rule_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm: bool = False,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule in chunks of `chunk_size` tokens (module docstring); the same returns as
    `gated_delta_rule_ref`."""
    if chunk_size < 1:
        raise ValueError(f"chunk_gated_delta_rule: chunk_size must be positive, got {chunk_size}")
    return _run(
        _chunked(chunk_size), q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm
    )


_FLA: list = []  # [fla's chunk_gated_delta_rule or None, why not], looked up once


def _fla():
    """fla's chunk_gated_delta_rule, or None (with the reason in `fla_status`)."""
    if not _FLA:
        try:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_op
        except Exception as exc:  # not installed, or built for another torch/triton: the reference runs
            _FLA[:] = [None, f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:120]}"]
        else:
            _FLA[:] = [fla_op, None]
    return _FLA[0]


def fla_status() -> str:
    """One phrase: which recurrence CUDA tensors run (fla's kernels, or the reference and why)."""
    if _fla() is not None:
        return "flash-linear-attention's chunk_gated_delta_rule"
    return f"the chunked reference in PyTorch (fla-core not importable: {_FLA[1]})"


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The chunked gated delta rule (module docstring): fla's kernels for CUDA tensors where fla-core is installed,
    `chunk_gated_delta_rule_ref` otherwise; the same arguments and returns."""
    fla_op = _fla() if q.is_cuda and current_backend() != "reference" else None
    if fla_op is None:
        return chunk_gated_delta_rule_ref(
            q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm
        )
    _check(q, k, v, g, beta, cu_seqlens, initial_state)
    cu = None if cu_seqlens is None else cu_seqlens.to(device=q.device, dtype=torch.long)
    return fla_op(
        q,
        k,
        v,
        g.float(),
        beta,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm,
        cu_seqlens=cu,
        cu_seqlens_cpu=None if cu_seqlens is None else cu_seqlens.to("cpu", torch.long),
    )
