"""NEFTune: uniform noise added to the token embeddings during fine-tuning (Jain et al., 2023,
"NEFTune: Noisy Embeddings Improve Instruction Finetuning", arXiv:2310.05914).

Math
----
Forward, for embeddings x of shape (B, T, d) and a noise scale alpha >= 0:

    y[b, t, :] = x[b, t, :] + u[b, t, :] * alpha / sqrt(L[b, t] * d),    u ~ U(-1, 1) i.i.d.

where L is the length of the sequence the token belongs to:
- no attention_mask, no position_ids: L = T for every token (Hugging Face semantics:
  `dims = embeds.size(1) * embeds.size(2)`, `mag_norm = alpha / sqrt(dims)`);
- attention_mask (B, T), nonzero = real token: L[b, :] = sum(attention_mask[b]) and padded tokens get no
  noise at all. Hugging Face's hook uses the padded length T for every row and also noises the padding,
  so a short sequence in a long padded batch gets less noise than the paper intends (its magnitude
  depends on what else is in the batch); here it depends only on the sequence itself;
- position_ids (B, T) for packed rows: a document starts where the position does not continue the
  previous one (normally where it restarts at 0, and at t = 0); L is that document's number of real
  tokens (all its tokens, or those with a nonzero mask when attention_mask is given too).
With training=False, or alpha == 0, y = x (the same tensor object is returned).

Backward: the noise is additive and independent of x, so dL/dx = dL/dy (identity). The autograd
Function saves nothing, in particular no noise tensor.

The noise is drawn and added in fp32 and rounded once to x's dtype (Hugging Face draws it in x's dtype,
so a bf16 noise value is already rounded before the bf16 add rounds again).

Random numbers
--------------
The Triton kernel draws its noise with Triton's Philox (`tl.randint4x`: one 10-round Philox call gives
four 32-bit numbers) from a 62-bit seed. The seed is one `torch.randint` draw from `generator` (or from
the default generator of embeds' device when None), kept on the device and loaded by the kernel, so a
CUDA generator costs no host sync (and CUDA-graph capture treats it like any other torch RNG op). A CPU generator with
CUDA embeds copies its 8-byte seed host->device (non_blocking: no wait for the GPU queue, but a pageable
copy may block the host briefly); keep the generator on the embeddings' device in the hot path.
The noise at (row, col) is a function of (seed, row, col, d) only, never of the block sizes: row r's
columns are split into four quarters of Q = ceil(d / 4); Philox counter r * Q + k gives the four numbers
for columns k, Q + k, 2Q + k, 3Q + k. So one call of four outputs covers four coalesced loads.
Under torch.compile pass generator=None (dynamo cannot trace a torch.Generator argument; the seed then
comes from the global RNG, which compiled code handles).

The reference `neftune_noise_ref` draws with `torch.rand`: same semantics and distribution, different
random numbers from the kernel's.

Bytes moved per element (s = element size): read x (s) + write y (s) = 2s. Plus, with a mask or
position ids, a (B*T,) fp32 row-scale vector (4/d bytes per element) computed beforehand by a few small
PyTorch ops over (B, T); without them the scale is a kernel argument. Hugging Face's hook
`x + torch.zeros_like(x).uniform_(-mag, mag)` moves 5s per element (zeros: write s; uniform_: write s;
add: read 2s, write s) in three launches.

Launch strategy
---------------
2-D grid over (row blocks, quarter-column blocks): each program takes BLOCK_R rows x BLOCK_Q columns of
each of the four quarters (a tile of 4 * BLOCK_R * BLOCK_Q = 8192 elements, 8 warps, 32 elements per
thread); BLOCK_Q = next_pow2(Q) capped at 1024, so for d <= 4096 one program covers whole rows (d = 4096:
BLOCK_R = 2, BLOCK_Q = 1024). Row offsets and Philox counters are int64, so tensors past 2^31
elements work. Eager calls the launcher directly; under torch.compile it goes through the
`torch.ops.kernelwright.neftune_fwd` custom op, so fullgraph tracing takes it whole (one opaque call that
launches the kernel). Not a `torch.library.triton_op`: declaring one imports torch._inductor, about 3 s of every
`import kernels` on a CPU, for an op whose launch is all the compiled graph would see of it anyway.

Test: `python -m pytest tests/kernels/test_neftune.py -q` (CPU: Triton interpreter and reference).
Bench: `python bench/bench_neftune.py` on a GPU (`--quick` on a CPU only checks that it runs).
"""

from __future__ import annotations

import math
import numbers

import torch

from ._dispatch import HAS_TRITON, use_triton

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _add_quarter_noise(
        X_ptr,  # (N, d) embeddings, row stride stride_x
        OUT_ptr,  # (N, d) output, row stride stride_out
        rows64,  # (BLOCK_R,) int64 row indices
        row_ok,  # (BLOCK_R,) rows inside the tensor
        cols,  # (BLOCK_Q,) column indices of this quarter
        col_ok,  # (BLOCK_Q,) columns inside this quarter and the row
        bits,  # (BLOCK_R, BLOCK_Q) uint32 Philox output for this quarter
        mag,  # fp32 noise magnitude, (BLOCK_R, 1) or a scalar
        stride_x,
        stride_out,
    ):
        mask = row_ok[:, None] & col_ok[None, :]
        # fp32 right after the load: the interpreter's bf16 arithmetic is wrong and the GPU wants fp32 anyway
        x = tl.load(X_ptr + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        u = tl.uint_to_uniform_float(bits)  # [0, 1)
        y = x + (2.0 * u - 1.0) * mag  # |noise| <= mag
        tl.store(OUT_ptr + rows64[:, None] * stride_out + cols[None, :], y.to(OUT_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _neftune_fwd_kernel(
        X_ptr,  # (N, d) embeddings (fp32/bf16/fp16), unit column stride, row stride stride_x
        OUT_ptr,  # (N, d) output, same dtype as X, row stride stride_out
        ROW_SCALE_ptr,  # (N,) fp32 per-row alpha / sqrt(L * d), 0 on padding; read only if HAS_ROW_SCALE
        SEED_ptr,  # (1,) int64 Philox seed drawn from the torch generator
        scale,  # fp32 magnitude of every row when not HAS_ROW_SCALE
        n_rows,
        n_cols,
        quarter,  # ceil(n_cols / 4): column k of quarter j is j * quarter + k
        stride_x,
        stride_out,
        HAS_ROW_SCALE: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_Q: tl.constexpr,
    ):
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # (BLOCK_R,)
        ks = tl.program_id(1) * BLOCK_Q + tl.arange(0, BLOCK_Q)  # (BLOCK_Q,)
        row_ok = rows < n_rows
        k_ok = ks < quarter
        rows64 = rows.to(tl.int64)
        seed = tl.load(SEED_ptr)
        # One counter per (row, k): the noise depends on (seed, row, col, d) only, not on the block sizes.
        counter = rows64[:, None] * quarter + ks[None, :]  # (BLOCK_R, BLOCK_Q) int64
        r0, r1, r2, r3 = tl.randint4x(seed, counter)
        if HAS_ROW_SCALE:
            mag = tl.load(ROW_SCALE_ptr + rows64, mask=row_ok, other=0.0)[:, None]  # (BLOCK_R, 1)
        else:
            mag = scale
        _add_quarter_noise(X_ptr, OUT_ptr, rows64, row_ok, ks, k_ok, r0, mag, stride_x, stride_out)
        c1 = quarter + ks
        _add_quarter_noise(X_ptr, OUT_ptr, rows64, row_ok, c1, k_ok & (c1 < n_cols), r1, mag, stride_x, stride_out)
        c2 = 2 * quarter + ks
        _add_quarter_noise(X_ptr, OUT_ptr, rows64, row_ok, c2, k_ok & (c2 < n_cols), r2, mag, stride_x, stride_out)
        c3 = 3 * quarter + ks
        _add_quarter_noise(X_ptr, OUT_ptr, rows64, row_ok, c3, k_ok & (c3 < n_cols), r3, mag, stride_x, stride_out)


_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_TILE = 8192  # elements per program (4 quarters x BLOCK_R x BLOCK_Q): 32 per thread at 8 warps


def neftune_fwd(
    x: torch.Tensor,
    seed: torch.Tensor,
    scale: float,
    row_scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launch the kernel: x + U(-1, 1) * magnitude, magnitude = row_scale[row] if given else scale.

    x: (..., d) fp32/bf16/fp16; seed: int64 tensor with one element on x's device; row_scale: (prod(...),)
    fp32 on x's device; out: optional contiguous buffer of x's shape and dtype. Returns y of x's shape.
    """
    if not HAS_TRITON:
        raise RuntimeError("neftune_fwd needs triton (pip install triton); neftune_noise_ref runs without it")
    d = x.shape[-1]
    x2 = x.reshape(-1, d)  # (N, d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    n_rows = x2.shape[0]
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    elif out.shape != x.shape or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(f"neftune_fwd: out must be a contiguous {x.dtype} tensor of shape {tuple(x.shape)}")
    if x.numel() == 0:
        return out
    out2 = out.view(n_rows, d)  # (N, d)
    if seed.numel() != 1 or seed.dtype != torch.int64:
        raise ValueError("neftune_fwd: seed must be an int64 tensor with one element")
    has_row_scale = row_scale is not None
    if has_row_scale:
        if row_scale.shape != (n_rows,) or row_scale.dtype != torch.float32:
            raise ValueError(f"neftune_fwd: row_scale must be a float32 tensor of shape ({n_rows},)")
        row_scale = row_scale.contiguous()
    # Blocks depend on d only (static in practice) so tracing with a symbolic number of rows adds no guard.
    quarter = triton.cdiv(int(d), 4)
    block_q = min(triton.next_power_of_2(quarter), 1024)
    block_r = _TILE // (4 * block_q)
    grid = (triton.cdiv(n_rows, block_r), triton.cdiv(quarter, block_q))
    torch.library.wrap_triton(_neftune_fwd_kernel)[grid](
        x2,
        out2,
        row_scale if has_row_scale else x2,  # never read without HAS_ROW_SCALE; any pointer will do
        seed,
        float(scale),
        n_rows,
        d,
        quarter,
        x2.stride(0),
        out2.stride(0),
        HAS_ROW_SCALE=has_row_scale,
        BLOCK_R=block_r,
        BLOCK_Q=block_q,
        num_warps=8,
    )
    return out


# One op namespace for the project: csrc/ops.cpp defines `kernelwright` with TORCH_LIBRARY, and this Python fragment
# joins it (checked: loading the C++ library after this registration keeps both ops).
@torch.library.custom_op("kernelwright::neftune_fwd", mutates_args=())
def _neftune_fwd_op(x: torch.Tensor, seed: torch.Tensor, scale: float, row_scale: torch.Tensor | None) -> torch.Tensor:
    return neftune_fwd(x, seed, scale, row_scale)


@_neftune_fwd_op.register_fake
def _(x, seed, scale, row_scale):
    # Explicit rather than traced from the body: under the Triton interpreter (CPU tests) wrap_triton runs
    # the kernel even on fake tensors, so only an explicit fake lets torch.library.opcheck run there.
    return torch.empty_like(x, memory_format=torch.contiguous_format)


class NEFTuneFunction(torch.autograd.Function):
    """y = x + noise with an identity backward; nothing is saved for backward."""

    @staticmethod
    def forward(ctx, embeds, seed, scale, row_scale):
        if torch.compiler.is_compiling():
            return torch.ops.kernelwright.neftune_fwd(embeds, seed, scale, row_scale)
        # Eager skips the custom-op dispatcher: it is pure host overhead here.
        return neftune_fwd(embeds, seed, scale, row_scale)

    @staticmethod
    def backward(ctx, grad_out):
        return grad_out, None, None, None


def _check_args(embeds, alpha, attention_mask, generator, position_ids, training, name):
    if not isinstance(embeds, torch.Tensor) or embeds.dim() != 3 or embeds.dtype not in _DTYPES:
        got = (
            f"shape {tuple(embeds.shape)} {embeds.dtype}" if isinstance(embeds, torch.Tensor) else type(embeds).__name__
        )
        raise ValueError(f"{name}: embeds must be a (batch, seq, hidden) float32/bfloat16/float16 tensor, got {got}")
    if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real) or not math.isfinite(alpha) or alpha < 0:
        raise ValueError(f"{name}: alpha must be a finite number >= 0 (0 disables the noise), got {alpha!r}")
    bt = tuple(embeds.shape[:2])
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor) or tuple(attention_mask.shape) != bt:
            got = (
                tuple(attention_mask.shape)
                if isinstance(attention_mask, torch.Tensor)
                else type(attention_mask).__name__
            )
            raise ValueError(f"{name}: attention_mask must be a (batch, seq) = {bt} tensor, got {got}")
        if attention_mask.device != embeds.device:
            raise ValueError(f"{name}: attention_mask is on {attention_mask.device}, embeds on {embeds.device}")
    if position_ids is not None:
        ok = isinstance(position_ids, torch.Tensor) and position_ids.dim() == 2 and position_ids.shape[1] == bt[1]
        if not ok or position_ids.shape[0] not in (1, bt[0]) or position_ids.dtype.is_floating_point:
            got = (
                f"{tuple(position_ids.shape)} {position_ids.dtype}"
                if isinstance(position_ids, torch.Tensor)
                else type(position_ids).__name__
            )
            raise ValueError(f"{name}: position_ids must be an integer (batch or 1, seq) = {bt} tensor, got {got}")
        if position_ids.device != embeds.device:
            raise ValueError(f"{name}: position_ids is on {position_ids.device}, embeds on {embeds.device}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(f"{name}: generator must be a torch.Generator or None, got {type(generator).__name__}")
    if not isinstance(training, bool):
        raise ValueError(f"{name}: training must be True or False, got {training!r}")


def _row_scale(shape, alpha: float, attention_mask, position_ids) -> torch.Tensor | None:
    """Per-token alpha / sqrt(L * d), 0 on padding, as a (B*T,) fp32 tensor; None when L = T for all.

    Only device ops over (B, T): no host sync, traceable by torch.compile.
    """
    if attention_mask is None and position_ids is None:
        return None
    B, T, d = shape
    device = attention_mask.device if attention_mask is not None else position_ids.device
    real = attention_mask != 0 if attention_mask is not None else None  # (B, T) bool
    weight = real.float() if real is not None else torch.ones((B, T), device=device)  # (B, T)
    if position_ids is None:
        length = weight.sum(dim=1, keepdim=True).expand(B, T)  # (B, T)
    else:
        pos = position_ids.expand(B, T)  # (B, T)
        first = torch.ones((B, 1), dtype=torch.bool, device=device)  # (B, 1)
        starts = torch.cat([first, pos[:, 1:] != pos[:, :-1] + 1], dim=1)  # (B, T)
        # Global document id per token, < B*T: per-row running count of starts, offset by the row.
        doc = torch.cumsum(starts, dim=1) - 1 + torch.arange(B, device=device)[:, None] * T  # (B, T) int64
        counts = torch.zeros(B * T, device=device).scatter_add(0, doc.reshape(-1), weight.reshape(-1))  # (B*T,)
        length = counts[doc]  # (B, T)
    scale = alpha * torch.rsqrt(length.clamp_min(1.0) * d)  # (B, T); padding's clamp only avoids inf
    if real is not None:
        scale = torch.where(real, scale, torch.zeros_like(scale))
    return scale.reshape(-1)  # (B*T,)


def _draw_seed(generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    # Drawn where the generator lives: no host sync for a generator on the embeddings' device.
    where = generator.device if generator is not None else device
    seed = torch.randint(0, 2**62, (1,), dtype=torch.int64, device=where, generator=generator)  # (1,)
    return seed.to(device, non_blocking=True)


def neftune_noise(embeds, alpha, attention_mask=None, generator=None, position_ids=None, training=True):
    """embeds + U(-1, 1) * alpha / sqrt(L * d) in training, embeds unchanged otherwise (see module docstring).

    embeds: (B, T, d) fp32/bf16/fp16; alpha: number >= 0; attention_mask: (B, T), nonzero = real token;
    generator: torch.Generator or None (the device's default generator); position_ids: (B, T) or (1, T)
    integer positions restarting for each packed document; training: False disables the noise.
    Output dtype = embeds dtype; the gradient w.r.t. embeds is the identity.
    """
    _check_args(embeds, alpha, attention_mask, generator, position_ids, training, "neftune_noise")
    if not training or alpha == 0 or embeds.numel() == 0:
        return embeds
    if not use_triton(embeds, attention_mask, position_ids):
        return neftune_noise_ref(embeds, alpha, attention_mask, generator, position_ids, training)
    B, T, d = embeds.shape
    seed = _draw_seed(generator, embeds.device)  # (1,) int64
    row_scale = _row_scale(embeds.shape, float(alpha), attention_mask, position_ids)  # (B*T,) or None
    return NEFTuneFunction.apply(embeds, seed, float(alpha) / math.sqrt(T * d), row_scale)


def neftune_noise_ref(embeds, alpha, attention_mask=None, generator=None, position_ids=None, training=True):
    """Plain-PyTorch NEFTune with the same semantics as `neftune_noise`, noise from `torch.rand` (fp32)."""
    _check_args(embeds, alpha, attention_mask, generator, position_ids, training, "neftune_noise_ref")
    if not training or alpha == 0 or embeds.numel() == 0:
        return embeds
    B, T, d = embeds.shape
    row_scale = _row_scale(embeds.shape, float(alpha), attention_mask, position_ids)  # (B*T,) or None
    mag = float(alpha) / math.sqrt(T * d) if row_scale is None else row_scale.view(B, T, 1)
    where = generator.device if generator is not None else embeds.device
    u = torch.rand(embeds.shape, generator=generator, device=where).to(embeds.device)  # (B, T, d) fp32 in [0, 1)
    return (embeds.float() + (2.0 * u - 1.0) * mag).to(embeds.dtype)
